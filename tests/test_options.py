"""Options no other test exercised: each run joins its script's shared launch (conftest.Runs), and
each test checks that the option changed what it says it changes, not only that the run ends."""
import pytest

from conftest import Runs

TP = Runs("tp.py", 2, {
    # the verdict's own knob: at 1/1000 of the noise the same correct run must FAIL
    "tol-k": ["--tol-k", "0.001"],
    "seed": ["--seed", "7"],
    "branching": ["--branching", "2"],
    "no-weight-decay": ["--weight-decay", "0"],
})
ZERO = Runs("zero.py", 2, {
    "sync-gather": ["--stage", "1", "--sync-param-gather"],
    "prefetch2": ["--stage", "3", "--prefetch", "2"],
})
DDP = Runs("ddp.py", 2, {"all": ["--mode", "all"]})


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
        return float(r.stdout.split("step 0: loss ")[1].split()[0])
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


def test_mode_all_runs_every_mode(runs):
    """--mode all: correctness, learning and benchmark in one process group, each with its
    verdict."""
    r = runs(DDP, "all")
    assert r.rc == 0 and r.last_line.startswith("PASS"), r
    assert r.json("correctness.json")[0]["ok"] and r.json("learning.json")["ok"]
    assert r.json("benchmark.json")["comm_ok"]
    assert sum(1 for line in r.stdout.splitlines() if line.startswith("PASS ")) >= 3, r
