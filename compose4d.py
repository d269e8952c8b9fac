"""compose4d.py: DP x TP(+SP) x PP x CP (x EP) training of an HF model, from the strategy files.

    torchrun --nproc_per_node=8 compose4d.py --tp 2 --pp 2 --cp 2                # correctness
    torchrun --nproc_per_node=8 compose4d.py --model tiny-moe --ep 2 --tp 2 --pp 2 --zero 3
    torchrun --nproc_per_node=8 compose4d.py --tp 2 --pp 2 --cp 2 --sp --mode benchmark
    torchrun --nproc_per_node=4 compose4d.py --tp 2 --pp 2 --mode train --steps 200 \\
        --lr-schedule cosine --lr-warmup 20 --save ckpt --export-hf hf_out
    torchrun --nproc_per_node=2 compose4d.py --pp 2 --mode train --steps 300 --resume ckpt

Nothing here re-implements a parallelism; the blocks come from their own files:
    tp.TensorParallel      Megatron column/row-parallel layers, vocab-parallel embedding and loss
    sp.SPRegion            Megatron sequence parallelism (--sp): all-gather / reduce-scatter at the
                           region edges (--async-tp: async_tp.py's rings); sp.shard_residual_stream
                           splits the residual stream
    cp_ring.CPContext      zig-zag ring attention over the cp group, through HF's attention registry
    pp.Pipeline            the stage split and the 1F1B / interleaved executor, over the pp group;
                           with P = 1 it is plain gradient accumulation over the micro-batches
    zero.Zero, ZeroOptimizer  ZeRO-1 (default), 2 or 3 over the dp x cp group (--zero 3: each
                           unit gathered before its forward and its backward, one unit prefetched)
    compose_moe            a MoE model's fifth dimension (--ep): ep_moe's all-to-all blocks over
                           ep groups carved out of dp x cp, the experts sharded over the ranks
                           that hold the same experts, the router losses per layer and micro-batch
What is here: the rank grid and its groups, the step that strings the blocks together, and
gradient clipping across all four dimensions. examples/train_4d.py composes tp, cp_ring, pp and
zero the same way in a short user loop (no SP, checkpoints or correctness mode).
The correctness reference takes its learning-rate schedule from torch.optim.lr_scheduler
(torch_schedule), not from our lr_at; the planted bugs (`--plant-bug NAME`, Compose4D.plants) show
that the correctness mode catches what a one-line slip in this file would break.

Rank grid (Fast-LLM's arithmetic)
    rank = tp + T * (cp + C * (dp + D * pp)): TP innermost (inside a node), then CP, then DP, PP
    outermost; --pipeline-first swaps PP inside DP (rank = tp + T * (cp + C * (pp + P * dp))).
    D = W / (T P C). Groups, created on every rank in this order: tp, cp, dp, pp, dp x cp, with
    --replicate R HSDP's shard groups (D C / R consecutive dp x cp ranks) and replicate groups
    (the same place in each), the tied-embedding pairs (first and last stage of each pipeline)
    when the embeddings are tied, and for a MoE model compose_moe's ep and edp groups.
    Gradients are summed and ZeRO's shards live over dp x cp: CP ranks hold the same weights and
    see different tokens of the same sequences, exactly as DP ranks see different sequences.

One step
    Each rank takes its dp share of the sequences and its cp share (zig-zag chunks, with their
    global positions for RoPE) of every sequence, and runs its pipeline stage's schedule over
    --grad-accum micro-batches; every micro-batch backpropagates CE_sum / N_global, so the sums
    over dp x cp (ZeRO's reduce-scatter), over tp (the partial gradients of replicated norms under
    SP) and over the tied pair give the reference's gradient exactly. Then: global-norm clipping
    (each gradient element counted once: tp-replicated ones on tp rank 0 only, the tied head copy
    on the first stage only), AdamW on the shards, all-gather of the updated parameters.

Communication per step and rank (trainer4d/comm.py; N_r = tokens per rank per step =
B S / (D C), H hidden, b bytes, M micro-batches, L_r = the layers this rank's stage holds,
f = 1 on the stage that holds the embedding, l = 1 on the stage that holds the LM head, else 0;
Psi_r = parameters held per rank = about Psi / (T P))
    tp group     TP: 4 L_r + f + l all-reduces per micro-batch (4 per layer, the embedding's
                 forward, the LM head's backward), each of N_r H b / M: (4 L_r + f + l) N_r H b
                 per step, i.e. 4L + 2 of N_r H b at P = 1, 4 L_r + 1 on the first and the last
                 of P > 1 stages, 4 L_r in between; the last stage adds 3 per micro-batch of
                 N_r b_ce / M for the loss (b_ce = 4 for bf16). With SP (sp.py), per micro-batch
                 6 L_r + 2 l + f all-gathers and 4 L_r + l reduce-scatters of N_r H b / M, and
                 the embedding's all-reduce stays; --async-tp makes all of these but f's
                 (T-1)-hop rings, M (10 L_r + 3 l) per step. Plus one all-reduce of the partial
                 gradients' shards (norms under SP, replicated kv heads) when there are any
    cp group     per layer and micro-batch (C-1) forward hops of K,V and (C-1) backward hops of
                 K,V,dK,dV, then dK,dV home (cp_ring)
    pp group     2 M (activation + gradient) sends of N_r H b / (M T_sp) per stage boundary (pp.py)
    dp x cp      ZeRO-1: one reduce-scatter of Psi_r b_r and one all-gather of Psi_r b, one call
                 per unit each (b_r: the reduce dtype's bytes, 4 for bf16); ZeRO-2 reduce-scatters
                 every micro-batch (M Psi_r b_r); ZeRO-3 also all-gathers every unit before each
                 micro-batch's forward and backward (2 M Psi_r b) and none after the step
                 (zero.py). With a MoE model (--ep) the experts' units take these rows over edp
                 (compose_moe.py, which adds the ep group's all-to-alls and the counts)
    tied pair    with tied embeddings and P > 1, one all-reduce of the embedding's gradient shard
                 on the first and last stages
    world        one 8-byte all-reduce of the squared gradient norm

Checkpoints and the train mode: trainer4d/checkpoint.py (layout-independent, atomic; the HF
export) and trainer4d/train.py (`--mode train`: real text with --data, held-out evaluation,
samples, logs, SIGTERM saves at the end of the step in flight, or mid-step with --preempt-at
micro-batch, elastic restarts). A model built on the meta device (train mode, --model a safetensors directory) is
materialised here, once it is cut: each rank reads only its shard.
"""
import copy
import os

import torch
import torch.distributed as dist

from harness import (DTYPES, METER, Batch, Plant, Strategy, all_reduce_flat,
                     clip_by_norm, global_loss, is_moe, kv_heads, main, name_group, parts,
                     phase, planted, spread_across_ranks)
from harness.flops import mfu_line
from harness.precision import grad_reduce_dtype
from harness import dropout, loading, train_data
import compose_moe
import cp_ring
import ep_moe
import fsdp
import pp
import sp
import tp
import zero
from trainer4d import comm, elastic, train   # the train mode, the comm formulas
from rig import compose_moe as rig_compose_moe, cp_ring as rig_cp_ring, ep_moe as rig_ep_moe
from rig import tp as rig_tp
from trainer4d.schedule import Scheduled, ScheduledReference, lr_at


# ----------------------------------------------------------------------------------------------
# Rank grid and process groups
# ----------------------------------------------------------------------------------------------
class Grid:
    """Coordinates of every rank. `order` lists the dimensions innermost first."""

    def __init__(self, world: int, T: int, P: int, C: int, pipeline_first: bool = False):
        self.size = dict(tp=T, cp=C, dp=world // (T * P * C), pp=P)
        self.order = ["tp", "cp", "pp", "dp"] if pipeline_first else ["tp", "cp", "dp", "pp"]
        self.world = world

    def coords(self, rank: int) -> dict[str, int]:
        out = {}
        for d in self.order:
            out[d] = rank % self.size[d]
            rank //= self.size[d]
        return out

    def rank_of(self, c: dict[str, int]) -> int:
        r = 0
        for d in reversed(self.order):
            r = r * self.size[d] + c[d]
        return r

    def groups_over(self, dims: tuple[str, ...]) -> list[list[int]]:
        """Every group in which `dims` vary and the other coordinates are fixed (rank order)."""
        seen = {}
        for r in range(self.world):
            c = self.coords(r)
            key = tuple(c[d] for d in self.order if d not in dims)
            seen.setdefault(key, []).append(r)
        return list(seen.values())


def make_groups(grid: Grid, rank: int, tied: bool, replicas: int = 1) -> dict:
    """tp, cp, dp, pp, dp x cp (and the tied pairs; with replicas R > 1 HSDP's shard groups of
    S = D C / R consecutive dp x cp ranks and replicate groups across them): every rank creates
    every group, same order."""
    out = {}
    for name, dims in (("tp", ("tp",)), ("cp", ("cp",)), ("dp", ("dp",)), ("pp", ("pp",)),
                       ("dpcp", ("dp", "cp"))):
        mine, _ = dist.new_subgroups_by_enumeration(grid.groups_over(dims))
        out[name] = name_group(mine, name)
    if replicas > 1:
        dpcp = grid.groups_over(("dp", "cp"))
        out["shard"], out["replicate"] = fsdp.new_block_groups(dpcp, len(dpcp[0]) // replicas)
    out["tied"] = None
    P = grid.size["pp"]
    if tied and P > 1:
        pairs = [[g[0], g[-1]] for g in grid.groups_over(("pp",))]
        mine, _ = dist.new_subgroups_by_enumeration(pairs)
        out["tied"] = name_group(mine, "tied")
    return out


# ----------------------------------------------------------------------------------------------
# Constraints
# ----------------------------------------------------------------------------------------------
def compose_constraints(args, world, config) -> list[str]:
    T, P, C, M = args.tp, args.pp, args.cp, args.grad_accum
    if min(T, P, C, M) < 1:
        return ["--tp, --pp, --cp and --grad-accum must be >= 1"]
    if world % (T * P * C):
        return [f"world size {world} is not divisible by tp x pp x cp = {T} x {P} x {C} = "
                f"{T * P * C} (dp = W / (tp pp cp))"]
    D = world // (T * P * C)
    meta = train.saved_meta(args) if args.mode == "train" else None   # (read once, here)
    if args.mode == "train" and args.elastic:     # re-plan first: it sets batch and grad-accum
        plan = train.replan(world, config, args, meta)
        if not plan.feasible:
            return [f"--elastic: {plan.why}"]
        args = copy.copy(args)
        args.batch, args.grad_accum, args.zero = plan.global_batch, plan.grad_accum, plan.zero
        M = args.grad_accum
    if args.dp is not None and args.dp != D:
        return [f"world size {world} is not dp x tp x pp x cp = {args.dp} x {T} x {P} x {C} = "
                f"{args.dp * T * P * C}"]
    errs = rig_compose_moe.constraints(args, config, D, C)
    if errs:
        return errs
    errs = rig_tp.tp_constraints(args, T, config) if T > 1 else []
    kv = kv_heads(config)
    if T > 1 and not errs and kv % T and kv != 1:
        errs = [f"compose4d: tensor parallel size {T} replicates kv heads "
                f"(num_key_value_heads {kv}); compose4d replicates only a single kv head"]
    if errs:
        return errs
    V = args.virtual_stages if args.schedule == "interleaved" else 1
    L = config.num_hidden_layers
    if L < P * V:
        return [f"{L} decoder layers cannot fill {P * V} pipeline chunks ({P} stages x {V} "
                f"virtual stages)"]
    if args.schedule == "interleaved" and (P < 2 or M % P):
        return [f"the interleaved schedule needs --pp >= 2 and --grad-accum ({M}) a multiple of "
                f"--pp ({P})"]
    if args.schedule == "interleaved" and args.zero >= 2:
        return [f"--zero {args.zero} reduce-scatters per micro-batch and needs each micro-batch's backward "
                "of a stage in one piece: use --schedule 1f1b"]
    if args.batch % (D * M):
        return [f"global batch {args.batch} is not divisible by dp x grad-accum = {D} x {M}"]
    if args.length % (2 * C):
        return [f"sequence length {args.length} is not divisible by 2 x cp = {2 * C} (zig-zag "
                f"chunks)"]
    if args.async_tp and not (args.sp and T > 1):
        return ["--async-tp decomposes sequence-parallel regions: give --tp > 1 with --sp"]
    if args.sp and (args.length // C) % T:
        return [f"--sp: the {args.length // C} tokens per cp rank are not divisible by tp = {T}"]
    if args.zero not in (1, 2, 3):
        return [f"--zero must be 1, 2 or 3 (got {args.zero})"]
    if args.replicate < 1 or (D * C) % args.replicate:
        return [f"--replicate {args.replicate} does not divide dp x cp = {D} x {C} = {D * C} "
                f"(HSDP shards over dp x cp / R ranks)"]
    feats = rig_cp_ring.ring_refusals(config, args.length) + (
        [f"{args.attn} attention (the ring installs its own)"] if args.attn != "sdpa" else [])
    if C > 1 and feats:
        return [f"--cp {C}: context parallelism's ring attention does not implement {feats[0]}"]
    if args.resume and not os.path.isdir(args.resume) and args.resume not in (
            args.save, *getattr(args, "saved_by_earlier_runs", ())):
        # (--save D --resume D is the restart idiom: the first launch finds no D yet; in a
        # --runs list an earlier run may save D)
        return [f"--resume {args.resume}: no such directory"]
    if args.resume:
        found, problems = train.find_checkpoint(args.resume)
        if found is None and problems:
            return [f"--resume {args.resume}: no complete, intact checkpoint ({problems[0]})"]
        saved, now = train.dropout_of(found), dropout.recorded(config, args.seed)
        if found and saved != now:   # other masks from here on: not the run it continues
            return [f"--resume {args.resume}: saved with dropout {saved or 'off'}, this run has "
                    f"{now or 'none'} (give the same --dropout and --seed)"]
        if found and args.mode == "train":
            why = train.objective_changes(meta, config, args, args.batch, D, M)
            if why:
                return [f"--resume {args.resume}: {why}"]
    if args.keep is not None and args.keep < 1:
        return [f"--keep must be >= 1 (got {args.keep})"]
    return train_data.constraints(args, config)


# ----------------------------------------------------------------------------------------------
# The composed strategy
# ----------------------------------------------------------------------------------------------
TIED_MODEL = "configs/tiny-tied.json"     # the tiny preset with tied embeddings (planted bugs)


class ScheduledMoEReference(Scheduled, rig_compose_moe.MoEReference):
    """compose_moe's reference (HF's MoE model, the router losses per layer and micro-batch)."""


def reference(ref_model, args, env):
    """The single-device reference, scheduled by torch: compose_moe's for a MoE model."""
    moe = is_moe(ref_model.config)
    return (ScheduledMoEReference if moe else ScheduledReference)(ref_model, args, env)


class Compose4D(Strategy):
    name = "4d"
    self_check = ("compose4d's stage loop (pp.py's)", pp.stage_loop)
    reference = staticmethod(reference)
    # Realistic one-line bugs, each beside the line it breaks (grep the name), and the
    # configuration in which correctness mode must FAIL with it (tests/test_plants.py). Scale
    # and norm bugs are judged in float32 with clipping (clipping must not hide them); the cp
    # configuration also runs a non-constant schedule (warm-up, then cosine), so the lr oracle
    # has work to do; the tp and pp ones use tied embeddings (the pair synced across stages).
    _CP = ("--cp", "2", "--dtype", "float32", "--clip", "0.5",
           "--lr-schedule", "cosine", "--lr-warmup", "2", "--steps", "3")
    _TP = ("--tp", "2", "--sp", "--model", TIED_MODEL)
    _PP = ("--pp", "2", "--dtype", "float32", "--clip", "0.5", "--model", TIED_MODEL)
    _MOE = ("--model", "tiny-moe", "--ep", "2", "--pp", "2", "--dtype", "float32", "--clip", "0.5")
    plants = {
        "expert-grads-over-dpcp": Plant(
            "the experts' gradients reduced (and sharded) over dp x cp, like the dense ones, "
            "instead of over the ranks that hold the same experts: other experts' gradients "
            "are added in", _MOE, world=4),
        "aux-per-stage": Plant(
            "each stage normalises its MoE layers' auxiliary loss by its own layer count, not "
            "the model's: the aux term counted once per stage", _MOE, world=4),
        "dropout-rank-local": Plant(dropout.PLANT_DOC, dropout.PLANT_ARGS + (
            "--tp", "2", "--pp", "2"), world=4),
        "lr-one-step-ahead": Plant(
            "step k runs at the schedule's learning rate for step k + 1", _CP),
        "grad-sum-misses-cp": Plant(
            "ZeRO reduces (and shards) over the dp group instead of dp x cp: the gradient "
            "misses the other cp ranks' tokens", _CP),
        "cp-local-positions": Plant(
            "RoPE positions 0..S/C-1 for the local zig-zag chunks instead of their global "
            "positions", _CP),
        "local-token-mean": Plant(
            "each rank divides its CE sum by its own token count instead of the global "
            "batch's (a mean of per-rank means)", _CP),
        "sp-partials-unreduced": Plant(
            "the partial gradients of the norms under SP are not summed over tp", _TP),
        "clip-norm-misses-pp": Plant(
            "the global gradient norm summed over the ZeRO shards (dp x cp) only, not over "
            "the pp stages (and tp ranks): each stage clips by its own part", _PP),
        "reshard-before-backward": Plant(
            "ZeRO-3: a unit freed after its forward is re-allocated for its backward but not "
            "all-gathered again: the backward computes with zeros", ("--zero", "3", "--tp", "2",
                                                                     "--pp", "2"), world=4),
        "replicas-not-summed": Plant(
            "HSDP: the dense gradient shards are reduced inside each replica's shard group but "
            "not summed across the replicas", ("--zero", "3", "--replicate", "2", "--pp", "2"),
            world=4),
        "tied-sync-skipped": Plant(
            "the first stage's embedding and the last stage's head copy of the tied weight "
            "are not summed: each updates with its own part of the gradient", _PP),
    }
    modes = {"train": train.run_train}   # --mode train: a logged run with checkpoints

    @staticmethod
    def add_args(p):
        p.add_argument("--dp", type=int, default=None,
                       help="data-parallel size D (default: W / (tp pp cp)); checked if given")
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel size T")
        p.add_argument("--pp", type=int, default=1, help="pipeline stages P")
        p.add_argument("--cp", type=int, default=1, help="context-parallel size C (zig-zag ring)")
        p.add_argument("--sp", action="store_true", help="Megatron sequence parallelism in TP")
        p.add_argument("--async-tp", action="store_true",
                       help="with --sp: each region's collectives as rings of chunked matmuls "
                            "that overlap them (async_tp.py)")
        p.add_argument("--ep", type=int, default=1,
                       help="expert-parallel size E for a MoE model, out of the dp x cp ranks "
                            "(compose_moe.py)")
        p.add_argument("--pipeline-first", action="store_true",
                       help="PP inside DP in the rank grid (default: PP outermost)")
        p.add_argument("--schedule", default="1f1b", choices=["1f1b", "interleaved"])
        p.add_argument("--virtual-stages", type=int, default=2, help="V for --schedule interleaved")
        p.add_argument("--zero", type=int, default=1, help="ZeRO stage over dp x cp: 1, 2 or 3")
        p.add_argument("--replicate", type=int, default=1,
                       help="HSDP: R replicas, each ZeRO-sharded over dp x cp / R consecutive "
                            "ranks (a node), gradients summed across them once per step")
        p.add_argument("--grad-accum", type=int, default=1,
                       help="micro-batches per step per replica (the pipeline's M)")
        p.add_argument("--lr-schedule", default="constant", choices=["constant", "cosine"])
        p.add_argument("--lr-warmup", type=int, default=0, help="linear warm-up steps")
        p.add_argument("--lr-min-ratio", type=float, default=0.1, help="cosine floor / lr")
        p.add_argument("--save", default=None, help="train mode: checkpoint directory")
        p.add_argument("--save-every", type=int, default=0, help="steps between saves (0: end)")
        p.add_argument("--keep", type=int, default=None,
                       help="keep the newest N complete checkpoints (default: all)")
        p.add_argument("--resume", default=None, help="train mode: resume from DIR/latest")
        p.add_argument("--stop-at", type=int, default=None,
                       help="train mode: save and stop after this many steps (an interruption)")
        p.add_argument("--export-hf", default=None,
                       help="train mode: write the trained model as an HF model directory")
        p.add_argument("--elastic", action="store_true",
                       help="train mode: re-plan micro-batch, grad-accum and ZeRO stage for the "
                            "world size this run starts on (elastic.py), keeping the global "
                            "batch of the checkpoint (or --batch) within --batch-tolerance")
        p.add_argument("--batch-tolerance", type=float, default=0.10)
        p.add_argument("--max-micro-batch", type=int, default=8)
        p.add_argument("--mem-gib", type=float, default=80.0,
                       help="--elastic: memory budget per GPU for the planner's memory model")
        p.add_argument("--grace-s", type=float, default=30.0,
                       help="seconds the batch system waits between SIGTERM and SIGKILL: a save "
                            "that ends later than that after the signal is warned about")
        p.add_argument("--preempt-at", default="step", choices=["step", "micro-batch"],
                       help="train mode with --save: where a SIGTERM stops the run. step: the "
                            "ranks agree on it once per step, inside the step's loss all-reduce "
                            "(no extra collective or host read), and save at the end of the step "
                            "in flight. micro-batch: also a MAX all-reduce and host read before "
                            "every micro-batch (1F1B), so the cut may fall mid-step (the "
                            "gradients saved); each is a global barrier that costs pipeline "
                            "bubble")
        p.add_argument("--test-sigterm-at", default=None,
                       help="test hook STEP:MB: rank 0 sends SIGTERM to the launcher after "
                            "that micro-batch")
        p.add_argument("--test-sigkill-at", default=None,
                       help="test hook STEP:MB: the last rank kills itself (SIGKILL) before "
                            "that micro-batch's forward, on the launcher's first attempt only")
        p.add_argument("--test-crash-in-save", action="store_true",
                       help="test hook: exit hard in the middle of a save")
        p.add_argument("--load", default="shards", choices=["shards", "full"],
                       help="train mode, --model a checkpoint directory: each rank reads only "
                            "its shard onto a meta-device model (safetensors), or builds the "
                            "whole model and slices it (the way every other mode does)")
        # train mode on real text (harness/corpus.py, harness/train_data.py)
        p.add_argument("--data", default=None, metavar="PATH",
                       help="train mode: a text file, a .jsonl, a directory of them, or "
                            "pre-tokenized .bin/.npy tokens (default: the synthetic language)")
        p.add_argument("--tokenizer", default=None, metavar="DIR",
                       help="tokenizer directory (default: --model's, when it has one)")
        p.add_argument("--data-dtype", default=None, choices=["uint16", "uint32"],
                       help=".bin token width (default uint16, as nanoGPT writes it)")
        p.add_argument("--data-cache", default=None, metavar="DIR",
                       help="where tokenized text is cached (default: beside --data)")
        p.add_argument("--val-fraction", type=float, default=0.0,
                       help="share of whole documents held out for evaluation")
        p.add_argument("--eval-every", type=int, default=0,
                       help="steps between held-out evaluations (0: none; also at the end)")
        p.add_argument("--eval-batches", type=int, default=2,
                       help="global batches of held-out sequences per evaluation")
        rig_ep_moe.add_moe_args(p)   # (used with a MoE --model)
        p.add_argument("--prompt", default=None,
                       help="train mode: print a greedy continuation of this text at the end")
        p.add_argument("--gen-tokens", type=int, default=24,
                       help="tokens generated for --prompt")

    constraints = staticmethod(compose_constraints)

    def __init__(self, model, args, env):
        self.args, self.env, self.model = args, env, model
        T, P, C = args.tp, args.pp, args.cp
        self.grid = Grid(env.world, T, P, C, args.pipeline_first)
        self.me = self.grid.coords(env.rank)
        self.name = (f"4d-dp{self.grid.size['dp']}-tp{T}{'sp' if args.sp else ''}"
                     f"{'-async' if args.async_tp else ''}-pp{P}-cp{C}"
                     f"{f'-ep{args.ep}' if args.ep > 1 else ''}-zero{args.zero}"
                     f"{f'-rep{args.replicate}' if args.replicate > 1 else ''}")
        self.tied = parts(model).tied
        g = self.groups = make_groups(self.grid, env.rank, self.tied, args.replicate)
        # Experts (a MoE model): ep groups out of dp x cp, ep_moe's all-to-all in every layer.
        self.moe = is_moe(model.config)
        blocks = []
        if self.moe:
            g.update(compose_moe.make_ep_groups(self.grid.groups_over(("dp", "cp")), args.ep))
            blocks = compose_moe.parallelize(model, args, g["ep"], g["dpcp"])
        # Tensor (and sequence) parallelism: split the linear layers, the vocabulary, the loss.
        self.tp, self.partial = None, []
        if T > 1:
            self.tp = (sp.parallelize(model, g["tp"], async_tp=args.async_tp) if args.sp
                       else tp.parallelize(model, g["tp"]))
            self.partial = list(self.tp.partial_grads) + list(self.tp.extra_partial)
        # Context parallelism: ring attention over the cp group, this rank's zig-zag tokens.
        self.pos = None
        if C > 1:
            self.pos = cp_ring.parallelize(model, g["cp"], args.length).positions.to(env.device)
        # Pipeline: this rank's stage (drops the other layers), over the pp group.
        V = args.virtual_stages if args.schedule == "interleaved" else 1
        self.pipe = pp.Pipeline(model, P, V, self.me["pp"], args.schedule, group=g["pp"],
                                tie_group=g["tied"])
        self.pipe.positions = None if planted("cp-local-positions") else self.pos   # plant
        self.pipe.seq_shards = T if args.sp else 1
        if args.sp:   # this rank's contiguous share of its tokens in the residual stream
            s = args.length // self.grid.size["cp"] // T
            self.pipe.hidden_columns = slice(self.me["tp"] * s, (self.me["tp"] + 1) * s)
        if self.tp is not None:
            self.pipe.loss_sum = self.tp.loss_sum
        self.first, self.last = 0 in self.pipe.mine, self.pipe.C - 1 in self.pipe.mine
        kept = {id(m) for m in model.modules()}
        self.blocks = [b for b in blocks if id(b) in kept]   # this stage's MoE layers
        for b in self.blocks:
            b.stage_layers = len(self.blocks)
        # A model built on the meta device (train mode, --model a checkpoint directory) gets
        # its storage now that it is cut: each rank reads only the ranges it holds.
        self.load_report = None
        if any(p.is_meta for p in model.parameters()):
            self.load_report = self._load_shards()
        # ZeRO over dp x cp, on this stage's (TP-sharded) parameters; gradients summed.
        # Experts: over the ranks that hold the same experts (edp).
        zgroup = g["dp"] if planted("grad-sum-misses-cp") else g.get("shard", g["dpcp"])  # plant
        egroup = zgroup if planted("expert-grads-over-dpcp") else g.get("edp")   # plant
        units = self._units()
        self.zero = zero.Zero(model, group=zgroup, stage=args.zero, average=False,
                              units=units, prefetch=int(args.zero == 3 and not self.moe),
                              unit_groups={u[0]: egroup for u in units if u[0].endswith("experts")},
                              reduce_dtype=grad_reduce_dtype(DTYPES[args.dtype], args))
        self.optimizer = zero.adamw_on_shards(model, self.zero, args)
        self._plan_shard_slices()
        self.t = 0              # optimizer steps taken (the schedule's position)
        self.last_norm = float("nan")
        coords = [None] * env.world          # every rank's coordinates, printed once at start
        shown = dict(self.me, **({"ep": dist.get_rank(g["ep"]), "edp": dist.get_rank(g["edp"])}
                                 if self.moe else {}),
                     **({"replica": dist.get_rank(g["replicate"])} if "replicate" in g else {}))
        with METER.paused():
            dist.all_gather_object(coords, shown)
        if env.is_main:
            print(f"rank grid {self.grid.size}, innermost first {self.grid.order}"
                  + (f"; ep {args.ep} out of dp x cp (edp {self.grid.size['dp'] * C // args.ep})"
                     if self.moe else "") + ":", flush=True)
            for r, c in enumerate(coords):
                print(f"  rank {r}: " + " ".join(f"{d}={v}" for d, v in c.items()), flush=True)

    def _load_shards(self) -> dict:
        """This rank's shard of --model's safetensors (harness/loading.py)."""
        tp_range = self.tp.local_range if self.tp is not None else (lambda name, shape: None)

        def ranges(name, shape):    # an expert tensor: this ep rank's experts (whole over tp)
            if self.moe and ep_moe.is_expert(name):
                n, r = shape[0] // self.args.ep, dist.get_rank(self.groups["ep"])
                return 0, r * n, (r + 1) * n
            return tp_range(name, shape)
        before = loading.rss_now()
        rep = loading.load_shards(self.model, self.args.model, self.env.device, ranges)
        peak = loading.rss_peak()     # (VmHWM: the caller resets it before the build)
        rep["grow"] = None if before is None or peak is None else peak - before
        return rep

    def _units(self):
        """ZeRO units of this stage in forward order; the tied head copy is a unit of its own, so
        its flat layout (and shards) match the embedding's on the first stage."""
        p, units = self.pipe.parts, []
        if self.first:
            units.append(("embed", [p.embed]))
        for i in (i for c in self.pipe.mine for i in self.pipe.bounds[c]):
            layer = p.layers[i]
            if not self.moe:
                units.append((f"layers.{i}", [layer]))
                continue
            # a MoE layer: its experts a unit of their own (sharded over edp, not dp x cp)
            experts = list(layer.mlp.experts.parameters())
            ids = {id(p) for p in experts}
            units += [(f"layers.{i}", [p for p in layer.parameters() if id(p) not in ids],
                       [layer]),
                      (f"layers.{i}.experts", experts, [layer.mlp.experts])]
        if self.last:
            if p.norm is not None:
                units.append(("norm", [p.norm]))
            if not (self.tied and self.first):
                units.append(("head", [p.head]))
            elif self.args.zero == 3:   # the head reads the embedding's unit: gathered for it
                units[0] = ("embed", [p.embed.weight], [p.embed, p.head])
        return units

    def shared_over(self, u, name: str, p):
        """The one rule that counts each gradient element once. For parameter `name` in ZeRO
        unit u: (summed, copies), the groups whose ranks each hold a partial sum of this rank's
        elements that a later reduction adds up, and those whose ranks hold identical copies
        of them once the reductions are done; None for the tied head's copy (its gradient is
        the embedding's, counted on the first stage). Used by
          the global norm (clip)      an element counts on rank 0 of every `copies` group;
          a restored partial gradient (trainer4d.train.add_partial) is added on rank 0 of
                                      every `summed` group, so the reduction counts it once.
        summed: ZeRO-1's full buffers (reduce-scattered over the unit's group: the shards are
        this rank's own after it), tp for a tp-partial gradient (SP's norms, replicated kv
        heads), the replicas for a dense unit under HSDP. copies: tp for a gradient that is
        not split over tp (replicated norms; the tp-partial ones once summed), the replicas
        under HSDP once all-reduced."""
        if self.tied and name == self.pipe.head_weight:
            return None
        g = self.groups
        summed, copies = [], []
        if self.args.zero == 1:
            summed.append(u.group)
        if self.tp is not None:
            if id(p) in self.partial_ids:
                summed.append(g["tp"])
            if name not in self.tp.split_dim:
                copies.append(g["tp"])
        if u.group is self.zero.group and "replicate" in g:   # HSDP (experts: edp spans them)
            summed.append(g["replicate"])
            copies.append(g["replicate"])
        return summed, copies

    @staticmethod
    def first_in(groups) -> bool:
        """Whether this rank is rank 0 of every group in `groups`."""
        return all(dist.get_rank(grp) == 0 for grp in groups)

    def _plan_shard_slices(self):
        """Per unit, which (start, end) ranges of this rank's gradient shard are (a) partial over
        tp (summed there), and (b) counted in the global norm (shared_over's rule)."""
        self.partial_ids = {id(p) for p in self.partial}
        self.partial_slices, self.norm_slices = [], []
        for u in self.zero.units:
            lo, s = u.rank * u.shard_numel, u.shard_numel
            ps, ns = [], []
            for n, p, off in zip(u.names, u.params, u.offsets):
                a, b = max(off, lo), min(off + p.numel(), lo + s)
                if a >= b:
                    continue
                if id(p) in self.partial_ids:
                    ps.append((a - lo, b - lo))
                shared = self.shared_over(u, n, p)
                if shared is not None and self.first_in(shared[1]):
                    ns.append((a - lo, b - lo))
            self.partial_slices.append(ps)
            self.norm_slices.append(ns)

    # -- the step --
    def local_batch(self, batch: Batch) -> Batch:
        return self._cp_tokens(batch.shard(self.me["dp"], self.grid.size["dp"]))

    def _cp_tokens(self, b: Batch) -> Batch:
        """This rank's zig-zag tokens of every sequence (all of them without CP)."""
        if self.pos is None:
            return b
        return b.cols(self.pos)

    def step(self, batch: Batch) -> float:
        """One optimizer step: this rank's dp share of the sequences and cp share of their
        tokens through its pipeline stage in --grad-accum micro-batches, each backpropagating
        CE_sum / N_global; then the gradient sums, clipping and AdamW on the ZeRO shards."""
        self.optimizer.zero_grad(set_to_none=False)
        local = self.local_batch(batch)
        n_tokens = local.n_tokens if planted("local-token-mean") else batch.n_tokens   # plant
        loss_sum = self.with_router_terms(self.pipe.run(local, self.args.grad_accum, n_tokens),
                                          batch)
        grads = self.reduce_grads()
        loss = self.loss_once(loss_sum)
        self.update(grads)
        return loss / batch.n_tokens

    def reduce_grads(self) -> list[torch.Tensor]:
        """The gradient sums after the micro-batches: over dp x cp (ZeRO's reduce-scatter, which
        also shards them; with HSDP over the shard group, then the shards over the replicas),
        over tp for the partial gradients (norms under SP, replicated kv heads), over the tied
        pair (first stage's embedding, last stage's head copy)."""
        g = self.groups
        with phase("backward"):
            self.optimizer.reduce_gradients()
            grads = self.optimizer.grad_shards()
            if not planted("sp-partials-unreduced"):   # plant: norms' partials left unsummed
                self._reduce_slices(grads, self.partial_slices, g["tp"])
            if g["tied"] is not None and (self.first or self.last) \
                    and not planted("tied-sync-skipped"):   # plant: the tie forgotten
                dist.all_reduce(grads[0] if self.first else grads[-1], group=g["tied"])
            if "replicate" in g and not planted("replicas-not-summed"):   # plant: HSDP's sum
                all_reduce_flat([gr for gr, u in zip(grads, self.zero.units)
                                 if u.group is self.zero.group], g["replicate"])
        return grads

    def eval_sum(self, batch: Batch) -> float:
        """The global CE sum of a held-out batch: forwards only, through the same split."""
        self.model.eval()   # (no dropout in a held-out loss)
        try:
            ce = self.pipe.evaluate(self.local_batch(batch), self.args.grad_accum)
        finally:
            self.model.train()
        return self.loss_once(ce)

    def with_router_terms(self, loss_sum, batch: Batch):
        """The step's CE sum plus this rank's share of the MoE router losses (scaled to a sum
        over the batch's tokens), for the logged objective; the CE sum alone without MoE."""
        return loss_sum + compose_moe.logged_terms(self.blocks) * batch.n_tokens

    def loss_once(self, loss_sum: torch.Tensor) -> float:
        """The global CE sum (logging): every tp rank computed the same one, so count it once."""
        return global_loss(loss_sum if self.first_in([self.groups["tp"]]) else loss_sum * 0, 1)

    def learning_rate(self, step: int) -> float:
        return lr_at(step, self.args)

    def update(self, grads: list[torch.Tensor]):
        """Clip by the global norm, AdamW on the shards at this step's learning rate, all-gather
        the updated parameters."""
        with phase("optimizer"):
            self.grad_norm = self.last_norm = self.clip(grads, self.args.clip)
            t = self.t + 1 if planted("lr-one-step-ahead") else self.t   # plant
            self.optimizer.param_groups[0]["lr"] = lr_at(t, self.args)
            self.optimizer.step()     # AdamW on the edited shards, then the all-gather
        compose_moe.after_step(self.blocks, self.args)   # (the aux-free bias)
        self.t += 1

    @staticmethod
    def _reduce_slices(grads, slices, group):
        if dist.get_world_size(group) > 1:
            all_reduce_flat([grads[i][a:b] for i, sl in enumerate(slices)
                                    for a, b in sl], group)

    def clip(self, grads, max_norm: float) -> float:
        """The global gradient norm over all four dimensions (one scalar all-reduce over the
        world), and clipping by it when max_norm > 0 (torch's clip_grad_norm_ formula)."""
        sq = torch.zeros(1, dtype=torch.float64, device=grads[0].device)
        for gr, sl in zip(grads, self.norm_slices):
            for a, b in sl:
                sq += gr[a:b].double().pow(2).sum()
        over_shards_only = planted("clip-norm-misses-pp")   # plant: each stage's own norm
        dist.all_reduce(sq, group=self.groups["dpcp"] if over_shards_only else None)
        return clip_by_norm(sq, grads, max_norm)

    # -- full tensors (collective) --
    def _full(self, stage_tensors: dict) -> dict[str, torch.Tensor]:
        """This stage's TP-local tensors -> full tensors of the whole model on every rank."""
        if self.moe:
            stage_tensors = ep_moe.gather_experts(stage_tensors, self.groups["ep"])
        if self.tp is not None:
            stage_tensors = self.tp.full(stage_tensors)
        parts = [None] * self.grid.size["pp"]
        with METER.paused():
            dist.all_gather_object(parts, {n: t.detach().cpu() for n, t in stage_tensors.items()},
                                   group=self.groups["pp"])
        out = {}
        for part in parts:
            out.update(part)
        if self.tied:
            out.pop(self.pipe.head_weight, None)   # the reference holds one tied tensor
        return {n: t.to(self.env.device) for n, t in out.items()}

    def local(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full tensor: its experts, its TP shard."""
        if self.moe:
            t = compose_moe.expert_local(name, t, self.args.ep, dist.get_rank(self.groups["ep"]))
        return self.tp.local(name, t) if self.tp is not None else t

    def _stage_tensors(self, shards) -> dict[str, torch.Tensor]:
        with METER.paused():
            return self.zero.gather_flat(shards)

    def full_grads(self):
        return self._full(self._stage_tensors([u.grad_shard for u in self.zero.units]))

    def full_params(self):
        return self._full(self._stage_tensors([u.shard for u in self.zero.units]))

    def model_states(self):
        z = self.zero
        return {"params": [u.shard if z.stage == 3 else u.full for u in z.units],
                "grads": z.grad_tensors(), "optimizer": self.optimizer.state_tensors()}

    def memory_formula(self):
        """ZeRO's formula on this rank's units: its stage's layers, TP-local, over dp x cp."""
        return zero.state_bytes(self.zero, self.optimizer)

    def extra_checks(self):
        rows = []
        if self.tp is not None:   # replicated parameters must stay identical across tp ranks
            rep = [p for n, p in self.model.named_parameters() if n not in self.tp.split_dim]
            with self.zero.gathered():
                spread = spread_across_ranks(rep, self.groups["tp"]) if rep else 0.0
            rows.append(("tp-replicated parameters identical", spread == 0.0,
                         f"max spread {spread:.1e}"))
        return rows

    # -- benchmark: communication formulas per group (trainer4d/comm.py) --
    def expected_comm(self):
        return comm.expected_comm(self)

    def report_lines(self):
        lines = [f"rank grid {self.grid.size}, order {self.grid.order} (innermost first); "
                 f"this rank {self.me}; stage layers "
                 f"{[list(self.pipe.bounds[c]) for c in self.pipe.mine]}"]
        bench = getattr(self, "bench", None)
        if bench:
            lines.append(mfu_line(self.model.config, self.args, self.env, bench["step_s"]))
        return lines


if __name__ == "__main__":
    import sys
    if sys.argv[1:2] == ["plan"]:       # the elastic batch planner (no process group)
        sys.exit(elastic.plan_main(sys.argv[2:]))
    main(Compose4D)
