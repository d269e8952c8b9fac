"""cp_balance_study.py: context parallelism's work per rank on packed documents, zig-zag against the
greedy balancer (cp_balance.py at the root: the formulas and the design).

    python scripts/cp_balance_study.py --out results/cp-balance-cpu.json

Batches of B = 8 rows of S = 4096 tokens, each row packed with documents whose lengths follow
harness.data's long tail (Pareto, alpha = 1.2) scaled to the sequence (at least S / 32 = 128
tokens: median about 230, a tail to the whole row), 64 batches; per C = 2, 4, 8 and assignment,
the mean over the batches of max / mean of the ranks' (query, key) pairs under the document mask
(the ring waits for its slowest rank), and the worst batch. "one-document" rows: the same
layouts on unpacked rows (zig-zag is balanced there by construction)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import cp_balance  # noqa: E402
from harness.data import doc_positions  # noqa: E402

B, S, BATCHES, SEED = 8, 4096, 64, 0


def rows():
    out = []
    for C in (2, 4, 8):
        for packed in (True, False):
            stats = {"zigzag": [], "greedy": []}
            for k in range(BATCHES):
                docs = (doc_positions(SEED, k * B, B, S, minimum=S // 32) if packed
                        else torch.arange(S).expand(B, S))
                work = cp_balance.token_work(docs)
                stats["zigzag"].append(cp_balance.imbalance(work, cp_balance.zigzag(C, S)))
                stats["greedy"].append(cp_balance.imbalance(work, cp_balance.balanced(docs, C)))
            for name, v in stats.items():
                out.append(dict(C=C, assignment=name, rows="packed" if packed else "one-document",
                                max_over_mean=sum(v) / len(v), worst=max(v)))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    table = rows()
    for r in table:
        print(f"C={r['C']} {r['rows']:12s} {r['assignment']:7s} max/mean {r['max_over_mean']:.3f}"
              f" (worst batch {r['worst']:.3f})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(command="python scripts/cp_balance_study.py --out " + a.out,
                           machine=f"{platform.machine()} CPU (arithmetic only)",
                           B=B, S=S, batches=BATCHES, doc_min=S // 32, rows=table), f, indent=1)


if __name__ == "__main__":
    main()
