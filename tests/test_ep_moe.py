"""ep_moe.py: routing math against HF's, the reference's router losses against HF's, capacity
priority, the all-to-all round trip, then the full model against the single-device reference
(HF's own MoE block where HF has one) under torchrun on CPU."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import harness
import ep_moe
from conftest import ROOT, Runs, assert_config_error, config_file

N_TENSORS = 21  # tiny-moe: embed, head, final norm + 2 layers x (4 attn, 2 norms, gate, 2 experts)
DROPLESS = ["--aux-coef", "0.01", "--z-coef", "0.001"]
W2 = Runs("ep_moe.py", 2, {  # one launch per batch: the start-up (~10 s a process) paid once
    "dropless": DROPLESS,
    "capacity": ["--capacity-factor", "1.0"],
    "learning": ["--mode", "learning", "--steps", "40", "--lr", "1e-2", "--log-every", "20"],
    "bench": ["--mode", "benchmark", "--bench-iters", "3", "--warmup", "1"],
})
SLOW_W4 = Runs("ep_moe.py", 4, tier="slow", runs={
    "dropless": DROPLESS,
    "capacity": ["--capacity-factor", "0.8", "--z-coef", "0.001", "--clip", "0.5"]})
# 6 experts over 3 ranks (a world size that is no power of two), bias-based balancing
SLOW_W3 = Runs("ep_moe.py", 3, tier="slow", runs={"aux-free": [
    "--model", config_file("moe6", "tiny-moe", num_local_experts=6), "--batch", "6",
    "--aux-free-bias", "--aux-coef", "0", "--steps", "3"]})


def tiny_moe(dtype=torch.float32):
    config = harness.load_config("tiny-moe")
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_config(config, experts_implementation="eager").to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_route_is_hf_router_math(dtype):
    # bit for bit, in float64 too: both softmax in float32 (HF's .float()), so a float64 run
    # selects and weights its experts exactly as the reference's HF block does
    model = tiny_moe(dtype)
    gate = model.model.layers[0].mlp.gate
    x = torch.randn(50, 64, dtype=dtype)
    hf_logits, hf_w, hf_idx = gate(x)
    logits, probs, w, idx = ep_moe.route(gate.weight, x, 2)
    assert torch.equal(logits, hf_logits) and torch.equal(idx, hf_idx) and torch.equal(w, hf_w)
    # the planted bug: weights that no longer sum to one
    w_bad = ep_moe.route(gate.weight, x, 2, renormalise=False)[2]
    assert (w_bad.sum(-1) < 1 - 1e-3).all() and torch.equal(w_bad / w_bad.sum(-1, True), w)


def test_reference_is_hf_block_where_hf_has_one():
    """Dropless without a bias, the reference model keeps HF's MixtralSparseMoeBlock (none of
    ep_moe's code); with capacity or the aux-free bias it needs ep_moe's ReferenceMoE."""
    from types import SimpleNamespace
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    base = dict(lr=1e-3, weight_decay=0.1, aux_coef=0.01, z_coef=0.0, capacity_factor=None,
                aux_free_bias=False, bias_rate=1e-3, clip=0.0, plant_bug=None)
    ref = ep_moe.MoEReference(tiny_moe(), SimpleNamespace(**base), None)
    assert all(type(l.mlp) is MixtralSparseMoeBlock for l in ref.model.model.layers)
    for extra in (dict(capacity_factor=1.0), dict(aux_free_bias=True, aux_coef=0.0)):
        ref = ep_moe.MoEReference(tiny_moe(), SimpleNamespace(**{**base, **extra}), None)
        assert all(isinstance(l.mlp, ep_moe.ReferenceMoE) for l in ref.model.model.layers)


def test_reference_router_losses_are_hf_losses():
    """hf_router_losses (the reference's) against transformers' own functions: Mixtral's
    load_balancing_loss_func (float32 sums) and Switch's router_z_loss_func; and against the
    strategy's router_losses, whose per-rank shares sum to the same."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    from transformers.models.switch_transformers.modeling_switch_transformers import (
        router_z_loss_func)
    E, k, L, N = 6, 2, 3, 40
    logits = tuple(3 * torch.randn(N, E, dtype=torch.float64) for _ in range(L))
    aux, z = ep_moe.hf_router_losses(logits, E, k)
    assert aux.dtype == z.dtype == torch.float64
    assert torch.allclose(aux.float(), load_balancing_loss_func(logits, E, k), rtol=1e-6)
    assert torch.allclose(z, sum(router_z_loss_func(lg[None]) for lg in logits) / L)
    stats = [dict(counts=torch.bincount(torch.topk(F.softmax(lg.float(), -1), k).indices
                                        .reshape(-1), minlength=E),
                  prob_sum=F.softmax(lg, -1).sum(0),
                  z_sum=torch.logsumexp(lg, -1).pow(2).sum()) for lg in logits]
    _, aux2, z2 = ep_moe.router_losses(stats, N, E)
    assert torch.allclose(aux2, aux, rtol=1e-14) and torch.allclose(z2, z, rtol=1e-14)


def test_aux_loss_matches_hf_load_balancing_loss():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    E, k, L, N = 8, 2, 3, 40
    logits = [torch.randn(N, E) for _ in range(L)]
    stats = []
    for lg in logits:
        probs = F.softmax(lg, -1)
        idx = torch.topk(probs, k, -1).indices
        stats.append(dict(counts=torch.bincount(idx.reshape(-1), minlength=E),
                          prob_sum=probs.sum(0)))
    _, aux, _ = ep_moe.router_losses(stats, N, E)
    hf = load_balancing_loss_func(tuple(logits), E, k)
    assert torch.allclose(aux, hf, rtol=1e-6, atol=0), (aux, hf)
    # split the tokens over 4 "ranks": the per-rank shares (with global counts) sum to the whole
    parts = []
    for r in range(4):
        sl = slice(r * N // 4, (r + 1) * N // 4)
        st = [dict(counts=s["counts"], prob_sum=F.softmax(lg[sl], -1).sum(0))
              for s, lg in zip(stats, logits)]
        parts.append(ep_moe.router_losses(st, N, E, reduce=lambda c: c)[1])
    assert torch.allclose(sum(parts), aux, rtol=1e-6)


def test_capacity_priority_first_choices_then_token_order():
    # 4 tokens, top-2, 2 experts, capacity 3: expert 0 is everyone's first choice
    idx = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 1]])
    keep, kept = ep_moe.capacity_keep(idx, F.one_hot(idx, 2).sum(0)[None], 0, 3)
    assert keep.tolist() == [[True, True], [True, True], [True, True], [False, False]]
    # second choices queue behind every first choice of the same expert
    idx = torch.tensor([[0, 1], [1, 0], [1, 0], [0, 1]])
    keep, _ = ep_moe.capacity_keep(idx, F.one_hot(idx, 2).sum(0)[None], 0, 3)
    assert keep.tolist() == [[True, True], [True, True], [True, False], [True, False]]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_capacity_split_over_ranks_equals_single_device(world):
    E, k, N, cap = 6, 2, 12 * world, 5
    g = torch.Generator().manual_seed(world)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    keep1, kept1 = ep_moe.capacity_keep(idx, F.one_hot(idx, E).sum(0)[None], 0, cap)
    chunks = idx.chunk(world)
    counts_all = torch.stack([F.one_hot(c, E).sum(0) for c in chunks])
    keeps = [ep_moe.capacity_keep(c, counts_all, r, cap) for r, c in enumerate(chunks)]
    assert torch.equal(torch.cat([kp for kp, _ in keeps]), keep1)
    assert torch.equal(keeps[0][1].sum(0), kept1[0])    # everyone knows every rank's kept rows
    assert (~keep1).any() and int(kept1.sum()) == int(keep1.sum())


@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_combine_round_trip(world):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world}", os.path.join(ROOT, "tests", "ep_roundtrip_check.py")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert p.stdout.count("PASS rank") == 3 * world and "FAIL" not in p.stdout, p.stdout


def assert_pass(r, world):
    """PASS as judged by the harness's noise policy, every tensor compared, every check ok."""
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    res = r.json("correctness.json")[0]
    assert res["ok"] and res["world"] == world and res["tensors"] == N_TENSORS, res
    assert res["grads_compared"] == res["params_compared"] == N_TENSORS
    assert res["checks"] and all(c["ok"] for c in res["checks"]), res
    return res


def capacity_detail(res) -> str:
    return next(c["detail"] for c in res["checks"] if c["name"] == "expert capacity respected")


@pytest.mark.parametrize("batch,world", [
    (W2, 2), pytest.param(SLOW_W4, 4, marks=pytest.mark.slow)])
def test_correctness_dropless_with_aux_and_z_loss(runs, batch, world):
    # the reference is HF's own block; aux and z from HF's recorded router logits
    res = assert_pass(runs(batch, "dropless"), world)
    assert all(c["name"] != "expert capacity respected" for c in res["checks"]), res


@pytest.mark.parametrize("batch,world", [
    (W2, 2), pytest.param(SLOW_W4, 4, marks=pytest.mark.slow)])
def test_correctness_capacity_drops_like_the_reference(runs, batch, world):
    res = assert_pass(runs(batch, "capacity"), world)
    drop = float(capacity_detail(res).split("dropped choices ")[1].split("%")[0])
    assert drop > 1.0, res   # tokens really were dropped, identically on both sides


@pytest.mark.slow
def test_correctness_aux_free_bias_and_uneven_expert_count(runs):
    assert_pass(runs(SLOW_W3, "aux-free"), 3)


def test_learning(runs):
    r = runs(W2, "learning")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    assert "imbalance max/mean per layer" in r.stdout


def test_benchmark_comm_matches_formulas(runs):
    r = runs(W2, "bench")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    b = r.json("benchmark.json")
    assert b["comm_ok"]
    cfg = harness.load_config("tiny-moe")
    L, E, H, k = 2, 8, 64, 2
    model = tiny_moe()
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    comm = b["ours"]["comm"]
    # replicated gradients and the router counts only: no expert weight is all-reduced
    assert comm["all_reduce|dp"]["bytes"] == dense * 4 + L * E * 8
    assert dense < harness.param_count(model) / 2
    # summed over ranks: 4 token all-to-alls of k tokens x H per layer, plus the counts
    n = 8 * 64
    assert b["ours"]["comm_sum"]["all_to_all_single|ep"]["bytes"] == \
        L * (4 * k * n * H * 4 + 2 * E * 8)
    assert cfg.num_local_experts == E
    assert "tokens per expert per step" in r.stdout and "2 k T H b (W-1)/W" in r.stdout


def test_bad_world_size_for_experts(run):
    r = run("ep_moe.py", 3, "--batch", "6")
    assert_config_error(r, "world size 3 does not divide num_local_experts 8")


def test_not_a_moe_model():
    from conftest import launch
    r = launch("ep_moe.py", 1, "--model", "tiny", torchrun=False)
    assert_config_error(r, "--model tiny is not a Mixture-of-Experts config", torchrun=False)
