"""The precomp reader: memory mapping, validation errors, dataset, collate, loader order."""

import json
import pickle
import warnings

import numpy as np
import pytest
import torch

from sgraf.cli import main
from sgraf.data.precomp import (FINITE_SAMPLE, PrecompDataset, PrecompSplit, available_splits, collate_batch,
                                make_loader)
from sgraf.data.vocab import build_vocab, load_vocab
from sgraf.errors import InputError


def write_split(root, split="train", n_img=4, caps_per_image=2, k=3, d=5, captions=None, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((n_img, k, d)).astype(np.float32)
    np.save(root / f"{split}_ims.npy", images)
    if captions is None:
        captions = [f"a {'red' if i % 2 else 'blue'} thing number {i}" for i in range(n_img * caps_per_image)]
    (root / f"{split}_caps.txt").write_bytes("".join(c + "\n" for c in captions).encode("utf-8"))
    return images, captions


def test_images_are_memory_mapped_not_loaded(tmp_path):
    images, captions = write_split(tmp_path, n_img=6, caps_per_image=5, k=36, d=100)
    split = PrecompSplit(tmp_path, "train")
    assert isinstance(split.images, np.memmap)
    assert not split.images.flags.writeable
    assert split.images.dtype == np.float32 and split.images.shape == (6, 36, 100)
    assert (split.n_images, split.n_captions, split.caps_per_image) == (6, 30, 5)
    assert [split.image_index(k) for k in (0, 4, 5, 29)] == [0, 0, 1, 5]
    np.testing.assert_array_equal(np.asarray(split.images), images)
    # pickling (DataLoader workers under spawn) re-opens the file instead of copying the data
    blob = pickle.dumps(split)
    assert len(blob) < 5000 < images.nbytes
    clone = pickle.loads(blob)
    assert isinstance(clone.images, np.memmap)
    np.testing.assert_array_equal(np.asarray(clone.images), images)


def test_toy_split_and_available_splits(data_dir):
    root = data_dir / "e2e" / "data" / "toy_precomp"
    split = PrecompSplit(root, "test")
    assert (split.n_images, split.n_captions, split.caps_per_image, split.num_regions, split.feature_dim) == \
        (6, 30, 5, 36, 40)
    assert available_splits(root) == ["test"]


def test_max_captions_keeps_first_captions_and_their_images(tmp_path):
    write_split(tmp_path, "dev", n_img=10, caps_per_image=5)
    split = PrecompSplit(tmp_path, "dev", max_captions=20)
    assert (split.n_captions, split.n_images, split.images.shape[0]) == (20, 4, 4)
    assert split.captions[-1] == "a red thing number 19"
    assert PrecompSplit(tmp_path, "dev", max_captions=5000).n_captions == 50  # larger than the file: all
    with pytest.raises(InputError, match="max_captions=12.*multiple of its 5"):
        PrecompSplit(tmp_path, "dev", max_captions=12)


def test_missing_file_names_the_file_and_found_splits(tmp_path):
    write_split(tmp_path, "train")
    with pytest.raises(InputError, match=r"test_ims\.npy: missing file.*splits found in .*: train\)$"):
        PrecompSplit(tmp_path, "test")
    write_split(tmp_path, "dev")
    for asked, meant in [("Train", "train"), ("val", "dev"), ("validation", "dev"), ("deev", "dev")]:
        with pytest.raises(InputError, match=rf"splits found in .*: train, dev; did you mean '{meant}'\?\)$"):
            PrecompSplit(tmp_path, asked)
    (tmp_path / "train_caps.txt").unlink()
    with pytest.raises(InputError, match=r"train_caps\.txt: missing file"):
        PrecompSplit(tmp_path, "train")


def test_a_missing_file_says_why_it_cannot_be_read(tmp_path):
    write_split(tmp_path, "train")
    with pytest.raises(InputError, match=r"nowhere: no such data folder$"):
        PrecompSplit(tmp_path / "nowhere", "train")
    with pytest.raises(InputError, match=r"train_ims\.npy: a file, where a data folder is needed$"):
        PrecompSplit(tmp_path / "train_ims.npy", "train")
    (tmp_path / "test_ims.npy").symlink_to(tmp_path / "gone.npy")
    (tmp_path / "test_caps.txt").mkdir()
    with pytest.raises(InputError, match=r"test_ims\.npy: a broken symbolic link \(to .*gone\.npy, which does not"):
        PrecompSplit(tmp_path, "test")
    (tmp_path / "test_ims.npy").unlink()
    np.save(tmp_path / "test_ims.npy", np.ones((2, 3, 5), np.float32))
    with pytest.raises(InputError, match=r"test_caps\.txt: a folder, where a file is needed$"):
        PrecompSplit(tmp_path, "test")


def test_one_row_per_caption_is_read_as_the_authors_loader_reads_it(tmp_path, capsys, caplog):
    """SCAN's "rkiros" files repeat each image once per caption: the authors' loader reads them
    (im_div) and their evaluation keeps every 5th row; read as the images they repeat."""
    images, captions = write_split(tmp_path, "test", n_img=4, caps_per_image=5)
    repeated = tmp_path / "repeated"
    repeated.mkdir()
    np.save(repeated / "test_ims.npy", np.repeat(images, 5, axis=0))
    (repeated / "test_caps.txt").write_bytes((tmp_path / "test_caps.txt").read_bytes())
    with caplog.at_level("INFO", logger="sgraf.data.precomp"):
        split = PrecompSplit(repeated, "test")
    assert "each image repeated 5 times" in caplog.text
    assert (split.n_images, split.caps_per_image, split.rows_per_image) == (4, 5, 5)
    assert np.array_equal(split.images, images) and np.array_equal(split.read_images(1, 3), images[1:3])
    assert np.array_equal(pickle.loads(pickle.dumps(split)).images, images)      # a loader worker's copy
    (repeated / "test_image_names.txt").write_text("".join(f"im{i // 5}.png\n" for i in range(20)))  # a name a row
    assert PrecompSplit(repeated, "test").image_names() == [f"im{i}.png" for i in range(4)]
    assert main(["data", "check", "--data", str(repeated), "--split", "test", "--json"]) == 0
    assert '"images": 4' in capsys.readouterr().out
    # one caption per image whose first images happen to be equal: read a row an image, with a warning
    rows = np.repeat(images, 5, axis=0)
    rows[7] += 1
    np.save(repeated / "test_ims.npy", rows)
    caplog.clear()
    split = PrecompSplit(repeated, "test")
    assert (split.n_images, split.caps_per_image, split.rows_per_image) == (20, 1, 1)
    assert "rows 0..4 are one image repeated, but rows 5..9 are not" in caplog.text
    # every row the same image (placeholder features): no row tells where an image ends, a row an image
    np.save(repeated / "test_ims.npy", np.repeat(images[:1], 20, axis=0))
    assert PrecompSplit(repeated, "test").rows_per_image == 1


def test_fortran_order_float64_overflow_and_blank_or_cr_captions_are_named(tmp_path, caplog):
    images, _ = write_split(tmp_path, "test", n_img=4, caps_per_image=1)
    np.save(tmp_path / "test_ims.npy", np.asfortranarray(images))
    with caplog.at_level("WARNING", logger="sgraf.data.precomp"):
        assert np.array_equal(PrecompSplit(tmp_path, "test").images, images)
    assert "stored in Fortran (column-major) order" in caplog.text
    big = images.astype(np.float64)
    big[2, 1, 3] = 1e300
    np.save(tmp_path / "test_ims.npy", big)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)     # numpy's overflow warning, naming its own line
        with pytest.raises(InputError, match=r"\[image 2, region 1, dim 3\] is inf \(a float64 value beyond "
                                             r"float32's range.*\(found by the sampled check\)"):
            PrecompSplit(tmp_path, "test").check_finite()
    for bad, message in ((b"one\n\xc2\xa0\xe3\x80\x80\nthree\nfour\n",
                          r":2: a caption of whitespace only \(U\+00A0, U\+3000\)"),
                         (b"one\rtwo\rthree\rfour\r", r":1: a carriage return \(CR\) inside the line")):
        (tmp_path / "test_caps.txt").write_bytes(bad)
        with pytest.raises(InputError, match=message):
            PrecompSplit(tmp_path, "test")


def test_bytes_past_the_array_are_said(tmp_path, caplog):
    images, _ = write_split(tmp_path, "test", n_img=2, caps_per_image=1)
    with open(tmp_path / "test_ims.npy", "ab") as handle:
        handle.write(b"\0" * 7)
    with caplog.at_level("WARNING", logger="sgraf.data.arrays"):
        assert np.array_equal(PrecompSplit(tmp_path, "test").images, images)
    assert "test_ims.npy: 7 bytes past the end of its (2, 3, 5) array, which are not read" in caplog.text


def test_data_check_counts_all_zero_regions(tmp_path, capsys, caplog):
    images, _ = write_split(tmp_path, "test", n_img=100, caps_per_image=1)
    images[:, 2] = 0        # padding
    images[99] = 0          # a file cut short
    np.save(tmp_path / "test_ims.npy", images)
    with caplog.at_level("WARNING"):
        assert main(["data", "check", "--data", str(tmp_path), "--split", "test", "--json", "--full-scan"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["zero_regions"] == {"looked_at": 100, "images": 100, "regions": 100 + 2, "empty_images": 1}
    assert "100 of the 100 images looked at have some (102 regions; 1 image all zero)" in caplog.text
    assert main(["data", "check", "--data", str(tmp_path), "--split", "test", "--json"]) == 0
    sampled = json.loads(capsys.readouterr().out)["zero_regions"]
    assert sampled["looked_at"] == FINITE_SAMPLE and sampled["empty_images"] == 1   # the last image is looked at


def test_caption_count_not_multiple_of_images(tmp_path):
    write_split(tmp_path, n_img=4, captions=[f"caption {i}" for i in range(9)])
    with pytest.raises(InputError, match=r"train_caps\.txt: 9 captions, not a multiple of the 4 images in .*"
                                         r"train_ims\.npy"):
        PrecompSplit(tmp_path, "train")


@pytest.mark.parametrize("shape", [(4, 15), (4, 3, 5, 1)])
def test_wrong_array_rank(tmp_path, shape):
    write_split(tmp_path)
    np.save(tmp_path / "train_ims.npy", np.zeros(shape, np.float32))
    with pytest.raises(InputError, match=rf"train_ims\.npy: array has rank {len(shape)}.*expected rank 3"):
        PrecompSplit(tmp_path, "train")


def test_not_an_npy_file_and_integer_dtype(tmp_path):
    write_split(tmp_path)
    (tmp_path / "train_ims.npy").write_bytes(b"this is not numpy")
    with pytest.raises(InputError, match=r"train_ims\.npy: not a readable \.npy array"):
        PrecompSplit(tmp_path, "train")
    np.save(tmp_path / "train_ims.npy", np.zeros((4, 3, 5), np.int32))
    with pytest.raises(InputError, match=r"train_ims\.npy: dtype int32; expected float32"):
        PrecompSplit(tmp_path, "train")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_features_are_refused_by_every_reader(tmp_path, bad, capsys):
    n_img = 3 * FINITE_SAMPLE
    images, _ = write_split(tmp_path, n_img=n_img, caps_per_image=1)
    # an image between the ones `sgraf data check` samples: the readers still find it
    sampled = set(np.linspace(0, n_img - 1, FINITE_SAMPLE).astype(int))
    hidden = next(i for i in range(n_img) if i not in sampled)
    images[hidden, 1, 0] = bad
    np.save(tmp_path / "train_ims.npy", images)
    split = PrecompSplit(tmp_path, "train")  # opening reads no feature
    message = rf"train_ims\.npy: feature \[image {hidden}, region 1, dim 0\] is (nan|inf); expected finite"
    split.read_images(0, hidden)
    with pytest.raises(InputError, match=message):
        split.read_images(hidden - 1, hidden + 2)
    with pytest.raises(InputError, match=message):
        PrecompSplit(tmp_path, "train", full_scan=True)
    dataset = PrecompDataset(split, build_vocab(split.captions, min_count=1))
    with pytest.raises(InputError, match=message):
        dataset.check_batch(collate_batch([dataset[0], dataset[hidden + 1], dataset[hidden]]))
    dataset.check_batch(collate_batch([dataset[0], dataset[hidden + 1]]))
    dataset.vocab.save(tmp_path / "vocab.json")           # a dataset may be given its vocabulary's path
    by_path = PrecompDataset(split, str(tmp_path / "vocab.json"))
    assert by_path.vocab == dataset.vocab and by_path.caption_ids(0) == dataset.caption_ids(0)
    with pytest.raises(InputError, match="vocab: expected a Vocabulary or its JSON path, got int"):
        PrecompDataset(split, 3)
    with pytest.raises(InputError, match=message):
        list(make_loader(dataset, batch_size=4, shuffle=True))   # the loader checks as batches arrive
    assert len(list(make_loader(PrecompDataset(PrecompSplit(tmp_path, "train", max_captions=hidden), dataset.vocab),
                                batch_size=4))) == -(-hidden // 4)
    assert main(["data", "check", "--data", str(tmp_path), "--split", "train"]) == 0   # the quick look
    assert "sampled: none found" in capsys.readouterr().out
    assert main(["data", "check", "--data", str(tmp_path), "--split", "train", "--full-scan"]) == 2
    assert f"image {hidden}, region 1" in capsys.readouterr().err
    images[hidden, 1, 0] = 0
    images[0, 2, 4] = bad  # the first image is always in the sample
    np.save(tmp_path / "train_ims.npy", images)
    assert main(["data", "check", "--data", str(tmp_path), "--split", "train"]) == 2
    assert "feature [image 0, region 2, dim 4]" in capsys.readouterr().err


def test_empty_caption_line_names_line(tmp_path):
    captions = ["one", "two", "   ", "four"]
    write_split(tmp_path, n_img=2, captions=captions)
    with pytest.raises(InputError, match=r"train_caps\.txt:3: empty caption line"):
        PrecompSplit(tmp_path, "train")
    (tmp_path / "train_caps.txt").write_bytes(b"one\ntwo\nthree\nfour\n\n  \r\n")   # blank lines at the end
    assert PrecompSplit(tmp_path, "train").captions == ["one", "two", "three", "four"]


def test_a_caption_too_long_for_sgr_is_refused_by_data_check_and_train_before_any_run_file(tmp_path, capsys):
    """One caption of 5,000 words had a training run killed by the kernel (22 GB) with no
    message; now data check and train name its line and length."""
    from sgraf.data.precomp import MAX_CAPTION_TOKENS

    captions = [f"a red thing number {i}" for i in range(8)]
    captions[5] = " ".join(["red"] * (MAX_CAPTION_TOKENS + 1))
    write_split(tmp_path, n_img=4, captions=captions)
    write_split(tmp_path, "dev", n_img=4)
    build_vocab(captions, min_count=1).save(tmp_path / "vocab.json")
    message = (f"train_caps.txt:6: a caption of {MAX_CAPTION_TOKENS + 1:,} tokens; sgraf takes at most "
               f"{MAX_CAPTION_TOKENS:,}")
    with pytest.raises(InputError, match=message):
        PrecompSplit(tmp_path, "train").check_caption_lengths()
    PrecompSplit(tmp_path, "train").check_caption_lengths(limit=MAX_CAPTION_TOKENS + 1)   # at the limit: kept
    assert main(["data", "check", "--data", str(tmp_path), "--split", "train"]) == 2
    assert message in capsys.readouterr().err
    run = tmp_path / "run"
    assert main(["train", "--data", str(tmp_path), "--out", str(run), "--preset", "tiny", "--set", "epochs=1"]) == 2
    assert message in capsys.readouterr().err
    assert not run.exists()                                            # no config.yaml of a run that never started


def test_data_check_checks_the_boxes_against_the_features(tmp_path, capsys):
    write_split(tmp_path, "test", n_img=4, k=3)
    assert main(["data", "check", "--data", str(tmp_path), "--split", "test"]) == 0
    assert "region boxes     none (a model with positions needs them)" in capsys.readouterr().out
    boxes = np.tile(np.array([0, 0, 10, 10], np.float32), (3, 3, 1))             # 3 images' boxes for 4
    np.save(tmp_path / "test_boxes.npy", boxes)
    np.save(tmp_path / "test_image_sizes.npy", np.full((4, 2), 20, np.float32))
    assert main(["data", "check", "--data", str(tmp_path), "--split", "test"]) == 2
    assert "test_boxes.npy: boxes for 3 images; expected 4" in capsys.readouterr().err
    np.save(tmp_path / "test_boxes.npy", np.tile(np.array([0, 0, 10, 10], np.float32), (4, 3, 1)))
    assert main(["data", "check", "--data", str(tmp_path), "--split", "test"]) == 0
    assert "test_boxes.npy and test_image_sizes.npy: checked" in capsys.readouterr().out


def test_bytes_not_utf8_name_line(tmp_path):
    write_split(tmp_path, n_img=2)
    (tmp_path / "train_caps.txt").write_bytes(b"fine\nalso fine\ncaf\xe9 latin-1\nok\n")
    with pytest.raises(InputError, match=r"train_caps\.txt:3: bytes are not valid UTF-8 \(byte 0xe9 at column 4\)"):
        PrecompSplit(tmp_path, "train")


def test_dataset_items_and_collate(data_dir):
    root = data_dir / "e2e" / "data"
    split = PrecompSplit(root / "toy_precomp", "test")
    vocab = load_vocab(root / "toy_vocab.json")
    dataset = PrecompDataset(split, vocab)
    assert len(dataset) == 30
    features, ids, k, image_id = dataset[7]
    assert (k, image_id) == (7, 1) and features.dtype == np.float32 and features.shape == (36, 40)
    np.testing.assert_array_equal(features, split.images[1])
    batch = collate_batch([dataset[i] for i in (4, 5, 13)])
    expected = torch.load(data_dir / "e2e" / "expected.pt", weights_only=True)["token_ids"]
    lengths = [len(expected[i]) for i in (4, 5, 13)]
    assert batch.lengths.tolist() == lengths and batch.lengths.dtype == torch.int64
    assert batch.captions.shape == (3, max(lengths)) and batch.captions.dtype == torch.int64
    for row, i in enumerate((4, 5, 13)):
        assert batch.captions[row, : lengths[row]].tolist() == expected[i]
        assert batch.captions[row, lengths[row]:].eq(0).all()
    assert batch.caption_ids.tolist() == [4, 5, 13] and batch.image_ids.tolist() == [0, 1, 2]
    assert batch.images.shape == (3, 36, 40) and batch.images.dtype == torch.float32
    assert torch.equal(batch.images[1], torch.from_numpy(np.array(split.images[1])))   # a copy, bit for bit


def test_loader_order_depends_only_on_seed_and_workers_are_honoured(tmp_path):
    write_split(tmp_path, n_img=12, caps_per_image=2)
    split = PrecompSplit(tmp_path, "train")
    dataset = PrecompDataset(split, build_vocab(split.captions, min_count=1))

    def order(seed, workers):
        loader = make_loader(dataset, batch_size=5, shuffle=True, seed=seed, num_workers=workers)
        assert loader.num_workers == workers
        return [[b.caption_ids.tolist() for b in loader] for _ in range(2)]  # two epochs

    first = order(3, 0)
    assert first == order(3, 0) == order(3, 2)
    assert first[0] != first[1]  # a new permutation each epoch
    assert first != order(4, 0)
    assert sorted(sum(first[0], [])) == list(range(24))
    resumed = make_loader(dataset, batch_size=5, shuffle=True, seed=3, epoch=1)
    assert [b.caption_ids.tolist() for b in resumed] == first[1]
    plain = [b.caption_ids.tolist() for b in make_loader(dataset, batch_size=10)]
    assert plain == [list(range(10)), list(range(10, 20)), list(range(20, 24))]


def test_with_workers_the_workers_check_the_features_and_the_consumer_only_names_a_bad_image(tmp_path, monkeypatch):
    """`CheckedLoader`: with DataLoader workers the worker that collates a batch looks at its
    features (`Batch.finite`, kept by `pin_memory` and `to`), so the consuming process (a GPU's
    host-bound training loop) checks no finite batch; a batch with a NaN is still refused in
    the consumer, in one line naming the file and the image. Without workers it checks each."""
    write_split(tmp_path, n_img=12, caps_per_image=2)
    split = PrecompSplit(tmp_path, "train")
    dataset = PrecompDataset(split, build_vocab(split.captions, min_count=1))
    checked = []
    check = PrecompDataset.check_batch
    monkeypatch.setattr(PrecompDataset, "check_batch", lambda self, batch: (checked.append(len(batch)),
                                                                             check(self, batch))[1])
    batches = list(make_loader(dataset, batch_size=5, num_workers=2))
    assert checked == [] and [b.finite for b in batches] == [True] * 5
    assert batches[0].to("cpu").finite is True and batches[0]._apply(lambda t: t.clone()).finite is True
    assert len(list(make_loader(dataset, batch_size=5))) == 5 and checked == [5, 5, 5, 5, 4]
    images = np.load(tmp_path / "train_ims.npy")
    images[7, 2, 3] = np.inf
    np.save(tmp_path / "train_ims.npy", images)
    dataset = PrecompDataset(PrecompSplit(tmp_path, "train"), dataset.vocab)
    checked.clear()
    with pytest.raises(InputError, match=r"train_ims.npy: feature \[image 7, region 2, dim 3\] is inf"):
        list(make_loader(dataset, batch_size=5, num_workers=2))
    assert checked == [5]              # the first batch found not finite (caption 14, image 7), checked to name it


def test_cli_data_check_summary(tmp_path, capsys, data_dir):
    root = data_dir / "e2e" / "data"
    code = main(["data", "check", "--data", str(root / "toy_precomp"), "--split", "test",
                 "--vocab", str(root / "toy_vocab.json")])
    out = capsys.readouterr().out
    assert code == 0
    assert "images           6" in out and "captions         30" in out and "captions/image   5" in out
    assert "regions          36" in out and "feature size     40" in out
    # 4 tokens of 30 captions map to <unk> ('ball' x3, 'savanna'): README.txt of the e2e data
    n_tokens = sum(len(t) for t in torch.load(data_dir / "e2e" / "expected.pt", weights_only=True)["tokens"])
    assert f"unknown words    {100 * 4 / n_tokens:.2f}% of {n_tokens} tokens" in out and "is it the" not in out
    from sgraf.data.vocab import Vocabulary
    Vocabulary.from_words([f"w{i}" for i in range(20)]).save(tmp_path / "other.json")   # another data set's
    assert main(["data", "check", "--data", str(root / "toy_precomp"), "--split", "test",
                 "--vocab", str(tmp_path / "other.json")]) == 0
    assert ": above 10%, is it the vocabulary of this data?" in capsys.readouterr().out
    assert main(["data", "check", "--data", str(tmp_path), "--split", "test"]) == 2
    assert "test_ims.npy: missing file" in capsys.readouterr().err
