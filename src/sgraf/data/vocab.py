"""Vocabulary and tokenisation, exactly as the authors' SCAN/SGRAF code does them.

Tokenisation (authors' `PrecompDataset` and `build_vocab`): the caption's UTF-8 bytes are
stripped of ASCII whitespace and lower-cased AS BYTES (so only ASCII letters change case:
"É" stays "É"), decoded, then split by nltk's Treebank word tokenizer. The authors call
`nltk.word_tokenize(text)`, which needs the downloaded 'punkt' model to split sentences;
every caption is one sentence, and `word_tokenize(text, preserve_line=True)` gives the same
tokens with no download, so that is what we call.

Ids: `<pad>`=0, `<start>`=1, `<end>`=2, `<unk>`=3, then the words. A caption encodes to
`[<start>] + [id(token) ...] + [<end>]`, unknown tokens mapping to `<unk>`.

JSON format (the authors' `serialize_vocab`): `{"word2idx": {word: id}, "idx2word":
{"id": word}, "idx": size}`; JSON turns the integer keys of `idx2word` into strings.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from sgraf.atomic_write import write_text
from sgraf import text_files
from sgraf.errors import InputError

logger = logging.getLogger(__name__)

PAD, START, END, UNK = "<pad>", "<start>", "<end>", "<unk>"
SPECIAL_TOKENS = {PAD: 0, START: 1, END: 2, UNK: 3}
# The authors' vocabularies leave 1-3 % of their own data's tokens unknown; above this share a
# vocabulary is probably not the data's (another data set's, or one built from other captions).
UNKNOWN_WARN_SHARE = 0.10

# Changes whenever `tokenize` would split some caption differently (it names the tokenizer in
# `sgraf.data.token_cache`'s keys, beside nltk's version).
TOKENIZER_REVISION = 1

_word_tokenize: Callable[..., list[str]] | None = None


_IMPORT_LOCK = threading.Lock()


def _import_word_tokenize() -> Any:
    """nltk's `word_tokenize`. Importing nltk looks for a folder to download data into, and fails
    ("Could not find a default download directory") where the home folder cannot be found (no
    HOME, and a user id without a passwd entry: a container run as an arbitrary user); sgraf
    downloads nothing, so the import is given the temporary folder as HOME, for the import only."""
    with _IMPORT_LOCK:      # one import changes HOME at a time, and puts it back
        homeless = os.path.expanduser("~/") == "~/"
        if homeless:
            os.environ["HOME"] = tempfile.gettempdir()
        try:
            from nltk.tokenize import word_tokenize
        finally:
            if homeless:
                os.environ.pop("HOME", None)
    return word_tokenize


def tokenize(caption: str | bytes) -> list[str]:
    """Split a caption into tokens as the authors' pipeline does.

    Args:
        caption: raw caption text (str) or its UTF-8 bytes.

    Returns:
        The Treebank tokens, e.g. "The woman's hat." -> ["the", "woman", "'s", "hat", "."].
    """
    global _word_tokenize
    if _word_tokenize is None:  # nltk is slow to import: only when first needed
        _word_tokenize = _import_word_tokenize()
    try:
        raw = caption.encode("utf-8") if isinstance(caption, str) else bytes(caption)
        # bytes.lower() changes only ASCII letters, as the authors' Python 2 byte strings did.
        text = raw.strip().lower().decode("utf-8")
    except UnicodeError as error:  # lone surrogates: bytes that were not UTF-8 in argv or a file
        raise InputError(f"text {caption!r} is not valid UTF-8 (at position {error.start + 1}); "
                         "expected UTF-8 text") from None
    return _word_tokenize(text, preserve_line=True)


def _id_faults(word2idx: Mapping[str, int]) -> str:
    """What is wrong with the ids of `word2idx`: the first id given twice (and its words), the
    first id missing, the first out of range."""
    owners: dict[int, list[str]] = {}
    for word, index in word2idx.items():
        owners.setdefault(index, []).append(word)
    faults = []
    twice = sorted(index for index, words in owners.items() if len(words) > 1)
    if twice:
        faults.append(f"id {twice[0]} is given to {' and '.join(map(repr, owners[twice[0]][:2]))}"
                      + (f" ({len(twice)} ids twice)" if len(twice) > 1 else ""))
    missing = [index for index in range(len(word2idx)) if index not in owners]
    if missing:
        faults.append(f"id {missing[0]} is missing" + (f" ({len(missing)} missing)" if len(missing) > 1 else ""))
    beyond = sorted(index for index in owners if not 0 <= index < len(word2idx))
    if beyond:
        faults.append(f"id {beyond[0]} ({owners[beyond[0]][0]!r}) is out of that range")
    return "; ".join(faults)


class Vocabulary:
    """A word <-> id mapping with the authors' special tokens and JSON format.

    Args:
        word2idx: every word with its id; must hold `<pad>`=0, `<start>`=1, `<end>`=2,
            `<unk>`=3, and the ids must be 0 .. n-1, each once.
        source: where it came from (a file path), used in error messages.
    """

    def __init__(self, word2idx: Mapping[str, int], source: str = "vocabulary") -> None:
        self.word2idx: dict[str, int] = dict(word2idx)
        for token, expected in SPECIAL_TOKENS.items():
            found = self.word2idx.get(token)
            if found != expected:
                raise InputError(
                    f"{source}: field 'word2idx' must map the special token {token!r} to {expected} "
                    f"(<pad>=0, <start>=1, <end>=2, <unk>=3), "
                    f"found {'no entry' if found is None else found}")
        ids = sorted(self.word2idx.values())
        if ids != list(range(len(ids))):
            raise InputError(f"{source}: field 'word2idx' must use each id 0 .. {len(ids) - 1} exactly once; "
                             + _id_faults(self.word2idx))
        self.idx2word: dict[int, str] = {i: w for w, i in self.word2idx.items()}
        self.idx2word = dict(sorted(self.idx2word.items()))
        self.source = source
        self.unk_id = SPECIAL_TOKENS[UNK]
        self.start_id = SPECIAL_TOKENS[START]
        self.end_id = SPECIAL_TOKENS[END]
        self.pad_id = SPECIAL_TOKENS[PAD]

    @classmethod
    def from_words(cls, words: Iterable[str]) -> Vocabulary:
        """A vocabulary of the special tokens followed by `words` in the given order."""
        word2idx = dict(SPECIAL_TOKENS)
        for word in words:
            if word not in word2idx:
                word2idx[word] = len(word2idx)
        return cls(word2idx)

    def __len__(self) -> int:
        return len(self.word2idx)

    def __contains__(self, word: str) -> bool:
        return word in self.word2idx

    def __call__(self, word: str) -> int:
        """The id of `word`, or the id of `<unk>` when the word is not in the vocabulary."""
        return self.word2idx.get(word, self.unk_id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and self.word2idx == other.word2idx

    def __repr__(self) -> str:
        return f"Vocabulary({len(self)} entries)"

    def tokenize(self, caption: str | bytes) -> list[str]:
        """The caption's tokens (see the module docstring), without `<start>`/`<end>`."""
        return tokenize(caption)

    def encode(self, caption: str | bytes) -> list[int]:
        """Token ids of a caption: `[<start>] + [id(token) ...] + [<end>]`."""
        return [self.start_id] + [self(token) for token in tokenize(caption)] + [self.end_id]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """The words of `ids`, dropping `<pad>`, `<start>` and `<end>`."""
        skip = {self.pad_id, self.start_id, self.end_id}
        return [self.idx2word[int(i)] for i in ids if int(i) not in skip]

    def to_dict(self) -> dict[str, Any]:
        """The authors' JSON content: `{"word2idx", "idx2word" (string keys), "idx"}`."""
        return {
            "word2idx": dict(self.word2idx),
            "idx2word": {str(i): w for i, w in self.idx2word.items()},
            "idx": len(self),
        }

    @classmethod
    def from_dict(cls, content: Any, source: str = "vocabulary") -> Vocabulary:
        """Rebuild a vocabulary from the authors' JSON content, checking every field.

        Raises:
            InputError: a field is missing or inconsistent; the message names `source`
                and the field.
        """
        if not isinstance(content, dict):
            raise InputError(f"{source}: expected a JSON object with fields 'word2idx', 'idx2word', 'idx', "
                             f"got {type(content).__name__}")
        word2idx = content.get("word2idx")
        if not isinstance(word2idx, dict):
            raise InputError(f"{source}: missing field 'word2idx' (an object mapping words to ids)")
        for word, idx in word2idx.items():
            if not isinstance(idx, int) or isinstance(idx, bool):
                raise InputError(f"{source}: field 'word2idx' maps {word!r} to {idx!r}, expected an integer id")
        vocab = cls(word2idx, source=source)
        idx2word = content.get("idx2word")
        if idx2word is not None:
            if not isinstance(idx2word, dict) or len(idx2word) != len(vocab):
                raise InputError(f"{source}: field 'idx2word' must have {len(vocab)} entries like 'word2idx'")
            for key, word in idx2word.items():
                if not str(key).isdigit() or vocab.word2idx.get(word) != int(key):
                    raise InputError(f"{source}: field 'idx2word' entry {key!r}: {word!r} disagrees with "
                                     f"'word2idx' ({word!r} -> {vocab.word2idx.get(word)})")
        size = content.get("idx")
        if size is not None and size != len(vocab):
            raise InputError(f"{source}: field 'idx' is {size!r}, expected the vocabulary size {len(vocab)}")
        return vocab

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the authors' JSON format (as `json.dump` writes it), atomically."""
        write_text(path, json.dumps(self.to_dict()))


def load_vocab(path: str | os.PathLike[str]) -> Vocabulary:
    """Load a vocabulary JSON file in the authors' format.

    Raises:
        FileNotFoundError: no such file.
        InputError: not JSON (with line and column) or a field is missing or inconsistent.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(21, "a folder, not a vocabulary file (vocab.json)", str(path))
    if not path.exists():
        raise FileNotFoundError(2, "vocabulary file not found", str(path))
    text = text_files.read_text(path, "a UTF-8 JSON vocabulary")     # a pipe too (--vocab <(...)): read once
    try:
        content = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg}); "
                         f"expected the authors' vocabulary format {{'word2idx', 'idx2word', 'idx'}}") from None
    return Vocabulary.from_dict(content, source=str(path))


def unknown_share(vocab: Vocabulary, encoded: Iterable[Sequence[int]]) -> tuple[float, int]:
    """The share of tokens that are `<unk>` in encoded captions (`<start>`/`<end>` excluded),
    and the number of tokens counted."""
    unknown = total = 0
    for ids in encoded:
        words = ids[1:-1]
        unknown += sum(1 for i in words if i == vocab.unk_id)
        total += len(words)
    return (unknown / total if total else 0.0), total


def warn_unknown_share(vocab: Vocabulary, encoded: Iterable[Sequence[int]], captions: str,
                       threshold: float = UNKNOWN_WARN_SHARE) -> float:
    """`unknown_share`, logging a WARNING naming the vocabulary and `captions` above `threshold`.

    Returns:
        The share of unknown tokens.
    """
    share, total = unknown_share(vocab, encoded)
    if share > threshold:
        logger.warning("%s: %.1f%% of the %d tokens of %s are unknown to this vocabulary (<unk>), above the "
                       "%.0f%% warning threshold; is it the vocabulary of this data?",
                       getattr(vocab, "source", "the vocabulary"), 100 * share,
                       total, captions, 100 * threshold)
    return share


def build_vocab(captions: Iterable[str | bytes], min_count: int = 4) -> Vocabulary:
    """Build a vocabulary as the authors do: words seen at least `min_count` times.

    Words follow the special tokens in order of first occurrence (the authors iterate a
    `Counter`, which keeps insertion order). The authors build from train + dev captions.

    Args:
        captions: the captions to count tokens in.
        min_count: smallest number of occurrences for a word to get its own id.

    Raises:
        InputError: `min_count` < 1, or no word is seen `min_count` times (a vocabulary of the
            special tokens alone would map every word to `<unk>`).
    """
    if min_count < 1:
        raise InputError(f"min_count must be >= 1, got {min_count}")
    counter: Counter[str] = Counter()
    for caption in captions:
        counter.update(tokenize(caption))
    words = {w: n for w, n in counter.items() if w not in SPECIAL_TOKENS}
    if not any(n >= min_count for n in words.values()):
        most = max(words.values(), default=0)
        raise InputError(f"min count {min_count} leaves no word in the vocabulary: the most frequent of the "
                         f"{len(words)} distinct words is seen {most} times; expected a min count of at most "
                         f"{most}" if most else "the captions hold no word")
    vocab = Vocabulary.from_words(w for w, n in counter.items() if n >= min_count and w not in SPECIAL_TOKENS)
    vocab.source = f"the vocabulary built from the captions (min count {min_count})"
    logger.info("vocabulary: %d of %d distinct tokens seen >= %d times", len(vocab) - 4, len(counter), min_count)
    return vocab
