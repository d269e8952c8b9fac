"""compose4d.py: DP x TP(+SP) x PP x CP training of an HF Llama, composed from the strategy files.

    torchrun --nproc_per_node=8 compose4d.py --tp 2 --pp 2 --cp 2                # correctness
    torchrun --nproc_per_node=8 compose4d.py --tp 2 --pp 2 --cp 2 --sp --mode benchmark
    torchrun --nproc_per_node=4 compose4d.py --tp 2 --pp 2 --mode train --steps 200 \\
        --lr-schedule cosine --lr-warmup 20 --save ckpt --export-hf hf_out
    torchrun --nproc_per_node=2 compose4d.py --pp 2 --mode train --steps 300 --resume ckpt

Nothing here re-implements a parallelism; the blocks come from their own files:
    tp.TensorParallel      Megatron column/row-parallel layers, vocab-parallel embedding and loss
    sp.SPRegion            Megatron sequence parallelism (--sp): all-gather / reduce-scatter at the
                           region edges; sp.shard_residual_stream splits the residual stream
    cp_ring.CPContext      zig-zag ring attention over the cp group, through HF's attention registry
    pp.Pipeline            the stage split and the 1F1B / interleaved executor, over the pp group;
                           with P = 1 it is plain gradient accumulation over the micro-batches
    zero.Zero, ShardAdamW  ZeRO-1 (default) or ZeRO-2 over the dp x cp group
What is here: the rank grid and its groups, the step that strings the blocks together, gradient
clipping across all four dimensions, layout-independent checkpoints and the HF export.
The correctness reference takes its learning-rate schedule from torch.optim.lr_scheduler
(torch_schedule), not from our lr_at; the planted bugs (`--plant-bug NAME`, Compose4D.plants) show
that the correctness mode catches what a one-line slip in this file would break.

Rank grid (Fast-LLM's arithmetic)
    rank = tp + T * (cp + C * (dp + D * pp)): TP innermost (inside a node), then CP, then DP, PP
    outermost; --pipeline-first swaps PP inside DP (rank = tp + T * (cp + C * (pp + P * dp))).
    D = W / (T P C). Groups, created on every rank in this order: tp, cp, dp, pp, dp x cp, and the
    tied-embedding pairs (first and last stage of each pipeline) when the embeddings are tied.
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

Communication per step (N_r = tokens per rank per step = B S / (D C), H hidden, b bytes, L layers,
M micro-batches, Psi_r = parameters held per rank = about Psi / (T P))
    tp group     TP: (4 L_stage + 2) all-reduces of N_r H b (+3 of N_r b for the loss); with SP
                 they become all-gathers / reduce-scatters of the same size (tp.py, sp.py)
    cp group     per layer (C-1) forward hops of K,V and (C-1) backward hops of K,V,dK,dV (cp_ring)
    pp group     2 M (activation + gradient) sends of N_r H b / (M T_sp) per stage boundary (pp.py)
    dp x cp      ZeRO-1: one reduce-scatter + one all-gather of Psi_r b; ZeRO-2: reduce-scatters
                 per micro-batch (M Psi_r b) (zero.py)
    world        one 8-byte all-reduce of the squared gradient norm

Checkpoints (--save DIR, --resume DIR)
    Layout-independent: the ranks with dp x cp rank 0 each write their (pp, tp) slice as
    per-parameter TP-local tensors (parameters, or fp32 masters under mixed precision, and AdamW's
    two moments) with the split dimension of each; a run at any other (dp, tp, pp, cp) reads all
    slices, rebuilds full tensors, and slices them its own way. The data position is the step
    index (the synthetic data is a function of it). Atomic: everything is written into
    DIR/.tmp-step-N, renamed to DIR/step-N, and only then does DIR/latest (replaced with
    os.replace) name it, so a crash never leaves a half-written "latest".
--export-hf DIR writes the full model with save_pretrained; AutoModelForCausalLM.from_pretrained
    loads it and gives the same logits.
"""
import copy
import json
import math
import os
import shutil
import signal
import time

import torch
import torch.distributed as dist

import common
import cp_ring
import elastic
import pp
import sp
import tp
import zero
from common import Expect, phase


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


def make_groups(grid: Grid, rank: int, tied: bool) -> dict:
    """tp, cp, dp, pp, dp x cp (and the tied pairs): every rank creates every group, same order."""
    out = {}
    for name, dims in (("tp", ("tp",)), ("cp", ("cp",)), ("dp", ("dp",)), ("pp", ("pp",)),
                       ("dpcp", ("dp", "cp"))):
        mine, _ = dist.new_subgroups_by_enumeration(grid.groups_over(dims))
        out[name] = common.name_group(mine, name)
    out["tied"] = None
    P = grid.size["pp"]
    if tied and P > 1:
        pairs = [[g[0], g[-1]] for g in grid.groups_over(("pp",))]
        mine, _ = dist.new_subgroups_by_enumeration(pairs)
        out["tied"] = common.name_group(mine, "tied")
    return out


# ----------------------------------------------------------------------------------------------
# Learning-rate schedule
# ----------------------------------------------------------------------------------------------
def lr_at(step: int, args) -> float:
    """Linear warm-up over --lr-warmup steps, then constant or cosine down to --lr-min-ratio x lr
    at --steps."""
    if step < args.lr_warmup:
        return args.lr * (step + 1) / args.lr_warmup
    if args.lr_schedule == "constant":
        return args.lr
    span = max(1, args.steps - args.lr_warmup)
    t = min(1.0, (step - args.lr_warmup) / span)
    lo = args.lr * args.lr_min_ratio
    return lo + (args.lr - lo) * 0.5 * (1 + math.cos(math.pi * t))


def torch_schedule(optimizer, args):
    """The same schedule from torch.optim.lr_scheduler, for the reference: an oracle that shares
    no code with lr_at (a bug there, e.g. the schedule one step ahead, cannot hide by appearing on
    both sides). Stepped once per optimizer step, after it, so step k runs at factor:
        warm-up   LinearLR from 1/W to 1 over W - 1 steps: (k + 1) / W for k < W
        cosine    CosineAnnealingLR from lr at step W to lr_min_ratio x lr at step --steps
        constant  LinearLR stays at its end factor 1 (no scheduler at all without warm-up)
    None when the learning rate is constant throughout."""
    from torch.optim import lr_scheduler as S
    W, phases = args.lr_warmup, []
    if W > 0:
        phases.append(S.LinearLR(optimizer, start_factor=1.0 / W, end_factor=1.0,
                                 total_iters=max(1, W - 1)))
    if args.lr_schedule == "cosine":
        phases.append(S.CosineAnnealingLR(optimizer, T_max=max(1, args.steps - W),
                                          eta_min=args.lr * args.lr_min_ratio))
    if len(phases) == 2:
        return S.SequentialLR(optimizer, phases, milestones=[W])
    return phases[0] if phases else None


class ScheduledReference(common.Reference):
    """The single-device reference, its learning rate scheduled by torch (torch_schedule)."""

    def __init__(self, ref_model, args, env):
        super().__init__(ref_model, args, env)
        self.scheduler = torch_schedule(self.optimizer, args)

    def step(self, batch):
        loss = super().step(batch)
        if self.scheduler is not None:
            self.scheduler.step()
        return loss


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
    if args.mode == "train" and args.elastic:     # re-plan first: it sets batch and grad-accum
        plan = replan(world, config, args)
        if not plan.feasible:
            return [f"--elastic: {plan.why}"]
        args = copy.copy(args)
        args.batch, args.grad_accum, args.zero = plan.global_batch, plan.grad_accum, plan.zero
        M = args.grad_accum
    if args.dp is not None and args.dp != D:
        return [f"world size {world} is not dp x tp x pp x cp = {args.dp} x {T} x {P} x {C} = "
                f"{args.dp * T * P * C}"]
    if getattr(config, "num_local_experts", None):
        return ["compose4d composes dense Llama models; MoE (--ep) is not implemented"]
    errs = tp.tp_constraints(args, T, config) if T > 1 else []
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
    if args.schedule == "interleaved" and args.zero == 2:
        return ["--zero 2 reduce-scatters per micro-batch and needs each micro-batch's backward "
                "of a stage in one piece: use --schedule 1f1b"]
    if args.batch % (D * M):
        return [f"global batch {args.batch} is not divisible by dp x grad-accum = {D} x {M}"]
    if args.length % (2 * C):
        return [f"sequence length {args.length} is not divisible by 2 x cp = {2 * C} (zig-zag "
                f"chunks)"]
    if args.sp and (args.length // C) % T:
        return [f"--sp: the {args.length // C} tokens per cp rank are not divisible by tp = {T}"]
    if args.zero not in (1, 2):
        return [f"--zero must be 1 or 2 (got {args.zero})"]
    if args.attn != "sdpa":
        return ["compose4d runs decoder layers itself (pp.Pipeline) with sdpa (--attn sdpa)"]
    if args.resume and not os.path.isdir(args.resume) and args.resume != args.save:
        # (--save D --resume D is the restart idiom: the first launch finds no D yet)
        return [f"--resume {args.resume}: no such directory"]
    return []


# ----------------------------------------------------------------------------------------------
# The composed strategy
# ----------------------------------------------------------------------------------------------
TIED_MODEL = "configs/tiny-tied.json"     # the tiny preset with tied embeddings (planted bugs)


class Compose4D(common.Strategy):
    name = "4d"
    reference = ScheduledReference
    # Realistic one-line bugs, each beside the line it breaks (grep the name), and the
    # configuration in which correctness mode must FAIL with it (tests/test_plants.py). Scale
    # and norm bugs are judged in float32 with clipping (clipping must not hide them); the cp
    # configuration also runs a non-constant schedule (warm-up, then cosine), so the lr oracle
    # has work to do; the tp and pp ones use tied embeddings (the pair synced across stages).
    _CP = ("--cp", "2", "--dtype", "float32", "--clip", "0.5",
           "--lr-schedule", "cosine", "--lr-warmup", "2", "--steps", "3")
    _TP = ("--tp", "2", "--sp", "--model", TIED_MODEL)
    _PP = ("--pp", "2", "--dtype", "float32", "--clip", "0.5", "--model", TIED_MODEL)
    plants = {
        "lr-one-step-ahead": common.Plant(
            "step k runs at the schedule's learning rate for step k + 1", _CP),
        "grad-sum-misses-cp": common.Plant(
            "ZeRO reduces (and shards) over the dp group instead of dp x cp: the gradient "
            "misses the other cp ranks' tokens", _CP),
        "cp-local-positions": common.Plant(
            "RoPE positions 0..S/C-1 for the local zig-zag chunks instead of their global "
            "positions", _CP),
        "local-token-mean": common.Plant(
            "each rank divides its CE sum by its own token count instead of the global "
            "batch's (a mean of per-rank means)", _CP),
        "sp-partials-unreduced": common.Plant(
            "the partial gradients of the norms under SP are not summed over tp", _TP),
        "clip-norm-misses-pp": common.Plant(
            "the global gradient norm summed over the ZeRO shards (dp x cp) only, not over "
            "the pp stages (and tp ranks): each stage clips by its own part", _PP),
        "tied-sync-skipped": common.Plant(
            "the first stage's embedding and the last stage's head copy of the tied weight "
            "are not summed: each updates with its own part of the gradient", _PP),
    }

    @staticmethod
    def add_args(p):
        p.add_argument("--dp", type=int, default=None,
                       help="data-parallel size D (default: W / (tp pp cp)); checked if given")
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel size T")
        p.add_argument("--pp", type=int, default=1, help="pipeline stages P")
        p.add_argument("--cp", type=int, default=1, help="context-parallel size C (zig-zag ring)")
        p.add_argument("--sp", action="store_true", help="Megatron sequence parallelism in TP")
        p.add_argument("--pipeline-first", action="store_true",
                       help="PP inside DP in the rank grid (default: PP outermost)")
        p.add_argument("--schedule", default="1f1b", choices=["1f1b", "interleaved"])
        p.add_argument("--virtual-stages", type=int, default=2, help="V for --schedule interleaved")
        p.add_argument("--zero", type=int, default=1, help="ZeRO stage over dp x cp: 1 or 2")
        p.add_argument("--grad-accum", type=int, default=1,
                       help="micro-batches per step per replica (the pipeline's M)")
        p.add_argument("--lr-schedule", default="constant", choices=["constant", "cosine"])
        p.add_argument("--lr-warmup", type=int, default=0, help="linear warm-up steps")
        p.add_argument("--lr-min-ratio", type=float, default=0.1, help="cosine floor / lr")
        p.add_argument("--save", default=None, help="train mode: checkpoint directory")
        p.add_argument("--save-every", type=int, default=0, help="steps between saves (0: end)")
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
                       help="seconds between SIGTERM and the forced kill (reported)")
        p.add_argument("--test-sigterm-at", default=None,
                       help="test hook STEP:MB: rank 0 sends SIGTERM to the launcher after "
                            "that micro-batch")
        p.add_argument("--test-crash-in-save", action="store_true",
                       help="test hook: exit hard in the middle of a save")

    constraints = staticmethod(compose_constraints)

    def __init__(self, model, args, env):
        self.args, self.env, self.model = args, env, model
        T, P, C = args.tp, args.pp, args.cp
        self.grid = Grid(env.world, T, P, C, args.pipeline_first)
        self.me = self.grid.coords(env.rank)
        self.name = (f"4d-dp{self.grid.size['dp']}-tp{T}{'sp' if args.sp else ''}-pp{P}-cp{C}"
                     f"-zero{args.zero}")
        self.tied = model.lm_head.weight is model.model.embed_tokens.weight
        g = self.groups = make_groups(self.grid, env.rank, self.tied)
        # Tensor (and sequence) parallelism: split the linear layers, the vocabulary, the loss.
        self.tp, self.partial = None, []
        if T > 1:
            region = sp.SPRegion(g["tp"]) if args.sp else tp.TPRegion(g["tp"])
            self.tp = tp.TensorParallel(model, g["tp"], region)
            self.partial = list(self.tp.partial_grads)
            if args.sp:
                self.partial += sp.shard_residual_stream(model, g["tp"])
        # Context parallelism: ring attention over the cp group, this rank's zig-zag tokens.
        self.pos = None
        if C > 1:
            cp = cp_ring.CPContext("zigzag", g["cp"], args.length)
            cp_ring.install(model, cp)
            self.pos = cp_ring.positions(cp.chunks[self.me["cp"]]).to(env.device)
        # Pipeline: this rank's stage (drops the other layers), over the pp group.
        V = args.virtual_stages if args.schedule == "interleaved" else 1
        self.pipe = pp.Pipeline(model, P, V, self.me["pp"], args.schedule, group=g["pp"],
                                tie_group=g["tied"])
        self.pipe.positions = None if args.plant_bug == "cp-local-positions" else self.pos
        self.pipe.seq_shards = T if args.sp else 1
        if self.tp is not None:
            self.pipe.loss_sum = self.tp.loss_sum
        self.first, self.last = 0 in self.pipe.mine, self.pipe.C - 1 in self.pipe.mine
        # ZeRO over dp x cp, on this stage's (TP-sharded) parameters; gradients summed.
        zgroup = g["dp"] if args.plant_bug == "grad-sum-misses-cp" else g["dpcp"]
        self.zero = zero.Zero(model, group=zgroup, stage=args.zero, average=False,
                              units=self._units())
        self.optimizer = zero.ShardAdamW([u.shard for u in self.zero.units], args.lr,
                                         args.weight_decay)
        self._plan_shard_slices()
        self.t = 0              # optimizer steps taken (the schedule's position)
        self.last_norm = float("nan")
        coords = [None] * env.world          # every rank's coordinates, printed once at start
        with common.METER.paused():
            dist.all_gather_object(coords, self.me)
        if env.is_main:
            print(f"rank grid {self.grid.size}, innermost first {self.grid.order}:", flush=True)
            for r, c in enumerate(coords):
                print(f"  rank {r}: " + " ".join(f"{d}={c[d]}" for d in self.grid.order),
                      flush=True)

    def _units(self):
        """ZeRO units of this stage in forward order; the tied head copy is a unit of its own, so
        its flat layout (and shards) match the embedding's on the first stage."""
        base, units = self.model.model, []
        if self.first:
            units.append(("embed", [base.embed_tokens]))
        units += [(f"layers.{i}", [base.layers[i]]) for c in self.pipe.mine
                  for i in self.pipe.bounds[c]]
        if self.last:
            units.append(("norm", [base.norm]))
            if not (self.tied and self.first):
                units.append(("head", [self.model.lm_head]))
        return units

    def _plan_shard_slices(self):
        """Per unit, which (start, end) ranges of this rank's gradient shard are (a) partial over
        tp (summed there), and (b) counted in the global norm."""
        partial = {id(p) for p in self.partial}
        tp_rank = self.me["tp"]
        self.partial_slices, self.norm_slices = [], []
        for u in self.zero.units:
            lo, s = u.rank * u.shard_numel, u.shard_numel
            ps, ns = [], []
            for n, p, off in zip(u.names, u.params, u.offsets):
                a, b = max(off, lo), min(off + p.numel(), lo + s)
                if a >= b:
                    continue
                if id(p) in partial:
                    ps.append((a - lo, b - lo))
                split = self.tp is not None and n in self.tp.split_dim
                head_copy = self.tied and n == "lm_head.weight"
                if (split or tp_rank == 0) and not head_copy:
                    ns.append((a - lo, b - lo))
            self.partial_slices.append(ps)
            self.norm_slices.append(ns)

    # -- the step --
    def local_batch(self, batch: common.Batch) -> common.Batch:
        return self._cp_tokens(batch.shard(self.me["dp"], self.grid.size["dp"]))

    def _cp_tokens(self, b: common.Batch) -> common.Batch:
        """This rank's zig-zag tokens of every sequence (all of them without CP)."""
        if self.pos is None:
            return b
        return common.Batch(b.input_ids[:, self.pos], b.labels[:, self.pos], b.index)

    def step(self, batch: common.Batch) -> float:
        loss, _ = self.elastic_step(batch)
        return loss

    def elastic_step(self, batch: common.Batch, rows=None, mb=None, stop=None, partial=None):
        """One optimizer step over the global batch's rows `rows` (default: all of them, split
        into contiguous dp shares of --grad-accum micro-batches; else each dp rank takes its
        contiguous share of `rows` in micro-batches of at most `mb`). `stop(m) -> bool`, asked
        on every rank before forward m (pp.Pipeline.stop_check), may end the step once micro-
        batches 0..m-1 are drained: the gradients are then reduced and kept, nothing is updated,
        and the processed rows are returned, for a mid-step checkpoint. `partial`:
        a restored mid-step gradient (sum over the rows already done) to start from.
        Returns (global loss or None when cut, processed rows or None)."""
        z, g, D = self.zero, self.groups, self.grid.size["dp"]
        plant = self.args.plant_bug
        z.zero_grad()
        if partial is not None:
            self._add_partial(partial)
        if rows is None:
            local, mbs = self.local_batch(batch), None
            M, my_rows = self.args.grad_accum, None
        else:
            my_rows = [list(r) for r in _split_even(rows, D)][self.me["dp"]]
            full = self._cp_tokens(common.Batch(batch.input_ids[my_rows],
                                                batch.labels[my_rows], batch.index))
            mbs = [full.rows(i, min(i + mb, len(my_rows))) for i in range(0, len(my_rows), mb)]
            local, M = full, len(mbs)
        self.pipe.stop_check = stop
        n_tokens = local.n_tokens if plant == "local-token-mean" else batch.n_tokens
        if M:
            loss_sum = self.pipe.run(local, M, n_tokens, mbs=mbs)
        else:   # nothing left for this dp rank (a resumed step): reductions only
            loss_sum = torch.zeros((), dtype=torch.float64, device=self.env.device)
        with phase("backward"):
            z.finish()                              # summed over dp x cp, sharded
            grads = [u.grad_shard for u in z.units]
            if plant != "sp-partials-unreduced":
                self._reduce_slices(grads, self.partial_slices, g["tp"])  # SP / MQA partials
            if g["tied"] is not None and (self.first or self.last) \
                    and plant != "tied-sync-skipped":                     # embedding + head copy
                dist.all_reduce(grads[0] if self.first else grads[-1], group=g["tied"])
        # every tp rank computed the same loss: count it once
        loss = common.global_loss(loss_sum if self.me["tp"] == 0 else loss_sum * 0, 1)
        if stop is not None and self.pipe.completed < M:      # cut: keep the gradients
            done = self._processed(batch, rows, self.pipe.completed)
            return None, (done, loss)
        with phase("optimizer"):
            self.grad_norm = self.last_norm = self.clip(grads, self.args.clip)
            t = self.t + 1 if plant == "lr-one-step-ahead" else self.t
            self.optimizer.lr = lr_at(t, self.args)
            self.optimizer.step(grads)
            z.all_gather_params()
        self.t += 1
        return loss / batch.n_tokens, None

    def _processed(self, batch, rows, k) -> list[int]:
        """Global rows done when every dp rank has run its first k micro-batches (fresh step)."""
        D, M = self.grid.size["dp"], self.args.grad_accum
        n = batch.input_ids.shape[0] // D
        mb = n // M
        return [d * n + i for d in range(D) for i in range(k * mb)]

    def _add_partial(self, full: dict[str, torch.Tensor]):
        """Put a restored partial gradient where this layout's reductions count it exactly once:
        on dp x cp rank 0 (ZeRO-1's full buffers; ZeRO-2: each rank's own shard of it); for
        tp-partial (SP norm) gradients on tp rank 0 only; for the tied head copy on the first
        stage only."""
        z = self.zero
        if self.args.zero == 1 and dist.get_rank(self.groups["dpcp"]) != 0:
            return            # ZeRO-1 sums full buffers over dp x cp: add it on one rank
        partial = {id(p) for p in self.partial}
        for u in z.units:
            flat = torch.zeros(u.padded, dtype=u.full.dtype, device=u.full.device)
            for n, p, off in zip(u.names, u.params, u.offsets):
                if (id(p) in partial and self.me["tp"] != 0) or \
                        (self.tied and n == "lm_head.weight"):
                    continue
                t = full[n].to(flat.device, flat.dtype)
                if self.tp is not None:
                    t = self.tp.local(n, t)
                flat[off:off + p.numel()] = t.reshape(-1)
            if self.args.zero == 1:
                u.grad_full.add_(flat)      # reduce-scattered (summed) with this step's own
            else:
                u.grad_shard.add_(flat[u.rank * u.shard_numel:(u.rank + 1) * u.shard_numel])

    @staticmethod
    def _reduce_slices(grads, slices, group):
        if dist.get_world_size(group) > 1:
            common.all_reduce_flat([grads[i][a:b] for i, sl in enumerate(slices)
                                    for a, b in sl], group)

    def clip(self, grads, max_norm: float) -> float:
        """The global gradient norm over all four dimensions (one scalar all-reduce over the
        world), and clipping by it when max_norm > 0 (torch's clip_grad_norm_ formula)."""
        sq = torch.zeros(1, dtype=torch.float64, device=grads[0].device)
        for gr, sl in zip(grads, self.norm_slices):
            for a, b in sl:
                sq += gr[a:b].double().pow(2).sum()
        over_shards_only = self.args.plant_bug == "clip-norm-misses-pp"
        dist.all_reduce(sq, group=self.groups["dpcp"] if over_shards_only else None)
        norm = common.scalar(sq.sqrt())
        if max_norm > 0:
            coef = min(1.0, max_norm / (norm + 1e-6))
            if coef < 1.0:
                for gr in grads:
                    gr.mul_(coef)
        return norm

    # -- full tensors (collective) --
    def _full(self, stage_tensors: dict) -> dict[str, torch.Tensor]:
        """This stage's TP-local tensors -> full tensors of the whole model on every rank."""
        if self.tp is not None:
            stage_tensors = self.tp.full(stage_tensors)
        parts = [None] * self.grid.size["pp"]
        with common.METER.paused():
            dist.all_gather_object(parts, {n: t.detach().cpu() for n, t in stage_tensors.items()},
                                   group=self.groups["pp"])
        out = {}
        for part in parts:
            out.update(part)
        if self.tied:
            out.pop("lm_head.weight", None)   # the reference holds one tied tensor
        return {n: t.to(self.env.device) for n, t in out.items()}

    def _stage_tensors(self, shards) -> dict[str, torch.Tensor]:
        with common.METER.paused():
            return self.zero.gather_flat(shards)

    def full_grads(self):
        return self._full(self._stage_tensors([u.grad_shard for u in self.zero.units]))

    def full_params(self):
        return self._full(self._stage_tensors([u.shard for u in self.zero.units]))

    def model_states(self):
        z = self.zero
        grads = ([u.grad_full for u in z.units] if self.args.zero == 1
                 else [u.grad_shard for u in z.units])
        return {"params": [u.full for u in z.units], "grads": grads,
                "optimizer": self.optimizer.state_tensors()}

    def extra_checks(self):
        rows = []
        if self.tp is not None:   # replicated parameters must stay identical across tp ranks
            rep = [p for n, p in self.model.named_parameters() if n not in self.tp.split_dim]
            spread = common.spread_across_ranks(rep, self.groups["tp"]) if rep else 0.0
            rows.append(("tp-replicated parameters identical", spread == 0.0,
                         f"max spread {spread:.1e}"))
        return rows

    # -- benchmark: communication formulas per group --
    def expected_comm(self):
        a, cfg = self.args, self.model.config
        T, P, C, M = a.tp, a.pp, a.cp, a.grad_accum
        D = self.grid.size["dp"]
        b = common.DTYPES[a.dtype].itemsize
        H = cfg.hidden_size
        n_tok = a.batch // D * a.length // C          # tokens per rank per step
        L_st = sum(len(self.pipe.bounds[c]) for c in self.pipe.mine)
        z = self.zero
        padded = sum(u.padded for u in z.units)
        rows = []
        rs = M if a.zero == 2 else 1   # (over a group of one as well: zero.py does not skip)
        rows += [Expect("reduce_scatter_tensor", "dpcp", len(z.units) * rs, padded * b * rs,
                        f"ZeRO-{a.zero}: Psi_r*b = {padded * b:,} B, one per unit"
                        + (f", x{M} micro-batches" if rs > 1 else "")),
                 Expect("all_gather_into_tensor", "dpcp", len(z.units), padded * b,
                        "updated parameters, one per unit")]
        rows.append(Expect("all_reduce", "world", 1, 8, "global gradient norm (fp64)"))
        if P > 1:
            act = (a.batch // D // M) * (a.length // C // (T if a.sp else 1)) * H * b
            n = sum(1 for c in self.pipe.mine if c < self.pipe.C - 1) * M \
                + sum(1 for c in self.pipe.mine if c > 0) * M
            rows += [Expect("isend", "pp", n, n * act, f"M activations out + gradients back per "
                            f"boundary, {act:,} B each"),
                     Expect("irecv", "pp", n, n * act, "the mirror of the sends")]
            if self.groups["tied"] is not None and (self.first or self.last):
                rows.append(Expect("all_reduce", "tied", 1, z.units[0 if self.first else -1]
                                   .shard_numel * b, "tied embedding gradient shard"))
        if C > 1:
            hd = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
            blk = (a.batch // D // M) * (a.length // C) * 2 * (cfg.num_key_value_heads // T) * hd * b
            per = (C - 1) * blk + (C - 1) * 2 * blk + blk
            rows += [Expect(op, "cp", M * L_st * (3 * (C - 1) + 1), M * L_st * per,
                            "ring attention per layer and micro-batch: (C-1) K,V hops forward, "
                            "(C-1) K,V,dK,dV hops backward, dK,dV home") for op in ("isend", "irecv")]
        if T > 1:
            nhb = n_tok * H * b
            head = int(self.last)
            if a.sp:
                ag = M * (6 * L_st + 2 * head + int(self.first))   # sp.py: 6L+3 per model
                rs_ = M * (4 * L_st + head)
                rows += [Expect("all_gather_into_tensor", "tp", ag, ag * nhb // M,
                                "SP: region entries (fwd), re-gathers and row exits (bwd)"),
                         Expect("reduce_scatter_tensor", "tp", rs_, rs_ * nhb // M,
                                "SP: row exits (fwd), region entries (bwd)")]
        return rows + (self._tp_allreduce_rows(M, b, n_tok) if T > 1 else [])

    def _tp_allreduce_rows(self, M, b, n_tok):
        a, cfg = self.args, self.model.config
        H = cfg.hidden_size
        L_st = sum(len(self.pipe.bounds[c]) for c in self.pipe.mine)
        nhb_mb = n_tok // M * H * b
        b_ce = 4 if a.dtype == "bfloat16" else b
        calls = nbytes = 0
        if self.first:
            calls, nbytes = calls + M, nbytes + M * nhb_mb            # embedding
        if self.last:
            calls, nbytes = calls + 3 * M, nbytes + 3 * M * n_tok // M * b_ce   # loss
        if not a.sp:
            calls += M * (4 * L_st + int(self.last))
            nbytes += M * (4 * L_st + int(self.last)) * nhb_mb
        psl = sum(b_ - a_ for sl in self.partial_slices for a_, b_ in sl)
        if psl:
            calls, nbytes = calls + 1, nbytes + psl * b
        return [Expect("all_reduce", "tp", calls, nbytes,
                       "TP: embedding + loss (3 x N b) per micro-batch"
                       + ("" if a.sp else " + 2 f and 2 g per layer (+ the head's f)")
                       + (" + partial (norm) gradient shards" if psl else ""))]

    def report_lines(self):
        lines = [f"rank grid {self.grid.size}, order {self.grid.order} (innermost first); "
                 f"this rank {self.me}; stage layers "
                 f"{[list(self.pipe.bounds[c]) for c in self.pipe.mine]}"]
        bench = getattr(self, "bench", None)
        if bench:
            lines.append(mfu_line(self.model.config, self.args, self.env, bench["step_s"]))
        return lines


# Dense bf16 peak FLOP/s per GPU (vendor datasheets, without sparsity), for MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def model_flops(config, tokens: int, seq: int) -> float:
    """Training FLOPs of one step (Megatron's accounting, Narayanan et al. 2021): 6 per parameter
    per token for the matmuls (2 forward, 4 backward) + causal attention's scores and values
    12 L h s per token (counted in full, as is customary), no recomputation."""
    h, L, V, I = (config.hidden_size, config.num_hidden_layers, config.vocab_size,
                  config.intermediate_size)
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    matmul = L * (2 * h * h + 2 * h * kv + 3 * h * I) + V * h      # per token, forward MACs
    return tokens * (6 * matmul + 12 * L * h * seq)


def mfu_line(config, args, env, step_s: float) -> str:
    flops = model_flops(config, args.batch * args.length, args.length)
    achieved = flops / step_s / env.world
    line = (f"model FLOPs/step = 6 Psi_matmul T + 12 L h S T (T tokens) = {flops:.3e}; achieved "
            f"{achieved / 1e12:.3f} TFLOP/s per rank")
    if env.device.type == "cuda":
        name = torch.cuda.get_device_name(env.device)
        peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
        line += (f"; MFU {achieved / peak:.1%} of {name}'s {peak / 1e12:.0f} TFLOP/s (bf16 dense)"
                 if peak else f"; MFU: no peak known for {name}")
    else:
        line += " (CPU: no MFU)"
    return line


def _split_even(rows, parts):
    """Contiguous shares of `rows`, as even as possible (the first ones one larger)."""
    q, r = divmod(len(rows), parts)
    out, i = [], 0
    for p in range(parts):
        n = q + (1 if p < r else 0)
        out.append(rows[i:i + n])
        i += n
    return out


# ----------------------------------------------------------------------------------------------
# Checkpoints: layout-independent, atomic
# ----------------------------------------------------------------------------------------------
def _tp_split(strat, name):
    return None if strat.tp is None else strat.tp.split_dim.get(name)


def _write_synced(path: str, text: str):
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(strat: Compose4D, root: str, step: int, extra: dict | None = None,
                    grads: bool = False) -> str:
    """Collective. Returns the step directory. `extra` goes into meta.json (data position,
    restarts, a cut step's position); `grads`: also the reduced gradients of a cut step."""
    env, z, opt = strat.env, strat.zero, strat.optimizer
    t0 = time.time()
    params = opt.master if opt.mixed else [u.shard for u in z.units]
    kinds = {"param": params, "exp_avg": opt.exp_avg, "exp_avg_sq": opt.exp_avg_sq}
    if grads:
        kinds["grad"] = [u.grad_shard for u in z.units]
    with common.METER.paused():
        local = {k: z.gather_flat(v) for k, v in kinds.items()}    # this stage, TP-local
    tmp, final = os.path.join(root, f".tmp-step-{step}"), os.path.join(root, f"step-{step}")
    if env.is_main:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    with common.METER.paused():
        dist.barrier()
    if dist.get_rank(strat.groups["dpcp"]) == 0:
        drop = "lm_head.weight" if strat.tied else None     # the tied copy: saved once, as embed
        rec = {"tp_rank": strat.me["tp"], "tp": strat.args.tp,
               "split": {n: _tp_split(strat, n) for n in local["param"] if n != drop},
               "tensors": {k: {n: t.detach().cpu().clone() for n, t in v.items() if n != drop}
                           for k, v in local.items()}}
        path = os.path.join(tmp, f"pp{strat.me['pp']}-tp{strat.me['tp']}.pt")
        torch.save(rec, path)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    if strat.args.test_crash_in_save:      # test hook: die mid-save, before anything is renamed
        os._exit(1)
    with common.METER.paused():
        dist.barrier()
    if env.is_main:
        meta = dict(step=step, adam_t=opt.t, layout=strat.grid.size, model=strat.args.model,
                    dtype=strat.args.dtype, vocab=strat.model.config.vocab_size,
                    seconds=time.time() - t0, **(extra or {}))
        _write_synced(os.path.join(tmp, "meta.json"), json.dumps(meta))
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)                               # the step is complete ...
        _write_synced(os.path.join(root, "latest.tmp"), os.path.basename(final))
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))  # ... named
    with common.METER.paused():
        dist.barrier()
    return final


def latest_dir(root: str | None) -> str | None:
    """The step directory DIR/latest names, or None when there is no checkpoint yet."""
    if not root or not os.path.isfile(os.path.join(root, "latest")):
        return None
    with open(os.path.join(root, "latest")) as f:
        return os.path.join(root, f.read().strip())


def load_checkpoint(root: str) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """(meta, {kind: {name: full tensor}}) from DIR/latest, whatever layout wrote it."""
    d = latest_dir(root)
    with open(os.path.join(d, "meta.json")) as f:
        meta = json.load(f)
    by_stage: dict[str, list] = {}
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".pt"):
            rec = torch.load(os.path.join(d, fn), weights_only=True)
            by_stage.setdefault(fn.split("-")[0], []).append(rec)
    full: dict[str, dict] = {}
    for recs in by_stage.values():
        recs.sort(key=lambda r: r["tp_rank"])
        for kind in recs[0]["tensors"]:
            for n, dim in recs[0]["split"].items():
                parts = [r["tensors"][kind][n] for r in recs]
                t = parts[0] if dim is None else torch.cat(parts, dim=dim)
                if n in ("model.embed_tokens.weight", "lm_head.weight"):
                    t = t[:meta["vocab"]]             # drop the TP vocabulary padding
                full.setdefault(kind, {})[n] = t
    return meta, full


def restore(strat: Compose4D, meta: dict, full: dict):
    """Parameters, AdamW moments and step counters from full tensors, sliced for this layout."""
    z, opt = strat.zero, strat.optimizer

    def local(kind):
        out = {}
        for u in z.units:
            for n in u.names:
                src = "model.embed_tokens.weight" if (strat.tied and n == "lm_head.weight") else n
                t = full[kind][src].to(u.full.device)
                out[n] = strat.tp.local(n, t) if strat.tp is not None else t
        return out
    with torch.no_grad():
        for shard, new in zip([u.shard for u in z.units], z.flat_shards(local("param"))):
            shard.copy_(new)
        if opt.mixed:
            for m, s in zip(opt.master, [u.shard for u in z.units]):
                m.copy_(s.float())
        for kind, dst in (("exp_avg", opt.exp_avg), ("exp_avg_sq", opt.exp_avg_sq)):
            for d, new in zip(dst, z.flat_shards(local(kind))):
                d.copy_(new.to(d.dtype))
    with common.METER.paused():
        z.all_gather_params()
    opt.t, strat.t = meta["adam_t"], meta["step"]


def export_hf(strat: Compose4D, out: str):
    """Collective: the full trained model as an HF model directory (rank 0 writes)."""
    from transformers import AutoModelForCausalLM
    full = strat.full_params()
    if strat.env.is_main:
        cfg = strat.model.config
        model = AutoModelForCausalLM.from_config(
            type(cfg).from_dict({**cfg.to_dict(), "_attn_implementation": "sdpa"}))
        model.to(common.DTYPES[strat.args.dtype])            # saved in the run's dtype
        missing, unexpected = model.load_state_dict({n: t.cpu() for n, t in full.items()},
                                                    strict=False)
        assert not unexpected and all(m == "lm_head.weight" for m in missing), (missing, unexpected)
        tmp = out.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
    with common.METER.paused():
        dist.barrier()


# ----------------------------------------------------------------------------------------------
# Train mode: a logged run with checkpoints (no reference)
# ----------------------------------------------------------------------------------------------
class Preemption:
    """SIGTERM (from the batch system, or torchrun passing it on) sets a flag; the ranks agree on
    it with one MAX all-reduce at micro-batch (P = 1) and step boundaries, so all of them stop
    after the same micro-batch."""

    def __init__(self):
        self.flag, self.at = False, None
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame):
        self.flag, self.at = True, self.at or time.time()

    def agreed(self, device) -> bool:
        t = torch.tensor([int(self.flag)], dtype=torch.int32, device=device)
        with common.METER.paused():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


def target_batch(args) -> int:
    """The global batch to keep: the checkpoint's, or --batch for a fresh run."""
    d = latest_dir(args.resume)
    if d is None:
        return args.batch
    with open(os.path.join(d, "meta.json")) as f:
        return json.load(f).get("global_batch", args.batch)


def replan(world: int, config, args) -> elastic.Plan:
    """elastic.plan_world for this world size: TP, PP, CP as given, DP absorbs the change.
    Runs before the process group exists (constraints), so an infeasible world ends at once."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        params = common.param_count(AutoModelForCausalLM.from_config(config))
    return elastic.plan_world(
        world, target_batch(args), params=params, hidden=config.hidden_size,
        layers=config.num_hidden_layers, seq=args.length, mem_bytes=args.mem_gib * 2**30,
        tolerance=args.batch_tolerance, max_micro_batch=args.max_micro_batch,
        min_zero=args.zero, max_zero=2, tp=args.tp, pp=args.pp, cp=args.cp)


def run_train(run: common.Run, cls) -> bool:
    """A logged training run with checkpoints; SIGTERM saves (mid-step when P = 1) and exits 0;
    with --elastic the batch is re-planned for the world size the run (re)starts on."""
    args, env = run.args, run.env
    model = common.build_model(args, run.config, env.device)
    meta, full = load_checkpoint(args.resume) if latest_dir(args.resume) else (None, None)
    target = meta.get("global_batch", args.batch) if meta else args.batch
    if args.elastic:     # feasible: checked in compose_constraints
        plan = replan(env.world, run.config, args)
        args.batch, args.grad_accum, args.zero = plan.global_batch, plan.grad_accum, plan.zero
    strat = cls(model, args, env)
    start, offset, restarts, cut = 0, 0, 0, None
    if meta:
        restore(strat, meta, full)
        start, offset = meta["step"], meta.get("samples", meta["step"] * args.batch)
        restarts, cut = meta.get("restarts", 0) + 1, meta.get("cut")
        run.print(f"resumed from {args.resume} at step {start}"
                  + (f", micro-batch position: {len(cut['rows_done'])} of {cut['global_batch']} "
                     f"sequences done" if cut else "")
                  + f" (saved by layout {meta['layout']}, restart {restarts})")
    D = strat.grid.size["dp"]
    mb = args.batch // (D * args.grad_accum)
    run.print(f"train: {strat.name} W={env.world} {args.dtype} model={args.model} "
              f"global batch={args.batch} (target {target}) micro-batch={mb} "
              f"grad-accum={args.grad_accum} length={args.length} steps {start}..{args.steps} "
              f"lr={args.lr} ({args.lr_schedule}, warm-up {args.lr_warmup})")
    pre = Preemption()
    extra = lambda off, **kw: dict(samples=off, global_batch=target, restarts=restarts, **kw)  # noqa
    t0, tok = time.time(), 0
    end = min(args.steps, args.stop_at or args.steps)
    s = start
    while s < end:
        G = cut["global_batch"] if cut else args.batch
        batch = common.make_batch(run.lang, s, G, args.length, env.device, offset=offset)
        rows = partial = None
        if cut:      # finish the step a SIGTERM cut: the rows not done yet, from its gradients
            rows = [r for r in range(G) if r not in set(cut["rows_done"])]
            partial = full["grad"]
        def stop(m, s=s):      # before forward m: micro-batch m - 1 is the last to finish
            if args.test_sigterm_at == f"{s}:{m - 1}" and env.is_main:
                # under torchrun the launcher passes it on to every rank; alone, to ourselves
                os.kill(os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid(),
                        signal.SIGTERM)
                pre.flag = True
            return pre.agreed(env.device)
        mid_step = rows is None and args.save and args.schedule == "1f1b"   # (V = 1)
        loss, stopped = strat.elastic_step(batch, rows, mb, stop if mid_step else None, partial)
        if stopped:                                  # SIGTERM inside the step: save mid-step
            done, loss_sum = stopped
            t1 = time.time()
            d = save_checkpoint(strat, args.save, s, extra(offset, cut=dict(
                rows_done=done, loss_sum=loss_sum, global_batch=G)), grads=True)
            run.print(f"SIGTERM: saved {d} after {len(done)} of {G} sequences of step {s} in "
                      f"{time.time() - t1:.2f} s (grace {args.grace_s:g} s)")
            break
        if cut:
            loss += cut["loss_sum"] / batch.n_tokens
            cut, full = None, None
        offset += G
        tok += G * args.length
        if s % args.log_every == 0 or s == end - 1:
            dt = time.time() - t0
            run.print(f"step {s:>5}  loss {loss:.6f}  grad norm {strat.last_norm:.4f}  "
                      f"lr {lr_at(s, args):.2e}  {tok / max(dt, 1e-9):,.0f} tok/s  "
                      f"world {env.world} global batch {G} micro {mb} accum {args.grad_accum} "
                      f"restarts {restarts}  [{s + 1}/{args.steps}, {dt:.0f}s]")
        run.results.setdefault("all_losses", []).append((s, loss))
        s += 1
        if args.save and pre.agreed(env.device):     # SIGTERM between steps (or P > 1)
            t1 = time.time()
            d = save_checkpoint(strat, args.save, s, extra(offset))
            run.print(f"SIGTERM: saved {d} at the step boundary in {time.time() - t1:.2f} s "
                      f"(grace {args.grace_s:g} s)")
            break
        if args.save and args.save_every and s % args.save_every == 0 and s < end:
            save_checkpoint(strat, args.save, s, extra(offset))
    else:
        if args.save and end > start:
            t1 = time.time()
            d = save_checkpoint(strat, args.save, end, extra(offset))
            run.print(f"saved {d} in {time.time() - t1:.2f} s")
        if args.export_hf:
            export_hf(strat, args.export_hf)
            run.print(f"exported an HF model to {args.export_hf}")
    if args.out and env.is_main:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "train.json"), "w") as f:
            json.dump(dict(strategy=strat.name, losses=run.results.get("all_losses", [])), f)
    return True


Compose4D.modes = {"train": run_train}


if __name__ == "__main__":
    import sys
    if sys.argv[1:2] == ["plan"]:       # the elastic batch planner (no process group)
        import elastic
        sys.exit(elastic.plan_main(sys.argv[2:]))
    common.main(Compose4D)
