"""zero.py (ZeRO-1/2/3) and zeropp.py (ZeRO++ on its engine) against the single-device
reference, under torchrun on CPU."""
import json
import os

import pytest
import torch

import harness
import test_plants
import zero
import rig.zeropp
import spawned

from conftest import Runs, assert_config_error

TINY_PARAMS = 180_800
CLIP = ["--clip", "0.5"]  # below the initial gradient norm, so clipping is active
BENCH = ["--mode", "benchmark", "--warmup", "1"]


def tied_config(base):
    path = os.path.join(base, "tied.json")
    with open(path, "w") as f:
        json.dump(dict(harness.PRESETS["tiny"], tie_word_embeddings=True), f)
    return path


W2 = Runs("zero.py", 2, {  # one launch per batch: the start-up paid once
    **{f"clip{s}": ["--stage", s, *CLIP] for s in (1, 2, 3)}})
SLOW_W2 = Runs("zero.py", 2, tier="slow", runs={
    "learning": ["--stage", "3", "--mode", "learning", "--steps", "40"],
    # the baseline: PyTorch's ZeroRedundancyOptimizer over torch DDP (ours, then theirs)
    **{f"native{s}": ["--stage", s, "--compare-native", *CLIP] for s in ("1", "2")},
    "tied": ["--stage", "3", "--model", tied_config],
    **{f"bf16-bench{s}": [*BENCH, "--stage", s, "--dtype", "bfloat16", "--bench-iters", "1"]
       for s in (1, 2, 3)},
    "bf16-stage2": ["--stage", "2", "--dtype", "bfloat16"],
    # (stage 2 in float32 with accumulation: the clean run of test_plants.py's zero group)
    **{f"f32-accum{s}": ["--stage", s, *CLIP, "--dtype", "float32", "--grad-accum", "2"]
       for s in (1, 3)},
})
SLOW_W3 = Runs("zero.py", 3, tier="slow", runs={
    **{f"clip{s}": ["--stage", s, *CLIP, "--batch", "6"] for s in (1, 2, 3)},   # uneven shards
    # 3 does not divide the units' sizes, so the buffers are padded
    **{f"bench{s}": [*BENCH, "--stage", s, "--clip", "1.0", "--batch", "6", "--bench-iters", "2"]
       for s in (1, 2, 3)}})


def assert_pass(r, name, world):
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    res = r.json("correctness.json")[0]
    assert res["strategy"] == name and res["world"] == world and res["ok"], res
    assert res["tensors"] == res["grads_compared"] == res["params_compared"] == 39, res
    return res


@pytest.mark.parametrize("batch,key,world", [
    *[(W2, f"clip{s}", 2) for s in (1, 2, 3)],
    *[pytest.param(SLOW_W3, f"clip{s}", 3, marks=pytest.mark.slow) for s in (1, 2, 3)],
    *[pytest.param(SLOW_W2, f"f32-accum{s}", 2, marks=pytest.mark.slow) for s in (1, 3)]])
def test_correctness_with_clipping(runs, batch, key, world):
    # the harness compares the gradients before clipping, and the reported pre-clip norm on its
    # own row
    res = assert_pass(runs(batch, key), f"zero{key[-1]}", world)
    assert "grad norm" in res["scalars"] and res["worst_ratio"] <= 1, res
    assert res["scalars"]["grad norm"]["value"] > 0.5     # clipping was active


@pytest.mark.slow
def test_stage3_tied_embeddings(runs):
    r = runs(SLOW_W2, "tied")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    assert r.json("correctness.json")[0]["tensors"] == 38  # lm_head is the embedding


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["1", "2"])
def test_torch_zero_redundancy_optimizer_baseline(runs, stage):
    """PyTorch's own ZeRO-1 (ZeroRedundancyOptimizer over torch DDP), run by --compare-native
    after ours on the same data, passes the same check against the float64 reference; it is
    also stage 2's baseline (torch has no gradient-sharding analogue of its own)."""
    r = runs(SLOW_W2, f"native{stage}")
    assert r.rc == 0 and r.last_line.startswith("PASS torch-zero1"), r
    res = r.json("correctness.json")
    assert [x["strategy"] for x in res] == [f"zero{stage}", "torch-zero1"], res
    assert all(x["ok"] and x["tensors"] == x["grads_compared"] == 39 for x in res), res


@pytest.mark.slow
def test_learning(runs):
    r = runs(SLOW_W2, "learning")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_benchmark_comm_and_memory(runs, stage):
    W = 3
    r = runs(SLOW_W3, f"bench{stage}")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    b = r.json("benchmark.json")
    # Independent padded size: each unit padded up to a multiple of W.
    L, H, I, V, KV = 4, 64, 128, 256, 32
    layer = 2 * H * H + 2 * H * KV + 3 * H * I + 2 * H
    units = [V * H] + [layer] * L + [H + V * H]
    assert sum(units) == TINY_PARAMS
    padded = sum(-(-u // W) * W for u in units)
    assert padded > TINY_PARAMS
    e = 4  # float32 bytes
    comm = b["ours"]["comm"]
    n = len(units)
    assert comm["reduce_scatter_tensor|world"] == {"calls": n, "bytes": padded * e}
    gathers = 2 if stage == 3 else 1    # stage 3: forward + backward
    assert comm["all_gather_into_tensor|world"] == {"calls": gathers * n,
                                                     "bytes": gathers * padded * e}
    assert comm["all_reduce|world"] == {"calls": 1, "bytes": 8}   # the clip norm
    # Model-state bytes per rank: ZeRO's formulas, fp32 (optimizer = m + v shards).
    shard = padded // W * e
    want = {1: (padded * e, padded * e), 2: (padded * e, shard), 3: (shard, shard)}[stage]
    for m in b["ours"]["memory"]:
        assert (m["params"], m["grads"], m["optimizer"]) == (*want, 2 * shard), m
        assert m["model_states"] == sum(want) + 2 * shard
    assert b["memory_formula"]["model_states"] == sum(want) + 2 * shard
    # against the single device's 16 Psi bytes (4 Psi params, grads, 2 x 4 Psi Adam)
    ref = b["reference"]["memory"][0]
    assert ref["params"] == ref["grads"] == TINY_PARAMS * e
    assert b["ours"]["memory"][0]["model_states"] < ref["model_states"]


def test_bad_config(run):
    r = run("zero.py", 1, "--stage", "4", torchrun=False)
    assert r.rc == 2 and r.stderr.strip() == "error: --stage must be 1, 2 or 3 (got 4)", r


def test_zero_optimizer_bf16_masters(group):
    """ZeroOptimizer over bf16 parameters keeps fp32 masters: they follow torch.optim.AdamW
    on fp32 copies (float32 arithmetic, 1e-6), and the parameters are their rounding; the
    reduce-scatter sums in fp32 ("auto")."""
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(7, 3)) for _ in range(2)]   # 21: odd, padded
    half = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in ref]
    ref = [torch.nn.Parameter(p.detach().float()) for p in half]       # the same start
    opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    ours = zero.ZeroOptimizer(half, torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                              betas=(0.9, 0.95))
    assert ours.mixed and ours.masters[0].dtype == torch.float32
    assert ours.engine.units[0].grad_shard.dtype == torch.float32
    for _ in range(3):
        grads = [torch.randn(7, 3).to(torch.bfloat16) for _ in ref]
        for p, q, g in zip(ref, half, grads):
            p.grad, q.grad = g.float(), g.clone()
        opt.step()
        ours.step()
        ours.zero_grad()
    masters = ours.state_dict()   # the unsharded states; the masters through shard_state
    flat = torch.cat([m for m in ours.shard_state("param")])
    want = torch.cat([p.detach().reshape(-1) for p in ref])
    assert torch.allclose(flat[:want.numel()], want, rtol=0, atol=1e-6)
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in half]),
                       flat[:want.numel()].to(torch.bfloat16))
    assert sorted(masters["state"][0]) == ["exp_avg", "exp_avg_sq", "step"]


def _zero_resume_bf16(rank, world, init_file):
    """Per rank of test_zero_optimizer_resumes_its_fp32_masters."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)   # (a file: no port to lose to another job)
    try:
        g = torch.Generator().manual_seed(0)
        w0 = [torch.randn(n, 3, generator=g).bfloat16() for n in (7, 5, 11)]   # odd: padded
        frozen = torch.randn(4, generator=g).bfloat16()   # in a group, in no unit
        # per step and rank, the loss's coefficients: the bf16 gradients, exact
        coefs = [[torch.randn(w.shape, generator=g).bfloat16() for w in w0]
                 for _ in range(5 * world)]

        def build(weights, stage):
            ps = [torch.nn.Parameter(w.clone()) for w in weights]
            fz = torch.nn.Parameter(frozen.clone(), requires_grad=False)
            opt = zero.ZeroOptimizer([{"params": ps[:2]}, {"params": [ps[2], fz], "lr": 5e-3}],
                                     torch.optim.AdamW, stage=stage, bucket_mb=40 / 2**20,
                                     lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
            return ps, opt

        def run(ps, opt, steps):
            for t in steps:
                sum((p * c).sum() for p, c in zip(ps, coefs[t * world + rank])).backward()
                opt.step()
                opt.zero_grad()

        for stage in (1, 2):
            full, opt = build(w0, stage)
            assert opt.mixed and len(opt.engine.units) > 2
            run(full, opt, range(5))
            part, first = build(w0, stage)
            run(part, first, range(3))
            sd = first.state_dict()
            # a fresh model (the bf16 weights of a model checkpoint) and optimizer resume
            again, second = build([p.detach() for p in part], stage)
            second.load_state_dict(sd)
            run(again, second, range(3, 5))
            assert all(torch.equal(a, b) for a, b in zip(full, again)), stage
            assert all(torch.equal(a, b) for a, b in
                       zip(opt.shard_state("param"), second.shard_state("param"))), stage
            assert [m.dtype for m in sd["fp32_masters"]] == [torch.float32] * 4
            assert [m.shape for m in sd["fp32_masters"]] == [*(w.shape for w in w0), (4,)]
            # torch's own format (no masters) still loads, and restarts the masters from the
            # rounded weights: 2 steps later the weights differ (what the masters are for)
            plain = {k: v for k, v in sd.items() if k != "fp32_masters"}
            third_w, third = build([p.detach() for p in part], stage)
            third.load_state_dict(plain)
            run(third_w, third, range(3, 5))
            assert not all(torch.equal(a, b) for a, b in zip(full, third_w)), stage
        dist.barrier()   # both ranks done before either tears the group down (gloo aborts a
        #                  rank whose peer's pairs close under it)
    finally:
        dist.destroy_process_group()


def test_zero_optimizer_resumes_its_fp32_masters(tmp_path):
    """bf16 parameters, stages 1 and 2 at W=2 (three units, odd sizes: parameters cut between
    the ranks' shards), two parameter groups and a frozen parameter: 3 steps, state_dict(), a
    fresh model and ZeroOptimizer load it, 2 more steps == 5 uninterrupted steps, bitwise, on
    the parameters and on the fp32 master shards (the state dict carries the masters as
    harness.precision.MasterAdamW's does); without them the run departs."""
    spawned.spawn(_zero_resume_bf16, 2, str(tmp_path / "init"))


def test_overlapped_param_gather_is_waited_by_each_units_own_forward(tmp_path):
    """Stages 1, 2: the step launches the parameter all-gathers async; each unit's gather is
    finished by its own modules' forward pre-hook, not before (the later units' gathers are still
    in flight while the first layers compute) and not after (every unit is complete when used);
    --sync-param-gather's engine finishes them inside the step. (W=2: a group of one gathers
    nothing, its shards being the buffers themselves.)"""
    spawned.spawn(_overlapped_gather, 2, str(tmp_path / "init"))


def _overlapped_gather(rank, world, init_file):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        args = harness.resolve_defaults(harness.base_parser("t").parse_args([]), "correctness",
                                        "cpu")
        for overlap in (True, False):
            m = harness.build_model(args, harness.load_config("tiny"), "cpu")
            z = zero.Zero(m, stage=1, overlap_param_gather=overlap)
            opt = zero.ZeroOptimizer(m.parameters(), torch.optim.AdamW, engine=z, lr=1e-3)
            x = torch.randint(0, m.config.vocab_size, (2, 8),
                              generator=torch.Generator().manual_seed(rank))
            m(x).logits.float().sum().backward()
            opt.step()
            assert [u.handle is not None for u in z.units] == [overlap] * len(z.units)
            seen = {}
            for i, layer in enumerate(m.model.layers):   # runs after the engine's own pre-hook
                layer.register_forward_pre_hook(
                    lambda mod, a, i=i: [seen.setdefault(i, [u.handle is None for u in z.units])]
                    and None)
            m(x)
            n = len(z.units)
            assert seen[0] == [True, True] + [not overlap] * (n - 2), seen[0]   # embed, layers.0
            assert all(u.handle is None for u in z.units)
    finally:
        dist.destroy_process_group()


def test_units_cover_every_parameter_once():
    args = harness.resolve_defaults(harness.base_parser("t").parse_args([]), "correctness", "cpu")
    for tied in (False, True):
        cfg = harness.load_config("tiny")
        cfg.tie_word_embeddings = tied
        m = harness.build_model(args, cfg, "cpu")
        units = zero.decoder_units(m)
        ids = [id(p) for _, mods in units for mod in mods for p in mod.parameters()]
        assert len(set(ids)) == len(list(m.parameters()))
        assert [n for n, _ in units][0] == ("embed+head" if tied else "embed")


@pytest.mark.slow
@pytest.mark.parametrize("stage,psi_units", [(1, 12), (2, 10), (3, 9)])
def test_bf16_mixed_precision_memory_and_correctness(runs, stage, psi_units):
    # 2Psi + 2Psi + 16Psi/N, 2Psi + 16Psi/N, 18Psi/N at N=2: fp32 masters and Adam in the
    # shards, and fp32 gradient shards (the default --reduce-dtype float32)
    r = runs(SLOW_W2, f"bf16-bench{stage}")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    m = r.json("benchmark.json")["ours"]["memory"][0]
    assert m["model_states"] == psi_units * TINY_PARAMS, m
    assert m["optimizer"] == 12 * TINY_PARAMS // 2   # master + m + v, fp32, sharded
    if stage == 2:  # and the errors stay within the noise policy's multiple of single-device bf16
        c = runs(SLOW_W2, "bf16-stage2")
        assert c.rc == 0 and c.last_line.startswith("PASS"), c


# ---------------------------------------------------------------------------------------------
# ZeRO++ (zeropp.py --zeropp qwz,hpz,qgz --node-size N): W=4 in two nodes of 2, W=2 in two of 1
# ---------------------------------------------------------------------------------------------
ZPP = ["--stage", "3", "--zeropp", "qwz,hpz,qgz", "--node-size", "2"]
W4 = Runs("zeropp.py", 4, tier="slow", runs={
    "zpp-all": ZPP,                                   # float64, the error-vs-error rule
    "zpp-qwz-hpz": ["--stage", "3", "--zeropp", "qwz,hpz", "--node-size", "2",
                    "--dtype", "float32"],
    "zpp-bench": [*BENCH, *ZPP, "--bench-iters", "1"],
})
W2_ZPP = Runs("zeropp.py", 2, {   # node size 1: every rank a node, qgZ one all-to-all across
    "zpp-n1": ["--stage", "3", "--zeropp", "qwz,hpz,qgz", "--node-size", "1", "--clip", "0.5"],
    "zpp-qgz-stage2": ["--stage", "2", "--zeropp", "qgz", "--node-size", "2",
                       "--grad-accum", "2"],   # node size W: one all-to-all inside the node
})


def assert_zpp_pass(r, name, world, checks):
    res = assert_pass(r, name, world)
    got = {c["name"]: c for c in res["checks"]}
    assert len(got) == checks and all(c["ok"] for c in got.values()), res["checks"]
    # the quantized run is judged by the quantization noise model, not float noise: its errors
    # are far above float noise and within 8x the model's
    assert res["max_grad_err"] > 1e-4 and res["worst_ratio"] <= 1, res
    return res


@pytest.mark.parametrize("batch,key,world,name,checks", [
    pytest.param(W4, "zpp-all", 4, "zero3+qwz+hpz+qgz", 3, marks=pytest.mark.slow),
    pytest.param(W4, "zpp-qwz-hpz", 4, "zero3+qwz+hpz", 2, marks=pytest.mark.slow),
    (W2_ZPP, "zpp-n1", 2, "zero3+qwz+hpz+qgz", 3),
    (W2_ZPP, "zpp-qgz-stage2", 2, "zero2+qgz", 1)])
def test_zeropp_correctness(runs, batch, key, world, name, checks):
    assert_zpp_pass(runs(batch, key), name, world, checks)


@pytest.mark.slow
def test_zeropp_bytes_equal_the_formula(runs):
    """W=4, N=2 (M=2 nodes), tiny float32: bytes per op and group, exactly."""
    r = runs(W4, "zpp-bench")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    b = r.json("benchmark.json")
    W, N, M, B, e = 4, 2, 2, 256, 4
    L, H, I, V, KV = 4, 64, 128, 256, 32
    layer = 2 * H * H + 2 * H * KV + 3 * H * I + 2 * H
    P = [V * H] + [layer] * L + [H + V * H]        # every unit divisible by 4: no padding
    s = [p // W for p in P]
    ceil = lambda a: -(-a // B)  # noqa: E731
    qwz = sum(p + 4 * W * ceil(x) for p, x in zip(P, s))          # int8 + float32 scales
    node_a2a = sum(p + 4 * N * ceil(M * x) for p, x in zip(P, s))
    cross_a2a = sum(p // N + 4 * M * ceil(x) for p, x in zip(P, s))
    assert (qwz, node_a2a, cross_a2a) == (183_696, 183_656, 91_848)
    n = len(P)
    comm = b["ours"]["comm"]
    assert comm == {"all_gather_into_tensor|world": {"calls": n, "bytes": qwz},
                    "all_gather_into_tensor|node": {"calls": n, "bytes": sum(P) * e},
                    "all_to_all_single|node": {"calls": n, "bytes": node_a2a},
                    "all_to_all_single|cross": {"calls": n, "bytes": cross_a2a}}, comm
    assert b["group_sizes"] == {"node": 2, "cross": 2}
    exact = 3 * sum(P) * e                   # ZeRO-3: 2 all-gathers + 1 reduce-scatter, fp32
    assert exact == 2_169_600 and exact / (qwz + sum(P) * e + node_a2a + cross_a2a) > 1.8
    assert exact / (qwz + cross_a2a) > 7.8   # what leaves a node: world + cross groups
    # hpZ's secondary shard Psi/N is resident beside the primary Psi/W
    for m in b["ours"]["memory"]:
        assert m["params"] == (sum(P) // W + sum(P) // N) * e == 542_400, m
        assert m["grads"] == sum(P) // W * e and m["optimizer"] == 2 * sum(P) // W * e, m
    assert b["memory_formula"]["params"] == 542_400


ZPP_PLANTS = " ".join(rig.zeropp.ZeroPlusPlus._ZEROPP)   # test_plants.py's run once tour lists it
PLANTS = test_plants.BATCHES.get(("zeropp.py", 4)) or Runs("zeropp.py", 4, tier="slow", runs={
    ZPP_PLANTS: [
    "--mode", "plants", "--plants", ",".join(rig.zeropp.ZeroPlusPlus.plants), *ZPP_PLANTS.split()]})


@pytest.mark.slow
def test_zeropp_plants_fail(runs):
    """The clean W=4 run PASSes and each ZeRO++ plant FAILs."""
    r = runs(PLANTS, ZPP_PLANTS)
    rows = json.load(open(os.path.join(r.out, "plants.json")))
    verdicts = {row["plant"]: row["passed"] for row in rows}
    assert verdicts == {"(none)": True, "qwz-local-dequant": False,
                        "hpz-stale-secondary": False, "qgz-chunk-order": False}, r


@pytest.mark.parametrize("args,msg", [
    (["--stage", "3", "--zeropp", "qwz,hpz", "--node-size", "3"],
     "--node-size 3 must divide the world size 4"),
    (["--stage", "3", "--zeropp", "qwz,int4"], "--zeropp: unknown trick 'int4'"),
    (["--stage", "2", "--zeropp", "qwz"], "--zeropp qwz: quantizes or re-partitions stage 3"),
])
def test_zeropp_bad_config(run, args, msg):
    r = run("zeropp.py", 4, *args, as_rank0=True)
    assert_config_error(r, msg, torchrun=False)


def test_zeropp_constraints():
    """The other refusals, without a process each (the first error is the one printed)."""
    p = harness.base_parser("t")
    rig.zeropp.ZeroPlusPlus.add_args(p)
    cases = {"--stage 1 --zeropp hpz --node-size 2": "--zeropp hpz: quantizes",
             "--stage 3 --zeropp qgz": "--zeropp qgz needs --node-size N",
             "--stage 3 --zeropp qwz --node-size 2": "--node-size 2 is for ZeRO++'s",
             "--stage 3 --zeropp hpz --node-size 0": "--node-size 0 must divide",
             "--stage 3 --zeropp qwz,hpz,qgz --node-size 4": None,
             "--stage 2 --zeropp qgz --node-size 1": None}
    for argv, msg in cases.items():
        errs = rig.zeropp.zeropp_constraints(p.parse_args(argv.split()), 4, None)
        assert (errs[0].startswith(msg) if msg else errs == []), (argv, errs)


@pytest.mark.slow
def test_zeropp_at_one_rank_checks_qgz_against_the_exact_result():
    """At W=1 qgZ has no quantizing hop: its check holds it to the exact reduce-scatter (a bound
    of zero; it read as a failure before, with nothing recorded)."""
    from conftest import launch
    r = launch("zeropp.py", 1, "--node-size", "1", "--length", "32", torchrun=False)
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    assert "ok (max |qgZ - exact| / bound = 0.000 (N=1, M=1))" in r.stdout, r


@pytest.mark.parametrize("stage", [1, 3])
def test_a_world_of_one_reduces_and_gathers_nothing_but_stage_3s_restores(stage, tmp_path):
    """W=1: a group of one's reduce-scatter is the gradient itself and, at stages 1 and 2, the
    shard is the buffer itself: no collective (each was a self-copy, and gloo's slowed the whole
    process); stage 3 still gathers its freed buffers back. The benchmark's formulas say so."""
    from conftest import launch
    r = launch("zero.py", 1, "--mode", "benchmark", "--stage", str(stage), "--bench-iters", "2",
               out=tmp_path, torchrun=False)
    assert r.rc == 0 and r.last_line.startswith(f"PASS zero{stage} W=1 benchmark"), r
    comm = r.json("benchmark.json")["ours"]["comm"]
    assert "reduce_scatter_tensor|world" not in comm, comm
    assert ("all_gather_into_tensor|world" in comm) == (stage == 3), comm
