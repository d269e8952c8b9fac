"""The test rig for ddp.py: its adapter, constraints, plants and baselines (rig/__init__.py)."""
import copy
import warnings

import torch
import torch.distributed as dist

from harness import (Batch, Expect, Plant, Strategy, dropout, global_loss, lm_loss_sum,
                     make_adamw, phase, spread_across_ranks)
from harness.precision import LOW_PRECISION, grad_reduce_dtype, muon_kwargs
from harness.reduce_probe import ReductionProbe
from harness.cli import main as harness_main
from harness.run import gather_objects

from ddp import DataParallel, NaiveDataParallel, forward_backward
import fp8
import muon


# ----------------------------------------------------------------------------------------------
# Harness adapter
# ----------------------------------------------------------------------------------------------
def batch_constraints(args, world) -> list[str]:
    """Every data-parallel strategy splits the global batch into world x grad-accum parts."""
    k = args.grad_accum
    if k < 1:
        return [f"--grad-accum must be >= 1 (got {k})"]
    if args.batch % (world * k):
        return [f"global batch {args.batch} is not divisible by world size x grad-accum = "
                f"{world} x {k} = {world * k}"]
    return fp8_constraints(args, world, k)


def fp8_constraints(args, world: int, micro_batches: int, averaged: bool = True) -> list[str]:
    """--fp8: a rank's scales equal one device's on the same micro-batch (fp8.scope; the
    reference runs the strategy's micro-batches one by one: data_parallel_micro_rows) only when
    each scale's group of elements is whole somewhere: under blockwise the weight gradient's
    1 x 128 tiles along the tokens not cut between ranks. Rowwise's scales
    are powers of 2: a rank's loss gradient is W times one device's (W CE_sum / N, averaged
    after the backward), which casts on the same grid only when W is a power of 2 (averaged:
    False where the ranks' gradients are summed, each rank's loss its share of the whole)."""
    if not getattr(args, "fp8", None):
        return []
    tokens = args.batch // (world * micro_batches) * args.length   # a rank's, per micro-batch
    if args.fp8 == "rowwise" and averaged and world & (world - 1):
        return [f"--fp8 rowwise at W={world}: its power-of-2 scales cast a rank's gradient "
                f"(W times one device's, before the average) on another grid unless W is a "
                f"power of 2"]
    return fp8_tiles(args, "a rank's {} tokens per micro-batch are", tokens)


def fp8_tiles(args, what: str, n: int) -> list[str]:
    """--fp8 blockwise: the weight gradient's 1 x 128 tiles run along the tokens, so the n
    tokens a rank (a micro-batch, a row's chunk) casts on its own must fill whole tiles, or its
    tiles are not one device's. what: the refusal's subject, `{}` for n."""
    if getattr(args, "fp8", None) == "blockwise" and n % fp8.BLOCK:
        return [f"--fp8 blockwise: {what.format(n)} not a multiple of {fp8.BLOCK} (the weight "
                f"gradient's 1 x {fp8.BLOCK} tiles along the tokens would not be one device's)"]
    return []


class AmaxLog:
    """--fp8 tensorwise, the correctness mode's check of the scales themselves (every strategy
    whose ranks all run every FP8 linear: data, tensor, sequence, context and expert parallel):
    every amax a rank's casts used during the strategy's steps (fp8.global_amax's results, in
    call order), gathered after them, must be the same on every rank bit for bit: each rank holds
    a part of the tensor and casts it with the whole tensor's scale. Exact in any dtype, so it
    holds in bf16, where the tensors themselves are compared only within FP8's own noise (a bf16
    rounding that moves a value across an FP8 rounding boundary moves it by 1/8 in e4m3, 1/4 in
    e5m2: one device's bf16 FP8 gradients land up to ~0.3 of a tensor's scale from the float64
    FP8 target), which a per-rank scale hides in. What it proves is agreement: a scale wrong
    the same way on every rank passes it (float64's element-wise run catches those), and so does
    a cast that changes the amax after global_amax returned (fsdp's gather plant: float64 too).
    stage: which ranks run the same FP8 linears in the same order (compose4d: its pipeline
    stage); each rank is held against the lowest rank of its stage."""

    def __init__(self, stage: int = 0):
        self.amaxes, self.stage = [], stage

    def __enter__(self):
        self._global = fp8.global_amax

        def recording(a, over):
            out = self._global(a, over)
            self.amaxes.append(out.detach().double().reshape(-1).clone())
            return out
        fp8.global_amax = recording   # (fp8's own calls read the module's global)
        return self

    def __exit__(self, *exc):
        fp8.global_amax = self._global

    def check(self) -> tuple[str, bool, str]:
        mine = torch.cat(self.amaxes).cpu() if self.amaxes else torch.zeros(0).double()
        stages, ranks = zip(*gather_objects((self.stage, mine)))
        first = {}
        for r, st in enumerate(stages):
            first.setdefault(st, r)
        ref = [ranks[first[st]] for st in stages]        # each rank's stage's lowest rank
        bits = lambda t: t.view(torch.int64)   # noqa: E731  (a NaN equals itself, bit for bit)
        differ = [r for r, (t, f) in enumerate(zip(ranks, ref))
                  if t.shape != f.shape or not torch.equal(bits(t), bits(f))]
        n = min(t.numel() for t in ranks)
        worst = max((float(((t - f).abs() / f.clamp(min=1e-30)).max())
                     for t, f in zip(ranks, ref) if t.shape == f.shape and t.numel()), default=0.0)
        alone = len(first) == len(stages) > 1   # (W > 1, no rank shares a stage: none compared)
        ok = n > 0 and not differ and not alone
        where = "every rank" if len(first) == 1 else f"every rank of each of {len(first)} stages"
        first_of = "rank 0" if len(first) == 1 else "their stage's first rank"
        return (f"fp8 scales the same on {where}", ok,
                f"{n} amaxes per rank over the steps, " + (
                    f"bit-identical on {where}" if ok else
                    "no two ranks run the same layers: nothing compared" if alone else
                    f"ranks {differ} differ from {first_of} (largest relative "
                    f"difference {worst:.2e})" if n else "none recorded"))


def data_parallel_micro_rows(args, world: int) -> list[list[int]] | None:
    """--fp8 --grad-accum K: global micro-batch k is every rank's k-th (forward_backward: rank r
    holds rows [r n, (r+1) n), n = B / W, in K chunks), its amaxes MAXed over the world; the
    reference runs these K row sets one by one. None for one micro-batch."""
    K = getattr(args, "grad_accum", 1)
    if K == 1:
        return None
    n = args.batch // world
    return [[r * n + k * (n // K) + j for r in range(world) for j in range(n // K)]
            for k in range(K)]


def fp8_data_parallel(model, args):
    """--fp8: the batch's rows are split over the world, so every converted layer's amaxes of
    x and dy are MAXed over it (fp8.scope): each rank casts with the whole batch's scales."""
    if getattr(args, "fp8", None):
        fp8.scope(model, tokens=[dist.group.WORLD])


def ddp_constraints(args, world, config) -> list[str]:
    errs = batch_constraints(args, world)
    if errs:
        return errs
    if args.bucket_mb <= 0:
        return [f"--bucket-mb must be > 0 (got {args.bucket_mb})"]
    return []


def clip_and_step(strat):
    """The optimizer phase of the replicated adapters: torch's global-norm clipping under
    --clip (the pre-clip norm kept for the verdict), then the step."""
    with phase("optimizer"):
        if strat.args.clip:
            strat.grad_norm = torch.nn.utils.clip_grad_norm_(strat.model.parameters(),
                                                             strat.args.clip)
        strat.optimizer.step()


# the Muon plants' configuration (a short sequence: the proofs do not need 64 tokens)
MUON_PLANT = ("--optimizer", "muon", "--length", "32")


def make_optimizer(model, args, tpm=None):
    """The run's optimizer over a module this rank holds whole (replicated) or T-way split
    (tp.py, sp.py: tpm, Muon's tp-gather): AdamW, or muon.build's with --optimizer muon."""
    if args.optimizer != "muon":   # (make_adamw leaves --lora's frozen base out)
        return make_adamw(model.parameters(), args)
    dtype = next(model.parameters()).dtype
    return muon.build(model, args.lr, args.muon_lr, tpm, **muon_kwargs(args, dtype))


class DDP(Strategy):
    chunked_ce = True
    doc_mask = True
    convert_fp8 = staticmethod(fp8.convert)
    fp8_micro_rows = staticmethod(data_parallel_micro_rows)   # (--grad-accum K)
    fp8_amax_log = AmaxLog
    name = "ddp"
    optimizers = ("adamw", "muon")   # muon.py: rig/muon.py builds it
    lora = True
    syncs_initial_params = True
    # --plant-bug NAME: known bugs the correctness check must catch (tests/test_plants.py)
    PLANT_CONFIG = ("--grad-accum", "2", "--dtype", "float32", "--clip", "0.5")
    plants = {
        "dropout-rank-local": Plant(dropout.PLANT_DOC, dropout.PLANT_ARGS),
        "doc-positions-dropped": Plant("packed documents' position ids not passed to the "
                                       "model: each token attends to the documents before it "
                                       "and its rotary position runs on", ("--doc-mask",)),
        "fp8-amax-per-rank": Plant("--fp8: each rank casts x and dy with the amax of its own "
                                   "rows, not the whole batch's (one device's scale)",
                                   ("--fp8", "tensorwise", "--dtype", "float64")),
        "no-average": Plant("all_reduce sums the gradients instead of averaging them "
                                   "(2x at W=2; clipping would hide it)", PLANT_CONFIG),
        "mean-of-means": Plant("each micro-batch's own mean loss, averaged, instead of "
                                      "the global token mean", PLANT_CONFIG),
        "sync-first-microbatch": Plant("gradient accumulation communicates after the "
                                              "first micro-batch instead of the last",
                                              PLANT_CONFIG),
        "no-broadcast": Plant("no initial broadcast: replicas keep their own init",
                                     PLANT_CONFIG),
        "lora-base-reduced": Plant("--variant naive --lora: the frozen base's (zero) "
                                   "gradients are all-reduced too",
                                   ("--variant", "naive", "--lora", "4")),
        "naive-no-average": Plant("--variant naive: each gradient's all_reduce sums instead of "
                                  "averaging", ("--variant", "naive", *PLANT_CONFIG)),
    }

    @staticmethod
    def add_args(p):
        p.add_argument("--variant", default="bucketed", choices=["bucketed", "naive"],
                       help="naive: ddp.NaiveDataParallel, one all_reduce per parameter after "
                            "the backward; bucketed: ddp.DataParallel")
        p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size")
        p.add_argument("--grad-accum", type=int, default=1,
                       help="micro-batches per optimizer step (no communication on the first K-1)")
        p.add_argument("--no-broadcast", action="store_true",
                       help="skip the initial broadcast (to see correctness fail)")

    constraints = staticmethod(ddp_constraints)

    def __init__(self, model, args, env):
        self.args, self.env = args, env
        self.model = model
        fp8_data_parallel(model, args)
        self.naive = getattr(args, "variant", "bucketed") == "naive"
        if self.naive:
            self.name = "ddp-naive"
            self.dp = NaiveDataParallel(model)
            self.optimizer = make_optimizer(model, args)
            self.probe = None
            return
        # getattr: DDP also serves as a memory baseline for other strategies' flags
        self.dp = DataParallel(model, bucket_mb=getattr(args, "bucket_mb", 25.0),
                               broadcast=not getattr(args, "no_broadcast", False),
                               broadcast_buffers=False,   # HF's buffers are constants
                               reduce_dtype=grad_reduce_dtype(next(model.parameters()).dtype,
                                                              args))
        self.optimizer = make_optimizer(model, args)
        # Instrumentation from outside the algorithm: the benchmark's first step also sums the
        # low-precision gradients in fp64, for the reduction's own error (report_lines)
        self.probe = (ReductionProbe(self.dp) if args.mode == "benchmark" and self.dp.buckets
                      and self.dp.buckets[0].buffer.dtype in LOW_PRECISION else None)

    def step(self, batch: Batch) -> float:
        self.optimizer.zero_grad(set_to_none=False)
        set_sync = (lambda sync: None) if self.naive else self.dp.set_sync
        local_sum = forward_backward(self.dp, batch, self.env.rank, self.env.world,
                                     self.args.grad_accum, set_sync, self.args.ce_chunk)
        if self.naive:
            with phase("backward"):   # (after it: nothing overlaps)
                self.dp.sync_gradients()
        clip_and_step(self)
        return global_loss(local_sum, batch.n_tokens)

    def expected_comm(self):   # (--lora: the adapters only; the frozen base is not reduced)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.naive:
            grad_bytes = sum(p.numel() * p.element_size() for p in params)
            return [Expect("all_reduce", "world", len(params), grad_bytes,
                           f"Psi*b = {grad_bytes:,} B in one call per parameter tensor "
                           f"({len(params)}), whatever K")]
        grad_bytes = sum(p.numel() for p in params) * self.dp.reduce_itemsize
        rows = [Expect("all_reduce", "world", len(self.dp.buckets), grad_bytes,
                       f"Psi*b = {grad_bytes:,} B (b: the reduce dtype) in "
                       f"{len(self.dp.buckets)} buckets "
                       f"of <= {getattr(self.args, 'bucket_mb', 25.0):g} MiB, whatever K")]
        return rows

    def report_lines(self):
        return self.probe.report_lines(self.args.reduce_dtype) if self.probe else []

    def extra_checks(self):
        spread = spread_across_ranks(self.model.parameters())
        return [("replicas identical across ranks", spread == 0.0,
                 f"max spread of per-tensor sums {spread:.1e}")]


class TorchDDP(Strategy):
    """Baseline: torch.nn.parallel.DistributedDataParallel on the same data and loss scaling."""
    name = "torch-ddp"
    syncs_initial_params = True
    constraints = staticmethod(ddp_constraints)

    def __init__(self, model, args, env):
        from torch.nn.parallel import DistributedDataParallel
        self.args, self.env = args, env
        self.model = model
        with warnings.catch_warnings():  # broadcast_buffers=False is the behaviour we want
            warnings.simplefilter("ignore", FutureWarning)
            self.ddp = DistributedDataParallel(
                model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
                bucket_cap_mb=getattr(args, "bucket_mb", 25.0), broadcast_buffers=False)
        self.optimizer = make_adamw(model.parameters(), args)

    def step(self, batch):
        self.optimizer.zero_grad(set_to_none=True)
        # what torch DDP's no_sync() context toggles
        local_sum = forward_backward(
            self.ddp, batch, self.env.rank, self.env.world, self.args.grad_accum,
            lambda sync: setattr(self.ddp, "require_backward_grad_sync", sync))
        clip_and_step(self)
        return global_loss(local_sum, batch.n_tokens)


class FullLogitsDDP(DDP):
    """--ce-chunk's baseline (--compare-native, --paired): the same DDP, its loss on the full
    logits."""
    name = "ddp-full-logits"

    def __init__(self, model, args, env):
        args = copy.copy(args)
        args.ce_chunk = 0
        super().__init__(model, args, env)


DDP.native = staticmethod(lambda args: [FullLogitsDDP] if args.ce_chunk else [TorchDDP])


def token_sharded_step(strat, batch: Batch, pos: torch.Tensor, label_pos=None) -> float:
    """One step when ranks hold the same weights but different tokens of every sequence
    (Ulysses, context parallelism): forward this rank's positions `pos` with their global
    position ids, backpropagate W * CE_sum / N, average the gradients (strat.dp, DataParallel),
    clip, step. Returns the global loss. label_pos: the labels' columns (default pos)."""
    W, B = strat.env.world, batch.input_ids.shape[0]
    strat.optimizer.zero_grad(set_to_none=False)   # in place: .grad stays a view of its bucket
    # global positions, or within each packed document (--doc-mask): (B, S/W)
    where = pos[None].expand(B, -1) if batch.doc_positions is None else batch.doc_positions[:, pos]
    with phase("forward"), dropout.at(batch, hidden=pos):   # (all columns in attention)
        logits = strat.dp(input_ids=batch.input_ids[:, pos],   # (B, S) -> (B, S/W)
                          position_ids=where).logits           # (B, S/W, V)
        ce = lm_loss_sum(logits, batch.labels[:, pos if label_pos is None else label_pos])
    with phase("backward"):
        (ce * W / batch.n_tokens).backward()   # averaged by the end of the backward
    with phase("optimizer"):
        if strat.args.clip:
            strat.grad_norm = torch.nn.utils.clip_grad_norm_(strat.model.parameters(),
                                                             strat.args.clip)
        strat.optimizer.step()
    return global_loss(ce.detach(), batch.n_tokens)

def main():
    """`torchrun ddp.py --mode ...`: ddp.py's __main__ lands here."""
    harness_main(DDP)
