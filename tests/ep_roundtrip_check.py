"""Standalone check, run under torchrun: ep_moe's dispatch then combine, with experts that
multiply their rows by (global expert id + 1) (identity when --identity), on integer-valued
tokens, so every expected value is exact. Forward and backward, dropless and with capacity.
Prints one PASS/FAIL line per case."""
import argparse
import sys
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
import ep_moe  # noqa: E402
from harness import teardown  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--experts", type=int, default=8)
p.add_argument("--tokens", type=int, default=37)            # per rank; uneven splits
args = p.parse_args()
dist.init_process_group("gloo")
rank, W = dist.get_rank(), dist.get_world_size()
E, k, H, N = args.experts, 2, 6, args.tokens
g = torch.Generator().manual_seed(rank)
x = torch.randint(-50, 50, (N, H), generator=g).double()
# skewed routing: expert 0 is everyone's favourite, so the all-to-all splits are uneven
idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
idx[: N // 2, 0] = 0
idx[: N // 2, 1] = torch.where(idx[: N // 2, 1] == 0, 1, idx[: N // 2, 1])
w = torch.full((N, k), 0.5, dtype=torch.float64)


class Scale(torch.nn.Module):
    """Local expert e multiplies its rows by (first + e + 1); identity when first is None."""
    def __init__(self, first):
        super().__init__()
        self.first = first

    def forward(self, rows, counts, device_counts=None):
        if self.first is None:
            return rows * 1.0
        f = torch.cat([torch.full((n,), float(self.first + e + 1), dtype=rows.dtype)
                       for e, n in enumerate(counts)])
        return rows * f[:, None]


hf = types.SimpleNamespace(gate=types.SimpleNamespace(num_experts=E, weight=torch.zeros(E, H)),
                           top_k=k, experts=types.SimpleNamespace(
                               gate_up_proj=torch.zeros(E, 2, H), down_proj=torch.zeros(E, H, 1),
                               act_fn=None))
opts = types.SimpleNamespace(aux_free_bias=False, capacity_factor=None, z_coef=0.0)
ok = True
for case in ("identity", "scaled", "capacity"):
    blk = ep_moe.ExpertParallelMoE(hf, [], opts, None)
    blk.experts = Scale(None if case == "identity" else rank * (E // W))
    keep, rec = None, {}
    if case == "capacity":
        cap = ep_moe.expert_capacity(0.75, N * W, k, E)
        counts = blk.gather_counts(F.one_hot(idx, E).sum(0))
        keep, rec["kept_all"] = ep_moe.capacity_keep(idx, counts, rank, cap)
    xi = x.clone().requires_grad_()
    out = blk.dispatch_combine(xi, w, idx, keep, rec)
    factor = (idx + 1).double() if case != "identity" else torch.ones(N, k, dtype=torch.float64)
    if keep is not None:
        factor = factor * keep
    expect = 0.5 * factor.sum(1, keepdim=True) * x
    gout = torch.randint(-9, 9, (N, H), generator=g).double()
    out.backward(gout)
    good = torch.equal(out, expect) and torch.equal(xi.grad, 0.5 * factor.sum(1, keepdim=True) * gout)
    dropped = 0 if keep is None else int((~keep).sum())
    print(f"{'PASS' if good else 'FAIL'} rank {rank} W={W} {case}: rows {N * k - dropped} "
          f"(dropped {dropped}) max |out - expected| {(out - expect).abs().max().item():.1e}",
          flush=True)
    ok &= good
teardown()
sys.exit(0 if ok else 1)
