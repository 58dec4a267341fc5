"""What `sgraf serve` computes, as plain functions over an opened gallery index.

`SearchService` holds the index (models loaded once), where the gallery's pictures and region
features are, and the limits of a request. Its methods check a request's arguments (raising
`InputError` with a message naming the problem, which the HTTP layer answers with 400), do the
work with `sgraf.search` and `sgraf.explain`, and return JSON-ready dicts. Nothing here knows
about HTTP; the routes in `sgraf.serve.app` only translate.

Where pictures and features come from: the index records the data folder and split it was
built from (`manifest.json`, `source`); the pictures are `{data}/images/{split}/{id:05d}.png`
(or `.jpg`), as the embedded benchmark writes them, and the region features (for
explanations) `{data}/{split}_ims.npy`. `data_dir` overrides the recorded folder when it moved.
"""

from __future__ import annotations

import io
import logging
import math
import os
import re
import threading
from pathlib import Path, PurePosixPath
from typing import Any, Sequence

import numpy as np

from sgraf.api import MAX_TEXT_CHARS, MAX_TEXT_WORDS
from sgraf.data.arrays import file_row
from sgraf.data.layout import PICTURE_SUFFIXES, picture_path, pictures_fingerprint, pictures_folder
from sgraf.errors import InputError
from sgraf.search import GalleryIndex, Hit, sha256_file, shortlist_for

logger = logging.getLogger(__name__)

# an absolute path inside a message (after a space, quote, parenthesis or the start): POSIX, or
# Windows' (a drive, a UNC share)
_ABSOLUTE_PATH = re.compile(r"(?:^|(?<=[\s'\"(=]))(?:/|[A-Za-z]:[\\/]|\\\\)[^\s'\"():,]*")


def _relative(path: Path, start: Path) -> str:
    """`path` relative to `start`; on Windows, on another drive than it, its file name (no way there)."""
    try:
        return os.path.relpath(path, start)
    except ValueError:
        return path.name


__all__ = ["SearchService", "NotFound", "Stale", "MAX_TEXT_CHARS", "MAX_TEXT_WORDS", "MAX_TOP_K", "PICTURE_SUFFIXES"]

MAX_TOP_K = 1000
PICTURE_ROUTE = "/images/"


class Stale(RuntimeError):
    """The data folder's files changed since the server started (HTTP 503): its pictures and
    features may no longer be the gallery's; a restart (after `sgraf index`) serves them."""


class NotFound(LookupError):
    """What a request asks for is not there (HTTP 404): a picture path that does not name a file
    inside the gallery's picture folder, or explanations without the gallery's features."""


class _InBackground:
    """`work()` run on a daemon thread from now on; `result()` waits for it (a server starts
    without waiting for what only a later check needs)."""

    def __init__(self, work: Any) -> None:
        self._result: Any = None
        self._thread = threading.Thread(target=self._run, args=(work,), name="sgraf-data-digests", daemon=True)
        self._thread.start()

    def _run(self, work: Any) -> None:
        self._result = work()

    def result(self) -> Any:
        self._thread.join()
        return self._result


class SearchService:
    """An opened gallery index with its pictures and features, ready to answer requests.

    Args:
        index: from `sgraf.search.open_index`.
        shortlist: first-stage candidates re-ranked per query (at least `top_k` are kept); 0
            scores the whole gallery (as `sgraf search --shortlist 0`).
        data_dir: the precomp folder the index was built from; default: the one its manifest
            records. Pictures and explanations are off when it (or its files) is missing.
    """

    def __init__(self, index: GalleryIndex, shortlist: int = 100,
                 data_dir: str | os.PathLike[str] | None = None) -> None:
        if isinstance(shortlist, bool) or not isinstance(shortlist, int) or shortlist < 0:
            raise InputError(f"--shortlist must be 0 (the whole gallery) or a positive integer, got {shortlist!r}")
        self.index = index
        self.matcher = index.matcher
        self.shortlist = shortlist
        source = index.manifest.get("source") or {}
        self.split = source.get("split")
        recorded = source.get("data_dir")
        self.data_dir = Path(data_dir) if data_dir is not None else (Path(recorded) if recorded else None)
        if data_dir is not None and not self.data_dir.is_dir():
            raise InputError(f"--data {data_dir}: no such folder")
        self._index_root = Path(index.folder).resolve()
        self._public_roots = self._roots()
        self.picture_dir = self._find_picture_dir()
        self._check_same_pictures()
        self.features, self.why_no_explain = self._open_features()
        self._data_files = self._data_states()
        self._data_digests = _InBackground(self._digests)     # read whole: seconds for MSCOCO's 5K features
        self._changed_states: dict[str, tuple[int, ...]] = {}   # touched files' states found changed by a hash
        self._judging = threading.Lock()      # one hash of a touched file at a time; the others wait for its verdict

    @classmethod
    def open(cls, index: str | os.PathLike[str], checkpoints: Sequence[str | os.PathLike[str]] | None = None,
             vocab: str | None = None, device: str = "cpu", precision: str = "fp32", shortlist: int = 100,
             verify: bool = True, first_stage: str = "auto",
             data_dir: str | os.PathLike[str] | None = None, memory_map: bool = False) -> "SearchService":
        """Open an index as `sgraf search` does (same checks, same messages), then the service.

        Args:
            index: the index folder; checkpoints / vocab / verify / first_stage as `open_index`.
            device, precision: where and how the models compute ('fp32', 'bf16', 'fp16').
            memory_map: map the index's arrays instead of reading them into memory (a gallery
                larger than the memory; files copied over the index while serving then change
                answers, and one cut short ends the server with SIGBUS).
        """
        from sgraf.api import Matcher
        from sgraf.search import check_identity, open_index

        opened = open_index(index, checkpoints=checkpoints, vocab=vocab, verify=verify, first_stage=first_stage,
                            in_memory=not memory_map)   # files copied over a held index change no answer
        loaded = opened.matcher
        if str(device) != "cpu" or precision != "fp32":
            opened.matcher = Matcher(loaded.models, vocab=loaded.vocab, sources=loaded.sources, device=device,
                                     precision=precision, batch_size=loaded.batch_size)
            check_identity(opened.manifest, opened.matcher, opened.folder)
        return cls(opened, shortlist=shortlist, data_dir=data_dir)

    # ----------------------------------------------------------------------------- start-up
    def _roots(self) -> list[tuple[str, str]]:
        """(absolute folder as it may appear in a message, how answers show it), longest first."""
        folders = {Path(self.index.folder), self._index_root}
        if self.data_dir is not None:
            folders |= {self.data_dir, self.data_dir.resolve()}
        for source in self.matcher.sources:
            if source is not None:
                folders |= {Path(source).parent, Path(source).resolve().parent}
        roots = {}
        for folder in folders:
            absolute = str(folder.absolute())
            if absolute != "/":
                roots[absolute] = _relative(folder.resolve(), self._index_root)
        return sorted(roots.items(), key=lambda item: -len(item[0]))

    def _find_picture_dir(self) -> Path | None:
        if self.data_dir is None or self.split is None:
            return None
        folder = pictures_folder(self.data_dir, self.split)
        return folder.resolve() if folder.is_dir() else None

    def _data_states(self) -> dict[str, tuple[int, ...] | None]:
        """The states (`sgraf.search.file_states`) of the data files the server reads while it
        runs, or that a new data set in its place replaces: the split's features and captions (a
        writer of the split replaces both; files added to the picture folder are no change), and
        its region boxes and picture sizes where it has them (explanations draw them)."""
        from sgraf.data.precomp import BOX_FILES
        from sgraf.search import file_states

        if self.data_dir is None or self.split is None:
            return {}
        extras = [f"{self.split}{suffix}" for suffix in BOX_FILES]
        extras = [name for name in extras if (self.data_dir / name).is_file()]
        return file_states(self.data_dir, [f"{self.split}_ims.npy", f"{self.split}_caps.txt", *extras])

    def _digests(self) -> dict[str, str]:
        """The sha256 of each data file the server watches (`_data_states`), read whole (a features
        file edited in place keeps its size and, often, its first and last MiB, which the data
        fingerprint hashes), or {} where not readable."""
        if not self._data_files or None in self._data_files.values():
            return {}
        try:
            return {name: sha256_file(self.data_dir / name) for name in self._data_files}
        except OSError:
            return {}

    def data_changed(self) -> list[str]:
        """The data files (relative to the data folder) that changed since the server started. A
        file only touched (the same file and size, a new time: `touch`, a copy keeping the bytes)
        is read again once, and is no change if its bytes are the same (it had stopped pictures
        and explanations until a restart). A touched file found changed keeps that verdict while
        its state stays: it had been hashed again by every request (a 221 MB features file made
        each health check and picture 0.26 s, one after another)."""
        from sgraf.search import changed_since, file_states

        if not self._data_files:
            return []
        changed = changed_since(self.data_dir, self._data_files)
        started = self._data_digests.result() if changed else None
        if started:
            now = file_states(self.data_dir, changed)
            touched = [name for name in changed if now[name] is not None and self._data_files[name] is not None
                       and now[name][:3] == self._data_files[name][:3]]
            with self._judging:
                for name in touched:
                    if self._data_files[name] == now[name]:     # judged the same bytes while this one waited
                        changed.remove(name)
                        continue
                    if self._changed_states.get(name) == now[name]:
                        continue                # judged changed in this state already
                    try:
                        same = sha256_file(self.data_dir / name) == started.get(name)
                    except OSError:
                        same = False
                    if same:
                        self._data_files = {**self._data_files, name: now[name]}
                        changed.remove(name)
                    else:
                        self._changed_states = {**self._changed_states, name: now[name]}
        return changed

    def _check_data_unchanged(self) -> None:
        changed = self.data_changed()
        if changed:
            raise Stale(f"the data folder's {', '.join(changed)} changed since the server started: its pictures and "
                        "features may no longer be the gallery's; rebuild the index if the data changed, and "
                        "restart sgraf serve")

    def _open_features(self) -> tuple[Any | None, str | None]:
        """The split's region features (memory-mapped) for explanations, or why there are none."""
        from sgraf.data.precomp import PrecompSplit

        if self.data_dir is None or self.split is None:
            return None, "the index does not record the data folder it was built from; start with --data DIR"
        try:
            split = PrecompSplit(self.data_dir, self.split)
        except (FileNotFoundError, InputError) as exc:
            message = f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) and exc.filename else str(exc)
            logger.warning("explanations are off: %s", message)
            return None, self.public(f"explanations need the gallery's region features: {message} "
                                     "(start with --data DIR)")
        if split.n_images != self.index.n_images:
            raise InputError(f"{self.data_dir} [{self.split}] holds {split.n_images} images but the index "
                             f"{self.index.folder} holds {self.index.n_images}: not the data it was built from")
        self._check_same_data()
        config = self.matcher.models[0].config
        if (split.num_regions, split.feature_dim) != (config.num_regions, config.img_dim):
            raise InputError(f"{self.data_dir} [{self.split}] has {split.num_regions} x {split.feature_dim} "
                             f"regions, the model expects {config.num_regions} x {config.img_dim}")
        return split.images, None

    def _check_same_pictures(self) -> None:
        """Refuse a picture folder other than the one the index was built with: the names and sizes
        of the gallery's pictures (`layout.pictures_fingerprint`, recorded by `build_index`; indexes
        without it are not checked)."""
        recorded = (self.index.manifest.get("source") or {}).get("pictures")
        if self.picture_dir is None or not isinstance(recorded, dict) or not recorded.get("count"):
            return        # an index built before its pictures were there records none to hold
        found = pictures_fingerprint(self.data_dir, self.split, self.index.n_images)
        if found == recorded:
            return
        folder = self.picture_dir
        counts = (f"{recorded.get('count')} pictures then, {found['count']} now" if found and
                  found["count"] != recorded.get("count") else "other sizes or names")
        raise InputError(f"the pictures of {folder} are not those the index {self.index.folder} was built with "
                         f"({counts}): give the data it was built from, or rebuild the index with sgraf index")

    def _check_same_data(self) -> None:
        """Refuse data other than what the index was built from: its split's fingerprint
        (`precomp.data_fingerprint`, recorded by `build_index`) must match. The same files in
        another folder (the data moved) are accepted; indexes without a fingerprint are not
        checked. The region boxes and picture sizes, which explanations draw, count where the
        index recorded them (indexes built before they were recorded are checked without)."""
        from sgraf.data.precomp import BOX_FILES, comparable_fingerprint, data_fingerprint, fingerprint_differences

        source = self.index.manifest.get("source") or {}
        recorded = source.get("data_fingerprint")
        if not isinstance(recorded, dict):
            return
        found = comparable_fingerprint(data_fingerprint(self.data_dir, splits=(self.split,), extras=BOX_FILES),
                                       recorded)
        if found == recorded:
            return
        differ = ", ".join(fingerprint_differences(found, recorded))
        given, built_from = self.data_dir, source.get("data_dir")
        if built_from is not None and Path(built_from).resolve() == given.resolve():
            raise InputError(f"the files of {given} changed since the index {self.index.folder} was built from them "
                             f"({differ} differ); rebuild the index with sgraf index")
        raise InputError(f"--data {given} is not the data the index {self.index.folder} was built from "
                         f"({built_from}): {differ} differ; give that data (or a copy of it)")

    def warm_up(self) -> None:
        """Runs once what a server's first requests would otherwise do while others wait: the
        tokenizer's first call (which runs on the event loop, in `check_text`), a text search
        and an image search (the first stage's structures, the kernels' first calls)."""
        # a few words of the vocabulary (a gallery caption may be longer than a query may be)
        words = [word for word in self.matcher.vocab.word2idx if not word.startswith("<")][:3]
        if words:
            text = " ".join(words)
            self.matcher.tokenize(text, allow_unknown=True)
            self.index.search_texts([text], top_k=1, shortlist=self.shortlist_for(1), allow_unknown=True)
        if self.index.n_images:
            self.index.search_image(image_id=0, top_k=1, shortlist=self.shortlist_for(1))

    # ----------------------------------------------------------------------------- checks
    def check_text(self, text: Any, allow_unknown: bool = False) -> str:
        """A query text, refused (naming why) when empty, too long (`sgraf.api.MAX_TEXT_CHARS`,
        `MAX_TEXT_WORDS`: the limit `sgraf search` has too) or with unknown words."""
        if not isinstance(text, str) or not text.strip():
            raise InputError("text is empty: give at least one word")
        self.matcher.tokenize(text, allow_unknown=allow_unknown)    # the length limit; names unknown words
        return text

    @staticmethod
    def check_top_k(top_k: Any) -> int:
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or not 1 <= top_k <= MAX_TOP_K:
            raise InputError(f"top_k must be an integer in 1..{MAX_TOP_K}, got {top_k!r}")
        return int(top_k)

    def check_image_id(self, image_id: Any) -> int:
        n = self.index.n_images
        if isinstance(image_id, bool) or not isinstance(image_id, (int, np.integer)) or not 0 <= image_id < n:
            raise InputError(f"image_id {image_id!r} is out of range: the gallery holds images 0..{n - 1}")
        return int(image_id)

    @staticmethod
    def check_query(text: str | None, image_id: int | None) -> str:
        """'text' or 'image': exactly one of the two must be given."""
        if text is None and image_id is None:
            raise InputError("give either text=... (text -> images) or image_id=N (image -> captions)")
        if text is not None and image_id is not None:
            raise InputError("give either text or image_id, not both")
        return "text" if text is not None else "image"

    def shortlist_for(self, top_k: int) -> int | None:
        """The first-stage shortlist of a query that asks for `top_k` results (None: the whole
        gallery, for `shortlist=0`), as `sgraf search` takes it (`sgraf.search.shortlist_for`)."""
        return shortlist_for(self.shortlist, top_k)

    # ----------------------------------------------------------------------------- pictures
    def picture_url(self, image_id: int) -> str | None:
        """The URL path of image `image_id`'s picture, or None when the gallery has none."""
        path = None if self.picture_dir is None else picture_path(self.picture_dir, image_id)
        return None if path is None else PICTURE_ROUTE + path.name

    def picture_file(self, relative: str) -> Path:
        """The file behind `/images/<relative>`, only inside the picture folder.

        Raises:
            NotFound: no picture folder; a path that is absolute, climbs out (`..`) or
                leads out through a link once resolved; not a picture file.
        """
        if self.picture_dir is None:
            raise NotFound("this gallery has no pictures")
        self._check_data_unchanged()
        shown = relative if len(relative) <= 80 else relative[:77] + "..."
        candidate = Path(relative)
        # one spelling of each picture: `a.png/`, `./a.png` or `a//b.png` are not its name
        if not relative or candidate.is_absolute() or ".." in candidate.parts or "\\" in relative \
                or "\x00" in relative or PurePosixPath(relative).as_posix() != relative:
            raise NotFound(f"no picture {shown!r}")
        try:   # a name too long for the file system, a link loop, a folder we may not read: not there
            path = (self.picture_dir / candidate).resolve(strict=True)
            found = path.is_relative_to(self.picture_dir) and path.suffix.lower() in PICTURE_SUFFIXES \
                and path.is_file()
        except (OSError, RuntimeError):
            found = False
        if not found:
            raise NotFound(f"no picture {shown!r}")
        return path

    def public(self, message: str, keep: Sequence[str] = ()) -> str:
        """`message` as an answer may show it: the server's absolute paths made relative to the
        index folder (`../data/test_ims.npy`), any other absolute path cut to its file name. The
        client's own words (`keep`: its parameters' values, each word of them and as the
        vocabulary lower-cases it) stay as sent where they stand whole (between spaces, quotes or
        punctuation): a path in a query had been rewritten, naming words the user never typed,
        and its answer told whether the path was the server's. A word that is only the start of a
        longer path (a guess `/srv` of the server's `/srv/data/...`) is not kept: that path is
        still hidden."""
        # each also as repr() writes it inside quotes (a backslash doubled), as messages quote text
        pieces = sorted({form for value in keep for word in [value, *value.split()]
                         for piece in (word, word.lower()) for form in (piece, repr(piece)[1:-1])
                         if len(form) > 1 and "\x00" not in form}, key=len, reverse=True)
        masked: list[str] = []

        def mask(match: re.Match[str]) -> str:
            masked.append(match.group(0))
            return f"\x00{len(masked) - 1}\x00"

        for piece in pieces:
            message = re.sub(rf"(?<![^\s'\"(=,:]){re.escape(piece)}(?![^\s'\"):,.;])", mask, message)
        for root, shown in self._public_roots:
            message = message.replace(root, shown)
        message = _ABSOLUTE_PATH.sub(lambda match: re.split(r"[\\/]", match.group(0).rstrip("\\/"))[-1] or "/",
                                     message)
        for number, piece in reversed(list(enumerate(masked))):
            message = message.replace(f"\x00{number}\x00", piece)
        return message

    def public_path(self, path: str | os.PathLike[str] | None) -> str | None:
        """A path as an answer shows it: relative to the index folder."""
        if path is None:
            return None
        return _relative(Path(path).resolve(), self._index_root)

    # ----------------------------------------------------------------------------- searches
    def search_texts(self, texts: Sequence[str], top_k: int, shortlist: int) -> list[list[dict[str, Any]]]:
        """Text -> images for several checked texts at once (one encoding and first-stage pass).

        Args:
            texts: texts that passed `check_text` (unknown words then map to `<unk>` only for
                the queries that allowed it).
            top_k: results per text.
            shortlist: the first-stage shortlist (`shortlist_for(top_k)` of each request).
        """
        hits = self.index.search_texts(list(texts), top_k=top_k, shortlist=shortlist, allow_unknown=True)
        return [[self._image_result(hit) for hit in per_text] for per_text in hits]

    def search_text(self, text: str, top_k: int = 10, allow_unknown: bool = False) -> dict[str, Any]:
        """`GET /api/search?text=...`: the best images, best first."""
        text = self.check_text(text, allow_unknown)
        top_k = self.check_top_k(top_k)
        return {"query": text, "results": self.search_texts([text], top_k, self.shortlist_for(top_k))[0]}

    def search_image(self, image_id: int, top_k: int = 10) -> dict[str, Any]:
        """`GET /api/search?image_id=N`: the best captions of the gallery, best first."""
        image_id = self.check_image_id(image_id)
        top_k = self.check_top_k(top_k)
        hits = self.index.search_image(image_id=image_id, top_k=top_k, shortlist=self.shortlist_for(top_k))
        return {"query": {"image_id": image_id, "image": self.picture_url(image_id),
                          "name": self.index.name_of(image_id)},
                "results": [{"id": hit.id, "score": _finite(hit.score), "caption": hit.text,
                             "explainable": self._explainable(hit.id, hit.text)} for hit in hits]}

    def _explainable(self, caption_id: int, text: str | None) -> bool:
        """Whether a gallery caption is within the text limit an explanation takes (its tokens
        as the index recorded them, `<start>` and `<end>` left out)."""
        return text is not None and len(text) <= MAX_TEXT_CHARS \
            and int(self.index.caption_lengths[caption_id]) - 2 <= MAX_TEXT_WORDS

    def _image_result(self, hit: Hit) -> dict[str, Any]:
        return {"id": hit.id, "score": _finite(hit.score), "image": self.picture_url(hit.id), "name": hit.name}

    # ----------------------------------------------------------------------------- explanations
    def _explanation(self, image_id: int, text: str, allow_unknown: bool) -> Any:
        from sgraf.explain import explain_pair

        image_id = self.check_image_id(image_id)
        text = self.check_text(text, allow_unknown)
        if self.features is None:
            raise NotFound(self.why_no_explain)
        self._check_data_unchanged()
        try:
            features = file_row(self.features, image_id)     # a read, not the map: a file cut short is no SIGBUS
        except OSError as error:
            self._check_data_unchanged()     # a writer truncated it since: named as changed
            raise Stale(f"the data folder's {self.split}_ims.npy cannot be read now ({error.strerror}): restart "
                        "sgraf serve once the data is whole") from None
        boxes = None if self.index.image_boxes is None else np.asarray(self.index.image_boxes[image_id])
        explanation = explain_pair(self.matcher, features, text,
                                   allow_unknown=allow_unknown, boxes=boxes)   # the boxes the index encoded with
        explanation.image_id = image_id
        explanation.image_name = self.index.name_of(image_id)
        return explanation

    def _layout(self, image_id: int) -> Any:
        from sgraf.explain import region_layout

        return region_layout(self.data_dir, self.split, image_id, self.matcher.models[0].config.num_regions,
                             skip_unreadable=True)      # the gallery's fault, not the request's

    def explain(self, image_id: int, text: str, allow_unknown: bool = False) -> dict[str, Any]:
        """`GET /api/explain`: what `sgraf explain` computes, as JSON.

        Returns:
            `image_id`, `text`, `image` (picture URL or None), `scores` (per model and the
            ensemble), `nodes` (per similarity node: `label`, SAF's `saf_beta`, SGR's
            `sgr_alignment`, None without that head), `attention` (`model`, `tokens`, and per
            token `weights` over the K regions; None for models without text-to-image local
            alignments), `regions` (`kind` 'grid' with `rows`/`cols`, row-major over the
            picture, or 'boxes'; `boxes`: each region's [x0, y0, x1, y1] in the picture's
            pixels (a grid's cells too), and its `width`/`height`, when there is a picture),
            `unknown` (positions in `tokens` of the words read as `<unk>`).
        """
        explanation = self._explanation(image_id, text, allow_unknown)
        layout = self._layout(explanation.image_id)
        nodes = []
        for p, label in enumerate(explanation.node_labels):
            nodes.append({
                "label": label,
                "saf_beta": None if explanation.saf_beta is None else _finite(explanation.saf_beta[p]),
                "sgr_alignment": None if explanation.sgr_alignment is None else _finite(explanation.sgr_alignment[p]),
            })
        attention = None
        if explanation.attention is not None:
            attention = {"model": explanation.attention_model, "tokens": explanation.tokens,
                         "weights": [[_finite(w) for w in row] for row in explanation.attention]}
        regions: dict[str, Any] = {"kind": layout.kind, "source": layout.source}
        if layout.image is not None:
            regions.update(width=layout.picture_size[0], height=layout.picture_size[1])
        if layout.kind == "grid":
            rows, cols = layout.grid
            regions.update(rows=rows, cols=cols)
            if layout.image is not None:   # each grid cell as a box in the picture's pixels, row-major
                height, width = regions["height"], regions["width"]
                regions["boxes"] = [[c * width / cols, r * height / rows, (c + 1) * width / cols,
                                     (r + 1) * height / rows] for r in range(rows) for c in range(cols)]
        else:
            regions["boxes"] = [[_finite(v) for v in box] for box in layout.boxes]
        return {"image_id": explanation.image_id, "text": explanation.text,
                "image": self.picture_url(explanation.image_id),
                "scores": {k: _finite(v) for k, v in explanation.scores.items()},
                "nodes": nodes, "attention": attention, "regions": regions,
                "unknown": [i for i, token in enumerate(explanation.tokens)
                            if not (token.startswith("<") and token.endswith(">")) and token not in self.matcher.vocab]}

    def explain_png(self, image_id: int, text: str, allow_unknown: bool = False) -> bytes:
        """`GET /api/explain.png`: the picture `sgraf explain --out` draws, as PNG bytes."""
        from sgraf.explain import render_explanation

        explanation = self._explanation(image_id, text, allow_unknown)
        layout = self._layout(explanation.image_id)
        return render_explanation(explanation, layout, io.BytesIO()).getvalue()   # no file written

    # ----------------------------------------------------------------------------- health
    def health(self) -> dict[str, Any]:
        """`GET /api/health`: the gallery, the models and how they run."""
        import torch

        changed = [f"index {name}" for name in self.index.changed_files()]
        changed += [f"data {name}" for name in self.data_changed()]
        return {
            "status": "stale" if changed else "ok",
            "changed": changed,
            "index": self.index.folder.name if self.index.folder.name else ".",
            "gallery": {"images": self.index.n_images, "captions": self.index.n_captions,
                        "caps_per_image": self.index.caps_per_image},
            "models": [{"module": identity["config"].get("module"),
                        "embed_size": identity["config"].get("embed_size"),
                        "weights_sha256": identity["weights_sha256"],
                        "source": self.public_path(identity.get("source"))}
                       for identity in self.matcher.identities],
            "device": str(self.matcher.device),
            "precision": self.matcher.precision,
            "torch_threads": torch.get_num_threads(),
            "shortlist": self.shortlist,
            "first_stage": self.index.first_stage,
            "pictures": self.picture_dir is not None,
            "explain": self.features is not None,
            "limits": {"text_chars": MAX_TEXT_CHARS, "text_words": MAX_TEXT_WORDS, "top_k": MAX_TOP_K},
        }


def _finite(value: Any) -> float | None:
    """A float for JSON (which has no NaN or infinity: those become null)."""
    value = float(value)
    return value if math.isfinite(value) else None
