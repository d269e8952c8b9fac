"""harness/dropout.py: masks that are a pure function of (seed, step, layer, site, global sample,
position, feature), so a model with dropout gives one device's gradients at every layout. Unit
tests of the masks and the attention, then every strategy's correctness with attention and
hidden dropout (tiny-phi3, --dropout 0.1), the refusals, and resume after a save."""
import os
import types

import pytest
import torch

import harness
from conftest import Runs, assert_config_error, assert_resume_continues, config_file, launch
from harness import dropout

P = 0.1
DROP = ["--model", "tiny-phi3", "--dropout", str(P)]


def test_a_mask_is_the_same_whichever_shard_computes_it():
    """The whole (rows, heads, queries, keys) grid at once equals any block of it drawn on its
    own from its global indices: what a dp, tp or sp rank draws is what one device draws there."""
    key = dropout.site_key(seed=3, step=5, layer=1, site=0)
    b, h, s = torch.arange(6), torch.arange(4), torch.arange(32)
    grid = lambda b, h, q, k: dropout.keep_mask(   # noqa: E731
        P, key, b[:, None, None, None], h[None, :, None, None], q[None, None, :, None],
        k[None, None, None, :])
    whole = grid(b, h, s, s)
    assert torch.equal(grid(b[2:4], h[1:3], s[8:16], s), whole[2:4, 1:3, 8:16])
    assert torch.equal(grid(b[[5, 0]], h[[3]], s[[7, 31, 2]], s[:9]),
                       whole[[5, 0]][:, [3]][:, :, [7, 31, 2]][..., :9])
    # about p of the entries drop (24,576 entries: 4 sigma is 0.0077)
    assert abs((~whole).float().mean().item() - P) < 0.008
    # another step, layer or site draws another mask (uncorrelated: ~p^2 drop together)
    for other in (dropout.site_key(3, 6, 1, 0), dropout.site_key(3, 5, 2, 0),
                  dropout.site_key(3, 5, 1, 1), dropout.site_key(4, 5, 1, 0)):
        m = dropout.keep_mask(P, other, b[:, None, None, None], h[None, :, None, None],
                              s[None, None, :, None], s[None, None, None, :])
        both = ((~m) & (~whole)).float().mean().item()
        assert both < 3 * P * P and not torch.equal(m, whole)


def test_the_hash_stays_in_range_for_large_coordinates():
    """Coordinates up to 2^31 (a million-token sequence times a large batch) hash without
    int64 overflow: the same bits as Python's unbounded integers."""
    c = torch.tensor([0, 1, 2 ** 20, 2 ** 31 - 1], dtype=torch.int64)
    key = dropout.site_key(0, 2 ** 30, 127, 3)
    got = dropout._absorb(torch.tensor(key), c)
    want = [dropout._absorb(key, int(x)) for x in c]
    assert got.tolist() == want and all(0 <= w < 2 ** 32 for w in want)


def _attention_inputs(nh=4, nkv=2, s=12, d=8):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, s, d, generator=g, dtype=torch.float64)
               for n in (nh, nkv, nkv))
    module = types.SimpleNamespace(num_key_value_groups=nh // nkv, training=True, scaling=d ** -0.5,
                                   dropout_layer=0, dropout_seed=0)
    return module, q, k, v


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_attention_without_dropout_is_hfs_eager(softcap):
    """dropout.attention at p = 0 is HF's eager attention (Llama's; Gemma2's with soft-capping),
    GQA and the additive causal mask included; no mask means causal."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2
    from transformers.models.llama.modeling_llama import eager_attention_forward as llama
    module, q, k, v = _attention_inputs()
    mask = dropout.causal_mask(q.shape[2], q.dtype, q.device)
    if softcap is None:
        want, _ = llama(module, q, k, v, mask, scaling=module.scaling)
    else:
        want, _ = gemma2(module, q, k, v, mask, scaling=module.scaling, softcap=softcap)
    got, _ = dropout.attention(module, q, k, v, mask, softcap=softcap)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)
    got, _ = dropout.attention(module, q, k, v, None, softcap=softcap)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)


def test_attention_dropout_keys_the_heads_globally():
    """A tp rank's two heads, given their global ids, get the entries of the whole model's."""
    module, q, k, v = _attention_inputs()
    batch = harness.Batch(torch.zeros(2, 12, dtype=torch.long), torch.zeros(2, 12,
                          dtype=torch.long), 7)
    with dropout.at(batch):
        _, full = dropout.attention(module, q, k, v, None, dropout=P)
        _, half = dropout.attention(module, q[:, 2:], k[:, 1:], v[:, 1:], None, dropout=P,
                                    heads=torch.tensor([2, 3]))
        _, wrong = dropout.attention(module, q[:, 2:], k[:, 1:], v[:, 1:], None, dropout=P)
    assert torch.equal(half, full[:, 2:]) and not torch.equal(wrong, full[:, 2:])
    assert (full == 0).any() and full.max() > 1    # dropped, and the kept ones scaled


def _phi3(p=P):
    args = harness.resolve_defaults(harness.base_parser("t").parse_args(
        ["--model", "tiny-phi3", "--dropout", str(p), "--dtype", "float64"]), "correctness",
        "cpu", 1)
    cfg = harness.load_config("tiny-phi3", dropout=p)
    assert not harness.common_constraints(args, 1, cfg)
    return harness.build_model(args, cfg, "cpu")


def test_a_built_model_drops_where_its_config_says():
    m = _phi3()
    drops = [n for n, x in m.named_modules() if isinstance(x, dropout.HiddenDropout)]
    assert len(drops) == 2 * m.config.num_hidden_layers, drops
    assert m.config._attn_implementation == dropout.IMPL
    ids = torch.randint(0, m.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = harness.Batch(ids, ids, 0)
    with pytest.raises(RuntimeError, match="outside harness.dropout.at"):
        m(input_ids=ids)
    with dropout.at(batch):
        a, b = m(input_ids=ids).logits, m(input_ids=ids).logits
    with dropout.at(harness.Batch(ids, ids, 1)):
        c = m(input_ids=ids).logits
    assert torch.equal(a, b) and not torch.equal(a, c)   # a function of the step
    m.eval()
    plain = _phi3(0.0)   # the same weights (seeded init) without dropout
    plain.eval()
    # in eval it is the plain model's function (eager attention here, SDPA there)
    torch.testing.assert_close(m(input_ids=ids).logits, plain(input_ids=ids).logits,
                               rtol=1e-12, atol=1e-12)
    assert (a - plain(input_ids=ids).logits).abs().max() > 1e-3


# -- every strategy at W=2 (and one uneven world) against one device --
HIDDEN_ONLY = config_file("phi3-hidden-dropout", preset="tiny-phi3", resid_pdrop=P,
                          attention_dropout=0.0)
QUICK = Runs("tp.py", 2, {"tp": ["--mode", "correctness", *DROP]})
SLOW = {
    ("tp.py", 2): {"tp-llama": ["--mode", "correctness", "--model", "tiny", "--dropout", str(P)],
                   # StarCoder2's residual_dropout: function calls (FunctionalDropout)
                   "tp-starcoder2": ["--mode", "correctness", "--model", "tiny-starcoder2",
                                     "--dropout", str(P)]},
    ("tp.py", 4): {"tp-kv-copies": ["--mode", "correctness", "--model", "tiny", "--dropout",
                                    str(P)]},                           # 2 kv heads, 4 ranks
    ("ddp.py", 2): {"ddp": ["--mode", "correctness", *DROP, "--grad-accum", "2"],
                    "ddp-learning": ["--mode", "learning", *DROP, "--steps", "30"]},
    ("ddp.py", 3): {"ddp": ["--mode", "correctness", *DROP, "--batch", "6"]},
    # (ZeRO-2 shards only what ZeRO-1 does after the backward, qgZ only the gradients' wire:
    # neither touches an activation, so zero1 and qwz stand for them)
    ("zero.py", 2): {"zero1": ["--mode", "correctness", *DROP, "--stage", "1"],
                     "zero3": ["--mode", "correctness", *DROP, "--stage", "3"]},
    ("fsdp.py", 2): {"fsdp": ["--mode", "correctness", *DROP]},
    ("sp.py", 2): {"megatron": ["--mode", "correctness", *DROP, "--variant", "megatron"],
                   "ulysses": ["--mode", "correctness", *DROP, "--variant", "ulysses"]},
    ("pp.py", 2): {"pp-full": ["--mode", "correctness", *DROP, "--recompute", "full"],
                   "pp-selective": ["--mode", "correctness", *DROP, "--recompute", "selective",
                                    "--schedule", "zb"]},
    ("cp_ring.py", 2): {"cp-hidden": ["--mode", "correctness", "--model", HIDDEN_ONLY]},
    ("ep_moe.py", 2): {"ep": ["--mode", "correctness", "--dropout", str(P)]},
    ("zeropp.py", 2): {"qwz": ["--mode", "correctness", *DROP, "--zeropp", "qwz"]},
    ("compose4d.py", 4): {"tp-pp": ["--mode", "correctness", *DROP, "--tp", "2", "--pp", "2"],
                          "dp-tp-sp": ["--mode", "correctness", *DROP, "--dp", "2", "--tp", "2",
                                       "--sp", "--grad-accum", "2"]},
}
# the four-rank worlds and the pipeline's two schedules run in the heavy tier (make test's budget)
HEAVY = {("tp.py", 4), ("pp.py", 2), ("compose4d.py", 4)}
SLOW_RUNS = {k: Runs(s, w, runs, tier="heavy" if k in HEAVY else "slow")
             for (s, w), runs in SLOW.items() for k in [(s, w)]}


def _passes(r, rates="{'attention_dropout': 0.1, 'resid_pdrop': 0.1}"):
    """PASS, with the dropout on (the run's header names it)."""
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    assert f" dropout={rates}" in r.stdout, r


def test_tp_with_attention_and_hidden_dropout_passes(runs):
    _passes(runs(QUICK, "tp"))


@pytest.mark.slow
@pytest.mark.parametrize("script,world,key", [
    pytest.param(s, w, k, marks=[pytest.mark.heavy] if (s, w) in HEAVY else [])
    for (s, w), rs in SLOW.items() for k in rs if "learning" not in k])
def test_every_strategy_with_dropout_passes(runs, script, world, key):
    rates = {"cp-hidden": "{'resid_pdrop': 0.1}", "tp-llama": "{'attention_dropout': 0.1}",
             "tp-kv-copies": "{'attention_dropout': 0.1}",
             "tp-starcoder2": "{'attention_dropout': 0.1, 'residual_dropout': 0.1}",
             "ep": "{'attention_dropout': 0.1}"}
    kw = {"rates": rates[key]} if key in rates else {}
    _passes(runs(SLOW_RUNS[script, world], key), **kw)


@pytest.mark.slow
def test_dropout_learns_and_agrees_with_one_device(runs):
    r = runs(SLOW_RUNS["ddp.py", 2], "ddp-learning")
    res = r.json("learning.json")
    assert r.rc == 0 and res["losses_agree"] and res["norms_agree"] and res["ok"], r


@pytest.mark.parametrize("script,args,msg", [
    ("cp_ring.py", DROP, "context parallelism's ring attention does not implement attention "
                         "dropout (attention_dropout=0.1)"),
    ("compose4d.py", [*DROP, "--cp", "2"], "--cp 2: context parallelism's ring attention does "
                                           "not implement attention dropout"),
    ("ddp.py", ["--dropout", "1.5"], "--dropout must be in [0, 1) (got 1.5)"),
    ("ddp.py", [*DROP, "--compare-native"], "--compare-native / --paired with dropout"),
    ("pp.py", [*DROP, "--mode", "benchmark", "--paired", "3"], "--compare-native / --paired"),
    ("tp.py", [*DROP, "--mode", "benchmark"], "--mode benchmark with dropout"),
])
def test_what_cannot_drop_the_same_everywhere_is_refused(script, args, msg):
    r = launch(script, 2, "--mode", "correctness", *args, as_rank0=True)
    assert_config_error(r, msg, torchrun=False)


def test_where_the_model_drops_is_found_by_running_it():
    """The probe forward (harness/cli.py): a dropout torch would draw itself (outside the
    decoder layers, where the layer-by-layer strategies do not run the model's forward) is
    refused in one line naming the model's line; a rate the forward never applies draws
    nothing and passes (a field Llama does not read, GPT-2's summary_first_dropout)."""
    from harness.cli import _dropout_errors
    args = harness.base_parser("t").parse_args([])
    sc2 = harness.load_config("tiny-starcoder2")
    sc2.residual_dropout = sc2.embedding_dropout = P   # in the layers (keyed) and outside
    errs = _dropout_errors(sc2, args)
    assert len(errs) == 1 and errs[0].startswith(
        f"dropout: p={P} at modeling_starcoder2.py:") and "outside the decoder layers" in errs[0]
    sc2.embedding_dropout = 0.0
    assert _dropout_errors(sc2, args) == []
    neox = harness.load_config("tiny-neox")
    neox.hidden_dropout = P   # GPT-NeoX's emb_dropout module reads it too
    assert _dropout_errors(neox, args) == [
        f"dropout: gpt_neox.emb_dropout (p={P}) sits outside the decoder layers (--dropout 0 "
        f"turns the model's dropout off)"]
    llama = harness.load_config("tiny")
    llama.foo_dropout = P
    assert dropout.rate_fields(llama) == {"foo_dropout": P} and _dropout_errors(llama, args) == []
    gpt2 = harness.load_config("tiny-gpt2")
    assert dropout.rate_fields(gpt2) == {"summary_first_dropout": 0.1} and not dropout.rates(gpt2)
    assert _dropout_errors(gpt2, args) == []


@pytest.mark.parametrize("family,field", [("tiny-starcoder2", "residual_dropout"),
                                          ("tiny-opt", "dropout")])
def test_a_functional_dropout_is_keyed_like_a_module(family, field):
    """StarCoder2 and OPT drop by function call inside their layers (no nn.Dropout to replace;
    OPT's on the flattened (rows * tokens, hidden) MLP output): FunctionalDropout keys them by
    coordinates, so rows 2..3 computed alone draw the masks they draw inside the whole batch,
    the step changes them, and a recomputed layer draws its forward's. With the calls left to
    torch (the plant) the rows computed alone draw other masks."""
    from harness.plants import planting
    from harness.recompute import apply_recompute
    cfg = harness.load_config(family)
    setattr(cfg, field, P)
    args = harness.base_parser("t").parse_args(["--model", family, "--dtype", "float64"])
    torch.manual_seed(0)
    m = harness.build_model(args, cfg, "cpu")
    ids = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    whole, part = harness.Batch(ids, ids, 0), harness.Batch(ids, ids, 0).rows(2, 4)

    def logits(batch, model=m):
        with dropout.at(batch):
            return model(input_ids=batch.input_ids).logits
    ref = logits(whole)
    torch.testing.assert_close(logits(part), ref[2:4], rtol=1e-12, atol=1e-12)
    assert not torch.equal(logits(harness.Batch(ids, ids, 1)), ref)        # another step
    m.eval()
    assert (m(input_ids=ids).logits - ref).abs().max() > 1e-3             # it drops
    m.train()
    with planting("dropout-functional-torch"):
        assert (logits(part) - ref[2:4]).abs().max() > 1e-3
    import copy
    recomputed = apply_recompute(copy.deepcopy(m), "full")
    grads = []
    for model in (m, recomputed):
        logits(whole, model).logsumexp(-1).mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)
    assert dropout._LAYER_MODES == []    # every layer's mode exited


# -- resume: a mask is a function of the step, so 2 + save + 2 equals 4 uninterrupted --
# (from a local HF directory: the model is built on the meta device and read shard by shard)
def _hf_dir(base):
    from transformers import AutoModelForCausalLM
    path = os.path.join(str(base), "phi3-hf")
    if not os.path.isdir(path):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(harness.load_config("tiny-phi3")).save_pretrained(path)
    return path


TRAIN = ["--mode", "train", "--dtype", "float64", "--steps", "4", "--log-every", "1",
         "--model", _hf_dir, "--dropout", str(P)]


def _ck(base):
    return os.path.join(str(base), "ck-dropout")


RESUME = Runs("compose4d.py", 2, tier="slow", runs={
    "full": [*TRAIN, "--tp", "2"],
    "first": [*TRAIN, "--tp", "2", "--stop-at", "2", "--save", _ck],
    "second": [*TRAIN, "--dp", "2", "--resume", _ck, "--save", _ck],
})


@pytest.mark.slow
def test_dropout_resumes_exactly_on_another_layout(runs):
    assert_resume_continues(runs, RESUME, "full", "first", "second", cut=2, steps=4)
    # the checkpoint records the dropout; a resume with another rate or seed (other masks from
    # there on: not the run it continues) is refused
    from trainer4d import checkpoint
    base = os.path.dirname(runs(RESUME, "first").out)
    ck = _ck(base)
    assert checkpoint.dropout_of(checkpoint.latest_dir(ck)) == dict(
        rates={"attention_dropout": P, "resid_pdrop": P}, seed=0)
    for other in (["--dropout", "0.2"], ["--seed", "1"]):
        bad = launch("compose4d.py", 2, *TRAIN[:-4], "--model", _hf_dir(base), "--dropout",
                     str(P), "--resume", ck, *other, as_rank0=True)
        assert_config_error(bad, f"--resume {ck}: saved with dropout", torchrun=False)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_draws_the_forwards_masks(mode):
    """A recomputed layer in the backward (outside dropout.at by then) draws the masks its
    forward drew: the gradients equal the plain model's, also for a second backward of the
    same graph (torch re-enters one recompute context per frame)."""
    from harness.recompute import apply_recompute
    plain, checkpointed = _phi3(), apply_recompute(_phi3(), mode)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    grads = []
    for m in (plain, checkpointed):
        with dropout.at(harness.Batch(ids, ids, 3)):
            loss = m(input_ids=ids).logits.logsumexp(-1).mean()
        loss.backward(retain_graph=True)
        grads.append([p.grad.clone() for p in m.parameters()])
        m.zero_grad()
        loss.backward()
        assert all(torch.equal(p.grad, g) for p, g in zip(m.parameters(), grads[-1]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)
