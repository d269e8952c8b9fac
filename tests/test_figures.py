"""scripts/figures.py: the README's pictures come from data that says what the pictures claim."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("figures", os.path.join(HERE, "scripts",
                                                                      "figures.py"))
figures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(figures)
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def test_schedules_and_zigzag(tmp_path):
    s = figures.main(["--only", "schedules,zigzag", "--out", str(tmp_path)])
    sch = s["schedules"]
    assert set(sch) == {"gpipe", "1f1b", "interleaved", "zb", "dualpipev"}
    for name, v in sch.items():   # each picture's bubble is its formula (DualPipeV: below it)
        if name == "dualpipev":
            assert v["bubble"] < v["formula"] and v["peak"] == [9] * 4
        else:
            assert v["bubble"] == pytest.approx(v["formula"], abs=1e-12)
    assert sch["zb"]["bubble"] < sch["interleaved"]["bubble"] < sch["1f1b"]["bubble"]
    z = s["zigzag"]               # zig-zag balances the causal work, contiguous does not
    assert len(set(z["zigzag"])) == 1 and sum(z["zigzag"]) == sum(z["contiguous"]) == 32 * 33 // 2
    assert z["contiguous"] == sorted(z["contiguous"]) and max(z["contiguous"]) > 6 * min(
        z["contiguous"])
    if HAVE_MPL:
        assert {"pp-schedules.png", "cp-zigzag.png"} <= set(os.listdir(tmp_path))


@pytest.mark.slow
def test_comm_and_memory_from_real_benchmarks(tmp_path):
    """Two real W=2 benchmarks (tiny): the bars are the measured bytes, which are the formulas:
    DDP's all-reduce moves 2(W-1)/W Psi b per rank, ZeRO-3 3 (W-1)/W Psi b, and ZeRO-3 keeps
    half the parameters of DDP on a rank."""
    res = tmp_path / "s.json"
    p = subprocess.run([sys.executable, os.path.join(HERE, "scripts", "figures.py"), "--only",
                        "comm,memory", "--strategies", "ddp,zero-3", "--out", str(tmp_path),
                        "--results", str(res), "--bench-args", "--model tiny --length 64"],
                       cwd=HERE, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {r["label"]: r for r in json.load(open(res))["rows"]}
    ddp, z3 = rows["ddp"], rows["zero-3"]
    assert ddp["comm_ok"] and z3["comm_ok"]
    psi_b = ddp["memory"]["params"]                    # fp32 bytes of the whole model
    assert ddp["wire"] == {"all_reduce": pytest.approx(psi_b)}          # 2 (W-1)/W = 1 at W=2
    z3_wire = z3["wire"]["all_gather_into_tensor"] + z3["wire"]["reduce_scatter_tensor"]
    assert z3_wire == pytest.approx(1.5 * psi_b, rel=0.01)     # 3 (W-1)/W, padding aside
    assert z3["memory"]["optimizer"] < 0.55 * ddp["memory"]["optimizer"]
    if HAVE_MPL:
        assert {"comm-bars.png", "memory-breakdown.png"} <= set(os.listdir(tmp_path))


def test_bad_figure_name():
    p = subprocess.run([sys.executable, os.path.join(HERE, "scripts", "figures.py"), "--only",
                        "bubbles"], capture_output=True, text=True)
    assert p.returncode == 2 and "unknown figure(s): bubbles" in p.stderr
