"""The chunked cross-entropy (harness/loss.py, --ce-chunk): the same loss and gradients as the
full logits, for the plain head (ddp.py) and tp.py's vocab-parallel one, the comm formula with
chunks, the refusals, oom_search's prediction, and the measurement script as a smoke test."""
import os
import subprocess
import sys

import pytest
import torch

import harness
from conftest import ROOT, Runs, assert_config_error, launch
from harness.loss import IGNORE_INDEX, ChunkedCrossEntropy, chunked_loss_sum, lm_loss_sum


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunks_give_the_full_logits_loss_and_gradients(chunk):
    """float64: each chunk's logits, loss and gradients are the full path's, to rounding,
    whether the chunk divides the tokens or not; ignored labels count nothing."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 21, 16, dtype=torch.float64, generator=g)
    weight = torch.randn(50, 16, dtype=torch.float64, generator=g)
    labels = torch.randint(0, 50, (3, 21), generator=g)
    labels[0, :4] = IGNORE_INDEX
    got, want = [], []
    for out, fn in ((got, lambda h, w: ChunkedCrossEntropy.apply(h, w, labels, chunk,
                                                                lm_loss_sum)),
                    (want, lambda h, w: lm_loss_sum(h @ w.t(), labels))):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fn(h, w)
        (loss / 7).backward()
        out += [loss.detach(), h.grad, w.grad]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)


def test_a_model_chunked_equals_the_model_whole():
    """Through an HF model (the head module returns its input inside; its weight is used
    directly): the loss and every parameter's gradient, float64."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(harness.load_config("tiny")).double()
    ids = torch.randint(0, 256, (2, 24))
    labels = torch.randint(0, 256, (2, 24))
    runs = []
    for chunk in (0, 10):
        m.zero_grad()
        loss = (chunked_loss_sum(m, ids, labels, chunk) if chunk else
                lm_loss_sum(m(input_ids=ids).logits, labels))
        loss.backward()
        runs.append((loss.detach(), [p.grad.clone() for p in m.parameters()]))
    assert "forward" not in vars(m.lm_head)   # the head is itself again
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-14, atol=0)
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("model", ["tiny", "configs/tiny-tied.json"])
def test_bf16_tied_and_evaluation(model):
    """bf16: the chunked loss is the full one's to bf16 noise (same values, gradients within a
    few bf16 ulps of the scale); tied embeddings (the head's weight is the embedding's: both
    gradients land in one tensor) in float64 to rounding; under no_grad the chunks' losses are
    summed and the head is itself again, also with a forward of its own set before."""
    from transformers import AutoModelForCausalLM
    cfg = harness.load_config(os.path.join(ROOT, model) if model.endswith(".json") else model)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    for dtype, tol in ((torch.float64, 1e-12), (torch.bfloat16, 0.05)):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg).to(dtype)
        grads, losses = [], []
        for chunk in (0, 10):
            m.zero_grad()
            loss = (chunked_loss_sum(m, ids, ids, chunk) if chunk else
                    lm_loss_sum(m(input_ids=ids).logits, ids))
            (loss / ids.numel()).backward()
            losses.append(loss.item())
            grads.append([p.grad.double() for p in m.parameters()])
        assert abs(losses[0] - losses[1]) <= tol * abs(losses[0]), (dtype, losses)
        for a, b in zip(*grads):
            assert (a - b).abs().max() <= tol * a.abs().max(), dtype
    own = lambda x: x  # noqa: E731
    m.lm_head.forward = own
    with torch.no_grad():
        ev = chunked_loss_sum(m, ids, ids, 7)
    assert m.lm_head.forward is own and abs(ev.item() - losses[0]) <= 0.05 * losses[0]


def test_the_loss_peak_follows_its_formula():
    """The chunked loss's live storages (FakeTensors, the tracker) against the formula, from a
    chunk where the forward's logits dominate to one where the backward's copies do."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import chunked_ce
    S, V, H = 2048, 8192, 256
    for C in (1024, 256, 16):
        got = chunked_ce.loss_peak(S, V, H, C)
        want = max(12 * C * V + 4 * (S + V) * H, 6 * (S + V) * H)
        assert abs(got - want) <= 0.02 * want, (C, got, want)
    assert abs(chunked_ce.loss_peak(S, V, H, 0) - 12 * S * V) <= 0.02 * 12 * S * V


RUNS = Runs("tp.py", 2, {
    "tp": ["--mode", "correctness", "--ce-chunk", "100"],
    "tp-bench": ["--mode", "benchmark", "--ce-chunk", "100", "--steps", "2", "--warmup", "1",
                 "--bench-iters", "1"],
})
DDP = Runs("ddp.py", 2, {"ddp": ["--mode", "correctness", "--ce-chunk", "48",
                                  "--grad-accum", "2"]})


@pytest.mark.parametrize("batch,key", [(RUNS, "tp"), (DDP, "ddp")], ids=["tp", "ddp"])
def test_chunked_strategies_pass(runs, batch, key):
    r = runs(batch, key)
    assert r.rc == 0 and r.last_line.startswith("PASS"), r


def test_the_vocab_parallel_loss_makes_three_all_reduces_per_chunk(runs):
    """N = 8 x 64 = 512 tokens in chunks of 100: 6 chunks, 18 all-reduces for the loss
    instead of 3, the same bytes (the benchmark fails on any other count)."""
    r = runs(RUNS, "tp-bench")
    assert r.rc == 0 and "communication matches the formulas" in r.stdout, r
    line = next(x for x in r.stdout.splitlines() if x.strip().startswith("all_reduce"))
    assert line.split()[2] == "36" and "the loss in 6 chunks" in line, line


@pytest.mark.parametrize("script,args,msg", [
    ("zero.py", ["--ce-chunk", "64"], "--ce-chunk: zero computes its loss on the full logits"),
    ("ddp.py", ["--ce-chunk", "-1"], "--ce-chunk must be >= 0"),
    ("tp.py", ["--ce-chunk", "64", "--model", "tiny-gemma2"],
     "--ce-chunk: the chunked loss does not soft-cap the logits"),
])
def test_chunking_is_refused_where_it_is_not_built(script, args, msg):
    r = launch(script, 2, "--mode", "correctness", *args, as_rank0=True)
    assert_config_error(r, msg, torchrun=False)


def test_oom_search_predicts_the_chunked_loss():
    """The prediction's logits term follows --ce-chunk and agrees with the simulated step's
    peak (FakeTensors, the live-storage tracker) as the full one does."""
    import oom_search
    cfg = harness.load_config("small")
    for chunk in (0, 128):
        pred = oom_search.predict_peak("ddp", 1, 1024, 1, cfg, 4, ce_chunk=chunk)["peak"]
        sim = oom_search.simulate_peak("ddp", 1, 1024, 1, "small", ce_chunk=chunk)["peak"]
        assert abs(pred - sim) <= 0.05 * sim, (chunk, pred, sim)
    full = oom_search.predict_peak("ddp", 1, 4096, 1, cfg, 2)
    part = oom_search.predict_peak("ddp", 1, 4096, 1, cfg, 2, ce_chunk=256)
    assert part["logits"] < full["logits"] / 4, (part, full)
    r = subprocess.run([sys.executable, "oom_search.py", "--strategy", "zero1", "--ce-chunk", "8",
                        "--simulate", "--mem-budget-gb", "1"], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: --ce-chunk 8:"), r.stderr


def test_the_measurement_script_runs():
    r = subprocess.run([sys.executable, "scripts/chunked_ce.py", "--seq", "256", "--vocab", "500",
                        "--hidden", "32", "--chunk", "64", "--model", "tiny", "--batch", "2",
                        "--length", "32", "--rounds", "1"], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0 and "of full" in r.stdout, r.stderr
