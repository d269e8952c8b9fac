"""overlap.py: the share of a step's communication time hidden behind compute, measured from a
timeline of a step under torch.profiler (benchmark mode prints it; `make bench` tabulates it):
each rank profiles PROFILED_STEPS steps, one at a time, and reports the median one (one step's
share varies from run to run: ddp's was 72% in one `make bench` and 51% in the next).

    comm      the union of the collectives' and point-to-point transfers' busy intervals:
              on CPU the `gloo:*` spans (an async collective runs on a gloo worker thread, its span
              from start to finish; a send/recv's span runs from its post to its completion as
              seen by the caller, so for point-to-point the share is an upper bound); on CUDA the
              NCCL kernels' device intervals. What the step leaves in flight (ZeRO-1/2's
              gathers of the updated parameters) is waited for inside the window
              (Strategy.wait_comm) and counts as exposed: each step is profiled on its own.
    compute   the union of the busy intervals of everything else: on CPU the `aten::` operators
              of the step's main thread (outside the collectives' own launch code), on CUDA the
              other kernels.
    hidden    |comm ∩ compute|; share = hidden / |comm|; exposed = |comm| - hidden, the
              communication time the step waits for.

A blocking collective (the caller waits inside it) has no compute beside it: share 0. Its
measured value is not a proof of overlap on a GPU (two CPU cores shared by two ranks and their
gloo threads are a different machine), but it is > 0 exactly where the algorithm lets compute run
while a transfer is in flight, and 0 where it does not (tests/test_overlap.py shows both).
"""
from __future__ import annotations

import torch
from torch.autograd import DeviceType


def union(intervals) -> list[tuple[float, float]]:
    """Sorted, merged (start, end) intervals."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(intervals) -> float:
    return sum(e - s for s, e in intervals)


def intersect(a, b) -> list[tuple[float, float]]:
    """Intersection of two merged interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _under_collective(ev) -> bool:
    p = ev.cpu_parent
    while p is not None:
        if p.name.startswith(("c10d::", "gloo:", "nccl:")):
            return True
        p = p.cpu_parent
    return False


def timeline(events, cuda: bool) -> tuple[list, list]:
    """(comm, compute) merged intervals in microseconds from a profiler's events."""
    comm, compute = [], []
    if cuda:
        for ev in events:
            if ev.device_type != DeviceType.CUDA:
                continue
            iv = (ev.time_range.start, ev.time_range.end)
            (comm if "nccl" in ev.name.lower() else compute).append(iv)
        return union(comm), union(compute)
    counts: dict = {}       # the step's thread: the one that ran the most aten operators
    for ev in events:
        if ev.name.startswith("aten::"):
            counts[ev.thread] = counts.get(ev.thread, 0) + 1
    main = max(counts, key=counts.get) if counts else None
    for ev in events:
        iv = (ev.time_range.start, ev.time_range.end)
        if ev.name.startswith("gloo:"):
            comm.append(iv)
        elif ev.thread == main and ev.name.startswith("aten::") and not _under_collective(ev):
            compute.append(iv)
    return union(comm), union(compute)


def measure(comm, compute) -> dict:
    hidden = length(intersect(comm, compute))
    total = length(comm)
    return dict(comm_s=total * 1e-6, hidden_s=hidden * 1e-6, exposed_s=(total - hidden) * 1e-6,
                share=hidden / total if total else None)


def profile_step(strat, batch, device) -> tuple[dict, tuple[list, list]]:
    """One step of `strat` under torch.profiler: (measure(...), (comm, compute) intervals in
    seconds from the step's first event)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        strat.step(batch)
        # A collective still running on a gloo worker thread while the profiler stops can crash
        # the process (torch 2.13's CPU profiler, seen as a SIGSEGV in profiler_stop), so what
        # the step left in flight (ZeRO's parameter gathers for the next forward) finishes
        # here, counted in this step: exposed, its overlap with the next forward unmeasured.
        strat.wait_comm()
        if cuda:
            torch.cuda.synchronize(device)
    comm, compute = timeline(prof.events(), cuda)
    t0 = min([s for s, _ in comm + compute], default=0.0)
    rel = lambda ivs: [((s - t0) * 1e-6, (e - t0) * 1e-6) for s, e in ivs]  # noqa: E731
    return measure(comm, compute), (rel(comm), rel(compute))


PROFILED_STEPS = 3


def profile_steps(strat, batches, device) -> tuple[dict, tuple[list, list]]:
    """Each batch's step profiled on its own (profile_step): the median step by its share (its
    measure and its timeline), with every step's share in `shares`. A step without
    communication (share None) sorts first."""
    runs = [profile_step(strat, b, device) for b in batches]
    order = sorted(range(len(runs)), key=lambda i: (runs[i][0]["share"] is not None,
                                                    runs[i][0]["share"] or 0.0))
    m, spans = runs[order[len(runs) // 2]]
    return dict(m, shares=[r[0]["share"] for r in runs]), spans


def plot(rows, path: str, title: str):
    """rows: [(label, (comm, compute) intervals in seconds)]: one pair of bars per label (when
    matplotlib is installed)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    import os
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig, ax = plt.subplots(figsize=(10, 0.9 * len(rows) + 1.2))
    ticks, labels = [], []
    for i, (label, (comm, compute)) in enumerate(rows):
        y = 2 * i
        ax.broken_barh([(s * 1e3, (e - s) * 1e3) for s, e in compute], (y + 0.05, 0.8),
                       color="tab:blue")
        ax.broken_barh([(s * 1e3, (e - s) * 1e3) for s, e in comm], (y + 0.95, 0.8),
                       color="tab:red")
        ticks += [y + 0.45, y + 1.35]
        labels += [f"{label} compute", f"{label} comm"]
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels)
    ax.set_xlabel("ms since the step's first operator")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
