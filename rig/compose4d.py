"""The test rig for compose4d.py: its adapter, constraints and plants (rig/__init__.py)."""
import copy
import os
import sys

import torch
import torch.distributed as dist

from harness import (METER, Plant, Strategy, dropout, is_moe, kv_heads, spread_across_ranks,
                     train_data)
from harness.cli import main as harness_main
from harness import lora_setup
from harness.models import LOW_PRECISION
from harness.flops import mfu_line
from trainer4d import comm, elastic, train
from trainer4d.schedule import Scheduled, ScheduledReference

import ep_moe
import fp8
import zero
import zero_units
from compose4d import Parallel4D
from rig.compose_moe import MoEReference, constraints as moe_constraints
from rig.cp_ring import ring_refusals
from rig.ddp import AmaxLog, MUON_PLANT, data_parallel_micro_rows, fp8_tiles
from rig.ep_moe import add_moe_args
from rig.pp import stage_loop
from rig.tp import fp8_tp_constraints, tp_constraints


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
    if getattr(args, "lora", 0) and is_moe(config):
        return ["--lora: compose4d trains the adapters of a dense model (MoE experts: not built)"]
    meta = train.saved_meta(args) if args.mode == "train" else None   # (read once, here)
    why = meta is not None and lora_setup.resume_refusal(meta, args)
    if why:
        return [f"--resume {args.resume}: {why}"]
    if meta is not None and meta.get("optimizer", "adamw") != args.optimizer:
        return [f"--resume: the checkpoint's run stepped with --optimizer "
                f"{meta.get('optimizer', 'adamw')}, not {args.optimizer} (its optimizer state "
                f"would not carry over)"]
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
    errs = moe_constraints(args, config, D, C)
    if errs:
        return errs
    errs = fp8_compose_constraints(args, T, D, C, config)
    errs = errs or (tp_constraints(args, T, config) if T > 1 else [])
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
    feats = ring_refusals(config, args.length) + (
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
# The adapter: compose4d.Parallel4D under the harness
# ----------------------------------------------------------------------------------------------
TIED_MODEL = "configs/tiny-tied.json"     # the tiny preset with tied embeddings (planted bugs)


class ScheduledMoEReference(Scheduled, MoEReference):
    """compose_moe's reference (HF's MoE model, the router losses per layer and micro-batch)."""


def fp8_compose_constraints(args, T: int, D: int, C: int, config) -> list[str]:
    """--fp8 under compose4d: tp's rules (fp8.carry), the tokens' amaxes over dp x cp (fp8.scope),
    each micro-batch cast with its own (compose_micro_rows); blockwise: a dp rank's micro-batch
    and each zig-zag cp chunk whole 1 x 128 tiles (the weight gradient's, along the tokens); a
    MoE model's experts stay in high precision (fp8.convert's rule)."""
    if not getattr(args, "fp8", None):
        return []
    if (args.mode in ("correctness", "plants") and args.fp8 == "tensorwise"
            and args.dtype in LOW_PRECISION and T * D * C == 1):
        return [f"--fp8 in {args.dtype} at pp = W: no two ranks run the same FP8 linears, so "
                f"the scales' exact check has nothing to compare (prove it in float64)"]
    rows = args.batch // max(D * args.grad_accum, 1)
    return (fp8_tiles(args, "a dp rank's {} tokens per micro-batch are", rows * args.length)
            or (fp8_tiles(args, "a cp chunk of {} positions is", args.length // (2 * C))
                if C > 1 else [])
            or (fp8_tp_constraints(args, T, config) if T > 1 else []))


def compose_micro_rows(args, world: int):
    """--fp8: compose4d's micro-batches are data parallelism's (each dp rank's rows in
    --grad-accum chunks, through its pipeline), over dp = W / (tp pp cp) ranks."""
    return data_parallel_micro_rows(args, world // (args.tp * args.pp * args.cp))


def reference(ref_model, args, env):
    """The single-device reference, scheduled by torch: compose_moe's for a MoE model."""
    moe = is_moe(ref_model.config)
    return (ScheduledMoEReference if moe else ScheduledReference)(ref_model, args, env)


class Compose4D(Parallel4D, Strategy):
    name = "4d"
    convert_fp8 = staticmethod(fp8.convert)   # tp's carry, dp x cp's token scopes, micro rows
    fp8_amax_log = AmaxLog   # (bf16 tensorwise) each stage's ranks' amaxes, bit for bit
    fp8_micro_rows = staticmethod(compose_micro_rows)
    doc_mask = True   # (every layout: pp.py's stage loop with HF's masks, the ring's own blocks)
    self_check = ("compose4d's stage loop (pp.py's)", stage_loop)
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
    _MUON = ("--tp", "2", *MUON_PLANT)
    _MOE = ("--model", "tiny-moe", "--ep", "2", "--pp", "2", "--dtype", "float32", "--clip", "0.5")
    plants = {
        "fp8-amax-per-rank": Plant(
            "--fp8: each rank casts its shards and tokens with its own part's amax, not the "
            "whole tensor's (over tp's split and dp x cp's tokens)",
            ("--fp8", "tensorwise", "--dtype", "float64", "--tp", "2", "--dp", "2"), world=4),
        "expert-grads-over-dpcp": Plant(
            "the experts' gradients reduced (and sharded) over dp x cp, like the dense ones, "
            "instead of over the ranks that hold the same experts: other experts' gradients "
            "are added in", _MOE, world=4),
        "aux-per-stage": Plant(
            "each stage normalises its MoE layers' auxiliary loss by its own layer count, not "
            "the model's: the aux term counted once per stage", _MOE, world=4),
        "dropout-rank-local": Plant(dropout.PLANT_DOC, dropout.PLANT_ARGS + (
            "--tp", "2", "--pp", "2"), world=4),
        "ring-docs-not-restored": Plant(
            "--doc-mask under cp and pp: a micro-batch's backward runs with the ring's block "
            "masks of the last forward, another micro-batch's documents",
            ("--doc-mask", "--cp", "2", "--pp", "2", "--grad-accum", "2"), world=4),
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
        "muon-blockwise": Plant(
            "--optimizer muon: Newton-Schulz on each rank's tp shard of a matrix as if it were "
            "the matrix (not gathered over tp)", _MUON),
        "muon-lr-by-shard": Plant(
            "--optimizer muon: the learning rate's shape adjustment sqrt(max(1, A/B)) from the "
            "tp shard's shape, not the matrix's (gate/up [I/T, H] lose theirs)", _MUON),
    }
    optimizers = ("adamw", "muon")   # muon.py's owner mode over dp x cp, whole over tp
    lora = True
    muon_modes = ("auto", "owner")
    modes = {"train": train.run_train}   # --mode train: a logged run with checkpoints

    def __init__(self, model, args, env):
        super().__init__(model, args, env)
        if getattr(args, "fp8", None):   # the tokens are split over dp x cp (rows, zig-zag)
            fp8.scope(model, tokens=[self.groups["dpcp"]])
            self.fp8_stage = self.me["pp"]   # (AmaxLog: the ranks running the same layers)
        self.print_coordinates()

    def print_coordinates(self):
        """Every rank's coordinates on the grid, printed once by rank 0 (collective)."""
        g, args = self.groups, self.args
        coords = [None] * self.env.world
        shown = dict(self.me, **({"ep": dist.get_rank(g["ep"]), "edp": dist.get_rank(g["edp"])}
                                 if self.moe else {}),
                     **({"replica": dist.get_rank(g["replicate"])} if "replicate" in g else {}))
        with METER.paused():
            dist.all_gather_object(coords, shown)
        if self.env.is_main:
            edp = self.grid.size["dp"] * self.grid.size["cp"] // args.ep if self.moe else 0
            print(f"rank grid {self.grid.size}, innermost first {self.grid.order}"
                  + (f"; ep {args.ep} out of dp x cp (edp {edp})" if self.moe else "") + ":",
                  flush=True)
            for r, c in enumerate(coords):
                print(f"  rank {r}: " + " ".join(f"{d}={v}" for d, v in c.items()), flush=True)

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
        add_moe_args(p)   # (used with a MoE --model)
        p.add_argument("--prompt", default=None,
                       help="train mode: print a greedy continuation of this text at the end")
        p.add_argument("--gen-tokens", type=int, default=24,
                       help="tokens generated for --prompt")

    constraints = staticmethod(compose_constraints)

    def full_grads(self):
        return self._full(self._stage_tensors("grad"))

    def full_params(self):
        return self._full(self._stage_tensors("param"))

    def _full(self, stage_tensors: dict) -> dict[str, torch.Tensor]:
        """This stage's TP-local tensors -> full tensors of the whole model on every rank."""
        if self.moe:
            stage_tensors = ep_moe.gather_experts(stage_tensors, self.groups["ep"])
        if self.tp is not None:
            stage_tensors = self.tp.full(stage_tensors)
        parts = [None] * self.grid.size["pp"]
        with METER.paused():
            dist.all_gather_object(parts, {n: t if t is None else t.detach().cpu()   # (None:
                                           for n, t in stage_tensors.items()},   # frozen grad)
                                   group=self.groups["pp"])
        out = {}
        for part in parts:
            out.update(part)
        if self.tied:
            out.pop(self.pipe.head_weight, None)   # the reference holds one tied tensor
        return {n: t if t is None else t.to(self.env.device) for n, t in out.items()}

    def _stage_tensors(self, kind: str) -> dict[str, torch.Tensor]:
        with METER.paused():   # ("param" or "grad"; a frozen tensor's gradient: None)
            return self.zero.full_tensors(kind)

    def model_states(self):
        z = self.zero
        return {"params": [u.shard if z.stage == 3 else u.full for u in z.units]
                + zero_units.outside_units(z),   # (--lora: the frozen base at stages 1, 2)
                "grads": z.grad_tensors(), "optimizer": self.optimizer.state_tensors()}

    def wait_comm(self):
        self.zero.wait_params()

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
                 f"{[list(self.pipe.chunk_layers[c]) for c in self.pipe.my_chunks]}"]
        bench = getattr(self, "bench", None)
        if bench:
            lines.append(mfu_line(self.model.config, self.args, self.env, bench["step_s"]))
        return lines


def main():
    """`torchrun compose4d.py --mode ...` (and `python compose4d.py plan ...`, the elastic batch
    planner, no process group): compose4d.py's __main__ lands here."""
    if sys.argv[1:2] == ["plan"]:
        sys.exit(elastic.plan_main(sys.argv[2:]))
    harness_main(Compose4D)
