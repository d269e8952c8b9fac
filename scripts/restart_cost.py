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
    build       to the line saying the model is built (the rank grid, the strategy)
    load        to the line saying the checkpoint is restored (its shards read and checked
                against their digests)
    first step  to the first step's log line after the resume
    lost work   the step the kill interrupted, counted from the last checkpoint: at most
                --save-every steps (here the part of step 3 done before the kill)
    save        the last checkpoint's own line (what each --save-every costs)

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


# Llama 3 (Dubey et al. 2024, section 3.3.4, Table 5): 419 unexpected interruptions in a 54-day
# snapshot of pre-training on 16,384 H100s (78% of them hardware, GPUs 58.7%), 47 planned.
LLAMA3_MTBF_S = 54 * 24 * 3600 / 419


def checkpoint_interval(save_s: float, restart_s: float, mtbf_s: float) -> tuple[float, float]:
    """Young's first-order optimum (1974; Daly 2006): a checkpoint every tau = sqrt(2 save
    MTBF) seconds; the fraction of time lost, save / tau + (tau / 2 + restart) / MTBF (the
    saves, then per failure half an interval of redone work and the restart)."""
    tau = (2 * save_s * mtbf_s) ** 0.5
    return tau, save_s / tau + (tau / 2 + restart_s) / mtbf_s


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
    t_restart = first(lines, r"^(self-check|rank grid|load rank)", t_detect)
    t_built = first(lines, r"^load rank", t_detect)
    t_loaded = first(lines, r"resumed from .* at step 3", t_detect)
    t_step = first(lines, r"^step\s+3\b", t_loaded)
    save = next(float(m.group(1)) for _, line in reversed(lines)
                if (m := re.search(r"^saved .* in ([\d.]+) s", line)))
    phases = dict(detection_s=t_detect - t_kill, restart_s=t_restart - t_detect,
                  build_s=t_built - t_restart, load_s=t_loaded - t_built,
                  first_step_s=t_step - t_loaded)
    phases["total_s"] = t_step - t_kill
    phases["save_s"] = save
    for k, v in phases.items():
        print(f"{k[:-2].replace('_', ' '):<12} {v:6.3f} s", flush=True)
    print("lost work: the part of step 3 done before the kill (a checkpoint every step)")
    print(f"at Llama 3's failure rate (one unexpected interruption every "
          f"{LLAMA3_MTBF_S / 3600:.2f} h), Young's checkpoint interval and the time lost:")
    rows = [("this machine's save and restart", phases["save_s"], phases["total_s"]),
            ("a 60 s blocking save, a 10 min restart (inputs)", 60.0, 600.0),
            ("a 1 s in-memory save, a 10 min restart (inputs)", 1.0, 600.0),
            ("a 1 s in-memory save, a 1 min restart (inputs)", 1.0, 60.0)]
    at_scale = []
    for name, save_s, restart_s in rows:
        tau, lost = checkpoint_interval(save_s, restart_s, LLAMA3_MTBF_S)
        at_scale.append(dict(case=name, save_s=save_s, restart_s=restart_s, interval_s=tau,
                             lost=lost))
        print(f"  {name:<50} every {tau / 60:7.1f} min, lost {lost:6.1%}", flush=True)
    phases["llama3_mtbf_h"] = LLAMA3_MTBF_S / 3600
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(command="python scripts/restart_cost.py --out " + a.out,
                           machine=f"{platform.machine()} CPU, {os.cpu_count()} cores, gloo, "
                                   f"torch {torch.__version__}",
                           dtype="float32", world=2, model="tiny (HF Llama)",
                           trainer=" ".join(BASE), at_scale=at_scale, **phases), f,
                      indent=1)


if __name__ == "__main__":
    main()
