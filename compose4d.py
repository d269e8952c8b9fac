"""compose4d.py: DP x TP(+SP) x PP x CP (x EP) training of an HF model from the strategy files.

    torchrun --nproc_per_node=8 compose4d.py --tp 2 --pp 2 --cp 2                # correctness
    torchrun --nproc_per_node=8 compose4d.py --model tiny-moe --ep 2 --tp 2 --pp 2 --zero 3
    torchrun --nproc_per_node=4 compose4d.py --tp 2 --pp 2 --mode train --steps 200 --save ckpt

Nothing here re-implements a parallelism: tp.parallelize (Megatron layers, vocab-parallel loss),
sp.parallelize (--sp; --async-tp: async_tp.py's rings), cp_ring.parallelize (zig-zag ring
attention), pp.Pipeline (stage split, 1F1B / interleaved; with P = 1 plain gradient
accumulation), zero.Zero + ZeroOptimizer (ZeRO-1/2/3 over dp x cp), compose_moe (--ep: ep_moe's
all-to-all blocks over ep groups carved out of dp x cp). What is here: the rank grid and its
groups, `Parallel4D` (the model cut over the grid, and the step that strings the blocks
together), and gradient clipping across all four dimensions.

Rank grid: rank = tp + T (cp + C (dp + D pp)), TP innermost, PP outermost (--pipeline-first puts
PP inside DP); D = W / (T P C). CP ranks hold the same weights and see other tokens of the same
sequences, as DP ranks see other sequences: gradients are summed, ZeRO's shards live over dp x cp.

One step: this rank's dp share of the sequences and cp share of their tokens (zig-zag chunks with
global positions) through its pipeline stage in M micro-batches, each backpropagating
CE_sum / N_global; then the sums over dp x cp (ZeRO's reduce-scatter), over tp (partial gradients
of SP's norms), over the tied pair; global-norm clipping (each element counted once,
`shared_over`); AdamW (or --optimizer muon: muon.py's owners) on the shards; their all-gather.
The step clips (torch's clip_grad_norm_ would take one rank's norm of the plain shards); sharded
(tp, ZeRO-3, experts), model.state_dict() refuses (DCP would save shards): trainer4d's checkpoints.

Communication per step and rank: the formulas are trainer4d/comm.py's (tp 4 L_r + f + l
all-reduces of N_r H b; cp 2 (C-1) hops per layer and micro-batch; pp 2 M sends per boundary;
dp x cp ZeRO's reduce-scatter and all-gather of Psi_r; the tied pair; one 8-byte norm all-reduce);
derivation and the checkpoint / train-mode design: docs/internals.md, "compose4d.py".

Run:  torchrun --nproc_per_node=4 compose4d.py --tp 2 --pp 2 --mode correctness
"""
import torch
import torch.distributed as dist

from harness import (DTYPES, METER, Batch, all_reduce_flat, clip_by_norm, global_loss, is_moe,
                     name_group, parts, phase, planted, refuse_state_dict)
from harness.precision import adamw_kwargs, grad_reduce_dtype, muon_kwargs
from harness import loading
import compose_moe
import cp_ring
import fsdp
import muon
import pp
import sp
import tp
import zero
from trainer4d import pipeline
from trainer4d.schedule import lr_at


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
    if tied and grid.size["pp"] > 1:
        pairs = [[g[0], g[-1]] for g in grid.groups_over(("pp",))]
        mine, _ = dist.new_subgroups_by_enumeration(pairs)
        out["tied"] = name_group(mine, "tied")
    return out


# ----------------------------------------------------------------------------------------------
# The composed model and its step
# ----------------------------------------------------------------------------------------------
class Parallel4D:
    """An HF model cut over the rank grid (tp, sp, cp, pp, ZeRO over dp x cp, experts over ep),
    with its optimizer and its training step. `args` carries the layout (tp, pp, cp, sp, ep,
    zero, replicate, schedule, virtual_stages, grad_accum) and the run (length, dtype, clip, lr
    schedule); rig/compose4d.py runs it against one device, trainer4d/train.py trains with it."""

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
            self.tp = (sp.parallelize(model, g["tp"], async_tp=args.async_tp, dtensor=False)
                       if args.sp else tp.parallelize(model, g["tp"], dtensor=False))
            self.partial = [*self.tp.kv_copy_params.values(),
                            *self.tp.group_partials.values()]
        # Context parallelism: ring attention over the cp group, this rank's zig-zag tokens.
        self.ring = cp_ring.parallelize(model, g["cp"], args.length) if C > 1 else None
        self.pos = self.ring.positions.to(env.device) if C > 1 else None
        # Pipeline: this rank's stage (drops the other layers), over the pp group.
        V = args.virtual_stages if args.schedule == "interleaved" else 1
        s = args.length // C // T   # under SP: this rank's contiguous share of its tokens
        self.pipe = pp.Pipeline(
            model, P, V, self.me["pp"], args.schedule, group=g["pp"], tie_group=g["tied"],
            positions=None if planted("cp-local-positions") else self.pos,   # plant
            seq_shards=T if args.sp else 1,
            hidden_columns=slice(self.me["tp"] * s, (self.me["tp"] + 1) * s) if args.sp else None,
            loss_sum=self.tp.loss_sum if self.tp is not None else None, ring=self.ring)
        mine = self.pipe.my_chunks
        self.first, self.last = 0 in mine, self.pipe.n_chunks - 1 in mine
        kept = {id(m) for m in model.modules()}
        self.blocks = [b for b in blocks if id(b) in kept]   # this stage's MoE layers
        for b in self.blocks:
            b.stage_layers = len(self.blocks)
        # A model built on the meta device (train mode, --model a checkpoint directory) gets
        # its storage now that it is cut: each rank reads only the ranges it holds.
        self.load_report = (loading.load_layout_shards(self)   # (this rank's tensors only)
                            if any(p.is_meta for p in model.parameters()) else None)
        # ZeRO over dp x cp, on this stage's (TP-sharded) parameters; gradients summed.
        # Experts: over the ranks that hold the same experts (edp).
        zgroup = g["dp"] if planted("grad-sum-misses-cp") else g.get("shard", g["dpcp"])  # plant
        egroup = zgroup if planted("expert-grads-over-dpcp") else g.get("edp")   # plant
        units = self._units()
        self.zero = zero.Zero(model, group=zgroup, stage=args.zero, average=False,
                              units=units, prefetch=int(args.zero == 3 and not self.moe),
                              unit_groups={u[0]: egroup for u in units if u[0].endswith("experts")},
                              reduce_dtype=grad_reduce_dtype(DTYPES[args.dtype], args))
        if T > 1 or args.zero == 3 or self.moe and args.ep > 1:   # else DCP saves it right
            refuse_state_dict(model, f"compose4d: {self.name} holds shards, which DCP would "
                              f"save as whole tensors; save with trainer4d's checkpoints")
        params = list(model.parameters())     # AdamW on the shards, the run's hyperparameters
        if args.optimizer == "muon":   # muon.py: an owner per matrix over dp x cp, whole over tp
            self.optimizer = zero.ZeroOptimizer(
                muon.param_groups(model.named_parameters(), args.lr, args.muon_lr),
                muon.MuonAdamW, engine=self.zero, **muon_kwargs(args, params[0].dtype))
            # (ZeroOptimizer planned the owners for ZeRO's shards alone: again, with tp's split)
            self.optimizer.inner.on_shards(self.optimizer, self.tp)
        else:
            self.optimizer = zero.ZeroOptimizer(
                params, torch.optim.AdamW, engine=self.zero,
                **adamw_kwargs([u.shard for u in self.zero.units] or params, args))
        self._plan_shard_slices()
        self.t = 0              # optimizer steps taken (the schedule's position)
        self.last_norm = float("nan")
        self.cut_row = None     # the last step's pipeline.Cut (mid-step preemption), if any

    def _units(self):
        """ZeRO units of this stage in forward order; the tied head copy is a unit of its own, so
        its flat layout (and shards) match the embedding's on the first stage."""
        p, units = self.pipe.parts, []
        if self.first:
            units.append(("embed", [p.embed]))
        for i in (i for c in self.pipe.my_chunks for i in self.pipe.chunk_layers[c]):
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
    def local_batch(self, batch: Batch, rows=None) -> Batch:
        """This rank's dp share of the sequences (or `rows`), its zig-zag tokens of each."""
        b = batch.shard(self.me["dp"], self.grid.size["dp"]) if rows is None else batch.take(rows)
        return b if self.pos is None else b.cols(self.pos)

    def step(self, batch: Batch) -> float:
        """One optimizer step; returns the global loss (the harness's step)."""
        return self.run_step(batch)[0]

    def run_step(self, batch: Batch, local: Batch | None = None, mbs=None, stop=None,
                 start=None, flag=lambda: False, cut: bool = True):
        """The one training step (the harness's, and the train mode's through
        trainer4d.train.step_rows): this rank's dp share of the sequences and cp share of their
        tokens (`local`, default the whole batch's; `mbs` its micro-batches, default
        --grad-accum even ones) through its pipeline stage, each micro-batch backpropagating
        CE_sum / N_global; the gradient sums, clipping, AdamW on the ZeRO shards. start(): run
        after zeroing (a restored partial gradient); stop(m): may end the step before
        micro-batch m, the gradients reduced and kept, nothing updated (`cut`). Returns (global
        loss, or None when cut; the global CE sum; whether any rank's flag() was set)."""
        self.optimizer.zero_grad(set_to_none=False)
        if start is not None:
            start()
        local = self.local_batch(batch) if local is None else local
        M = self.args.grad_accum if mbs is None else len(mbs)
        n_tokens = local.n_tokens if planted("local-token-mean") else batch.n_tokens   # plant
        self.cut_row = pipeline.Cut(self.pipe, M, stop) if stop is not None and M else None
        # the CE sum plus this rank's share of the MoE router losses (as a sum over the
        # batch's tokens), for the logged objective (the CE sum alone without MoE)
        loss_sum = (self.pipe.run(local, M, n_tokens, mbs=mbs, steps=self.cut_row,
                                  docs=batch.doc_positions)
                    + compose_moe.logged_terms(self.blocks) * batch.n_tokens if M else
                    torch.zeros((), dtype=torch.float64, device=self.env.device))
        grads = self.reduce_grads()
        if cut and self.cut_row is not None and self.cut_row.completed < M:   # cut: keep the grads
            ce, stopping, _ = self.loss_flag_norm(loss_sum, flag())
            return None, ce, stopping
        self.update(grads)    # (clipped on the device: the norm is not read inside the step)
        ce, stopping, self.last_norm = self.loss_flag_norm(loss_sum, flag(), self.last_norm)
        return ce / batch.n_tokens, ce, stopping

    def loss_flag_norm(self, loss_sum: torch.Tensor, flag: bool, norm=None):
        """(global CE sum, any rank's flag, the gradient norm as a float) from one all-reduce of
        [CE sum on tp rank 0, flag, norm on rank 0] (float64, unmetered) and the step's one host
        read: preemption and the logged norm cost no collective of their own."""
        t = torch.zeros(3, dtype=torch.float64, device=loss_sum.device)     # [CE, flag, norm]
        if self.first_in([self.groups["tp"]]):   # (every tp rank holds the same sum)
            t[0] = loss_sum.detach()
        t[1].fill_(float(flag))    # (a kernel argument: `t[1] = flag` would copy a host tensor)
        if norm is not None and dist.get_rank() == 0:
            t[2] = norm
        if dist.get_world_size() > 1:   # [3] summed over the world (a world of one's: itself)
            with METER.paused():
                dist.all_reduce(t)
        ce, n, g = t.tolist()
        return ce, n > 0, (g if norm is not None else None)

    def reduce_grads(self) -> list[torch.Tensor]:
        """The gradient sums after the micro-batches: over dp x cp (ZeRO's reduce-scatter, which
        also shards them; with HSDP over the shard group, then the shards over the replicas),
        over tp for the partial gradients (norms under SP, replicated kv heads), over the tied
        pair (first stage's embedding, last stage's head copy)."""
        g = self.groups
        with phase("backward"):
            self.optimizer.reduce_gradients()     # per unit: flat [W * s] -> this rank's [s]
            grads = self.optimizer.grad_shards()  # [s] per unit, over dp x cp (edp: experts)
            if not planted("sp-partials-unreduced"):   # plant: norms' partials left unsummed
                all_reduce_flat([grads[i][a:b] for i, sl in enumerate(self.partial_slices)   # flat
                                 for a, b in sl], g["tp"])   # [the slices' b - a] (T = 1: none)
            if self.pipe.tie_trains():
                if not planted("tied-sync-skipped"):   # plant: the tie forgotten
                    dist.all_reduce(grads[0] if self.first else grads[-1], group=g["tied"])  # [s]
            if "replicate" in g:
                if not planted("replicas-not-summed"):   # plant: HSDP's sum
                    all_reduce_flat([gr for gr, u in zip(grads, self.zero.units)
                                     if u.group is self.zero.group], g["replicate"])
        return grads

    def eval_sum(self, batch: Batch) -> float:
        """The global CE sum of a held-out batch: forwards only, through the same split."""
        self.model.eval()   # (no dropout in a held-out loss)
        try:
            ce = pipeline.evaluate(self.pipe, self.local_batch(batch), self.args.grad_accum,
                                   batch.doc_positions)
        finally:
            self.model.train()
        # every tp rank computed the same CE sum: counted once
        return global_loss(ce if self.first_in([self.groups["tp"]]) else ce * 0, 1)

    def learning_rate(self, step: int) -> float:
        return lr_at(step, self.args)

    def update(self, grads: list[torch.Tensor]):
        """Clip by the global norm, step the shards at this step's rate, gather the updates."""
        with phase("optimizer"):
            self.grad_norm = self.last_norm = self.clip(grads, self.args.clip)
            t = self.t + 1 if planted("lr-one-step-ahead") else self.t   # plant
            for g in self.optimizer.param_groups:   # (Muon's matrices: from --muon-lr)
                g["lr"] = lr_at(t, self.args, self.args.muon_lr if g.get("muon") else None)
            self.optimizer.step()     # on the edited shards, then the all-gather
        compose_moe.after_step(self.blocks, self.args)   # (the aux-free bias)
        self.t += 1

    def clip(self, grads, max_norm: float) -> float:
        """The global gradient norm over all four dimensions (one scalar all-reduce over the
        world), and clipping by it when max_norm > 0 (torch's clip_grad_norm_ formula)."""
        parts = [gr[a:b] for gr, sl in zip(grads, self.norm_slices) for a, b in sl]
        # each part's norm in its dtype, one multi-tensor op (as torch's clip); squares in fp64
        sq = (torch.stack(torch._foreach_norm(parts)).double().square().sum().reshape(1) if parts
              else torch.zeros(1, dtype=torch.float64, device=grads[0].device))     # [1]
        group = None                              # the world: every stage's and shard's squares
        if planted("clip-norm-misses-pp"):       # plant: each stage's own norm
            group = self.groups["dpcp"]
        if dist.get_world_size(group) > 1:
            dist.all_reduce(sq, group=group)      # [1]
        return clip_by_norm(sq, grads, max_norm)

    def local(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full tensor: its experts, its TP shard."""
        if self.moe:
            t = compose_moe.expert_local(name, t, self.args.ep, dist.get_rank(self.groups["ep"]))
        return self.tp.local(name, t) if self.tp is not None else t


if __name__ == "__main__":   # torchrun compose4d.py --mode ...: the test rig runs it
    from rig.compose4d import main
    main()
