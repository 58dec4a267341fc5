"""Captions' token ids kept on disk, so that scoring the same captions again skips the tokenizer.

Tokenising a split is host work that a GPU does not speed up: importing nltk (about 1.8 s where
SciPy is installed, which nltk imports) and its Treebank rules (about 0.25 ms a caption) took
3.3 s of a Flickr30K-size `sgraf evaluate` on a 2-core AMD EPYC (5,000 captions), against about
1.6 s of scoring on an H200. The ids depend only on the captions, the vocabulary and the
tokenizer, so they are stored under a key that hashes all three:
`<cache>/tokens/<sha256>.npz` (`sgraf.user_cache`), a few bytes per token, with a sha256 of its
contents (as the kept tokens below): a file that does not read back as valid ids for these
captions, or whose contents no longer match their digest (edited, damaged), is tokenised again
and rewritten; a cache that cannot
be written costs nothing but the time. `SGRAF_TOKEN_CACHE=off` turns it off.

The first evaluation of a split still tokenises. `prefetch(captions_file)` does that in another
process while the command imports PyTorch and loads its checkpoint (about 3 s at Flickr30K size
on a 2-core EPYC): the process keeps the captions' tokens, which need no vocabulary, under a key
of the captions and the tokenizer (`<cache>/tokens/words-<sha256>.json`), and `token_ids(...,
prefetched=)` turns them into ids when it finds no ids kept. `python -m sgraf.data.token_cache
CAPTIONS_FILE` is that process.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import numpy as np

from sgraf.atomic_write import atomic_path
from sgraf.data.arrays import DAMAGED_NPY
from sgraf.data.vocab import TOKENIZER_REVISION, Vocabulary, tokenize
from sgraf.devices import available_cores
from sgraf.errors import InputError
from sgraf.user_cache import cache_dir, say_unwritable, switched_on

logger = logging.getLogger(__name__)


def enabled() -> bool:
    """False when SGRAF_TOKEN_CACHE is off/0/false/no."""
    return switched_on("SGRAF_TOKEN_CACHE")


# How long the command waits for the tokenising process: nltk's import (2 s here) and its rules
# (0.25 ms a caption on one EPYC core), ten times over.
PREFETCH_WAIT_S = 30.0
PREFETCH_WAIT_PER_CAPTION_S = 0.0025


class Prefetch:
    """The tokens of a caption file, being computed by another process (`prefetch`)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process

    def words(self, captions: list[str]) -> list[list[str]] | None:
        """Wait for the process; the tokens it kept for exactly these captions, or None (it
        failed, read other captions because the file changed since, or took ten times longer
        than tokenising them here would: it is then stopped)."""
        try:
            code = self.process.wait(timeout=PREFETCH_WAIT_S + PREFETCH_WAIT_PER_CAPTION_S * len(captions))
        except subprocess.TimeoutExpired:
            logger.warning("the process tokenising the captions did not finish; tokenising them here")
            self.cancel()
            return None
        if code != 0:
            logger.debug("the tokenising process ended with %s", code)
            return None
        return _read_words(words_path(captions), len(captions))

    def cancel(self) -> None:
        """Stop the process if it still runs (the ids were kept already)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def prefetch(captions_file: str | os.PathLike[str]) -> Prefetch | None:
    """Start tokenising a caption file in another process; None when the cache is off or the
    process cannot start (the captions are then tokenised when needed, as without it)."""
    if not enabled():
        return None
    try:
        process = subprocess.Popen([sys.executable, "-m", "sgraf.data.token_cache", os.fspath(captions_file)],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError as error:
        logger.debug("could not start tokenising %s in another process: %s", captions_file, error)
        return None
    return Prefetch(process)


def token_ids(captions: Sequence[str], vocab: Vocabulary, prefetched: Prefetch | None = None) -> list[list[int]]:
    """`[vocab.encode(c) for c in captions]`, read from the cache when these captions were
    encoded with this vocabulary and tokenizer before (see the module); else from the tokens
    `prefetched` kept, when given."""
    captions = list(captions)
    if not enabled() or not captions:
        return [vocab.encode(caption) for caption in captions]
    path = cache_dir() / "tokens" / f"{_key(captions, vocab)}.npz"
    cached = _read(path, len(captions), len(vocab), vocab.start_id, vocab.end_id)
    if cached is not None:
        if prefetched is not None:
            prefetched.cancel()
        return cached
    words = prefetched.words(captions) if prefetched is not None else None
    if words is None:
        ids = [vocab.encode(caption) for caption in captions]
    else:
        ids = [[vocab.start_id] + [vocab(word) for word in row] + [vocab.end_id] for row in words]
    try:
        lengths = np.array([len(row) for row in ids], dtype=np.int32)
        flat = np.fromiter((i for row in ids for i in row), dtype=np.int32)
        with atomic_path(path) as temporary, open(temporary, "wb") as handle:
            np.savez(handle, lengths=lengths, ids=flat, sha256=_ids_digest(lengths, flat))
    except (InputError, OSError) as error:      # a read-only or full cache: the ids still hold
        logger.debug("could not keep the token ids in %s: %s", path, error)
        say_unwritable(cache_dir(), error)
    return ids


def words_path(captions: list[str]) -> Path:
    """Where the tokens of these captions are kept (`prefetch`)."""
    digest = hashlib.sha256(_tokenizer().encode())
    digest.update(b"\0words\0")
    digest.update(json.dumps(captions, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    return cache_dir() / "tokens" / f"words-{digest.hexdigest()}.json"


def _words_digest(words: list[list[str]]) -> str:
    return hashlib.sha256(json.dumps(words, ensure_ascii=False).encode("utf-8", "surrogatepass")).hexdigest()


def _ids_digest(lengths: np.ndarray, ids: np.ndarray) -> np.ndarray:
    digest = hashlib.sha256(lengths.astype("<i4").tobytes())
    digest.update(ids.astype("<i4").tobytes())
    return np.frombuffer(digest.digest(), dtype=np.uint8)


def _read_words(path: Path, n_captions: int) -> list[list[str]] | None:
    """The tokens kept at `path` if they are `n_captions` lists of strings whose digest matches
    the one kept beside them, else None."""
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        logger.debug("no usable tokens in %s: %s", path, error)
        return None
    words = kept.get("words") if isinstance(kept, dict) else None
    if (not isinstance(words, list) or len(words) != n_captions
            or not all(isinstance(row, list) and all(isinstance(word, str) for word in row) for row in words)):
        logger.debug("ignoring the tokens in %s: not the tokens of %d captions", path, n_captions)
        return None
    if kept.get("sha256") != _words_digest(words):
        logger.debug("ignoring the tokens in %s: they do not match their digest (edited or damaged)", path)
        return None
    return words


def _keep_words(captions_file: str) -> int:
    """`python -m sgraf.data.token_cache CAPTIONS_FILE`: keep the file's tokens (see `prefetch`)."""
    from sgraf.data.captions import read_captions

    captions = read_captions(captions_file)
    path = words_path(captions)
    if _read_words(path, len(captions)) is None:
        words = _tokenize_all(captions, tokenize_workers(len(captions), available_cores()))
        with atomic_path(path) as temporary:
            Path(temporary).write_text(json.dumps({"sha256": _words_digest(words), "words": words},
                                                  ensure_ascii=False), encoding="utf-8")
    return 0


# captions a tokenising process takes at least: below, forking one costs more than it saves
CAPTIONS_PER_WORKER = 2000


def tokenize_workers(n_captions: int, cpus: int) -> int:
    """Processes that tokenise `n_captions` for `prefetch`: the cores but one (the command's own
    process is importing PyTorch meanwhile), at most 8, each given at least
    `CAPTIONS_PER_WORKER` captions (MSCOCO's 25,000 test captions: 8 on a 16-core machine,
    about 8 s of nltk's rules on one core)."""
    return max(1, min(8, cpus - 1, n_captions // CAPTIONS_PER_WORKER))


def _tokenize_all(captions: list[str], workers: int) -> list[list[str]]:
    """Every caption's tokens, in `workers` processes forked after nltk is imported (so they do
    not import it again); in this process where there is one, or no fork."""
    tokenize("")                                 # imports nltk here, once
    if workers > 1:
        import multiprocessing

        try:      # macOS has fork but not safely after threads are started (Apple's frameworks): Linux only
            context = multiprocessing.get_context("fork") if sys.platform.startswith("linux") else None
        except ValueError:                       # no fork on this system
            context = None
        if context is not None:
            with context.Pool(workers) as pool:
                return pool.map(tokenize, captions, chunksize=-(-len(captions) // (4 * workers)))
    return [tokenize(caption) for caption in captions]


@functools.cache
def _tokenizer() -> str:
    try:
        version = metadata.version("nltk")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return f"nltk {version}, sgraf tokenizer {TOKENIZER_REVISION}"


def _key(captions: list[str], vocab: Vocabulary) -> str:
    digest = hashlib.sha256(_tokenizer().encode())
    for part in (list(vocab.idx2word.values()), captions):
        digest.update(b"\0")
        digest.update(json.dumps(part, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def _read(path: Path, n_captions: int, vocab_size: int, start: int, end: int) -> list[list[int]] | None:
    """The ids stored at `path`, or None when there are none or they are not valid ids of
    `n_captions` captions (each `<start>` ... `<end>`, every id in the vocabulary)."""
    try:
        stored = np.load(path, allow_pickle=False)
        if not isinstance(stored, np.lib.npyio.NpzFile):       # a plain .npy under our name
            raise ValueError("not an .npz archive")
        with stored:
            lengths, ids, digest = stored["lengths"], stored["ids"], stored["sha256"]
    except FileNotFoundError:
        return None
    except (*DAMAGED_NPY, KeyError, zipfile.BadZipFile) as error:
        logger.debug("ignoring the damaged token ids in %s: %s", path, error)
        return None
    if (lengths.dtype != np.int32 or ids.dtype != np.int32 or lengths.shape != (n_captions,) or ids.ndim != 1
            or (lengths < 2).any() or int(lengths.sum()) != ids.size
            or (ids.size and (ids.min() < 0 or ids.max() >= vocab_size))):
        logger.debug("ignoring the token ids in %s: not ids of these %d captions", path, n_captions)
        return None
    if not np.array_equal(digest, _ids_digest(lengths, ids)):
        logger.debug("ignoring the token ids in %s: they do not match their digest (edited or damaged)", path)
        return None
    ends = np.cumsum(lengths)
    starts = ends - lengths
    if (ids[starts] != start).any() or (ids[ends - 1] != end).any():
        logger.debug("ignoring the token ids in %s: a caption without <start> ... <end>", path)
        return None
    flat = ids.tolist()
    return [flat[a:b] for a, b in zip(starts.tolist(), ends.tolist())]


if __name__ == "__main__":
    sys.exit(_keep_words(sys.argv[1]))
