"""harness/corpus.py on its own (one process): every input kind gives the expected token stream,
sampling is a pure function of (seed, i) that visits each window once per epoch, the held-out
split holds whole documents, the cache is hit, rebuilt when it must be and built once by
concurrent openers, and each bad input is one ConfigError line starting with --data."""
import json
import os
import threading

import numpy as np
import pytest
import torch

import textdata
from harness.corpus import TextCorpus
from harness.data import Batch
from harness.models import ConfigError

V = 320      # the fixture tokenizer's size (and the model vocabulary the tests claim)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    return textdata.train_tokenizer(str(d / "tok"), textdata.documents(200), V)


def stream_of(tok_dir, docs):
    """The expected stream: each document tokenized directly, followed by EOS."""
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(tok_dir)
    out = []
    for d in docs:
        out += t(d, add_special_tokens=False).input_ids + [t.eos_token_id]
    return np.array(out)


def open_(path, tok, **kw):
    kw = dict(dict(vocab_size=V, seed=0, progress=False), **kw)
    return TextCorpus.open(str(path), tok, **kw)


def test_text_jsonl_and_directory_give_documents_joined_with_eos(tmp_path, tok):
    docs = textdata.documents(30, seed=3)
    txt = textdata.text_corpus(str(tmp_path / "a"), 30, seed=3)
    jl = tmp_path / "b" / "docs.jsonl"
    jl.parent.mkdir()
    jl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    d = tmp_path / "c"
    (d / "sub").mkdir(parents=True)
    # several blank lines (one with spaces) between documents, Windows line ends in one file
    (d / "sub" / "2.txt").write_text("\n\n \n\n".join(docs[15:25]))
    (d / "sub" / "3.txt").write_bytes("\r\n\r\n".join(docs[25:]).encode())
    (d / "1.jsonl").write_text("".join(json.dumps({"text": x}) + "\n" for x in docs[:15]))
    (d / "notes.md").write_text("not read: neither .txt nor .jsonl")
    want = stream_of(tok, docs)
    for path in (txt, jl, d):
        c = open_(path, tok)
        assert np.array_equal(c.stream("train"), want), path
        assert c.n_docs == {"train": 30, "val": 0} and c.eos_id == 2
        assert c.n_tokens == {"train": len(want), "val": 0}
    assert "3 file(s)" in open_(d, tok).describe()
    # a document keeps its inner line breaks
    (tmp_path / "lines.txt").write_text("first line\nsecond line\n\n\n\nnext document\n")
    assert np.array_equal(open_(tmp_path / "lines.txt", tok).stream("train"),
                          stream_of(tok, ["first line\nsecond line", "next document"]))


def test_pretokenized_npy_and_bin(tmp_path, tok):
    ids = np.array([5, 6, 2, 7, 8, 9, 2, 10], dtype=np.uint16)
    np.save(tmp_path / "t16.npy", ids)
    np.save(tmp_path / "t32.npy", ids.astype(np.uint32))
    ids.tofile(tmp_path / "t16.bin")                          # nanoGPT's format
    ids.astype(np.uint32).tofile(tmp_path / "t32.bin")
    fps = set()
    for name, kw in (("t16.npy", {}), ("t32.npy", {}), ("t16.bin", {}),
                     ("t32.bin", dict(token_dtype="uint32"))):
        c = open_(tmp_path / name, None, eos_id=2, **kw)
        assert np.array_equal(c.stream("train"), ids), name
        assert c.n_docs["train"] == 3 and c.n_tokens["train"] == 8     # the last without EOS
        fps.add(c.fingerprint)
    assert len(fps) == 1          # the same ids, whatever the file format: the same data
    c = open_(tmp_path / "t16.bin", tok)                       # EOS from the tokenizer
    assert c.eos_id == 2 and c.n_docs["train"] == 3
    with pytest.raises(ConfigError, match="needs an EOS id"):
        open_(tmp_path / "t16.npy", None)
    with pytest.raises(ConfigError, match=r"token id 10 is outside the model's vocabulary \(10"):
        open_(tmp_path / "t16.npy", None, vocab_size=10, eos_id=2)
    with pytest.raises(ConfigError, match="not a whole number of uint32 ids"):
        (tmp_path / "odd.bin").write_bytes(b"\0" * 6)
        open_(tmp_path / "odd.bin", None, eos_id=2, token_dtype="uint32")
    np.save(tmp_path / "i64.npy", ids.astype(np.int64))
    with pytest.raises(ConfigError, match="expected a 1-D uint16 or uint32 array"):
        open_(tmp_path / "i64.npy", None, eos_id=2)


def test_samples_are_a_pure_function_and_cover_each_window_once_per_epoch(tmp_path, tok):
    path = textdata.text_corpus(str(tmp_path), 60)
    a = open_(path, tok, seed=5)
    b = open_(path, tok, seed=5)
    L = 16
    n = a.n_samples("train", L)
    s = a.stream("train")
    assert n == (len(s) - 1) // L and n > 20
    whole = a.sample("train", 0, 3 * n, L)
    assert whole.dtype == np.int64 and whole.shape == (3 * n, L + 1)
    assert np.array_equal(b.sample("train", 5, 3, L), whole[5:8])
    assert np.array_equal(b.sample("train", n - 2, 5, L), whole[n - 2:n + 3])  # across epochs
    windows = {tuple(s[j * L:j * L + L + 1]): j for j in range(n)}
    assert len(windows) == n                                  # (each window is distinct)
    for e in range(3):                                        # each epoch: every window once
        seen = sorted(windows[tuple(row)] for row in whole[e * n:(e + 1) * n])
        assert seen == list(range(n)), e
    assert not np.array_equal(whole[:n], whole[n:2 * n])      # the next epoch reshuffles
    other = open_(path, tok, seed=6)
    assert not np.array_equal(other.sample("train", 0, 4, L), whole[:4])
    # held-out samples are the windows in order, wrapping around
    c = open_(path, tok, seed=5, val_fraction=0.3)
    m, v = c.n_samples("val", L), c.stream("val")
    rows = c.sample("val", 0, m + 2, L)
    assert np.array_equal(rows[1], v[L:2 * L + 1]) and np.array_equal(rows[m], rows[0])


def test_batch_is_samples_shifted_by_one(tmp_path, tok):
    c = open_(textdata.text_corpus(str(tmp_path), 40), tok, seed=1)
    L = 12
    x = c.sample("train", 0, 12, L)
    b = c.batch("train", 2, 4, L, "cpu")
    assert isinstance(b, Batch) and b.index == 2 and b.input_ids.dtype == torch.int64
    assert torch.equal(b.input_ids, torch.from_numpy(x[8:12, :-1]))
    assert torch.equal(b.labels, torch.from_numpy(x[8:12, 1:]))
    assert torch.equal(b.input_ids[:, 1:], b.labels[:, :-1]) and b.n_tokens == 4 * L
    o = c.batch("train", 7, 4, L, "cpu", offset=3)          # an explicit offset wins
    assert torch.equal(o.input_ids, torch.from_numpy(x[3:7, :-1])) and o.index == 7


def test_held_out_split_keeps_whole_documents(tmp_path, tok):
    docs = textdata.documents(300)
    path = textdata.text_corpus(str(tmp_path), 300)
    c = open_(path, tok, val_fraction=0.2)
    assert 40 <= c.n_docs["val"] <= 80 and c.n_docs["train"] + c.n_docs["val"] == 300
    split_docs = {}
    for split in ("train", "val"):
        s = c.stream(split)
        assert s[-1] == c.eos_id and (s == c.eos_id).sum() == c.n_docs[split]
        assert len(s) == c.n_tokens[split]
        split_docs[split] = _decode_docs(tok, s, c.eos_id)
    # each split is whole documents, each in exactly one split, in corpus order
    assert sorted(split_docs["train"] + split_docs["val"]) == sorted(docs)
    order = {d: i for i, d in enumerate(docs)}
    for split in ("train", "val"):
        assert [order[d] for d in split_docs[split]] == sorted(order[d] for d in split_docs[split])
    # the same seed splits the same way; another seed differently
    assert open_(path, tok, val_fraction=0.2).fingerprint == c.fingerprint
    d = open_(path, tok, val_fraction=0.2, seed=1)
    assert d.n_docs != c.n_docs or not np.array_equal(d.stream("val"), c.stream("val"))
    # tiny fractions and two documents: still one document on each side
    two = tmp_path / "two.txt"
    two.write_text(docs[0] + "\n\n" + docs[1] + "\n")
    for f in (0.01, 0.99):
        assert open_(two, tok, val_fraction=f).n_docs == {"train": 1, "val": 1}
    assert open_(path, tok, val_fraction=1e-9).n_docs["val"] == 1


def _decode_docs(tok_dir, stream, eos):
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(tok_dir)
    cuts = np.flatnonzero(stream == eos)
    starts = np.concatenate([[0], cuts[:-1] + 1])
    return [t.decode(stream[a:b]) for a, b in zip(starts, cuts)]


def test_cache_is_hit_then_rebuilt_when_the_corpus_or_tokenizer_changes(tmp_path, tok):
    path = textdata.text_corpus(str(tmp_path / "data"), 40)
    first = open_(path, tok)
    assert "cache built" in first.describe()
    cache = tmp_path / "data" / ".corpus.txt.tokens"
    assert sorted(p.suffix for p in cache.glob("*") if p.suffix != ".lock") == [".json", ".npy",
                                                                                ".npy"]
    assert np.load(next(cache.glob("*.tokens.npy"))).dtype == np.uint16   # 320 tokens fit
    again = open_(path, tok)
    assert "cache hit" in again.describe() and again.fingerprint == first.fingerprint
    assert np.array_equal(again.stream("train"), first.stream("train"))
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))     # touched: rebuilt,
    touched = open_(path, tok)                                          # the same data
    assert "cache built" in touched.describe() and touched.fingerprint == first.fingerprint
    with open(path, "a") as f:
        f.write("\n\nA new document about the sea.\n")
    changed = open_(path, tok)
    assert "cache built" in changed.describe() and changed.n_docs["train"] == 41
    assert changed.fingerprint != first.fingerprint
    tok2 = textdata.train_tokenizer(str(tmp_path / "tok2"), textdata.documents(50), 300)
    other = open_(path, tok2)
    assert "cache built" in other.describe() and other.fingerprint != changed.fingerprint
    assert "cache hit" in open_(path, tok2).describe()
    # a directory caches inside itself (and does not read its own cache back)
    d = tmp_path / "dir"
    textdata.text_corpus(str(d / "x"), 10)
    assert "cache built" in open_(d, tok).describe() and (d / ".tokens").is_dir()
    assert "cache hit" in open_(d, tok).describe() and open_(d, tok).n_docs["train"] == 10
    # an explicit cache directory; the seed and the held-out fraction change the fingerprint
    c = open_(path, tok, cache_dir=str(tmp_path / "elsewhere"))
    assert "cache built" in c.describe() and str(tmp_path / "elsewhere") in c.describe()
    assert c.fingerprint == changed.fingerprint
    assert len({c.fingerprint, open_(path, tok, seed=1).fingerprint,
                open_(path, tok, val_fraction=0.1).fingerprint}) == 3


def test_cache_falls_back_to_home_when_beside_the_data_is_not_writable(tmp_path, tok, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = textdata.text_corpus(str(tmp_path / "data"), 20)
    (tmp_path / "data" / ".corpus.txt.tokens").write_text("a file: no directory can go here")
    c = open_(path, tok)
    assert "cache built" in c.describe()
    assert str(tmp_path / "home" / ".cache" / "parallelisms") in c.describe()
    assert "cache hit" in open_(path, tok).describe()


def test_concurrent_opens_build_the_cache_once(tmp_path, tok):
    path = textdata.text_corpus(str(tmp_path), 100)
    got, errors = [], []

    def opener():
        try:
            got.append(open_(path, tok))
        except Exception as e:      # noqa: BLE001 (reported below)
            errors.append(e)
    threads = [threading.Thread(target=opener) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(got) == 4
    assert sum("cache built" in c.describe() for c in got) == 1
    assert len({c.fingerprint for c in got}) == 1
    assert not [p for p in os.listdir(tmp_path / ".corpus.txt.tokens") if p.endswith(".tmp")]


def test_bad_inputs_are_one_line_naming_data(tmp_path, tok):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"text": "ok"}\n\n{"body": "no text"}\n')
    not_json = tmp_path / "notjson.jsonl"
    not_json.write_text('{"text": 3}\n')
    no_eos = tmp_path / "noeos"
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {"a": 0, "<unk>": 1}, unk_token="<unk>")), unk_token="<unk>").save_pretrained(no_eos)
    (tmp_path / "nodir").mkdir()
    (tmp_path / "nodir" / "a.md").write_text("not a .txt")
    np.save(tmp_path / "empty.npy", np.zeros(0, np.uint16))
    np.save(tmp_path / "big.npy", np.array([1, 2, 400], np.uint16))
    corpus = textdata.text_corpus(str(tmp_path), 20)
    cases = [
        (dict(path=tmp_path / "missing.txt"), "no such file or directory"),
        (dict(path=empty), "no documents (an empty corpus)"),
        (dict(path=tmp_path / "nodir"), "the directory has no .txt or .jsonl files"),
        (dict(path=bad_jsonl), 'bad.jsonl line 3 has no string "text" field'),
        (dict(path=not_json), 'notjson.jsonl line 1 has no string "text" field'),
        (dict(path=corpus, tokenizer=str(no_eos)), "has no EOS token"),
        (dict(path=corpus, vocab_size=100), "the tokenizer has 320 tokens, more than the "
                                            "model's vocabulary (100)"),
        (dict(path=corpus, tokenizer=None), "text needs a tokenizer (the model directory has "
                                            "none; pass --tokenizer DIR)"),
        (dict(path=corpus, tokenizer=str(tmp_path / "nodir")), "cannot load the tokenizer"),
        (dict(path=corpus, tokenizer=str(tmp_path / "absent")), "cannot load the tokenizer"),
        (dict(path=corpus, val_fraction=1.0), "--val-fraction must be in [0, 1)"),
        (dict(path=corpus, val_fraction=-0.1), "--val-fraction must be in [0, 1)"),
        (dict(path=tmp_path / "empty.npy", eos_id=2), "no documents (an empty corpus)"),
        (dict(path=tmp_path / "big.npy", eos_id=2), "token id 400 is outside the model's "
                                                    "vocabulary (320 ids)"),
        (dict(path=tmp_path / "big.npy", eos_id=2, token_dtype="int8"), "token dtype must be"),
    ]
    for kw, msg in cases:
        args = dict(tokenizer=tok, vocab_size=V, seed=0, progress=False)
        args.update(kw)
        path = str(args.pop("path"))
        with pytest.raises(ConfigError) as e:
            TextCorpus.open(path, **args)
        text = str(e.value)
        assert text.startswith(f"--data {path}: ") and msg in text and "\n" not in text, text
    # a tokenizer without EOS is usable when the model's config names one
    assert open_(corpus, str(no_eos), eos_id=1).n_docs["train"] == 20
    # too short a split: check_length names the split, its size and the window
    c = open_(corpus, tok, val_fraction=0.1)
    for split in ("train", "val"):
        L = c.n_tokens[split]
        with pytest.raises(ConfigError) as e:
            c.check_length(L)
        assert str(e.value) == (f"--data {corpus}: the {split} split holds {L} tokens, fewer "
                                f"than --length + 1 = {L + 1}")
        with pytest.raises(ConfigError, match="fewer than --length"):
            c.sample(split, 0, 1, L)
        if split == "train":
            c.check_length(c.n_tokens["val"] - 1)            # both splits hold a window
    open_(corpus, tok).check_length(open_(corpus, tok).n_tokens["train"] - 1)   # no val: fine
