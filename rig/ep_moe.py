"""The test rig for ep_moe.py: its adapter, constraints, plants and baselines (rig/__init__.py)."""
import torch.distributed as dist

from harness import (Batch, Expect, Plant, Reference, Strategy, clip_by_norm, dropout,
                     global_loss, lm_loss_sum, name_group, phase, planted,
                     spread_across_ranks)
from harness.precision import grad_reduce_dtype
from harness.routing import RoutingStats, drop_over_capacity, hf_moe_objective
from harness.cli import main as harness_main
import fp8
from rig.ddp import AmaxLog, fp8_constraints, fp8_data_parallel, make_optimizer

from ddp import DataParallel
from ep_moe import (COUNT_ALL_TO_ALLS, TOKEN_ALL_TO_ALLS, LocalExperts, ReferenceMoE,
                    gather_experts, install, is_expert, parallelize, router_losses, update_bias)


# ----------------------------------------------------------------------------------------------
# The single-device reference: HF's own MoE block where HF has one, else HF's experts + route()
# ----------------------------------------------------------------------------------------------
class MoEReference(Reference):
    """The single-device reference; objective = mean CE + aux_coef aux + z_coef z.

    Without a selection bias (the default) it shares no code with the strategy: the model is
    HF's own (MixtralSparseMoeBlock.forward with HF's router, top-k renormalisation and
    experts), and the router losses come from the router logits HF records
    (output_router_logits=True), checked against HF's own load_balancing_loss_func
    (harness.routing.hf_moe_objective). With --capacity-factor, which HF does not have, the
    drops are applied to HF's blocks from outside (harness.routing.drop_over_capacity: a loop
    written from the stated priority, not capacity_keep). A router bug in route() therefore
    FAILs, with capacity or without. HF has no auxiliary-loss-free bias: with --aux-free-bias the
    layers are ReferenceMoE (this file's route() and drops, HF's experts) and the losses this
    file's router_losses, so those runs check the dispatch, not the router."""

    def __init__(self, ref_model, args, env):
        super().__init__(ref_model, args, env)
        self.hf_block = not args.aux_free_bias
        self.stats, self.blocks = [], []
        if self.hf_block and args.capacity_factor:
            drop_over_capacity(ref_model, args.capacity_factor)
        if not self.hf_block:
            # route() is shared here: its planted bug (router-no-renorm) is shared too
            self.blocks = install(ref_model, lambda b: ReferenceMoE(b, self.stats, args))

    def objective(self, batch):
        if self.hf_block:
            return hf_moe_objective(self.model, batch, self.args.aux_coef, self.args.z_coef)
        self.stats.clear()
        loss = super().objective(batch)
        self.counts, aux, z = router_losses(self.stats, batch.input_ids.numel(),
                                            self.blocks[0].num_experts)
        return loss + self.args.aux_coef * aux + (self.args.z_coef * z if z is not None else 0)

    def after_step(self):
        if self.args.aux_free_bias:
            update_bias(self.blocks, self.counts, self.args.bias_rate)


# ----------------------------------------------------------------------------------------------
# Harness adapter
# ----------------------------------------------------------------------------------------------
def routing_constraints(args, config) -> list[str]:
    """The routing flags' own checks (add_moe_args; ep_moe.py's and compose4d's)."""
    errs = []
    if getattr(config, "router_jitter_noise", 0.0):
        errs.append(f"router_jitter_noise={config.router_jitter_noise} is random per layout; "
                    "set it to 0")
    if args.capacity_factor is not None and args.capacity_factor <= 0:
        errs.append(f"--capacity-factor must be > 0 (got {args.capacity_factor})")
    if args.aux_free_bias and args.aux_coef:
        errs.append("--aux-free-bias replaces the auxiliary loss: set --aux-coef 0")
    if args.aux_coef < 0 or args.z_coef < 0:
        errs.append("--aux-coef and --z-coef must be >= 0")
    return errs


def ep_constraints(args, world, config) -> list[str]:
    E = getattr(config, "num_local_experts", None)
    if not E:
        return [f"--model {args.model} is not a Mixture-of-Experts config (no num_local_experts); "
                "use --model tiny-moe or a Mixtral config"]
    errs = []
    if E % world:
        errs.append(f"world size {world} does not divide num_local_experts {E}")
    if args.batch % world:
        errs.append(f"global batch {args.batch} is not divisible by world size {world}")
    errs += routing_constraints(args, config)
    errs += fp8_constraints(args, world, 1, averaged=False)   # (dense linears: DDP's scopes)
    if getattr(args, "recompute", "none") == "full":   # (harness/recompute.py)
        errs.append("--recompute full: the routing statistics are recorded in each MoE layer's "
                    "forward and a recomputed layer would record them twice; use selective")
    return errs


def add_moe_args(p):
    """The routing flags (ep_moe.py's and compose4d's)."""
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="expert capacity ceil(c k N / E) rows per layer; default dropless")
    p.add_argument("--aux-coef", type=float, default=0.01,
                   help="Switch/HF load-balancing loss coefficient")
    p.add_argument("--z-coef", type=float, default=0.0, help="router z-loss coefficient")
    p.add_argument("--aux-free-bias", action="store_true",
                   help="DeepSeek-V3 style selection bias instead of the auxiliary loss")
    p.add_argument("--bias-rate", type=float, default=1e-3,
                   help="aux-free bias update per step")
    p.add_argument("--experts-impl", default="auto", choices=LocalExperts.IMPLS,
                   help="local experts: torch._grouped_mm, padded bmm, per-expert loop; "
                        "auto = grouped_mm where it runs (not float64), else bmm")


class ExpertParallel(Strategy):
    optimizers = ("adamw", "muon")   # muon.py: dense matrices replicated; expert stacks take AdamW
    name = "ep"
    convert_fp8 = staticmethod(fp8.convert)   # the dense linears; expert stacks stay
    fp8_amax_log = AmaxLog   # every rank runs every FP8 linear: its amaxes, bit for bit
    doc_mask = True   # (HF's forward: its packed-sequence mask from the documents' positions)
    reference = MoEReference
    # Top-k routing is discontinuous: in float32, rounding differences between the layouts flip
    # a few expert choices within tens of steps and the two loss curves drift apart by ~1%
    # (both still learn). Learning mode therefore compares in float64 on CPU by default.
    cpu_dtype = {"learning": "float64"}
    # One configuration for all four (a single `--mode plants` run): float32 with clipping, where
    # the scale bug must fail too; the dropless default, so the reference is HF's own block.
    _plant_args = ("--dtype", "float32", "--clip", "0.5")
    plants = {
        "router-no-renorm": Plant(
            "route() skips the top-k renormalisation: the weights of the k chosen experts no "
            "longer sum to 1 (caught by HF's own router in the reference)", _plant_args),
        "combine-wrong-order": Plant(
            "the combine un-sorts the expert outputs with the sorting permutation instead of "
            "its inverse: rows go back to the wrong tokens", _plant_args),
        "expert-grad-scale": Plant(
            "expert gradients divided by the data-parallel size, as if averaged like the "
            "replicated ones (they are complete already: every token comes to its expert)",
            _plant_args),
        "aux-per-rank": Plant(
            "the auxiliary loss from each rank's own counts and tokens, averaged over ranks "
            "(HF's per-shard loss under data parallelism), instead of the global batch's",
            _plant_args),
    }

    @staticmethod
    def add_args(p):
        p.set_defaults(model="tiny-moe")
        add_moe_args(p)
        p.add_argument("--bucket-mb", type=float, default=25.0,
                       help="gradient bucket size for the replicated parameters")

    constraints = staticmethod(ep_constraints)

    def __init__(self, model, args, env):
        self.args, self.env, self.model = args, env, model
        fp8_data_parallel(model, args)   # --fp8: the dense linears' tokens are split
        ranks = list(range(env.world))
        # all-to-all over "ep"; replicated gradients and router counts over "dp" (the same ranks
        # here; compose4d would pass its data x context group for both)
        self.group = name_group(dist.new_group(ranks), "ep")
        self.dp_group = name_group(dist.new_group(ranks), "dp")
        self.stats: list[dict] = []
        self.blocks = parallelize(model, self.group, args.capacity_factor, args.aux_free_bias,
                                  args.z_coef, self.stats, getattr(args, "experts_impl", "auto"))
        self.expert_params = [p for n, p in model.named_parameters() if is_expert(n)]
        dense = [p for n, p in model.named_parameters() if not is_expert(n)]
        # The loss on each rank is its share of the global objective, so replicated gradients
        # are summed, not averaged; every rank built the same weights, so no broadcast.
        self.dp = DataParallel(model, self.dp_group, bucket_mb=args.bucket_mb, broadcast=False,
                               broadcast_buffers=False, average=False, params=dense,
                               reduce_dtype=grad_reduce_dtype(dense[0].dtype, args))
        self.optimizer = make_optimizer(model, args)   # (experts: 3-D, AdamW)
        # Routing statistics (loads, drops, off-rank rows), observed from outside the algorithm
        self.routing = RoutingStats(self.blocks, env, args)

    @property
    def counts_reduced(self) -> bool:
        return bool(self.args.aux_coef or self.args.aux_free_bias)

    def _reduce_counts(self, counts):
        counts = counts.clone()
        dist.all_reduce(counts, group=self.dp_group)
        return counts

    def step(self, batch: Batch) -> float:
        self.optimizer.zero_grad(set_to_none=False)
        self.stats.clear()
        self.routing.start_step()
        mb = batch.shard(self.env.rank, self.env.world)
        with phase("forward"):
            with dropout.at(mb):
                logits = self.model(input_ids=mb.input_ids, position_ids=mb.doc_positions).logits
            ce = lm_loss_sum(logits, mb.labels)
            obj = ce / batch.n_tokens
            counts, aux, z = router_losses(self.stats, batch.input_ids.numel(),
                                           self.blocks[0].num_experts,
                                           self._reduce_counts if self.counts_reduced else None)
            if planted("aux-per-rank"):   # plant: local f and P, averaged over the ranks
                aux = router_losses(self.stats, mb.input_ids.numel(),
                                    self.blocks[0].num_experts)[1] / self.env.world
            if self.args.aux_coef:
                obj = obj + self.args.aux_coef * aux
            if z is not None:
                obj = obj + self.args.z_coef * z
        with phase("backward"):
            obj.backward()   # replicated gradients summed by the end of the backward
            if planted("expert-grad-scale"):   # plant: divided like the replicated ones
                for p in self.expert_params:
                    p.grad.div_(self.env.world)
        with phase("optimizer"):
            if self.args.clip:
                self.grad_norm = self.clip(self.args.clip)
            self.optimizer.step()
        if self.args.aux_free_bias:
            update_bias(self.blocks, counts, self.args.bias_rate)
        self.routing.record(self.stats)
        return global_loss(obj.detach() * batch.n_tokens, batch.n_tokens)

    def clip(self, max_norm: float):
        """Global norm: replicated gradients are identical on every rank (count them once),
        expert gradients are disjoint (sum their squares over the ranks)."""
        dense = [p.grad for p in self.dp.bucket_of]
        sq_dense = sum(g.double().pow(2).sum() for g in dense)
        sq_exp = sum(p.grad.double().pow(2).sum() for p in self.expert_params).reshape(1)
        dist.all_reduce(sq_exp, group=self.group)
        return clip_by_norm(sq_dense + sq_exp[0], dense + [p.grad for p in self.expert_params],
                            max_norm)

    # ---- reassembly ------------------------------------------------------------------------
    def full_grads(self):
        return gather_experts({n: p.grad for n, p in self.model.named_parameters()}, self.group)

    def full_params(self):
        return gather_experts({n: p.detach() for n, p in self.model.named_parameters()},
                              self.group)

    # ---- reports ---------------------------------------------------------------------------
    def expected_comm(self):
        cfg = self.model.config
        L, E, H, k, W = (cfg.num_hidden_layers, cfg.num_local_experts, cfg.hidden_size,
                         cfg.num_experts_per_tok, self.env.world)
        b = self.model.model.embed_tokens.weight.element_size()
        n_global = self.args.batch * self.args.length
        dense_bytes = sum(p.numel() for p in self.dp.bucket_of) * self.dp.reduce_itemsize
        rows = []
        if self.args.capacity_factor:
            kept = float(self.routing.metered["kept"]) / max(1, self.routing.metered["steps"])
            tok = TOKEN_ALL_TO_ALLS
            rows.append(Expect("all_to_all_single", "ep", tok * L * W, tok * kept * H * b,
                               f"4 x kept rows x H b = 4 x {kept:,.0f} x {H} x {b} (kept over "
                               f"{L} layers; {k * n_global * L:,} choices)", ranks="sum"))
            rows.append(Expect("all_gather_into_tensor", "ep", L, L * W * k * E * 8,
                               "L x W k E x 8 = (slot, expert) counts of every rank"))
        else:
            tok, cnt = TOKEN_ALL_TO_ALLS, COUNT_ALL_TO_ALLS
            rows.append(Expect("all_to_all_single", "ep", (tok + cnt) * L * W,
                               tok * L * k * n_global * H * b + cnt * L * W * E * 8,
                               f"per layer 4 k (W T) H b (dispatch+combine, fwd+bwd) + W E x 8 "
                               f"(counts) = L x ({tok * k * n_global * H * b:,} + {W * E * 8})",
                               ranks="sum"))
        n_buckets = len(self.dp.buckets)
        calls, nbytes = n_buckets, dense_bytes
        formula = f"Psi_dense b = {dense_bytes:,} B in {n_buckets} buckets"
        if self.counts_reduced:
            calls, nbytes = calls + 1, nbytes + L * E * 8
            formula += f" + (L, E) counts {L * E * 8} B"
        rows.append(Expect("all_reduce", "dp", calls, nbytes, formula))
        if self.args.clip:
            rows.append(Expect("all_reduce", "ep", 1, 8, "expert grad-norm^2 (float64)"))
        return rows

    def learning_lines(self):
        return self.routing.balance_lines(10)

    def report_lines(self):
        return self.routing.report_lines(self.model.config,
                                         self.model.model.embed_tokens.weight.element_size())

    def extra_checks(self):
        spread = spread_across_ranks([p for p in self.dp.bucket_of])
        exp = [n for n, _ in self.model.named_parameters() if is_expert(n)]
        in_dp = any(is_expert(n) for n, p in self.model.named_parameters()
                    if p in self.dp.bucket_of)
        checks = [("replicated parameters identical across ranks", spread == 0.0,
                   f"max spread {spread:.1e}"),
                  ("expert weights outside the gradient all-reduce", not in_dp and len(exp) > 0,
                   f"{len(exp)} expert tensors, E/W = "
                   f"{self.model.config.num_local_experts // self.env.world} experts each")]
        if self.args.capacity_factor:
            checks.append(self.routing.capacity_check(self.group, self.args.capacity_factor))
        return checks


def main():
    """`torchrun ep_moe.py --mode ...`: ep_moe.py's __main__ lands here."""
    harness_main(ExpertParallel)
