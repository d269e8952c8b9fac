"""doc_mask_text.py: training on packed documents with and without --doc-mask, at dp 2 x cp 2
(docs/training.md's figures).

    python scripts/doc_mask_text.py [--steps 150] [--out results/doc-mask-text-cpu.json]

scripts/text_demo.py's corpus (Python's standard-library docstrings, one module per document),
its BPE tokenizer and its 6-layer Llama (random weights), then compose4d.py --mode train twice
at dp 2 x cp 2 (W = 4: ZeRO-1 over dp x cp, zig-zag ring attention) with training.md's
pre-training settings (float32, batch 16 x 128 tokens, cosine schedule with 20 warm-up steps,
5% of the modules held out): once attending across the documents a window packs, once with
--doc-mask (each token within its own document, positions restarting after each EOS; the ring
skips the block pairs no query may see). The same data order and steps; the held-out loss every
--eval-every steps, each run measured with its own masks (the objective it trains).
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "doc-mask-text-cpu.json"),
                   help="the results file (default: the temporary directory's; "
                        "results/doc-mask-text-cpu.json updates the tracked figures)")
    a = p.parse_args()
    tmp = tempfile.mkdtemp()
    subprocess.run([sys.executable, os.path.join(HERE, "scripts", "text_demo.py"), tmp],
                   check=True, cwd=HERE, capture_output=True)
    common = ["--mode", "train", "--model", os.path.join(tmp, "llama-init"),
              "--data", os.path.join(tmp, "pretrain.jsonl"), "--val-fraction", "0.05",
              "--dp", "2", "--cp", "2", "--dtype", "float32", "--batch", "16", "--length",
              "128", "--steps", str(a.steps), "--lr", "3e-3", "--lr-schedule", "cosine",
              "--lr-warmup", "20", "--eval-every", str(a.eval_every), "--log-every", "50"]
    runs = []
    for mask in (False, True):
        out = os.path.join(tmp, f"out-{'mask' if mask else 'whole'}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=4", os.path.join(HERE, "compose4d.py"), *common,
               *(["--doc-mask"] if mask else []), "--out", out]
        t0 = time.time()
        r = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        rows = [json.loads(line) for line in open(os.path.join(out, "train.jsonl"))]
        evals = [dict(step=x["step"] + 1, eval_loss=round(x["eval_loss"], 4))
                 for x in rows if "eval_loss" in x]
        train = [x["loss"] for x in rows if "loss" in x]
        runs.append(dict(doc_mask=mask, evals=evals, first_train_loss=round(train[0], 4),
                         last_train_loss=round(train[-1], 4),
                         seconds=round(time.time() - t0, 1)))
        print("doc-mask" if mask else "whole", evals, flush=True)
    import torch
    result = dict(command="python scripts/doc_mask_text.py " + " ".join(sys.argv[1:]),
                  machine=f"{platform.machine()} CPU, {os.cpu_count()} cores, gloo, torch "
                          f"{torch.__version__}",
                  world=4, dtype="float32", layout="compose4d dp 2 x cp 2 (ZeRO-1, zig-zag ring)",
                  data="scripts/text_demo.py: pretrain.jsonl, 5% of its modules held out",
                  model="text_demo's llama-init: 6 layers, hidden 256, ~6M parameters",
                  budget=f"{a.steps} steps x 16 sequences x 128 tokens", runs=runs)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
