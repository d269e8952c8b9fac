"""report.py: Writing results: byte formatting, --out JSON files, the learning curve plot."""
from __future__ import annotations

import json
import os

from .run import Run


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def write_json(run: Run, name: str, obj):
    if run.args.out and run.env.is_main:
        os.makedirs(run.args.out, exist_ok=True)
        with open(os.path.join(run.args.out, name), "w") as f:
            json.dump(obj, f, indent=1, default=str)


def plot_learning(out, name, rows, floor):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [s for s, _, _ in rows]
    ax.plot(steps, [r for _, r, _ in rows], label="single-device reference", lw=2)
    ax.plot(steps, [l for _, _, l in rows], "--", label=name)
    ax.axhline(floor, color="gray", ls=":", label="entropy floor")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "learning.png"), dpi=100)
    plt.close(fig)


def jsonable(r):
    if r is None:
        return None
    r = dict(r)
    for key in ("comm", "comm_sum"):
        if key in r:
            r[key] = {f"{op}|{g}": dict(calls=c, bytes=b) for (op, g), (c, b) in r[key].items()}
    return r
