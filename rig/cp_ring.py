"""The test rig for cp_ring.py: its adapter, constraints, plants and baselines (rig/__init__.py)."""
import torch.distributed as dist

from harness import (DTYPES, Expect, METER, Plant, Strategy, attention_features, kv_heads,
                     planted)
from harness.precision import grad_reduce_dtype
from harness.timing import CallTimer
from harness.cli import main as harness_main
from rig.ddp import (AmaxLog, fp8_constraints, fp8_data_parallel, fp8_tiles,
                     make_optimizer, token_sharded_step)

import cp_balance
import ddp
import fp8
from cp_kernels import pick_kernel
from cp_ring import (ALLGATHER_COLLECTIVES, layout, parallelize, positions, ring_bytes,
                     ring_messages, set_documents)


# ----------------------------------------------------------------------------------------------
# Harness adapter
# ----------------------------------------------------------------------------------------------
def add_kernel_arg(p):
    p.add_argument("--attn-kernel", default="auto", choices=["auto", "sdpa", "torch"],
                   help="attention block kernel: auto = fused SDPA on CUDA, pure torch on CPU")


def _block_flops(q, k, *_):
    """Forward FLOPs of one block as the kernel sees it: 2 matmuls of 2 B H n m d."""
    B, H, n, d = q.shape
    return 4 * B * H * n * k.shape[2] * d


def cp_constraints(args, world, config) -> list[str]:
    errs = []
    parts = world if args.variant == "ring" else 2 * world
    if args.length % parts:
        what = "W" if args.variant == "ring" else "2W"
        errs.append(f"sequence length {args.length} is not divisible by {what} = {parts} "
                    f"({args.variant} layout over {world} ranks)")
    errs += [f"context parallelism's ring attention does not implement {f}"
             for f in ring_refusals(config, args.length)]
    if args.cp_balance != "none" and not args.doc_mask:
        errs.append("--cp-balance greedy balances packed documents' work: give --doc-mask")
    elif args.cp_balance != "none" and args.length % (2 * world * 4):
        errs.append(f"--cp-balance greedy: sequence length {args.length} is not divisible by "
                    f"2 x cp x 4 = {8 * world} chunks")
    chunk = args.length // (parts * (4 if args.cp_balance != "none" else 1))
    errs += fp8_tiles(args, "a cp chunk of {} positions is", chunk)
    return errs + fp8_constraints(args, world, 1)   # (linears whole, tokens split: DDP's)


def ring_refusals(config, length: int) -> list[str]:
    """What the ring does not implement for this model: attention_features, and attention
    dropout (its mask would have to enter every block's online softmax and the custom
    backward; hidden-state dropout is per token and works, harness/dropout.py)."""
    p = getattr(config, "attention_dropout", 0) or 0
    return attention_features(config, length) + (
        [f"attention dropout (attention_dropout={p})"] if p else [])


# Where each planted bug must FAIL: the tour's model, float32 with clipping (a scale bug must
# show through the clip too).
PLANT_ARGS = ("--dtype", "float32", "--clip", "0.5")


class CP(Strategy):
    convert_fp8 = staticmethod(fp8.convert)   # (the ring's attention itself stays in bf16)
    fp8_amax_log = AmaxLog   # every rank runs every FP8 linear: its amaxes, bit for bit
    optimizers = ("adamw", "muon")   # muon.py: replicated weights, NS duplicated
    lora = True
    doc_mask = True   # (each block pair its documents' mask: cp_ring.set_documents; torch kernel)
    name = "cp"
    plants = {
        "fp8-amax-per-rank": Plant("--fp8: each rank casts its zig-zag chunks' x and dy with "
                                   "their own amax, not the whole sequence's",
                                   ("--fp8", "tensorwise", "--dtype", "float64")),
        "no-average": Plant("the CP group's gradient all_reduce sums instead of "
                                   "averaging (W x; clipping would hide it)", PLANT_ARGS),
        "unmasked-diagonal": Plant("the diagonal block attends in full: each query "
                                          "also sees the later keys of its own chunk",
                                          PLANT_ARGS),
        "merge-no-rescale": Plant("the online-softmax merge rescales l but not the "
                                         "running output when the row max grows", PLANT_ARGS),
        "dkv-not-home": Plant("the backward skips the last ring hop: each rank keeps "
                                     "its neighbour's dK/dV as its own", PLANT_ARGS),
        "contiguous-tokens": Plant("tokens split into contiguous chunks (with their "
                                          "positions) while attention assumes the zig-zag "
                                          "layout", PLANT_ARGS),
        "doc-mask-own-rank-only": Plant("packed documents: only the blocks of the rank's own "
                                        "K/V get the documents' mask, the other ranks' blocks "
                                        "stay causal (a leak across a boundary at a chunk edge)",
                                        ("--doc-mask", *PLANT_ARGS)),
        "doc-skip-by-corner": Plant("packed documents: an off-diagonal block pair is skipped "
                                    "when its corner pair (the last query, the first key) is "
                                    "masked, though other queries in it see other keys",
                                    ("--doc-mask", *PLANT_ARGS)),
        "balanced-labels-zigzag": Plant("--cp-balance greedy: the inputs take the balanced "
                                        "layout's columns, the labels keep zig-zag's (the "
                                        "permutation not applied to the labels)",
                                        ("--doc-mask", "--cp-balance", "greedy", *PLANT_ARGS)),
        "no-reduce-scatter": Plant("allgather: dK/dV keep only this rank's queries' "
                                          "share instead of the reduce-scatter's sum",
                                          ("--variant", "allgather", *PLANT_ARGS)),
    }

    @staticmethod
    def add_args(p):
        p.add_argument("--variant", default="zigzag", choices=["zigzag", "ring", "allgather"])
        p.add_argument("--cp-balance", default="none", choices=["none", "greedy"],
                       help="with --doc-mask: each batch's layout by its documents' causal "
                            "work (cp_balance.py) instead of the variant's")
        add_kernel_arg(p)

    constraints = staticmethod(cp_constraints)

    def __init__(self, model, args, env):
        self.args, self.env, self.model = args, env, model
        fp8_data_parallel(model, args)   # --fp8: x's and dy's amaxes over the split tokens
        self.name = f"cp-{args.variant}" + ("-greedy" if args.cp_balance == "greedy" else "")
        # (packed documents: their masks go to the pure-torch block kernel)
        kernel, self.kernel_line = pick_kernel("torch" if args.doc_mask else args.attn_kernel,
                                               env.device, DTYPES[args.dtype])
        if env.is_main:
            print(self.kernel_line, flush=True)
        # Instrumentation from outside the algorithm: time inside the block kernel, and its
        # forward FLOPs, per rank (the benchmark's balance lines).
        self.kernel_time = CallTimer(env.device.type == "cuda")
        kernel.forward = self.kernel_time.wrap(kernel.forward, work=_block_flops)
        kernel.backward = self.kernel_time.wrap(kernel.backward)
        self.cp = parallelize(model, None, args.length, args.variant, kernel)
        self.pos = self.zigzag_pos = self.cp.positions.to(env.device)
        if planted("contiguous-tokens"):   # plant: the usual contiguous split
            self.pos = positions(layout("ring", env.world, args.length)[env.rank]).to(env.device)
        # Same weights, different tokens: gradients are summed over the CP group.
        self.dp = ddp.DataParallel(model, broadcast=False, broadcast_buffers=False,
                                   reduce_dtype=grad_reduce_dtype(DTYPES[args.dtype], args))
        self.optimizer = make_optimizer(model, args)   # (replicated weights)

    def step(self, batch):
        label_pos = None
        if self.args.cp_balance == "greedy":   # this batch's layout, by its documents' work
            cp_balance.apply(self.cp, cp_balance.balanced(batch.doc_positions, self.env.world))
            self.pos = label_pos = self.cp.positions.to(self.env.device)
            if planted("balanced-labels-zigzag"):   # plant: the labels keep zig-zag's columns
                label_pos = self.zigzag_pos
        set_documents(self.cp, batch.doc_positions)   # (--doc-mask: packed documents)
        return token_sharded_step(self, batch, self.pos, label_pos)

    def expected_comm(self):
        cfg, a, W = self.model.config, self.args, self.env.world
        L, B = cfg.num_hidden_layers, a.batch
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv = kv_heads(cfg) * hd
        b = DTYPES[a.dtype].itemsize
        s = a.length // W
        blk = B * s * 2 * kv * b                       # one rank's K and V
        grads = sum(p.numel() for p in self.model.parameters()) * self.dp.reduce_itemsize
        rows = [Expect("all_reduce", "world", len(self.dp.buckets), grads,
                       f"weight gradients summed over CP: Psi*b = {grads:,} B (reduce dtype)")]
        if self.args.variant == "allgather":
            full, (ag, rs) = W * blk, ALLGATHER_COLLECTIVES
            return rows + [
                Expect("all_gather_into_tensor", "world", ag * L, ag * L * full,
                       f"K,V per layer, forward and again in backward: {full:,} B"),
                Expect("reduce_scatter_tensor", "world", rs * L, rs * L * full,
                       f"dK,dV per layer: {full:,} B")]
        if W == 1:
            return rows
        # dK/dV accumulate over the hops in fp32 (fp64 in float64 runs), and travel so
        dblk = blk * max(b, 4) // b
        per_layer = ring_bytes(W, blk, dblk)
        return rows + [Expect(op, "world", L * ring_messages(W), L * per_layer,
                              f"per layer: fwd (W-1) hops of K,V ({blk:,} B) = "
                              f"2(W-1)/W*S*kv*b*B; bwd (W-1) hops of K,V + dK,dV (in fp32: "
                              f"{dblk:,} B), then dK,dV home")
                       for op in ("isend", "irecv")]

    def report_lines(self):
        # per-rank attention work: balance of ring vs zigzag (a collective)
        stats = [None] * self.env.world
        with METER.paused():
            dist.all_gather_object(stats, self.kernel_time.total())
        sec = [t for t, _ in stats]
        fl = [f for _, f in stats]
        self.kernel_time.reset()
        return [self.kernel_line,
                "attention forward FLOPs per rank (all steps so far): "
                + ", ".join(f"{f / 1e6:.1f}M" for f in fl)
                + f"; balance max/min {max(fl) / max(min(fl), 1):.2f}",
                "attention block compute time per rank (fwd+bwd, s): "
                + ", ".join(f"{t:.3f}" for t in sec)
                + f"; balance max/min {max(sec) / max(min(sec), 1e-12):.2f}"]


def main():
    """`torchrun cp_ring.py --mode ...`: cp_ring.py's __main__ lands here."""
    harness_main(CP)
