"""The test rig for fsdp.py: its adapter, constraints, plants and baselines (rig/__init__.py)."""
import math
import warnings

import torch

from harness import (Expect, METER, Plant, Strategy, global_loss, parts, phase, ranks_per_node,
                     spread_across_ranks, uneven_nodes)
from harness.precision import LOW_PRECISION, adamw_kwargs, grad_reduce_dtype, muon_kwargs
from harness.cli import main as harness_main

import ddp
import fp8
import muon
from trainer4d.comm import owner_comm
from fsdp import MixedPrecisionPolicy, collectives_per_unit, fully_shard, hsdp_groups
from fsdp_state import clip_grad_norm_, full_tensors, units

from rig.ddp import (AmaxLog, DDP, MUON_PLANT, batch_constraints,
                     data_parallel_micro_rows, fp8_data_parallel)
from rig.zero import TorchFSDP2


# ----------------------------------------------------------------------------------------------
# Harness adapter
# ----------------------------------------------------------------------------------------------
def fsdp_constraints(args, world, config) -> list[str]:
    errs = batch_constraints(args, world)
    if args.prefetch < 0:
        errs.append(f"--prefetch must be >= 0 (got {args.prefetch})")
    if args.replicate is not None and (args.replicate < 1 or world % args.replicate):
        errs.append(f"--replicate {args.replicate}: the replicas must divide world size {world} "
                    f"(HSDP shards over W / R ranks)")
    if getattr(args, "fp8_all_gather", False) and args.fp8 != "tensorwise":
        errs.append(f"--fp8-all-gather casts each weight with one scale: with --fp8 tensorwise "
                    f"(got --fp8 {args.fp8})")
    if args.replicate is None and uneven_nodes(world):
        errs.append(f"HSDP's default --replicate (one per node): {uneven_nodes(world)}; give "
                    f"--replicate R")
    return errs


def replicas(args, world: int) -> tuple[int, str | None]:
    """(R, a line saying where it came from): --replicate, or one replica per node of the
    launcher's layout (torchrun --nnodes M: R = M, each shard group one node's ranks)."""
    if args.replicate is not None:
        return args.replicate, None
    n = ranks_per_node(world)
    if n is None:
        return 1, None
    return world // n, (f"HSDP: --replicate {world // n} from the launcher's layout ({world // n} "
                        f"nodes of {n} ranks, LOCAL_WORLD_SIZE)")


class FSDP(Strategy):
    """fully_shard on each decoder layer and on the model, and a plain torch.optim.AdamW over
    model.parameters(): the loop a user writes. In bf16 runs the shards are fp32 masters (the
    reference's, exactly) under MixedPrecisionPolicy(bf16, the run's reduce dtype)."""
    convert_fp8 = staticmethod(fp8.convert)
    fp8_amax_log = AmaxLog   # every rank runs every FP8 linear: its amaxes, bit for bit
    fp8_micro_rows = staticmethod(data_parallel_micro_rows)   # (--grad-accum K)
    fp8_benchmark = True   # its formulas count the amax all-reduces and the FP8 all-gather
    name = "fsdp"
    optimizers = ("adamw", "muon")   # muon.py's owner mode on the shards (muon.build)
    lora = True
    doc_mask = True
    muon_modes = ("auto", "owner")
    syncs_initial_params = True   # fully_shard broadcasts rank 0's parameters and buffers
    # One configuration catches the first three: float32 + --clip for the scale, --grad-accum 2
    # for the accumulation without sync; the stale root shows from the second step on.
    _ACCUM_CLIP = ("--grad-accum", "2", "--dtype", "float32", "--clip", "0.5")
    plants = {
        "no-average": Plant("the reduce-scatter sums the gradients instead of averaging them "
                            "(2x at W=2; clipping would hide it)", _ACCUM_CLIP),
        "sync-drops-accumulated": Plant("the last micro-batch's reduce-scatter carries its own "
                                        "gradient only, not those accumulated without sync",
                                        _ACCUM_CLIP),
        "root-stays-gathered": Plant("the root is not freed after the backward: the next "
                                     "forward uses stale embeddings and head", _ACCUM_CLIP),
        "no-regather": Plant("the backward re-allocates a resharded unit's parameters without "
                             "all-gathering them (bf16: the policy's compute copies)",
                             ("--dtype", "bfloat16", "--grad-accum", "2")),
        "shard-rows": Plant("rank r's shard starts at row r floor(d0 / W), not r ceil(d0 / W): "
                            "shards overlap where W does not divide d0", ("--batch", "6"),
                            world=3),
        "muon-owner-keeps-update": Plant(
            "--optimizer muon: the owners' Newton-Schulz results are not sent back to the "
            "ranks holding the other rows", MUON_PLANT),
        "fp8-gather-shard-amax": Plant("--fp8-all-gather: each rank casts its rows of a weight "
                                        "with its own rows' amax, not the whole weight's",
                                        ("--fp8", "tensorwise", "--fp8-all-gather",
                                         "--dtype", "float64")),
        "replicas-not-averaged": Plant("HSDP: the reduced shards are not all-reduced over the "
                                       "replicas: each steps on its half of the batch",
                                       ("--replicate", "2"), world=4),
    }

    @staticmethod
    def add_args(p):
        p.add_argument("--prefetch", type=int, default=1,
                       help="units whose all-gather is launched ahead of use")
        p.add_argument("--no-reshard-after-forward", action="store_true",
                       help="keep full parameters from the forward to the backward (ZeRO-2)")
        p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
        p.add_argument("--replicate", type=int, default=None,
                       help="HSDP: R replicas, each sharded over W / R ranks (default: one per "
                            "node of the launcher's layout, so 1 on one node)")
        p.add_argument("--fp8-all-gather", action="store_true",
                       help="with --fp8 tensorwise: all-gather the converted weights in e4m3 "
                            "(fp8.gather_in_fp8), 1 byte per element")

    constraints = staticmethod(fsdp_constraints)

    def __init__(self, model, args, env):
        self.args, self.env, self.model = args, env, model
        fp8_data_parallel(model, args)
        if args.fp8_all_gather:
            fp8.gather_in_fp8(model)
        group = replicate = None
        args.replicate, line = replicas(args, env.world)
        if line and env.is_main:
            print(line, flush=True)
        if args.replicate > 1:
            group, replicate = hsdp_groups(args.replicate)
        self.dtype = dtype = next(model.parameters()).dtype
        mp = None
        if dtype in LOW_PRECISION:   # fp32 masters: the bf16 weights, exactly, as the reference's
            with torch.no_grad():
                for p in model.parameters():
                    p.data = p.data.float()
            mp = MixedPrecisionPolicy(dtype, grad_reduce_dtype(dtype, args))
        kw = dict(group=group, replicate_group=replicate, mp_policy=mp, prefetch=args.prefetch,
                  reshard_after_forward=False if args.no_reshard_after_forward else None)
        for layer in (parts(model).layers or []):
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        self.units = units(model)
        params = list(model.parameters())
        if args.optimizer == "muon":   # muon.py's owner mode on the dim-0 shards (fp32 masters)
            self.optimizer = muon.build(model, args.lr, args.muon_lr, **muon_kwargs(args, dtype))
        else:
            self.optimizer = torch.optim.AdamW(params, **adamw_kwargs(params, self.args))

    def step(self, batch) -> float:
        for u in self.units:
            u.copies = {}
        self.optimizer.zero_grad(set_to_none=True)
        local_sum = ddp.forward_backward(self.model, batch, self.env.rank, self.env.world,
                                         self.args.grad_accum,
                                         self.model.set_requires_gradient_sync)
        with phase("optimizer"):
            if self.args.clip:
                self.grad_norm = clip_grad_norm_(self.model, self.args.clip)
            self.optimizer.step()
        if METER.active:   # the copies in and out of the buffers, beside the collectives
            for u in self.units:
                for kind, (n, nbytes) in u.copies.items():
                    c = METER.counts.setdefault((kind, "local"), [0, 0])
                    c[0], c[1] = c[0] + n, c[1] + nbytes
        return global_loss(local_sum, batch.n_tokens)

    def full_grads(self):
        return full_tensors(self.model, "grad")

    def full_params(self):   # the masters in the run's dtype: what the reference's module holds
        return {n: t.to(self.dtype) for n, t in full_tensors(self.model, "param").items()}

    def extra_checks(self):
        """HSDP: the replicas must hold the same shards (the reference sees replica 0 only)."""
        u = self.units[0]
        if u.replicate is None:
            return []
        spread = spread_across_ranks(list(self.model.parameters()), u.replicate)
        return [("HSDP replicas hold identical shards", spread == 0.0, f"max spread {spread:.1e}")]

    def sizes(self) -> dict[str, int]:
        """Elements: gathered per pass (Psi: the padded buffers) and of it the resharded units',
        reduced (Psi_g); this rank's shards (all, trainable)."""
        us, W = self.units, self.units[0].world
        return dict(psi=sum(W * u.shard_numel for u in us),
                    psi_g=sum(W * sum(p.padded for p in u.trainable) for u in us),
                    resharded=sum(W * u.shard_numel for u in us if u.reshard_after_forward),
                    shard=sum(p.local for u in us for p in u.params),
                    shard_g=sum(p.local for u in us for p in u.trainable))

    def expected_comm(self):
        u0, K, us = self.units[0], self.args.grad_accum, self.units
        g = "shard" if u0.replicate is not None else "world"   # HSDP: inside a shard group
        s, W, b, rb = self.sizes(), u0.world, u0.dtype.itemsize, u0.reduce_dtype.itemsize
        per_unit = [collectives_per_unit(u.reshard_after_forward, K) for u in us]  # fsdp.py's
        calls = sum(ag for _, ag in per_unit)
        wire = [sum(p.padded * (1 if p.cast else b) for p in u.params) for u in us]  # bytes
        gathered = sum(ag * W * n for (_, ag), n in zip(per_unit, wire))
        n_rs = sum(rs for (rs, _), u in zip(per_unit, us) if u.trainable)
        rows = [Expect("all_gather_into_tensor", g, calls, gathered,
                       f"forward Psi*b = {s['psi'] * b:,} B"
                       + (f" (FP8 all-gather: {sum(wire) * W:,} B, the cast weights at 1 B)"
                          if self.args.fp8_all_gather else "") + "; backward (Psi - Psi_root)*b"
                       + ("" if s["resharded"] else " (none: no resharding)")
                       + (f"; x{K} micro-batches" if K > 1 else "")),
                Expect("reduce_scatter_tensor", g, n_rs, s["psi_g"] * rb,
                       f"Psi_g*b_reduce = {s['psi_g'] * rb:,} B, once per step"),
                Expect("all_gather copy-in", "local", calls, gathered // W,
                       "Psi*b/W per gather (FP8 all-gather: 1 B per cast element)"),
                Expect("all_gather copy-out", "local", calls, gathered, "Psi*b per gather"),
                Expect("reduce_scatter copy-in", "local", n_rs, s["psi_g"] * rb,
                       "Psi_g*b_reduce (padded)"),
                Expect("reduce_scatter copy-out", "local",
                       sum(len(u.trainable) for u in us),
                       s["shard_g"] * u0.params[0].sharded.element_size(),
                       "this rank's unpadded gradient rows, in the shards' dtype")]
        if u0.replicate is not None:
            rows.append(Expect("all_reduce", "replicate", n_rs, s["psi_g"] * rb // W,
                               f"HSDP: each reduced shard over the {u0.replicas} replicas, "
                               f"Psi_g*b_reduce/S = {s['psi_g'] * rb // W:,} B"))
        reduce = {}   # all-reduces by group: [calls, bytes, formula]
        if self.args.clip:
            reduce[g] = [1, 8, "clip: squared-norm sum (fp64)"]
        if self.args.fp8:   # tensorwise (cli), one micro-batch (rig.ddp): scalar amaxes, MAX
            a = 8 if self.dtype == torch.float64 else 4
            n = sum(isinstance(m, fp8.Float8Linear) for m in self.model.modules())
            c, nb, f = reduce.setdefault("world", [0, 0, ""])
            reduce["world"] = [c + 2 * n, nb + 2 * n * a, f + f"; fp8: x and dy amax of {n} "
                               f"linears over the tokens' ranks"]
            casts = sum(1 for u in us for p in u.params if p.cast)
            if casts:   # fp8.precompute_scales
                c, nb, f = reduce.setdefault(g, [0, 0, ""])
                reduce[g] = [c + 1, nb + casts * a, f + f"; FP8 all-gather: the {casts} weights' "
                             f"amaxes at the model's forward"]
        rows += [Expect("all_reduce", k, c, nb, f.lstrip("; ")) for k, (c, nb, f) in reduce.items()]
        plan = getattr(self.optimizer, "orthogonalize", None)
        if isinstance(plan, muon.OwnerPlan):   # muon.py's owner: 2 all-to-alls
            rows.append(Expect("all_to_all_single", g, *owner_comm(plan, plan.like.element_size()),
                               "Muon's owner mode: this rank's rows of each matrix to its "
                               "owner, the owned matrices' results back"))
        return rows

    def memory_formula(self) -> dict[str, float]:
        """16 bytes per fp32 shard element with AdamW: shard, gradient, m, v (no extra master:
        the shard is the master), and torch's 4-byte step count per parameter; Muon's matrices
        keep one momentum buffer and no step count."""
        e = self.units[0].params[0].sharded.element_size()
        s = self.sizes()
        mats = [p for g in self.optimizer.param_groups if g.get("muon") for p in g["params"]]
        n = sum(len(u.trainable) for u in self.units) - len(mats)
        m = sum(p.numel() for p in mats)
        states = {"params": s["shard"] * e, "grads": s["shard_g"] * e,
                  "optimizer": (2 * (s["shard_g"] - m) + m) * e + 4 * n}
        return {**states, "model_states": sum(states.values())}

    def report_lines(self):
        s, W = self.sizes(), self.units[0].world
        numel = sum(math.prod(p.shape) for u in self.units for p in u.params)
        return [f"per-parameter shards: {len(self.units)} units, {numel:,} parameters; buffers "
                f"padded to {s['psi']:,} (+{s['psi'] - numel} for dim-0 chunks of W={W}); "
                f"this rank's shards {s['shard']:,}"]


FSDP.native = [TorchFSDP2, DDP]   # PyTorch's FSDP2 on the same units, and our DDP


def main():
    """`torchrun fsdp.py --mode ...`: fsdp.py's __main__ lands here."""
    warnings.filterwarnings("ignore", message=".*FSDP.*")
    harness_main(FSDP)
