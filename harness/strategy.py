"""strategy.py: the strategy contract, the single-device reference, and helpers adapters share.

The adapter contract (subclass `Strategy`)
------------------------------------------
    name                      short name used in reports ("ddp")
    syncs_initial_params      True if the strategy claims to make replicas identical itself
                              (e.g. DDP broadcasts from rank 0). Correctness mode then hands
                              ranks != 0 a *perturbed* copy of the weights, so a missing sync fails.
    add_args(parser)          staticmethod: the strategy's own flags
    constraints(args, world, config) -> list[str]
                              staticmethod: each string names one violated constraint. Checked on
                              every rank before the process group exists; rank 0 prints the first
                              one as a single line and every rank exits with code 2.
    __init__(ref_model, args, env)
                              build the local (sharded) model and optimizer *from the full
                              reference weights* (never from a fresh random init), so both start
                              bit-identical. `ref_model` is this rank's private copy: slice it,
                              wrap it, or keep it.
    step(batch) -> float      forward, backward and optimizer step on this rank's share of the
                              global batch (`Batch`, the same object on every rank). Returns the
                              global loss with the reference's normalisation: the mean over all
                              target tokens of the global batch (`batch.n_tokens`), whatever the
                              split. Use `lm_loss_sum` and `global_loss`. Gradients of the last step
                              must stay readable until the next step (zero them at the start).
    full_grads(), full_params() -> dict[str, Tensor]
                              full tensors keyed by the reference's parameter names. Collective:
                              every rank calls; rank 0's result is compared.
    model_states() -> dict[str, list[Tensor]]
                              the tensors this rank keeps resident between steps, by category
                              ("params", "grads", "optimizer"); the default reads self.model and
                              self.optimizer. Bytes are counted over unique storages.
    expected_comm() -> list[Expect]
                              the textbook per-step communication: benchmark mode prints it beside
                              the measured figures and fails when they differ.
    extra_checks() -> list[(name, ok, detail)]
                              strategy-specific correctness checks (collective; rank 0's verdict).
                              Each must be able to fail: no rows that are true by construction.
    grad_norm                 set by step() when --clip is on: the pre-clip global gradient norm
                              (float or 0-d tensor). The harness divides the clipped gradients by
                              torch's clip coefficient from it, so gradients are compared before
                              clipping, and judges the norm on its own row.
    plants                    {NAME: Plant(doc, args, world)}: known bugs the strategy can plant in
                              itself; args is the configuration in which correctness must FAIL
                              (tests/test_plants.py). The harness switches one on for a run
                              (--plant-bug NAME); the strategy's code tests `planted(NAME)` on the
                              line the bug changes (harness/plants.py): no API takes a plant.
    lossy_noise(run)          classmethod, optional: for a strategy that rounds on purpose
                              (zeropp.py's int8 communication), a single-device model of
                              that rounding built from the run's weights (a Strategy with step,
                              full_grads, full_params), or a list of them; each one's distance
                              from the float64 target is one more noise sample (scale 1). None
                              (the default): exact.
    native                    optional Strategy subclass (or list of them) wrapping PyTorch's own
                              implementation, used by `--compare-native`; the first is the one
                              the step-time ratio is taken against. Or a staticmethod of the
                              run's args returning one (zero.py: ZeroRedundancyOptimizer for
                              stages 1 and 2, FSDP2 for stage 3).
    reference                 the single-device reference class (default `Reference`: plain HF
                              model + AdamW). A strategy whose objective adds terms to the LM
                              loss (ep_moe's router losses) supplies a subclass computing them.
    learning_lines()          extra lines printed after a learning run (collective).
    report_lines()            extra benchmark lines; `self.bench` (the timings: step_s, forward_s,
                              tokens_per_s, ...) is set before it is called.
    cpu_dtype                 {mode: dtype}: a strategy's own CPU default where MODE_DEFAULTS'
                              does not suit it (ep_moe learns in float64: see its docstring).
    modes                     {name: function(run, cls) -> bool}: extra --mode values (compose4d's
                              "train", from trainer4d/train.py: a logged run with checkpoints,
                              outside the comparisons).

Strategy code marks its forward and backward with `with phase("forward"):` so the benchmark can
time them and the memory tracker can tell activations from the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import dropout
from .data import Batch
from .loss import lm_loss_sum
from .meter import Expect, METER, phase
from .precision import make_adamw  # noqa: F401  (strategies import it from here)


@dataclass(frozen=True)
class Plant:
    """A known bug a strategy can plant in itself (`--plant-bug NAME`): proof that its
    correctness check can fail. `args` is the configuration in which the check must catch it
    (the tests and `tour.py --plants` run exactly that, at `world` ranks)."""
    doc: str
    args: tuple = ()
    world: int = 2


HARNESS_PLANTS = {
    "grad": Plant("the harness perturbs one reported gradient by 1e-6 of its scale (float64 "
                  "only: below float32 noise)"),
    # MasterAdamW's (precision.py), under every strategy that steps with make_adamw; they show
    # in a low-precision run only (fp32/fp64 parameters are their own masters)
    "master-keeps-grads": Plant("MasterAdamW.zero_grad(set_to_none=False) leaves the bf16 "
                                "gradients in place: the next step accumulates onto them",
                                ("--dtype", "bfloat16")),
    # the correctness mode's --host-syncs check (hostsync.py), on dropout.py's keep_mask
    "dropout-host-key": Plant("dropout's keep_mask builds its key tensor from the host at every "
                              "dropout site (torch.tensor(key, device=...)): a host-to-device "
                              "copy inside the step", ("--dropout", "0.1", "--host-syncs")),
    "master-no-copy": Plant("MasterAdamW.step does not copy the updated fp32 masters back into "
                            "the bf16 weights: the model never changes",
                            ("--dtype", "bfloat16")),
}


class Strategy:
    name = "strategy"
    syncs_initial_params = False
    native = None
    reference = None  # None: Reference (set after its definition)
    cpu_dtype: dict = {}  # mode -> default dtype on CPU where the strategy needs another one
    modes: dict = {}      # extra --mode name -> function(run, cls) -> bool (compose4d's "train")
    plants: dict = {}     # --plant-bug NAME -> what the planted bug does (correctness must FAIL)
    chunked_ce = False    # takes --ce-chunk N (loss.chunked_loss_sum)
    self_check = None     # ("what", build(model, args) -> fn(ids) -> logits): selfcheck.py

    @staticmethod
    def add_args(parser):
        pass

    @classmethod
    def lossy_noise(cls, run):
        return None

    @staticmethod
    def constraints(args, world, config) -> list[str]:
        return []

    def __init__(self, ref_model, args, env):
        raise NotImplementedError

    def step(self, batch: Batch) -> float:
        raise NotImplementedError

    def full_grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad for n, p in self.model.named_parameters()}

    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def model_states(self) -> dict[str, list[torch.Tensor]]:
        opt = getattr(self, "optimizer", None)
        states = [v for s in (opt.state.values() if opt else []) for v in s.values()
                  if isinstance(v, torch.Tensor)]
        states += getattr(opt, "master_tensors", list)()   # fp32 masters of bf16 parameters
        return {"params": list(self.model.parameters()),
                "grads": [p.grad for p in self.model.parameters()],
                "optimizer": states}

    def expected_comm(self) -> list[Expect]:
        return []

    def extra_checks(self) -> list[tuple[str, bool, str]]:
        return []

    def memory_formula(self) -> dict[str, float] | None:
        """Textbook resident bytes per rank by model_states() category (benchmark report)."""
        return None

    def report_lines(self) -> list[str]:
        """Extra benchmark lines (e.g. padding)."""
        return []

    def learning_lines(self) -> list[str]:
        """Extra lines after a learning run (collective: every rank calls)."""
        return []


def spread_across_ranks(tensors, group=None) -> float:
    """Max over tensors of (max - min across ranks) of each tensor's sum: 0.0 when every rank
    holds identical replicas (a checksum, for extra_checks; not metered)."""
    sums = torch.stack([t.detach().double().sum() for t in tensors])
    lo, hi = sums.clone(), sums.clone()
    with METER.paused():
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    return (hi - lo).abs().max().item()


def full_tensor(t):
    """A DTensor's full value (a collective); a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class DTensorBaseline(Strategy):
    """Reassembly for PyTorch's DTensor-based baselines (FSDP2, DTensor TP): full tensors via
    full_tensor(), resident bytes from the local shards."""

    def full_grads(self):
        return {n: full_tensor(p.grad) for n, p in self.model.named_parameters()}

    def full_params(self):
        return {n: full_tensor(p.detach()) for n, p in self.model.named_parameters()}

    def model_states(self):
        local = lambda ts: [t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
                            for t in ts if t is not None]
        opt = [v for s in self.optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0]
        return {"params": local(self.model.parameters()),
                "grads": local(p.grad for p in self.model.parameters()), "optimizer": local(opt)}


class Reference(Strategy):
    """The plain HF model and torch.optim.AdamW on the whole global batch, on one device."""
    name = "reference"

    def __init__(self, ref_model, args, env):
        self.model, self.args = ref_model, args
        # (the correctness mode's references step with compare.OracleAdamW, which shares no
        # code with the strategies' optimizer)
        make = getattr(args, "reference_optimizer", None) or make_adamw
        self.optimizer = make(self.model.parameters(), args)

    def objective(self, batch: Batch) -> torch.Tensor:
        """The loss to minimise: mean token cross-entropy (subclasses add terms)."""
        with dropout.at(batch):
            logits = self.model(input_ids=batch.input_ids).logits
        return lm_loss_sum(logits, batch.labels) / batch.n_tokens

    def after_step(self):
        """Non-gradient state updates after the optimizer step (none here)."""

    def step(self, batch: Batch) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        with phase("forward"):
            loss = self.objective(batch)
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            if self.args.clip:
                self.grad_norm = self.clip(self.args.clip)
            self.optimizer.step()
        self.after_step()
        return loss.item()

    def clip(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)


def reference_class(cls):
    return getattr(cls, "reference", None) or Reference


def natives(cls, args) -> list:
    n = cls.native
    if n is not None and not isinstance(n, (type, list, tuple)):
        n = n(args)           # chosen by the run's arguments
    return list(n) if isinstance(n, (list, tuple)) else ([n] if n else [])
