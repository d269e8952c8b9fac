"""compose5d.py: compose4d's new layouts measured: expert parallelism and ZeRO-3 in the composition.

    python scripts/compose5d.py --out results/compose5d-cpu.json     (about 2 minutes on 2 cores)

For each layout, one `compose4d.py --mode benchmark` run (float32, tiny-moe or tiny, W=4): every
communication row of rank 0 (or summed over the ranks, the all-to-all) beside the formula's
count and bytes (trainer4d/comm.py, compose_moe.expected_comm), and each rank's
model-state bytes measured by the live-tensor tracker beside zero.state_bytes' formula. The
docs quote the rows from the JSON (docs/training.md, "Expert parallelism and ZeRO-3").
"""
from __future__ import annotations

from bench import cpu_machine, torchrun_json, write_results

LAYOUTS = {
    "ep2-pp2-zero3": ["--model", "tiny-moe", "--ep", "2", "--pp", "2", "--zero", "3"],
    "ep2-tp2": ["--model", "tiny-moe", "--ep", "2", "--tp", "2"],
    "ep4-zero2": ["--model", "tiny-moe", "--ep", "4", "--zero", "2"],
    "zero3-tp2-pp2": ["--zero", "3", "--tp", "2", "--pp", "2"],
}
COMMON = ["--mode", "benchmark", "--dtype", "float32", "--grad-accum", "2", "--bench-iters", "2",
          "--warmup", "1"]


def run(name: str, args: list[str]) -> dict:
    b, command = torchrun_json(4, ["compose4d.py", *args, *COMMON], prefix=f"compose5d-{name}-")
    comm = []
    for e in b["expected"]:
        key = f"{e['op']}|{e['group']}"
        got = (b["ours"]["comm_sum"] if e["ranks"] == "sum" else b["ours"]["comm"]).get(
            key, {"calls": 0, "bytes": 0})
        comm.append(dict(op=e["op"], group=e["group"], ranks=e["ranks"], calls=got["calls"],
                         bytes=got["bytes"], formula_calls=e["calls"], formula_bytes=e["bytes"],
                         formula=e["formula"]))
    mem = [{k: m[k] for k in ("params", "grads", "optimizer", "model_states")}
           for m in b["ours"]["memory"]]
    return dict(layout=name, command=command,
                strategy=b["strategy"], comm_ok=b["comm_ok"], comm=comm, memory=mem,
                memory_formula_rank0=b["memory_formula"], tokens_per_s=b["ours"]["tokens_per_s"])


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None, help="the results file (default: the temporary "
                   "directory's; results/compose5d-cpu.json updates the tracked figures)")
    out = p.parse_args(argv).out
    rows = []
    for name, args in LAYOUTS.items():
        row = run(name, args)
        m0, f0 = row["memory"][0], row["memory_formula_rank0"]
        print(f"{name}: comm {'matches' if row['comm_ok'] else 'DIFFERS FROM'} the formulas; "
              f"rank 0 model states {m0['model_states']:,} B (formula {f0['model_states']:,.0f})")
        rows.append(row)
    write_results("compose5d-cpu.json", dict(machine=cpu_machine() + ", float32, world 4",
                                             rows=rows), out)
    if not all(r["comm_ok"] and r["memory"][0]["model_states"] ==
               r["memory_formula_rank0"]["model_states"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
