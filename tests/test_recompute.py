"""Activation recompute (harness/recompute.py): gradients unchanged, the saved activations per
layer equal to the formula byte for byte, the recomputation really runs (and one that differs
from the forward is caught), and the strategies stay correct with it under torchrun."""
import pytest
import torch

import harness.recompute as rc
from conftest import Runs, assert_config_error, config_file, launch
from harness.models import load_config, model_kwargs, keep_float64


def tiny(attn, dtype=torch.float64, layers=None, seed=0, preset="tiny"):
    from transformers import AutoModelForCausalLM
    cfg = load_config(preset)
    if layers:
        cfg.num_hidden_layers = layers
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg, **model_kwargs(cfg, attn))
    return keep_float64(m.to(dtype)).train()


def grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_grads(got, ref):
    assert got.keys() == ref.keys()
    for n in ref:
        assert torch.allclose(got[n], ref[n], rtol=1e-12, atol=1e-15), n


IDS = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_gradients_do_not_change(attn, mode):
    ref_loss, ref = grads(tiny(attn), IDS)
    loss, got = grads(rc.apply_recompute(tiny(attn), mode), IDS)
    assert torch.equal(loss, ref_loss)
    assert_same_grads(got, ref)


def kv_cache(out):
    """The output's KV cache: `cache` from transformers 5.24, `past_key_values` before."""
    return out["cache"] if "cache" in out else out.past_key_values


def test_full_leaves_a_kv_cache_alone():
    """A forward with use_cache=True (HF's default config): the recomputation must not append
    to the cache again; the config is not edited (an exported model keeps use_cache)."""
    ref_loss, ref = grads(tiny("sdpa"), IDS)
    m = rc.apply_recompute(tiny("sdpa"), "full")
    assert m.config.use_cache
    m.zero_grad(set_to_none=True)
    out = m(input_ids=IDS, use_cache=True)
    loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1),
                                             IDS[:, 1:].flatten())
    loss.backward()
    assert kv_cache(out).get_seq_length() == 0      # not filled twice (48 + 48)
    assert torch.equal(loss.detach(), ref_loss)
    assert_same_grads({n: p.grad for n, p in m.named_parameters()}, ref)
    with torch.no_grad():      # evaluation / generation: the layers run as they are, cached
        assert kv_cache(m(input_ids=IDS, use_cache=True)).get_seq_length() == 48


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_gradients_do_not_change_mixtral(mode):
    """The MoE model (router, experts) under either mode, eager attention."""
    ref_loss, ref = grads(tiny("eager", preset="tiny-moe"), IDS)
    loss, got = grads(rc.apply_recompute(tiny("eager", preset="tiny-moe"), mode), IDS)
    assert torch.equal(loss, ref_loss)
    assert_same_grads(got, ref)


def test_selective_wraps_a_registered_attention():
    """Like cp_ring's "ring_cp": a custom function in HF's registry is wrapped, not replaced,
    and really runs twice per layer (forward, recomputation), with unchanged gradients."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    calls = []

    def probe(module, *args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return sdpa_attention_forward(module, *args, **kwargs)
    AttentionInterface.register("probe_attn", probe)
    ref_loss, ref = grads(tiny("sdpa"), IDS)
    m = tiny("sdpa")
    m.config._attn_implementation = "probe_attn"
    rc.apply_recompute(m, "selective")
    assert m.config._attn_implementation == "recompute_probe_attn"
    assert "recompute_probe_attn" in rc.recompute_what(m)
    loss, got = grads(m, IDS)
    assert len(calls) == 2 * 4         # 4 layers: the forward, then the backward's recompute
    assert torch.equal(loss, ref_loss)
    assert_same_grads(got, ref)
    with torch.no_grad():              # no grad: no checkpoint, one call per layer
        m(input_ids=IDS)
    assert len(calls) == 3 * 4


def test_a_recomputation_that_differs_from_the_forward_is_caught(monkeypatch):
    """The gradient check can fail: a full recompute whose second run of the layer sees
    shifted rotary positions (what a recompute that rebuilt positions would do under CP)
    changes the gradients, while the forward (and the loss) stays the same."""
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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_activations_equal_the_formula(attn, dtype):
    cfg = load_config("tiny")
    got = {m: rc.per_layer_measured(cfg, m, attn, dtype, 2, 128, repeats=0)["per_layer"]
           for m in rc.MODES}
    want = {m: rc.activation_bytes(cfg, 2, 128, dtype.itemsize, m, attn) for m in rc.MODES}
    assert got == {m: w["per_layer"] for m, w in want.items()}          # byte for byte
    assert all(w["layers"] == 4 * w["per_layer"] for w in want.values())
    assert all(w["per_layer"] == w["inside"] + w["outside"] for w in want.values())
    assert got["full"] < got["selective"] < got["none"]
    if dtype == torch.bfloat16:
        # the check can fail: the float32 formula with e = 2 (no upcast copies) misses HF's
        # float32 RMSNorm inputs, 2 (4 - e) b s h per layer, and eager's softmax copy
        h, I, b, s, e = cfg.hidden_size, cfg.intermediate_size, 2, 128, 2
        naive = e * b * s * (8 * h + 2 * 2 * 16 + 4 * I) + 2 * 4 * b * s
        assert got["selective"] - naive == 2 * 2 * b * s * h, (got, naive)
        return
    if attn == "eager":      # selective removes the float32 softmax, 4 b a s^2, and eager's
        #                      k and v repeated to all heads, e b s (2 h - 2 g d)
        assert got["none"] - got["selective"] == 4 * 2 * 4 * 128 * 128 + 4 * 2 * 128 * 64
    else:                    # sdpa (CPU flash) keeps no s^2 tensor: only its logsumexp goes
        assert got["none"] - got["selective"] == 4 * 2 * 4 * 128


def test_measure_on_a_model():
    """measure(): the three modes on one model (applied to copies, the model left as it is),
    activation bytes strictly ordered full < selective < none under eager, so the memory
    checks cannot pass vacuously; a model with another mode installed is refused."""
    m = tiny("eager", dtype=torch.float32)
    ids = IDS[:, :32]
    got = {mode: rc.measure(m, ids, mode, repeats=1) for mode in rc.MODES}
    assert not hasattr(m, "_recompute") and m.config._attn_implementation == "eager"
    act = {k: v["activation_bytes"] for k, v in got.items()}
    assert act["full"] < act["selective"] < act["none"], act
    rc.apply_recompute(m, "full")
    assert rc.measure(m, ids, "full", repeats=0)["activation_bytes"] == act["full"]
    with pytest.raises(ValueError, match="has recompute 'full' installed"):
        rc.measure(m, ids, "selective")


def test_skips_dropped_layers_and_rejects_bad_use():
    m = tiny("sdpa")
    m.model.layers[0] = torch.nn.Identity()        # a pipeline stage's dropped layer
    m.model.layers[3] = torch.nn.Identity()
    rc.apply_recompute(m, "full")
    assert "2 decoder layers" in rc.recompute_what(m)
    with pytest.raises(ValueError, match="installed already"):
        rc.apply_recompute(m, "selective")
    s = rc.apply_recompute(tiny("sdpa", layers=2), "selective")
    with pytest.raises(ValueError, match="installed already"):
        rc.apply_recompute(s, "selective")
    with pytest.raises(ValueError, match="must be one of"):
        rc.apply_recompute(tiny("sdpa"), "partial")
    with pytest.raises(ValueError, match="mode must be one of"):
        rc.activation_bytes(load_config("tiny"), 1, 8, 4, "partial")
    with pytest.raises(ValueError, match="unwrap"):
        rc.apply_recompute(torch.nn.Linear(2, 2), "full")
    untouched = rc.apply_recompute(tiny("sdpa"), "none")       # none: nothing installed
    assert not hasattr(untouched, "_recompute") and untouched.config.use_cache


def test_every_strategy_takes_the_argument():
    from harness import MODES, base_parser
    p = base_parser("x.py")
    choices = next(a.choices for a in p._actions if a.dest == "recompute")
    assert tuple(choices) == MODES == rc.MODES
    assert p.parse_args([]).recompute == "none"


def test_the_command_prints_the_table(capsys):
    rows = rc.main(["--model", "tiny", "--batch", "1", "--length", "64", "--attn", "eager",
                    "--repeats", "1"])
    assert [r["mode"] for r in rows] == list(rc.MODES)
    assert all(r["per_layer"] == r["formula"] for r in rows)
    out = capsys.readouterr().out
    assert "ratio" in out and "Korthikanti" in out
    # one round: no extra time is printed (one slow step would decide its sign)
    assert "%" not in out and "none below --repeats 5" in out and rows[1]["extra"] is None


def test_extra_time_is_the_median_of_paired_rounds():
    none = [1.0, 1.0, 2.0, 1.0, 1.0, 1.0]          # round 3: the machine slowed both
    full = [1.3, 1.2, 2.6, 1.25, 1.4, 1.1]
    x = rc.extra_time({"none": none, "full": full}, "full")
    ratios = sorted([1.3, 1.2, 1.3, 1.25, 1.4, 1.1])
    assert x["median"] == pytest.approx((ratios[2] + ratios[3]) / 2 - 1)
    # linearly interpolated (harness.meter.quantile): at 0.1 x 5 = 0.5 and 0.9 x 5 = 4.5
    assert x["p10"] == pytest.approx((ratios[0] + ratios[1]) / 2 - 1)
    assert x["p90"] == pytest.approx((ratios[4] + ratios[5]) / 2 - 1)
    assert rc.extra_time({"none": none[:4], "full": full[:4]}, "full") is None


# -- the strategies with recompute, under torchrun --------------------------------------------
# (the slow tier: each joins its script's slow W=2 launch)
W2 = Runs("compose4d.py", 2, tier="slow", runs={
    "cp-full": ["--cp", "2", "--recompute", "full"],
    "tp-sp-selective": ["--tp", "2", "--sp", "--recompute", "selective", "--attn", "sdpa"],
})
PP = Runs("pp.py", 2, tier="slow", runs={"zb-full": ["--schedule", "zb", "--recompute", "full"]})
SLOW_TP = Runs("tp.py", 2, tier="slow", runs={
    "tp-full": ["--recompute", "full"],
    "tp-selective-eager": ["--recompute", "selective", "--attn", "eager"]})
SLOW_FSDP = Runs("fsdp.py", 2, tier="slow", runs={   # gathers re-entered by the recompute
    "fsdp-full-accum": ["--recompute", "full", "--grad-accum", "2", "--prefetch", "2"]})
SLOW_ZERO = Runs("zero.py", 2, tier="slow", runs={
    "zero3-selective": ["--stage", "3", "--recompute", "selective", "--attn", "eager"]})
SLOW_CP = Runs("cp_ring.py", 2, tier="slow", runs={  # wraps "ring_cp"
    "cp-selective": ["--recompute", "selective"]})


@pytest.mark.slow
@pytest.mark.parametrize("batch,key", [
    pytest.param(b, k, id=k)
    for b in (W2, PP, SLOW_TP, SLOW_FSDP, SLOW_ZERO, SLOW_CP) for k in b.runs])
def test_strategies_stay_correct_with_recompute(runs, batch, key):
    r = runs(batch, key)
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    mode = next(batch.runs[key][i + 1] for i, a in enumerate(batch.runs[key])
                if a == "--recompute")
    assert f"recompute {mode}: " in r.stdout, r


def test_benchmark_refuses_recompute():
    r = launch("tp.py", 2, "--mode", "benchmark", "--recompute", "full", as_rank0=True)
    assert_config_error(r, "--recompute full: the benchmark's communication formulas",
                        torchrun=False)


def test_ep_refuses_full_recompute():
    r = launch("ep_moe.py", 2, "--recompute", "full", as_rank0=True)
    assert_config_error(r, "--recompute full: the routing statistics", torchrun=False)


# Sequence parallelism with full recompute keeps each layer's input chunk, 1/T of it, and
# nothing else: the re-gather hooks SP installs on entering a region must stay out of a
# checkpointed layer (harness.recompute.inside_checkpoint), or, innermost, they win over the
# checkpoint's and keep what it drops. Measured per layer as the difference between a 4- and a
# 2-layer model (the peak mode's live-tensor tracker, float32, W = T = 2, B 2, S 256): before
# the fix 921,600 B per layer under compose4d --sp, against the 65,536 of the prediction.
PEAK = ["--mode", "peak", "--recompute", "full", "--batch", "2", "--length", "256",
        "--dtype", "float32"]
LAYERS = {4: "tiny", 2: config_file("tiny-2layers", num_hidden_layers=2)}
SP_PEAK = {"sp.py": Runs("sp.py", 2, tier="slow", runs={
               f"peak {n}": [*PEAK, "--model", m] for n, m in LAYERS.items()}),
           "compose4d.py": Runs("compose4d.py", 2, tier="slow", runs={
               f"peak {n}": [*PEAK, "--tp", "2", "--sp", "--model", m]
               for n, m in LAYERS.items()})}


@pytest.mark.slow
@pytest.mark.parametrize("script", list(SP_PEAK))
def test_sp_with_full_recompute_keeps_only_the_layer_input_chunks(runs, script):
    import json
    act = {}
    for n in LAYERS:
        r = runs(SP_PEAK[script], f"peak {n}")
        assert r.rc == 0, r
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith("TRIAL OK"))
        act[n] = [x["activations"] for x in json.loads(line[len("TRIAL OK"):])["ranks"]]
    per_layer = [(a - b) / 2 for a, b in zip(act[4], act[2])]
    want = rc.activation_bytes(load_config("tiny"), 2, 256 // 2, 4, "full")["per_layer"]
    assert want == 4 * 2 * 128 * 64
    assert per_layer == [want, want], (per_layer, want)


@pytest.mark.slow
@pytest.mark.parametrize("plant", [None, pytest.param("sp-unsplit", marks=pytest.mark.heavy)])
def test_the_activation_model_splits_as_tp_and_sp_ranks_hold(plant):
    """At T = 2 each rank's live storage per layer (tp.py, and sp.py's sequence-sharded norms),
    float32 and bf16, no recompute and selective, equals activation_bytes(tp=2, sp=...) within
    one (b, s, h/T) tensor (the measured noise; tests/tp_activation_check.py), and the unsplit
    model is far off. The check can fail: a model that forgets SP's split of the norms' tokens
    (--plant sp-unsplit) FAILS."""
    r = launch("tests/tp_activation_check.py", 2, *(["--plant", plant] if plant else []),
               timeout=240)
    assert r.stdout.count(" measured ") == 8, r
    assert (r.rc == 0 and r.stdout.rstrip().endswith("PASS")) == (plant is None), r
