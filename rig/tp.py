"""The test rig for tp.py: its adapter, constraints, plants and baselines (rig/__init__.py)."""
import torch

from harness import (Batch, DTYPES, DTensorBaseline, Expect, Plant, Reference, Strategy,
                     clip_by_norm, dropout, full_tensor, is_moe, phase, scalar,
                     spread_across_ranks)
from harness.collectives import local_part
from harness.loss import chunked_loss_sum
from harness.lora_setup import no_grad_inputs, wrap as lora_wrap
from harness.cli import main as harness_main

from tp import (LOSS_ALL_REDUCES, TensorParallel, parallelize, region_all_reduces,
                shape_constraints)
from tp import classify
from tp_plan import head_dims, meta_model, segments
import fp8
import muon
from rig.ddp import AmaxLog, MUON_PLANT, fp8_tiles, make_optimizer


# ----------------------------------------------------------------------------------------------
# Harness adapter
# ----------------------------------------------------------------------------------------------
def tp_constraints(args, world, config) -> list[str]:
    """The shapes T must divide, then every parameter classified (on a meta-device model)."""
    model = meta_model(config)
    if getattr(args, "lora", 0):   # peft's layers, as the run will build them
        lora_wrap(model, args)
    return shape_constraints(world, config) or classify(model, world)[1]


def fp8_tp_constraints(args, world, config) -> list[str]:
    """--fp8 under TP (fp8.carry): each split layer's scales MAXed over the group make a rank
    cast as one device does, provided its shard is a whole number of the kernel's tiles (16;
    blockwise: 128 x 128 blocks, which a cut must not split) and no kv head is replicated."""
    if not getattr(args, "fp8", None):
        return []
    if getattr(args, "async_tp", False):
        return ["--fp8 with --async-tp: async TP's rings fuse the layers' bf16 matmuls"]
    if getattr(args, "lora", 0):
        return ["--fp8 with --lora: peft's adapters wrap the base linears fp8.convert replaces"]
    _, _, hkv = head_dims(config)
    if world > hkv:
        return [f"--fp8 at T={world} > {hkv} kv heads: a replicated kv head's scales would "
                f"span its copies, not the group (fp8.carry refuses kv-copy layers)"]
    tile = fp8.BLOCK if args.fp8 == "blockwise" else 16
    model = meta_model(config)
    fp8.convert(model, args.fp8)
    kinds = classify(model, world)[0]
    for name, m in model.named_modules():
        kind = kinds.get(f"{name}.weight")
        if isinstance(m, fp8.Float8Linear) and kind in ("column", "fused", "row"):
            # (a fused [q; k; v] or [gate; up]: each segment's shard, or blocks would mix parts)
            segs = (segments(model, name, m.out_features) or (m.out_features,)) \
                if kind == "fused" else (m.in_features if kind == "row" else m.out_features,)
            local = next((n // world for n in segs if n // world % tile), 0)
            if local:
                return [f"--fp8 {args.fp8} at T={world}: {name}'s shard has {local} "
                        f"{'input' if kind == 'row' else 'output'} features"
                        f"{' in a fused segment' if kind == 'fused' else ''}, not a multiple of "
                        f"the kernel's {tile}"]
    return fp8_tiles(args, "the step's {} tokens (on every tp rank) are", args.batch * args.length)


def standalone_constraints(args, world, config) -> list[str]:
    """tp.py (and sp.py's Megatron variant) on their own refuse a MoE model: its blocks would
    run whole on every rank, which only compose4d.py (--ep, compose_moe.py) accounts for."""
    if is_moe(config):
        return [f"--model {args.model} is a Mixture-of-Experts model: tp.py splits attention and "
                f"dense MLPs, not experts; use compose4d.py --ep (or ep_moe.py)"]
    return tp_constraints(args, world, config) or fp8_tp_constraints(args, world, config)


# Where each planted bug must FAIL: the tour's model, float32 with clipping (clipping hides a
# gradient scale error unless gradients are compared before it; float32 is the harder case).
PLANT_ARGS = ("--model", "configs/tiny-gqa8.json", "--dtype", "float32", "--clip", "0.5")
LORA_PLANT = ("--lora", "4", "--dtype", "float32", "--clip", "0.5")


class TP(Strategy):
    name = "tp"
    convert_fp8 = staticmethod(fp8.convert)   # fp8.carry keeps them in FP8 as TP splits them
    fp8_amax_log = AmaxLog   # every rank runs every FP8 linear: its amaxes, bit for bit
    optimizers = ("adamw", "muon")   # muon.py: rig/muon.py builds it
    lora = True
    chunked_ce = True
    doc_mask = True
    plants = {
        "dropout-rank-local": Plant(dropout.PLANT_DOC, dropout.PLANT_ARGS),
        "no-f": Plant("a region's input enters without f: the backward misses the "
                             "all-reduce of d(input) over the ranks' branches", PLANT_ARGS),
        "embed-unmasked": Plant("the vocab-parallel embedding does not zero the ids "
                                       "another rank owns: they add this shard's row 0",
                                       PLANT_ARGS),
        "lora-a-unsummed": Plant("--lora: a column base's lora_A gradient (partial: this "
                                 "rank's output rows only) is not summed over the group",
                                 LORA_PLANT),
        "lora-dropout-local-columns": Plant(
            "--lora-dropout: a row base's adapter input is dropped by its local column index, "
            "not the global one (its masks then differ from one device's)",
            ("--lora", "4", "--lora-dropout", "0.1")),
        "lora-scaled-twice": Plant("--lora: the parallel LoRA layers scale the adapters' "
                                   "product by (alpha / r)^2 instead of alpha / r", LORA_PLANT),
        "muon-blockwise": Plant(
            "--optimizer muon: Newton-Schulz on each rank's shard as if it were the matrix (the "
            "'blockwise' mode): the update then depends on the layout", MUON_PLANT),
        "muon-lr-by-shard": Plant(
            "--optimizer muon: the lr scale sqrt(max(1, A/B)) from the shard's shape, not the "
            "matrix's (gate/up [I/T, H], o/down [H, I/T])", MUON_PLANT),
        "embed-drops-padding-idx": Plant(
            "the vocab-parallel embedding drops HF's padding_idx: the pad token's row trains "
            "under TP and stays frozen on one device (OLMo2's pad id is 1)",
            ("--model", "tiny-olmo2", "--dtype", "float32", "--clip", "0.5")),
        "ce-counts-ignored": Plant("the vocab-parallel loss does not mask ignored labels: "
                                          "padding adds to the loss and the gradient",
                                          PLANT_ARGS),
        "clip-norm-scale": Plant("the clip norm sums the replicated gradients' squares "
                                        "over the group too: counted T times", PLANT_ARGS),
        "qk-norm-grads-unreduced": Plant(
            "Qwen3's per-head q/k norms keep each rank's gradient (its own heads' share) "
            "instead of the sum over the group", ("--model", "tiny-qwen3", "--dtype", "float32",
                                                  "--clip", "0.5")),
        "tp-views-linger": Plant(
            "tp_dtensor's forward hook that removes a module's local views is skipped when the "
            "forward raises (torch's checkpoint stops a recomputation early by raising): the "
            "views stay, shadowing the DTensor parameters", ("--recompute", "full")),
        "fp8-amax-per-rank": Plant("--fp8: each rank casts its shard of a split weight (and "
                                   "of dY, X) with its own part's amax, not the whole tensor's",
                                   ("--fp8", "tensorwise", "--dtype", "float64")),
        "kv-copies-summed-across-heads": Plant(
            "with more ranks than kv heads, a replicated kv head's gradient is all-reduced "
            "over the whole group: summed with the other heads' copies, not its own only",
            ("--dtype", "float32", "--clip", "0.5"), world=4),
    }

    @staticmethod
    def add_args(p):
        p.add_argument("--dtensor", dest="compare_native", action="store_true",
                       help="same as --compare-native: also run PyTorch DTensor's "
                            "parallelize_module with the same plan")

    constraints = staticmethod(standalone_constraints)

    def __init__(self, model, args, env):
        self.args, self.env, self.model = args, env, model
        self.tp = parallelize(model)
        self.optimizer = make_optimizer(model, args, self.tp)

    def step(self, batch: Batch) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        with phase("forward"):
            with dropout.at(batch):
                if self.args.ce_chunk:   # the vocab-parallel loss, ce_chunk tokens at a time
                    ce = chunked_loss_sum(self.model, batch.input_ids, batch.labels,
                                          self.args.ce_chunk, self.tp.loss_sum,
                                          position_ids=batch.doc_positions)
                else:
                    ce = self.tp.loss_sum(self.model(input_ids=batch.input_ids,
                                                     position_ids=batch.doc_positions).logits,
                                          batch.labels)
        return self.backward_and_step(ce, batch)

    def backward_and_step(self, ce, batch: Batch) -> float:
        """The second half of a TP step (sp.py's Megatron SP shares it): the partial gradients
        summed over the group, clip, the optimizer; the full loss, which every rank computed."""
        with phase("backward"):
            (ce / batch.n_tokens).backward()
            self.tp.reduce_partial_grads()
        with phase("optimizer"):
            if self.args.clip:
                self.grad_norm = self.tp.clip(self.args.clip)
            self.optimizer.step()
        return scalar(ce) / batch.n_tokens

    def full_grads(self):
        return self.tp.full({n: p.grad for n, p in self.model.named_parameters()})

    def full_params(self):
        return self.tp.full({n: p.detach() for n, p in self.model.named_parameters()})

    def extra_checks(self):
        # Replicated parameters (norms, replicated kv) must stay identical across TP ranks.
        rep = [p for n, p in self.model.named_parameters() if n not in self.tp.split_dim
               and (n not in self.tp.kv_split or self.tp.kv_copies == self.tp.world)]
        spread = spread_across_ranks(rep)
        # tp_dtensor's local views live for a forward only: one left in a module's __dict__
        # would shadow its DTensor parameter (and be computed with after a reload)
        stale = [f"{type(m).__name__}.{n}" for m in self.model.modules()
                 for n in m._parameters if n in m.__dict__]
        return [(f"{len(rep)} replicated tensors identical across ranks", spread == 0.0,
                 f"max spread of per-tensor sums {spread:.1e}"),
                ("no parameter's local view left in a module after the step", not stale,
                 f"{len(stale)} left{': ' + stale[0] if stale else ''}")]

    def expected_comm(self):
        cfg, a = self.model.config, self.args
        N, H, L = a.batch * a.length, cfg.hidden_size, cfg.num_hidden_layers
        b = DTYPES[a.dtype].itemsize
        b_ce = 4 if a.dtype == "bfloat16" else b
        partial = self.tp.kv_copy_params or self.tp.group_partials
        K = -(-N // a.ce_chunk) if a.ce_chunk else 1   # the loss's chunks, 3 all-reduces each
        regions = region_all_reduces(L, no_grad_inputs=no_grad_inputs(self.model))  # 4L + 2
        calls = regions + LOSS_ALL_REDUCES * K + (1 if partial else 0)
        nbytes = regions * N * H * b + LOSS_ALL_REDUCES * N * b_ce
        if partial:
            nbytes += partial_numel(self.tp) * b
        norm_calls, norm_bytes = norm_sharded_comm(self.tp, N, a.dtype)
        calls, nbytes = calls + norm_calls, nbytes + norm_bytes
        if a.clip:
            calls, nbytes = calls + 1, nbytes + 8
        return [Expect("all_reduce", "world", calls, nbytes,
                       f"(4L+2) x N*H*b + 3 x N*b_ce = {regions} x {N * H * b:,} + "
                       f"3 x {N * b_ce:,} B (L={L}, N=B*S={N}, H={H})"
                       + (f"; the loss in {K} chunks of --ce-chunk tokens, 3 calls each"
                          if a.ce_chunk else "")
                       + (" + kv grads" if self.tp.kv_copy_params else "")
                       + (" + q/k norm grads" if self.tp.group_partials else "")
                       + (" + full-width q/k norms 2 x N*b each" if norm_calls else "")
                       + (" + clip" if a.clip else ""))] + tp_gather_rows(self.optimizer, self.tp)


def tp_gather_rows(opt, tpm) -> list:
    """The meter's extra row under --optimizer muon: tp-gather's all-gathers (muon.py)."""
    if not isinstance(opt, muon.MuonAdamW):
        return []
    split = [m for g in opt.param_groups if g["muon"] for m in g["params"]
             if opt.names[m] in tpm.split_dim or opt.names[m] in tpm.kv_split]
    b = split[0].element_size() if split else 0
    calls, nbytes = muon.tp_gather_comm([local_part(m).numel() for m in split], tpm.world, b)
    return [Expect("all_gather", "world", calls, nbytes,
                   f"Muon's tp-gather: one per split matrix ({calls}), T shards x {b} B")]


def partial_numel(tpm: TensorParallel) -> int:
    """Elements of tp's all-reduce of the partial gradients (reduce_partial_grads): the kv
    heads' buffers (n_kv x each copy) and the group_partials' gradients."""
    n = lambda p: local_part(p).numel()   # noqa: E731 (this rank's part of a DTensor label)
    return (sum(n(p) * tpm.n_kv for p in tpm.kv_copy_params.values() if p.requires_grad)
            + sum(n(p) for p in tpm.group_partials.values() if p.requires_grad))


def norm_sharded_comm(tpm: TensorParallel, N: int, dtype: str) -> tuple[int, int]:
    """(all-reduce calls, bytes) of the full-width q/k norms (ShardedRMSNorm): one sum of
    squares of N values forward and its gradient backward, each, in at least float32."""
    n = sum(1 for k in tpm.kinds.values() if k == "norm-sharded")
    b = max(DTYPES[dtype].itemsize, 4)
    return 2 * n, 2 * n * N * b


class DTensorTP(DTensorBaseline, Reference):
    """Baseline: PyTorch DTensor's parallelize_module with the same Megatron plan (colwise
    q/k/v/gate/up, rowwise o/down, vocab-sharded embedding) and a full-vocabulary LM head.
    The step is the reference's: DTensor makes the plain training code parallel."""
    name = "dtensor-tp"
    constraints = staticmethod(standalone_constraints)

    def __init__(self, model, args, env):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        mesh = init_device_mesh(env.device.type, (env.world,))
        plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Replicate())}
        for i in range(len(model.model.layers)):
            p = f"model.layers.{i}."
            plan.update({p + f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj",
                                                                          "v_proj")})
            plan.update({p + f"mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")})
            plan[p + "self_attn.o_proj"] = RowwiseParallel()
            plan[p + "mlp.down_proj"] = RowwiseParallel()
        super().__init__(parallelize_module(model, mesh, plan), args, env)

    def clip(self, max_norm: float) -> torch.Tensor:
        """torch's clip_grad_norm_ refuses a mix of DTensor (the sharded weights) and plain
        gradients (the norms, which the plan leaves replicated): each DTensor gradient is
        reassembled whatever its placement (a baseline: the all-gathers are not what it
        measures), and every gradient counted once."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        sq = sum(full_tensor(g).double().pow(2).sum() for g in grads)
        return clip_by_norm(sq, [g.to_local() if hasattr(g, "to_local") else g for g in grads],
                            max_norm)


TP.native = DTensorTP


def main():
    """`torchrun tp.py --mode ...`: tp.py's __main__ lands here."""
    harness_main(TP)
