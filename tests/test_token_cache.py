"""Captions' token ids kept on disk (`sgraf.data.token_cache`): the same ids as the tokenizer,
read back without it, and never trusted when the file does not hold ids of these captions."""

from __future__ import annotations

import io
import json
import os
import zipfile

import numpy as np
import pytest
import torch

import sgraf.data.vocab as vocab_module
from sgraf.data import token_cache
from sgraf.data.precomp import read_captions
from sgraf.data.vocab import Vocabulary, load_vocab
from sgraf.scoring import tokenize_captions

E2E = "e2e/data"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SGRAF_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SGRAF_TOKEN_CACHE", raising=False)
    return tmp_path / "tokens"


@pytest.fixture
def toy(data_dir):
    vocab = load_vocab(data_dir / E2E / "toy_vocab.json")
    captions = read_captions(data_dir / E2E / "toy_precomp" / "test_caps.txt")
    expected = torch.load(data_dir / "e2e" / "expected.pt", weights_only=True)["token_ids"]
    return vocab, captions, expected


def no_tokenizer(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the tokenizer ran")
    monkeypatch.setattr(vocab_module, "tokenize", refuse)


def test_the_second_encoding_reads_the_authors_ids_without_the_tokenizer(cache, toy, monkeypatch):
    vocab, captions, expected = toy
    assert tokenize_captions(captions, vocab) == expected
    assert len(list(cache.glob("*.npz"))) == 1
    no_tokenizer(monkeypatch)
    assert tokenize_captions(captions, vocab) == expected


def test_other_captions_another_vocabulary_or_tokenizer_are_encoded_anew(cache, toy, monkeypatch):
    vocab, captions, expected = toy
    tokenize_captions(captions, vocab)
    smaller = Vocabulary.from_words(list(vocab.word2idx)[4:-1])          # the last word now unknown
    assert tokenize_captions(captions, smaller) == [smaller.encode(c) for c in captions]
    assert tokenize_captions(captions[::-1], vocab) == expected[::-1]
    monkeypatch.setattr(token_cache, "TOKENIZER_REVISION", 2)
    token_cache._tokenizer.cache_clear()
    try:
        tokenize_captions(captions, vocab)
    finally:
        token_cache._tokenizer.cache_clear()
    assert len(list(cache.glob("*.npz"))) == 4


def damage(path, how):
    if how == "truncated":
        path.write_bytes(path.read_bytes()[:50])
    elif how == "not npz":
        path.write_text("hello")
    elif how == "a plain .npy":
        with open(path, "wb") as handle:
            np.save(handle, np.arange(5, dtype=np.int32))
    elif how == "garbled header":       # Python 3.12: numpy's fallback header parser raises TokenError
        with np.load(path) as stored:
            lengths = stored["lengths"]
        member = io.BytesIO()
        np.save(member, lengths)
        raw = bytearray(member.getvalue())
        raw[12:40] = b"{'descr': <<garbage>>, 'sh"
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("lengths.npy", bytes(raw))
            archive.writestr("ids.npy", bytes(raw))
    else:
        with np.load(path) as stored:
            lengths, ids, digest = stored["lengths"], stored["ids"], stored["sha256"]
        if how == "another valid id, the digest kept":       # edited: only the digest tells
            ids = ids.copy()
            ids[1] = ids[1] + 1 if ids[1] + 1 < ids.max() else 4
        elif how == "id outside the vocabulary":
            ids = ids.copy()
            ids[1] = 10**6
        elif how == "one caption too few":
            lengths, ids = lengths[1:], ids[lengths[0]:]
        elif how == "no <start>":
            ids = ids.copy()
            ids[0] = 5
        elif how == "float ids":
            ids = ids.astype(np.float32)
        if how != "another valid id, the digest kept":     # each check on its own: a digest of the damage
            digest = token_cache._ids_digest(lengths, ids)
        with open(path, "wb") as handle:
            np.savez(handle, lengths=lengths, ids=ids, sha256=digest)


@pytest.mark.parametrize("how", ["truncated", "not npz", "a plain .npy", "garbled header", "id outside the vocabulary",
                                 "one caption too few", "no <start>", "float ids", "another valid id, the digest kept"])
def test_a_damaged_file_is_tokenised_again_and_rewritten(cache, toy, how):
    vocab, captions, expected = toy
    tokenize_captions(captions, vocab)
    (path,) = cache.glob("*.npz")
    damage(path, how)
    assert tokenize_captions(captions, vocab) == expected
    with np.load(path) as stored:                                        # rewritten whole
        assert stored["ids"].tolist() == [i for row in expected for i in row]


def test_an_unwritable_cache_or_the_switch_off_still_gives_the_ids(tmp_path, toy, monkeypatch, caplog):
    vocab, captions, expected = toy
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("SGRAF_CACHE_DIR", str(blocker))              # the cache folder cannot be made
    with caplog.at_level("WARNING", logger="sgraf"):
        assert tokenize_captions(captions, vocab) == expected
        assert tokenize_captions(captions, vocab) == expected
    said = [record.getMessage() for record in caplog.records if "cannot be written" in record.getMessage()]
    assert len(said) == 1 and "SGRAF_TOKEN_CACHE=off" in said[0]   # once
    assert f"{blocker} cannot be written ({blocker} is a file, not a folder)" in said[0], said
    monkeypatch.setenv("SGRAF_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SGRAF_TOKEN_CACHE", "off")
    assert tokenize_captions(captions, vocab) == expected
    assert not (tmp_path / "cache").exists()
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]


def test_a_caption_that_is_not_utf8_is_refused_the_same_way_through_the_cache(cache):
    from sgraf.errors import InputError

    vocab = Vocabulary.from_words(["a"])
    with pytest.raises(InputError, match="is not valid UTF-8"):
        tokenize_captions(["a \udcff b"], vocab)


def test_evaluate_takes_the_kept_ids_and_reproduces_the_authors_matrix(cache, data_dir, monkeypatch):
    from sgraf.evaluate import evaluate_checkpoints_with_sims

    e2e = data_dir / "e2e"
    args = ([e2e / "sgr.pth.tar"], e2e / "data" / "toy_precomp", "test", e2e / "data" / "toy_vocab.json")
    first, sims = evaluate_checkpoints_with_sims(*args)
    no_tokenizer(monkeypatch)
    second, again = evaluate_checkpoints_with_sims(*args)
    assert first == second and np.array_equal(sims, again)
    expected = torch.load(e2e / "expected.pt", weights_only=True)
    assert second["rsum"] == expected["sgr_rsum"]


def test_a_prefetch_tokenises_in_another_process(cache, toy, data_dir, monkeypatch):
    """`sgraf evaluate` starts it before importing PyTorch: the ids come from its tokens."""
    vocab, captions, expected = toy
    prefetched = token_cache.prefetch(data_dir / E2E / "toy_precomp" / "test_caps.txt")
    no_tokenizer(monkeypatch)            # this process does not tokenise
    assert tokenize_captions(captions, vocab, prefetched) == expected
    assert prefetched.process.returncode == 0
    assert token_cache.words_path(captions).is_file() and len(list(cache.glob("*.npz"))) == 1
    assert tokenize_captions(captions, vocab) == expected      # kept as ids too


def test_a_prefetch_that_fails_or_read_other_captions_is_not_used(cache, toy, data_dir, tmp_path):
    vocab, captions, expected = toy
    missing = token_cache.prefetch(tmp_path / "missing_caps.txt")
    assert tokenize_captions(captions, vocab, missing) == expected
    assert missing.process.returncode != 0
    changed = tmp_path / "test_caps.txt"          # the file the process read is not the captions encoded
    changed.write_text("".join(caption[::-1] + "\n" for caption in captions), encoding="utf-8")
    other = token_cache.prefetch(changed)
    smaller = Vocabulary.from_words(list(vocab.word2idx)[4:-1])
    assert tokenize_captions(captions, smaller, other) == [smaller.encode(c) for c in captions]


def test_kept_ids_stop_the_prefetch_and_damaged_tokens_are_rewritten(cache, toy, data_dir):
    vocab, captions, expected = toy
    caption_file = data_dir / E2E / "toy_precomp" / "test_caps.txt"
    path = token_cache.words_path(captions)
    path.parent.mkdir(parents=True)
    # not a list, a token that is not a string, not JSON, one caption too few, an earlier format,
    # a word edited under the digest of the words written
    digest = token_cache._words_digest([["a"], ["b"]])
    for damaged, count in (('{"words": {"not": "a list"}}', 1), ('{"words": [["a"], [1]]}', 2), ("[", 1),
                           ('{"words": [["a"]]}', 2), ('[["a"], ["b"]]', 2),
                           (json.dumps({"sha256": digest, "words": [["a"], ["horses"]]}), 2)):
        path.write_text(damaged)
        assert token_cache._read_words(path, count) is None
    path.write_text(json.dumps({"sha256": digest, "words": [["a"], ["b"]]}))
    assert token_cache._read_words(path, 2) == [["a"], ["b"]]
    prefetched = token_cache.prefetch(caption_file)      # the damaged file is tokenised again, rewritten
    assert prefetched.words(captions) == [vocab.tokenize(c) for c in captions]
    assert tokenize_captions(captions, vocab) == expected           # now kept as ids
    prefetched = token_cache.prefetch(caption_file)
    assert tokenize_captions(captions, vocab, prefetched) == expected
    assert prefetched.process.poll() is not None                     # cancelled or done, not left running


def test_no_prefetch_with_the_cache_off(cache, data_dir, monkeypatch):
    monkeypatch.setenv("SGRAF_TOKEN_CACHE", "off")
    assert token_cache.prefetch(data_dir / E2E / "toy_precomp" / "test_caps.txt") is None


def test_evaluate_tokenises_its_split_in_another_process(cache, toy, data_dir, capsys, monkeypatch):
    from sgraf.cli import main

    vocab, captions, expected = toy
    started = []
    real = token_cache.prefetch
    monkeypatch.setattr(token_cache, "prefetch", lambda path: started.append(path) or real(path))
    args = ["evaluate", "--checkpoint", str(data_dir / "e2e" / "sgr.pth.tar"), "--data",
            str(data_dir / E2E / "toy_precomp"), "--vocab", str(data_dir / E2E / "toy_vocab.json"), "--json", "--quiet"]
    no_tokenizer(monkeypatch)
    assert main(args) == 0
    assert started == [data_dir / E2E / "toy_precomp" / "test_caps.txt"]
    assert token_cache.words_path(captions).is_file()
    assert main([*args[:-2], "--sims", "x.npy"]) == 2            # refused before anything starts
    assert len(started) == 1
    capsys.readouterr()


def test_a_large_caption_file_is_tokenised_by_several_processes(cache, toy, tmp_path):
    """The prefetch forks workers (the cores but one, at most 8, 2,000 captions each at least);
    the tokens are the same, in the file's order."""
    import json
    import subprocess
    import sys

    assert [token_cache.tokenize_workers(n, cpus) for n, cpus in
            [(25000, 16), (25000, 2), (5000, 16), (1999, 16), (25000, 1), (0, 8)]] == [8, 1, 2, 1, 1, 1]
    vocab, captions, expected = toy
    many = [f"{caption} number {i}, isn't it?" for i in range(10) for caption in captions]   # 300 captions
    path = tmp_path / "many_caps.txt"
    path.write_text("".join(caption + "\n" for caption in many), encoding="utf-8")
    code = ("import sys\nimport sgraf.data.token_cache as t\nt.available_cores = lambda: 3\n"
            "t.CAPTIONS_PER_WORKER = 100\nassert t.tokenize_workers(300, t.available_cores()) == 2\n"
            "sys.exit(t._keep_words(sys.argv[1]))")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=300)
    kept = json.loads(token_cache.words_path(many).read_text(encoding="utf-8"))
    assert kept["words"] == [vocab.tokenize(caption) for caption in many]
    assert kept["sha256"] == token_cache._words_digest(kept["words"])


def test_a_prefetch_that_hangs_is_stopped_and_the_captions_tokenised_here(cache, toy, monkeypatch):
    import subprocess
    import sys

    vocab, captions, expected = toy
    monkeypatch.setattr(token_cache, "PREFETCH_WAIT_S", 0.5)
    hung = token_cache.Prefetch(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    assert tokenize_captions(captions, vocab, hung) == expected
    assert hung.process.returncode is not None          # killed, not left behind
