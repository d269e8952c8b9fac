"""scripts/verdict_calibration.py (docs/correctness.md, "Calibration"): the correct runs over
seeds are counted, and a planted bug in every run is counted as a fail in every run (the
calibration can FAIL). One strategy, few seeds: the full run is the script's own command."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "verdict_calibration.py")


def calibrate(tmp_path, *extra):
    out = tmp_path / "cal.json"
    p = subprocess.run([sys.executable, SCRIPT, "--only", "ddp", "--seeds", "2,1,1", "--worlds",
                        "2", "--no-plants", "--out", str(out), *extra],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    return p, json.loads(out.read_text())


@pytest.mark.slow
def test_calibration_counts_runs_and_a_planted_bug_fails_every_run(tmp_path):
    p, d = calibrate(tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {r["dtype"]: r for r in d["rows"]}
    assert {k: (r["runs"], r["fails"]) for k, r in rows.items()} == {
        "float64": (2, 0), "float32": (1, 0), "bfloat16": (1, 0)}
    assert all(0 < r["max_ratio"] <= 1 for r in rows.values()), rows
    assert d["machine"]["model_name"] and d["machine"]["torch"]
    p, d = calibrate(tmp_path, "--extra", "--plant-bug no-average")
    assert p.returncode == 1, p.stdout + p.stderr
    assert all(r["fails"] == r["runs"] and r["max_ratio"] > 1 for r in d["rows"]), d["rows"]
