"""What the model attends to, for one image and one caption (in the spirit of the paper's Fig. 3/5).

For a pair, `explain_pair` computes, with the model's own sub-modules in eval mode:

- per word, the text-to-image attention `alpha_ij` over the K regions (Eq. 3-4, SCAN t2i);
- SAF's weight `beta_p` on every similarity node (Eq. 9): the global alignment and each word;
- SGR's "final vs raw" alignment: the cosine between the reasoned read-out vector `s_r`
  after the last step (Eq. 6-8) and each raw node `s_p` before reasoning, the quantity the
  paper's figures plot as "SGR alpha";
- the score of each model and of the ensemble.

Each quantity is recomputed from the same modules the scorer uses, and the tests check the
scores rebuilt from them equal `SGRAF.similarity`.

`render_explanation` draws the PNG (matplotlib, imported when called): the image, a strip of
SAF beta and SGR alignment per token, and one panel per token with its attention over the
image: over the rendered image when the data folder has it (the embedded benchmark keeps them
under `images/{split}/`), over region boxes when the data has them (`{split}_boxes.npy`, in
pixels: the image panel outlines every region's box), else over an abstract grid of the K
regions.
"""

from __future__ import annotations

import logging
import math
import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from sgraf import text_files
from sgraf.atomic_write import atomic_path
from sgraf.data.arrays import file_row, open_npy
from sgraf.data.boxes import boxes_files
from sgraf.data.layout import picture_path, pictures_folder
from sgraf.errors import InputError

TITLE_CHARS_PER_LINE = 110   # the figure's title wraps here (the text can be 500 characters)
NOTE_CHARS_PER_LINE = 130   # the attention panels' note (smaller type) wraps here
LABEL_CHARS = 16             # words longer than this are cut in the picture's labels
DRAW_SIDE = 1024             # a picture is drawn from a copy at most this many pixels a side
MAX_PICTURE_PIXELS = 64_000_000   # a larger picture is not decoded (a 12,000 x 12,000 PNG took 3 GB)

logger = logging.getLogger(__name__)

__all__ = ["Explanation", "RegionLayout", "explain_pair", "penalty_note", "place_shares", "region_layout",
           "render_explanation", "word_region_attention", "saf_node_weights", "sgr_final_vs_raw"]


# --------------------------------------------------------------------------------- quantities
def word_region_attention(regions: torch.Tensor, words: torch.Tensor, smooth: float) -> torch.Tensor:
    """Text-to-image attention weights of one pair (the weights inside `attend_regions`).

    Args:
        regions: (K, d) region embeddings of the image.
        words: (L, d) word embeddings of the caption (its real length, no padding).
        smooth: the softmax temperature lambda.

    Returns:
        (L, K) `alpha`: for each word, a distribution over the regions.
    """
    from sgraf.model.similarity import region_attention

    return region_attention(regions.unsqueeze(0), words.unsqueeze(0), smooth)[0, 0]


def place_shares(term: torch.nn.Module, attention: torch.Tensor, centres: torch.Tensor,
                 words: torch.Tensor, signed: bool = False) -> torch.Tensor:
    """Each word's share of a place term (`sgraf.model.positions.PlaceTerm`) on one pair.

    Args:
        attention: (L, K) `word_region_attention` of the pair, at the temperature the model reads
            places at (`ModelConfig.place_sharpness`); centres: (K, 2); words: (L, d), no padding.

    Returns:
        (L,) e_u . (p_u - 1/2) per word, in logit units: they sum to the term (a penalty's, zero
        where the signed term is above 0: `PlaceTerm.value_shares`; with `signed`, the signed
        term's whatever its sign).
    """
    places = term.places(attention.float()[None, None], centres.float().unsqueeze(0))   # (1, 1, L, 2)
    words = words.float().unsqueeze(0)
    directions = term.word_directions(words, torch.ones(words.shape[:2], dtype=torch.bool, device=words.device))
    shares = term.word_shares(places, directions)[0, 0]
    return shares if signed else term.value_shares(shares)


def saf_node_weights(saf: torch.nn.Module, nodes: torch.Tensor) -> torch.Tensor:
    """SAF's eval-mode weights beta over the nodes of one pair (Eq. 9).

    Args:
        saf: an `AttentionFiltration` module.
        nodes: (P, m) similarity nodes, all valid.

    Returns:
        (P,) beta, summing to 1.
    """
    from sgraf.model.norms import l1norm

    bn = saf.bn
    logits = saf.attn_sim_w(nodes).view(-1, 1)                   # (P, 1)
    normed = F.batch_norm(logits, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
    return l1norm(torch.sigmoid(normed).view(-1), dim=0)


def sgr_final_vs_raw(steps: Sequence[torch.nn.Module], nodes: torch.Tensor,
                     has_global: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Run SGR's reasoning steps on one pair and compare the read-out with the raw nodes.

    Args:
        steps: the `GraphReasoning` modules.
        nodes: (P, m) raw similarity nodes (global first when `has_global`).
        has_global: read out node 0; otherwise the mean of the reasoned nodes.

    Returns:
        (readout (m,), cosine (P,)): the reasoned vector `s_r` and its cosine with each raw node.
    """
    from sgraf.model.norms import cosine

    graph = nodes.unsqueeze(0)                                   # (1, P, m)
    key_mask = torch.ones(1, 1, nodes.shape[0], dtype=torch.bool, device=nodes.device)
    for step in steps:
        graph = step(graph, key_mask)
    readout = graph[0, 0] if has_global else graph[0].mean(dim=0)
    return readout, cosine(readout.unsqueeze(0), nodes)


@dataclass
class Explanation:
    """Everything the picture shows, as numbers.

    Attributes:
        text: the caption.
        tokens: the L tokens the model sees, `<start>` and `<end>` included.
        node_labels: the labels of the similarity nodes (`[global]` first when present).
        scores: per model label ('sgr', 'saf', ... or 'model 1'), and 'ensemble' for several.
        attention: (L, K) each token's attention over the regions, from `attention_model`,
            or None (i2t attention or no local alignments).
        attention_model: label of the model whose attention is shown.
        saf_beta: (P,) SAF's weight on each node, or None without a SAF head.
        sgr_alignment: (P,) cosine of SGR's final read-out with each raw node, or None.
        place: (L,) each token's share of the place term (`positions='place'`: its weight
            e_u . (p_u - 1/2), in logit units; they sum to the term) from `place_model`, or
            None without such a model.
        place_model: label of the model whose place term is shown.
        place_signed: (L,) the signed term's shares where that model's term is a penalty
            (`place_penalty`: `place` is zero where they sum to more than 0), else None.
        place_terms: every place model's term (the sum of its shares), by label: an ensemble of
            two place models had shown the first one's alone.
    """

    text: str
    tokens: list[str]
    node_labels: list[str]
    scores: dict[str, float]
    attention: np.ndarray | None
    attention_model: str | None
    saf_beta: np.ndarray | None
    sgr_alignment: np.ndarray | None
    image_id: int | None = None
    image_name: str | None = None      # the picture's file name or image id, where the data records one
    extra: dict[str, Any] = field(default_factory=dict)
    place: np.ndarray | None = None
    place_model: str | None = None
    place_signed: np.ndarray | None = None
    place_terms: dict[str, float] = field(default_factory=dict)
    n_regions: int | None = None        # K, the image's regions (the abstract grid drawn without a layout)

    def render(self, out: str | os.PathLike[str] | BinaryIO, layout: "RegionLayout | None" = None,
               title: str | None = None) -> Path | BinaryIO:
        """Draws the explanation to a PNG (`render_explanation`): over `layout` (`region_layout`:
        the picture and its regions' boxes) or, by default, an abstract grid of the regions."""
        return render_explanation(self, layout or self._grid(), out, title=title)

    def _repr_png_(self) -> bytes:
        """The picture, for a notebook (Jupyter draws an `Explanation` so), over the abstract grid
        of the regions: `render(out, region_layout(...))` draws it over the image itself."""
        import io

        return self.render(io.BytesIO()).getvalue()

    def _grid(self) -> "RegionLayout":
        count = self.n_regions or (self.attention.shape[1] if self.attention is not None else 36)
        return region_layout(None, None, 0, count)        # no data: the abstract grid of the regions

    def __repr__(self) -> str:
        """One line: the text, the scores and the shapes of the arrays (a notebook had printed
        every attention weight)."""
        def shape(value: Any) -> str:
            return "None" if value is None else f"<array {tuple(value.shape)}>"

        arrays = ", ".join(f"{name}={shape(getattr(self, name))}"
                           for name in ("attention", "saf_beta", "sgr_alignment", "place", "place_signed"))
        scores = ", ".join(f"{label}: {score:.4f}" for label, score in self.scores.items())
        return (f"Explanation(text={self.text!r}, image_id={self.image_id}, scores={{{scores}}}, "
                f"tokens={len(self.tokens)}, nodes={len(self.node_labels)}, {arrays})")


def _label(model: torch.nn.Module, position: int, models: Sequence[torch.nn.Module]) -> str:
    module = model.config.module
    same = [m for m in models if m.config.module == module]
    return module if len(same) == 1 else f"{module} {position + 1}"


@torch.no_grad()
def explain_pair(matcher: Any, features: Any, text: str, allow_unknown: bool = False,
                 boxes: Any = None) -> Explanation:
    """The attention quantities of one image and one caption.

    Args:
        matcher: a `sgraf.api.Matcher` (one model or an ensemble), or one `SGRAF` model.
        features: (K, img_dim) region features of the image.
        text: the caption, held to a query's limits (`sgraf.api.MAX_TEXT_WORDS` words); unknown
            words are refused unless `allow_unknown`.
        boxes: (K, 4) the regions' boxes normalised to [0, 1] (`PrecompSplit.boxes[i]`), for
            models with positions (refused without them); ignored by the others.

    Returns:
        An `Explanation`. SAF weights come from the first model with a SAF head, SGR's
        alignment from the first with an SGR head, attention from the first model with
        text-to-image local alignments. The scores are computed in the matcher's precision (as
        its searches are); the quantities drawn, in float32.
    """
    from sgraf.api import Matcher
    from sgraf.model.sgraf import SGRAF

    if isinstance(matcher, SGRAF):              # one model, as Matcher(model) would hold it
        matcher = Matcher(matcher)
    elif not isinstance(matcher, Matcher):
        raise InputError(f"matcher: expected a sgraf.Matcher (or an SGRAF model), got {type(matcher).__name__}; "
                         "Matcher.load(paths) loads checkpoints")
    with matcher.computing():
        return _explain_pair(matcher, features, text, allow_unknown, boxes)


def _explain_pair(matcher: Any, features: Any, text: str, allow_unknown: bool, boxes: Any) -> Explanation:
    from sgraf.precision import autocast

    image = matcher.check_features(features)
    if image.shape[0] != 1:
        raise InputError(f"explain one image at a time, got features of {image.shape[0]} images")
    boxes = matcher.check_boxes(boxes, 1, what="the image's boxes")
    tokens, ids = matcher.tokenize(text, allow_unknown=allow_unknown)
    captions = torch.tensor([ids], dtype=torch.int64, device=matcher.device)
    lengths = torch.tensor([len(ids)], dtype=torch.int64, device=matcher.device)
    image = image.to(matcher.device)
    scores: dict[str, float] = {}
    attention = attention_model = saf_beta = sgr_alignment = place = place_model = place_signed = None
    node_labels: list[str] = []
    place_terms: dict[str, float] = {}
    for position, model in enumerate(matcher.models):
        label = _label(model, position, matcher.models)
        image_boxes = {"boxes": boxes.to(matcher.device)} if getattr(model, "needs_boxes", False) else {}
        if matcher.precision != "fp32":
            with autocast(matcher.precision, matcher.device):
                scores[label] = float(model.similarity(model.encode_images(image, **image_boxes),
                                                       model.encode_captions(captions, lengths), lengths)[0, 0])
        regions = model.encode_images(image, **image_boxes)               # (1, K, d)
        words = model.encode_captions(captions, lengths)                  # (1, L, d)
        if matcher.precision == "fp32":
            scores[label] = float(model.similarity(regions, words, lengths)[0, 0])
        centres = None
        if hasattr(model, "split_places"):
            regions, centres = model.split_places(regions)                # a place model's centres off
        encoder = model.sim_enc
        word_mask = torch.ones(1, len(ids), dtype=torch.bool, device=words.device)
        nodes, _ = encoder(regions, words, word_mask)                     # (1, 1, P, m)
        nodes = nodes[0, 0]                                               # (P, m)
        if not node_labels:
            local = [*(["<start>"] + tokens + ["<end>"])] if encoder.attention == "t2i" else \
                [f"region {k}" for k in range(regions.shape[1])]
            node_labels = (["[global]"] if encoder.use_global else []) + (local if encoder.use_local else [])
        model_attention = None
        if encoder.use_local and encoder.attention == "t2i" and (attention is None or centres is not None):
            model_attention = word_region_attention(regions[0], words[0], encoder.smooth)   # (L, K)
        if attention is None and model_attention is not None:
            attention = model_attention.cpu().numpy()
            attention_model = label
        if centres is not None:           # a place model (it has t2i local alignments): its term, per word
            read = model_attention if encoder.place_smooth == encoder.smooth else \
                word_region_attention(regions[0], words[0], encoder.place_smooth)
            signed = place_shares(encoder.place_term, read, centres[0], words[0], signed=True)
            shares = encoder.place_term.value_shares(signed).cpu().numpy()
            place_terms[label] = float(shares.sum())
            if place is None:             # the first place model's shares are the ones drawn
                place, place_model = shares, label
                if encoder.place_term.penalty:
                    place_signed = signed.cpu().numpy()
        if saf_beta is None and hasattr(encoder, "SAF_module"):
            saf_beta = saf_node_weights(encoder.SAF_module, nodes).cpu().numpy()
        if sgr_alignment is None and hasattr(encoder, "SGR_module"):
            _, cosines = sgr_final_vs_raw(encoder.SGR_module, nodes, encoder.use_global)
            sgr_alignment = cosines.cpu().numpy()
    if len(matcher.models) > 1:
        scores["ensemble"] = float(np.mean(list(scores.values())))
    return Explanation(text=text, tokens=["<start>", *tokens, "<end>"], node_labels=node_labels, scores=scores,
                       attention=attention, attention_model=attention_model, saf_beta=saf_beta,
                       sgr_alignment=sgr_alignment, place=place, place_model=place_model, place_signed=place_signed,
                       place_terms=place_terms, n_regions=int(image.shape[1]))


# --------------------------------------------------------------------------------- regions
@dataclass
class RegionLayout:
    """Where the K regions of an image are, for drawing attention.

    Attributes:
        kind: 'grid' (a rows x cols grid, row-major, over the image or abstract), or 'boxes'.
        image: the picture (H, W, 3) uint8, or None (then an abstract grid is drawn).
        grid: (rows, cols) for 'grid'.
        boxes: (K, 4) x0, y0, x1, y1 in image pixels, for 'boxes'.
        source: a short description for the figure ("image file ...", "region boxes", ...).
        size: (width, height) of the picture in the boxes' pixels, where `image` is a smaller
            copy of it (`DRAW_SIDE`); None: `image`'s own.
    """

    kind: str
    image: np.ndarray | None = None
    grid: tuple[int, int] | None = None
    boxes: np.ndarray | None = None
    source: str = ""
    size: tuple[int, int] | None = None

    @property
    def picture_size(self) -> tuple[int, int] | None:
        """(width, height) of the picture in the pixels the boxes are given in; None without one."""
        if self.size is not None:
            return self.size
        return None if self.image is None else (int(self.image.shape[1]), int(self.image.shape[0]))

    def heatmap(self, weights: np.ndarray) -> np.ndarray:
        """Spread (K,) region weights over the picture: (H, W) (or (rows, cols) without one)."""
        if self.kind == "grid":
            rows, cols = self.grid
            cells = weights.reshape(rows, cols)
            if self.image is None:
                return cells
            height, width = self.image.shape[:2]
            row_of = np.minimum(np.arange(height) * rows // height, rows - 1)
            col_of = np.minimum(np.arange(width) * cols // width, cols - 1)
            return cells[row_of][:, col_of]
        height, width = self.image.shape[:2]
        scale_x, scale_y = width / self.picture_size[0], height / self.picture_size[1]   # to the drawn copy
        heat = np.zeros((height, width), dtype=np.float64)
        for weight, (x0, y0, x1, y1) in zip(weights, self.boxes * [scale_x, scale_y, scale_x, scale_y]):
            x0, x1 = int(max(0, math.floor(x0))), int(min(width, math.ceil(x1)))
            y0, y1 = int(max(0, math.floor(y0))), int(min(height, math.ceil(y1)))
            heat[y0:y1, x0:x1] += weight
        return heat


def _grid_shape(k: int) -> tuple[int, int]:
    rows = int(math.isqrt(k))
    while k % rows:
        rows -= 1
    return rows, k // rows


def _image_boxes(data_dir: Path, split: str, image_id: int, num_regions: int,
                 skip_unreadable: bool) -> tuple[np.ndarray | None, tuple[int, int] | None]:
    """The (num_regions, 4) float64 boxes of one image from a split's boxes file, and its
    picture's (width, height) where the split has picture sizes, each row read from its file (not
    the map: a file cut short meanwhile is an error, not SIGBUS). With sizes, the whole pair of
    files is checked as a model with positions reads them (`data.boxes.check_boxes`: boxes outside
    the picture, x2 < x1, boxes divided by the sizes; a position-free model's explanation had drawn
    them without a word), once per state of the files (`_boxes_verdict`). A damaged file is an
    InputError, or with `skip_unreadable` (`sgraf serve`: the gallery's fault, not the request's;
    it had answered 400 as if the client had erred) (None, None) and a warning, once per state."""
    boxes_path, sizes_path = boxes_files(data_dir, split)
    expected = f"(n_images, {num_regions}, 4) float region boxes covering image {image_id}"
    try:
        mapped = open_npy(boxes_path, expected)
        if mapped.ndim != 3 or mapped.shape[1:] != (num_regions, 4) or image_id >= mapped.shape[0] \
                or mapped.dtype.kind not in "fiu":
            raise InputError(f"{boxes_path}: expected {expected}, got {mapped.dtype} of shape {mapped.shape}")
        try:
            boxes = file_row(mapped, image_id).astype(np.float64)
        except OSError as error:
            raise InputError(f"{boxes_path}: {error.strerror}") from None
        if not np.isfinite(boxes).all():
            region = int(np.argwhere(~np.isfinite(boxes))[0][0])
            raise InputError(f"{boxes_path}: the box of image {image_id}, region {region} is "
                             f"{boxes[region].tolist()}; expected finite (x1, y1, x2, y2) coordinates")
        size = None
        if sizes_path.is_file():
            _boxes_verdict(boxes_path, sizes_path, num_regions)
            try:
                width, height = (float(v) for v in file_row(open_npy(sizes_path, "(n_images, 2) sizes"), image_id))
            except OSError as error:
                raise InputError(f"{sizes_path}: {error.strerror}") from None
            size = (max(int(round(width)), 1), max(int(round(height)), 1))
    except InputError as error:
        if not skip_unreadable:
            raise
        if str(error) not in _BOX_SAID:
            if len(_BOX_SAID) >= 1000:
                _BOX_SAID.clear()
            _BOX_SAID.add(str(error))
            logger.warning("%s; drawn without the boxes", error)
        return None, None
    return boxes, size


_BOX_VERDICTS: dict[tuple[Any, ...], str | None] = {}     # files' states -> None (good) or why not
_BOX_SAID: set[str] = set()                                # warnings given (once each, not per request)
_UNJUDGED = object()


def _boxes_verdict(boxes_path: Path, sizes_path: Path, num_regions: int) -> None:
    """InputError unless the boxes and sizes files pass `data.boxes.check_boxes`, read whole with
    plain reads (a file cut short is an error, not SIGBUS); the verdict is kept per state of the
    two files (size, time, inode), so that a server checks them once, not at every explanation
    (0.2 s for 123,000 images)."""
    from sgraf.data.boxes import check_boxes
    from sgraf.search import file_states

    key = (str(boxes_path), str(sizes_path), num_regions,
           *file_states(boxes_path.parent, [boxes_path.name, sizes_path.name]).values())
    verdict = _BOX_VERDICTS.get(key, _UNJUDGED)
    if verdict is _UNJUDGED:
        try:
            arrays = []
            for path in (boxes_path, sizes_path):
                try:
                    arrays.append(np.load(path, allow_pickle=False))     # read, not mapped
                except (OSError, ValueError) as error:
                    raise InputError(f"{path}: not a readable .npy array ({error})") from None
            check_boxes(*arrays, boxes_path, sizes_path, n_regions=num_regions)
            verdict = None
        except InputError as error:
            verdict = str(error)
        if len(_BOX_VERDICTS) >= 16:      # serve's threads share it: a value read is used, not read again
            _BOX_VERDICTS.clear()
        _BOX_VERDICTS[key] = verdict
    if verdict is not None:
        raise InputError(verdict)


def region_layout(data_dir: str | os.PathLike[str] | None, split: str | None, image_id: int,
                  num_regions: int, skip_unreadable: bool = False) -> RegionLayout:
    """Find the picture and region geometry of an image of a precomp split.

    Looks for, in order: region boxes `{split}_boxes.npy` (n_images, K, 4) written by the TSV
    converter, with the image itself if present; the rendered image `images/{split}/{id:05d}.png`
    (the embedded benchmark's, whose K regions are a square grid over it); otherwise an abstract
    grid of the K regions. A picture is kept as a copy at most `DRAW_SIDE` pixels a side (its
    size recorded); one of more than `MAX_PICTURE_PIXELS` is not decoded (drawn as absent, said).

    Args:
        skip_unreadable: draw without a picture, or a boxes file, that cannot be read (a server's
            gallery: not the request's fault), with a warning, instead of raising `InputError`.
    """
    grid = _grid_shape(num_regions)
    if data_dir is None or split is None:
        return RegionLayout("grid", grid=grid, source=f"no image: {grid[0]} x {grid[1]} region grid")
    data_dir = Path(data_dir)
    picture = size = None
    candidate = picture_path(pictures_folder(data_dir, split), image_id)
    if candidate is not None:
        try:
            picture, size = _read_picture(candidate)
        except InputError as error:
            if not skip_unreadable:
                raise
            logger.warning("%s; drawn without it", error)
    boxes_path, _ = boxes_files(data_dir, split)
    boxes, sized = _image_boxes(data_dir, split, image_id, num_regions, skip_unreadable) if boxes_path.is_file() \
        else (None, None)
    if boxes is not None:
        if picture is None:  # no picture: a blank canvas of the image's size (or the boxes' extent)
            width, height = size or sized or _image_size(data_dir / f"{split}_image_ids.txt", image_id) or (
                int(np.ceil(boxes[:, 2].max())), int(np.ceil(boxes[:, 3].max())))
            size = (max(width, 1), max(height, 1))
            drawn_w, drawn_h = _drawn_size(*size)
            picture = np.full((drawn_h, drawn_w, 3), 235, dtype=np.uint8)
        return RegionLayout("boxes", image=picture, boxes=boxes, source=f"region boxes of {boxes_path.name}",
                            size=size)
    if picture is not None:
        if grid[0] != grid[1]:
            logger.warning("%d regions are not a square grid; drawing a %d x %d grid", num_regions, *grid)
        return RegionLayout("grid", image=picture, grid=grid,
                            source=f"images/{split}/{image_id:05d}, {grid[0]} x {grid[1]} region grid", size=size)
    return RegionLayout("grid", grid=grid, source=f"no image found: {grid[0]} x {grid[1]} region grid")


def _drawn_size(width: int, height: int) -> tuple[int, int]:
    """The size of the copy a picture of `width` x `height` is drawn from (`DRAW_SIDE`)."""
    scale = min(1.0, DRAW_SIDE / max(width, height))
    return max(1, round(width * scale)), max(1, round(height * scale))


def _read_picture(path: Path) -> tuple[np.ndarray | None, tuple[int, int] | None]:
    """A picture as RGB uint8, reduced to `DRAW_SIDE` pixels a side, and its own (width, height);
    None for one of more than `MAX_PICTURE_PIXELS` pixels (not decoded: a warning says so).

    Raises:
        InputError: not a readable image.
    """
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():          # its size is checked here, before any decoding
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as handle:
                width, height = handle.size
                if width * height > MAX_PICTURE_PIXELS:
                    logger.warning("%s: a picture of %d x %d pixels, more than the %s drawn; drawn without it",
                                   path, width, height, f"{MAX_PICTURE_PIXELS:,}")
                    return None, (width, height)
                handle.draft("RGB", _drawn_size(width, height))   # JPEG: decoded at a fraction of its size
                picture = handle.convert("RGB")
                if max(picture.size) > DRAW_SIDE:
                    picture = picture.resize(_drawn_size(width, height), Image.Resampling.BILINEAR)
                return np.asarray(picture), (width, height)
    except Image.DecompressionBombError as error:     # Pillow's own limit, past ours: a header of a huge size
        logger.warning("%s: %s; drawn without it", path, error)
        return None, None
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise InputError(f"{path}: not a readable image ({error})") from None


def _image_size(path: Path, image_id: int) -> tuple[int, int] | None:
    """(width, height) of row `image_id` of the TSV converter's `image_id<TAB>w<TAB>h` file, if any."""
    if not path.is_file():
        return None
    for number, raw in text_files.lines(path):
        if number == image_id + 1:
            fields = raw.decode("utf-8", "replace").rstrip("\n").split("\t")  # numbers only are read
            try:
                return int(float(fields[1])), int(float(fields[2]))
            except (IndexError, ValueError):
                raise InputError(f"{path}:{number}: expected image_id<TAB>width<TAB>height") from None
    return None


# --------------------------------------------------------------------------------- drawing
def render_explanation(explanation: Explanation, layout: RegionLayout, out: str | os.PathLike[str] | BinaryIO,
                       title: str | None = None, columns: int = 8) -> Path | BinaryIO:
    """Draw an `Explanation` to a PNG.

    Args:
        explanation: from `explain_pair`.
        layout: from `region_layout`.
        out: the PNG path (parent folders are created), or a binary file object to write it to
            (a server answers with the bytes without writing a file).
        title: the figure title (default: the caption and the scores).
        columns: token panels per row.
    """
    from sgraf.plotting import pyplot

    plt = pyplot()

    tokens = explanation.tokens
    n_panels = len(tokens) if explanation.attention is not None else 0
    panel_rows = math.ceil(n_panels / columns) if n_panels else 0
    width = max(10.0, 1.25 * columns)   # 900 px at 8 columns: a served picture stays bounded
    # constrained layout sizes each part to its content: the weight row's rotated node labels get
    # their own room above the attention panels, whose rows are as tall as their square pictures
    panel_height = width / columns + 0.35
    top_height = 3.0
    figure = plt.figure(figsize=(width, top_height + 0.6 + panel_height * panel_rows + (0.4 if n_panels else 0)),
                        layout="constrained")
    if n_panels:
        upper, lower = figure.subfigures(2, 1, height_ratios=[top_height, panel_height * panel_rows + 0.4])
    else:
        upper, lower = figure, None
    top = upper.add_gridspec(1, 2, width_ratios=[1, 3.2])

    # the image itself
    axis = upper.add_subplot(top[0])
    _draw_picture(axis, layout, None)
    axis.set_title(image_label(explanation), fontsize=9)

    # SAF beta and SGR final-vs-raw alignment per node: rows of a fixed height (about 0.6 inch), so
    # that one model's single row is a strip beside the picture, not a block as tall as the picture
    # each row its own colour scale: SAF's beta from 0 to its largest (white: no weight), SGR's
    # cosines on a diverging scale from -1 to 1 (white: 0, blue below, red above)
    import matplotlib

    rows, labels, colours = [], [], []
    if explanation.saf_beta is not None:
        rows.append(explanation.saf_beta)
        labels.append("SAF $\\beta$")
        colours.append(matplotlib.colormaps["Reds"](explanation.saf_beta / max(float(explanation.saf_beta.max()),
                                                                                1e-12)))
    if explanation.sgr_alignment is not None:
        rows.append(explanation.sgr_alignment)
        labels.append("SGR final·raw")
        colours.append(matplotlib.colormaps["RdBu_r"]((np.clip(explanation.sgr_alignment, -1.0, 1.0) + 1.0) / 2.0))
    strip = min(top_height - 1.6, 0.6 * max(1, len(rows)))
    axis = upper.add_subplot(top[1].subgridspec(3, 1, height_ratios=[1.0, strip, top_height - 1.0 - strip])[1])
    if rows:
        cells = np.stack(colours)                                      # (rows, nodes, RGBA)
        axis.imshow(cells, aspect="auto")
        luminance = cells[..., :3] @ np.array([0.299, 0.587, 0.114])
        for i, row in enumerate(rows):
            for j, value in enumerate(row):
                axis.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7,
                          color="white" if luminance[i, j] < 0.5 else "black")
        axis.set_yticks(range(len(labels)), labels, fontsize=9)
        axis.set_xticks(range(len(explanation.node_labels)), [_short(n) for n in explanation.node_labels], rotation=45,
                        ha="right", fontsize=8)
        axis.tick_params(length=0)
    else:
        axis.axis("off")
        axis.text(0.5, 0.5, "no SAF or SGR head in these models", ha="center", va="center")
    # a line for each row drawn, so the title is no wider than the strip
    legend = []
    if explanation.saf_beta is not None:
        legend.append("SAF $\\beta$: each alignment's weight, white 0 to red at its largest")
    if explanation.sgr_alignment is not None:
        legend.append("SGR final·raw: cosine of the reasoned read-out with each raw node, blue -1, white 0, red 1")
    if legend:
        axis.set_title("\n".join(legend), fontsize=8)

    # each token's attention over the image
    if lower is not None:
        panels = lower.subplots(panel_rows, columns, squeeze=False)
        for index, axis in enumerate(panels.flat):
            if index >= n_panels:
                axis.axis("off")
                continue
            _draw_picture(axis, layout, explanation.attention[index])
            # rounded first, so that a share of -0.001 reads +0.00 (a penalty model's are 0 or below)
            place = "" if explanation.place is None else f" ({round(float(explanation.place[index]), 2) + 0.0:+.2f})"
            axis.set_title(_short(tokens[index]) + place, fontsize=9)
        place_note = "" if explanation.place is None else \
            (f"; in brackets each token's share of the place term ({explanation.place_model}, logit"
             f"{penalty_note(explanation)}{other_place_terms(explanation)})")
        note = (f"attention of each token over the regions ({explanation.attention_model} model; {layout.source}); "
                f"brighter = more weight, the most attended region framed{place_note}")
        # wrapped as the title is (a data folder's name can be long): the picture keeps its width
        lower.suptitle(textwrap.fill(note, NOTE_CHARS_PER_LINE), fontsize=9)
    scores = ", ".join(f"{name} {value:.4f}" for name, value in explanation.scores.items())
    # wrapped, so that a long text (up to sgraf.api.MAX_TEXT_CHARS) does not widen the picture
    quoted = textwrap.fill(f"\u201c{explanation.text}\u201d", TITLE_CHARS_PER_LINE)
    figure.suptitle(title or f"{quoted}\nscore: {scores}", fontsize=11)
    if hasattr(out, "write"):
        figure.savefig(out, format="png", dpi=90, bbox_inches="tight")
        plt.close(figure)
        return out
    out = Path(out)
    try:
        with atomic_path(out) as temporary:
            figure.savefig(temporary, format="png", dpi=90, bbox_inches="tight")
    finally:
        plt.close(figure)
    logger.info("wrote %s", out)
    return out


def image_label(explanation: "Explanation") -> str:
    """'image 7', 'image 7 (beach.jpg)' where the picture has a name, or 'image'."""
    if explanation.image_id is None:
        return "image"
    name = explanation.image_name
    return f"image {explanation.image_id}" + (f" ({_short(name, 40)})" if name else "")


def _short(label: str, limit: int = LABEL_CHARS) -> str:
    """A word as a label: a long one cut (a word can be any length), so it cannot widen the picture."""
    return label if len(label) <= limit else label[:limit - 1] + "\u2026"


def _draw_picture(axis: Any, layout: RegionLayout, weights: np.ndarray | None) -> None:
    axis.set_xticks([])
    axis.set_yticks([])
    if layout.image is None:
        rows, cols = layout.grid
        values = np.zeros((rows, cols)) if weights is None else weights.reshape(rows, cols)
        axis.imshow(values, cmap="magma", vmin=0, vmax=max(float(values.max()), 1e-12), interpolation="nearest")
        return
    width, height = layout.picture_size
    extent = (-0.5, width - 0.5, height - 0.5, -0.5)    # the drawn copy over the picture's own pixels
    if weights is None:
        axis.imshow(layout.image, extent=extent)
        if layout.kind == "boxes":   # every region's box, thin: where the model's positions come from
            for x0, y0, x1, y1 in layout.boxes:
                axis.add_patch(_rectangle(x0, y0, x1 - x0, y1 - y0, colour="deepskyblue", width=0.6))
        return
    heat = layout.heatmap(weights)
    heat = heat / max(float(heat.max()), 1e-12)
    # darken the picture where attention is low: the attended regions stay visible
    shade = 0.25 + 0.75 * heat[..., None]
    axis.imshow((layout.image.astype(np.float64) * shade).astype(np.uint8), extent=extent)
    if layout.kind == "grid":
        rows, cols = layout.grid
        best = int(np.argmax(weights))
        r, c = divmod(best, cols)
        axis.add_patch(_rectangle(c * width / cols, r * height / rows, width / cols, height / rows))
    else:
        x0, y0, x1, y1 = layout.boxes[int(np.argmax(weights))]
        axis.add_patch(_rectangle(x0, y0, x1 - x0, y1 - y0))


def _rectangle(x: float, y: float, w: float, h: float, colour: str = "yellow", width: float = 1.5) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((x - 0.5, y - 0.5), w, h, fill=False, edgecolor=colour, linewidth=width)


def other_place_terms(explanation: Explanation) -> str:
    """The other place models' terms where an ensemble holds several, as '; saf's term -0.494'
    (the shares drawn are `place_model`'s alone); else ''."""
    return "".join(f"; {label}'s term {value + 0.0:+.3f}" for label, value in explanation.place_terms.items()
                   if label != explanation.place_model)


def penalty_note(explanation: Explanation) -> str:
    """What a penalty's term left out where it zeroed a signed term above 0
    (`Explanation.place_signed`), as ', a penalty: the signed term +0.600 adds nothing'; else ''."""
    signed = None if explanation.place_signed is None else float(explanation.place_signed.sum())
    if signed is None or signed <= 0:
        return ""
    return f", a penalty: the signed term {signed:+.3f} adds nothing"
