"""Explanations: the quantities rebuild the model's own scores; the picture is written."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from PIL import Image

from numerics import REORDERED, approx, assert_close
from sgraf.api import Matcher
from sgraf.checkpoint import save_model
from sgraf.cli import main
from sgraf.config import ModelConfig
from sgraf.data.vocab import Vocabulary
from sgraf.errors import InputError
from sgraf.explain import (explain_pair, region_layout, render_explanation, saf_node_weights, sgr_final_vs_raw,
                           word_region_attention)
from sgraf.model.norms import l2norm
from sgraf.model.similarity import attend_regions
from sgraf.model.sgraf import SGRAF

pytestmark = pytest.mark.numeric

WORDS = "a red blue square circle left of the right above".split()
K, IMG_DIM = 9, 10


def _model(module: str, vocab: Vocabulary, seed: int, alignments: str = "both") -> SGRAF:
    torch.manual_seed(seed)
    model = SGRAF(ModelConfig(vocab_size=len(vocab), img_dim=IMG_DIM, word_dim=8, embed_size=12, sim_dim=6,
                              num_regions=K, module=module, sgr_step=3, alignments=alignments))
    for bn in model.modules():
        if isinstance(bn, torch.nn.BatchNorm1d):
            bn.running_mean.normal_(0, 0.3)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.data.uniform_(0.5, 1.5)
    model.vocab = vocab
    return model.eval()


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return Vocabulary.from_words(WORDS)


@pytest.fixture(scope="module")
def image() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((K, IMG_DIM)).astype(np.float32)


def _pair(model: SGRAF, vocab: Vocabulary, image: np.ndarray, text: str):
    ids = torch.tensor([vocab.encode(text)])
    lengths = torch.tensor([ids.shape[1]])
    with torch.no_grad():
        regions = model.encode_images(torch.from_numpy(image)[None])
        words = model.encode_captions(ids, lengths)
        nodes, _ = model.sim_enc(regions, words, torch.ones(1, ids.shape[1], dtype=torch.bool))
        score = float(model.similarity(regions, words, lengths)[0, 0])
    return regions, words, nodes[0, 0], score


def test_attention_weights_rebuild_the_models_attended_context(vocab, image):
    model = _model("sgr", vocab, 0)
    regions, words, _, _ = _pair(model, vocab, image, "a red square left of the blue circle")
    with torch.no_grad():
        alpha = word_region_attention(regions[0], words[0], model.sim_enc.smooth)     # (L, K)
        expected = attend_regions(regions, words, model.sim_enc.smooth)[0, 0]          # (L, d)
    assert_close(alpha.sum(dim=1), torch.ones(alpha.shape[0]), REORDERED)
    assert_close(l2norm(alpha @ regions[0]), expected, REORDERED)


def test_saf_weights_rebuild_the_saf_score(vocab, image):
    model = _model("saf", vocab, 1)
    _, _, nodes, score = _pair(model, vocab, image, "the circle above a square")
    with torch.no_grad():
        beta = saf_node_weights(model.sim_enc.SAF_module, nodes)
        rebuilt = torch.sigmoid(model.sim_enc.sim_eval_w(l2norm((beta[:, None] * nodes).sum(0))))
    assert beta.shape == (nodes.shape[0],) and float(beta.sum()) == approx(1.0, REORDERED)
    assert float(rebuilt) == approx(score, REORDERED)


@pytest.mark.parametrize("alignments", ["both", "local"])
def test_sgr_readout_rebuilds_the_sgr_score(vocab, image, alignments):
    model = _model("sgr", vocab, 2, alignments=alignments)
    _, _, nodes, score = _pair(model, vocab, image, "a blue square right of a red circle")
    with torch.no_grad():
        readout, cosines = sgr_final_vs_raw(model.sim_enc.SGR_module, nodes, model.sim_enc.use_global)
        rebuilt = torch.sigmoid(model.sim_enc.sim_eval_w(readout))
    assert float(rebuilt) == approx(score, REORDERED)
    expected = torch.nn.functional.cosine_similarity(readout[None], nodes, dim=1)
    assert_close(cosines, expected, REORDERED)


def test_explain_pair_of_an_ensemble(vocab, image):
    sgr, saf = _model("sgr", vocab, 3), _model("saf", vocab, 4)
    matcher = Matcher([sgr, saf])
    text = "a red square left of the blue circle"
    explanation = explain_pair(matcher, image, text)
    n_tokens = len(vocab.tokenize(text)) + 2
    assert explanation.tokens[0] == "<start>" and explanation.tokens[-1] == "<end>"
    assert explanation.node_labels == ["[global]", *explanation.tokens]
    assert explanation.attention.shape == (n_tokens, K) and explanation.attention_model == "sgr"
    assert explanation.saf_beta.shape == explanation.sgr_alignment.shape == (n_tokens + 1,)
    scores = matcher.score(image[None], [text])[0, 0]
    assert explanation.scores["ensemble"] == approx(float(scores), REORDERED)
    assert set(explanation.scores) == {"sgr", "saf", "ensemble"}
    with pytest.raises(InputError, match="'green' not in the model's vocabulary"):
        explain_pair(matcher, image, "a green square")


def test_region_layout_prefers_boxes_then_images_then_a_grid(tmp_path):
    assert region_layout(tmp_path, "test", 0, 36).source.startswith("no image found: 6 x 6")
    images = tmp_path / "images" / "test"
    images.mkdir(parents=True)
    Image.new("RGB", (60, 30), (10, 200, 10)).save(images / "00001.png")
    layout = region_layout(tmp_path, "test", 1, 6)
    assert layout.kind == "grid" and layout.grid == (2, 3) and layout.image.shape == (30, 60, 3)
    heat = layout.heatmap(np.arange(6, dtype=float))
    assert heat.shape == (30, 60) and heat[0, 0] == 0 and heat[29, 59] == 5 and heat[0, 25] == 1
    boxes = np.zeros((2, 6, 4), np.float32)
    boxes[1, :, 2:] = 10
    boxes[1, 5] = [20, 5, 40, 25]
    np.save(tmp_path / "test_boxes.npy", boxes)
    layout = region_layout(tmp_path, "test", 1, 6)
    assert layout.kind == "boxes" and layout.image.shape == (30, 60, 3)   # the picture, under the boxes
    (images / "00001.png").unlink()
    (tmp_path / "test_image_ids.txt").write_text("17\t50\t40\n18\t64\t48\n")
    layout = region_layout(tmp_path, "test", 1, 6)
    assert layout.kind == "boxes" and layout.image.shape == (48, 64, 3)   # blank canvas of the image's size
    heat = layout.heatmap(np.array([0, 0, 0, 0, 0, 1.0]))
    assert heat[10, 30] == 1 and heat[2, 2] == 0 and heat.sum() == 20 * 20
    np.save(tmp_path / "test_image_sizes.npy", np.array([[50, 40], [70, 45]], np.float32))
    boxes[0, :, 2:] = 10                      # image 0's boxes were points at the corner
    np.save(tmp_path / "test_boxes.npy", boxes)
    layout = region_layout(tmp_path, "test", 1, 6)
    assert layout.kind == "boxes" and layout.picture_size == (70, 45)     # the sizes file's, first
    (tmp_path / "test_image_sizes.npy").unlink()
    with pytest.raises(InputError, match=r"test_boxes\.npy: expected \(n_images, 9, 4\)"):
        region_layout(tmp_path, "test", 1, 9)


@pytest.mark.parametrize("damage", ["garbage", "nan", "swapped", "divided"])
def test_a_damaged_boxes_file_is_an_error_or_for_a_server_drawn_without(tmp_path, caplog, damage):
    """`sgraf serve` (skip_unreadable) had answered 400 to a request, as if the client had erred;
    with picture sizes beside them the boxes are checked as a model with positions reads them (a
    position-free model's explanation had drawn swapped or divided boxes without a word)."""
    images = tmp_path / "images" / "test"
    images.mkdir(parents=True)
    Image.new("RGB", (60, 30), (10, 200, 10)).save(images / "00001.png")
    boxes = np.tile(np.array([0, 0, 10, 10], np.float32), (2, 6, 1))
    np.save(tmp_path / "test_boxes.npy", boxes)
    np.save(tmp_path / "test_image_sizes.npy", np.array([[60, 30], [60, 30]], np.float32))
    path = tmp_path / "test_boxes.npy"
    if damage == "garbage":
        path.write_bytes(b"\x00" * 200)
    elif damage == "nan":
        boxes[1, 2, 0] = np.nan
    elif damage == "swapped":
        boxes[0, 3] = [9, 0, 2, 10]           # another image's box: the whole file is checked
    else:
        boxes /= 60.0
    if damage != "garbage":
        np.save(path, boxes)
    expected = {"garbage": "not a readable .npy array", "nan": "the box of image 1, region 2 is [nan",
                "swapped": "the box of image 0, region 3 is [9.0, 0.0, 2.0, 10.0]; expected x2 >= x1",
                "divided": "every box lies within the first pixel of its picture"}[damage]
    with pytest.raises(InputError, match=re.escape(expected)):
        region_layout(tmp_path, "test", 1, 6)
    with caplog.at_level("WARNING", logger="sgraf.explain"):
        layout = region_layout(tmp_path, "test", 1, 6, skip_unreadable=True)
    assert layout.kind == "grid" and layout.image.shape == (30, 60, 3)      # the picture, without the boxes
    assert any(expected in r.getMessage() and "drawn without the boxes" in r.getMessage() for r in caplog.records)


def test_cli_explain_writes_a_png(vocab, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    np.save(data / "test_ims.npy", rng.standard_normal((3, K, IMG_DIM)).astype(np.float32))
    (data / "test_caps.txt").write_text("a red square\nthe blue circle\na circle above a square\n")
    save_model(_model("sgr", vocab, 5), tmp_path / "sgr.pt", vocab=vocab)
    save_model(_model("saf", vocab, 6), tmp_path / "saf.pt", vocab=vocab)
    out = tmp_path / "pics" / "explain.png"
    argv = ["explain", "--checkpoint", str(tmp_path / "sgr.pt"), "--checkpoint", str(tmp_path / "saf.pt"),
            "--data", str(data), "--split", "test", "--text", "a red square left of the circle", "--out", str(out)]
    assert main([*argv, "--image-id", "2"]) == 0
    printed = capsys.readouterr().out
    with Image.open(out) as picture:
        assert picture.format == "PNG" and picture.size[0] > 600 and picture.size[1] > 300
    assert "[global]" in printed and "ensemble" in printed and "3 x 3 region grid" in printed
    assert main([*argv, "--image-id", "3"]) == 2
    assert "--image-id 3 is out of range" in capsys.readouterr().err


def test_render_explanation_without_attention_or_heads(vocab, image, tmp_path):
    model = _model("ave", vocab, 7, alignments="global")
    explanation = explain_pair(Matcher([model]), image, "a red square")
    assert explanation.attention is None and explanation.saf_beta is None and explanation.sgr_alignment is None
    out = render_explanation(explanation, region_layout(None, None, 0, K), tmp_path / "x.png")
    assert out.stat().st_size > 1000


def test_the_weight_row_is_a_strip_and_the_notes_keep_the_picture_narrow(vocab, image, monkeypatch):
    """One model's single weight row is about 0.6 inch tall (it had filled the 4 inches beside the
    picture), and the attention panels' note, with a place model's and a long folder's words,
    wraps instead of widening the picture (1,181 px before); a share of -0.001 reads +0.00."""
    import dataclasses
    import io

    from sgraf import plotting

    explanation = explain_pair(Matcher([_model("sgr", vocab, 3)]), image, "a red square left of the circle")
    explanation = dataclasses.replace(explanation, place=np.full(len(explanation.tokens), -1e-3), place_model="sgr")
    layout = dataclasses.replace(region_layout(None, None, 0, K),
                                 source="region boxes of " + "d" * 60 + "/test_boxes.npy")
    figures = []
    monkeypatch.setattr(plotting._Figures, "close", lambda self, figure=None: figures.append(figure))
    picture = render_explanation(explanation, layout, io.BytesIO())
    assert Image.open(io.BytesIO(picture.getvalue())).size[0] <= 1000
    (figure,) = figures
    (strip,) = [axis for axis in figure.get_axes()
                if [label.get_text() for label in axis.get_yticklabels()] == ["SGR final·raw"]]
    height = strip.get_window_extent().height / figure.dpi
    assert 0.3 < height < 0.8, height
    titles = [axis.get_title() for axis in figure.get_axes() if axis.get_title().endswith(")")]
    assert len(titles) == len(explanation.tokens) and all(t.endswith(" (+0.00)") for t in titles), titles


def test_an_explanation_reads_in_one_line(vocab, image):
    explanation = explain_pair(Matcher([_model("sgr", vocab, 3)]), image, "a red square left of the circle")
    text = repr(explanation)
    assert text.startswith("Explanation(text='a red square left of the circle', image_id=None, scores={sgr: 0.")
    assert "\n" not in text and f"attention=<array ({len(explanation.tokens)}, {K})>" in text and len(text) < 400


def test_a_notebook_draws_an_explanation(vocab, image, tmp_path):
    """Jupyter shows an `Explanation` as its picture (`_repr_png_`, over the abstract grid of its
    regions); `render` draws it to a file, over a layout when given one."""
    import io

    explanation = explain_pair(Matcher([_model("sgr", vocab, 3)]), image, "a red square left of the circle")
    assert explanation.n_regions == K
    png = explanation._repr_png_()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and Image.open(io.BytesIO(png)).size[0] <= 1000
    assert explanation.render(tmp_path / "grid.png").read_bytes() == png      # the same picture
    layout = region_layout(None, None, 0, K)
    assert explanation.render(tmp_path / "x.png", layout, title="mine").stat().st_size > 1000
    bare = explain_pair(Matcher([_model("ave", vocab, 7, alignments="global")]), image, "a red square")
    assert bare.attention is None and bare.n_regions == K and bare._repr_png_()[:4] == b"\x89PNG"


def test_the_printed_table_has_no_negative_zero(vocab, image):
    import dataclasses

    from sgraf.cli.explain import format_explanation

    explanation = explain_pair(Matcher([_model("sgr", vocab, 3)]), image, "a red square left of the circle")
    tiny = np.full(len(explanation.tokens), -1e-4)
    text = format_explanation(dataclasses.replace(explanation, place=tiny, place_model="sgr",
                                                  sgr_alignment=np.full(len(explanation.node_labels), -2e-4)))
    assert "-0.000" not in text and "+0.000" in text and "place term -0.001" in text, text


def test_a_large_picture_is_drawn_from_a_reduced_copy_and_a_huge_or_broken_one_without(vocab, image, tmp_path,
                                                                                       monkeypatch, caplog):
    """A 12,000 x 12,000 gallery picture had taken 3 GB and over two minutes to explain: pictures
    are drawn from a copy of at most DRAW_SIDE pixels a side, over the picture's own pixels (the
    boxes keep theirs); one past MAX_PICTURE_PIXELS is not decoded."""
    import struct
    import zlib

    from sgraf import explain

    images = tmp_path / "images" / "test"
    images.mkdir(parents=True)
    Image.new("RGB", (3000, 1500), (10, 200, 10)).save(images / "00000.png")
    boxes = np.zeros((1, K, 4), np.float32)
    boxes[0, :, 2:] = 100
    boxes[0, K - 1] = [2000, 500, 3000, 1500]                  # the picture's last corner
    np.save(tmp_path / "test_boxes.npy", boxes)
    layout = region_layout(tmp_path, "test", 0, K)
    assert layout.image.shape == (512, 1024, 3) and layout.picture_size == (3000, 1500)
    heat = layout.heatmap(np.eye(K)[K - 1])
    assert heat.shape == (512, 1024) and heat[-1, -1] == 1 and heat[0, 0] == 0
    assert abs(heat.sum() - 1024 / 3 * 512 * 2 / 3) < 1024 + 512
    explanation = explain_pair(Matcher([_model("sgr", vocab, 3)]), image, "a red square left of the circle")
    assert explanation.render(tmp_path / "big.png", layout).stat().st_size > 1000
    # past the limit: not decoded, drawn without (a blank canvas of its size under the boxes), said
    monkeypatch.setattr(explain, "MAX_PICTURE_PIXELS", 1000)
    with caplog.at_level("WARNING", logger="sgraf.explain"):
        layout = region_layout(tmp_path, "test", 0, K)
    assert "a picture of 3000 x 1500 pixels, more than the 1,000 drawn; drawn without it" in caplog.text
    assert layout.kind == "boxes" and layout.picture_size == (3000, 1500) and int(layout.image.max()) == 235
    monkeypatch.undo()
    # a header claiming 20,000 x 20,000 pixels (Pillow's own limit): drawn without, said
    png = bytearray((images / "00000.png").read_bytes())
    ihdr = struct.pack(">II", 20000, 20000) + png[24:29]
    png[16:29] = ihdr
    png[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + bytes(ihdr)))
    (images / "00000.png").write_bytes(bytes(png))
    caplog.clear()
    with caplog.at_level("WARNING", logger="sgraf.explain"):
        assert int(region_layout(tmp_path, "test", 0, K).image.max()) == 235
    assert "drawn without it" in caplog.text
    # a broken picture: refused, or (a server's gallery) drawn without it
    (images / "00000.png").write_bytes(b"not a picture")
    with pytest.raises(InputError, match=r"00000\.png: not a readable image"):
        region_layout(tmp_path, "test", 0, K)
    assert region_layout(tmp_path, "test", 0, K, skip_unreadable=True).kind == "boxes"


def test_characters_the_font_lacks_draw_without_a_warning_per_character():
    """A server drawing its clients' texts had logged two lines for each new CJK character."""
    import io
    import warnings

    from sgraf.plotting import pyplot

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        figure = pyplot().figure()
        figure.add_subplot().set_title("\u9f98\u9f49\u9c7b \u7228\u9e1e")    # rare CJK characters
        figure.savefig(io.BytesIO(), format="png")
    assert not [w for w in caught if "missing from font" in str(w.message)], [str(w.message) for w in caught]
