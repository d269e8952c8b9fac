"""fsdp.py against the single-device reference and PyTorch's FSDP2, under torchrun on CPU."""
import pytest

from conftest import Runs

L, H, I, V, KV = 4, 64, 128, 256, 32
LAYER = 2 * H * H + 2 * H * KV + 3 * H * I + 2 * H
ROOT = 2 * V * H + H


def padded(n, w):
    return -(-n // w) * w


BENCH = ["--mode", "benchmark", "--batch", "6", "--warmup", "1", "--bench-iters", "2"]
# one launch per batch: the start-up paid once
W2 = Runs("fsdp.py", 2, {"clip": ["--clip", "0.5"]})
W3 = Runs("fsdp.py", 3, tier="slow", runs={"clip": ["--clip", "0.5", "--batch", "6"],   # uneven shards
                         "bench-reshard": BENCH,
                         "bench-keep": BENCH + ["--no-reshard-after-forward"]})
# HSDP: 2 replicas x shard groups of 2 (correctness with accumulation and clipping, comm)
W4 = Runs("fsdp.py", 4, tier="slow", runs={"hsdp": ["--replicate", "2", "--clip", "0.5", "--grad-accum", "2"],
                         "bench-hsdp": BENCH[:3] + ["8"] + BENCH[4:] + ["--replicate", "2"]})
SLOW_W2 = Runs("fsdp.py", 2, tier="slow", runs={
    "keep-prefetch2": ["--clip", "0.5", "--no-reshard-after-forward", "--prefetch", "2"],
    "native": ["--compare-native", "--clip", "0.5"],
    "learning": ["--mode", "learning", "--steps", "40"]})


# (float32 with accumulation and clipping: the clean run of test_plants.py's fsdp group)
@pytest.mark.parametrize("batch,key", [
    (W2, "clip"), pytest.param(W3, "clip", marks=pytest.mark.slow), pytest.param(SLOW_W2, "keep-prefetch2", marks=pytest.mark.slow)])
def test_correctness_with_clipping(runs, batch, key):
    r = runs(batch, key)
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    res = r.json("correctness.json")[0]
    assert res["strategy"] == "fsdp" and res["tensors"] == res["grads_compared"] == 39


@pytest.mark.slow
def test_matches_fsdp2_and_ddp(runs):
    r = runs(SLOW_W2, "native")
    assert r.rc == 0, r
    res = r.json("correctness.json")
    assert [x["strategy"] for x in res] == ["fsdp", "torch-fsdp2", "ddp"]
    assert all(x["ok"] and x["worst_ratio"] <= 1 for x in res), res


@pytest.mark.slow
def test_learning(runs):
    r = runs(SLOW_W2, "learning")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r


@pytest.mark.slow
@pytest.mark.parametrize("reshard", [True, False])
def test_benchmark_comm_and_memory(runs, reshard):
    W = 3
    r = runs(W3, "bench-reshard" if reshard else "bench-keep")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    b = r.json("benchmark.json")
    e = 4
    root, layers = padded(ROOT, W) * e, L * padded(LAYER, W) * e
    comm = b["ours"]["comm"]
    assert comm["reduce_scatter_tensor|world"] == {"calls": L + 1, "bytes": root + layers}
    assert comm["all_gather_into_tensor|world"] == (
        {"calls": 2 * L + 1, "bytes": root + 2 * layers} if reshard
        else {"calls": L + 1, "bytes": root + layers})
    shard = (root + layers) // W
    for m in b["ours"]["memory"]:  # 16 Psi / N in fp32: params, grads, m, v all sharded
        assert (m["params"], m["grads"], m["optimizer"]) == (shard, shard, 2 * shard), m
    # the working set: resharding keeps less gathered than keeping every layer
    peak = b["ours"]["memory"][0]["peak"]
    assert peak < b["reference"]["memory"][0]["peak"]


def test_bad_config(run):
    r = run("fsdp.py", 1, "--prefetch", "-1", torchrun=False)
    assert r.rc == 2 and r.stderr.strip() == "error: --prefetch must be >= 0 (got -1)", r


@pytest.mark.slow
def test_hsdp_correct_with_identical_replicas(runs):
    r = runs(W4, "hsdp")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    assert "HSDP replicas hold identical shards" in r.stdout, r


@pytest.mark.slow
def test_hsdp_comm_inside_shard_groups_and_across_replicas(runs):
    """W = 4, R = 2, S = 2: gathers and reduce-scatters inside the shard group (Psi padded to
    a multiple of S), one all_reduce of each reduced shard (Psi / S) over the replicas."""
    S = 2
    r = runs(W4, "bench-hsdp")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    e = 4
    root, layers = padded(ROOT, S) * e, L * padded(LAYER, S) * e
    comm = r.json("benchmark.json")["ours"]["comm"]
    assert comm["reduce_scatter_tensor|shard"] == {"calls": L + 1, "bytes": root + layers}
    assert comm["all_gather_into_tensor|shard"] == {"calls": 2 * L + 1,
                                                    "bytes": root + 2 * layers}
    assert comm["all_reduce|replicate"] == {"calls": L + 1, "bytes": (root + layers) // S}
    assert not any(k.endswith("|world") for k in comm), comm
    # model states over the shard group: 16 Psi / S (fp32), measured and formula alike
    b = r.json("benchmark.json")
    states = 16 * (root + layers) // e // S
    assert b["memory_formula"]["model_states"] == states
    assert b["ours"]["memory"][0]["model_states"] == states
    assert b["group_sizes"] == {"shard": S, "replicate": 2}


def test_hsdp_replicas_must_divide_the_world(run):
    from conftest import assert_config_error
    r = run("fsdp.py", 4, "--replicate", "3", as_rank0=True)
    assert_config_error(r, "--replicate 3: the replicas must divide world size 4", torchrun=False)


def test_root_prefetches_layer_zero_once_per_forward(group):
    """The root unit's pre-forward hook runs at the embeddings, the final norm and the head;
    only the first prefetches layer 0. Otherwise layer 0 is gathered a second time at the
    norm and sits gathered through the backward (the gather count alone cannot see it)."""
    import torch
    import torch.distributed as dist
    import fsdp
    import harness
    args = harness.resolve_defaults(harness.base_parser("t").parse_args([]), "correctness", "cpu")
    model = harness.build_model(args, harness.load_config("tiny"), "cpu")
    fs = fsdp.fully_shard(model)
    gathers, real = [], dist.all_gather_into_tensor

    def counting(out, inp, *a, **k):
        gathers.append(next(u.name for u in fs.units if u.full is out))
        return real(out, inp, *a, **k)
    dist.all_gather_into_tensor = counting
    try:
        loss = model(torch.randint(0, 256, (2, 16))).logits.sum()
        assert gathers == ["root"] + [f"model.layers.{i}" for i in range(L)], gathers
        assert not fs.layers[0].gathered           # resharded after its forward, not re-fetched
        loss.backward()
    finally:
        dist.all_gather_into_tensor = real
    assert gathers.count("model.layers.0") == 2           # forward, then backward
