"""async_tp_bench.py: asynchronous TP against the synchronous SP regions, on this machine.

    python scripts/async_tp_bench.py --out results/async-tp-cpu.json   (about 4 minutes, 2 cores)

For W = 2 (the `small` preset: 8 layers, H 384, 6 heads) and W = 4 (configs/small-gqa8.json, the
same with 8 heads so that 4 divides them), float32, batch 4 x 512 tokens: one
`sp.py --variant megatron --async-tp --mode benchmark --compare-native --paired N` run, which
builds the asynchronous regions and the synchronous ones (rig.sp.SyncMegatronSP) side by side and
records
    overlap   the share of each side's communication time hidden behind compute, the median
              of three profiled steps (harness/overlap.py; for point-to-point an upper bound:
              a hop's span runs from its post to the wait that completes it)
    paired    the step-time ratio async / sync over N interleaved rounds (median, p10, p90)
    comm      whether both sides' traffic matches their formulas (the rings: 10L+3 of T-1 hops)
docs/benchmarks.md quotes the JSON.
"""
from __future__ import annotations

import os
import sys

from bench import cpu_machine, torchrun_json, write_results
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness.benchmark import overlap_share  # noqa: E402
RUNS = {2: ["--model", "small", "--paired", "8"],
        4: ["--model", "configs/small-gqa8.json", "--paired", "6"]}
COMMON = ["--variant", "megatron", "--async-tp", "--mode", "benchmark", "--compare-native",
          "--dtype", "float32", "--batch", "4", "--length", "512", "--bench-iters", "2",
          "--warmup", "1"]


def run(world: int) -> dict:
    b, command = torchrun_json(world, ["sp.py", *COMMON, *RUNS[world]], prefix="async-tp-")
    sync = b["native"]["sp-megatron-sync"]
    pair = b["paired"]["sp-megatron-sync"]
    return dict(world=world, command=command,
                async_overlap_share=b["overlap_share"],
                sync_overlap_share=overlap_share(sync),
                async_exposed_ms=1e3 * b["ours"]["overlap"][0]["exposed_s"],
                sync_exposed_ms=1e3 * sync["overlap"][0]["exposed_s"],
                paired_ratio_median=pair["median"], paired_ratio_p10=pair["p10"],
                paired_ratio_p90=pair["p90"], rounds=pair["n"],
                async_tokens_per_s=b["ours"]["tokens_per_s"],
                sync_tokens_per_s=sync["tokens_per_s"], comm_ok=b["comm_ok"])


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None, help="the results file (default: the temporary "
                   "directory's; results/async-tp-cpu.json updates the tracked figures)")
    out = p.parse_args(argv).out
    rows = []
    for world in RUNS:
        row = run(world)
        print(f"W={world}: hidden {row['async_overlap_share']:.0%} async vs "
              f"{row['sync_overlap_share'] or 0:.0%} sync; step ratio async/sync median "
              f"{row['paired_ratio_median']:.3f} [{row['paired_ratio_p10']:.3f}, "
              f"{row['paired_ratio_p90']:.3f}] over {row['rounds']} rounds")
        rows.append(row)
    write_results("async-tp-cpu.json", dict(machine=cpu_machine() + ", float32", rows=rows), out)


if __name__ == "__main__":
    main()
