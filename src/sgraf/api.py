"""The Python API for applications: load SGRAF models, encode images and texts, score, search.

`Matcher` wraps one model or an ensemble of independently trained models (the paper's SGRAF is
the mean of an SGR and a SAF model's scores) together with the vocabulary that turns text
strings into word ids:

    matcher = Matcher.load(["runs/sgr/model_best.pt", "runs/saf/model_best.pt"])
    images = matcher.encode_images(features)            # features: (n_img, K, img_dim)
                                                         # (boxes=(n_img, K, 4) for a model with positions)
    texts = matcher.encode_texts(["a dog runs on the grass"])
    scores = matcher.score_embeddings(images, texts)     # (n_img, n_txt) numpy

A model with positions (`ModelConfig.positions` not 'none', `SGRAF.needs_boxes`) reads each
region's box (x1, y1, x2, y2 normalised to [0, 1] of its picture, as `sgraf.data.boxes.read_boxes`
returns them) in its image encoder: `encode_images(features, boxes)` and `score(features, texts,
boxes)` take them, and refuse in one line to encode images without them. An ensemble may mix
models with and without positions: each model gets the boxes only if it reads them.

Encodings keep, per model, the l2-normalised region / word embeddings that the full SGRAF
scorer needs, plus the model's self-attention global vectors (Eq. 3 of the paper) that a
gallery search uses as a cheap first stage (`sgraf.search`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

import numpy as np
import torch

from sgraf.data.arrays import as_float32, check_finite_features, mapped_file, padded_ids
from sgraf.devices import resolve_device
from sgraf.errors import InputError, check_positive_int
from sgraf.io_paths import path_list
from sgraf.precision import autocast, check_precision

logger = logging.getLogger(__name__)

__all__ = ["Matcher", "ImageEncoding", "TextEncoding", "model_identity", "describe_identity", "shortlist_keys",
           "split_shortlist_keys", "MAX_TEXT_CHARS", "MAX_TEXT_WORDS", "check_text_length"]

# The one limit on a query text, for every entry point that takes one (`Matcher.tokenize`, so
# `sgraf search --text`, `sgraf explain`, and the service's search and explanations). It bounds
# a request's cost: encoding and scoring grow with the words, an explanation's picture has a
# panel per word. The longest Flickr30K / MSCOCO captions are well under 64 words. Captions
# scored as data (`Matcher.score`, `encode_texts`) have the data's limit instead
# (`sgraf.data.precomp.MAX_CAPTION_TOKENS`, as training and `sgraf evaluate` read them).
MAX_TEXT_CHARS = 500
MAX_TEXT_WORDS = 64


def check_text_length(text: str, n_words: int | None = None) -> None:
    """Refuse a query text over `MAX_TEXT_CHARS` characters or `MAX_TEXT_WORDS` words.

    Args:
        text: the text as given (its characters are counted before any tokenisation).
        n_words: its words after tokenisation, when known.

    Raises:
        InputError: "text is too long: N characters, the limit is 500" (or words, 64).
    """
    if len(text) > MAX_TEXT_CHARS:
        raise InputError(f"text is too long: {len(text)} characters, the limit is {MAX_TEXT_CHARS}")
    if n_words is not None and n_words > MAX_TEXT_WORDS:
        raise InputError(f"text is too long: {n_words} words, the limit is {MAX_TEXT_WORDS}")


def _weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over the state dict (names, dtypes, shapes and bytes), in key order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.numpy().tobytes() if tensor.dtype != torch.bfloat16
                      else tensor.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def model_identity(model: torch.nn.Module, source: str | None = None) -> dict[str, Any]:
    """What identifies a trained model: its configuration, a hash of its weights, where it came from.

    Args:
        model: an `SGRAF` network.
        source: the checkpoint path it was loaded from, if any (informative only).

    Returns:
        `{"config": dict, "weights_sha256": str, "source": str | None}`.
    """
    return {"config": model.config.to_dict(), "weights_sha256": _weights_sha256(model),
            "source": source}


def describe_identity(identity: dict[str, Any]) -> str:
    """One-line human description of a `model_identity` dict, for error messages."""
    config = identity.get("config", {})
    where = identity.get("source") or "<in memory>"
    return (f"{where} (module={config.get('module')}, embed_size={config.get('embed_size')}, "
            f"weights sha256 {str(identity.get('weights_sha256'))[:12]})")


@dataclass
class ImageEncoding:
    """Encoded images, one entry per model of the matcher.

    Attributes:
        regions: per model, (n_img, K, d_m) float32 l2-normalised region embeddings.
        global_vectors: per model, (n_img, d_m) float32 l2-normalised self-attention vectors.
        models: the encoding models' fingerprints (`Matcher.fingerprints`; None when built by hand),
            so that a matcher refuses encodings of other models.
    """

    regions: list[torch.Tensor]
    global_vectors: list[torch.Tensor]
    models: tuple[str, ...] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return int(self.regions[0].shape[0])

    def __repr__(self) -> str:      # shapes, not the tensors (thousands of characters in a notebook)
        shapes = ", ".join(str(tuple(regions.shape)) for regions in self.regions)
        return f"ImageEncoding({len(self)} images, {len(self.regions)} model(s), regions {shapes})"


@dataclass
class TextEncoding:
    """Encoded texts, one entry per model of the matcher.

    Attributes:
        words: per model, (n_txt, L, d_m) float32 word embeddings, zero beyond each length.
        lengths: (n_txt,) int64 token counts, `<start>` and `<end>` included.
        global_vectors: per model, (n_txt, d_m) float32 l2-normalised self-attention vectors.
        tokens: per text, the tokens between `<start>` and `<end>` (empty when built from ids).
        models: the encoding models' fingerprints, as `ImageEncoding.models`.
    """

    words: list[torch.Tensor]
    lengths: torch.Tensor
    global_vectors: list[torch.Tensor]
    tokens: list[list[str]]
    models: tuple[str, ...] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __repr__(self) -> str:
        shapes = ", ".join(str(tuple(words.shape)) for words in self.words)
        return f"TextEncoding({len(self)} texts, {len(self.words)} model(s), words {shapes})"


def shortlist_keys(global_vectors: Sequence[torch.Tensor]) -> np.ndarray:
    """First-stage search keys: the models' global vectors, concatenated and scaled.

    Each model's vectors are l2-normalised, so the inner product of two keys is the MEAN over
    models of the cosine similarity of their global vectors, the ensemble's cheap score.

    Returns:
        (n, sum of d_m) float32.
    """
    scale = 1.0 / np.sqrt(len(global_vectors))
    return np.concatenate([v.detach().cpu().float().numpy() * scale for v in global_vectors],
                          axis=1).astype(np.float32)


def split_shortlist_keys(keys: np.ndarray, sizes: Sequence[int]) -> list[torch.Tensor] | None:
    """The models' global vectors back from `shortlist_keys` (the inverse of its scaling).

    Args:
        keys: (n, sum of d_m) first-stage keys.
        sizes: each model's d_m, in the matcher's order.

    Returns:
        per model, (n, d_m) float32; None when the widths do not add up.
    """
    if keys.ndim != 2 or keys.shape[1] != sum(sizes):
        return None
    scale = np.float32(np.sqrt(len(sizes)))
    edges = np.cumsum([0, *sizes])
    return [torch.from_numpy(np.ascontiguousarray(keys[:, a:b], dtype=np.float32) * scale)
            for a, b in zip(edges[:-1], edges[1:])]


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _computes(method: _Method) -> _Method:
    """A `Matcher` method that runs its models: in eval mode and without gradients whatever mode
    the caller left them in (restored after), and in the matcher's own precision, whatever
    autocast the caller is in."""
    @functools.wraps(method)
    def wrapper(self: "Matcher", *args: Any, **kwargs: Any) -> Any:
        with self.computing():
            return method(self, *args, **kwargs)
    return wrapper  # type: ignore[return-value]


def _weights_key(models: Sequence[torch.nn.Module]) -> tuple[Any, ...]:
    """What changes when a weight does: each parameter's and buffer's object and version counter
    (an optimizer's step, `load_state_dict` and in-place edits through the tensor count; an edit
    through `.data` does not bump the counter and goes unseen). A tensor made under
    `torch.inference_mode` keeps no counter, and cannot be edited in place outside it: its object
    alone counts."""
    key = []
    for model in models:
        for tensor in (*model.parameters(), *model.buffers()):
            try:
                key.append((id(tensor), tensor._version))
            except RuntimeError:
                key.append((id(tensor), None))
    return tuple(key)


def _indexed(device: torch.device) -> torch.device:
    """`device` with its index: 'cuda' is the current CUDA device (`torch.cuda.set_device`, a
    torchrun process's own), 'cpu' and 'mps' the one there is."""
    if device.index is not None:
        return device
    if device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device.type, 0)


def _check_float32(models: Sequence[torch.nn.Module]) -> None:
    """Refuse models with weights other than float32, naming the model and the dtypes."""
    for m, model in enumerate(models):
        other = sorted({str(t.dtype).replace("torch.", "") for t in model.parameters()
                        if t.is_floating_point() and t.dtype != torch.float32})
        if other:
            raise InputError(f"model {m + 1} has {', '.join(other)} weights; a Matcher computes from float32 "
                             "weights: keep them float32 and pass precision='bf16' or 'fp16'")


class Matcher:
    """One SGRAF model or an ensemble, with its vocabulary, ready to encode, score and search.

    The models may be ones still being trained: every call runs them in eval mode without
    gradients and restores their mode after, and the identities and fingerprints that an index
    and encodings are checked against follow their weights as they change.

    Args:
        models: `SGRAF` networks with float32 weights (one model, or a list). Several models are
            an ensemble: their score matrices are averaged, as the paper's SGRAF averages SGR and
            SAF.
        vocab: the vocabulary used to tokenise text (a `Vocabulary`, its dict, or a JSON path);
            default: the first model's `vocab`. A model that carries another one is refused (its
            word ids would not be the ones it learned).
        sources: the checkpoint path of each model (kept in the identities), optional.
        device: where to compute ('cpu', 'cuda', 'cuda:N', 'mps'; checked by
            `sgraf.devices.resolve_device`).
        precision: 'fp32', 'bf16' or 'fp16' autocast for encoding and scoring ('fp32' also
            inside a caller's autocast).
        batch_size: images or texts encoded per forward pass.
    """

    def __init__(self, models: torch.nn.Module | Sequence[torch.nn.Module], vocab: Any | None = None,
                 sources: Sequence[str | None] | None = None, device: str | torch.device = "cpu",
                 precision: str = "fp32", batch_size: int = 128) -> None:
        if isinstance(models, torch.nn.Module):
            models = [models]
        models = list(models)
        if not models:
            raise InputError("a Matcher needs at least one model")
        for m, model in enumerate(models):
            if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
                raise InputError(f"model {m + 1} is a {type(model).__name__}, not an SGRAF network (load a "
                                 "checkpoint with sgraf.load_model, or use Matcher.load(paths))")
        _check_float32(models)
        self._device = resolve_device(device)
        self.precision = precision
        self.batch_size = batch_size
        self.models = [model.to(self._device) for model in models]   # their modes stay theirs (`computing`)
        self.vocab = _shared_vocab(self.models, vocab)
        self.sources = list(sources) if sources is not None else [None] * len(self.models)
        if len(self.sources) != len(self.models):
            raise InputError(f"got {len(self.sources)} sources for {len(self.models)} models")
        vocab_sizes = {model.config.vocab_size for model in self.models}
        img_dims = {model.config.img_dim for model in self.models}
        if len(vocab_sizes) > 1 or len(img_dims) > 1:
            raise InputError("the models of an ensemble must share vocab_size and img_dim, got "
                             + "; ".join(describe_identity({"config": m.config.to_dict(), "source": s,
                                                            "weights_sha256": "-"})
                                         for m, s in zip(self.models, self.sources)))
        if self.vocab is not None and len(self.vocab) != self.models[0].config.vocab_size:
            raise InputError(f"the vocabulary has {len(self.vocab)} words but the model expects "
                             f"vocab_size={self.models[0].config.vocab_size}")
        self._identities: tuple[Any, list[dict[str, Any]]] | None = None

    def __repr__(self) -> str:
        models = "; ".join(f"{model.config.module} ({source or '<in memory>'})"
                           for model, source in zip(self.models, self.sources))
        words = f"{len(self.vocab)} words" if self.vocab is not None else "none"
        return (f"Matcher({len(self.models)} model(s): {models}; device {self.device}, precision {self.precision}, "
                f"vocabulary {words})")

    @property
    def device(self) -> torch.device:
        """Where the matcher computes; set it (`matcher.device = "cuda"`) to move its models there."""
        return self._device

    @device.setter
    def device(self, device: str | torch.device) -> None:
        device = resolve_device(device, "device")
        self.models = [model.to(device) for model in self.models]
        self._device = device

    @property
    def precision(self) -> str:
        """'fp32', 'bf16' or 'fp16' (checked when set)."""
        return self._precision

    @precision.setter
    def precision(self, precision: str) -> None:
        self._precision = check_precision(precision)

    @property
    def batch_size(self) -> int:
        """Images or texts encoded per forward pass (a positive integer, checked when set)."""
        return self._batch_size

    @batch_size.setter
    def batch_size(self, batch_size: int) -> None:
        self._batch_size = check_positive_int(batch_size, "batch_size")

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """The context every model call of the matcher runs in: the models in eval mode without
        gradients (their train/eval mode restored after), and with 'fp32' no autocast of the
        caller's. The models are checked again first: float32 weights on the matcher's device (a
        model cast or moved since, as `model.half()` or `model.to("cuda")`, had failed deep in PyTorch)."""
        from sgraf.model.blocks import eval_mode

        _check_float32(self.models)
        for m, model in enumerate(self.models):
            where = next((t.device for t in model.parameters()), self._device)
            if _indexed(where) != _indexed(self._device):
                raise InputError(f"model {m + 1} is on {where} but the matcher computes on {self._device}: set "
                                 f"matcher.device = {str(where)!r} (it moves every model), or move the model back")
        with contextlib.ExitStack() as stack:
            stack.enter_context(eval_mode(self.models))
            if self.precision == "fp32" and self.device.type in ("cpu", "cuda"):
                stack.enter_context(torch.autocast(self.device.type, enabled=False))
            yield

    @property
    def fingerprints(self) -> tuple[str, ...]:
        """Each model's weights hash (`identities`: every byte, taken again when a weight has
        changed since), which encodings carry. (A hash of each tensor's first values had let an
        edit of one word's embedding through; a paper-size model's 60 MB hash in tens of
        milliseconds, once per change of its weights.)"""
        return tuple(identity["weights_sha256"] for identity in self.identities)

    # ----------------------------------------------------------------------------- loading
    @classmethod
    def load(cls, checkpoints: str | Path | Sequence[str | Path], vocab: Any | None = None,
             device: str | torch.device = "cpu", precision: str = "fp32",
             batch_size: int = 128) -> "Matcher":
        """Load one checkpoint or several (an ensemble) in our format or the authors'.

        Args:
            checkpoints: a path or a list of paths.
            vocab: a `Vocabulary`, or a path to the authors' vocabulary JSON; needed when the
                checkpoints do not carry one (the authors' `.pth.tar` never do).
        """
        from sgraf.evaluate import load_ensemble

        device = resolve_device(device)  # before the loading, which can take a while
        paths = path_list("checkpoints", checkpoints)
        models, vocab = load_ensemble(paths, vocab=vocab, device="cpu")
        return cls(models, vocab=vocab, sources=[str(Path(p).resolve()) for p in paths], device=device,
                   precision=precision, batch_size=batch_size)

    @property
    def identities(self) -> list[dict[str, Any]]:
        """`model_identity` of each model (config + weights hash + source): computed once, and
        again when a weight has changed since."""
        key = _weights_key(self.models)
        if self._identities is None or self._identities[0] != key:
            self._identities = (key, [model_identity(model, source)
                                      for model, source in zip(self.models, self.sources)])
        return self._identities[1]

    # ----------------------------------------------------------------------------- text
    def tokenize(self, text: str, allow_unknown: bool = False, query: bool = True) -> tuple[list[str], list[int]]:
        """Tokenise one text with the model's vocabulary.

        Args:
            text: the text.
            allow_unknown: map words the vocabulary does not know to `<unk>` instead of refusing.
            query: hold it to a query's limits (`MAX_TEXT_CHARS`, `MAX_TEXT_WORDS`); False, to a
                caption's as data (`sgraf.data.precomp.MAX_CAPTION_TOKENS` words).

        Returns:
            (tokens, ids): the words, and their ids framed by `<start>` ... `<end>`.

        Raises:
            InputError: a text that is not a str or is empty, one over the limits, no vocabulary,
                or (unless `allow_unknown`) words that the vocabulary does not know, named in the
                message.
        """
        from sgraf.data.precomp import MAX_CAPTION_TOKENS

        if self.vocab is None:
            raise InputError("this matcher has no vocabulary; load it with vocab=PATH")
        if not isinstance(text, str):
            raise InputError(f"a text must be a str, got {type(text).__name__}")
        if not text.strip():
            raise InputError("text is empty: give at least one word")   # as the service says it
        if query:
            check_text_length(text)                 # before the tokeniser reads a long text
        tokens = self.vocab.tokenize(text)
        if not tokens:
            raise InputError(f"{'query ' if query else ''}text {text!r} has no words after tokenisation")
        if query:
            check_text_length(text, len(tokens))
        elif len(tokens) > MAX_CAPTION_TOKENS:
            raise InputError(f"text is too long: {len(tokens)} words, the limit of a caption is {MAX_CAPTION_TOKENS}")
        if not allow_unknown:
            unknown = [t for t in tokens if t not in self.vocab.word2idx]
            if unknown:
                import unicodedata

                listed = ", ".join(repr(t) for t in dict.fromkeys(unknown))
                # a word typed decomposed (e + a combining accent) looks like the known composed one
                composed = [t for t in dict.fromkeys(unknown)
                            if unicodedata.normalize("NFC", t) != t and unicodedata.normalize("NFC", t) in self.vocab]
                hint = (f" ({composed[0]!r} is written with combining accents, Unicode NFD, and its composed form "
                        "is known: unicodedata.normalize('NFC', text))" if composed else "")
                raise InputError(f"{'query' if query else 'text'} {text!r}: word(s) {listed} not in the model's "
                                 f"vocabulary ({len(self.vocab)} words){hint}; rephrase with known words, or let "
                                 "unknown words count as <unk> (allow_unknown=True in Python, --allow-unknown on the "
                                 "command line, allow_unknown=true in the HTTP API)")
        return tokens, self.vocab.encode(text)

    def encode_texts(self, texts: Sequence[str], allow_unknown: bool = False, query: bool = False) -> TextEncoding:
        """Tokenise and encode texts with every model.

        Args:
            texts: strings (any iterable of them); each must have at least one word.
            allow_unknown: map unknown words to `<unk>` instead of refusing them.
            query: hold each to a query's limits (`tokenize`; a search's texts), not a caption's.
        """
        texts = [texts] if isinstance(texts, str) else list(texts)
        if len(texts) == 0:
            raise InputError("no text to encode")
        tokenised = [self.tokenize(text, allow_unknown=allow_unknown, query=query) for text in texts]
        ids = [t[1] for t in tokenised]
        lengths = torch.tensor([len(i) for i in ids], dtype=torch.int64)
        encoding = self.encode_token_ids(padded_ids(ids), lengths)
        encoding.tokens = [t[0] for t in tokenised]
        return encoding

    @_computes
    def encode_token_ids(self, captions: torch.Tensor, lengths: torch.Tensor) -> TextEncoding:
        """Encode padded word ids (n_txt, L) int64 with their lengths (n_txt,) with every model."""
        captions = torch.as_tensor(captions, dtype=torch.int64)
        lengths = torch.as_tensor(lengths, dtype=torch.int64)
        if captions.dim() != 2 or lengths.shape != (captions.shape[0],):
            raise InputError(f"captions must be (n, L) with lengths (n,), got {tuple(captions.shape)} "
                             f"and {tuple(lengths.shape)}")
        if captions.shape[0] == 0:
            raise InputError("no text to encode")
        if int(lengths.min()) < 1 or int(lengths.max()) > captions.shape[1]:
            raise InputError(f"lengths must be in [1, {captions.shape[1]}], got "
                             f"{int(lengths.min())}..{int(lengths.max())}")
        if int(captions.min()) < 0 or int(captions.max()) >= self.models[0].config.vocab_size:
            raise InputError(f"word ids must be in [0, {self.models[0].config.vocab_size}), got "
                             f"{int(captions.min())}..{int(captions.max())}")
        width = int(lengths.max())
        words: list[torch.Tensor] = []
        globals_: list[torch.Tensor] = []
        for model in self.models:
            model_words, model_globals = [], []
            for start in range(0, captions.shape[0], self.batch_size):
                batch = captions[start:start + self.batch_size].to(self.device)
                batch_lengths = lengths[start:start + self.batch_size].to(self.device)
                with autocast(self.precision, self.device):
                    cap_embs = model.encode_captions(batch, batch_lengths)  # (b, L', d)
                cap_embs = cap_embs.float()
                padded = cap_embs.new_zeros(cap_embs.shape[0], width, cap_embs.shape[2])
                padded[:, :cap_embs.shape[1]] = cap_embs[:, :width]
                model_words.append(padded.cpu())
                model_globals.append(text_global_vectors(model, cap_embs, batch_lengths).float().cpu())
            words.append(torch.cat(model_words))
            globals_.append(torch.cat(model_globals))
        return TextEncoding(words=words, lengths=lengths.cpu(), global_vectors=globals_,
                            tokens=[[] for _ in range(captions.shape[0])], models=self.fingerprints)

    # ----------------------------------------------------------------------------- images
    def check_features(self, features: Any, what: str = "image features") -> torch.Tensor:
        """Validate (n_img, K, img_dim) region features and return them as a float32 tensor.

        Raises:
            InputError: the wrong shape, no image, or NaN/inf (naming the image, region and
                dimension, and the file of a memory map).
        """
        source, first_row = mapped_file(features)   # a memory map: its file and rows
        if not torch.is_tensor(features):
            features = torch.from_numpy(as_float32(features, copy=True))  # copy: memmaps are read-only
        config = self.models[0].config
        if features.dim() == 2:
            features = features.unsqueeze(0)
        if features.dim() != 3 or features.shape[1:] != (config.num_regions, config.img_dim):
            where = f"{source}: " if source is not None else ""   # the file of a memory map
            raise InputError(f"{where}{what} must have shape (n_images, {config.num_regions}, {config.img_dim}) "
                             f"for this model, got {tuple(features.shape)}")
        if features.shape[0] == 0:
            raise InputError(f"{what}: no image to encode")
        features = features.float()
        check_finite_features(features, source or what, first_image=first_row)
        return features

    @property
    def needs_boxes(self) -> bool:
        """Whether a model of the matcher reads region boxes (a model with positions)."""
        return any(getattr(model, "needs_boxes", False) for model in self.models)

    def boxes_needed_by(self, and_need: bool = False) -> str:
        """The models that read boxes, for messages: "model 1 (sgr, positions='box') reads region
        positions", or with several "model 1 (...), model 3 (...) read region positions"; with
        `and_need`, followed by " and needs" (" and need")."""
        named = [f"model {m + 1} ({model.config.module}, positions={model.config.positions!r})"
                 for m, model in enumerate(self.models) if getattr(model, "needs_boxes", False)]
        ending = "s" if len(named) == 1 else ""
        return f"{', '.join(named)} read{ending} region positions" + (f" and need{ending}" if and_need else "")

    def check_boxes(self, boxes: Any, n_images: int, what: str = "boxes") -> torch.Tensor | None:
        """Validate (n_img, K, 4) region boxes normalised to [0, 1] for `n_images` images.

        Returns:
            float32 tensor (n_img, K, 4), or None when the matcher reads no boxes (they are
            then ignored) and none were given.

        Raises:
            InputError: none given to a matcher whose models need them; the wrong shape; NaN,
                inf, a box outside [0, 1] or with x2 < x1 / y2 < y1 (naming image and region).
        """
        if boxes is None:
            if self.needs_boxes:
                shape = "(K, 4)" if n_images == 1 else "(n_images, K, 4)"
                raise InputError(f"{self.boxes_needed_by(and_need=True)} each region's box "
                                 f"{shape} normalised to [0, 1]; got images without boxes (a "
                                 "PrecompSplit's boxes are None where a file is missing: "
                                 "split.read_boxes(required=True) names it)")
            return None
        if not self.needs_boxes:
            return None                           # no model reads them: not worth a check
        source, first_row = mapped_file(boxes)
        where = source or what
        if not torch.is_tensor(boxes):
            boxes = torch.from_numpy(np.array(boxes, dtype=np.float32))
        boxes = boxes.float()
        given = tuple(boxes.shape)                # as the caller passed them, for the message
        if boxes.dim() == 2 and n_images == 1:
            boxes = boxes.unsqueeze(0)
        k = self.models[0].config.num_regions
        if tuple(boxes.shape) != (n_images, k, 4):
            shape = f"({k}, 4) or (1, {k}, 4)" if n_images == 1 else f"({n_images}, {k}, 4)"
            raise InputError(f"{where} must have shape {shape} (x1, y1, x2, y2 per region of each "
                             f"image), got {given}")
        from sgraf.model.positions import check_normalised_boxes

        check_normalised_boxes(boxes, where, first_row)
        return boxes

    @_computes
    def encode_images(self, features: Any, boxes: Any = None) -> ImageEncoding:
        """Encode region features (n_img, K, img_dim) (numpy, memmap or tensor) with every model.

        Args:
            features: the region features.
            boxes: (n_img, K, 4) each region's box normalised to [0, 1] (array, memmap or
                tensor), for models with positions; required when one of them needs boxes,
                ignored otherwise.
        """
        features = self.check_features(features)
        boxes = self.check_boxes(boxes, int(features.shape[0]))
        regions: list[torch.Tensor] = []
        globals_: list[torch.Tensor] = []
        for model in self.models:
            model_regions, model_globals = [], []
            reads_boxes = getattr(model, "needs_boxes", False)
            for start in range(0, features.shape[0], self.batch_size):
                batch = features[start:start + self.batch_size].to(self.device)
                with autocast(self.precision, self.device):
                    if reads_boxes:
                        batch_boxes = boxes[start:start + self.batch_size].to(self.device)
                        img_embs = model.encode_images(batch, boxes=batch_boxes)  # (b, K, d)
                    else:
                        img_embs = model.encode_images(batch)  # (b, K, d)
                img_embs = img_embs.float()
                model_regions.append(img_embs.cpu())
                model_globals.append(image_global_vectors(model, img_embs).float().cpu())
            regions.append(torch.cat(model_regions))
            globals_.append(torch.cat(model_globals))
        return ImageEncoding(regions=regions, global_vectors=globals_, models=self.fingerprints)

    # ----------------------------------------------------------------------------- scoring
    @_computes
    def score_embeddings(self, images: ImageEncoding | Sequence[torch.Tensor],
                         texts: TextEncoding | tuple[Sequence[torch.Tensor], torch.Tensor],
                         image_globals: Sequence[torch.Tensor] | None = None) -> np.ndarray:
        """Full SGRAF scores of encoded images against encoded texts, the ensemble mean.

        Scored by the block scorer every entry point shares (`sgraf.model.blocks`): texts in
        buckets of `batch_size` sorted by length, the weight folds, global vectors and Gram
        matrices computed once per call, the models averaged in float64.

        Args:
            images: an `ImageEncoding`, or per model (n_img, K, d_m) region embeddings.
            texts: a `TextEncoding`, or (per model (n_txt, L, d_m) word embeddings, lengths).
            image_globals: optional per model (n_img, d_m) self-attention global vectors of
                these images (an index stores them as its first-stage keys), so the scorer does
                not compute them again; they must be the models' own (`ImageEncoding.global_vectors`).

        Returns:
            (n_img, n_txt) numpy: float32 for one model, float64 for an ensemble (the exact mean
            of its models' float32 scores, as the authors average; `sgraf.model.blocks.ENSEMBLE_DTYPE`).
        """
        from sgraf.model import blocks

        for what, encoding in (("images", images), ("texts", texts)):
            made_by = getattr(encoding, "models", None)
            if made_by is not None and made_by != self.fingerprints:
                raise InputError(f"the {what} were encoded by other weights than this matcher's {len(self.models)} "
                                 f"model(s) have now ({len(made_by)} model(s): other models, or these before "
                                 "their weights changed): encode them again with the matcher that scores them")
        regions = images.regions if isinstance(images, ImageEncoding) else list(images)
        if isinstance(texts, TextEncoding):
            words, lengths = texts.words, texts.lengths
        else:
            words, lengths = list(texts[0]), torch.as_tensor(texts[1])
        if len(regions) != len(self.models) or len(words) != len(self.models):
            raise InputError(f"expected one encoding per model of the matcher ({len(self.models)}), got "
                             f"{len(regions)} for the images and {len(words)} for the texts")
        encoded = []
        for m, (model, img_embs, cap_embs) in enumerate(zip(self.models, regions, words)):
            img_embs = torch.as_tensor(img_embs).float().to(self.device)
            buckets = blocks.bucket_words(model, torch.as_tensor(cap_embs), lengths, self.batch_size, self.precision)
            # the stored vectors stand in only where the model's scorer uses global vectors at all
            if image_globals is not None and blocks.image_globals(model, img_embs[:1], 1, self.precision) is not None:
                img_glo = torch.as_tensor(image_globals[m]).float().to(self.device)
            else:
                img_glo = blocks.image_globals(model, img_embs, self.batch_size, self.precision)
            encoded.append(blocks.Encoded(img_embs=img_embs, buckets=buckets, n_captions=int(len(lengths)),
                                          img_glo=img_glo))
        return blocks.score_encoded(self.models, encoded, self.precision).numpy()

    def score(self, features: Any, texts: Sequence[str], boxes: Any = None, allow_unknown: bool = False) -> np.ndarray:
        """Scores of region features (n_img, K, img_dim) against text strings: (n_img, n_txt).

        `boxes`: (n_img, K, 4) normalised region boxes, as `encode_images` takes them. The texts
        are captions as data (up to `sgraf.data.precomp.MAX_CAPTION_TOKENS` words each).
        """
        return self.score_embeddings(self.encode_images(features, boxes=boxes),
                                     self.encode_texts(texts, allow_unknown=allow_unknown))


def _shared_vocab(models: Sequence[torch.nn.Module], vocab: Any) -> Any:
    """The one vocabulary of `models`: `vocab` (a Vocabulary, its dict or a JSON path) when given,
    else the first model's; refused when a model carries another (other word ids)."""
    from sgraf.checkpoint import resolve_vocab

    if vocab is not None:
        given = resolve_vocab(vocab, source="the vocabulary given")
        name = str(vocab) if isinstance(vocab, (str, os.PathLike)) else "the vocabulary given"
    else:
        given = getattr(models[0], "vocab", None)
        name = "model 1's"
    if given is None:
        return None
    words = getattr(given, "word2idx", None)
    for m, model in enumerate(models):
        own = getattr(getattr(model, "vocab", None), "word2idx", None)
        if own is not None and words is not None and own != words:
            raise InputError(f"model {m + 1} carries its own vocabulary, which differs from {name} (other word ids: "
                             "the scores would be wrong); an ensemble needs one vocabulary")
    return given


# --------------------------------------------------------------------------------- global vectors
def _similarity_representation(model: torch.nn.Module) -> torch.nn.Module:
    from sgraf.model.similarity import SimilarityRepresentation

    for module in model.modules():
        if isinstance(module, SimilarityRepresentation):
            return module
    raise InputError(f"{type(model).__name__} has no similarity representation module")


def image_global_vectors(model: torch.nn.Module, img_embs: torch.Tensor) -> torch.Tensor:
    """The model's self-attention global image vectors: (n_img, K, d) -> (n_img, d), unit norm.

    A model without global alignments (`alignments='local'`) has no self-attention; its
    global vector is then the l2-normalised mean of the regions.
    """
    from sgraf.model.norms import l2norm

    if hasattr(model, "split_places"):
        img_embs = model.split_places(img_embs)[0]     # a place model's centres are not features
    representation = _similarity_representation(model)
    if representation.use_global:
        return representation.v_global_w(img_embs)
    return l2norm(img_embs.mean(dim=1))


def text_global_vectors(model: torch.nn.Module, cap_embs: torch.Tensor,
                        lengths: torch.Tensor) -> torch.Tensor:
    """The model's self-attention global text vectors: (n, L, d) zero-padded -> (n, d), unit norm."""
    from sgraf.model.norms import l2norm

    word_mask = torch.arange(cap_embs.shape[1], device=cap_embs.device)[None, :] < lengths[:, None]
    representation = _similarity_representation(model)
    if representation.use_global:
        return representation.t_global_w(cap_embs, word_mask)
    return l2norm(cap_embs.sum(dim=1) / lengths[:, None].to(cap_embs.dtype))
