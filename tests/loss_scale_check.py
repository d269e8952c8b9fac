"""Standalone check, run under torchrun (W >= 2): harness.loss_scale's DynamicLossScaler over
ranks that hold different float16 parameters (as TP's or ZeRO's shards do). Step 1: only the
last rank's gradient overflows; every rank must skip and halve its scale. Step 2: no overflow;
every rank must step, its fp32 master moving as AdamW on the unscaled gradient does. Prints
PASS or FAIL and the reason. --plant-bug NAME switches a planted bug on."""
import argparse
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
from harness import teardown  # noqa: E402
from harness.loss_scale import DynamicLossScaler  # noqa: E402
from harness.plants import planting  # noqa: E402
from harness.precision import make_adamw  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--plant-bug", default=None)
args = p.parse_args()
dist.init_process_group("gloo")
rank, W = dist.get_rank(), dist.get_world_size()
S = 2.0 ** 10
w = torch.nn.Parameter(torch.full((4,), 1.0 + rank, dtype=torch.float16))   # this rank's shard
opt = make_adamw([w], argparse.Namespace(lr=0.1, weight_decay=0.0))
scaler = DynamicLossScaler(init_scale=S, growth_interval=100, group=dist.group.WORLD)
errors = []
with planting(args.plant_bug):
    # step 1: an overflow on the last rank only
    w.grad = torch.full_like(w, 3.0 * S)
    if rank == W - 1:
        w.grad[1] = float("inf")
    stepped = scaler.step(opt)
    if stepped or scaler.scale != S / 2 or not torch.equal(w.detach(), torch.full_like(w, 1 + rank)):
        errors.append(f"overflow on rank {W - 1}: stepped {stepped}, scale {scaler.scale}, "
                      f"weights {w.tolist()} (every rank must skip and halve)")
    # step 2: finite gradients, scaled by the new S
    g = torch.tensor([0.5, -1.0, 2.0, 1e-6])   # (Adam: g / (|g| + eps) feels S at 1e-6)
    w.grad = (g * scaler.scale).half()
    ref_w = torch.nn.Parameter(torch.full((4,), 1.0 + rank))
    ref = torch.optim.AdamW([ref_w], lr=0.1, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
    ref_w.grad = (g * scaler.scale).half().float() / scaler.scale   # what fp32 unscaling gives
    ref.step()
    stepped = scaler.step(opt)
    if not stepped or not torch.allclose(opt.masters[0], ref_w.detach(), rtol=0, atol=1e-6):
        errors.append(f"finite step: stepped {stepped}, master {opt.masters[0].tolist()} vs "
                      f"AdamW on the unscaled gradient {ref_w.tolist()}")
verdicts = [None] * W
dist.all_gather_object(verdicts, errors)
if rank == 0:
    bad = [f"rank {r}: {e}" for r, es in enumerate(verdicts) for e in es]
    print("FAIL " + "; ".join(bad) if bad else f"PASS loss scaler W={W}: skipped together, "
          "unscaled in fp32")
teardown()
