"""chunked_ce.py: the chunked cross-entropy (harness/loss.py, --ce-chunk) against the full
logits: the loss's peak memory at a long sequence, and a training step's time on this machine.

    python scripts/chunked_ce.py --out results/chunked-ce-cpu.json

Memory: the loss alone (the head's matmul, the cross-entropy, the backward to the final hidden
states and the head's weight) at S = 16,384 tokens, V = 128,256, H = 2,048 (Llama 3.2 1B's
head), bf16, on FakeTensors (shapes without storage, so a CPU runs it) under harness/memory.py's
live-storage tracker: the peak of the storages the loss creates, beside the formula
(oom_search.py's: full, 12 bytes per logit in bf16: the logits, their float32 upcast, the
log-softmax kept for the backward and the gradient; chunked, the larger of the forward's, one
chunk's logits at 12 bytes each beside the float32 gradients of the hidden states and of the
weight, 4 (S + V) H, and the backward's, those gradients with their scaled bf16 copies,
6 (S + V) H).
Time: a single-device training step (forward, backward, AdamW) of --model on --batch x
--length tokens, full against chunked, one step of each per round, the order reversed every
other round, median and [min, max] of --rounds rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import build_model, load_config, make_adamw  # noqa: E402
from harness.loss import ChunkedCrossEntropy, chunked_loss_sum, lm_loss_sum  # noqa: E402
from harness.memory import MemoryTracker  # noqa: E402


def loss_peak(S: int, V: int, H: int, chunk: int, dtype=torch.bfloat16) -> int:
    """Peak bytes of the storages the loss creates (forward and backward), on FakeTensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        hidden = torch.empty(S, H, dtype=dtype).requires_grad_()
        weight = torch.nn.Parameter(torch.empty(V, H, dtype=dtype))
        labels = torch.zeros(S, dtype=torch.long)
        tracker = MemoryTracker([hidden, weight, labels])
        base = tracker.cur   # (the inputs: counted out)
        with tracker:
            if chunk:
                loss = ChunkedCrossEntropy.apply(hidden, weight, labels, chunk, lm_loss_sum)
            else:
                loss = lm_loss_sum(hidden @ weight.t(), labels)
            (loss / S).backward()
        return tracker.peak - base


def step_times(args) -> dict:
    cfg = load_config(args.model)
    a = SimpleNamespace(model=args.model, dtype="float32", attn="sdpa", seed=0, lr=1e-3,
                        weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.length), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (args.batch, args.length), generator=g)
    runs = {}
    for kind in ("full", "chunked"):
        model = build_model(a, cfg, torch.device("cpu"))
        runs[kind] = (model, make_adamw(model.parameters(), a))

    def step(kind):
        model, opt = runs[kind]
        opt.zero_grad(set_to_none=True)
        t = time.perf_counter()
        ce = (chunked_loss_sum(model, ids, labels, args.chunk) if kind == "chunked" else
              lm_loss_sum(model(input_ids=ids).logits, labels))
        (ce / ids.numel()).backward()
        opt.step()
        return time.perf_counter() - t, ce.item()
    out = {k: [] for k in runs}
    losses: dict = {}
    for r in range(args.rounds + 1):
        for kind in (("full", "chunked") if r % 2 == 0 else ("chunked", "full")):
            dt, loss = step(kind)
            if r:   # round 0 warms up
                out[kind].append(dt)
            losses.setdefault(kind, []).append(loss)
    return dict(model=args.model, batch=args.batch, length=args.length, chunk=args.chunk,
                vocab=cfg.vocab_size, threads=torch.get_num_threads(),
                median_ms={k: 1e3 * statistics.median(v) for k, v in out.items()},
                min_ms={k: 1e3 * min(v) for k, v in out.items()},
                max_ms={k: 1e3 * max(v) for k, v in out.items()},
                ratio=statistics.median(out["chunked"]) / statistics.median(out["full"]),
                max_loss_rel_diff=max(abs(a - b) / abs(a) for a, b in
                                      zip(losses["full"], losses["chunked"])))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--model", default="small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    S, V, H, C = args.seq, args.vocab, args.hidden, args.chunk
    full, chunked = loss_peak(S, V, H, 0), loss_peak(S, V, H, C)
    mem = dict(seq=S, vocab=V, hidden=H, chunk=C, dtype="bfloat16",
               full_peak_bytes=full, chunked_peak_bytes=chunked, ratio=chunked / full,
               full_formula_bytes=12 * S * V,
               chunked_formula_bytes=max(12 * C * V + 4 * (S + V) * H, 6 * (S + V) * H))
    print(f"loss peak, S={S} V={V} H={H} bf16: full {full / 2**30:.2f} GiB (formula "
          f"{mem['full_formula_bytes'] / 2**30:.2f}), chunks of {C}: {chunked / 2**30:.2f} GiB "
          f"(formula {mem['chunked_formula_bytes'] / 2**30:.2f}): {mem['ratio']:.3f} of full")
    t = step_times(args)
    print(f"step, {args.model} {args.batch}x{args.length} float32 CPU {t['threads']} threads, "
          f"chunks of {args.chunk}: full {t['median_ms']['full']:.1f} ms, chunked "
          f"{t['median_ms']['chunked']:.1f} ms, ratio {t['ratio']:.3f} (median of "
          f"{args.rounds}); losses agree to {t['max_loss_rel_diff']:.1e} (float32)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(command="python scripts/chunked_ce.py " + " ".join(sys.argv[1:]),
                           torch=torch.__version__, memory=mem, step=t), f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
