"""Vocabulary: the authors' JSON files, tokenisation identical to their pipeline, building."""

import json
import os
import threading

import pytest
import torch

import sgraf
from sgraf.cli import main
from sgraf.data.precomp import read_captions
from sgraf.data.vocab import Vocabulary, build_vocab, load_vocab, tokenize, unknown_share, warn_unknown_share
from sgraf.errors import InputError

E2E = "e2e/data"


@pytest.fixture
def expected(data_dir):
    return torch.load(data_dir / "e2e" / "expected.pt", weights_only=True)


@pytest.mark.parametrize("name,size", [("f30k_precomp_vocab.json", 8481), ("coco_precomp_vocab.json", 11353)])
def test_authors_vocabularies_load_and_save_same_content(data_dir, tmp_path, name, size):
    path = data_dir / "vocab" / name
    vocab = sgraf.load_vocab(path)
    assert len(vocab) == size
    assert [vocab.idx2word[i] for i in range(4)] == ["<pad>", "<start>", "<end>", "<unk>"]
    vocab.save(tmp_path / name)
    assert json.loads((tmp_path / name).read_text()) == json.loads(path.read_text())
    assert load_vocab(tmp_path / name) == vocab


def test_a_folder_is_named_as_one_and_a_pipe_is_read(data_dir, tmp_path):
    """A folder had been 'vocabulary file not found', and a pipe (--vocab <(...)) refused as missing."""
    with pytest.raises(IsADirectoryError, match="a folder, not a vocabulary file"):
        load_vocab(tmp_path)
    with pytest.raises(FileNotFoundError, match="vocabulary file not found"):
        load_vocab(tmp_path / "vocab.json")
    if not hasattr(os, "mkfifo"):
        return
    source = data_dir / "e2e" / "data" / "toy_vocab.json"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(source.read_bytes()))
    writer.start()
    assert load_vocab(fifo) == load_vocab(source)
    writer.join(10)


def test_encode_matches_authors_token_ids_on_tricky_captions(data_dir, expected):
    vocab = sgraf.load_vocab(data_dir / E2E / "toy_vocab.json")
    raw = read_captions(data_dir / E2E / "toy_precomp" / "test_caps.txt")
    assert raw == expected["captions"]
    assert [vocab.encode(c) for c in raw] == expected["token_ids"]
    assert [vocab.tokenize(c) for c in raw] == expected["tokens"]
    # the raw lines, with their leading/trailing spaces, give the same ids too
    lines = (data_dir / E2E / "toy_precomp" / "test_caps.txt").read_text(encoding="utf-8").split("\n")
    assert [vocab.encode(line) for line in lines[:30]] == expected["token_ids"]


def test_encode_structure_and_unknown_words(data_dir):
    vocab = sgraf.load_vocab(data_dir / "vocab" / "f30k_precomp_vocab.json")
    ids = vocab.encode("Two dogs   play in the zzzunseen snow.")
    assert ids[0] == 1 and ids[-1] == 2
    assert ids[1:-1] == [vocab(w) for w in ["two", "dogs", "play", "in", "the", "zzzunseen", "snow", "."]]
    assert vocab("zzzunseen") == 3 and ids[6] == 3
    assert vocab.decode(ids) == ["two", "dogs", "play", "in", "the", "<unk>", "snow", "."]


def test_tokenize_lowercases_ascii_only_like_bytes_lower():
    # The authors lower-case UTF-8 bytes: 'É' and 'Ñ' keep their case, ASCII letters do not.
    assert tokenize("ÉCOLE NIÑO's CAFÉ") == ["École", "niÑo", "'s", "cafÉ"]
    assert tokenize("ÉCOLE".encode("utf-8")) == ["École"]
    assert tokenize("  Don't, ice-cream 3  ") == ["do", "n't", ",", "ice-cream", "3"]


def test_build_vocab_orders_by_first_occurrence_like_the_authors(data_dir):
    captions = read_captions(data_dir / E2E / "toy_precomp" / "test_caps.txt")
    built = build_vocab(captions, min_count=1)
    authors = load_vocab(data_dir / E2E / "toy_vocab.json")
    # toy_vocab.json is build_vocab(threshold=1) with 'ball' and 'savanna' removed (README.txt)
    words = [w for w in list(built.word2idx) if w not in ("ball", "savanna")]
    assert words == list(authors.word2idx)
    assert len(built) == 183


def test_build_vocab_min_count():
    vocab = build_vocab(["a red cube", "a red ball", "a blue cube", "a cube"], min_count=2)
    assert list(vocab.word2idx)[4:] == ["a", "red", "cube"]
    with pytest.raises(InputError, match="min_count"):
        build_vocab(["a"], min_count=0)


def test_vocab_without_special_tokens_is_rejected(tmp_path):
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"word2idx": {"<pad>": 0, "a": 1}, "idx2word": {"0": "<pad>", "1": "a"}, "idx": 2}))
    with pytest.raises(InputError, match=r"v\.json.*'word2idx'.*'<start>' to 1"):
        load_vocab(path)
    assert main(["data", "check", "--data", str(tmp_path), "--split", "x", "--vocab", str(path)]) == 2


def test_ids_given_twice_missing_or_out_of_range_are_named():
    from sgraf.data.vocab import Vocabulary

    special = {"<pad>": 0, "<start>": 1, "<end>": 2, "<unk>": 3}
    with pytest.raises(InputError, match=r"exactly once; id 4 is given to 'a' and 'b'; id 5 is missing$"):
        Vocabulary({**special, "a": 4, "b": 4, "c": 6})
    with pytest.raises(InputError, match=r"0 \.\. 4 exactly once; id 4 is missing; id 9 \('b'\) is out of that range$"):
        Vocabulary({**special, "b": 9})


@pytest.mark.parametrize("content,field", [
    ('{"idx2word": {}}', "'word2idx'"),
    ('{"word2idx": {"<pad>": 0, "<start>": 1, "<end>": 2, "<unk>": 3}, "idx": 7}', "'idx'"),
    ('{"word2idx": {"<pad>": 0, "<start>": 1, "<end>": 2, "<unk>": 3}, "idx2word": {"0": "<pad>", "1": "x", '
     '"2": "<end>", "3": "<unk>"}}', "'idx2word'"),
    ('{"word2idx": {"<pad>": 0, "<start>": 1, "<end>": 2, "<unk>": 5}}', "'word2idx'"),
    ('{"word2idx": \n [1, 2', ":2:"),
])
def test_bad_vocab_json_names_file_and_field(tmp_path, content, field):
    path = tmp_path / "bad_vocab.json"
    path.write_text(content)
    with pytest.raises(InputError) as info:
        load_vocab(path)
    assert "bad_vocab.json" in str(info.value) and field in str(info.value)


def test_vocabulary_from_words_and_roundtrip(tmp_path):
    vocab = Vocabulary.from_words(["jalapeño", "b"])
    assert vocab("jalapeño") == 4 and len(vocab) == 6
    vocab.save(tmp_path / "v.json")
    text = (tmp_path / "v.json").read_text()
    assert "jalape\\u00f1o" in text  # json.dump's default ASCII escaping, as the authors' files
    assert Vocabulary.from_dict(json.loads(text)) == vocab


def test_cli_vocab_build(tmp_path, data_dir):
    caps = (data_dir / E2E / "toy_precomp" / "test_caps.txt").read_bytes()
    (tmp_path / "train_caps.txt").write_bytes(caps)
    out = tmp_path / "vocab.json"
    assert main(["vocab", "build", "--data", str(tmp_path), "--out", str(out), "--min-count", "3"]) == 0
    vocab = load_vocab(out)
    expected = build_vocab(read_captions(tmp_path / "train_caps.txt"), min_count=3)
    assert vocab == expected and "a" in vocab and "jalapeño" not in vocab
    assert main(["vocab", "build", "--data", str(tmp_path), "--out", str(out), "--splits", "nope"]) == 2


def test_unknown_share_warns_naming_the_vocabulary_the_captions_and_the_threshold(tmp_path, caplog):
    path = tmp_path / "other_vocab.json"
    Vocabulary.from_words(["dog", "cat"]).save(path)
    vocab = load_vocab(path)
    encoded = [vocab.encode("a dog and a cat"), vocab.encode("the dog")]   # 4 of 7 words unknown
    assert unknown_share(vocab, encoded) == (pytest.approx(4 / 7), 7)
    with caplog.at_level("WARNING", logger="sgraf.data.vocab"):
        assert warn_unknown_share(vocab, encoded, "test_caps.txt") == pytest.approx(4 / 7)
    assert f"{path}: 57.1% of the 7 tokens of test_caps.txt are unknown to this vocabulary (<unk>), above the " \
           "10% warning threshold" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="sgraf.data.vocab"):
        warn_unknown_share(vocab, [vocab.encode("dog cat dog")], "test_caps.txt")
    assert caplog.text == ""
    built = build_vocab(["a dog", "a dog"], min_count=2)
    assert built.source == "the vocabulary built from the captions (min count 2)"


def test_vocab_build_rebuilds_the_data_sets_own_vocabulary_in_place(tmp_path, capsys):
    """DATA/vocab.json is where train and data check look; vocab build does not read it, so it may
    write it again (it had been refused as "the input --data")."""
    (tmp_path / "train_caps.txt").write_text("a red ball\na blue ball\n")
    assert main(["vocab", "build", "--data", str(tmp_path), "--out", str(tmp_path / "vocab.json"),
                 "--min-count", "1"]) == 0
    first = json.loads((tmp_path / "vocab.json").read_text())
    (tmp_path / "train_caps.txt").write_text("a red ball\na blue ball\na green cube\n")
    assert main(["vocab", "build", "--data", str(tmp_path), "--out", str(tmp_path / "vocab.json"),
                 "--min-count", "1"]) == 0
    second = json.loads((tmp_path / "vocab.json").read_text())
    assert "cube" in second["word2idx"] and "cube" not in first["word2idx"]
    assert main(["vocab", "build", "--data", str(tmp_path), "--out", str(tmp_path / "train_caps.txt")]) == 2
    assert "is the input --data" in capsys.readouterr().err
