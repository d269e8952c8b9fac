"""The test rig for zero.py: its adapter, constraints, plants and baselines (rig/__init__.py)."""
import torch

from harness import (Batch, DTensorBaseline, Expect, Plant, Strategy, full_tensor, global_loss,
                     make_adamw, parts, phase)
from harness.precision import adamw_kwargs, grad_reduce_dtype, muon_kwargs
from harness.cli import main as harness_main
import fp8
import muon
from trainer4d.comm import owner_comm

import ddp
from zero import Zero, ZeroOptimizer, collectives_per_unit
from zero_units import backward_gathers, outside_units, reduce_scattered, state_bytes

from rig.ddp import (AmaxLog, MUON_PLANT, TorchDDP, batch_constraints,
                     data_parallel_micro_rows, fp8_data_parallel)


def optimizer_on_shards(model, engine: Zero, args) -> ZeroOptimizer:
    """The harness's AdamW (the reference's hyperparameters) on an engine's shards, or
    muon.py's MuonAdamW with --optimizer muon (its owner or gather mode, --muon-mode)."""
    params = list(model.parameters())
    if args.optimizer == "muon":
        groups = muon.param_groups(model.named_parameters(), args.lr, args.muon_lr)
        return ZeroOptimizer(groups, muon.MuonAdamW, engine=engine,
                             **muon_kwargs(args, params[0].dtype))
    return ZeroOptimizer(params, torch.optim.AdamW, engine=engine,
                         **adamw_kwargs([u.shard for u in engine.units] or params, args))


def zero_constraints(args, world, config) -> list[str]:
    errs = batch_constraints(args, world)
    if args.stage not in (1, 2, 3):
        errs.append(f"--stage must be 1, 2 or 3 (got {args.stage})")
    if getattr(args, "prefetch", 0) < 0:
        errs.append(f"--prefetch must be >= 0 (got {args.prefetch})")
    return errs


def muon_lines(opt) -> list[str]:
    """Muon's owner mode: how evenly the matrices' Newton-Schulz FLOPs fall on the ranks."""
    plan = getattr(getattr(opt, "inner", None), "orthogonalize", None)
    if not isinstance(plan, muon.OwnerPlan):
        return []
    f, total = plan.flops, sum(plan.flops)
    return [f"Muon owner mode: {len(plan.mats)} matrices, Newton-Schulz FLOPs per rank "
            f"{', '.join(f'{x / 1e6:.1f}M' for x in f)} (max/mean {max(f) * len(f) / total:.3f}; "
            f"gather would run {muon_gather_flops(plan) / 1e6:.1f}M on rank 0)"]


def muon_gather_flops(plan) -> int:
    """rank 0's Newton-Schulz FLOPs in the gather mode: every matrix its shard touches."""
    return sum(muon.ns_flops(m.param.shape) for m in plan.mats if m.offset < m.unit.shard_numel)


class ZeRO(Strategy):
    convert_fp8 = staticmethod(fp8.convert)
    fp8_amax_log = AmaxLog   # every rank runs every FP8 linear: its amaxes, bit for bit
    fp8_micro_rows = staticmethod(data_parallel_micro_rows)   # (--grad-accum K)
    name = "zero"
    optimizers = ("adamw", "muon")   # muon.py: optimizer_on_shards builds it
    lora = True
    doc_mask = True
    muon_modes = ("auto", "owner", "gather")
    syncs_initial_params = False
    # One configuration catches the first four (stage 2: accumulation; float32 + --clip: the
    # norm and the scale); the misaligned shard needs W=3 (at W=2 no tiny unit is padded).
    _ACCUM_CLIP = ("--stage", "2", "--grad-accum", "2", "--dtype", "float32", "--clip", "0.5")
    plants = {
        "muon-owner-keeps-update": Plant(
            "--optimizer muon, owner mode: the owners' Newton-Schulz results are not sent back "
            "to the ranks holding the pieces", MUON_PLANT),
        "muon-no-gather": Plant(
            "--optimizer muon: Newton-Schulz on the matrix with only this rank's shard of the "
            "update (zeros elsewhere) instead of the gathered whole",
            (*MUON_PLANT, "--muon-mode", "gather")),
        "lora-base-in-units": Plant("--lora: the frozen base shares the adapters' units, its "
                                    "zero gradients reduce-scattered with theirs",
                                    ("--stage", "2", "--lora", "4")),
        "no-average": Plant("the reduce-scatter sums the gradients instead of averaging "
                            "them (2x at W=2; clipping would hide it)", _ACCUM_CLIP),
        "overwrite-accum": Plant("stages 2/3 overwrite the reduced gradient shard with "
                                 "each micro-batch's instead of accumulating it", _ACCUM_CLIP),
        "clip-local-norm": Plant("clipping by the rank's shard norm: the squared norms "
                                 "are not all-reduced", _ACCUM_CLIP),
        "no-param-gather": Plant("stages 1/2 skip the all-gather of the updated shards: "
                                 "the next forward runs on stale parameters", _ACCUM_CLIP),
        "shard-offset": Plant("a rank's shard starts at rank * (numel // W), the "
                              "unpadded size: misaligned when W does not divide a unit",
                              ("--batch", "6"), world=3),
    }

    @staticmethod
    def add_args(p):
        p.add_argument("--stage", type=int, default=1, help="ZeRO stage: 1, 2 or 3")
        p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
        p.add_argument("--prefetch", type=int, default=1,
                       help="stage 3: units whose all-gather is launched ahead of use")
        p.add_argument("--sync-param-gather", action="store_true",
                       help="stages 1, 2: all-gather the updated parameters inside the step "
                            "(default: async, each unit's forward waits for its own)")

    constraints = staticmethod(zero_constraints)

    def __init__(self, model, args, env):
        self.args, self.env, self.model = args, env, model
        fp8_data_parallel(model, args)
        self.name = f"zero{args.stage}"
        self.zero = self.make_engine(
            model, stage=args.stage, prefetch=args.prefetch,
            reduce_dtype=grad_reduce_dtype(next(model.parameters()).dtype, args),
            overlap_param_gather=not args.sync_param_gather)
        self.optimizer = optimizer_on_shards(model, self.zero, args)

    def make_engine(self, model, **kw) -> Zero:
        return Zero(model, **kw)   # (zeropp.py: ZeRO++'s)

    def step(self, batch: Batch) -> float:
        opt = self.optimizer
        opt.zero_grad(set_to_none=False)
        def set_sync(last):   # stage 1: the last micro-batch's backward reduce-scatters
            self.zero.sync = last
        local_sum = ddp.forward_backward(self.model, batch, self.env.rank, self.env.world,
                                         self.args.grad_accum, set_sync)
        self.zero.sync = False
        with phase("backward"):
            opt.reduce_gradients()
        with phase("optimizer"):
            if self.args.clip:
                self.grad_norm = opt.clip_grad_norm_(self.args.clip)
            opt.step()
        return global_loss(local_sum, batch.n_tokens)

    def wait_comm(self):
        self.zero.wait_params()

    def full_grads(self):
        return self.zero.full_tensors("grad")

    def full_params(self):
        return self.zero.full_tensors("param")

    def model_states(self):
        return {"params": [u.shard if self.args.stage == 3 else u.full for u in self.zero.units]
                + outside_units(self.zero),   # (--lora: the frozen base at stages 1, 2)
                "grads": self.zero.grad_tensors(), "optimizer": self.optimizer.state_tensors()}

    def report_lines(self):
        numel, padded = self.psi()
        return [f"flat buffers: {len(self.zero.units)} units, {numel:,} parameters padded to "
                f"{padded:,} (+{padded - numel} for divisibility by W={self.env.world}); "
                f"shard per rank {padded // self.env.world:,}"] + muon_lines(self.optimizer)

    def psi(self) -> tuple[int, int]:
        """(parameters, padded parameters)."""
        return (sum(u.numel for u in self.zero.units), sum(u.padded for u in self.zero.units))

    def expected_comm(self):
        """The textbook traffic (the docstring's formulas)."""
        z, K = self.zero, self.args.grad_accum
        _, padded = self.psi()
        b, n = z.units[0].full.element_size(), len(z.units)
        # --lora: only the trainable parameters reduce (stage 3 gathers the frozen ones too,
        # in units of their own)
        n_rs, padded_rs = reduce_scattered(z.units)
        rb = z.units[0].grad_shard.element_size()   # the reduce dtype's
        rs_times, ag_times = collectives_per_unit(self.args.stage, K)   # zero.py's formula
        full = padded * b
        calls = nbytes = 0
        owner = getattr(self.optimizer.inner, "orthogonalize", None)
        mb = self.optimizer.masters[0].element_size()
        if isinstance(owner, muon.OwnerPlan):   # muon.py's owner: 2 all-to-alls
            owner = Expect("all_to_all_single", "world", *owner_comm(owner, mb),
                           "Muon's owner mode: this rank's pieces of each matrix to its owner, "
                           "the owned matrices' results back")
        elif self.args.optimizer == "muon":      # its gather: the updates, per unit
            owner = None
            calls, nbytes = muon.gather_comm(
                [u.padded for _, u in muon.matrix_units(self.optimizer)], mb)
        muon_note = (f" + Muon's gather of the updates: {calls} units holding a matrix, "
                     f"{nbytes:,} B" if calls else "")
        # a world of one reduces nothing, and its shards (stages 1, 2) are the buffers themselves
        one = self.env.world == 1
        rows = [] if one else [Expect(
            "reduce_scatter_tensor", "world", n_rs * rs_times, padded_rs * rb * rs_times,
            f"Psi*b_reduce = {padded_rs * rb:,} B per reduction, one per unit"
            + (" with gradients" if n_rs < n else "") + f" ({n_rs})"
            + (f", x{K} micro-batches" if rs_times > 1 else ""))]
        if self.args.stage < 3:
            if calls or not one:
                rows.append(Expect("all_gather_into_tensor", "world",
                                   n * ag_times * (not one) + calls,
                                   full * ag_times * (not one) + nbytes,
                                   f"Psi*b = {full:,} B: updated parameters, one per unit"
                                   + muon_note))
        else:   # forward per unit; backward from the first unit that trains on (LoRA)
            nb, fb = backward_gathers(z.units, self.model)
            fb *= b
            rows.append(Expect("all_gather_into_tensor", "world", (n + nb) * K + calls,
                               (full + fb) * K + nbytes,
                               "2 Psi*b: forward + backward gather per unit"
                               + (" (none backward before the first unit that trains)"
                                  if nb < n else "")
                               + (f", x{K} micro-batches" if K > 1 else "") + muon_note))
        if isinstance(owner, Expect):
            rows.append(owner)
        if self.args.clip:
            rows.append(Expect("all_reduce", "world", 1, 8, "clip: squared-norm sum (fp64)"))
        return rows

    def memory_formula(self) -> dict[str, float]:
        return state_bytes(self.zero, self.optimizer)


# the baselines (--compare-native): PyTorch's own ZeRO-1 and FSDP2
class TorchZeRO1(TorchDDP):
    """PyTorch's ZeroRedundancyOptimizer (AdamW state sharded by whole parameters, each rank
    updating and broadcasting its own) over torch DDP, on the same data and loss scaling."""
    name = "torch-zero1"
    constraints = staticmethod(zero_constraints)

    def __init__(self, model, args, env):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        super().__init__(model, args, env)
        g = self.optimizer.param_groups[0]   # make_adamw's hyper-parameters, the reference's
        self.optimizer = ZeroRedundancyOptimizer(
            list(model.parameters()), optimizer_class=torch.optim.AdamW, lr=g["lr"],
            weight_decay=g["weight_decay"], betas=g["betas"], eps=g["eps"])

    def model_states(self):
        local = [v for s in self.optimizer.optim.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
        return {"params": list(self.model.parameters()),
                "grads": [p.grad for p in self.model.parameters()], "optimizer": local}


class TorchFSDP2(DTensorBaseline):
    """PyTorch's FSDP2 (fully_shard) on each decoder layer and the root (fsdp.py's units too)."""
    name = "torch-fsdp2"

    def __init__(self, model, args, env):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        self.args, self.env, self.model = args, env, model
        mesh = init_device_mesh(env.device.type, (env.world,))
        reshard = not getattr(args, "no_reshard_after_forward", False)   # (zero.py: absent)
        for layer in parts(model).layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        self.optimizer = make_adamw(model.parameters(), args)

    def step(self, batch):
        self.optimizer.zero_grad(set_to_none=True)
        local_sum = ddp.forward_backward(   # FSDP2's switch: reduce-scatter in this backward?
            self.model, batch, self.env.rank, self.env.world, self.args.grad_accum,
            self.model.set_requires_gradient_sync)
        with phase("optimizer"):
            if self.args.clip:
                self.grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(
                    self.model.parameters(), self.args.clip))
            self.optimizer.step()
        return global_loss(local_sum, batch.n_tokens)


# stages 1 and 2 shard the optimizer (ZeroRedundancyOptimizer has no gradient sharding: its
# stage 2 is the same object); stage 3 shards the parameters too, as FSDP2 does
ZeRO.native = staticmethod(lambda args: TorchFSDP2 if args.stage == 3 else TorchZeRO1)


def main():
    """`torchrun zero.py --mode ...`: zero.py's __main__ lands here."""
    harness_main(ZeRO)
