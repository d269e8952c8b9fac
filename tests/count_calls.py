"""Run compose4d.py (its arguments follow) with every torch.distributed call and every host read
(`Tensor.item`, `Tensor.tolist`) counted per training step, for tests/test_elastic.py.

A step's window runs from one TrainLog.write (every rank calls it once per finished step) to the
next, so window s holds step s's micro-batches, its reductions and update, and whatever runs
between steps s - 1 and s (the old between-step preemption agreement); checkpoint saves are not
counted. Each rank writes --out's calls-rank{R}.json: a list of {name: calls}, one per window
(window 0 includes the start-up). Counting wraps the functions the way the meter does
(harness.meter.patch_dist), so strategy code is not touched.
"""
import json
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from trainer4d import train  # noqa: E402
from harness.meter import _METERED, patch_dist  # noqa: E402
from harness.nccl import COLLECTIVES  # noqa: E402

windows, paused = [{}], [0]
out = sys.argv[sys.argv.index("--out") + 1]
rank = int(os.environ.get("RANK", "0"))


def bump(name):
    if not paused[0]:
        windows[-1][name] = windows[-1].get(name, 0) + 1


def wrap(name, fn):
    def counted(*a, **k):
        bump(name)
        return fn(*a, **k)
    return counted


patch_dist(sorted(set(_METERED) | set(COLLECTIVES)), wrap)
for meth in ("item", "tolist"):
    setattr(torch.Tensor, meth, wrap("host:" + meth, getattr(torch.Tensor, meth)))

_write = train.TrainLog.write


def write(self, row):
    windows.append({})
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"calls-rank{rank}.json"), "w") as f:
        json.dump(windows[:-1], f)
    return _write(self, row)


_save = train.save_checkpoint


def save(*a, **k):
    paused[0] += 1
    try:
        return _save(*a, **k)
    finally:
        paused[0] -= 1


train.TrainLog.write, train.save_checkpoint = write, save
sys.argv = [os.path.join(ROOT, "compose4d.py")] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
