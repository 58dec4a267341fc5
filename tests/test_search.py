"""Gallery index and two-stage search: agreement with exhaustive scoring, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from numerics import FLOAT16, REORDERED, approx, assert_close
from sgraf.api import Matcher, shortlist_keys
from sgraf.checkpoint import save_model
from sgraf.cli import main
from sgraf.config import ModelConfig
from sgraf.data.vocab import Vocabulary
from sgraf.errors import InputError
from sgraf.model.sgraf import SGRAF
from sgraf.search import build_index, open_index

pytestmark = pytest.mark.numeric

WORDS = "a dog cat runs on the grass man woman red blue ball plays with in park".split()
N_IMG, CAPS, K, IMG_DIM = 12, 5, 6, 12


def _model(module: str, vocab: Vocabulary, seed: int) -> SGRAF:
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=len(vocab), img_dim=IMG_DIM, word_dim=8, embed_size=16, sim_dim=8,
                         num_regions=K, module=module, sgr_step=2)
    model = SGRAF(config)
    # non-trivial BatchNorm statistics, so eval numerics matter
    for bn in model.modules():
        if isinstance(bn, torch.nn.BatchNorm1d):
            bn.running_mean.normal_(0, 0.2)
            bn.running_var.uniform_(0.5, 2.0)
    model.vocab = vocab
    return model.eval()


@pytest.fixture(scope="module")
def gallery(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gallery")
    rng = np.random.default_rng(3)
    data = root / "data"
    data.mkdir()
    features = rng.standard_normal((N_IMG, K, IMG_DIM)).astype(np.float32)
    captions = [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 9)))) for _ in range(N_IMG * CAPS)]
    np.save(data / "test_ims.npy", features)
    (data / "test_caps.txt").write_text("\n".join(captions) + "\n")
    vocab = Vocabulary.from_words(WORDS)
    paths = []
    for module, seed in (("sgr", 1), ("saf", 2)):
        path = root / f"{module}.pt"
        save_model(_model(module, vocab, seed), path, vocab=vocab)
        paths.append(str(path))
    index = root / "index"
    assert main(["index", "--checkpoint", paths[0], "--checkpoint", paths[1], "--data", str(data),
                 "--split", "test", "--out", str(index)]) == 0
    return {"root": root, "data": data, "features": features, "captions": captions, "paths": paths,
            "index": index, "vocab": vocab}


def _exhaustive(matcher: Matcher, features: np.ndarray, captions: list[str]) -> np.ndarray:
    """Reference: each model's validated `score` on raw inputs, averaged. (n_img, n_cap)."""
    ids = [matcher.vocab.encode(c) for c in captions]
    lengths = torch.tensor([len(i) for i in ids])
    padded = torch.zeros(len(ids), int(lengths.max()), dtype=torch.int64)
    for row, caption in enumerate(ids):
        padded[row, :len(caption)] = torch.tensor(caption)
    images = torch.from_numpy(features)
    return np.mean([m.score(images, padded, lengths).numpy() for m in matcher.models], axis=0)


def test_text_search_with_whole_gallery_shortlist_is_exhaustive_ranking(gallery):
    index = open_index(gallery["index"])
    query = "a man plays with the red ball"
    reference = _exhaustive(index.matcher, gallery["features"], [query])[:, 0]     # (n_img,)
    expected = np.lexsort((np.arange(N_IMG), -reference))
    hits = index.search_text(query, top_k=N_IMG, shortlist=N_IMG)
    assert [h.id for h in hits] == expected.tolist()
    assert repr(index) == f"GalleryIndex({index.folder}: {N_IMG} images, {N_IMG * CAPS} captions, 2 model(s))"
    # more than the gallery holds asks for all of it, whatever the shortlist (it had been refused, naming a
    # shortlist never set); a shortlist below top_k still is
    for top_k, shortlist in ((1000, None), (1000, 100), (N_IMG + 1, N_IMG)):
        assert index.search_text(query, top_k=top_k, shortlist=shortlist) == hits
    with pytest.raises(InputError, match=r"shortlist \(5\) must be at least top_k \(8\)"):
        index.search_text(query, top_k=8, shortlist=5)
    assert_close([h.score for h in hits], reference[expected], REORDERED)
    assert hits[0].text == gallery["captions"][hits[0].id * CAPS]


def test_image_search_with_whole_gallery_shortlist_is_exhaustive_ranking(gallery):
    index = open_index(gallery["index"])
    reference = _exhaustive(index.matcher, gallery["features"][4:5], gallery["captions"])[0]
    expected = np.lexsort((np.arange(len(reference)), -reference))[:15]
    hits = index.search_image(image_id=4, top_k=15, shortlist=None)
    assert [h.id for h in hits] == expected.tolist()
    assert_close([h.score for h in hits], reference[expected], REORDERED)
    assert [h.text for h in hits] == [gallery["captions"][i] for i in expected]


def test_shortlist_keeps_the_best_global_vectors_then_reranks(gallery):
    index = open_index(gallery["index"], first_stage="numpy")
    query = "the dog runs on the grass"
    text = index.matcher.encode_texts([query])
    coarse = index.image_keys @ shortlist_keys(text.global_vectors)[0]
    shortlist = set(np.argsort(-coarse)[:5].tolist())
    hits = index.search_text(query, top_k=5, shortlist=5)
    assert {h.id for h in hits} == shortlist
    scores = [h.score for h in hits]
    assert scores == sorted(scores, reverse=True)
    full = _exhaustive(index.matcher, gallery["features"], [query])[:, 0]
    assert_close(scores, full[[h.id for h in hits]], REORDERED)
    # the coarse score is the ensemble's mean cosine of the global vectors
    image = index.matcher.encode_images(gallery["features"][hits[0].id])
    cosines = [float(a[0] @ b[0]) for a, b in zip(image.global_vectors, text.global_vectors)]
    assert hits[0].coarse == approx(np.mean(cosines), REORDERED, scale=1.0)


def test_faiss_first_stage_matches_numpy(gallery):
    pytest.importorskip("faiss")
    numpy_index = open_index(gallery["index"], first_stage="numpy")
    faiss_index = open_index(gallery["index"], first_stage="faiss", matcher=numpy_index.matcher)
    for shortlist in (3, 7):
        a = numpy_index.search_image(image_id=1, top_k=3, shortlist=shortlist)
        b = faiss_index.search_image(image_id=1, top_k=3, shortlist=shortlist)
        assert [h.id for h in a] == [h.id for h in b]
    texts = ["a cat in the park", "a dog runs", "the red ball"]          # one alone or several: the same bits
    alone = [faiss_index.search_texts([text], top_k=3, shortlist=7)[0] for text in texts]
    together = faiss_index.search_texts(texts, top_k=3, shortlist=7)
    assert [[(h.id, h.score, h.coarse) for h in hits] for hits in together] == \
        [[(h.id, h.score, h.coarse) for h in hits] for hits in alone]


def test_float16_index_ranks_like_float32(gallery, tmp_path):
    index32 = open_index(gallery["index"])
    build_index(index32.matcher, gallery["features"], gallery["captions"], tmp_path / "half",
                dtype="float16")
    index16 = open_index(tmp_path / "half", matcher=index32.matcher)
    assert index16.image_regions[0].dtype == np.float16
    a = index32.search_image(image_id=7, top_k=5, shortlist=None)
    b = index16.search_image(image_id=7, top_k=5, shortlist=None)
    assert_close([h.score for h in b], [h.score for h in a], FLOAT16, scale=1.0)


def test_cli_search_json_lists_ids_and_scores_best_first(gallery, capsys):
    capsys.readouterr()
    assert main(["search", "--index", str(gallery["index"]), "--text", "a cat in the park", "--top-k", "4",
                 "--shortlist", "0", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert [sorted(h) for h in hits] == [["id", "score"]] * 4
    index = open_index(gallery["index"])
    expected = index.search_text("a cat in the park", top_k=4, shortlist=None)
    assert [h["id"] for h in hits] == [h.id for h in expected]
    assert main(["search", "--index", str(gallery["index"]), "--image-id", "2", "--top-k", "3", "--json"]) == 0
    captions = json.loads(capsys.readouterr().out)                       # captions come with their text
    assert [h["caption"] for h in captions] == [h.text for h in index.search_image(image_id=2, top_k=3)]
    assert main(["search", "--index", str(gallery["index"]), "--image-id", "2", "--top-k", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("caption ") == 3 and "image 2 -> top 3 captions" in out


@pytest.mark.parametrize("argv, message", [
    (["--text", "a zebra runs"], "'zebra' not in the model's vocabulary"),
    (["--text", "   "], "text is empty: give at least one word"),
    (["--image-id", "99"], "image id 99 is out of range"),
    (["--text", "a dog", "--top-k", "0"], "argument --top-k: expected a positive integer, got 0"),
])
def test_cli_search_bad_queries_are_one_line_errors(gallery, capsys, argv, message):
    assert main(["search", "--index", str(gallery["index"]), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_index_built_with_another_model_is_refused_naming_both(gallery, tmp_path):
    other = tmp_path / "other.pt"
    save_model(_model("sgr", gallery["vocab"], seed=11), other, vocab=gallery["vocab"])
    matcher = Matcher.load([other, gallery["paths"][1]])
    with pytest.raises(InputError) as error:
        open_index(gallery["index"], matcher=matcher)
    message = str(error.value)
    built = json.loads((gallery["index"] / "manifest.json").read_text())["models"][0]
    assert built["source"] in message and str(other) in message
    assert built["weights_sha256"][:12] in message and matcher.identities[0]["weights_sha256"][:12] in message
    with pytest.raises(InputError, match=r"built with 2 model\(s\) \[.*\] but 1 was given \["):
        open_index(gallery["index"], matcher=Matcher.load([gallery["paths"][0]]))


def test_search_into_a_closed_pipe_ends_quietly(gallery, monkeypatch, capsys):
    """`sgraf search ... | head -1`: the reader went away; no BrokenPipeError traceback, exit 0."""
    import io
    import os
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)
    broken = io.TextIOWrapper(io.FileIO(write_end, "w"), write_through=True)
    monkeypatch.setattr(sys, "stdout", broken)
    try:
        assert main(["search", "--index", str(gallery["index"]), "--text", "a cat in the park", "--top-k", "4"]) == 0
    finally:
        monkeypatch.undo()
        broken.close()      # its descriptor now writes to the null device
    assert "Traceback" not in capsys.readouterr().err


def test_search_cli_refuses_checkpoint_overwritten_since_indexing(gallery, tmp_path, capsys):
    copy = tmp_path / "index"
    import shutil

    shutil.copytree(gallery["index"], copy)
    moved = tmp_path / "sgr.pt"
    save_model(_model("sgr", gallery["vocab"], seed=12), moved, vocab=gallery["vocab"])
    assert main(["search", "--index", str(copy), "--text", "a dog", "--checkpoint", str(moved),
                 "--checkpoint", gallery["paths"][1]]) == 2
    err = capsys.readouterr().err
    assert "was built with model 1" in err and str(moved) in err and gallery["paths"][0] in err


def _corrupt_copy(gallery: dict, tmp_path: Path) -> Path:
    import shutil

    copy = tmp_path / "index"
    shutil.copytree(gallery["index"], copy)
    return copy


def test_truncated_index_file_is_reported_by_name(gallery, tmp_path):
    copy = _corrupt_copy(gallery, tmp_path)
    target = copy / "image_regions.1.npy"
    target.write_bytes(target.read_bytes()[:-100])
    with pytest.raises(InputError, match=r"image_regions\.1\.npy: corrupted index file, .* bytes"):
        open_index(copy)


def test_flipped_bytes_in_index_file_fail_the_checksum(gallery, tmp_path):
    copy = _corrupt_copy(gallery, tmp_path)
    target = copy / "caption_words.0.npy"
    raw = bytearray(target.read_bytes())
    raw[-7] ^= 0xFF
    target.write_bytes(bytes(raw))
    with pytest.raises(InputError, match=r"caption_words\.0\.npy: corrupted index file, its sha256"):
        open_index(copy)
    open_index(copy, verify=False)  # without the checksum, only the sizes and headers are checked


def test_broken_manifest_and_header_are_reported(gallery, tmp_path):
    copy = _corrupt_copy(gallery, tmp_path)
    target = copy / "image_keys.npy"
    raw = bytearray(target.read_bytes())
    raw[:6] = b"XXXXXX"  # the .npy magic string
    target.write_bytes(bytes(raw))
    with pytest.raises(InputError, match=r"image_keys\.npy: corrupted index file, not a readable \.npy"):
        open_index(copy, verify=False)
    (copy / "manifest.json").write_text('{"format": "sgraf-index", "vers')
    with pytest.raises(InputError, match=r"manifest\.json: corrupted index manifest, not valid JSON"):
        open_index(copy)
    (copy / "manifest.json").unlink()
    with pytest.raises(InputError, match="is not an sgraf index"):
        open_index(copy)


def test_index_out_refuses_a_folder_that_is_not_an_index(gallery, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    matcher = Matcher.load(gallery["paths"])
    with pytest.raises(InputError, match="is not an sgraf index"):
        build_index(matcher, gallery["features"], gallery["captions"], tmp_path)
    for features, captions, message in (("features.npy", gallery["captions"], "got str"),
                                        (gallery["features"], [*gallery["captions"][:-1], 3], "a list of str"),
                                        (gallery["features"][0], ["a dog"], r"one image's features: features\[None\]"),
                                        (gallery["features"][None], gallery["captions"], "got shape \\(1, ")):
        with pytest.raises(InputError, match=message):
            build_index(matcher, features, captions, tmp_path / "new")
    assert not (tmp_path / "new").exists()
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_several_texts_at_once_rank_as_one_by_one(gallery):
    index = open_index(gallery["index"])
    queries = ["a cat in the park", "a red ball", "the man plays with a blue ball in the grass"]
    for shortlist in (5, None):
        together = index.search_texts(queries, top_k=4, shortlist=shortlist)
        assert len(together) == len(queries)
        for query, hits in zip(queries, together):
            alone = index.search_text(query, top_k=4, shortlist=shortlist)
            assert [h.id for h in hits] == [h.id for h in alone]
            assert_close(np.array([h.score for h in hits]), np.array([h.score for h in alone]), REORDERED)
    assert index.search_texts([]) == []
    with pytest.raises(InputError, match="search_texts takes a list of texts, got one str"):
        index.search_texts("a red ball")     # not its characters, each a query
    # the first stage of a batch is each query's own: same shortlist as the numpy reference
    keys = shortlist_keys(index.matcher.encode_texts(queries).global_vectors)
    for q, (ids, _) in enumerate(index._coarse_many("image", keys, 5)):
        assert set(ids.tolist()) == set(np.argsort(-(index.image_keys @ keys[q]))[:5].tolist())


def test_index_out_replaces_an_index_whole_but_never_a_file_it_does_not_list(gallery, tmp_path):
    import shutil

    index = tmp_path / "index"
    shutil.copytree(gallery["index"], index)
    matcher = Matcher.load(gallery["paths"])
    (index / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match=r"notes\.txt is not part of the sgraf index in .* and would be deleted"):
        build_index(matcher, gallery["features"][:4], gallery["captions"][:20], index)
    (index / "notes.txt").unlink()
    build_index(matcher, gallery["features"][:4], gallery["captions"][:20], index)
    assert open_index(index).n_images == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index"]     # no staging or earlier index left


def test_an_index_being_built_is_refused_to_a_second_build_and_a_killed_builds_leftovers_go(gallery, tmp_path,
                                                                                             caplog):
    """Two builds into one --out had both said they wrote it (the last won); a build killed by SIGKILL
    left a staging folder as large as the index beside it, and one killed mid-swap the earlier index
    moved aside with no index at --out."""
    import shutil

    from sgraf.folder_lock import LOCK_FILE, FolderLock, FolderLockedError

    index = tmp_path / "index"
    matcher = Matcher.load(gallery["paths"])
    with FolderLock(index, path=tmp_path / f".index{LOCK_FILE}"):     # as another build holds it
        with pytest.raises(FolderLockedError, match=f"^{index} is in use by another sgraf process"):
            build_index(matcher, gallery["features"][:4], gallery["captions"][:20], index)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # what killed builds leave: a staging folder, and the earlier index moved aside before the new one came in
    (tmp_path / ".index.sgraf-staging-1a2b3c4d").mkdir()
    (tmp_path / ".index.sgraf-staging-1a2b3c4d" / "image_regions.0.npy").write_bytes(b"half written")
    shutil.copytree(gallery["index"], tmp_path / ".index.sgraf-earlier-5e6f7a8b" / "index")
    others = [".index.v2.sgraf-staging-1a2b3c4d", ".index.v2.sgraf-earlier-5e6f7a8b", ".index.backup",
              ".index.1a2b3c4d"]                     # another index's (index.v2), a user's: never touched
    for other in others:
        (tmp_path / other).mkdir()
    aside = tmp_path / ".index.sgraf-earlier-5e6f7a8b" / "index"
    with pytest.raises(InputError, match=rf"^{index}: no index there, but a stopped `sgraf index` left the earlier "
                                         rf"one aside in {aside}: move it back \(mv {aside} {index}\)"):
        open_index(index)                        # searching meanwhile: it says where the index is
    with caplog.at_level("WARNING", logger="sgraf.search"):
        build_index(matcher, gallery["features"][:4], gallery["captions"][:20], index)
    assert "put back the index a stopped build had moved aside" in caplog.text
    assert open_index(index).n_images == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*others, "index"])


def test_index_write_errors_name_the_index_not_its_staging_folder(gallery, tmp_path, monkeypatch):
    import errno
    import os

    matcher = Matcher.load(gallery["paths"])

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), *args[:1])

    monkeypatch.setattr(os, "replace", no_space)
    with pytest.raises(InputError, match=f"^cannot write {tmp_path / 'gallery'}: No space left on device$"):
        build_index(matcher, gallery["features"][:4], gallery["captions"][:20], tmp_path / "gallery")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    (tmp_path / "a_file").write_text("not a folder")      # "File exists" had named neither
    with pytest.raises(InputError, match=f"^cannot write {tmp_path / 'a_file' / 'gallery'}: {tmp_path / 'a_file'} is a "
                                         "file, where a folder is needed$"):
        build_index(matcher, gallery["features"][:4], gallery["captions"][:20], tmp_path / "a_file" / "gallery")


def test_features_of_another_shape_name_their_file(gallery, tmp_path):
    np.save(tmp_path / "wide_ims.npy", np.zeros((4, 3, 7), np.float32))
    matcher = Matcher.load(gallery["paths"])
    with pytest.raises(InputError, match=r"wide_ims\.npy: image features must have shape \(n_images, "):
        matcher.encode_images(np.load(tmp_path / "wide_ims.npy", mmap_mode="r"))


def test_an_index_named_by_its_manifest_or_built_in_memory_is_said_in_pythons_words(gallery, tmp_path):
    with pytest.raises(InputError, match=rf"^{gallery['index'] / 'manifest.json'} is a file: give the index folder "
                                         rf"\({gallery['index']}\)$"):
        open_index(gallery["index"] / "manifest.json")
    matcher = Matcher.load(gallery["paths"])
    matcher.sources = [None] * len(matcher.models)                   # models in memory
    build_index(matcher, gallery["features"][:2], gallery["captions"][:10], tmp_path / "mem")
    with pytest.raises(InputError, match="built from models in memory.*checkpoints= or matcher= in Python"):
        open_index(tmp_path / "mem")
    assert open_index(tmp_path / "mem", matcher=matcher).n_images == 2
