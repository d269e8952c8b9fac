"""harness/corpus.py on its own (one process): every input kind gives the expected token stream,
sampling is a pure function of (seed, i) that visits each window once per epoch, the held-out
split holds whole documents, the cache is hit and rebuilt when it must be, and each bad input
is one ConfigError line naming --data."""
import json
import os

import numpy as np
import pytest
import torch

import textdata
from harness.corpus import TextCorpus
from harness.models import ConfigError


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    return textdata.train_tokenizer(str(d / "tok"), textdata.documents(200))


def stream_of(tok_dir, docs):
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(tok_dir)
    out = []
    for d in docs:
        out += t(d, add_special_tokens=False).input_ids + [t.eos_token_id]
    return np.array(out)


def test_text_jsonl_and_directory_give_documents_joined_with_eos(tmp_path, tok):
    docs = textdata.documents(30, seed=3)
    txt = textdata.text_corpus(str(tmp_path / "a"), 30, seed=3)
    jl = tmp_path / "b" / "docs.jsonl"
    jl.parent.mkdir()
    jl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    d = tmp_path / "c"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "2.txt").write_text("\n\n".join(docs[15:]))
    (d / "1.jsonl").write_text("".join(json.dumps({"text": x}) + "\n" for x in docs[:15]))
    want = stream_of(tok, docs)
    for path in (txt, str(jl), str(d)):
        c = TextCorpus.open(path, tok, 320, seed=0, progress=False)
        assert np.array_equal(c.streams["train"], want), path
        assert c.n_docs == {"train": 30, "val": 0} and c.eos_id == 2


def test_pretokenized_npy_and_bin(tmp_path, tok):
    ids = np.array([5, 6, 2, 7, 8, 9, 2, 10], dtype=np.uint16)
    np.save(tmp_path / "t.npy", ids)
    ids.astype(np.uint32).tofile(tmp_path / "t.bin")
    for path, kw in ((tmp_path / "t.npy", {}), (tmp_path / "t.bin", dict(token_dtype="uint32"))):
        c = TextCorpus.open(str(path), None, 320, 0, eos_id=2, progress=False, **kw)
        assert np.array_equal(c.streams["train"], ids) and c.n_docs["train"] == 3
    with pytest.raises(ConfigError, match="needs an EOS id"):
        TextCorpus.open(str(tmp_path / "t.npy"), None, 320, 0, progress=False)
    with pytest.raises(ConfigError, match="token id 10 is outside"):
        TextCorpus.open(str(tmp_path / "t.npy"), None, 10, 0, eos_id=2, progress=False)


def test_samples_are_a_pure_function_and_cover_each_window_once_per_epoch(tmp_path, tok):
    path = textdata.text_corpus(str(tmp_path), 60)
    a = TextCorpus.open(path, tok, 320, seed=5, progress=False)
    b = TextCorpus.open(path, tok, 320, seed=5, progress=False)
    L = 16
    n = a.n_samples("train", L)
    whole = a.sample("train", 0, 2 * n, L)
    assert np.array_equal(whole[5:8], b.sample("train", 5, 3, L))
    s = a.streams["train"]
    starts = [int(np.flatnonzero([np.array_equal(s[j * L:j * L + L + 1], row)
                                  for j in range(n)])[0]) for row in whole[:n]]
    assert sorted(starts) == list(range(n))                 # one epoch: every window once
    assert not np.array_equal(whole[:n], whole[n:])         # the next epoch reshuffles
    other = TextCorpus.open(path, tok, 320, seed=6, progress=False)
    assert not np.array_equal(other.sample("train", 0, 4, L), whole[:4])
    batch = a.batch("train", 2, 4, L, "cpu")
    assert torch.equal(batch.input_ids[:, 1:], batch.labels[:, :-1])
    assert np.array_equal(batch.input_ids.numpy(), whole[8:12, :-1])


def test_held_out_split_keeps_whole_documents(tmp_path, tok):
    path = textdata.text_corpus(str(tmp_path), 200)
    c = TextCorpus.open(path, tok, 320, seed=0, val_fraction=0.2, progress=False)
    assert 20 <= c.n_docs["val"] <= 60 and c.n_docs["train"] + c.n_docs["val"] == 200
    # each split is a concatenation of whole documents, each ending in EOS
    for split in ("train", "val"):
        s = c.streams[split]
        assert s[-1] == c.eos_id and (s == c.eos_id).sum() == c.n_docs[split]
    docs = textdata.documents(200)
    val_docs = [d for d in docs if d in set(_decode_docs(tok, c.streams["val"], c.eos_id))]
    assert len(val_docs) == c.n_docs["val"]
    val = c.sample("val", 0, 3, 16)
    assert np.array_equal(val[1], c.streams["val"][16:33])    # held-out: in order


def _decode_docs(tok_dir, stream, eos):
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(tok_dir)
    cuts = np.flatnonzero(stream == eos)
    starts = np.concatenate([[0], cuts[:-1] + 1])
    return [t.decode(stream[a:b]) for a, b in zip(starts, cuts)]


def test_cache_is_hit_then_rebuilt_when_the_corpus_or_tokenizer_changes(tmp_path, tok):
    path = textdata.text_corpus(str(tmp_path), 40)
    first = TextCorpus.open(path, tok, 320, 0, progress=False)
    assert "tokenized" in first.describe()
    again = TextCorpus.open(path, tok, 320, 0, progress=False)
    assert "cache hit" in again.describe() and again.fingerprint == first.fingerprint
    with open(path, "a") as f:
        f.write("\n\nA new document about the sea.\n")
    changed = TextCorpus.open(path, tok, 320, 0, progress=False)
    assert "tokenized" in changed.describe() and changed.n_docs["train"] == 41
    assert changed.fingerprint != first.fingerprint
    tok2 = textdata.train_tokenizer(str(tmp_path / "tok2"), textdata.documents(50), 300)
    other = TextCorpus.open(path, tok2, 320, 0, progress=False)
    assert "tokenized" in other.describe() and other.fingerprint != changed.fingerprint


def test_bad_inputs_are_one_line_naming_data(tmp_path, tok):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    no_eos = tmp_path / "noeos"
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {"a": 0, "<unk>": 1}, unk_token="<unk>")), unk_token="<unk>").save_pretrained(no_eos)
    (tmp_path / "nodir").mkdir()
    corpus = textdata.text_corpus(str(tmp_path), 20)
    cases = [
        (dict(path=str(tmp_path / "missing.txt")), "no such file or directory"),
        (dict(path=str(empty)), "no documents"),
        (dict(path=str(tmp_path / "nodir")), "has no .txt or .jsonl files"),
        (dict(path=str(bad_jsonl)), 'line 2 has no string "text" field'),
        (dict(path=corpus, tokenizer=str(no_eos)), "has no EOS token"),
        (dict(path=corpus, vocab_size=100), "more than the model's vocabulary (100)"),
        (dict(path=corpus, tokenizer=None), "text needs a tokenizer"),
        (dict(path=corpus, tokenizer=str(tmp_path / "nodir")), "cannot load the tokenizer"),
        (dict(path=corpus, val_fraction=1.0), "--val-fraction must be in [0, 1)"),
    ]
    for kw, msg in cases:
        args = dict(tokenizer=tok, vocab_size=320, seed=0, progress=False)
        args.update(kw)
        with pytest.raises(ConfigError) as e:
            TextCorpus.open(args.pop("path"), **args)
        text = str(e.value)
        assert text.startswith("--data ") and msg in text and "\n" not in text, text
    c = TextCorpus.open(corpus, tok, 320, 0, val_fraction=0.1, progress=False)
    with pytest.raises(ConfigError, match="fewer than --length"):
        c.check_length(10 ** 6)
