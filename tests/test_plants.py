"""Every check can fail: each strategy's planted bugs FAIL its correctness mode, in the
configuration the strategy declares for them (`Plant.args`), and the same run without the plant
PASSes. One torchrun per (script, configuration): `--mode plants` runs the clean correctness
run and then each plant in one process group."""
import importlib
import json
import os

import pytest

import harness
from conftest import Runs
from tour import STRATEGIES, plant_groups, rig_module   # script -> its adapter class (rig/)


def strategy(script):
    return getattr(importlib.import_module(rig_module(script)), STRATEGIES[script])


def groups():
    """One test per (script, configuration), its plants together."""
    return [pytest.param(s, w, a, names, id=f"{s[:-3]}-W{w}-{'_'.join(a) or 'default'}")
            for s, w, a, names in plant_groups()]


# One `--mode plants` run per (script, configuration); each joins the launch of its script's
# other slow runs at that world size (conftest.Runs).
BATCHES = {}
for _s, _w, _a, _names in plant_groups():
    BATCHES.setdefault((_s, _w), Runs(_s, _w, {}, tier="slow")).runs[" ".join(_a)] = [
        "--mode", "plants", "--plants", ",".join(_names), *_a]


# The learning mode's check of the checks: one gradient-scale (or token-mean) plant per strategy,
# which AdamW's normalised update hides from the loss curve; the pre-clip gradient norm, compared
# at every step, must not. Each runs a few steps beside the same configuration without the plant
# (too few steps to pass "learned": the two comparisons are asserted on their own).
LEARNING_PLANTS = [("ddp.py", "no-average"), ("zero.py", "no-average"), ("fsdp.py", "no-average"),
                   ("tp.py", "no-f"), ("sp.py", "no-average"),
                   ("pp.py", "microbatch-scale"), ("cp_ring.py", "no-average"),
                   ("ep_moe.py", "expert-grad-scale"), ("compose4d.py", "local-token-mean")]
for _s, _n in LEARNING_PLANTS:
    _p = strategy(_s).plants[_n]
    _runs = BATCHES.setdefault((_s, _p.world), Runs(_s, _p.world, {}, tier="slow")).runs
    for _plant in (_n, None):
        _runs[f"learning {_plant}"] = ["--mode", "learning", *_p.args, "--steps", "6",
                                       *(["--plant-bug", _plant] if _plant else [])]


@pytest.mark.slow
@pytest.mark.parametrize("script,name", LEARNING_PLANTS)
def test_learning_mode_fails_a_gradient_scale_bug(runs, script, name):
    batch = BATCHES[script, strategy(script).plants[name].world]
    clean = runs(batch, "learning None").json("learning.json")
    assert clean["losses_agree"] and clean["norms_agree"], clean
    r = runs(batch, f"learning {name}")
    planted = r.json("learning.json")
    assert not planted["norms_agree"] and not planted["ok"], planted
    assert r.last_line.startswith("FAIL") and "grad norms differ" in r.last_line, r


def test_every_strategy_plants_at_least_two_bugs():
    counts = {s: len(strategy(s).plants) for s in STRATEGIES}
    assert all(n >= 2 for n in counts.values()), counts
    for s in STRATEGIES:   # a plant says what it breaks, and its flags parse
        for name, plant in strategy(s).plants.items():
            assert plant.doc and plant.world >= 1 and name not in harness.HARNESS_PLANTS, (s, name)


def test_scale_bugs_are_checked_with_clipping_in_float32():
    """Clipping rescales gradients: a scale bug must still FAIL in float32 with --clip."""
    scale = [(s, n) for s in STRATEGIES for n, p in strategy(s).plants.items()
             if n in ("no-average",) or "scale" in n]
    assert scale
    for s, n in scale:
        args = strategy(s).plants[n].args
        assert "--clip" in args and "float32" in args, (s, n, args)


@pytest.mark.slow
@pytest.mark.parametrize("script,world,args,names", groups())
def test_planted_bugs_fail_and_the_clean_run_passes(runs, script, world, args, names):
    r = runs(BATCHES[script, world], " ".join(args))
    rows = json.load(open(os.path.join(r.out, "plants.json")))
    verdicts = {row["plant"]: row["passed"] for row in rows}
    assert verdicts.pop("(none)") is True, r           # the clean run PASSes ...
    assert verdicts == {n: False for n in names}, r    # ... and every plant FAILs
    assert r.rc == 0 and r.last_line.startswith("PASS plants"), r
