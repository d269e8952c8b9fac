"""The test rig for pp.py: its adapter, constraints, plants and baselines (rig/__init__.py)."""
import torch
import torch.distributed as dist
import torch.nn as nn

from harness import (DTYPES, Expect, METER, Plant, Strategy, global_loss, lm_loss_sum, make_adamw,
                     name_group, parts, phase, planted)
from harness.timeline import ascii_timeline, measured_bubble, plot_timeline
from harness.timing import ActionTimeline
from harness.cli import main as harness_main
import fp8
from rig.ddp import fp8_tiles, make_optimizer

from pp import Pipeline, clip_across_stages
from pp_schedule import (SCHEDULES, schedule_error, boundary_messages, bubble_formula, chunk_owner,
                         chunks_per_rank, simulate)


# ----------------------------------------------------------------------------------------------
# Harness adapter
# ----------------------------------------------------------------------------------------------
def pp_constraints(args, world, config) -> list[str]:
    P, M = world, args.microbatches
    V = chunks_per_rank(args.schedule, args.virtual_stages)
    L = config.num_hidden_layers
    if L < P * V:
        per = "chunks" if args.schedule == "dualpipev" else "virtual stages"
        return [f"{L} decoder layers cannot fill {P * V} pipeline chunks ({P} stages x {V} {per})"]
    if args.batch % M:
        return [f"global batch {args.batch} is not divisible by --microbatches {M}"]
    err = schedule_error(args.schedule, P, M)
    if err:
        return [err]
    # (every stage casts a whole micro-batch)
    return fp8_tiles(args, "a micro-batch's {} tokens are", args.batch // M * args.length)


def pp_micro_rows(args, world: int) -> list[list[int]]:
    """--fp8: each micro-batch (batch.split(M): contiguous rows) is cast with its own amaxes
    on every stage; the reference runs the same M row sets one by one."""
    n = args.batch // args.microbatches
    return [list(range(m * n, (m + 1) * n)) for m in range(args.microbatches)]


TIED_PLANT_ARGS = ("--schedule", "zb", "--dtype", "float32", "--clip", "0.5",
                   "--model", "configs/tiny-tied.json")


def stage_loop(model, args):
    """The stage loop on one rank, for harness/selfcheck.py: `model` cut into two chunks (an
    interleaved plan over one rank: no group, no collective), run one after the other."""
    pipe = Pipeline(model, 1, 2, 0, "interleaved")

    def forward(ids):                    # (B, S) -> (B, S, V), through every chunk in turn
        h = ids
        for c in range(pipe.n_chunks):
            h = pipe.run_chunk(c, h, ids.shape[1])
        return h
    return forward


class PP(Strategy):
    convert_fp8 = staticmethod(fp8.convert)   # each stage's layers; the head and embedding stay
    fp8_micro_rows = staticmethod(pp_micro_rows)
    optimizers = ("adamw", "muon")   # muon.py: each stage holds whole matrices (replicated)
    lora = True
    name = "pp"
    doc_mask = True   # (HF's packed-sequence masks around its own stage loop: document_masks)
    self_check = ("pp's stage loop", stage_loop)
    # One configuration catches them all: ZB-H1 (the stale-gradient bug needs a deferred W on a
    # middle stage, so 3 stages), tied embeddings (a first and a last stage copy), float32 with
    # clipping (a scale bug must not hide behind clipping).
    plants = {
        "doc-mask-causal-only": Plant(
            "packed documents' positions restart but the stage loop keeps the plain causal "
            "mask: each token attends to the documents before it", ("--doc-mask",)),
        "microbatch-scale": Plant(
            "each micro-batch's loss divided by M on top of the global token count (gradients "
            "1/M; clipping would hide it)", TIED_PLANT_ARGS, world=3),
        "mean-of-means": Plant(
            "each micro-batch's own mean loss, averaged over M, instead of its CE sum over the "
            "global token count", TIED_PLANT_ARGS, world=3),
        "no-tied-sync": Plant(
            "the first stage's embedding and the last stage's tied head copy are not summed",
            TIED_PLANT_ARGS, world=3),
        "clip-tied-twice": Plant(
            "the clip norm counts the tied head copy as a tensor of its own",
            TIED_PLANT_ARGS, world=3),
        "pp-skips-final-norm": Plant(
            "the stage loop skips the model's final norm: selfcheck.py refuses the run before "
            "training (--mode correctness); the plants mode, which checks before planting, "
            "FAILs it on the numbers", TIED_PLANT_ARGS, world=3),
        "split-batches": Plant(
            "each step's sends and receives posted one per batch_isend_irecv, sends first: "
            "gloo runs it, NCCL deadlocks (two stages that send to each other in one step)",
            ("--nccl-semantics", "--schedule", "1f1b", "--microbatches", "4")),
        "w-stale-grad": Plant(
            "ZB-H1's deferred W takes the stashed pairs of the last I (a later micro-batch) "
            "instead of its own micro-batch's", TIED_PLANT_ARGS, world=3),
        "v-turn-zero-grad": Plant(
            "DualPipeV: at the V's turn (chunks P-1 and P on one rank) the gradient handed from "
            "chunk P to chunk P-1 in memory is zeros, as if the hand-over were forgotten",
            ("--schedule", "dualpipev", "--microbatches", "4", "--dtype", "float32",
             "--clip", "0.5")),
    }

    @staticmethod
    def add_args(p):
        p.add_argument("--schedule", default="1f1b", choices=list(SCHEDULES),
                       help="dualpipev: 2 chunks per rank in a V, --microbatches >= 2 x ranks")
        p.add_argument("--microbatches", type=int, default=4, help="M")
        p.add_argument("--virtual-stages", type=int, default=2,
                       help="V, chunks per rank for --schedule interleaved")

    constraints = staticmethod(lambda a, w, c: pp_constraints(a, w, c) + (   # (+ the baseline's)
        torch_pp_constraints(a, w, c) if getattr(a, "compare_native", False) else []))

    def __init__(self, model, args, env):
        self.args, self.env, self.model = args, env, model
        self.name = f"pp-{args.schedule}"
        V = chunks_per_rank(args.schedule, args.virtual_stages)
        tied = parts(model).tied
        ends = {chunk_owner(args.schedule, 0, env.world),
                chunk_owner(args.schedule, env.world * V - 1, env.world)}
        tie = (name_group(dist.new_group(sorted(ends)), "tied")   # (DualPipeV: one rank, none)
               if tied and len(ends) > 1 else None)
        self.pipe = Pipeline(model, env.world, V, env.rank, args.schedule, tie_group=tie)
        self.optimizer = make_optimizer(model, args)   # (a stage's matrices are whole)
        # The benchmark's timeline: each action's compute span, the receives and sends left out
        # (waiting for a peer is bubble, not work); two steps kept, for report_lines.
        self.timeline = ActionTimeline(keep=2, cuda=env.device.type == "cuda")
        self.pipe.forward = self.timeline.timed(self.pipe.forward,
                                                key=lambda c, m, *_: ("F", c, m))
        self.pipe.backward = self.timeline.timed(self.pipe.backward,
                                                 key=lambda kind, c, m, *_: (kind, c, m))

    def step(self, batch):
        self.optimizer.zero_grad(set_to_none=True)
        with self.timeline.step():
            loss_sum = self.pipe.run(batch, self.args.microbatches)
        with phase("backward"):
            if not planted("no-tied-sync"):   # plant: the tie forgotten
                self.pipe.sync_tied()
        with phase("optimizer"):
            if self.args.clip:
                self.grad_norm = clip_across_stages(self.model, self.args.clip, self.pipe)
            self.optimizer.step()
        return global_loss(loss_sum, batch.n_tokens)

    def _gather(self, tensors: dict) -> dict:
        parts = [None] * self.env.world
        with METER.paused():
            dist.all_gather_object(parts, {n: t.detach().cpu() for n, t in tensors.items()
                                           if t is not None})
        out = {}
        for p in parts:
            out.update(p)
        if self.pipe.tied:
            out.pop(self.pipe.head_weight, None)  # the reference has one tied tensor
        return out

    def full_grads(self):
        return self._gather({n: p.grad for n, p in self.model.named_parameters()})

    def full_params(self):
        return self._gather({n: p for n, p in self.model.named_parameters()})

    def expected_comm(self):
        a, cfg = self.args, self.model.config
        M = a.microbatches
        act = (a.batch // M) * a.length * cfg.hidden_size * DTYPES[a.dtype].itemsize
        # a boundary to another rank (the V's turn, chunks P-1 and P on one rank, is no message)
        sends = M * boundary_messages(a.schedule, self.env.world, a.virtual_stages, self.env.rank)
        rows = [Expect("isend", "world", sends, sends * act,
                       f"M x (activations out + gradients back) per chunk boundary to another "
                       f"rank, {act:,} B each"),
                Expect("irecv", "world", sends, sends * act, "the mirror of the sends")]
        if self.pipe.tie_trains():   # (--lora freezes the pair: nothing summed)
            n = self.model.config.vocab_size * cfg.hidden_size * DTYPES[a.dtype].itemsize
            rows.append(Expect("all_reduce", "tied", 1, n, "tied embedding gradient"))
        if a.clip:
            rows.append(Expect("all_reduce", "world", 1, 8, "clip: squared-norm sum (fp64)"))
        return rows

    def report_lines(self):
        tl = [None] * self.env.world
        with METER.paused():  # the last timed step (the very last one was memory-tracked)
            dist.all_gather_object(tl, self.timeline.steps[0])
        a, V = self.args, self.args.virtual_stages
        end, measured = measured_bubble(tl)
        _, _, sim, peak = simulate(a.schedule, self.env.world, a.microbatches, V)
        lines = [f"bubble: measured {measured:.3f} (wall clock, last step), simulated {sim:.3f} "
                 f"(unit costs F=1 B=2 I=W=1), formula "
                 f"{bubble_formula(a.schedule, self.env.world, a.microbatches, V):.3f}; "
                 f"peak in-flight micro-batches per stage {peak}"]
        if a.schedule == "dualpipev":
            sim_pairs = simulate(a.schedule, self.env.world, a.microbatches, V, paired=True)[2]
            lines.append(f"DualPipeV: the formula is DeepSeek's, whose F&B pairs start together "
                         f"(simulated so: {sim_pairs:.3f}); this executor starts each half when "
                         f"its input is there ({sim:.3f}); in-flight counts are chunk "
                         f"micro-batches, half a 1F1B stage each")
        lines.append(f"stage costs (parameters): {self.pipe.costs}")
        if a.out and self.env.is_main:
            plot_timeline(tl, end, f"{a.out}/timeline.png", self.name)
        return lines + ascii_timeline(tl, end)


# ----------------------------------------------------------------------------------------------
# Baseline: PyTorch's own pipelining (--compare-native)
# ----------------------------------------------------------------------------------------------
# Our schedule -> torch's class that runs the same actions in the same order (checked by
# tests/test_pp.py::test_schedules_are_torchs_own): ZB-H1 is torch's ZB1P with one stage per
# rank; ScheduleDualPipeV's "v" style places stage s on rank s or 2P-1-s, our V.
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "interleaved": "ScheduleInterleaved1F1B",
                   "zb": "ScheduleInterleavedZeroBubble", "dualpipev": "ScheduleDualPipeV"}


def torch_pp_constraints(args, world, config) -> list[str]:
    """What torch's schedule class refuses beyond ours (checked with --compare-native only)."""
    P, M = world, args.microbatches
    if args.schedule == "1f1b" and M < P:
        return [f"--compare-native: torch's Schedule1F1B needs --microbatches ({M}) >= the "
                f"number of stages ({P})"]
    if args.schedule == "zb" and M % max(1, M // P):
        return [f"--compare-native: torch's ScheduleInterleavedZeroBubble needs --microbatches "
                f"({M}) to be a multiple of its number of rounds max(1, M // P) = {M // P}"]
    return []


class TorchChunk(nn.Module):
    """One chunk as torch's PipelineStage wants it: a module owning exactly the chunk's
    parameters (Pipeline.modules_of) whose forward is Pipeline.run_chunk, the code ours runs."""

    def __init__(self, pipe: "Pipeline", c: int):
        super().__init__()
        self.parts = nn.ModuleList(pipe.modules_of(c))   # (registered: parameters() is the chunk's)
        self.pipe, self.c = pipe, c                       # (a plain object, not a submodule)

    def forward(self, x):
        with phase("forward"):
            return self.pipe.run_chunk(self.c, x, x.shape[1])


class TorchPipelining(Strategy):
    """Baseline: torch.distributed.pipelining running --schedule on Pipeline's cut (chunk c on
    chunk_owner(c)), the same micro-batches (torch splits dim 0 as Batch.split does) and loss
    scaling (CE sum / global token count, scale_grads=False). torch's schedules know nothing of
    ties: the ends' gradients are summed after schedule.step() (Pipeline.sync_tied); DualPipeV
    holds both ends on rank 0, two stages sharing one tensor. Gathers and clipping are PP's."""
    name = "torch-pp"
    constraints = staticmethod(pp_constraints)

    def __init__(self, model, args, env):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining import schedules as torch_schedules
        self.args, self.env, self.model = args, env, model
        name = args.schedule
        self.name = f"torch-pp-{name}"
        P, V = env.world, chunks_per_rank(name, args.virtual_stages)
        tied = parts(model).tied
        ends = {chunk_owner(name, 0, P), chunk_owner(name, P * V - 1, P)}
        tie = name_group(dist.new_group(sorted(ends)), "tied") if tied and len(ends) > 1 else None
        # the cut only: torch splits the backward of its zero-bubble schedules itself
        self.pipe = Pipeline(model, P, V, env.rank, name, tie_group=tie, split_backward=False)
        self.stages = [PipelineStage(TorchChunk(self.pipe, c), c, self.pipe.n_chunks, env.device)
                       for c in self.pipe.my_chunks]
        cls = getattr(torch_schedules, TORCH_SCHEDULES[name])
        single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
        self.schedule = cls(self.stages[0] if single else self.stages, args.microbatches,
                            loss_fn=self._loss, scale_grads=False)
        self.optimizer = make_adamw(list(model.parameters()), args)
        self._n_tokens, self._ce = 1, []

    def _loss(self, logits, labels):
        """torch's loss_fn, per micro-batch on the last stage: CE sum / global token count."""
        with phase("forward"):
            ce = lm_loss_sum(logits, labels)
            self._ce.append(ce.detach().double())
            return ce / self._n_tokens

    def step(self, batch):
        self.optimizer.zero_grad(set_to_none=True)
        self._n_tokens, self._ce = batch.n_tokens, []
        inputs = (batch.input_ids,) if 0 in self.pipe.my_chunks else ()
        target = batch.labels if self.pipe.n_chunks - 1 in self.pipe.my_chunks else None
        self.schedule.step(*inputs, target=target, return_outputs=False)
        with phase("backward"):
            self.pipe.sync_tied()
        with phase("optimizer"):
            if self.args.clip:
                self.grad_norm = clip_across_stages(self.model, self.args.clip, self.pipe)
            self.optimizer.step()
        # the last M: on its first step torch runs the loss once more to infer the gradients'
        # metadata (_prepare_backward_infra)
        ce = self._ce[-self.args.microbatches:]
        loss_sum = (torch.stack(ce).sum() if ce else
                    torch.zeros((), dtype=torch.float64, device=batch.input_ids.device))
        return global_loss(loss_sum, batch.n_tokens)

    _gather = PP._gather
    full_grads = PP.full_grads
    full_params = PP.full_params


PP.native = TorchPipelining


def main():
    """`torchrun pp.py --mode ...`: pp.py's __main__ lands here."""
    harness_main(PP)
