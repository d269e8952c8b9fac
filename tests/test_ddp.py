"""ddp.py against the single-device reference, under torchrun with gloo on CPU."""
import os
import re

import pytest
import torch

import harness
import ddp
from conftest import Runs, assert_config_error

BENCH = ["--mode", "benchmark", "--bucket-mb", "0.25", "--warmup", "1", "--bench-iters", "3"]
W2 = Runs("ddp.py", 2, {  # one launch: the start-up paid once
    "correctness": ["--dtype", "float64"],
    "plant-grad": ["--plant-bug", "grad"],
    "naive": ["--variant", "naive", "--dtype", "float64", "--grad-accum", "2"],
    "naive-bench": BENCH + ["--variant", "naive"],
})
HEAVY_W2 = Runs("ddp.py", 2, tier="heavy", runs={   # (heavy: make test's budget)
    "native": ["--compare-native", "--grad-accum", "2"],
})
SLOW_W2 = Runs("ddp.py", 2, tier="slow", runs={
    "learning": ["--mode", "learning", "--steps", "40"],
    "bench-accum1": BENCH + ["--grad-accum", "1"],
    "bench-accum2": BENCH + ["--grad-accum", "2"],
})
SLOW_W3 = Runs("ddp.py", 3, tier="slow", runs={
    "float64": ["--dtype", "float64", "--batch", "6", "--grad-accum", "2"],
    "float32": ["--dtype", "float32", "--batch", "6"],
    "naive-bf16": ["--variant", "naive", "--dtype", "bfloat16", "--batch", "6"],
})


def assert_pass(r, world, dtype, n_tensors=39):
    assert r.rc == 0, r
    assert r.last_line.startswith("PASS"), r
    res = r.json("correctness.json")[0]
    assert res["ok"] and res["world"] == world and res["dtype"] == dtype, res
    # every parameter's gradient and value was compared: tiny has 39 parameter tensors
    assert res["tensors"] == n_tensors == res["grads_compared"] == res["params_compared"], res
    return res


@pytest.mark.parametrize("batch,key,world,dtype", [
    (W2, "correctness", 2, "float64"),
    # (W=2 float32 with accumulation and clipping: the clean run of test_plants.py's ddp group)
    pytest.param(SLOW_W3, "float64", 3, "float64", marks=pytest.mark.slow),   # uneven, accum
    pytest.param(SLOW_W3, "float32", 3, "float32", marks=pytest.mark.slow),
])
def test_correctness(runs, batch, key, world, dtype):
    res = assert_pass(runs(batch, key), world, dtype)
    # judged against measured noise: the single-device error, rescaled for float64 runs
    assert 0 < res["max_grad_noise"] and res["worst_ratio"] <= 1.0
    assert res["noise_dtype"] == "float32" and res["tol_k"] == harness.TOL_K
    assert res["checks"][0]["ok"]  # replicas identical across ranks


@pytest.mark.parametrize("batch,key,world,dtype", [
    (W2, "naive", 2, "float64"),
    pytest.param(SLOW_W3, "naive-bf16", 3, "bfloat16", marks=pytest.mark.slow),   # uneven
])
def test_naive_variant(runs, batch, key, world, dtype):
    """--variant naive (ddp.NaiveDataParallel): the same averaged gradients, one all_reduce
    per parameter tensor after the backward; its planted sum-not-average FAILs in
    tests/test_plants.py's ddp.py group."""
    res = assert_pass(runs(batch, key), world, dtype)
    assert res["strategy"] == "ddp-naive" and res["checks"][0]["ok"], res


def test_naive_variant_sends_one_call_per_parameter(runs):
    r = runs(W2, "naive-bench")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    b = r.json("benchmark.json")
    ar, bc = b["ours"]["comm"]["all_reduce|world"], b["setup"]["broadcast|world"]
    assert (ar["calls"], ar["bytes"]) == (39, 4 * 180800) == (bc["calls"], bc["bytes"]), b


def test_correctness_small_buckets_and_world_size_one(run):
    # A plain `python ddp.py` is a group of one; tiny buckets exercise the launch ordering.
    r = run("ddp.py", 1, "--bucket-mb", "0.01", torchrun=False)
    res = assert_pass(r, 1, "float64")
    assert res["max_rel_err"] == 0.0  # same arithmetic as the reference: bit-identical


def test_planted_gradient_error_fails(runs):
    r = runs(W2, "plant-grad")
    assert r.rc == 1 and r.last_line.startswith("FAIL"), r
    assert "1 tensors over tolerance" in r.last_line


@pytest.mark.heavy
def test_compare_native_correctness(runs):
    r = runs(HEAVY_W2, "native")
    assert r.rc == 0, r
    res = r.json("correctness.json")
    assert [x["strategy"] for x in res] == ["ddp", "torch-ddp"] and all(x["ok"] for x in res)


@pytest.mark.slow
def test_learning(runs):
    r = runs(SLOW_W2, "learning")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    rows = open(os.path.join(r.out, "learning.csv")).read().splitlines()
    assert len(rows) == 41 and rows[0].startswith("step,reference,ddp")
    first, last = float(rows[1].split(",")[2]), float(rows[-1].split(",")[2])
    floor = float(rows[1].split(",")[3])
    assert last < first - (first - floor) / 2


def expected_buckets(model, cap_bytes):
    """Independent count of greedy reverse-order buckets."""
    n, cur = 0, 0
    for p in reversed(list(model.parameters())):
        b = p.numel() * p.element_size()
        if cur and cur + b > cap_bytes:
            n, cur = n + 1, 0
        cur += b
    return n + (cur > 0)


@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 2])
def test_benchmark_comm_and_memory(runs, accum):
    r = runs(SLOW_W2, f"bench-accum{accum}")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    b = r.json("benchmark.json")
    cfg = harness.load_config("tiny")
    n_params = b["params"]
    assert n_params == 180800
    grad_bytes = 4 * n_params  # float32
    # Comm: all_reduce bytes per optimizer step == gradient bytes exactly, whatever K.
    ar = b["ours"]["comm"]["all_reduce|world"]
    assert ar["bytes"] == grad_bytes
    ref = harness.build_model(harness.resolve_defaults(
        harness.base_parser("t").parse_args([]), "benchmark", "cpu"), cfg, "cpu")
    assert ar["calls"] == expected_buckets(ref, int(0.25 * 2**20)) > 1
    assert set(b["ours"]["comm"]) == {"all_reduce|world"}
    # One-time broadcast of every parameter and buffer (the rotary frequencies) from rank 0,
    # packed into flat buffers of at most --bucket-mb
    tensors = list(ref.parameters()) + list(ref.buffers())
    n, cur, cap = 0, 0, int(0.25 * 2**20)
    for t in reversed(tensors):
        if cur and cur + t.numel() * t.element_size() > cap:
            n, cur = n + 1, 0
        cur += t.numel() * t.element_size()
    buffer_bytes = sum(t.numel() * t.element_size() for t in ref.buffers())
    assert buffer_bytes > 0
    assert b["setup"]["broadcast|world"] == {"calls": n + 1, "bytes": grad_bytes + buffer_bytes}
    assert n + 1 < 39    # one call per packed buffer, not per tensor
    # Memory per rank: full model states on each rank, activations of half the batch.
    for m in b["ours"]["memory"]:
        assert m["params"] == m["grads"] == grad_bytes
        assert 2 * grad_bytes <= m["optimizer"] <= 2 * grad_bytes + 39 * 8  # m, v, step
        assert m["model_states"] == m["params"] + m["grads"] + m["optimizer"]
    ref_act = b["reference"]["memory"][0]["activations"]
    act = b["ours"]["memory"][0]["activations"]
    assert 0.4 <= act / ref_act * accum <= 0.6, (act, ref_act)


def test_bad_config_torchrun(run):
    r = run("ddp.py", 3, "--batch", "8")
    assert_config_error(r, "global batch 8 is not divisible by world size x grad-accum = "
                           "3 x 1 = 3")
    # rank 0 exited with code 2 and is torchrun's root cause; nothing of ours raised
    assert re.search(r"Root Cause.*\n(.*\n){0,4}\s*exitcode\s*:\s*2", r.stderr), r
    assert "harness/" not in r.stderr and "ddp.py\", line" not in r.stderr


@pytest.mark.parametrize("args,msg", [
    (["--grad-accum", "3"], "global batch 8 is not divisible by world size x grad-accum"),
    (["--model", "/no/such/dir"], "--model /no/such/dir: not a preset"),
])
def test_bad_config_plain(run, args, msg):
    assert_config_error(run("ddp.py", 1, *args, torchrun=False), msg, torchrun=False)


def test_plan_buckets():
    ps = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 20, 30, 40)]
    assert ddp.plan_buckets(ps, 4 * 50) == [[3], [2, 1], [0]]   # reverse order, greedy
    assert ddp.plan_buckets(ps, 4 * 10) == [[3], [2], [1], [0]]  # oversize gets its own
    assert ddp.plan_buckets(ps, 10**9) == [[3, 2, 1, 0]]
