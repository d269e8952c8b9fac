"""strategy.py: the strategy contract, the single-device reference, and helpers adapters share.

The adapter contract is written once, in harness/__init__.py's docstring.

Strategy code marks its forward and backward with `with phase("forward"):` so the benchmark can
time them and the memory tracker can tell activations from the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import dropout
from .collectives import local_part
from .data import Batch
from .loss import lm_loss_sum
from .meter import Expect, METER, phase
from .oracle import OracleMuon
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
    # dropout.py's FunctionalDropout (StarCoder2's residual_dropout is a function call)
    "dropout-functional-torch": Plant("a decoder layer's functional dropout is left to torch: "
                                      "its mask is drawn from the rank's generator, not keyed "
                                      "by the tokens' global coordinates",
                                      ("--model", "tiny-starcoder2", "--dropout", "0.1")),
    # every strategy's set-up (run.same_build): the run must end in one line, exit 2
    "build-per-rank": Plant("rank 1's model is built with other weights than rank 0's (a "
                            "device's random init that is not reproducible across ranks)"),
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
    optimizers = ("adamw",)   # --optimizer values it supports (muon.py's: "muon")
    muon_modes = ("auto",)    # --muon-mode values it supports
    lora = False          # takes --lora R (peft's adapters; lora.py)
    doc_mask = False      # takes --doc-mask (packed documents through HF's forward)
    # --fp8 RECIPE: fp8.convert (the rig's, which imports the learner file), applied to the one
    # build before the reference and the strategy copy it; the strategy scopes its own layers
    convert_fp8 = None
    fp8_benchmark = False   # --mode benchmark --fp8 tensorwise: its formulas count FP8's traffic
    # --fp8 with micro-batches: (args, world) -> the global batch's rows of each micro-batch the
    # strategy casts with its own amaxes (None: one), which the reference then runs one by one
    fp8_micro_rows = None
    # --fp8 tensorwise, correctness: a context manager recording every amax this rank's casts
    # use in the strategy's steps; its check() (a collective) says whether they are the same on
    # every rank of its stage (rig/ddp.py's AmaxLog; None where no two ranks run the same
    # layers: pp.py). fp8_stage: which ranks do (compose4d: the pipeline stage)
    fp8_amax_log = None
    fp8_stage = 0
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

    def wait_comm(self):
        """Finish this rank's communication still in flight after step() (ZeRO's parameter
        all-gathers for the next forward); the benchmark's profiled steps call it before the
        profiler stops (harness/overlap.py)."""

    def report_lines(self) -> list[str]:
        """Extra benchmark lines (e.g. padding)."""
        return []

    def learning_lines(self) -> list[str]:
        """Extra lines after a learning run (collective: every rank calls)."""
        return []


def spread_across_ranks(tensors, group=None) -> float:
    """Max over tensors of (max - min across ranks) of each tensor's sum: 0.0 when every rank
    holds identical replicas (a checksum, for extra_checks; not metered)."""
    sums = torch.stack([local_part(t).detach().double().sum() for t in tensors])
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
        local = lambda ts: [local_part(t) for t in ts if t is not None]  # noqa: E731
        opt = [v for s in self.optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0]
        return {"params": local(self.model.parameters()),
                "grads": local(p.grad for p in self.model.parameters()), "optimizer": local(opt)}


class Reference(Strategy):
    """The plain HF model and torch.optim.AdamW on the whole global batch, on one device."""
    name = "reference"

    micro_rows = None   # --fp8: the strategy's micro-batches (rows each), run one at a time

    def __init__(self, ref_model, args, env):
        self.model, self.args = ref_model, args
        # (the correctness mode's references step with compare.OracleAdamW, which shares no
        # code with the strategies' optimizer)
        make = getattr(args, "reference_optimizer", None) or make_adamw
        if getattr(args, "optimizer", "adamw") == "muon":   # torch.optim.Muon + AdamW
            self.optimizer = OracleMuon(self.model.named_parameters(), args)
        else:   # (--lora: the adapters; the frozen base has no optimizer state)
            self.optimizer = make([p for p in self.model.parameters() if p.requires_grad], args)

    def objective(self, batch: Batch) -> torch.Tensor:
        """The loss to minimise: mean token cross-entropy (subclasses add terms). Under --fp8
        with micro-batches, the sum of each micro-batch's (each cast with its own amaxes, as the
        strategy casts them)."""
        ce = 0.0
        for mb in ([batch.take(rows) for rows in self.micro_rows] if self.micro_rows
                   else [batch]):
            with dropout.at(mb):
                logits = self.model(input_ids=mb.input_ids, position_ids=mb.doc_positions).logits
            ce = ce + lm_loss_sum(logits, mb.labels)
        return ce / batch.n_tokens

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


def make_reference(cls, model, args, env):
    """cls's single-device reference on `model`; under --fp8 it runs the strategy's
    micro-batches one by one (cls.fp8_micro_rows), each cast with its own amaxes."""
    ref = reference_class(cls)(model, args, env)
    if getattr(args, "fp8", None) and cls.fp8_micro_rows:
        ref.micro_rows = cls.fp8_micro_rows(args, env.world)
    return ref


def natives(cls, args) -> list:
    n = cls.native
    if n is not None and not isinstance(n, (type, list, tuple)):
        n = n(args)           # chosen by the run's arguments
    return list(n) if isinstance(n, (list, tuple)) else ([n] if n else [])
