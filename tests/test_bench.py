"""scripts/bench.py (`make bench`): the interleaved ours-vs-PyTorch table. One real row on the
tiny model (the schema results/bench-cpu.json is written in, the ratios taken from --paired
rounds), and a refused configuration recorded as a skipped row with its reason, not a crash."""
import json
import math
import os
import subprocess
import sys

import pytest

from conftest import ROOT

KEYS = {"strategy", "baseline", "world", "dtype", "ratio_median", "ratio_p10", "ratio_p90",
        "ours_ms", "theirs_ms", "overlap_share", "pairs", "model", "machine"}


def bench(tmp_path, *args):
    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench.py"), *args,
                        "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    return p, (json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.slow
def test_ddp_row_against_torch_ddp_and_the_reference(tmp_path):
    p, rows = bench(tmp_path, "--world", "2", "--only", "ddp", "--pairs", "3", "--model", "tiny")
    assert p.returncode == 0, p.stdout + p.stderr
    assert [r["baseline"] for r in rows] == ["torch-ddp", "single device"], rows
    for r in rows:
        assert set(r) == KEYS and r["world"] == 2 and r["dtype"] == "float32", r
        assert r["pairs"] == 3 and r["model"] == "tiny", r
        # the median of the per-round ratios and the ratio of the median times describe the
        # same rounds: they agree to the rounds' spread (a swapped or stale field does not)
        assert abs(math.log(r["ratio_median"] * r["theirs_ms"] / r["ours_ms"])) < math.log(1.5), r
        assert r["ratio_p10"] < r["ratio_p90"], r    # 3 rounds of real timings differ
        assert r["overlap_share"] < 0.25, r   # tiny: one bucket, nothing to hide it behind
    assert "| ddp | torch-ddp | 2 |" in p.stdout


def test_refused_configuration_is_a_skipped_row_merged_into_the_table(tmp_path):
    # --merge keeps the other rows: an earlier tp row at W=3 is replaced, ddp's is kept; its
    # old failure is not this run's, so the exit code stays 0
    earlier = [dict(strategy="tp", world=3, skipped="stale"), dict(strategy="ddp", world=3,
                                                                   skipped="failed (exit 1)")]
    (tmp_path / "bench.json").write_text(json.dumps(earlier))
    # tp runs 8 heads (configs/small-gqa8.json): 3 ranks cannot split them
    p, rows = bench(tmp_path, "--world", "3", "--only", "tp", "--pairs", "2", "--merge")
    assert p.returncode == 0, p.stdout + p.stderr
    assert [r["strategy"] for r in rows] == ["ddp", "tp"], rows
    assert rows[0]["skipped"] == "failed (exit 1)", rows
    rows = rows[1:]
    assert len(rows) == 1 and rows[0]["skipped"].startswith("error:"), rows
    assert "head" in rows[0]["skipped"], rows
    assert "| tp | - | 3 | not run: error:" in p.stdout
    t = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench.py"), "--table",
                        str(tmp_path / "bench.json")], capture_output=True, text=True)
    assert t.returncode == 0 and t.stdout.count("not run:") == 2, t.stdout + t.stderr


def test_wide_table_one_line_per_pair_a_column_per_world(tmp_path):
    rows = [dict(strategy="ddp", baseline="torch-ddp", world=2, ratio_median=0.98, ratio_p10=0.9,
                 ratio_p90=1.1, overlap_share=0.7),
            dict(strategy="ddp", baseline="torch-ddp", world=4, ratio_median=1.02, ratio_p10=0.97,
                 ratio_p90=1.03, overlap_share=None),
            dict(strategy="tp", world=4, skipped="error: heads")]
    (tmp_path / "b.json").write_text(json.dumps(rows))
    t = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench.py"), "--table",
                        str(tmp_path / "b.json"), "--wide"], capture_output=True, text=True)
    assert t.returncode == 0, t.stderr
    lines = t.stdout.splitlines()
    assert lines[0] == ("| strategy | baseline | W=2 ours/theirs | W=4 ours/theirs | overlap W=2 "
                        "| overlap W=4 |"), lines
    assert "| ddp | torch-ddp | 0.98 (0.90-1.10) | 1.02 (0.97-1.03) | 70% | - |" in lines, lines
    assert "| tp | - | - | not run: error: heads | - | - |" in lines, lines
