"""Captions' token ids kept on disk, so that scoring the same captions again skips the tokenizer.

Tokenising a split is host work that a GPU does not speed up: importing nltk (about 1.8 s where
SciPy is installed, which nltk imports) and its Treebank rules (about 0.25 ms a caption) took
3.3 s of a Flickr30K-size `sgraf evaluate` on a 2-core AMD EPYC (5,000 captions), against about
1.6 s of scoring on an H200. The ids depend only on the captions, the vocabulary and the
tokenizer, so they are stored under a key that hashes all three:
`<cache>/tokens/<sha256>.npz` (`sgraf.user_cache`), a few bytes per token. A file that does not
read back as valid ids for these captions is tokenised again and rewritten; a cache that cannot
be written costs nothing but the time. `SGRAF_TOKEN_CACHE=off` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import zipfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import numpy as np

from sgraf.atomic_write import atomic_path
from sgraf.data.vocab import TOKENIZER_REVISION, Vocabulary
from sgraf.errors import InputError
from sgraf.user_cache import cache_dir, switched_on

logger = logging.getLogger(__name__)


def enabled() -> bool:
    """False when SGRAF_TOKEN_CACHE is off/0/false/no."""
    return switched_on("SGRAF_TOKEN_CACHE")


def token_ids(captions: Sequence[str], vocab: Vocabulary) -> list[list[int]]:
    """`[vocab.encode(c) for c in captions]`, read from the cache when these captions were
    encoded with this vocabulary and tokenizer before (see the module)."""
    captions = list(captions)
    if not enabled() or not captions:
        return [vocab.encode(caption) for caption in captions]
    path = cache_dir() / "tokens" / f"{_key(captions, vocab)}.npz"
    cached = _read(path, len(captions), len(vocab), vocab.start_id, vocab.end_id)
    if cached is not None:
        return cached
    ids = [vocab.encode(caption) for caption in captions]
    try:
        with atomic_path(path) as temporary, open(temporary, "wb") as handle:
            np.savez(handle, lengths=np.array([len(row) for row in ids], dtype=np.int32),
                     ids=np.fromiter((i for row in ids for i in row), dtype=np.int32))
    except (InputError, OSError) as error:      # a read-only or full cache: the ids still hold
        logger.debug("could not keep the token ids in %s: %s", path, error)
    return ids


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
            lengths, ids = stored["lengths"], stored["ids"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        logger.debug("ignoring the damaged token ids in %s: %s", path, error)
        return None
    if (lengths.dtype != np.int32 or ids.dtype != np.int32 or lengths.shape != (n_captions,) or ids.ndim != 1
            or (lengths < 2).any() or int(lengths.sum()) != ids.size
            or (ids.size and (ids.min() < 0 or ids.max() >= vocab_size))):
        logger.debug("ignoring the token ids in %s: not ids of these %d captions", path, n_captions)
        return None
    ends = np.cumsum(lengths)
    starts = ends - lengths
    if (ids[starts] != start).any() or (ids[ends - 1] != end).any():
        logger.debug("ignoring the token ids in %s: a caption without <start> ... <end>", path)
        return None
    flat = ids.tolist()
    return [flat[a:b] for a, b in zip(starts.tolist(), ends.tolist())]
