"""timeline.py: a pipeline's per-rank action timelines, measured and drawn.

A timeline is one list per rank of (kind, chunk, micro-batch, start, end) spans, kind in F, B, I,
W: what timing.ActionTimeline records around a pipeline's compute from outside (pp.py's
benchmark), or what a schedule simulator returns. Only the spans count as busy; the gaps are
the bubble. Nothing here knows how a pipeline schedules its work: the caller passes the spans.
"""
from __future__ import annotations

import os


def measured_bubble(timelines) -> tuple[float, float]:
    """(end of the last span, idle share 1 - busy / (ranks x end)) over every rank's spans."""
    end = max(e for tl in timelines for *_, e in tl)
    busy = sum(e - s for tl in timelines for *_, s, e in tl)
    return end, 1 - busy / (len(timelines) * end)


def ascii_timeline(timelines, end, width=72) -> list[str]:
    """One row per rank: F/B/I/W with the micro-batch's last digit, '.' idle."""
    rows = []
    for r, tl in enumerate(timelines):
        line = ["."] * width
        for kind, c, m, s, e in tl:
            a, b = int(s / end * width), max(int(s / end * width) + 1, int(e / end * width))
            for i in range(a, min(b, width)):
                line[i] = kind if i == a else str(m % 10)
        rows.append(f"  rank {r} |" + "".join(line) + "|")
    return rows


def plot_timeline(timelines, end, path, title):
    """The schedule as a Gantt chart (when matplotlib is installed); spans in seconds."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    colors = {"F": "tab:blue", "B": "tab:orange", "I": "tab:orange", "W": "tab:green"}
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(timelines) + 1))
    for r, tl in enumerate(timelines):
        for kind, c, m, s, e in tl:
            ax.barh(r, (e - s) * 1e3, left=s * 1e3, color=colors[kind], edgecolor="black",
                    linewidth=0.3)
            ax.text((s + e) / 2 * 1e3, r, f"{kind}{m}", ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(timelines)), [f"rank {r}" for r in range(len(timelines))])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(f"{title}: F forward, B/I backward (input), W weight gradient")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
