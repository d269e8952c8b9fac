"""trainlog.py: the train mode's logs under --out: one JSON line per logged step
(train.jsonl), TensorBoard event files when tensorboard is installed, and a PNG of the train and
held-out loss at the end when matplotlib is. Rank 0 writes; the other ranks hold a no-op log.

A train.jsonl row: {"step", "loss", "lr", "grad_norm", "tokens_per_s", "memory_bytes",
"memory_source", "mfu"} and, on evaluation steps, {"eval_loss", "eval_ppl"} (the held-out
loss after that step; a run with evaluations starts with a row {"step": start - 1, "eval_loss",
"eval_ppl"}: the loss before its first step). memory_bytes is
torch.cuda.max_memory_allocated on CUDA and the process's peak resident set (VmHWM) on CPU; mfu
is null on CPU (harness/flops.py).
"""
from __future__ import annotations

import json
import os

import torch


def memory_now(device) -> tuple[int | None, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda max_memory_allocated"
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024, "peak resident set (VmHWM, CPU)"
    except OSError:
        pass
    return None, "unavailable"


class TrainLog:
    def __init__(self, out: str | None, enabled: bool, resume: bool = False):
        self.enabled = bool(out) and enabled
        self.rows: list[dict] = []
        self.tb = None
        if not self.enabled:
            return
        os.makedirs(out, exist_ok=True)
        self.out = out
        self.path = os.path.join(out, "train.jsonl")
        if not resume and os.path.exists(self.path):
            os.remove(self.path)
        if resume and os.path.exists(self.path):     # a restart continues the curve
            with open(self.path) as f:
                self.rows = [json.loads(line) for line in f if line.strip()]
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:        # tensorboard not installed: the JSONL is the log
            SummaryWriter = None
        if SummaryWriter is not None:   # (any other error is a real one: raised)
            self.tb = SummaryWriter(os.path.join(out, "tensorboard"))

    def write(self, row: dict):
        if not self.enabled:
            return
        self.rows = [r for r in self.rows if r["step"] != row["step"]] + [row]
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and v is not None:
                    self.tb.add_scalar(k, v, row["step"])

    def close(self, title: str | None = None) -> str | None:
        """Flush TensorBoard and draw loss.png; returns the PNG's path (None without
        matplotlib or rows)."""
        if not self.enabled:
            return None
        if self.tb is not None:
            self.tb.close()
        return plot_losses(self.rows, os.path.join(self.out, "loss.png"), title)


def plot_losses(rows: list[dict], path: str, title: str | None = None) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    tr = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    ev = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    if not tr and not ev:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    if tr:
        ax.plot(*zip(*tr), label="train loss", lw=1.2)
    if ev:
        ax.plot(*zip(*ev), "o-", label="held-out loss", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":        # python -m harness.trainlog OUT/train.jsonl PNG [TITLE]
    import sys
    with open(sys.argv[1]) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    print(plot_losses(rows, sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None))
