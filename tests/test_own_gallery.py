"""A gallery of one's own pictures, end to end: `extract` keeps each picture (a copy, or the
upright RGB picture) where search, serve and explain find it, and the index gives each picture
its file name (an own-images walk: search had printed 'image 2', serve 'image': null, explain
grey boxes)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from torch import nn

from sgraf.checkpoint import save_model
from sgraf.cli import main
from sgraf.config import ModelConfig
from sgraf.data.features import GridBackbone, extract_folder
from sgraf.data.vocab import Vocabulary
from sgraf.model.sgraf import SGRAF

WORDS = "a red green blue ball field square sky".split()


def _backbone() -> GridBackbone:
    torch.manual_seed(0)
    return GridBackbone(nn.Conv2d(3, 4, kernel_size=32, stride=32), feature_dim=4, image_size=64, name="tiny")


@pytest.fixture(scope="module")
def own(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("own")
    photos = root / "photos"
    photos.mkdir()
    sideways = Image.new("RGB", (120, 40), (200, 200, 200))
    ImageDraw.Draw(sideways).ellipse([10, 5, 40, 35], fill=(220, 30, 30))
    exif = sideways.getexif()
    exif[0x0112] = 6                                                   # shown turned: 40 x 120
    sideways.save(photos / "phone shot.jpg", exif=exif)
    Image.new("RGB", (90, 60), (30, 200, 30)).save(photos / "field.jpg")
    Image.new("L", (50, 50), 128).save(photos / "grey.png")
    Image.new("RGBA", (64, 64), (0, 0, 255, 128)).save(photos / "square.png")
    names = ["phone shot.jpg", "field.jpg", "grey.png", "square.png"]
    captions = ["a red ball", "a green field", "a grey sky", "a blue square"]
    (root / "caps.tsv").write_text("".join(f"{n}\t{c}\n" for n, c in zip(names, captions)), encoding="utf-8")
    data = root / "data"
    extract_folder(photos, root / "caps.tsv", data, "test", _backbone(), progress=False)
    vocab = Vocabulary.from_words(WORDS)
    torch.manual_seed(1)
    model = SGRAF(ModelConfig(vocab_size=len(vocab), img_dim=4, word_dim=8, embed_size=16, sim_dim=8,
                              num_regions=4, module="sgr", sgr_step=2))
    model.vocab = vocab
    save_model(model.eval(), root / "sgr.pt", vocab=vocab)
    return {"root": root, "photos": photos, "data": data, "names": names, "captions": captions}


def test_extract_keeps_each_picture_as_a_browser_and_explain_show_it(own):
    pictures = own["data"] / "images" / "test"
    assert sorted(p.name for p in pictures.iterdir()) == ["00000.png", "00001.jpg", "00002.png", "00003.png"]
    assert (pictures / "00001.jpg").read_bytes() == (own["photos"] / "field.jpg").read_bytes()   # copied
    assert (pictures / "00002.png").read_bytes() == (own["photos"] / "grey.png").read_bytes()
    with Image.open(pictures / "00000.png") as upright:                  # the phone's shot, turned
        assert (upright.size, upright.mode) == ((40, 120), "RGB")
    with Image.open(pictures / "00003.png") as rgba:                     # RGBA: written as RGB
        assert rgba.mode == "RGB"
    sizes = np.load(own["data"] / "test_image_sizes.npy")
    assert sizes[0].tolist() == [40, 120]                                # the boxes are of the picture kept
    record = json.loads((own["data"] / ".sgraf-files.json").read_text())["files"]
    assert {f"images/test/{n}" for n in ("00000.png", "00001.jpg", "00002.png", "00003.png")} <= set(record)


def test_no_pictures_keeps_none(own, tmp_path, capsys):
    extract_folder(own["photos"], own["root"] / "caps.tsv", tmp_path / "d", "test", _backbone(), progress=False,
                   keep_pictures=False)
    assert not (tmp_path / "d" / "images").exists()
    assert main(["extract", "--images", str(own["photos"]), "--captions", str(own["root"] / "caps.tsv"), "--out",
                 str(tmp_path / "e"), "--split", "test", "--backbone", "missing-backbone", "--no-pictures"]) == 2
    assert "unknown backbone 'missing-backbone'" in capsys.readouterr().err   # the flag parsed, the backbone not


def test_search_serve_and_explain_show_the_pictures_and_their_names(own, capsys):
    index = own["root"] / "index"
    assert main(["index", "--checkpoint", str(own["root"] / "sgr.pt"), "--data", str(own["data"]), "--split", "test",
                 "--out", str(index)]) == 0
    capsys.readouterr()
    assert main(["search", "--index", str(index), "--text", "a red ball", "--top-k", "4", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert sorted(hit["name"] for hit in hits) == sorted(own["names"])
    assert main(["search", "--index", str(index), "--text", "a red ball", "--top-k", "4"]) == 0
    out = capsys.readouterr().out
    assert all(f"image {i} {name}" in out for i, name in enumerate(own["names"]))
    assert main(["search", "--index", str(index), "--image-id", "1", "--top-k", "2"]) == 0
    assert "image 1 (field.jpg) -> top 2 captions" in capsys.readouterr().out

    pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
    from fastapi.testclient import TestClient

    from sgraf.serve.app import create_app
    from sgraf.serve.service import SearchService

    with TestClient(create_app(SearchService.open(index, shortlist=4))) as client:
        results = client.get("/api/search", params={"text": "a red ball", "top_k": 4}).json()["results"]
        by_name = {hit["name"]: hit for hit in results}
        assert by_name["field.jpg"]["image"] == "/images/00001.jpg"
        assert client.get(by_name["field.jpg"]["image"]).content == (own["photos"] / "field.jpg").read_bytes()
        query = client.get("/api/search", params={"image_id": 0, "top_k": 2}).json()["query"]
        assert query == {"image_id": 0, "image": "/images/00000.png", "name": "phone shot.jpg"}
        regions = client.get("/api/explain", params={"image_id": 0, "text": "a red ball"}).json()["regions"]
        assert (regions["kind"], regions["width"], regions["height"]) == ("boxes", 40, 120)

    from sgraf.explain import region_layout

    layout = region_layout(own["data"], "test", 0, 4)
    assert layout.image.shape == (120, 40, 3) and layout.image[20, 20].tolist() != [235, 235, 235]
