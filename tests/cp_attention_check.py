"""Standalone check, run under torchrun: cp_ring's attention against full causal attention,
forward and backward, for every variant. Prints one PASS/FAIL line per variant."""
import argparse
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
import cp_ring  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--seq", type=int, required=True)
p.add_argument("--dtype", default="float64")
p.add_argument("--tol", type=float, required=True)
args = p.parse_args()
dist.init_process_group("gloo")
rank, W = dist.get_rank(), dist.get_world_size()
dtype = getattr(torch, args.dtype)
g = torch.Generator().manual_seed(0)
B, H, HKV, D = 2, 4, 2, 8                                   # GQA: the ring carries 2 kv heads
q, k, v, do = (torch.randn(B, h, args.seq, D, generator=g, dtype=torch.float64).to(dtype)
               for h in (H, HKV, HKV, H))
scale = D ** -0.5
leaf = [t.clone().requires_grad_() for t in (q, k, v)]
ref = cp_ring.reference_attention(*leaf, scale)
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
              f"max rel err (out, dq, dk, dv) {err.item():.1e} (tol {args.tol:.0e})", flush=True)
dist.barrier()
dist.destroy_process_group()
sys.exit(0 if ok else 1)
