"""Activation recompute (harness/recompute.py): gradients unchanged, the saved activations per
layer equal to the formula byte for byte, a recomputation that differs from the forward is
caught, and the strategies stay correct with it under torchrun."""
import copy

import pytest
import torch

import harness.recompute as rc
from conftest import Runs, assert_config_error, launch
from harness.models import load_config, model_kwargs, promote_norms


def tiny(attn, dtype=torch.float64, layers=None, seed=0):
    from transformers import AutoModelForCausalLM
    cfg = load_config("tiny")
    if layers:
        cfg.num_hidden_layers = layers
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg, **model_kwargs(cfg, attn))
    return promote_norms(m.to(dtype)).train()


def grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


IDS = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_gradients_do_not_change(attn, mode):
    ref_loss, ref = grads(tiny(attn), IDS)
    loss, got = grads(rc.apply_recompute(tiny(attn), mode), IDS)
    assert torch.equal(loss, ref_loss)
    for n in ref:
        assert torch.allclose(got[n], ref[n], rtol=1e-12, atol=1e-15), n


def test_a_recomputation_that_differs_from_the_forward_is_caught(monkeypatch):
    """The check above can fail: a full recompute whose second run of the layer sees shifted
    rotary positions (what a recompute that rebuilt positions would do under CP) changes the
    gradients, while the forward (and the loss) stays the same."""
    calls = {"n": 0}
    real = rc.checkpoint

    def shifted(fn, *args, **kwargs):
        runs = []

        def again(*a, **k):
            calls["n"] += 1
            runs.append(1)
            if len(runs) > 1:          # this layer's second run: the recomputation
                cos, sin = k["position_embeddings"]
                k = dict(k, position_embeddings=(cos.roll(1, 1), sin.roll(1, 1)))
            return fn(*a, **k)
        return real(again, *args, **kwargs)
    monkeypatch.setattr(rc, "checkpoint", shifted)
    ref_loss, ref = grads(tiny("sdpa"), IDS)
    loss, got = grads(rc.apply_recompute(tiny("sdpa"), "full"), IDS)
    assert torch.equal(loss, ref_loss) and calls["n"] == 8        # 4 layers, twice each
    assert max((got[n] - ref[n]).abs().max().item() for n in ref) > 1e-3


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_saved_activations_equal_the_formula(attn):
    cfg = load_config("tiny")
    got = {m: rc.per_layer_measured(cfg, m, attn, torch.float32, 2, 128)["per_layer"]
           for m in rc.MODES}
    want = {m: rc.activation_bytes(cfg, 2, 128, 4, m, attn) for m in rc.MODES}
    assert got == want
    assert got["full"] < got["selective"] < got["none"]
    if attn == "eager":      # selective removes the float32 softmax, 4 b a s^2, and eager's
        #                      k and v repeated to all heads, e b s (2 h - 2 g d)
        assert got["none"] - got["selective"] == 4 * 2 * 4 * 128 * 128 + 4 * 2 * 128 * 64


def test_skips_dropped_layers_and_rejects_bad_use():
    m = tiny("sdpa")
    m.model.layers[0] = torch.nn.Identity()        # a pipeline stage's dropped layer
    rc.apply_recompute(m, "full")
    assert "3 decoder layers" in rc.recompute_what(m)
    with pytest.raises(ValueError, match="installed already"):
        rc.apply_recompute(m, "selective")
    with pytest.raises(ValueError, match="must be one of"):
        rc.apply_recompute(tiny("sdpa"), "partial")
    untouched = rc.apply_recompute(tiny("sdpa"), "none")       # none: nothing installed
    assert not hasattr(untouched, "_recompute") and untouched.config.use_cache


def test_the_command_prints_the_table(capsys):
    rows = rc.main(["--model", "tiny", "--batch", "1", "--length", "64", "--attn", "eager"])
    assert [r["mode"] for r in rows] == list(rc.MODES)
    assert all(r["per_layer"] == r["formula"] for r in rows)
    assert "ratio" in capsys.readouterr().out


# -- the strategies with recompute, under torchrun (shares compose4d's W=2 launch) -----------
W2 = Runs("compose4d.py", 2, {
    "cp-full": ["--cp", "2", "--recompute", "full"],
    "tp-sp-selective": ["--tp", "2", "--sp", "--recompute", "selective", "--attn", "sdpa"],
})
PP = Runs("pp.py", 2, {"zb-full": ["--schedule", "zb", "--recompute", "full"]})


@pytest.mark.parametrize("batch,key", [(W2, "cp-full"), (W2, "tp-sp-selective"),
                                       (PP, "zb-full")])
def test_strategies_stay_correct_with_recompute(runs, batch, key):
    r = runs(batch, key)
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    assert "recompute " in r.stdout


def test_benchmark_refuses_recompute():
    r = launch("tp.py", 2, "--mode", "benchmark", "--recompute", "full", as_rank0=True)
    assert_config_error(r, "--recompute full: the benchmark's communication formulas",
                        torchrun=False)
