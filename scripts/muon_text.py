"""muon_text.py: Muon against AdamW on real text at the same budget (docs/muon.md's figures).

    python scripts/muon_text.py [--steps 300] [--out results/muon-text-cpu.json]

scripts/text_demo.py's corpus (Python's standard-library docstrings), its BPE tokenizer and its
6-layer Llama (random weights), then compose4d.py --mode train twice with training.md's
pre-training settings (dp 2, float32, batch 16 x 128 tokens, cosine schedule with 20 warm-up
steps, 5% of the modules held out): once with AdamW at --lr 3e-3, once with --optimizer muon
(Muon at --muon-lr 0.02 on the hidden matrices, AdamW at 3e-3 on the rest). The same data
order, the same steps; the held-out loss every --eval-every steps.
"""
import argparse
import json
import os
import platform
import sys
import tempfile

import text_demo



def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "muon-text-cpu.json"),
                   help="the results file (default: the temporary directory's; "
                        "results/muon-text-cpu.json updates the tracked figures)")
    a = p.parse_args()
    tmp = tempfile.mkdtemp()
    text_demo.make(tmp)
    runs = []
    for opt in ("adamw", "muon"):
        run = text_demo.train([*text_demo.pretrain_args(tmp, a.steps, a.eval_every), "--dp", "2",
                               "--optimizer", opt], 2, os.path.join(tmp, f"out-{opt}"))
        runs.append(dict(optimizer=opt, evals=run["evals"],
                         last_train_loss=run["last_train_loss"]))
        print(opt, run["evals"], flush=True)
    import torch
    result = dict(command="python scripts/muon_text.py " + " ".join(sys.argv[1:]),
                  machine=f"{platform.machine()} CPU, {os.cpu_count()} cores, gloo, torch "
                          f"{torch.__version__}",
                  world=2, dtype="float32", layout="compose4d dp 2 (ZeRO-1)",
                  data="scripts/text_demo.py: pretrain.jsonl, 5% of its modules held out",
                  model="text_demo's llama-init: 6 layers, hidden 256, ~6M parameters",
                  budget=f"{a.steps} steps x 16 sequences x 128 tokens",
                  settings=dict(adamw="--lr 3e-3", muon="--optimizer muon --muon-lr 0.02 "
                                                         "(AdamW 3e-3 on the rest)"),
                  runs=runs)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


def table(d) -> str:
    """docs/muon.md's real-text table (scripts/docs.py renders it)."""
    steps = [e["step"] for e in d["runs"][0]["evals"]]
    out = ["| optimizer | " + " | ".join(f"held-out loss at step {s}" for s in steps)
           + " | last train loss |", "|---" * (len(steps) + 2) + "|"]
    for r in d["runs"]:
        name = "AdamW" if r["optimizer"] == "adamw" else "Muon"
        out.append(f"| {name} ({d['settings'][r['optimizer']]}) | "
                   + " | ".join(f"{e['eval_loss']:.3f}" for e in r["evals"])
                   + f" | {r['last_train_loss']:.3f} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
