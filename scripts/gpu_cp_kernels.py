"""gpu_cp_kernels.py: ring attention's block loop on one device, pure vs fused block kernels,
against fused SDPA on the whole sequence, and against the same kernel called once on the whole
sequence (the loop's own overhead).

    python scripts/gpu_cp_kernels.py OUT [--seq 4096] [--ranks 2,4,8]
    python scripts/gpu_cp_kernels.py OUT --device cpu --seq 1024 --dtypes float32

C virtual ranks in one process (tests/cp_attention_check.py's ring_local: cp_ring's zig-zag
block loop and merge, every rank played in turn, no communication), forward and backward, with
cp_ring's pure torch block kernel and with its fused SDPA kernel (FlashAttention-2 for bf16,
memory-efficient for fp32; the CPU flash kernel on CPU). Errors of (out, dq, dk, dv), max
relative, against float64 attention of the whole sequence; times are medians of 5 calls after
2 warm-ups (CUDA events; wall clock on CPU), forward + backward. Shapes: Llama 3.2 1B's
attention (32 heads, 8 kv heads, d 64), batch 1.

The loop's overhead: each kernel is also called once on the whole sequence (C = 1: one causal
block, the kernel's own forward, merge-free finish and backward), and each loop row records
`over_whole`, its time over that call's. The loop computes only the blocks with causal work
(under zig-zag 2C(2C+1)/2 of the (2C)^2 chunk pairs, about half), the whole call all of them
for the pure kernel (it masks the upper half) and half for the fused ones (they skip it).

--doc-mask N: the rows again on packed documents (harness.data's lengths, Pareto from N tokens):
the loop with cp_ring.set_documents' block masks (tensor masks: every block through the pure
kernel, as the fused ones take none) against SDPA on the whole sequence with the same
block-diagonal causal mask (one call; an explicit mask takes the memory-efficient kernel on
CUDA; FlashAttention's varlen form would take no mask at all).
"""
import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import cp_kernels  # noqa: E402
import cp_ring  # noqa: E402
from cp_attention_check import ring_local  # noqa: E402

H, HKV, D = 32, 8, 64
DEVICE = torch.device("cuda")


def timed(fn, reps=5):
    for _ in range(2):
        res = fn()
    ts = []
    for _ in range(reps):
        if not torch.cuda.is_available() or DEVICE.type != "cuda":
            t = time.perf_counter()
            res = fn()
            ts.append(time.perf_counter() - t)
            continue
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        res = fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return res, sorted(ts)[len(ts) // 2]


def whole(q, k, v, do, scale, kernel):
    """(out, dq, dk, dv) of one call of `kernel` on the whole sequence: one causal block."""
    S, acc = q.shape[2], cp_ring._acc_dtype(q)
    a, l, m = kernel.forward(q, k, v, scale, "mask", (0, S), (0, S), acc)
    out, lse = a / l[..., None], m + torch.log(l)
    do_ = do.to(acc)
    dq, dk, dv = kernel.backward(q, k, v, do_, out, lse, (do_ * out).sum(-1), scale, "mask",
                                 (0, S), (0, S))
    return out.to(q.dtype), dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def sdpa_full(q, k, v, do, scale, mask=None):
    """One SDPA call on the whole sequence, causal or under `mask` (B, S, S), and its grads."""
    leaf = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if mask is None:
        out = cp_kernels.reference_attention(*leaf, scale)
    else:
        r = q.shape[1] // k.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(
            leaf[0], *(t.repeat_interleave(r, 1) for t in leaf[1:]), attn_mask=mask[:, None],
            scale=scale)
    out.backward(do)
    return (out.detach(), *(t.grad for t in leaf))


def doc_rows(x64, scale, a, dev):
    """The loop with packed documents' block masks against one masked SDPA call, per dtype."""
    from harness.data import doc_positions, document_mask
    docs = doc_positions(0, 0, 1, a.seq, a.doc_mask).to(dev)
    mask = document_mask(docs)
    ref, rows = sdpa_full(*x64, scale, mask), []
    n_docs = int((docs == 0).sum())
    for dt in (getattr(torch, n) for n in a.dtypes.split(",")):
        x = [t.to(dt) for t in x64]
        res, t1 = timed(lambda: sdpa_full(*x, scale, mask))
        rows.append(dict(kernel="SDPA, whole sequence, document mask", dtype=str(dt)[6:], C=1,
                         docs=n_docs, err=err(res, ref), ms=t1 * 1e3))
        kern = cp_kernels.pick_kernel("sdpa", dev, dt)[0]
        for C in map(int, a.ranks.split(",")):
            res, t = timed(lambda: ring_local(*x, scale, "zigzag", C, kern, docs))
            rows.append(dict(kernel="ring block loop, document masks (every block a tensor "
                                    "mask: the pure kernel; the fused ones take none)",
                             dtype=str(dt)[6:], C=C, docs=n_docs, err=err(res, ref),
                             ms=t * 1e3, over_whole=t / t1))
            print(f"{str(dt)[6:]:9s} documents ({n_docs}) ring C={C} pure (masks)    err "
                  f"{rows[-1]['err']:.1e}  {t * 1e3:8.2f} ms  x{t / t1:.2f} of one masked "
                  f"call", flush=True)
    return rows


def err(got, ref):
    return max(float((g.double() - r).abs().max() / r.abs().max()) for g, r in zip(got, ref))


def main():
    global DEVICE
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--ranks", default="2,4,8")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--doc-mask", type=int, default=0, metavar="N",
                   help="also on packed documents of at least N tokens (0: no)")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    DEVICE = dev = torch.device(a.device)
    S, scale = a.seq, D ** -0.5
    g = torch.Generator(device=dev).manual_seed(0)
    x64 = [torch.randn(1, h, S, D, generator=g, device=dev, dtype=torch.float64)
           for h in (H, HKV, HKV, H)]
    x64[0] = x64[0] * 2.0                        # logits of a few units, as in a trained model
    ref = sdpa_full(*x64, scale)
    rows = []
    for dt in (getattr(torch, n) for n in a.dtypes.split(",")):
        x = [t.to(dt) for t in x64]
        res, t = timed(lambda: sdpa_full(*x, scale))
        rows.append(dict(kernel="fused SDPA, whole sequence", dtype=str(dt)[6:], C=1,
                         err=err(res, ref), ms=t * 1e3))
        print(f"{str(dt)[6:]:9s} whole-sequence SDPA           err {rows[-1]['err']:.1e}  "
              f"{t * 1e3:8.2f} ms", flush=True)
        sdpa_kernel, why = cp_kernels.pick_kernel("sdpa", dev, dt)
        print(f"          {why}", flush=True)
        kernels = (("pure torch", cp_ring.TorchKernel()), ("fused", sdpa_kernel))
        once = {}
        for label, kern in kernels:
            res, t = timed(lambda: whole(*x, scale, kern))
            once[label] = t
            rows.append(dict(kernel=f"one call on the whole sequence, {label} ({kern.name})",
                             dtype=str(dt)[6:], C=1, err=err(res, ref), ms=t * 1e3))
            print(f"{str(dt)[6:]:9s} one call  {label:10s} {kern.name:15s} err "
                  f"{rows[-1]['err']:.1e}  {t * 1e3:8.2f} ms", flush=True)
        for C in map(int, a.ranks.split(",")):
            for label, kern in kernels:
                res, t = timed(lambda: ring_local(*x, scale, "zigzag", C, kern))
                rows.append(dict(kernel=f"ring block loop, {label} ({kern.name})",
                                 dtype=str(dt)[6:], C=C, err=err(res, ref), ms=t * 1e3,
                                 over_whole=t / once[label]))
                print(f"{str(dt)[6:]:9s} ring C={C} {label:10s} {kern.name:15s} err "
                      f"{rows[-1]['err']:.1e}  {t * 1e3:8.2f} ms  x{t / once[label]:.2f} of "
                      f"one call", flush=True)
    if a.doc_mask:
        rows += doc_rows(x64, scale, a, dev)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else \
        f"CPU, {torch.get_num_threads()} threads"
    with open(os.path.join(a.out, "cp_kernels.json"), "w") as f:
        json.dump(dict(seq=S, heads=H, kv_heads=HKV, head_dim=D, batch=1, device=name,
                       command="python scripts/gpu_cp_kernels.py " + " ".join(sys.argv[1:]),
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
