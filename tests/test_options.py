"""Options no other test exercised: each run joins its script's slow launch (conftest.Runs), and
each test checks that the option changed what it says it changes, not only that the run ends."""
import pytest

from conftest import Runs, config_file, step_losses

pytestmark = pytest.mark.slow

TP = Runs("tp.py", 2, tier="slow", runs={
    # the verdict's own knob: at 1/1000 of the noise the same correct run must FAIL
    "tol-k": ["--tol-k", "0.001"],
    "seed": ["--seed", "7"],
    "branching": ["--branching", "2"],
    "no-weight-decay": ["--weight-decay", "0"],
})
ZERO = Runs("zero.py", 2, tier="slow", runs={
    "sync-gather": ["--stage", "1", "--sync-param-gather"],
    "prefetch2": ["--stage", "3", "--prefetch", "2"],
    # bf16 gradients reduce-scattered in fp32 (the default) and in bf16 (--reduce-dtype param)
    **{f"reduce-{rd}": ["--stage", "2", "--dtype", "bfloat16", "--reduce-dtype", rd]
       for rd in ("float32", "param")},
})
DDP = Runs("ddp.py", 2, tier="slow", runs={"all": ["--mode", "all"]})
# three chunks per rank: 6 layers over 2 stages x 3 virtual stages
V3 = ["--schedule", "interleaved", "--virtual-stages", "3", "--microbatches", "2",
      "--model", config_file("layers6", num_hidden_layers=6)]
PP = Runs("pp.py", 2, tier="slow", runs={
    "v3": V3, "v3-bench": [*V3, "--mode", "benchmark", "--warmup", "1", "--bench-iters", "1"]})
# the cosine floor at half the peak: the reference takes it from torch's CosineAnnealingLR
C4D = Runs("compose4d.py", 2, tier="slow", runs={
    f"lr-floor{r}": ["--pp", "2", "--lr-schedule", "cosine", "--lr-min-ratio", r, "--steps", "3"]
    for r in ("0.5", "0.1")})


def passed(r):
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    return r.json("correctness.json")[0]


def test_tol_k_is_the_verdicts_factor(runs):
    """--tol-k k: err <= k x noise + floor. A correct tp run PASSes at the default 8 with its
    worst tensor at a fraction of the tolerance; at k = 0.001 the same run FAILs."""
    r = runs(TP, "tol-k")
    res = r.json("correctness.json")[0]
    assert res["tol_k"] == 0.001 and not res["ok"] and r.last_line.startswith("FAIL"), res


def test_seed_and_branching_change_the_data(runs):
    """--seed and --branching set the synthetic language (and --seed the model's init): the
    entropy floor the run prints and the losses it compares differ from the defaults'."""
    def first_loss(key):   # step 0's loss: before any update, so weight decay plays no part
        r = runs(TP, key)
        passed(r)
        return step_losses(r.stdout)[0]
    base, seed, branching = (first_loss(k) for k in ("no-weight-decay", "seed", "branching"))
    assert base != seed and base != branching, (base, seed, branching)


def test_weight_decay_zero_still_passes(runs):
    """--weight-decay 0: the reference and the strategy both without decay (a strategy that
    applied its own default would be off by lr x wd x p per step, far over the floor)."""
    res = passed(runs(TP, "no-weight-decay"))
    assert res["params_compared"] == res["tensors"]


@pytest.mark.parametrize("key", ["sync-gather", "prefetch2"])
def test_zero_gather_options(runs, key):
    """zero.py's --sync-param-gather (ZeRO-1/2's all-gather waited at once, not overlapped with
    the next forward) and --prefetch 2 (ZeRO-3 gathers two units ahead) give the same result."""
    res = passed(runs(ZERO, key))
    assert res["strategy"] == ("zero1" if key == "sync-gather" else "zero3")


def test_three_virtual_stages(runs):
    """pp.py --virtual-stages 3 (every other test uses 2): interleaved 1F1B over 6 chunks, which
    the sends show: rank 0 holds chunks 0, 2, 4, so each micro-batch leaves it V = 3 times
    forward and V - 1 = 2 times backward (V = 2 would be 2 + 1)."""
    res = passed(runs(PP, "v3"))
    assert res["strategy"] == "pp-interleaved", res["strategy"]
    assert res["tensors"] == res["grads_compared"] == 3 + 6 * 9   # every layer's 9 tensors
    r = runs(PP, "v3-bench")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    M, V, B, S, H = 2, 3, 8, 64, 64
    act = B // M * S * H * 4
    sends = r.json("benchmark.json")["ours"]["comm"]["isend|world"]
    assert sends == {"calls": M * (2 * V - 1), "bytes": M * (2 * V - 1) * act}, sends


def test_cosine_floor_matches_torchs_scheduler(runs):
    """compose4d --lr-min-ratio 0.5: its lr_at against torch.optim.lr_scheduler's cosine with
    eta_min = 0.5 lr in the reference (an oracle that shares no code with it); the floor moves
    step 1's learning rate, so step 2's loss differs from the run at the default 0.1."""
    def losses(key):
        r = runs(C4D, key)
        passed(r)
        return step_losses(r.stdout)
    half, tenth = losses("lr-floor0.5"), losses("lr-floor0.1")
    assert half[:2] == tenth[:2] and half[2] != tenth[2], (half, tenth)


def test_mode_all_runs_every_mode(runs):
    """--mode all: correctness, learning and benchmark in one process group, each with its
    verdict."""
    r = runs(DDP, "all")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    assert r.json("correctness.json")[0]["ok"] and r.json("learning.json")["ok"]
    assert r.json("benchmark.json")["comm_ok"]
    assert sum(1 for line in r.stdout.splitlines() if line.startswith("PASS ")) >= 3, r


def test_reduce_dtype_param_in_correctness_mode(runs):
    """--reduce-dtype param in a bf16 correctness run: the reduce-scatter sums in bf16 and the
    run still PASSes against the float64 target, with gradient errors of its own (the same run
    reducing in fp32 lands elsewhere: the option reached the reduction)."""
    f32, param = passed(runs(ZERO, "reduce-float32")), passed(runs(ZERO, "reduce-param"))
    assert f32["dtype"] == param["dtype"] == "bfloat16", (f32, param)
    # (per tensor: the largest error of all may sit on a tensor whose reduction is exact)
    errs = lambda r: {n: row["grad"]["err"] for n, row in r["rows"].items()}  # noqa: E731
    assert errs(f32) != errs(param), (f32, param)
