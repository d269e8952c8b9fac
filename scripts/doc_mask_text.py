"""doc_mask_text.py: training on packed documents with and without --doc-mask, at dp 2 x cp 2
(docs/training.md's figures).

    python scripts/doc_mask_text.py [--steps 150] [--out results/doc-mask-text-cpu.json]

scripts/text_demo.py's corpus (Python's standard-library docstrings, one module per document),
its BPE tokenizer and its 6-layer Llama (random weights), then compose4d.py --mode train twice
at dp 2 x cp 2 (W = 4: ZeRO-1 over dp x cp, zig-zag ring attention) with training.md's
pre-training settings (text_demo.pretrain_args): once attending across the documents a window
packs, once with --doc-mask (each token within its own document, positions restarting after
each EOS; the ring skips the block pairs no query may see). The same data order and steps; the
held-out loss every --eval-every steps, each run measured with its own masks (the objective it
trains).
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
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "doc-mask-text-cpu.json"),
                   help="the results file (default: the temporary directory's; "
                        "results/doc-mask-text-cpu.json updates the tracked figures)")
    a = p.parse_args()
    tmp = tempfile.mkdtemp()
    text_demo.make(tmp)
    runs = []
    for mask in (False, True):
        args = [*text_demo.pretrain_args(tmp, a.steps, a.eval_every), "--dp", "2", "--cp", "2",
                *(["--doc-mask"] if mask else [])]
        run = text_demo.train(args, 4, os.path.join(tmp, f"out-{'mask' if mask else 'whole'}"))
        runs.append(dict(doc_mask=mask, **run))
        print("doc-mask" if mask else "whole", run["evals"], flush=True)
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
