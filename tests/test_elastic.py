"""elastic.py's batch planner: the rule, the memory model, infeasible counts, and the CLI."""
import subprocess
import sys

import pytest

import elastic
from conftest import ROOT

GiB = 2**30
BASE = dict(params=5e9, hidden=4096, layers=32, seq=4096, mem_bytes=80 * GiB, tolerance=0.10,
            max_micro_batch=8)


def test_memory_model_matches_the_stated_formulas():
    m = elastic.MemoryModel()
    psi, dp = 1e9, 8
    assert m.states(psi, 0, dp) == 14 * psi                     # 2 + 4 + 8 bytes per parameter
    assert m.states(psi, 1, dp) == 2 * psi + 4 * psi + 8 * psi / dp
    assert m.states(psi, 2, dp) == 2 * psi + 12 * psi / dp
    assert m.states(psi, 3, dp) == 14 * psi / dp
    assert m.states(psi, 0, dp, tp=2, pp=2) == 14 * psi / 4
    assert m.activations(2, 4096, 4096, 32) == 16 * 2 * 4096 * 4096 * 32 * 2


def test_keeps_the_global_batch_exactly_when_it_can_and_prefers_low_zero():
    p = elastic.plan_world(64, 512, **BASE)
    assert p.global_batch == 512 and p.delta == 0
    assert p.zero == 1                   # ZeRO-0 would need 70 GB of states + activations
    roomy = elastic.plan_world(64, 512, **dict(BASE, params=1e9))
    assert roomy.zero == 0 and roomy.global_batch == 512
    assert roomy.micro_batch * roomy.grad_accum * 64 == 512


def test_memory_forces_a_higher_zero_stage_and_smaller_micro_batch():
    tight = elastic.plan_world(8, 512, **dict(BASE, mem_bytes=30 * GiB))
    assert tight.feasible and tight.zero == 3 and tight.memory <= 30 * GiB
    assert tight.global_batch == 512


def test_infeasible_counts():
    # more data-parallel ranks than the tolerance allows: 800 GPUs, batch 512 +- 10%
    p = elastic.plan_world(800, 512, **BASE)
    assert not p.feasible and "within 10%" in p.why
    # a world that tp x pp does not divide
    q = elastic.plan_world(12, 512, **BASE, tp=8)
    assert not q.feasible and "multiple of tp pp cp" in q.why
    # nothing fits in memory
    r = elastic.plan_world(8, 512, **dict(BASE, mem_bytes=1 * GiB))
    assert not r.feasible


def test_tolerance_band_and_minimal_deviation():
    p = elastic.plan_world(24, 512, **BASE)       # 512 / 24 is not an integer
    assert p.feasible and abs(p.global_batch - 512) <= 0.1 * 512
    best = min(abs(24 * b * a - 512) for b in range(1, 9) for a in range(1, 40))
    assert abs(p.global_batch - 512) == best


def test_plan_command_prints_the_table():
    r = subprocess.run([sys.executable, "compose4d.py", "plan", "--params", "5e9", "--hidden",
                        "4096", "--layers", "32", "--seq", "4096", "--world", "64",
                        "--micro-batch", "2", "--grad-accum", "4", "--zero", "0", "--nodes",
                        "1:100", "--gpus-per-node", "8", "--mem-gib", "80", "--tolerance", "0.1",
                        "--max-micro-batch", "8"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("target global batch 512")
    rows = [l.split() for l in lines[2:]]
    assert len(rows) == 100
    assert rows[0][:6] == ["1", "8", "1", "2", "32", "512"]
    assert rows[99][2] == "-"                     # 800 GPUs cannot keep 512 within 10%


@pytest.mark.parametrize("bad", [["--world", "6", "--tp", "4"]])
def test_plan_rejects_a_world_that_tp_does_not_divide(bad):
    r = subprocess.run([sys.executable, "compose4d.py", "plan", "--params", "1e9", "--hidden",
                        "1024", "--layers", "8", "--seq", "1024", "--micro-batch", "1",
                        "--grad-accum", "1", *bad], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: --world 6"), r.stderr
