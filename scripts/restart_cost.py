"""restart_cost.py: what a worker's death costs a training job here, phase by phase.

    python scripts/restart_cost.py --out results/restart-cost-cpu.json

One launch, `torchrun --nproc_per_node=2 --max-restarts=1 compose4d.py --mode train --dp 2
--save CK --save-every 1 --resume CK --test-sigkill-at 3:1` (tiny, float32): the last rank kills
itself with SIGKILL before micro-batch 1 of step 3; torchrun sees the worker exit, stops the
other, starts both again, and they resume from the newest checkpoint (step 3's start) and
finish. Every output line is timestamped as it arrives (both streams, unbuffered), so:

    detection   the SIGKILL (the hook prints its time) to torchrun's line naming the failure
    restart     that line to the restarted workers' first line (new processes: Python and
                torch imports, the rendezvous, the process group)
    build+load  to the line saying the checkpoint is restored (the model built, the
                shards read and checked against their digests)
    first step  to the first step's log line after the resume
    lost work   the step the kill interrupted, counted from the last checkpoint: at most
                --save-every steps (here the part of step 3 done before the kill)

A node death without a signal is detected only by the peers' collective timeout (--timeout, 60
s here): the other rank of a dead one waits in its all-reduce; on one machine torchrun's
monitor sees the local exit first. The figures are one CPU machine's; at scale each phase
grows (rendezvous over thousands of ranks, the checkpoint's bytes from a shared filesystem)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--mode", "train", "--dtype", "float32", "--steps", "5", "--log-every", "1", "--dp", "2",
        "--grad-accum", "2", "--batch", "4", "--save-every", "1", "--timeout", "60"]


def run(ck: str, out: str) -> list[tuple[float, str]]:
    """The launch's lines, each with the time it arrived."""
    cmd = [sys.executable, "-u", "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", "--max-restarts=1", os.path.join(ROOT, "compose4d.py"), *BASE,
           "--save", ck, "--resume", ck, "--test-sigkill-at", "3:1", "--out", out]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1",
                                            PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1",
                                            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    lines, lock = [], threading.Lock()

    def pump(stream):
        for line in stream:
            with lock:
                lines.append((time.time(), line.rstrip("\n")))
    threads = [threading.Thread(target=pump, args=(s,)) for s in (p.stdout, p.stderr)]
    for t in threads:
        t.start()
    p.wait(timeout=600)
    for t in threads:
        t.join()
    if p.returncode != 0:
        raise SystemExit("the launch failed:\n" + "\n".join(line for _, line in lines[-40:]))
    return sorted(lines)


def first(lines, pattern: str, after: float = 0.0) -> float:
    for t, line in lines:
        if t >= after and re.search(pattern, line):
            return t
    raise SystemExit(f"no line matching {pattern!r} after {after:.3f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    import torch
    with tempfile.TemporaryDirectory() as tmp:
        lines = run(os.path.join(tmp, "ck"), os.path.join(tmp, "out"))
    kill_line = next(line for _, line in lines if "test hook: SIGKILL at" in line)
    t_kill = float(re.search(r"SIGKILL at ([\d.]+)", kill_line).group(1))
    t_detect = first(lines, r"exitcode: -9|Signals\.SIGKILL|failed \(exitcode", t_kill)
    t_restart = first(lines, r"^(load rank|train:|resumed from|warning:)", t_detect)
    t_loaded = first(lines, r"resumed from .* at step 3", t_detect)
    t_step = first(lines, r"^\s*step\s+3\b|^\s*3\s", t_loaded)
    phases = dict(detection_s=t_detect - t_kill, restart_s=t_restart - t_detect,
                  build_load_s=t_loaded - t_restart, first_step_s=t_step - t_loaded)
    phases["total_s"] = t_step - t_kill
    for k, v in phases.items():
        print(f"{k[:-2].replace('_', ' '):<12} {v:6.2f} s", flush=True)
    print("lost work: the part of step 3 done before the kill (checkpoint every step)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(command="python scripts/restart_cost.py --out " + a.out,
                           machine=f"{platform.machine()} CPU, {os.cpu_count()} cores, gloo, "
                                   f"torch {torch.__version__}",
                           dtype="float32", world=2, model="tiny (HF Llama)",
                           trainer=" ".join(BASE), **phases), f, indent=1)


if __name__ == "__main__":
    main()
