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


def chunk(d0, rest, w):
    """FSDP2's padded size of a (d0, *rest) parameter: W chunks of ceil(d0 / W) rows."""
    return w * -(-d0 // w) * rest


def unit_sizes(w):
    """(root, one layer) elements in the communication buffers, each parameter padded."""
    layer = (2 * chunk(H, H, w) + 2 * chunk(KV, H, w) + 2 * chunk(I, H, w) + chunk(H, I, w)
             + 2 * chunk(H, 1, w))
    return 2 * chunk(V, H, w) + chunk(H, 1, w), layer


def local_rows(d0, rest, w, r):
    c = -(-d0 // w)
    return (min((r + 1) * c, d0) - min(r * c, d0)) * rest


@pytest.mark.slow
@pytest.mark.parametrize("reshard", [True, False])
def test_benchmark_comm_and_memory(runs, reshard):
    W = 3
    r = runs(W3, "bench-reshard" if reshard else "bench-keep")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    b = r.json("benchmark.json")
    e = 4
    root, layer = unit_sizes(W)
    root, layers = root * e, L * layer * e
    comm = b["ours"]["comm"]
    assert comm["reduce_scatter_tensor|world"] == {"calls": L + 1, "bytes": root + layers}
    gathers = ({"calls": 2 * L + 1, "bytes": root + 2 * layers} if reshard
               else {"calls": L + 1, "bytes": root + layers})
    assert comm["all_gather_into_tensor|world"] == gathers
    # the copies in and out of the buffers: shards in (Psi/W), the padded rows out (Psi)
    assert comm["all_gather copy-out|local"] == gathers
    assert comm["all_gather copy-in|local"] == {"calls": gathers["calls"],
                                                "bytes": gathers["bytes"] // W}
    assert comm["reduce_scatter copy-in|local"] == {"calls": L + 1, "bytes": root + layers}
    # 16 bytes per element of this rank's shards (fp32 shard, gradient, m, v); rank 2 holds
    # fewer rows of the dimensions W does not divide (V = 256, H = 64, I = 128, KV = 32)
    for rank, m in enumerate(b["ours"]["memory"]):
        shapes = [(V, H)] * 2 + [(H, 1)] + L * ([(H, H)] * 2 + [(KV, H)] * 2 + [(I, H)] * 2
                                              + [(H, I)] + [(H, 1)] * 2)
        shard = sum(local_rows(d0, rest, W, rank) for d0, rest in shapes) * e
        steps = 4 * 39   # AdamW's step count, one float32 per parameter
        assert (m["params"], m["optimizer"]) == (shard, 2 * shard + steps), (rank, m)
        if rank == 0:
            assert b["memory_formula"]["optimizer"] == 2 * shard + steps
    assert b["ours"]["memory"][0]["peak"] < b["reference"]["memory"][0]["peak"]


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
    states = 16 * (root + layers) // e // S + 4 * 39   # + AdamW's step counts
    assert b["memory_formula"]["model_states"] == states
    assert b["ours"]["memory"][0]["model_states"] == states
    assert b["group_sizes"] == {"shard": S, "replicate": 2}


def test_hsdp_replicas_must_divide_the_world(run):
    from conftest import assert_config_error
    r = run("fsdp.py", 4, "--replicate", "3", as_rank0=True)
    assert_config_error(r, "--replicate 3: the replicas must divide world size 4", torchrun=False)


def test_gathers_follow_the_recorded_order(group):
    """The first forward records the units' order; later forwards prefetch by it, the backward
    re-gathers the layers (not the root, which stays gathered) in reverse; every unit is
    gathered once per pass, and between steps nothing is gathered and every parameter is a
    shard that a plain optimizer steps."""
    import torch
    import fsdp
    import harness
    args = harness.resolve_defaults(harness.base_parser("t").parse_args([]), "correctness", "cpu")
    model = harness.build_model(args, harness.load_config("tiny"), "cpu")
    names = {m: n or "root" for n, m in model.named_modules()}
    for layer in model.model.layers:
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    launched, real = [], fsdp.FSDPUnit.unshard

    def spy(self, async_op=False):
        if not self.gathered and self.params:
            launched.append(names[self.module])
        return real(self, async_op)
    fsdp.FSDPUnit.unshard = spy
    layers = [f"model.layers.{i}" for i in range(L)]
    try:
        for step in range(2):
            launched.clear()
            loss = model(torch.randint(0, V, (2, 16))).logits.sum()
            assert launched == ["root"] + layers, (step, launched)
            assert not any(u.gathered for u in fsdp.units(model)[1:])   # resharded
            loss.backward()
            assert launched == ["root"] + layers + layers[::-1], (step, launched)
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
            assert all(not u.gathered for u in fsdp.units(model))
            assert all(p._fsdp_param.sharded is p for p in model.parameters())   # shards
            assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    finally:
        fsdp.FSDPUnit.unshard = real
