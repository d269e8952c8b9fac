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
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "muon-text-cpu.json"),
                   help="the results file (default: the temporary directory's; "
                        "results/muon-text-cpu.json updates the tracked figures)")
    a = p.parse_args()
    tmp = tempfile.mkdtemp()
    subprocess.run([sys.executable, os.path.join(HERE, "scripts", "text_demo.py"), tmp],
                   check=True, cwd=HERE, capture_output=True)
    common = ["--mode", "train", "--model", os.path.join(tmp, "llama-init"),
              "--data", os.path.join(tmp, "pretrain.jsonl"), "--val-fraction", "0.05",
              "--dp", "2", "--dtype", "float32", "--batch", "16", "--length", "128",
              "--steps", str(a.steps), "--lr", "3e-3", "--lr-schedule", "cosine",
              "--lr-warmup", "20", "--eval-every", str(a.eval_every), "--log-every", "50"]
    runs = []
    for opt in ("adamw", "muon"):
        out = os.path.join(tmp, f"out-{opt}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", os.path.join(HERE, "compose4d.py"), *common,
               "--optimizer", opt, "--out", out]
        r = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        rows = [json.loads(line) for line in open(os.path.join(out, "train.jsonl"))]
        evals = [dict(step=x["step"] + 1, eval_loss=round(x["eval_loss"], 4))
                 for x in rows if "eval_loss" in x]
        train = [x["loss"] for x in rows if "loss" in x]
        runs.append(dict(optimizer=opt, evals=evals, last_train_loss=round(train[-1], 4)))
        print(opt, evals, flush=True)
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
