"""The test rig for sp.py: its adapter, constraints, plants and baselines (rig/__init__.py)."""
import copy

import torch

from harness.lora_setup import no_grad_inputs, regathered_regions
from harness import (DTYPES, Expect, Plant, Strategy, attention_features,
                     dropout as harness_dropout, kv_heads, phase, planted)
from harness.precision import grad_reduce_dtype
from harness.cli import main as harness_main

from sp import (ULYSSES_ALL_TO_ALLS, parallelize, parallelize_ulysses, region_collectives,
                set_documents, ulysses_bytes)

import fp8
from rig.ddp import (AmaxLog, fp8_constraints, fp8_data_parallel, fp8_tiles,
                     make_optimizer, token_sharded_step)
from rig.tp import (PLANT_ARGS, tp_gather_rows, TP, norm_sharded_comm, partial_numel,
                    standalone_constraints)
from tp import LOSS_ALL_REDUCES


# Where each planted bug must FAIL: the tour's model, float32 with clipping (see PLANT_ARGS).
MEGATRON_ARGS = ("--variant", "megatron", *PLANT_ARGS)
ULYSSES_ARGS = ("--variant", "ulysses", *PLANT_ARGS)


class MegatronSP(TP):
    name = "sp-megatron"
    chunked_ce = False   # (its step computes the loss on the full logits)
    plants = {
        "dropout-rank-local": Plant(harness_dropout.PLANT_DOC, ("--variant", "megatron")
                                    + harness_dropout.PLANT_ARGS),
        "norm-grads-unreduced": Plant("the norms' gradients (each rank saw its own tokens "
                                             "only) are not all-reduced", MEGATRON_ARGS),
        "enter-grad-unreduced": Plant("the region entry's backward keeps its own chunk of "
                                             "the gradient instead of reduce-scattering it",
                                             MEGATRON_ARGS),
        "split-strided": Plant("the first layer keeps tokens r, r+W, ... while the "
                                      "all-gathers lay the shards out as contiguous chunks",
                                      MEGATRON_ARGS),
        "async-chunk-rows": Plant("--async-tp: the all-gather ring's matmul writes each chunk's "
                                  "output into the next rank's rows", MEGATRON_ARGS
                                  + ("--async-tp",)),
    }

    def __init__(self, model, args, env):
        self.args, self.env, self.model = args, env, model
        self.tp = parallelize(model, async_tp=args.async_tp)
        if args.async_tp:
            self.name = "sp-megatron-async"
        self.optimizer = make_optimizer(model, args, self.tp)

    def my_tokens(self, batch) -> slice:
        """This rank's contiguous share of the sequence in the residual stream."""
        s = batch.input_ids.shape[1] // self.env.world
        return slice(self.env.rank * s, (self.env.rank + 1) * s)

    def step(self, batch):
        self.optimizer.zero_grad(set_to_none=True)
        with phase("forward"):
            with harness_dropout.at(batch, hidden=self.my_tokens(batch)):
                logits = self.model(input_ids=batch.input_ids,
                                    position_ids=batch.doc_positions).logits
            ce = self.tp.loss_sum(logits, batch.labels)
        return self.backward_and_step(ce, batch)

    def expected_comm(self):
        cfg, a = self.model.config, self.args
        N, H, L = a.batch * a.length, cfg.hidden_size, cfg.num_hidden_layers
        b = DTYPES[a.dtype].itemsize
        b_ce = 4 if a.dtype == "bfloat16" else b
        nhb = N * H * b
        partial = partial_numel(self.tp)   # (frozen tensors, LoRA's, have no gradient)
        norm_calls, norm_bytes = norm_sharded_comm(self.tp, N, a.dtype)
        loss = LOSS_ALL_REDUCES      # the embedding's sum + the loss + the partial gradients
        ar_calls = 1 + loss + 1 + (1 if a.clip else 0) + norm_calls
        ar_bytes = nhb + loss * N * b_ce + partial * b + (8 if a.clip else 0) + norm_bytes
        muon = tp_gather_rows(self.optimizer, self.tp)     # --optimizer muon's tp-gather
        if a.async_tp:    # every region collective a ring of T-1 hops (async_tp.py)
            rings, W = region_collectives(L, async_tp=True)["ring"], self.env.world
            return [
                Expect("all_gather_into_tensor", "world", 1, nhb,
                       "N*H*b: the first layer's split (bwd)"),
                *[Expect(op, "world", rings * (W - 1), rings * (W - 1) * nhb // W,
                         "(10L+3) rings x (T-1) hops of N*H*b/T: the 6L+2 region all-gathers "
                         "and 4L+1 reduce-scatters") for op in ("isend", "irecv")],
                Expect("all_reduce", "world", ar_calls, ar_bytes,
                       "embedding N*H*b + loss 3 x N*b + norm/bias grads"
                       + (" + clip" if a.clip else ""))] + muon
        n = region_collectives(L, regathered=regathered_regions(self.model),   # sp.py's: 6L + 3
                               no_grad_inputs=no_grad_inputs(self.model))         # and 4L + 1
        ag, rs = n["all_gather_into_tensor"], n["reduce_scatter_tensor"]
        return [
            Expect("all_gather_into_tensor", "world", ag, ag * nhb,
                   "(6L+3) x N*H*b: 2 region entries per layer + LM head (fwd); the same "
                   "2L+1 re-gathered for the weight grads, 2 row exits per layer and the "
                   "first-layer split (bwd)"),
            Expect("reduce_scatter_tensor", "world", rs, rs * nhb,
                   "(4L+1) x N*H*b: 2 row exits per layer (fwd), 2 entries per layer + "
                   "LM head (bwd)"),
            Expect("all_reduce", "world", ar_calls, ar_bytes,
                   "embedding N*H*b + loss 3 x N*b + norm/bias grads"
                   + (" + clip" if a.clip else "")),
        ] + muon

    def report_lines(self):
        return _per_layer_lines(self.model.config, self.args, self.env.world)


class Ulysses(Strategy):
    name = "sp-ulysses"
    plants = {
        "no-average": Plant("the gradient all-reduce sums instead of averaging (W x; "
                                   "clipping would hide it)", ULYSSES_ARGS),
        "a2a-permute": Plant("the all-to-all's result is permuted as (rank, head) "
                                    "instead of (head, rank): heads and sequence chunks mix",
                                    ULYSSES_ARGS),
        "strided-shard": Plant("rank r takes tokens r, r+W, ... (with their true "
                                      "positions) while the all-to-all lays shards out as "
                                      "contiguous chunks: causal attention sees them out of "
                                      "order", ULYSSES_ARGS),
        "ulysses-causal-only": Plant("packed documents' positions restart but the gathered "
                                     "sequence is attended with the plain causal mask: each "
                                     "token sees the documents before it",
                                     ("--variant", "ulysses", "--doc-mask")),
    }

    def __init__(self, model, args, env):
        self.args, self.env, self.model = args, env, model
        fp8_data_parallel(model, args)   # --fp8: x's and dy's amaxes over the split tokens
        # Replicated weights, different tokens: DDP's bucketed gradient all-reduce.
        self.dp = parallelize_ulysses(model, None, broadcast=False, broadcast_buffers=False,
                                      reduce_dtype=grad_reduce_dtype(DTYPES[args.dtype], args))
        self.optimizer = make_optimizer(model, args)   # (replicated: Muon duplicated)
        s, r = args.length // env.world, env.rank   # this rank's contiguous tokens
        self.pos = torch.arange(r * s, (r + 1) * s, device=env.device)
        if planted("strided-shard"):   # plant: strided, but the all-to-all assumes chunks
            self.pos = torch.arange(r, args.length, env.world, device=env.device)

    def step(self, batch):
        set_documents(self.model, batch.doc_positions)   # (--doc-mask: packed documents)
        return token_sharded_step(self, batch, self.pos)

    def expected_comm(self):
        cfg, a, W = self.model.config, self.args, self.env.world
        N, H, L = a.batch * a.length, cfg.hidden_size, cfg.num_hidden_layers
        hd = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
        kv = kv_heads(cfg) * hd
        b = DTYPES[a.dtype].itemsize
        per_layer = ulysses_bytes(N, H, kv, W, b)     # sp.py's formula
        grads = sum(p.numel() for p in self.model.parameters()) * self.dp.reduce_itemsize
        return [Expect("all_to_all_single", "world", ULYSSES_ALL_TO_ALLS * L, L * per_layer,
                       f"per layer 8 calls, 2 x (2H + 2H_kv) x N/W x b = {per_layer:,} B"),
                Expect("all_reduce", "world", len(self.dp.buckets), grads,
                       f"gradients Psi*b = {grads:,} B")]

    def report_lines(self):
        return _per_layer_lines(self.model.config, self.args, self.env.world)


def _per_layer_lines(cfg, a, W):
    """Per-layer activation traffic of the three schemes side by side (per-rank wire bytes)."""
    N, H = a.batch * a.length, cfg.hidden_size
    hd = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    kv = kv_heads(cfg) * hd
    b = DTYPES[a.dtype].itemsize
    tp_wire = 4 * N * H * b * 2 * (W - 1) / W           # 4 all-reduces of N*H*b
    sp_wire = 4 * N * H * b * (W - 1) / W * 2           # 4 all-gathers + 4 reduce-scatters
    uly_wire = 2 * (2 * H + 2 * kv) * N / W * b * (W - 1) / W
    return [f"per-layer activation traffic, per-rank wire bytes at W={W}: TP {tp_wire:,.0f}, "
            f"Megatron SP {sp_wire:,.0f} (= TP), Ulysses {uly_wire:,.0f} "
            f"({uly_wire / tp_wire if tp_wire else 0:.2f} of TP, ~1/W with GQA)"]


# ----------------------------------------------------------------------------------------------
# Harness adapter: one script, two variants
# ----------------------------------------------------------------------------------------------
def sp_constraints(args, world, config) -> list[str]:
    if args.length % world:
        return [f"sequence length {args.length} is not divisible by the sequence-parallel "
                f"size {world}"]
    if args.variant == "megatron":
        if args.async_tp and getattr(args, "lora", 0):
            return ["--async-tp with --lora: async TP's rings fuse the base's matmul, not the "
                    "adapters' (run without --async-tp)"]
        return standalone_constraints(args, world, config)
    if args.async_tp:
        return ["--async-tp decomposes Megatron SP's regions: use --variant megatron"]
    feats = attention_features(config, args.length)
    if feats:
        return [f"ulysses attends with SDPA's causal mode, which does not implement {feats[0]}"]
    h, kv = config.num_attention_heads, kv_heads(config)
    if h % world or kv % world:
        return [f"ulysses needs num_attention_heads ({h}) and num_key_value_heads ({kv}) "
                f"divisible by the sequence-parallel size {world}"]
    return (fp8_tiles(args, "ulysses: a rank's {} positions of each row are", args.length // world)
            or fp8_constraints(args, world, 1))   # (its linears whole, its tokens split: as DDP's)


class SyncMegatronSP(MegatronSP):
    """--async-tp's baseline (--compare-native, --paired): the same regions, their collectives
    whole."""
    name = "sp-megatron-sync"

    def __init__(self, model, args, env):
        args = copy.copy(args)
        args.async_tp = False
        super().__init__(model, args, env)


class SP(Strategy):
    """Dispatches to the variant chosen by --variant (the harness builds one class)."""
    name = "sp"
    convert_fp8 = staticmethod(fp8.convert)   # megatron: fp8.carry; ulysses: fp8.scope
    fp8_amax_log = AmaxLog   # every rank runs every FP8 linear: its amaxes, bit for bit
    optimizers = ("adamw", "muon")   # muon.py: rig/muon.py builds it
    lora = True
    doc_mask = True   # (megatron: HF's forward and mask; ulysses refuses, sp_constraints)
    # --compare-native: tensor parallelism alone, for activation memory; with --async-tp the
    # synchronous regions
    native = staticmethod(lambda args: [SyncMegatronSP] if args.async_tp else [TP])
    plants = {**MegatronSP.plants, **Ulysses.plants}   # each names its --variant in its args

    @staticmethod
    def add_args(p):
        p.add_argument("--variant", default="megatron", choices=["megatron", "ulysses"])
        p.add_argument("--async-tp", action="store_true",
                       help="megatron: decompose each region's all-gather + matmul and matmul + "
                            "reduce-scatter into rings that overlap them (async_tp.py)")

    constraints = staticmethod(sp_constraints)

    def __new__(cls, model, args, env):
        return (MegatronSP if args.variant == "megatron" else Ulysses)(model, args, env)


def main():
    """`torchrun sp.py --mode ...`: sp.py's __main__ lands here."""
    harness_main(SP)
