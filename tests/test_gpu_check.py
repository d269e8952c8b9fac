"""scripts/gpu_check.py rehearsed on CPU (--device cpu --smoke), and the host-sync detector it
uses (harness/hostsync.py) shown to catch a host read and a host-built tensor in a step."""
import json
import os
import subprocess
import sys

import pytest
import torch

from harness.hostsync import HostSyncs
from harness.loss import scalar

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.py")


class Clean:
    def step(self, x):
        return scalar((x * 2).sum())          # the logged loss: the one allowed read


class Reads(Clean):
    def step(self, x):
        n = int((x > 0).sum())                # plant: a host read inside the step
        return super().step(x) + n


class Builds(Clean):
    def step(self, x):
        w = torch.tensor([1.0, 2.0, 3.0], device=x.device)   # plant: a tensor from host data
        return super().step(x * w)


@pytest.mark.parametrize("cls, unexpected", [(Clean, 0), (Reads, 1), (Builds, 1)])
def test_hostsync_counts_per_step(cls, unexpected):
    hs = HostSyncs("cpu")
    with hs.watching(cls):
        for _ in range(3):
            cls().step(torch.ones(3))
    r = hs.report()
    assert r["steps"] == 3                    # a subclass's super().step is one step, not two
    assert r["allowed_per_step"] == 1.0, r["sites"]
    assert r["unexpected_per_step"] == unexpected, r["sites"]
    bad = [k for k, v in r["sites"].items() if not v["allowed"]]
    assert all("tests/test_gpu_check.py" in k for k in bad), bad
    assert cls.step.__qualname__ == f"{cls.__name__}.step"      # the class is restored


def _run(out, *extra):
    return subprocess.run([sys.executable, SCRIPT, str(out), "--device", "cpu", "--smoke",
                           *extra], cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.heavy   # (a minute: make test's budget)
def test_smoke_every_section(tmp_path):
    """The whole driver on tiny shapes: every section passes, one JSON each plus the log (at
    most 8 files, one folder deep), each naming the machine and what ran."""
    p = _run(tmp_path, "--budget-s", "300")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    files = sorted(os.listdir(tmp_path))
    assert files == ["cp.json", "device.json", "fp8.json", "gpu_check.log", "memory.json",
                     "speed.json"]
    docs = {f[:-5]: json.load(open(tmp_path / f)) for f in files if f.endswith(".json")}
    for name, d in docs.items():
        assert d["ok"] is True and d["rc"] == 0 and d["torch"] and d["device"], (name, d)
    dev = docs["device"]
    labels = [(i["label"], i.get("mode")) for i in dev["items"]]
    assert ("ddp", "correctness") in labels and ("zero3", "learning") in labels
    assert [lab for lab, _ in labels][-3:] == ["train-save", "train-resume", "hf-reload"]
    reload = dev["items"][-1]      # the export is the trainer's final model, tensor by tensor
    assert reload["checkpoint_step"] == 30 and reload["tensors"] > 0, reload
    assert reload["differ_from_checkpoint"] == [], reload
    steps = [i["host_syncs"]["steps"] for i in dev["items"] if i.get("mode") == "correctness"]
    assert steps and all(s >= 2 for s in steps)        # the steps were watched
    assert dev["host_syncs_unexpected"] == 0, dev
    speed = {r["run"]: r for r in docs["speed"]["items"]}
    assert list(speed)[-1].startswith("compose4d")
    lever = speed["reference, chunked CE, compiled blocks"]   # Part B's lever, its loss held
    assert lever["eager_over_compiled"] > 0 and abs(lever["loss_first_diff"]) <= 0.02, lever
    trials = docs["memory"]["strategies"]["tp"]["trials"]
    assert trials and trials[0]["length"] == docs["memory"]["strategies"]["tp"]["predicted_max"]
    assert {t["kind"] for t in trials} <= {"OK", "OOM"}
    assert docs["cp"]["rows"] and all(r["accurate"] for r in docs["cp"]["rows"] if r["C"] > 1)
    assert docs["cp"]["docs_loop_over_one_masked_call_C2"]["float32"] > 0   # packed documents
    fp8_rows = docs["fp8"]["items"]                      # bf16, then each recipe beside it
    assert [r["run"] for r in fp8_rows] == ["bf16", "tensorwise", "rowwise", "blockwise"]
    assert all(r["ok"] for r in fp8_rows) and fp8_rows[0]["converted"] == 0
    assert all(r["converted"] > 0 and r["over_bf16"] for r in fp8_rows[1:]), fp8_rows


def test_failures_are_loud(tmp_path):
    """A section that breaks fails the whole command; an unknown section is refused (exit 2)."""
    p = _run(tmp_path, "--sections", "device", "--strategies", "no-such-strategy")
    assert p.returncode == 1
    assert json.load(open(tmp_path / "device.json"))["ok"] is False
    p = _run(tmp_path, "--sections", "gpu")
    assert p.returncode == 2 and "'gpu' is not one of" in p.stderr


def test_the_export_is_compared_with_the_checkpoint_bit_for_bit():
    """differ_from_checkpoint: an fp32 master rounded to the export's bf16 matches; one bf16
    ulp off, or a tensor missing, is named."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    saved = {"a": torch.randn(8, 4), "b": torch.randn(3)}
    export = {n: t.bfloat16() for n, t in saved.items()}
    assert gc.differ_from_checkpoint(export, saved) == []
    export["a"] = export["a"].clone()
    export["a"][0, 0] = torch.nextafter(export["a"][0, 0], torch.tensor(9.0, dtype=torch.bfloat16))
    del export["b"]
    assert gc.differ_from_checkpoint(export, saved) == ["a", "b"]
