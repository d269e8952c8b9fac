"""compose4d's train mode on real text (issue: a real model on real text): a corpus, a tokenizer
trained on the fly and small Llama directories with weights, all written by the tests
(tests/textdata.py); shard-by-shard loading against the whole-model build, fine-tuning with a
held-out evaluation, a resume across layouts that is exact in float64 with the data position,
the greedy sample against the HF export, the logs, and the bad inputs."""
import json
import math
import os

import pytest

from conftest import Runs, assert_config_error, launch
import textdata


def fixtures(base) -> dict:
    """base/text: corpus.txt (300 documents), tok/ (BPE, 320 tokens), llama/ (4 layers, untied)
    and llama-tied/ (tied embeddings), each with weights and the tokenizer. Made once per base."""
    d = os.path.join(str(base), "text")
    paths = dict(corpus=os.path.join(d, "corpus.txt"), tok=os.path.join(d, "tok"),
                 llama=os.path.join(d, "llama"), tied=os.path.join(d, "llama-tied"))
    if not os.path.isdir(paths["tied"]):
        textdata.text_corpus(d, 300)
        textdata.train_tokenizer(paths["tok"], textdata.documents(300))
        textdata.llama_dir(paths["llama"], paths["tok"])
        textdata.llama_dir(paths["tied"], paths["tok"], tied=True, seed=1)
    return paths


def path(key):
    return lambda base: fixtures(base)[key]


def ck(base):
    return os.path.join(str(base), "ck-text")


def hf(base):
    return os.path.join(str(base), "hf-text")


def bin32(base):
    """The corpus as the text path tokenizes it (doc0 EOS doc1 EOS ...), written as raw uint32
    ids (a .bin that read as nanoGPT's default uint16 would be another stream)."""
    import numpy as np
    from harness.corpus import TextCorpus
    p = fixtures(base)
    out = os.path.join(str(base), "text", "corpus32.bin")
    if not os.path.exists(out):
        c = TextCorpus.open(p["corpus"], p["tok"], 320, seed=0, progress=False,
                            cache_dir=os.path.join(str(base), "text", "scratch"))
        np.asarray(c.stream("train"), dtype=np.uint32).tofile(out)
    return out


def cache32(base):
    return os.path.join(str(base), "cache32")


TRAIN = ["--mode", "train", "--batch", "4", "--length", "32", "--log-every", "1"]
TEXT = [*TRAIN, "--model", path("llama"), "--data", path("corpus"), "--val-fraction", "0.1"]
PROMPT = "The old man"
EVAL3 = ["--eval-every", "3", "--eval-batches", "1"]
W2 = Runs("compose4d.py", 2, tier="slow", runs={
    # the same two steps from the shards each rank reads and from the whole model, sliced
    "shards": [*TRAIN, "--model", path("tied"), "--tp", "2", "--dtype", "float64",
               "--steps", "2", "--data", path("corpus")],
    "full": [*TRAIN, "--model", path("tied"), "--tp", "2", "--dtype", "float64",
             "--steps", "2", "--data", path("corpus"), "--load", "full"],
    # the same tokens pre-tokenized as uint32, their cache entry in a directory of our choosing
    "bin32": [*TRAIN, "--model", path("tied"), "--tp", "2", "--dtype", "float64",
              "--steps", "2", "--data", bin32, "--data-dtype", "uint32", "--data-cache", cache32],
    # fine-tuning on text lowers the held-out loss; the greedy sample and the export
    "finetune": [*TEXT, "--pp", "2", "--dtype", "float32", "--steps", "40", "--batch", "8",
                 "--eval-every", "20", "--eval-batches", "2", "--lr", "3e-3",
                 "--prompt", PROMPT, "--gen-tokens", "12", "--export-hf", hf],
    # resume across layouts, float64: uninterrupted on tp 2; stopped at 3 on pp 2; resumed on tp 2
    # (with held-out evaluations after step 2: the same on tp 2, pp 2 and cp 2)
    "whole": [*TEXT, "--tp", "2", "--dtype", "float64", "--steps", "6", *EVAL3],
    "first": [*TEXT, "--pp", "2", "--dtype", "float64", "--steps", "6", "--stop-at", "3",
              "--save", ck, *EVAL3],
    "cp": [*TEXT, "--cp", "2", "--dtype", "float64", "--steps", "3", *EVAL3],
    "second": [*TEXT, "--tp", "2", "--dtype", "float64", "--steps", "6", "--resume", ck,
               "--save", ck],     # (--resume D --save D: D need not exist when validated)
    # packed documents (--doc-mask, positions restarting after each EOS): the same on tp 2, pp 2
    # and cp 2 (the ring's block masks, in training and in the held-out loss), and not the
    # unmasked run's ("whole")
    "packed-tp": [*TEXT, "--tp", "2", "--dtype", "float64", "--steps", "3",
                  "--doc-mask", "--eval-every", "2", "--eval-batches", "1"],
    "packed-pp": [*TEXT, "--pp", "2", "--dtype", "float64", "--steps", "3",
                  "--doc-mask", "--eval-every", "2", "--eval-batches", "1"],
    "packed-cp": [*TEXT, "--cp", "2", "--dtype", "float64", "--steps", "3",
                  "--doc-mask", "--eval-every", "2", "--eval-batches", "1"],
})


def rows(r):
    with open(os.path.join(r.out, "train.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_rows(r):
    return [x for x in rows(r) if "loss" in x]


def _ok(runs, key):
    r = runs(W2, key)
    assert r.rc == 0, r
    return r


@pytest.mark.slow
def test_each_rank_reads_its_shard_and_trains_as_the_whole_model_would(runs):
    shards, full = _ok(runs, "shards"), _ok(runs, "full")
    a, b = rows(shards), rows(full)
    assert [r["step"] for r in a] == [0, 1]
    for x, y in zip(a, b):       # float64, the same weights: the same losses and norms
        assert abs(x["loss"] - y["loss"]) <= 1e-12 * abs(y["loss"]), (x, y)
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-10 * abs(y["grad_norm"]), (x, y)
    assert "read its shard" in shards.stdout and "built all" in full.stdout
    # under tp 2 each rank holds about half the model (the norms are replicated)
    load = [l for l in shards.stdout.splitlines() if l.startswith("load rank")]
    assert len(load) == 2, shards.stdout


@pytest.mark.slow
def test_uint32_tokens_and_the_cache_directory(runs):
    """--data-dtype uint32 reads a raw .bin of 32-bit ids (the text run's own token stream, so
    the same samples and bitwise the same losses); --data-cache puts the entry where it says,
    nothing beside the data."""
    shards, b32 = _ok(runs, "shards"), _ok(runs, "bin32")
    assert [x["loss"] for x in train_rows(b32)] == [x["loss"] for x in train_rows(shards)]
    base = os.path.dirname(b32.out)     # the pool's directory: the fixtures, the cache
    assert any(f.endswith(".json") for f in os.listdir(cache32(base))), os.listdir(cache32(base))
    assert not os.path.exists(os.path.join(base, "text", ".corpus32.bin.tokens"))


@pytest.mark.slow
def test_finetuning_lowers_the_held_out_loss_and_logs_every_step(runs):
    r = _ok(runs, "finetune")
    log = rows(r)
    before, log = log[0], log[1:]
    assert before["step"] == -1 and set(before) == {"step", "eval_loss", "eval_ppl"}
    assert [x["step"] for x in log] == list(range(40))
    for x in log:
        assert {"loss", "lr", "grad_norm", "tokens_per_s", "memory_bytes", "mfu"} <= set(x)
        assert x["mfu"] is None          # CPU: no MFU
    evals = [x for x in log if "eval_loss" in x]
    assert [x["step"] for x in evals] == [19, 39]
    assert all(abs(x["eval_ppl"] - math.exp(x["eval_loss"])) < 1e-9 * x["eval_ppl"]
               for x in evals)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] < before["eval_loss"], evals
    assert evals[-1]["eval_loss"] < before["eval_loss"] - 0.5, (before, evals)
    assert log[-1]["loss"] < log[0]["loss"] - 1.0
    assert "held-out loss" in r.stdout and "data: " in r.stdout


@pytest.mark.slow
def test_the_export_gives_the_printed_greedy_continuation(runs):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    r = _ok(runs, "finetune")
    with open(os.path.join(r.out, "sample.json")) as f:
        sample = json.load(f)
    assert sample["prompt"] == PROMPT and f"greedy continuation: {sample['continuation']!r}" \
        in r.stdout
    d = hf(os.path.dirname(r.out))
    tok = AutoTokenizer.from_pretrained(d)                  # exported with the model
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = torch.tensor([tok(PROMPT, add_special_tokens=False).input_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                         do_sample=False, pad_token_id=tok.eos_token_id)
    assert tok.decode(out[0, ids.shape[1]:]) == sample["continuation"]
    assert len(sample["continuation"]) > 0
    # the last held-out loss (pp 2, forwards only) is the export's loss on the same sequences
    from harness import lm_loss_sum
    from harness.corpus import TextCorpus
    corpus = TextCorpus.open(fixtures(os.path.dirname(r.out))["corpus"], d, len(tok), 0,
                             val_fraction=0.1, progress=False)
    ce = n = 0
    with torch.no_grad():
        for k in range(2):
            b = corpus.batch("val", k, 8, 32, "cpu")
            ce += lm_loss_sum(model(input_ids=b.input_ids).logits, b.labels).item()
            n += b.n_tokens
    last = rows(r)[-1]["eval_loss"]
    assert abs(ce / n - last) <= 1e-5 * last, (ce / n, last)


@pytest.mark.slow
def test_resume_across_layouts_is_exact_with_the_data_position(runs):
    whole, first, second = (train_rows(_ok(runs, k)) for k in ("whole", "first", "second"))
    assert [x["step"] for x in first] == [0, 1, 2]
    assert [x["step"] for x in second][-3:] == [3, 4, 5]
    s2 = runs(W2, "second")
    assert "at step 3, sample 12" in s2.stdout, s2
    got = {x["step"]: x["loss"] for x in first + second}
    for x in whole:
        assert abs(got[x["step"]] - x["loss"]) <= 1e-12 * x["loss"], (x, got)
    # the held-out loss after step 2 (forwards only) on three layouts
    cp = train_rows(_ok(runs, "cp"))
    ev = [x["eval_loss"] for x in (whole[2], first[2], cp[2])]
    assert max(ev) - min(ev) <= 1e-12 * ev[0], ev
    ev0 = [rows(runs(W2, k))[0]["eval_loss"] for k in ("whole", "first", "cp")]   # before step 0
    assert max(ev0) - min(ev0) <= 1e-12 * ev0[0], ev0
    root = ck(os.path.dirname(runs(W2, "first").out))
    for step, samples in ((3, 12), (6, 24)):     # saved by the stopped run, then the resumed one
        with open(os.path.join(root, f"step-{step}", "meta.json")) as f:
            meta = json.load(f)
        assert meta["samples"] == samples and meta["length"] == 32 and len(meta["data"]) == 64


# -- bad input: one line, exit 2, before any process group ---------------------------------------
@pytest.mark.parametrize("args,msg", [
    (["--data", "MISSING"], "--data MISSING"),
    (["--data", "EMPTY"], "--data EMPTY"),
    (["--data", "CORPUS", "--eval-every", "5"], "--eval-every needs held-out documents"),
    (["--data", "CORPUS", "--length", "100000"], "--data CORPUS"),
    (["--mode", "correctness", "--data", "CORPUS"], "--data is read by --mode train"),
    (["--data", "CORPUS", "--model", "tiny"], "--data CORPUS: text needs a tokenizer"),
    (["--data", "CORPUS", "--model", "tiny", "--tokenizer", "TOK"], "--data CORPUS"),  # 256 < 320
    (["--prompt", "hi", "--model", "tiny"], "--prompt needs a tokenizer"),
])
def test_bad_text_inputs_end_with_one_line(tmp_path, args, msg):
    p = fixtures(tmp_path)
    empty = os.path.join(str(tmp_path), "empty.txt")
    open(empty, "w").close()
    subst = dict(MISSING=os.path.join(str(tmp_path), "nope.txt"), EMPTY=empty,
                 CORPUS=p["corpus"], TOK=p["tok"])
    args = [subst.get(a, a) for a in args]
    for k, v in subst.items():
        msg = msg.replace(k, v)
    base = ["--mode", "train", "--model", p["llama"]]
    r = launch("compose4d.py", 2, *base, *args, as_rank0=True)
    assert_config_error(r, msg, torchrun=False)


@pytest.mark.slow
def test_resume_refuses_a_checkpoint_of_other_data(tmp_path, runs):
    first = runs(W2, "first")
    p = fixtures(os.path.dirname(first.out))
    other = textdata.text_corpus(str(tmp_path), 50, seed=7, name="other.txt")
    r = launch("compose4d.py", 2, *TRAIN, "--model", p["llama"], "--data", other,
               "--resume", ck(os.path.dirname(first.out)), as_rank0=True)
    assert_config_error(r, "--resume", torchrun=False)
    assert "trained on other data" in r.stderr
    # the same data, but its documents masked: another objective
    r = launch("compose4d.py", 2, *TRAIN, "--model", p["llama"], "--data", p["corpus"],
               "--val-fraction", "0.1", "--doc-mask", "--resume", ck(os.path.dirname(first.out)),
               as_rank0=True)
    assert_config_error(r, f"--resume {ck(os.path.dirname(first.out))}: the checkpoint was "
                           f"trained without --doc-mask", torchrun=False)


@pytest.mark.slow
def test_packed_documents_train_the_same_on_any_layout(runs):
    """--mode train --doc-mask on the corpus: each document (EOS-terminated) attends within
    itself, positions restarting after each EOS; the losses and held-out losses are the same on
    tp 2, pp 2 and cp 2 (float64), and differ from the unmasked run's from the first step."""
    tp, pp, cp = (rows(_ok(runs, k)) for k in ("packed-tp", "packed-pp", "packed-cp"))
    for other in (pp, cp):
        assert len(other) == len(tp)
        for a, b in zip(tp, other):
            for key in ("loss", "eval_loss"):
                if key in a:
                    assert abs(a[key] - b[key]) <= 1e-12 * abs(b[key]), (key, a, b)
    packed, plain = (train_rows(_ok(runs, k)) for k in ("packed-tp", "whole"))
    assert [r["step"] for r in packed] == [0, 1, 2] and len(tp) == len(pp) > 3
    assert abs(packed[0]["loss"] - plain[0]["loss"]) > 1e-6, (packed[0], plain[0])
