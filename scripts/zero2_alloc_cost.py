"""What ZeRO-2's free-and-reallocate of full gradients costs on CPU, outside any process group.

    python scripts/zero2_alloc_cost.py --out results/zero2-alloc-cost-cpu.json   # both, 5 runs each
    OMP_NUM_THREADS=1 python scripts/zero2_alloc_cost.py                         # one run, printed
    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 \
        OMP_NUM_THREADS=1 python scripts/zero2_alloc_cost.py   # one run, glibc keeps freed pages

Stage 1 keeps one flat gradient buffer per unit and accumulates into it in place. Stage 2 frees
each unit's buffer once reduce-scattered (zero_units.py: FlatUnit.free_grads) and allocates it again,
zeroed, when the unit's next gradient arrives (FlatUnit.alloc_grads). Timed here on the small
preset's units (embedding, head, 8 decoder layers: 72 MiB in float32), the same storage calls.
glibc serves a buffer this large by mmap, so every step touches fresh pages; the CUDA caching
allocator reuses its blocks instead.

--out runs the measurement --runs times in fresh processes (one thread each) under glibc's
default malloc and again with the two variables above (they are read when a process starts), and
writes every run's times, their min and max, the command, the machine and the dtype."""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KEEP_PAGES = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "4294967296"}


def unit_sizes(preset: str = "small") -> list[int]:
    """Elements per zero.py unit (embed, each decoder layer, norm + head) of a preset, counted
    on the meta device so nothing is allocated."""
    from types import SimpleNamespace
    from harness.loading import meta_model
    from harness.models import load_config
    from zero import decoder_units
    model = meta_model(load_config(preset), SimpleNamespace(attn="sdpa", dtype="float32"))
    return [sum(p.numel() for m in mods for p in m.parameters())
            for _, mods in decoder_units(model)]


def stage1(bufs, grads):
    for b, g in zip(bufs, grads):
        b.add_(g)


def stage2(bufs, grads):
    for b, g in zip(bufs, grads):
        b.untyped_storage().resize_(b.numel() * b.element_size())   # alloc_grads
        b.zero_()
        b.add_(g)
    for b in bufs:
        b.untyped_storage().resize_(0)                               # free_grads


def measure(reps: int = 10) -> dict:
    """{"stage1_ms", "stage2_ms", "grads_mib"}: one process's mean time per step of each."""
    sizes = unit_sizes()
    grads = [torch.randn(n) for n in sizes]
    out = {"grads_mib": sum(sizes) * 4 / 2**20}
    for key, f in (("stage1_ms", stage1), ("stage2_ms", stage2)):
        bufs = [torch.zeros(n) for n in sizes]
        f(bufs, grads)   # warm-up
        t = time.perf_counter()
        for _ in range(reps):
            f(bufs, grads)
        out[key] = (time.perf_counter() - t) / reps * 1e3
    return out


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def record(path: str, runs: int):
    rows = []
    for label, extra in (("glibc default", {}), ("glibc keeps its pages", KEEP_PAGES)):
        env = {k: v for k, v in os.environ.items() if k not in KEEP_PAGES}
        env.update(extra, OMP_NUM_THREADS="1")
        got = [json.loads(subprocess.run([sys.executable, os.path.abspath(__file__), "--json"],
                                         env=env, capture_output=True, text=True,
                                         check=True).stdout) for _ in range(runs)]
        row = {"malloc": label, "env": extra, "runs": runs}
        for key in ("stage1_ms", "stage2_ms"):
            ms = [round(g[key], 2) for g in got]
            row.update({key: ms, key + "_min": min(ms), key + "_max": max(ms)})
        rows.append(row)
        print(f"{label:<22} stage 1 {row['stage1_ms_min']:.1f}-{row['stage1_ms_max']:.1f} ms, "
              f"stage 2 {row['stage2_ms_min']:.1f}-{row['stage2_ms_max']:.1f} ms per step "
              f"({runs} runs)", flush=True)
    out = {"command": f"python scripts/zero2_alloc_cost.py --out {path} --runs {runs}",
           "machine": f"{cpu_name()}, {os.cpu_count()} cores; one process, one thread",
           "torch": torch.__version__.split("+")[0], "dtype": "float32", "world": 1,
           "model": "small preset's zero.py units", "grads_mib": round(got[0]["grads_mib"], 2),
           "method": "mean over 10 steps after one warm-up, per process; min and max over runs",
           "rows": rows}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="run --runs processes per malloc setting, "
                                                 "write the JSON here")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)   # one run, as JSON
    a = ap.parse_args()
    if a.out:
        return record(a.out, a.runs)
    r = measure()
    if a.json:
        print(json.dumps(r))
        return
    for name, key in (("stage 1, in place", "stage1_ms"), ("stage 2, free and reallocate",
                                                           "stage2_ms")):
        print(f"{name:<30} {r[key]:6.1f} ms per step ({r['grads_mib']:.1f} MiB of gradients)")


if __name__ == "__main__":
    main()
