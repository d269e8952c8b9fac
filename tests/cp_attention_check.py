"""cp_ring's attention against full causal attention, forward and backward.

    torchrun --nproc_per_node=W tests/cp_attention_check.py --seq S --tol T [--dtype D]
        every variant over a real process group: one PASS/FAIL line per variant.
    python tests/cp_attention_check.py --kernel
        one process plays every rank of the block loop (no communication) on inputs with large
        attention logits and a shared key offset (what a trained model's massive activations
        give), in float32 and float64; cp_ring's errors and torch SDPA's, both against a
        long-double reference. PASS when cp_ring is within --factor of SDPA everywhere.
"""
import argparse
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
import cp_kernels  # noqa: E402
import cp_ring  # noqa: E402
from harness import teardown  # noqa: E402

B, H, HKV = 2, 4, 2                                          # GQA: the ring carries 2 kv heads


def distributed(args):
    dist.init_process_group("gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    D = 8
    q, k, v, do = (torch.randn(B, h, args.seq, D, generator=g, dtype=torch.float64).to(dtype)
                   for h in (H, HKV, HKV, H))
    scale = D ** -0.5
    leaf = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = cp_kernels.reference_attention(*leaf, scale)
    ref.backward(do)
    ok = True
    for variant in ("zigzag", "ring", "allgather"):
        cp = cp_ring.CPContext(variant, None, args.seq)
        pos = cp_ring.positions(cp.chunks[rank])
        mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
        out = cp_ring.cp_attention(*mine, cp, scale)
        out.backward(do[:, :, pos])
        errs = [(out - ref[:, :, pos]).abs().max() / ref.abs().max()]
        errs += [(m.grad - l.grad[:, :, pos]).abs().max() / l.grad.abs().max()
                 for m, l in zip(mine, leaf)]
        err = torch.stack([e.double() for e in errs]).max().reshape(1)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        good = bool(err.item() <= args.tol) and not torch.isnan(err).any()
        ok &= good
        if rank == 0:
            print(f"{'PASS' if good else 'FAIL'} {variant} W={W} S={args.seq} {args.dtype}: "
                  f"max rel err (out, dq, dk, dv) {err.item():.1e} (tol {args.tol:.0e})",
                  flush=True)
    teardown()
    return ok


# ----------------------------------------------------------------------------------------------
# --kernel: the block loop and merge alone, in one process
# ----------------------------------------------------------------------------------------------
def ring_local(q, k, v, do, scale, variant, W, kernel=None, docs=None):
    """(out, dq, dk, dv) from cp_ring's block loop (_attend, _finish, _grad: one kernel call
    per zig-zag step), every rank played in turn with every K/V block at hand: the arithmetic
    of the ring without its transport. kernel: a cp_ring block kernel (default the pure one); docs:
    (B, S) positions in packed documents (cp_ring.set_documents' block masks)."""
    out, dq = torch.empty_like(q), torch.empty_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    cps = [cp_ring.CPContext(variant, None, q.shape[2], world=W, rank=r, kernel=kernel)
           for r in range(W)]
    for cp in cps if docs is not None else ():
        cp_ring.set_documents(cp, docs)
    pos = [cp_ring.positions(cp.chunks[cp.rank]) for cp in cps]
    kvs = [torch.stack([k[:, :, pos[s]], v[:, :, pos[s]]]) for s in range(W)]
    for r, cp in enumerate(cps):
        acc, q_r = {"dtype": cp_ring._acc_dtype(q)}, q[:, :, pos[r]]
        for src in range(W):
            cp_ring._attend(q_r, kvs[src], cp, src, scale, acc)
        o, lse = cp_ring._finish(acc)
        out[:, :, pos[r]] = o.to(q.dtype)
        dt = cp.kernel.operand_dtype(q)
        do_r = do[:, :, pos[r]]
        delta = (do_r.to(o.dtype) * o).sum(-1)
        dq_r = torch.zeros_like(o)
        for src in range(W):
            dkv = torch.zeros_like(kvs[src], dtype=o.dtype)
            cp_ring._grad(q_r, kvs[src], do_r.to(dt), o.to(dt), lse, delta, cp, src, scale,
                          dq_r, dkv)
            dk[:, :, pos[src]] += dkv[0].to(k.dtype)
            dv[:, :, pos[src]] += dkv[1].to(v.dtype)
        dq[:, :, pos[r]] = dq_r.to(q.dtype)
    return out, dq, dk, dv


def sdpa(q, k, v, do, scale):
    leaf = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cp_kernels.reference_attention(*leaf, scale)
    out.backward(do)
    return (out.detach(), *(t.grad for t in leaf))


def exact(q, k, v, do, scale):
    """(out, dq, dk, dv) in long double with the softmax materialised (GQA by repetition)."""
    L = np.longdouble
    q, k, v, do = (t.double().numpy().astype(L) for t in (q, k, v, do))
    n, S = q.shape[1] // k.shape[1], q.shape[2]
    K, V = np.repeat(k, n, axis=1), np.repeat(v, n, axis=1)
    s = np.einsum("bhid,bhjd->bhij", q, K) * L(scale)
    s[..., np.triu(np.ones((S, S), bool), 1)] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = np.einsum("bhid,bhjd->bhij", do, V)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    dK = np.einsum("bhij,bhid->bhjd", ds, q) * L(scale)
    dV = np.einsum("bhij,bhid->bhjd", p, do)
    fold = lambda x: x.reshape(x.shape[0], -1, n, *x.shape[2:]).sum(2)   # noqa: E731
    return (np.einsum("bhij,bhjd->bhid", p, V), np.einsum("bhij,bhjd->bhid", ds, K) * L(scale),
            fold(dK), fold(dV))


def rel_errs(got, ref):
    return [float(np.abs(g.double().numpy().astype(np.longdouble) - r).max() / np.abs(r).max())
            for g, r in zip(got, ref)]


def kernel(args):
    """Largest error over (out, dq, dk, dv) per case; PASS when ring <= factor x SDPA."""
    S, D, scale = 48, 16, 16 ** -0.5
    dtypes = [torch.float32]
    if np.finfo(np.longdouble).eps < 1e-17:   # long double is wider than float64 here
        dtypes.append(torch.float64)
    layouts = [("zigzag", 2), ("zigzag", 3), ("ring", 3)]
    worst, ok = {}, True
    print(f"max rel err over (out, dq, dk, dv) vs long double; B={B} H={H} Hkv={HKV} S={S} "
          f"D={D}; block kernel {args.attn_kernel}; ring/sdpa in brackets")
    for mag in (1, 10, 30):
        for shift in (0.0, 3.0):
            g = torch.Generator().manual_seed(mag)
            q, k, v, do = (torch.randn(B, h, S, D, generator=g, dtype=torch.float64)
                           for h in (H, HKV, HKV, H))
            q, k = q * mag ** 0.5, (k + shift) * mag ** 0.5       # logits ~ mag, shifted keys
            logit = float((q @ cp_kernels._expand(k, H // HKV).transpose(-1, -2)).abs().max()
                          * scale)
            for dt in dtypes:
                x = [t.to(dt) for t in (q, k, v, do)]
                ref = exact(*x, scale)
                base = max(rel_errs(sdpa(*x, scale), ref))
                line = f"|logit| <= {logit:5.0f} key shift {shift:3.1f} {str(dt)[6:]:7s} " \
                       f"sdpa {base:.1e}"
                for variant, W in layouts:
                    kern = cp_kernels.SDPAKernel("cpu", dt) if args.attn_kernel == "sdpa" else None
                    e = max(rel_errs(ring_local(*x, scale, variant, W, kern), ref))
                    r = e / base
                    worst[str(dt)[6:]] = max(worst.get(str(dt)[6:], 0.0), r)
                    ok &= r <= args.factor
                    line += f"  {variant} W={W} {e:.1e} ({r:.2f})"
                print(line, flush=True)
    print(f"{'PASS' if ok else 'FAIL'} kernel: cp_ring's error / SDPA's at most "
          + ", ".join(f"{k} {v:.2f}" for k, v in worst.items()) + f" (limit {args.factor:g})")
    return ok


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--kernel", action="store_true", help="one process: the block loop vs SDPA")
    p.add_argument("--factor", type=float, default=2.0, help="--kernel: allowed error / SDPA's")
    p.add_argument("--attn-kernel", default="torch", choices=["torch", "sdpa"],
                   help="--kernel: cp_ring's block kernel (sdpa: the CPU flash kernel)")
    p.add_argument("--seq", type=int)
    p.add_argument("--dtype", default="float64")
    p.add_argument("--tol", type=float)
    a = p.parse_args()
    if not a.kernel and (a.seq is None or a.tol is None):
        p.error("--seq and --tol are required (or --kernel)")
    sys.exit(0 if (kernel(a) if a.kernel else distributed(a)) else 1)
