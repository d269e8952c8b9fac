"""No host synchronisation inside a training step, for every strategy (issue 48, item 5).

On a GPU a host read of a device value or a tensor built from host data inside the step stalls
the CPU until the stream drains, undoing every overlap the strategies build; gloo hides the
cost. The correctness mode's `--host-syncs` watches each step with harness/hostsync.py's
dispatch mode (aten._local_scalar_dense: a host read; aten.lift_fresh: a tensor made from host
data) and FAILs on a site outside hostsync.ALLOWED. Every strategy runs here once at W=2 with
it (clipping and, where the strategy has it, dropout on: their paths are the ones that read),
joining its script's own launch (conftest.Runs). The plant `dropout-host-key` (test_plants)
shows the check fails. On a GPU, scripts/gpu_check.py adds torch.cuda's sync debug mode.
"""
import pytest

from conftest import Runs
from harness import hostsync

# Every allowed site, with its reason: a new one must be named here.
ALLOWED = {
    ("harness/loss.py", "scalar"): "the step's one logged loss",
    ("compose4d.py", "loss_flag_norm"): "compose4d's one read per step: the loss, the "
                                        "preemption flag and the norm together",
    ("ep_moe.py", "dispatch_combine"): "all_to_all_single takes its split sizes as host ints",
    ("harness/routing.py", "experts_forward"): "the harness's routing statistics "
                                               "(instrumentation, a host list kept on the host)",
}
ALLOWED_LIBRARY = {
    ("transformers/masking_utils.py", "find_packed_sequence_indices"):
        "transformers' own check whether the position ids pack several sequences",
}

SMALL = ["--mode", "correctness", "--host-syncs", "--clip", "1.0", "--batch", "4",
         "--length", "32"]
DROP = ["--dropout", "0.1"]
# (script, key, extra args); the quick tier holds one run per strategy file, the heavy tier
# their other variants
QUICK = [("ddp.py", "ddp", ["--grad-accum", "2", *DROP]),
         ("zero.py", "zero3", ["--stage", "3", *DROP]),
         ("fsdp.py", "fsdp", []),
         ("tp.py", "tp", DROP),
         ("sp.py", "sp", DROP),
         ("pp.py", "pp", ["--schedule", "1f1b", "--microbatches", "4", *DROP]),
         ("cp_ring.py", "cp", []),
         ("ep_moe.py", "ep", []),
         ("compose4d.py", "4d", ["--pp", "2", "--grad-accum", "2", *DROP])]
HEAVY = [("zero.py", "zero1", ["--stage", "1"]), ("zero.py", "zero2", ["--stage", "2"]),
         # (int8 rounding: the grad norm's noise at batch 4 x 32 is too small a sample)
         ("zeropp.py", "zeropp", ["--node-size", "1", "--batch", "8", "--length", "64"]),
         ("sp.py", "ulysses", ["--variant", "ulysses"]), ("sp.py", "async", ["--async-tp"]),
         ("pp.py", "zb", ["--schedule", "zb", "--microbatches", "4"]),
         ("pp.py", "dualpipev", ["--schedule", "dualpipev", "--microbatches", "4"]),
         ("tp.py", "gemma2", ["--model", "tiny-gemma2"]),
         ("compose4d.py", "4d-tp-sp", ["--tp", "2", "--sp"]),
         ("compose4d.py", "4d-cp", ["--cp", "2"]),
         ("compose4d.py", "4d-moe", ["--model", "tiny-moe", "--ep", "2"])]


def _batches(cases, tier):
    out = {}
    for script, key, extra in cases:
        out.setdefault(script, Runs(script, 2, {}, tier=tier)).runs[f"hostsync {key}"] = \
            [*SMALL, *extra]
    return out


BATCHES = {"quick": _batches(QUICK, "quick"), "heavy": _batches(HEAVY, "heavy")}


def test_the_allowed_sites_are_the_ones_named_here():
    assert set(hostsync.ALLOWED) == set(ALLOWED)
    assert set(hostsync.ALLOWED_LIBRARY) == set(ALLOWED_LIBRARY)


def _check(runs, tier, script, key):
    r = runs(BATCHES[tier][script], f"hostsync {key}")
    rows = [c for c in r.json("correctness.json")[-1]["checks"]
            if c["name"] == "no host sync inside the step"]
    assert rows and rows[0]["ok"], (rows, r)
    assert "2 steps watched" in rows[0]["detail"], rows
    assert r.rc == 0 and r.last_line.startswith("PASS"), r


@pytest.mark.parametrize("script,key", [(s, k) for s, k, _ in QUICK])
def test_no_host_sync_inside_the_step(runs, script, key):
    _check(runs, "quick", script, key)


@pytest.mark.heavy
@pytest.mark.parametrize("script,key", [(s, k) for s, k, _ in HEAVY])
def test_no_host_sync_inside_the_step_variants(runs, script, key):
    _check(runs, "heavy", script, key)
