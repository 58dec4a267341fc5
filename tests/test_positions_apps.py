"""Region positions in the applications: Matcher, index, search, explain and serve (issue 21).

A model with positions (`ModelConfig.positions != 'none'`) reads each region's box in its image
encoder; everything that encodes images for it must pass the boxes, and refuse in one line when
the data has none.
"""

from __future__ import annotations

import io
import json
import re
import shutil

import numpy as np
import pytest
import torch

from numerics import REORDERED, SAME_PATH, assert_close
from sgraf.api import Matcher
from sgraf.checkpoint import load_model, save_model
from sgraf.cli import main
from sgraf.config import ModelConfig
from sgraf.data.boxes import write_boxes
from sgraf.data.vocab import Vocabulary
from sgraf.errors import InputError
from sgraf.explain import explain_pair
from sgraf.model.positions import PLACE_GAIN
from sgraf.model.sgraf import SGRAF
from sgraf.search import build_index, open_index

pytestmark = pytest.mark.numeric

WORDS = "a dog cat left of right above below red blue square circle the".split()
N_IMG, CAPS, K, IMG_DIM, SIDE = 6, 2, 4, 10, 64


def _model(module: str, positions: str, vocab: Vocabulary, seed: int) -> SGRAF:
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=len(vocab), img_dim=IMG_DIM, word_dim=8, embed_size=16, sim_dim=8,
                         num_regions=K, module=module, sgr_step=2, positions=positions)
    model = SGRAF(config)
    for parameter in model.parameters():   # positions' layers too: no zero-initialised no-op
        if parameter.dim() > 1:
            parameter.data.normal_(0, 0.3)
    if positions == "place":   # the place term's directions are PLACE_GAIN x its weights
        model.sim_enc.place_term.relation.weight.data /= PLACE_GAIN
    model.vocab = vocab
    return model.eval()


def _grid_pixels() -> np.ndarray:
    """(N_IMG, K, 4) pixel boxes: a 2 x 2 grid of a SIDE x SIDE picture, the regions shuffled per image."""
    rng = np.random.default_rng(5)
    cells = np.array([[0, 0, 32, 32], [32, 0, 64, 32], [0, 32, 32, 64], [32, 32, 64, 64]], np.float32)
    return np.stack([cells[rng.permutation(K)] for _ in range(N_IMG)])


@pytest.fixture(scope="module")
def gallery(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("positions")
    rng = np.random.default_rng(3)
    features = rng.standard_normal((N_IMG, K, IMG_DIM)).astype(np.float32)
    captions = [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 7)))) for _ in range(N_IMG * CAPS)]
    plain, boxed = root / "plain", root / "boxed"   # the same split without and with boxes
    for folder in (plain, boxed):
        folder.mkdir()
        np.save(folder / "test_ims.npy", features)
        (folder / "test_caps.txt").write_text("\n".join(captions) + "\n")
    pixels = _grid_pixels()
    write_boxes(boxed, "test", pixels, np.full((N_IMG, 2), SIDE, np.float32))
    vocab = Vocabulary.from_words(WORDS)
    paths = {}
    for name, module, positions, seed in (("box", "sgr", "box", 1), ("plain", "saf", "none", 2),
                                          ("relation", "saf", "relation", 3), ("place", "joint", "place", 4)):
        paths[name] = root / f"{name}.pt"
        save_model(_model(module, positions, vocab, seed), paths[name], vocab=vocab)
    return {"root": root, "plain": plain, "boxed": boxed, "features": features, "captions": captions,
            "boxes": pixels / SIDE, "paths": paths, "vocab": vocab}


def _reference(models, features, boxes, captions, vocab) -> np.ndarray:
    """Each model's own validated `SGRAF.score` (boxes given to those that read them), averaged."""
    ids = [vocab.encode(c) for c in captions]
    lengths = torch.tensor([len(i) for i in ids])
    padded = torch.zeros(len(ids), int(lengths.max()), dtype=torch.int64)
    for row, caption in enumerate(ids):
        padded[row, :len(caption)] = torch.tensor(caption)
    images, boxes = torch.from_numpy(features), torch.from_numpy(np.asarray(boxes, np.float32))
    return np.mean([m.score(images, padded, lengths, boxes=boxes).numpy() for m in models], axis=0)


def test_a_checkpoint_records_that_its_model_needs_boxes(gallery):
    assert load_model(gallery["paths"]["box"]).needs_boxes
    assert not load_model(gallery["paths"]["plain"]).needs_boxes
    matcher = Matcher.load([gallery["paths"]["plain"], gallery["paths"]["box"]])
    assert matcher.needs_boxes and matcher.identities[1]["config"]["positions"] == "box"
    assert not Matcher.load(gallery["paths"]["plain"]).needs_boxes


def test_matcher_scores_with_boxes_as_the_models_do_and_boxes_matter(gallery):
    matcher = Matcher.load([gallery["paths"]["box"], gallery["paths"]["plain"], gallery["paths"]["relation"],
                            gallery["paths"]["place"]])
    texts = gallery["captions"][:5]
    scores = matcher.score(gallery["features"], texts, boxes=gallery["boxes"])
    expected = _reference(matcher.models, gallery["features"], gallery["boxes"], texts, gallery["vocab"])
    assert_close(scores, expected, REORDERED)
    moved = gallery["boxes"][:, ::-1].copy()   # the regions' places exchanged, the features not
    assert np.abs(matcher.score(gallery["features"], texts, boxes=moved) - scores).max() > 1e-3
    # the model without positions ignores boxes: the same score with or without them
    plain = Matcher.load(gallery["paths"]["plain"])
    assert_close(plain.score(gallery["features"], texts, boxes=moved), plain.score(gallery["features"], texts),
                 SAME_PATH)


def test_matcher_refuses_images_without_boxes_or_with_bad_ones(gallery):
    matcher = Matcher.load([gallery["paths"]["plain"], gallery["paths"]["box"]])
    with pytest.raises(InputError, match=r"^model 2 \(sgr, positions='box'\) reads region positions and needs "
                                         r"each region's box \(n_images, K, 4\) normalised to \[0, 1\]; got images "
                                         r"without boxes \(a PrecompSplit's boxes are None where a file is "
                                         r"missing: split.read_boxes\(required=True\) names it\)$"):
        matcher.encode_images(gallery["features"])
    bad = gallery["boxes"].copy()
    bad[3, 2] = [0.5, 0.2, 0.25, 0.9]
    with pytest.raises(InputError, match=r"^boxes: the box of image 3, region 2 \[0\.5, 0\.2, 0\.25, 0\.9\] has "
                                         r"x2 < x1 or y2 < y1; expected"):
        matcher.encode_images(gallery["features"], boxes=bad)
    bad[3, 2] = [0, 0, 1.5, 1]
    with pytest.raises(InputError, match=r"image 3, region 2 .* lies outside \[0, 1\]"):
        matcher.encode_images(gallery["features"], boxes=bad)
    with pytest.raises(InputError, match=r"boxes must have shape \(6, 4, 4\) .* got \(6, 3, 4\)"):
        matcher.encode_images(gallery["features"], boxes=gallery["boxes"][:, :3])
    with pytest.raises(InputError, match=r"boxes must have shape \(6, 4, 4\) .* got \(4, 4\)$"):   # as passed
        matcher.encode_images(gallery["features"], boxes=gallery["boxes"][0])


def test_the_index_of_a_model_with_positions_scores_as_the_model_with_boxes(gallery, tmp_path, capsys):
    index_dir = tmp_path / "index"
    assert main(["index", "--checkpoint", str(gallery["paths"]["box"]), "--checkpoint",
                 str(gallery["paths"]["plain"]), "--checkpoint", str(gallery["paths"]["place"]), "--data",
                 str(gallery["boxed"]), "--split", "test", "--out", str(index_dir)]) == 0
    manifest = json.loads((index_dir / "manifest.json").read_text())
    assert manifest["files"]["image_boxes.npy"]["shape"] == [N_IMG, K, 4]
    index = open_index(index_dir)
    np.testing.assert_array_equal(index.image_boxes, gallery["boxes"].astype(np.float32))
    reference = _reference(index.matcher.models, gallery["features"], gallery["boxes"], gallery["captions"],
                           gallery["vocab"])
    query = "a red square left of the blue circle"
    text_reference = _reference(index.matcher.models, gallery["features"], gallery["boxes"], [query],
                                gallery["vocab"])[:, 0]
    hits = index.search_text(query, top_k=N_IMG, shortlist=None)
    assert [h.id for h in hits] == np.lexsort((np.arange(N_IMG), -text_reference)).tolist()
    assert_close([h.score for h in hits], text_reference[[h.id for h in hits]], REORDERED)
    hits = index.search_image(image_id=2, top_k=4, shortlist=None)
    assert_close([h.score for h in hits], reference[2, [h.id for h in hits]], REORDERED)
    # a new image's features: its boxes are needed, and then it scores as the stored one
    new = index.search_image(features=gallery["features"][2], boxes=gallery["boxes"][2], top_k=4, shortlist=None)
    assert [h.id for h in new] == [h.id for h in hits]
    with pytest.raises(InputError, match=r"model 1 \(sgr, positions='box'\), model 3 \(joint, positions='place'\) "
                                         r"read region positions"):
        index.search_image(features=gallery["features"][2], top_k=4)
    capsys.readouterr()
    assert main(["search", "--index", str(index_dir), "--text", query, "--top-k", "2", "--json"]) == 0
    assert [h["id"] for h in json.loads(capsys.readouterr().out)] == [h.id for h in index.search_text(query, 2)]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


def test_index_and_explain_refuse_data_without_boxes_for_a_model_with_positions(gallery, tmp_path, capsys):
    box = str(gallery["paths"]["box"])
    assert main(["index", "--checkpoint", box, "--data", str(gallery["plain"]), "--split", "test", "--out",
                 str(tmp_path / "index")]) == 2
    assert _one_line_error(capsys).startswith(f"sgraf index: error: {gallery['plain'] / 'test_boxes.npy'}: "
                                              "missing file; this model uses region positions")
    assert not (tmp_path / "index").exists()
    assert main(["explain", "--checkpoint", box, "--data", str(gallery["plain"]), "--split", "test", "--image-id",
                 "1", "--text", "a red square", "--out", str(tmp_path / "e.png")]) == 2
    assert "test_boxes.npy: missing file; this model uses region positions" in _one_line_error(capsys)
    assert not (tmp_path / "e.png").exists()
    # boxes without the sizes (written before sizes were recorded): the sizes file is named
    old = tmp_path / "old"
    shutil.copytree(gallery["boxed"], old)
    (old / "test_image_sizes.npy").unlink()
    assert main(["index", "--checkpoint", box, "--data", str(old), "--split", "test", "--out",
                 str(tmp_path / "index")]) == 2
    assert f"{old / 'test_image_sizes.npy'}: missing file" in _one_line_error(capsys)
    # a model without positions indexes the same data as before
    assert main(["index", "--checkpoint", str(gallery["paths"]["plain"]), "--data", str(gallery["plain"]),
                 "--split", "test", "--out", str(tmp_path / "index")]) == 0
    assert "image_boxes.npy" not in json.loads((tmp_path / "index" / "manifest.json").read_text())["files"]


def test_an_index_without_the_boxes_its_model_needs_is_refused(gallery, tmp_path, capsys):
    matcher = Matcher.load(gallery["paths"]["box"])
    with pytest.raises(InputError, match="reads region positions and needs each region's box"):
        build_index(matcher, gallery["features"], gallery["captions"], tmp_path / "index")
    build_index(matcher, gallery["features"], gallery["captions"], tmp_path / "index", boxes=gallery["boxes"])
    manifest_path = tmp_path / "index" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["files"]["image_boxes.npy"]             # an index that lost its boxes
    manifest_path.write_text(json.dumps(manifest))
    (tmp_path / "index" / "image_boxes.npy").unlink()
    message = (f"index {tmp_path / 'index'} holds no image_boxes.npy, but model 1 (sgr, positions='box') reads "
               "region positions; rebuild the index with `sgraf index` from data with boxes")
    with pytest.raises(InputError, match=f"^{re.escape(message)}$"):
        open_index(tmp_path / "index", matcher=matcher)
    capsys.readouterr()
    for command, query in (("search", ["--text", "a dog"]), ("serve", [])):   # serve opens it as search does
        assert main([command, "--index", str(tmp_path / "index"), *query]) == 2
        assert _one_line_error(capsys) == f"sgraf {command}: error: {message}"


def test_a_damaged_boxes_file_of_an_index_is_named(gallery, tmp_path):
    matcher = Matcher.load(gallery["paths"]["box"])
    build_index(matcher, gallery["features"], gallery["captions"], tmp_path / "index", boxes=gallery["boxes"])
    target = tmp_path / "index" / "image_boxes.npy"
    intact = target.read_bytes()
    target.write_bytes(intact[:-8])
    with pytest.raises(InputError, match=rf"^{target}: corrupted index file, \d+ bytes where the manifest"):
        open_index(tmp_path / "index", matcher=matcher)
    # boxes that cannot be positions (the sizes kept: verify=False reads no checksum) are named with
    # their image at opening, not at the request that reads them (as image 0)
    for value, problem in ((float("nan"), "is not finite"), (250.0, r"lies outside \[0, 1\]")):
        boxes = np.load(io.BytesIO(intact))
        boxes[4, 3, 2] = value
        with open(target, "wb") as handle:
            np.save(handle, boxes)
        with pytest.raises(InputError, match=rf"^{target}: corrupted index file, the box of image 4, region 3 "
                                             rf"\[.*\] {problem}; expected .*; rebuild the index$"):
            open_index(tmp_path / "index", matcher=matcher, verify=False)


def test_explain_with_boxes_scores_as_the_model_and_draws_the_boxes(gallery, tmp_path, capsys):
    matcher = Matcher.load([gallery["paths"]["box"], gallery["paths"]["plain"], gallery["paths"]["place"]])
    text = "a red square left of the blue circle"
    explanation = explain_pair(matcher, gallery["features"][4], text, boxes=gallery["boxes"][4])
    expected = _reference(matcher.models, gallery["features"][4:5], gallery["boxes"][4:5], [text],
                          gallery["vocab"])[0, 0]
    assert_close(explanation.scores["ensemble"], expected, REORDERED, scale=1.0)
    # the place model's term, word by word: the shares sum to the term the model adds to its logit
    place = matcher.models[2]
    ids = torch.tensor([gallery["vocab"].encode(text)])
    lengths = torch.tensor([ids.shape[1]])
    regions, centres = place.split_places(place.encode_images(torch.from_numpy(gallery["features"][4:5]),
                                                              torch.from_numpy(gallery["boxes"][4:5]).float()))
    words = place.encode_captions(ids, lengths)
    with torch.no_grad():
        term = place.sim_enc.place_offset(regions, centres, words, torch.ones(1, ids.shape[1], dtype=torch.bool))
    assert explanation.place_model in explanation.scores and explanation.place_model != "ensemble"
    assert explanation.place.shape == (ids.shape[1],) and abs(float(term) - explanation.place.sum()) < 1e-4
    assert abs(float(term)) > 1e-3
    with pytest.raises(InputError, match=r"positions='place'\) read region positions and need each region's box "
                                         r"\(K, 4\) normalised"):      # explain takes one image's, (K, 4)
        explain_pair(matcher, gallery["features"][4], text)
    with pytest.raises(InputError, match=r"must have shape \(\d+, 4\) or \(1, \d+, 4\)"):
        explain_pair(matcher, gallery["features"][4], text, boxes=gallery["boxes"][4][:2])
    out = tmp_path / "explain.png"
    assert main(["explain", "--checkpoint", str(gallery["paths"]["box"]), "--data", str(gallery["boxed"]),
                 "--split", "test", "--image-id", "4", "--text", text, "--out", str(out)]) == 0
    assert "regions: region boxes of test_boxes.npy" in capsys.readouterr().out and out.stat().st_size > 0


def test_serve_explains_with_the_boxes_the_index_encoded_with(gallery, tmp_path):
    pytest.importorskip("fastapi")
    from sgraf.serve.service import SearchService

    index_dir = tmp_path / "index"
    assert main(["index", "--checkpoint", str(gallery["paths"]["box"]), "--checkpoint", str(gallery["paths"]["place"]),
                 "--data", str(gallery["boxed"]), "--split", "test", "--out", str(index_dir), "--quiet"]) == 0
    service = SearchService.open(index_dir, shortlist=N_IMG)
    text = "a blue circle above the red square"
    answer = service.explain(3, text)
    expected = explain_pair(service.matcher, gallery["features"][3], text, boxes=gallery["boxes"][3])
    assert answer["scores"]["sgr"] == pytest.approx(expected.scores["sgr"], abs=1e-6)
    assert answer["regions"]["kind"] == "boxes"
    np.testing.assert_allclose(answer["regions"]["boxes"], _grid_pixels()[3])
    results = service.search_text(text, top_k=3)["results"]
    assert [r["id"] for r in results] == [h.id for h in service.index.search_text(text, 3, shortlist=N_IMG)]


def test_the_commands_of_the_positions_apps_page_parse():
    import pathlib
    import shlex

    from sgraf.cli import build_parser

    text = (pathlib.Path(__file__).parents[1] / "docs" / "positions-apps.md").read_text(encoding="utf-8")
    commands = [shlex.split(line)[1:] for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
                for line in block.replace("\\\n", " ").splitlines() if line.startswith("sgraf ")]   # as bash joins
    assert {c[0] for c in commands} == {"convert-tsv", "extract", "generate", "train", "index", "search", "serve",
                                        "explain"}
    parser = build_parser()
    for words in commands:
        parser.parse_args(words)   # an unknown flag or a bad value exits here
