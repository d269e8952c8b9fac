"""async_tp.py: Megatron SP's regions as rings of chunked matmuls (sp.py --async-tp, compose4d
--sp --async-tp). The rings, and both autograd Functions (biases, three weights with one output
unused, a non-contiguous upstream gradient), against the collectives and matmuls they replace
(gloo, two and three ranks, float64); correctness against the float64 reference at W=2 and W=4
(GQA) under NCCL's rules, and for Qwen2 (biases), Phi3 (fused qkv / gate_up) and Gemma2
(soft-capped, tied, GQA); the traffic counted against the ring formula; compose4d with tp x pp and
tp x cp; bad configurations. The planted bug (a chunk multiplied into the wrong rows) FAILs at
W=2 (tests/test_plants.py) and W=4. (The hidden share is reported by the benchmark, not asserted
here: for point-to-point it is an upper bound, harness/overlap.py.)"""
import os

import pytest
import torch
import torch.distributed as dist

import async_tp
import spawned
from conftest import Runs, assert_config_error, launch

MEGA = ["--variant", "megatron", "--async-tp"]
BENCH = ["--mode", "benchmark", "--warmup", "1", "--bench-iters", "1"]
SP2 = Runs("sp.py", 2, tier="slow", runs={
    "async": [*MEGA, "--nccl-semantics", "--clip", "0.5"],
    "async-bench": [*MEGA, *BENCH],
    "sync-bench": ["--variant", "megatron", *BENCH],
    **{f"family-{f}": [*MEGA, "--model", f"tiny-{f}"] for f in ("qwen2", "phi3", "gemma2")},
})
SP4 = Runs("sp.py", 4, tier="slow", runs={
    "async-gqa": [*MEGA, "--model", "configs/tiny-gqa8.json", "--nccl-semantics"],
    "plant": [*MEGA, "--model", "configs/tiny-gqa8.json", "--dtype", "float32", "--clip", "0.5",
              "--mode", "plants", "--plants", "async-chunk-rows", "--nccl-semantics"],
})
C4 = Runs("compose4d.py", 4, tier="heavy", runs={   # (heavy: make test's budget)
    "tp-pp": ["--tp", "2", "--sp", "--async-tp", "--pp", "2", "--grad-accum", "2"],
    "tp-cp": ["--tp", "2", "--sp", "--async-tp", "--cp", "2", "--zero", "3"],
    "bench": ["--tp", "2", "--sp", "--async-tp", "--pp", "2", "--grad-accum", "2", *BENCH],
})


def ok(r):
    assert r.rc == 0 and r.last_line.startswith(("PASS", "NCCL semantics: PASS")), r
    return r


def _rings(rank, world, init_file):
    """Each ring against the collective it replaces, in float64 (same sums, other order)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(2, 3, 5, dtype=torch.float64, generator=g)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        seen = {}
        async_tp.ring_gather(x, None, lambda src, c: seen.setdefault(src, c.clone()))
        assert sorted(seen) == list(range(world))
        assert all(torch.equal(seen[s], parts[s]) for s in range(world))
        full = torch.randn(2, 3 * world, 5, dtype=torch.float64, generator=g)
        want = full.clone()
        dist.all_reduce(want)
        got = async_tp.ring_reduce_scatter(lambda c: full[:, 3 * c:3 * (c + 1)], None)
        assert torch.allclose(got, want[:, 3 * rank:3 * (rank + 1)], rtol=0, atol=1e-13)
    finally:
        dist.destroy_process_group()


def _functions(rank, world, init_file):
    """Both Functions against sp.py's collectives around plain matmuls, outputs and every
    gradient, float64: biases, three weights with the second output unused, a non-contiguous
    upstream gradient."""
    import sp
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        g = torch.Generator().manual_seed(7 + rank)
        x = torch.randn(2, 3, 5, dtype=torch.float64, generator=g, requires_grad=True)
        ws = [torch.randn(o, 5, dtype=torch.float64, generator=g, requires_grad=True)
              for o in (4, 6, 2)]
        bs = [torch.randn(4, dtype=torch.float64, generator=g, requires_grad=True), None,
              torch.randn(2, dtype=torch.float64, generator=g, requires_grad=True)]
        ups = [torch.randn(2, 4, 3 * world, dtype=torch.float64, generator=g).transpose(1, 2),
               None, torch.randn(2, 3 * world, 2, dtype=torch.float64, generator=g)]

        def grads(outs):
            loss = sum((o * u).sum() for o, u in zip(outs, ups) if u is not None)
            return torch.autograd.grad(loss, [x, *ws, bs[0], bs[2]], allow_unused=True)
        mine = async_tp.AllGatherMatmul.apply(x, None, 3, *ws, *bs)
        full = sp.GatherFromSP.apply(x, None)
        want = [torch.nn.functional.linear(full, w, b) for w, b in zip(ws, bs)]
        for a, b in zip(mine, want):
            assert torch.allclose(a, b, rtol=0, atol=1e-12)
        for a, b in zip(grads(mine), grads(want)):   # (the unused output's weight: zeros)
            b = torch.zeros_like(a) if b is None else b
            assert torch.allclose(a, b, rtol=0, atol=1e-12)
        h = torch.randn(2, 3 * world, 4, dtype=torch.float64, generator=g, requires_grad=True)
        w = torch.randn(5, 4, dtype=torch.float64, generator=g, requires_grad=True)
        up = torch.randn(2, 5, 3, dtype=torch.float64, generator=g).transpose(1, 2)
        mine = async_tp.MatmulReduceScatter.apply(h, w, None)
        want = sp.ReduceScatterToSP.apply(torch.nn.functional.linear(h, w), None)
        assert torch.allclose(mine, want, rtol=0, atol=1e-12)
        for a, b in zip(torch.autograd.grad((mine * up).sum(), [h, w]),
                        torch.autograd.grad((want * up).sum(), [h, w])):
            assert torch.allclose(a, b, rtol=0, atol=1e-12)
    finally:
        dist.destroy_process_group()


def _spawn(fn, world):
    import tempfile
    with tempfile.TemporaryDirectory() as d:   # (a file store: no rank hosts a TCP store)
        spawned.spawn(fn, world, os.path.join(d, "init"))


@pytest.mark.parametrize("world", [2, 3])
def test_the_functions_equal_collectives_around_matmuls(world):
    _spawn(_functions, world)


@pytest.mark.parametrize("world", [2, 3])
def test_the_rings_equal_the_collectives(world):
    _spawn(_rings, world)


def _fp32_accumulation_bound(a, b):
    """The worst-case error of a @ b from exact products summed in fp32 (K terms, each
    partial sum rounded once: (K - 1) u sum |a||b|, u = 2^-24), elementwise."""
    return (a.shape[1] - 1) * 2.0 ** -24 * (a.abs().double() @ b.abs().double())


def test_wgrad_mm_paths(monkeypatch):
    """_wgrad_mm: which path runs where, and that each is a bf16 product accumulated in fp32.
    The CPU has no aten::mm.dtype kernel in torch 2.13, so the CUDA path (out_dtype) runs here
    only on the meta device (its shape and dtype); its numerics are checked where CUDA is
    (test_wgrad_mm_cuda_path). The upcast path, the CPU's, is held to the fp32-accumulation
    bound, and a bf16-output GEMM is not (the bound is tight enough to tell them apart)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(24, 512, generator=g).bfloat16()   # (out, B s): a gradient chunk^T
    b = torch.randn(512, 40, generator=g).bfloat16()   # (B s, in): the input chunk
    exact = a.double() @ b.double()   # (bf16 products are exact, and so is this sum nearly)
    bound = _fp32_accumulation_bound(a, b)
    # selection: float32/float64 plain; bf16 upcast on the CPU, out_dtype on CUDA if probed ok
    assert async_tp._wgrad_path(a.float(), b.float()) == "plain"
    assert async_tp._wgrad_path(a.double(), b.double()) == "plain"
    assert async_tp._wgrad_path(a, b) == "upcast"
    assert not async_tp.mm_out_dtype_works("cpu", torch.bfloat16)
    meta = a.to("meta"), b.to("meta")
    assert async_tp._wgrad_path(*meta) == "upcast"
    monkeypatch.setitem(async_tp._MM_OUT_DTYPE_OK, ("meta", torch.bfloat16), True)
    assert async_tp._wgrad_path(*meta) == "out_dtype"   # (as a CUDA device that passed the probe)
    out = async_tp._wgrad_mm(*meta)
    assert out.dtype == torch.float32 and out.shape == (24, 40)
    monkeypatch.setitem(async_tp._MM_OUT_DTYPE_OK, ("meta", torch.bfloat16), False)
    assert async_tp._wgrad_path(*meta) == "upcast"       # a CUDA build without the kernel
    # numerics: the upcast path within the bound, a bf16-output GEMM far outside it
    up = async_tp._wgrad_mm(a, b)
    assert up.dtype == torch.float32 and bool(((up.double() - exact).abs() <= bound).all())
    rounded = (a @ b).double()
    assert bool(((rounded - exact).abs() > bound).any())
    assert torch.equal(async_tp._wgrad_mm(a.double(), b.double()), a.double() @ b.double())
    try:   # the CPU's out_dtype kernel, should a later torch add one
        cpu_out = async_tp._wgrad_mm(a, b, path="out_dtype")
    except NotImplementedError:
        return
    assert bool(((cpu_out.double() - exact).abs() <= bound).all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path needs a GPU")
def test_wgrad_mm_cuda_path():
    """On CUDA, bf16 operands take torch.mm(..., out_dtype=float32): within the fp32-
    accumulation bound of the exact sum, as the float32 upcast path is."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(256, 4096, generator=g).bfloat16().cuda()
    b = torch.randn(4096, 512, generator=g).bfloat16().cuda()
    assert async_tp._wgrad_path(a, b) == "out_dtype"
    exact = a.double() @ b.double()
    bound = _fp32_accumulation_bound(a, b)
    for path in ("out_dtype", "upcast"):
        out = async_tp._wgrad_mm(a, b, path=path)
        assert out.dtype == torch.float32 and bool(((out.double() - exact).abs() <= bound).all())


@pytest.mark.slow
@pytest.mark.parametrize("batch,key,world", [(SP2, "async", 2), (SP4, "async-gqa", 4)])
def test_correctness_under_nccl_rules(runs, batch, key, world):
    r = ok(runs(batch, key))
    assert r.last_line.startswith("NCCL semantics: PASS") and f" on {world} ranks" in r.last_line
    assert f"\nPASS sp-megatron-async W={world}" in r.stdout, r


@pytest.mark.slow
def test_the_plant_fails_at_four_under_nccl_rules(runs):
    """(W=2: tests/test_plants.py.) The clean run PASSes and the chunk written into the next
    rank's rows FAILs, both under NCCL's matching rules."""
    r = runs(SP4, "plant")
    assert r.rc == 0 and "PASS plants sp W=4: clean run PASS, 1/1 planted bugs caught" in r.stdout, r
    assert "NCCL semantics: FAIL" not in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "phi3", "gemma2"])
def test_correctness_model_families(runs, family):
    ok(runs(SP2, f"family-{family}"))


@pytest.mark.slow
def test_comm_is_rings(runs):
    """tiny (L 4, H 64, B 8 x S 64, float32) at W=2: 10L+3 = 43 rings of one hop each, N H b / 2
    per hop; the first layer's split stays an all-gather, against the synchronous regions' 6L+3
    all-gathers."""
    r = ok(runs(SP2, "async-bench"))
    b = r.json("benchmark.json")
    comm, nhb = b["ours"]["comm"], 8 * 64 * 64 * 4
    assert comm["isend|world"] == comm["irecv|world"] == {"calls": 43, "bytes": 43 * nhb // 2}
    assert comm["all_gather_into_tensor|world"] == {"calls": 1, "bytes": nhb}
    assert "reduce_scatter_tensor|world" not in comm
    sync = ok(runs(SP2, "sync-bench")).json("benchmark.json")
    assert sync["ours"]["comm"]["all_gather_into_tensor|world"]["calls"] == 6 * 4 + 3


@pytest.mark.heavy
@pytest.mark.parametrize("key", ["tp-pp", "tp-cp"])
def test_compose4d(runs, key):
    ok(runs(C4, key))


@pytest.mark.heavy
def test_compose4d_comm(runs):
    """Rank 0: the first of 2 stages (2 layers), tp 2, M 2: M (10 L_r) rings of one hop of
    N_r H b / (M T), and the first layer's split gathered once per micro-batch."""
    r = ok(runs(C4, "bench"))
    b = r.json("benchmark.json")
    assert b["comm_ok"]
    comm, hop = b["ours"]["comm"], 4 * 64 * 64 * 4 // 2
    assert comm["isend|tp"] == {"calls": 2 * 10 * 2, "bytes": 2 * 10 * 2 * hop}
    assert comm["all_gather_into_tensor|tp"]["calls"] == 2


@pytest.mark.parametrize("script,nproc,args,msg", [
    ("sp.py", 2, ["--variant", "ulysses", "--async-tp"], "--async-tp decomposes Megatron SP's"),
    ("compose4d.py", 2, ["--tp", "2", "--async-tp"], "--async-tp decomposes sequence-parallel"),
])
def test_bad_config(script, nproc, args, msg):
    assert_config_error(launch(script, nproc, *args, as_rank0=True), msg, torchrun=False)
