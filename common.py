"""common.py: everything that is not a parallelism.

A strategy file (ddp.py, zero.py, ...) supplies a small adapter class; this module launches the
process group, builds the single-device reference model, generates the data, and runs the three
modes against the reference. Nothing here knows how any strategy splits the work.

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
                              itself (--plant-bug NAME, checked where the bug would be); args is the
                              configuration in which correctness must FAIL (tests/test_plants.py).
    native                    optional Strategy subclass (or list of them) wrapping PyTorch's own
                              implementation, used by `--compare-native`; the first is the one
                              the step-time ratio is taken against.
    reference                 the single-device reference class (default `Reference`: plain HF
                              model + AdamW). A strategy whose objective adds terms to the LM
                              loss (ep_moe's router losses) supplies a subclass computing them.
    learning_lines()          extra lines printed after a learning run (collective).
    report_lines()            extra benchmark lines; `self.bench` (the timings: step_s, forward_s,
                              tokens_per_s, ...) is set before it is called.
    cpu_dtype                 {mode: dtype}: a strategy's own CPU default where MODE_DEFAULTS'
                              does not suit it (ep_moe learns in float64: see its docstring).
    modes                     {name: function(run, cls) -> bool}: extra --mode values (compose4d's
                              "train": a logged run with checkpoints, outside the comparisons).

Strategy code marks its forward and backward with `with phase("forward"):` so the benchmark can
time them and the memory tracker can tell activations from the rest.

Modes (`--mode correctness|learning|benchmark|all`)
---------------------------------------------------
correctness  rank 0 runs the reference (plain HF model + torch.optim.AdamW on the whole global
             batch) while the strategy runs on every rank, same batches (with ignored labels,
             uneven per rank and micro-batch), >= 2 optimizer steps. Compares the loss at every
             step, every gradient (before clipping) at every step and every parameter after
             every step against a float64 reference, each error judged against the measured
             noise of a single-device run (NoisePolicy, "Verdicts" below); prints a per-tensor
             table; the last line starts PASS or FAIL.
plants       the clean correctness run, then each planted bug (--plants a,b; default: the plants
             declared for this configuration) in one process group: PASS when the clean run
             PASSes and every plant FAILs.
learning     --steps steps on the synthetic language, reference and strategy side by side,
             against the language's exact entropy rate (the loss floor).
benchmark    --warmup steps, then --bench-iters timed steps (a fixed count: adaptive counts
             deadlock because ranks decide differently). Step and forward time (max over ranks),
             tokens/s, memory per rank, communication per step by op and group beside formulas,
             the single-device reference, and with --compare-native PyTorch's implementation.
peak         (oom_search.py's trials) two full steps under the memory tracker, the steady-state
             peak (`steady_peak`): `TRIAL OK {json}`, or `TRIAL OOM ...` and exit code 3 when
             --mem-budget-gb (CPU, simulated) or the CUDA allocator runs out.
A strategy may add modes (`Strategy.modes`): compose4d's `train`.

`--out DIR` writes correctness.json, learning.csv (+ .png with matplotlib), benchmark.json.

Communication is counted by wrapping the `torch.distributed` functions while a step runs, so
strategy code calls plain `dist.all_reduce(...)`. Bytes are the logical buffer per call: the
tensor for all_reduce/broadcast/send/recv, the *full* (gathered) tensor for all_gather and
reduce_scatter, the send buffer for all_to_all. Per-rank wire traffic for a ring algorithm is
derived from that: all_reduce 2(W-1)/W, all_gather and reduce_scatter (W-1)/W, all_to_all (W-1)/W.
Loss logging (one scalar all_reduce) runs under `meter.paused()` and is not counted.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import inspect
import datetime
import functools
import gc
import json
import math
import os
import re
import socket
import sys
import time
import types
import warnings
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten  # noqa: F401  (re-exported for strategies)

# torch 2.13 renames all_gather_into_tensor/reduce_scatter_tensor to *_single; 2.11 lacks the new
# names, so strategies keep the old ones (both are metered) and the warning is noise.
warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor).*deprecated")

IGNORE_INDEX = -100
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}

# ----------------------------------------------------------------------------------------------
# Model presets. `tiny` is for CPU tests (GQA, untied embeddings); `small` for CPU benchmarks
# (~19M parameters); the Llama 3 shapes are for GPU runs and memory planning.
# ----------------------------------------------------------------------------------------------
PRESETS = {
    "tiny": dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6),
    "small": dict(model_type="llama", vocab_size=8192, hidden_size=384, intermediate_size=1024,
                  num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2,
                  max_position_embeddings=8192, tie_word_embeddings=False, rms_norm_eps=1e-6),
    "llama3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048,
                        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, max_position_embeddings=131072,
                        tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=500000.0,
                        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0,
                                          original_max_position_embeddings=8192)),
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, max_position_embeddings=8192,
                      tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=500000.0),
    # Mixture-of-Experts (HF Mixtral): `tiny-moe` for CPU tests, Mixtral 8x7B's shape for planning.
    "tiny-moe": dict(model_type="mixtral", vocab_size=256, hidden_size=64, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.0,
                     max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6),
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=32768, tie_word_embeddings=False,
                         rms_norm_eps=1e-5, rope_theta=1e6, router_jitter_noise=0.0),
}


class ConfigError(Exception):
    """A violated configuration constraint: one line, exit code 2, before any collective."""


@dataclass(frozen=True)
class Plant:
    """A known bug a strategy can plant in itself (`--plant-bug NAME`): proof that its
    correctness check can fail. `args` is the configuration in which the check must catch it
    (the tests and `tour.py --plants` run exactly that, at `world` ranks)."""
    doc: str
    args: tuple = ()
    world: int = 2


HARNESS_PLANTS = {"grad": Plant("the harness perturbs one reported gradient by 1e-6 of its "
                                "scale (float64 only: below float32 noise)")}


# ----------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------
MODE_DEFAULTS = {  # (steps, dtype on cpu) per mode; see the numerics policy in the README
    "correctness": (2, "float64"),
    "plants": (2, "float64"),    # correctness runs: the clean one, then each planted bug
    "learning": (200, "float32"),
    "benchmark": (None, "float32"),
    "peak": (1, "float32"),
    "train": (100, "float32"),   # a strategy's own mode (compose4d's training run)
}


def _dtype_list(text: str) -> str:
    bad = [d for d in text.split(",") if d not in DTYPES]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]!r} is not one of {', '.join(DTYPES)}")
    return text


def base_parser(prog: str, modes=(), plants=None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mode", default="correctness",
                   choices=["correctness", "learning", "benchmark", "all", "peak", "plants",
                            *modes])
    p.add_argument("--model", default="tiny",
                   help="preset (%s), a local HF model directory, or a config.json path"
                   % ", ".join(PRESETS))
    p.add_argument("--dtype", default=None, type=_dtype_list,
                   help="%s; comma-separated: each in turn in one process group "
                        "(e.g. float64,float32). Default: float64 for correctness, float32 "
                        "otherwise on CPU; bfloat16 for learning/benchmark on CUDA"
                        % "|".join(DTYPES))
    p.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="default: cuda when available")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"],
                   help="HF attention implementation of the reference model")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--length", type=int, default=64, help="sequence length")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps (default 2 for correctness, 200 for learning)")
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW learning rate (default 1e-3 correctness, 3e-3 learning)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0, help="model init, language and sample seed")
    p.add_argument("--branching", type=int, default=4,
                   help="successors per token in the synthetic Markov language")
    p.add_argument("--tol-k", type=float, default=None,
                   help="correctness: a strategy passes when err(strategy vs float64 reference) "
                        "<= K x the single-device noise + a floor (default %g; see the README's "
                        "numerics policy)" % 8.0)
    p.add_argument("--warmup", type=int, default=2, help="benchmark warm-up steps")
    p.add_argument("--bench-iters", type=int, default=5, help="benchmark timed steps")
    p.add_argument("--log-every", type=int, default=10, help="learning-mode print interval")
    p.add_argument("--compare-native", action="store_true",
                   help="also run PyTorch's own implementation, where the strategy has one")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="process-group timeout in seconds: a dead peer fails instead of hanging")
    p.add_argument("--out", default=None, help="directory for json/csv/png results")
    p.add_argument("--clip", type=float, default=0.0,
                   help="clip gradients to this global L2 norm (0: off)")
    p.add_argument("--mem-budget-gb", type=float, default=None,
                   help="peak mode: a simulated OOM as soon as a rank's live tensor bytes "
                        "exceed this (CPU tracker); on CUDA the real allocator decides")
    p.add_argument("--mem-fraction", type=float, default=None,
                   help="peak mode on CUDA: torch.cuda.set_per_process_memory_fraction, to "
                        "emulate a smaller GPU")
    plants = {**HARNESS_PLANTS, **(plants or {})}
    p.add_argument("--plant-bug", default=None, choices=list(plants), metavar="NAME",
                   help="plant a known bug; correctness mode must FAIL. " + "; ".join(
                       f"{k}: {v.doc}" for k, v in plants.items()))
    p.add_argument("--runs", default=None, metavar="FILE",
                   help="a JSON list of argument lists, run one after another in this one "
                        "process group (start-up paid once); each needs its own --out, where "
                        "its verdict goes to status.json")
    p.add_argument("--plants", default=None,
                   help="--mode plants: comma-separated plants to run after the clean run "
                        "(default: all of this strategy's own)")
    return p


def resolve_defaults(args, mode: str, device: str, world: int = 1) -> argparse.Namespace:
    """A copy of args with the mode-dependent defaults filled in."""
    a = copy.copy(args)
    a.mode = mode
    steps, cpu_dtype = MODE_DEFAULTS[mode]
    if a.steps is None:
        a.steps = steps
    if a.dtype is None:
        a.dtype = cpu_dtype if (device == "cpu" or mode == "correctness") else "bfloat16"
    if a.lr is None:
        a.lr = 1e-3 if mode == "correctness" else 3e-3
    if a.tol_k is None:
        a.tol_k = TOL_K
    return a


# ----------------------------------------------------------------------------------------------
# Launch: torchrun environment, gloo on CPU and NCCL on CUDA, a timeout, clean teardown
# ----------------------------------------------------------------------------------------------
@dataclass
class Env:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_from_os() -> tuple[int, int, int]:
    """(rank, world, local_rank) from torchrun's variables; a plain `python x.py` is world 1."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args) -> Env:
    rank, world, local_rank = env_from_os()
    if "RANK" not in os.environ:  # plain python: a group of one, so strategy code is unchanged
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        # torchrun gives each worker one thread; a plain run may use the whole machine.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    kw = dict(backend=backend, timeout=datetime.timedelta(seconds=args.timeout))
    if backend == "nccl":
        kw["device_id"] = device
    dist.init_process_group(**kw)
    return Env(rank, world, local_rank, device, backend)


def teardown(clean: bool = True):
    """Destroy the groups; after a barrier when every rank got here normally, so no rank tears
    down gloo while a peer is still inside a collective. Then collect the cyclic garbage (a
    strategy's hooks refer to it, and it to its subgroups) so that every ProcessGroupGloo is
    destructed, and its worker threads joined, now and not during interpreter shutdown, where
    that can abort the process ("terminate called without an active exception")."""
    if dist.is_initialized():
        if clean:
            with METER.paused():
                dist.barrier()
        dist.destroy_process_group()
    gc.collect()


# ----------------------------------------------------------------------------------------------
# Model: HF transformers from a preset, a config.json, or a local checkpoint directory
# ----------------------------------------------------------------------------------------------
def load_config(spec: str):
    """The HF config for `--model`: preset name, model directory, or config.json path."""
    from transformers import AutoConfig, CONFIG_MAPPING
    if spec in PRESETS:
        kw = dict(PRESETS[spec])
        return CONFIG_MAPPING[kw.pop("model_type")](**kw)
    if os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise ConfigError(f"--model {spec}: directory has no config.json")
        return AutoConfig.from_pretrained(spec)
    if os.path.isfile(spec) and spec.endswith(".json"):
        with open(spec) as f:
            kw = json.load(f)
        return CONFIG_MAPPING[kw.pop("model_type", "llama")](**kw)
    raise ConfigError(f"--model {spec}: not a preset ({', '.join(PRESETS)}), "
                      f"a model directory or a config.json")


def has_weights(spec: str) -> bool:
    return os.path.isdir(spec) and any(
        f.endswith((".safetensors", ".bin")) for f in os.listdir(spec))


def _promoting_rmsnorm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """HF's RMSNorm with `.to(float32)` replaced by promotion to at least float32: identical
    for bf16/fp32, and truly float64 in float64 runs (HF's cast would round every norm to
    float32, so a loss scaled by a non-power-of-two W shows 1e-7 errors in a float64 run)."""
    dtype = hidden_states.dtype
    h = hidden_states.to(torch.promote_types(dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(dtype)


def promote_norms(model: torch.nn.Module) -> torch.nn.Module:
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon"):
            m.forward = types.MethodType(_promoting_rmsnorm_forward, m)
    return model


def model_kwargs(config, attn: str) -> dict:
    """The implementation choices every model build makes (from_config / from_pretrained)."""
    kw = dict(attn_implementation=attn)
    if getattr(config, "num_local_experts", None):
        # HF's reference expert loop; its grouped_mm kernel takes no float64
        kw["experts_implementation"] = "eager"
    return kw


def build_model(args, config, device) -> torch.nn.Module:
    """The full reference model in args.dtype on `device`: loaded weights when --model is a
    checkpoint directory, otherwise a seeded random init (identical on every rank)."""
    from transformers import AutoModelForCausalLM
    dtype = DTYPES[args.dtype]
    kw = model_kwargs(config, args.attn)
    if has_weights(args.model):
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, **kw)
    else:
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(config, **kw)
    return promote_norms(model.to(device=device, dtype=dtype)).train()


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def common_constraints(args, world, config) -> list[str]:
    errs = []
    if args.batch < 1 or args.length < 2:
        errs.append(f"--batch ({args.batch}) must be >= 1 and --length ({args.length}) >= 2")
    drop = getattr(config, "attention_dropout", 0.0) or 0.0
    if drop > 0:
        errs.append(f"attention_dropout={drop}: dropout is not reproducible across layouts; "
                    "set it to 0")
    if args.clip < 0:
        errs.append(f"--clip must be >= 0 (got {args.clip})")
    if args.branching > config.vocab_size:
        errs.append(f"--branching {args.branching} exceeds vocab_size {config.vocab_size}")
    return errs


# ----------------------------------------------------------------------------------------------
# Data: a sparse random Markov chain over the vocabulary. Sequences start from the stationary
# distribution pi, so every position's next-token entropy is exactly the chain's entropy rate
#     H = sum_i pi_i * H(P_i)     (nats),
# the floor that a perfect model's cross-entropy reaches. Sample i is a pure function of
# (seed, i): the same whatever the world size, rank or layout.
# ----------------------------------------------------------------------------------------------
class MarkovLanguage:
    def __init__(self, vocab: int, seed: int, branching: int = 4):
        rng = np.random.default_rng([seed, 0x5EED])
        self.vocab, self.seed = vocab, seed
        self.succ = np.stack([rng.choice(vocab, branching, replace=False) for _ in range(vocab)])
        self.prob = rng.dirichlet(np.ones(branching), size=vocab)            # (V, k)
        self.cum = np.cumsum(self.prob, axis=1)
        self.cum[:, -1] = 1.0
        self.pi = self._stationary()
        row_entropy = -(self.prob * np.log(self.prob)).sum(axis=1)
        self.entropy_rate = float((self.pi * row_entropy).sum())

    def _stationary(self, iters: int = 10000, tol: float = 1e-13) -> np.ndarray:
        pi = np.full(self.vocab, 1.0 / self.vocab)
        for _ in range(iters):  # lazy chain (I+P)/2: same pi, and no oscillation if periodic
            nxt = np.zeros_like(pi)
            np.add.at(nxt, self.succ, pi[:, None] * self.prob)
            nxt = 0.5 * (pi + nxt)
            if np.abs(nxt - pi).sum() < tol:
                return nxt / nxt.sum()
            pi = nxt
        return pi / pi.sum()

    def sample(self, start: int, count: int, length: int) -> np.ndarray:
        """Samples start..start+count-1, each length+1 tokens, as an int64 array."""
        u = np.stack([np.random.default_rng([self.seed, i]).random(length + 1)
                      for i in range(start, start + count)])
        x = np.empty((count, length + 1), dtype=np.int64)
        x[:, 0] = np.searchsorted(np.cumsum(self.pi), u[:, 0]).clip(max=self.vocab - 1)
        for t in range(1, length + 1):
            cur = x[:, t - 1]
            j = (u[:, t, None] > self.cum[cur]).sum(axis=1)
            x[:, t] = self.succ[cur, j]
        return x


@dataclass
class Batch:
    """A global batch. labels are already shifted (labels[:, t] is the token after
    input_ids[:, t]), so every position has a target and a sequence split loses no token."""
    input_ids: torch.Tensor   # (B, S)
    labels: torch.Tensor      # (B, S), IGNORE_INDEX where there is no target
    index: int                # step index s: samples [s*B, (s+1)*B)

    @functools.cached_property
    def n_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def rows(self, start: int, stop: int) -> "Batch":
        return Batch(self.input_ids[start:stop], self.labels[start:stop], self.index)

    def shard(self, rank: int, world: int) -> "Batch":
        """This rank's contiguous share of the sequences (world must divide the batch)."""
        n = self.input_ids.shape[0] // world
        return self.rows(rank * n, (rank + 1) * n)

    def split(self, k: int) -> list["Batch"]:
        n = self.input_ids.shape[0] // k
        return [self.rows(i * n, (i + 1) * n) for i in range(k)]


PAD_ID = 0   # the input token at padded positions (their labels are IGNORE_INDEX)


def ignore_spans(seed: int, start: int, count: int, length: int) -> np.ndarray:
    """(count, length) bool: which targets of samples start..start+count-1 are ignored, a pure
    function of (seed, sample index) like the tokens. Each sample gets a padded tail of 0..L/4
    positions (inputs PAD_ID, labels ignored) and an ignored span of 0..L/8 labels somewhere
    before it (a masked prompt), so token counts differ per sample, per rank, per micro-batch
    and per sequence chunk, and a "mean of per-shard means" cannot agree with the global mean."""
    out = np.zeros((count, length), dtype=bool)
    for r, i in enumerate(range(start, start + count)):
        rng = np.random.default_rng([seed, i, 0x1D])
        tail = int(rng.integers(0, length // 4 + 1))
        span = int(rng.integers(0, length // 8 + 1))
        a = int(rng.integers(0, max(1, length - tail - span)))
        out[r, a:a + span] = True
        if tail:
            out[r, length - tail - 1:] = True     # the last real token predicts padding too
    return out


def make_batch(lang: MarkovLanguage, step: int, batch: int, length: int, device,
               offset: int | None = None, ignore: bool = False) -> Batch:
    """Samples [step*batch, (step+1)*batch), or [offset, offset+batch) when the global batch
    has not been the same every step (compose4d's elastic restarts). ignore=True (correctness
    mode) pads and masks targets as `ignore_spans` says."""
    start = step * batch if offset is None else offset
    x = torch.from_numpy(lang.sample(start, batch, length))
    inputs, labels = x[:, :-1].clone(), x[:, 1:].clone()
    if ignore:
        m = torch.from_numpy(ignore_spans(lang.seed, start, batch, length))
        labels[m] = IGNORE_INDEX
        # padded tail: the inputs after the last real token are PAD_ID too
        pad = torch.zeros_like(m)
        pad[:, 1:] = m[:, :-1] & m[:, -1:]
        pad &= torch.flip(torch.cummin(torch.flip(m.int(), [1]), 1).values.bool(), [1])
        inputs[pad] = PAD_ID
    return Batch(inputs.to(device).contiguous(), labels.to(device).contiguous(), step)


# ----------------------------------------------------------------------------------------------
# Loss: the reference normalisation is the mean over all target tokens of the global batch.
# A strategy computes the cross-entropy *sum* over its tokens and divides by batch.n_tokens.
# ----------------------------------------------------------------------------------------------
def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies; half-precision logits are upcast to fp32 first."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def scalar(t: torch.Tensor) -> float:
    """`t.item()` for logging, and NaN for a FakeTensor (oom_search --simulate runs the real step
    on FakeTensors, which have shapes but no values)."""
    from torch._subclasses.fake_tensor import FakeTensor
    return float("nan") if isinstance(t, FakeTensor) else t.item()


def global_loss(local_sum: torch.Tensor, n_tokens: int, group=None) -> float:
    """The global mean loss from each rank's CE sum (logging only: not metered)."""
    t = local_sum.detach().to(torch.float64).reshape(1).clone()
    with METER.paused():
        dist.all_reduce(t, group=group)
    return scalar(t) / n_tokens


# ----------------------------------------------------------------------------------------------
# Phases: strategies mark forward/backward/optimizer; benchmark times them, the memory tracker
# tags storages allocated inside "forward" as activations.
# ----------------------------------------------------------------------------------------------
class Phases:
    def __init__(self):
        self.stack: list[str] = []
        self.elapsed: dict[str, float] = {}
        self.sync = None  # torch.cuda.synchronize on CUDA so times are real

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.sync:
            self.sync()
        t0 = time.perf_counter()
        self.stack.append(name)
        try:
            yield
        finally:
            self.stack.pop()
            if self.sync:
                self.sync()
            self.elapsed[name] = self.elapsed.get(name, 0.0) + time.perf_counter() - t0

    @property
    def current(self) -> str | None:
        return self.stack[-1] if self.stack else None

    def reset(self):
        self.elapsed = {}


phase = Phases()


# ----------------------------------------------------------------------------------------------
# Communication meter: wraps torch.distributed functions while active. Strategies name their
# groups with `name_group(group, "dp")` so reports say which group carried the bytes.
# ----------------------------------------------------------------------------------------------
_GROUP_NAMES = weakref.WeakKeyDictionary()   # a name must not keep a destroyed group alive


def name_group(group, name: str):
    if isinstance(group, dist.ProcessGroup):   # not None / NON_GROUP_MEMBER (not a member)
        _GROUP_NAMES[group] = name
    return group


def group_name(group) -> str:
    if group is None or group is dist.group.WORLD:
        return "world"
    return _GROUP_NAMES.get(group, f"group{id(group) % 10000}")


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


# op -> the argument whose size is "the bytes" (names as in torch.distributed's signatures)
_METERED = {
    "all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor",
    "all_gather_into_tensor": "output_tensor",   # the full (gathered) tensor
    "all_gather_single": "output_tensor",        # torch >= 2.13 name of the same
    "reduce_scatter_tensor": "input",            # the full (unreduced) tensor
    "reduce_scatter_single": "input",
    "all_gather": "tensor_list", "reduce_scatter": "input_list",
    "all_to_all_single": "input",                # the send buffer
    "send": "tensor", "recv": "tensor", "isend": "tensor", "irecv": "tensor",
    "batch_isend_irecv": "p2p_op_list",
}
RING_FACTOR = {  # per-rank wire bytes / logical bytes, for ring algorithms on W ranks
    "all_reduce": lambda w: 2 * (w - 1) / w, "all_gather_into_tensor": lambda w: (w - 1) / w,
    "reduce_scatter_tensor": lambda w: (w - 1) / w, "all_gather": lambda w: (w - 1) / w,
    "all_gather_single": lambda w: (w - 1) / w, "reduce_scatter_single": lambda w: (w - 1) / w,
    "reduce_scatter": lambda w: (w - 1) / w, "all_to_all_single": lambda w: (w - 1) / w,
    "broadcast": lambda w: (w - 1) / w, "reduce": lambda w: (w - 1) / w,
}


class CommMeter:
    def __init__(self):
        self.counts: dict[tuple[str, str], list[int]] = {}
        self._depth = 0       # only the outermost call counts (batch_isend_irecv -> isend)
        self._paused = 0
        self._saved: dict = {}

    def _wrap(self, name, fn):
        sig = inspect.signature(fn)

        def wrapper(*args, **kwargs):
            if self._depth == 0 and not self._paused:
                bound = sig.bind(*args, **kwargs).arguments
                if name == "batch_isend_irecv":
                    for op in bound["p2p_op_list"]:
                        opn = getattr(op.op, "__name__", "p2p").lstrip("_")
                        self._add(opn, group_name(op.group), _nbytes(op.tensor))
                else:
                    self._add(name, group_name(bound.get("group")), _nbytes(bound[_METERED[name]]))
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
        wrapper.__name__ = name
        wrapper.__wrapped__ = fn
        return wrapper

    def _add(self, op, group, nbytes):
        c = self.counts.setdefault((op, group), [0, 0])
        c[0] += 1
        c[1] += nbytes

    @contextlib.contextmanager
    def measuring(self):
        """Count every metered call in the block (cumulative until reset()). The wrappers go
        into torch.distributed and into distributed_c10d's globals, where P2POp checks that its
        op is isend/irecv and where one collective calls another (the depth guard then keeps
        the inner call from being counted twice)."""
        assert not self._saved, "meter already active"
        c10d = dist.distributed_c10d
        for name in _METERED:
            fn = getattr(dist, name, None)
            if fn is None:  # e.g. all_gather_single before torch 2.13
                continue
            wrapped = self._wrap(name, fn)
            for mod in (dist, c10d):
                if getattr(mod, name, None) is fn:
                    self._saved[(mod, name)] = fn
                    setattr(mod, name, wrapped)
        try:
            yield self
        finally:
            for (mod, name), fn in self._saved.items():
                setattr(mod, name, fn)
            self._saved = {}

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def reset(self):
        self.counts = {}

    @property
    def active(self) -> bool:
        """True while measuring() and not paused (strategies may track data-dependent
        expectations over exactly the metered steps)."""
        return bool(self._saved) and not self._paused

    def snapshot(self, per: int = 1) -> dict[tuple[str, str], tuple[float, float]]:
        return {k: (c / per, b / per) for k, (c, b) in sorted(self.counts.items())}


METER = CommMeter()


@dataclass
class Expect:
    """One row of the textbook communication per optimizer step. ranks="rank 0" compares with
    rank 0's measured traffic; ranks="sum" with the sum over all ranks (for data-dependent
    traffic such as MoE all-to-all, whose per-rank share depends on the routing)."""
    op: str
    group: str
    calls: float
    bytes: float
    formula: str
    ranks: str = "rank 0"


# ----------------------------------------------------------------------------------------------
# Memory: a live-storage tracker (TorchDispatchMode) that works on CPU and CUDA. Storages that
# exist when tracking starts are seeded from the strategy's model states; every storage created
# by an op inside the block is added, and removed when Python frees it. Storages created inside
# phase("forward") are also counted as activations (saved tensors and forward temporaries).
# ----------------------------------------------------------------------------------------------
def unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        st = t.untyped_storage()
        if st._cdata in seen:   # the StorageImpl (also distinct for FakeTensors, unlike data_ptr)
            continue
        seen.add(st._cdata)
        total += st.nbytes()
    return total


class SimulatedOOM(RuntimeError):
    """The live-tensor tracker went over its --mem-budget-gb limit (CPU: a simulated OOM)."""


class MemoryTracker(TorchDispatchMode):
    def __init__(self, preexisting=(), limit: int | None = None):
        super().__init__()
        self.live: dict[int, tuple[int, bool]] = {}   # id(storage) -> (bytes, is_activation)
        self.cur = self.peak = self.act_cur = self.act_peak = 0
        self.limit = limit
        for t in preexisting:
            self._track(t, False)

    def _track(self, t, is_act):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        self._track_storage(t.untyped_storage(), is_act)

    def _track_storage(self, st, is_act):
        key = id(st)
        if key in self.live or st.nbytes() == 0:
            return
        self.live[key] = (0, is_act)
        self._set(key, st.nbytes())
        weakref.finalize(st, self._free, key)

    def _set(self, key, nbytes):
        old, is_act = self.live[key]
        self.live[key] = (nbytes, is_act)
        self.cur += nbytes - old
        self.peak = max(self.peak, self.cur)
        if self.limit is not None and self.cur > self.limit:
            self.limit = None  # raise once; the step unwinds
            raise SimulatedOOM(f"live tensors {self.cur:,} B exceed the budget")
        if is_act:
            self.act_cur += nbytes - old
            self.act_peak = max(self.act_peak, self.act_cur)

    def _resized(self, st):
        """storage.resize_ (how ZeRO-3/FSDP free and re-gather parameters) is no dispatcher op,
        so the tracker wraps it while active."""
        if id(st) in self.live:
            self._set(id(st), st.nbytes())
        else:
            self._track_storage(st, False)

    def __enter__(self):
        orig = self._orig_resize = torch.UntypedStorage.resize_

        def resize_(st, nbytes):
            out = orig(st, nbytes)
            self._resized(st)
            return out
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)

    def _free(self, key):
        nbytes, is_act = self.live.pop(key, (0, False))
        self.cur -= nbytes
        if is_act:
            self.act_cur -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        is_act = "forward" in phase.stack  # phases nest (e.g. attention inside forward)
        for t in tree_flatten(out)[0]:
            self._track(t, is_act)
        return out


# ----------------------------------------------------------------------------------------------
# The adapter base class and the single-device reference
# ----------------------------------------------------------------------------------------------
class Strategy:
    name = "strategy"
    syncs_initial_params = False
    native = None
    reference = None  # None: common.Reference (set after its definition)
    cpu_dtype: dict = {}  # mode -> default dtype on CPU where the strategy needs another one
    modes: dict = {}      # extra --mode name -> function(run, cls) -> bool (compose4d's "train")
    plants: dict = {}     # --plant-bug NAME -> what the planted bug does (correctness must FAIL)

    @staticmethod
    def add_args(parser):
        pass

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


def all_reduce_flat(tensors: list[torch.Tensor], group=None):
    """Sum `tensors` over the group in place with one all_reduce of their concatenation
    (many small gradients: one call instead of one each)."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    off = 0
    for t in tensors:
        t.copy_(flat[off:off + t.numel()].view_as(t))
        off += t.numel()


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


def make_adamw(params, args) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay,
                             betas=(0.9, 0.95), eps=1e-8)


class Reference(Strategy):
    """The plain HF model and torch.optim.AdamW on the whole global batch, on one device."""
    name = "reference"

    def __init__(self, ref_model, args, env):
        self.model, self.args = ref_model, args
        self.optimizer = make_adamw(self.model.parameters(), args)

    def objective(self, batch: Batch) -> torch.Tensor:
        """The loss to minimise: mean token cross-entropy (subclasses add terms)."""
        return lm_loss_sum(self.model(input_ids=batch.input_ids).logits,
                           batch.labels) / batch.n_tokens

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
                self.grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                                self.args.clip)
            self.optimizer.step()
        self.after_step()
        return loss.item()


def reference_class(cls):
    return getattr(cls, "reference", None) or Reference


# ----------------------------------------------------------------------------------------------
# Verdicts: an error is judged against the measured numerical noise of the same computation
# ----------------------------------------------------------------------------------------------
# A fixed tolerance ("1e-5 in float32") encodes one machine's BLAS and one model's conditioning:
# the gradient of a replicated norm in a trained model is a sum over tokens that cancels heavily,
# so its error relative to its own size is large however correct the code. What is portable is a
# comparison of errors. On rank 0 the correctness mode runs the reference twice more:
#
#   target  the reference in float64: the best answer we can compute;
#   noise   the reference on one device in the low dtype N, compared with the target: how far
#           plain, correct arithmetic in N lands from it on this machine, for this model, for
#           this tensor (N = the run's dtype for float32/bfloat16; float32 for float64 runs,
#           scaled by eps64/eps32 = 2^-29: rounding errors propagate linearly in the unit
#           roundoff, so the float32 error profile, rescaled, is float64's own noise).
#
#   PASS  when, for every tensor, step and kind (gradient, parameter, loss, gradient norm),
#         err(strategy, target) <= TOL_K * noise + TOL_FLOOR_ULPS * eps(dtype)
#
# where err is max |got - target| / max |target| over the tensor, and a tensor's noise is at least
# the median noise of its role (the same tensor in the other layers). A parallel strategy reorders
# sums (over ranks, over shards, over sequence chunks) and so may be a few times noisier than
# one device: TOL_K = 8 leaves that room; a real bug (a missing average, a wrong position, one
# lost micro-batch) is off by 1e-3 to 1, orders of magnitude beyond. The floor keeps a tensor
# whose noise happens to be zero from demanding bit-equality. Gradients are compared as they
# were before clipping (the clipped ones divided by the coefficient the strategy applied, from
# the norm it reports), and the norm itself is compared on its own row, so no scale bug can hide
# behind clipping.
EPS = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "bfloat16": 2.0 ** -7}
TOL_K = 8.0
# Parameters after an Adam step: each entry moves by lr * m / (sqrt(v) + eps), which multiplies
# that entry's gradient error by about 1 / (|g| + eps). The parameter error is therefore set by
# the few entries whose gradient is near zero, a small-sample extreme that differs between two
# equally correct runs by more than the gradient errors do (measured: up to 6x on the realistic
# checkpoint in float64). Parameters get PARAM_K_FACTOR times the factor; the bugs only they
# can show (optimizer state, learning rate, the updated-parameter gather) are off by a fraction
# of lr, orders of magnitude beyond either.
PARAM_K_FACTOR = 4.0
# And one entry whose gradient is within rounding of Adam's eps can take a visibly different
# update on rounding alone: lr * g / (|g| + eps) moves by up to lr when g's rounding is
# comparable to eps. A strategy's rounding lands on other entries than the single-device run's,
# so per tensor the noise sample can miss it (measured: TP's vocab-parallel softmax on an untied
# lm_head, float32, 0.01 lr on one entry vs 2e-4 lr of noise). Parameters therefore also get
#     PARAM_LR_FLOOR * lr * steps * min(1, eps(dtype) / ADAM_EPS)      (absolute)
# 5% of an lr step per step in float32 and bfloat16, and ~1e-9 lr in float64, where rounding is
# far below Adam's eps. A learning-rate, optimizer-state or stale-parameter bug moves every entry
# by a large fraction of lr; float64 runs still see a missing weight decay (1e-4 lr).
PARAM_LR_FLOOR = 0.05
ADAM_EPS = 1e-8   # make_adamw's eps
TOL_FLOOR_ULPS = 4.0


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|: an error relative to the tensor's scale, so entries near
    zero do not blow it up."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    if got.shape != ref.shape:
        return math.inf
    if not ref.numel():
        return 0.0
    abs_err = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    return abs_err / scale if scale > 0 else (0.0 if abs_err == 0 else math.inf)


def role(name: str) -> str:
    """A parameter's role: its name with the layer index dropped
    (model.layers.3.mlp.up_proj.weight -> model.layers.*.mlp.up_proj.weight)."""
    return re.sub(r"\.\d+\.", ".*.", name)


@dataclass
class NoisePolicy:
    dtype: str                   # the run's dtype
    k: float = TOL_K
    floor_ulps: float = TOL_FLOOR_ULPS

    @property
    def noise_dtype(self) -> str:
        """The dtype whose single-device run measures the noise."""
        return "float32" if self.dtype == "float64" else self.dtype

    @property
    def scale(self) -> float:
        return EPS[self.dtype] / EPS[self.noise_dtype]

    @property
    def floor(self) -> float:
        return self.floor_ulps * EPS[self.dtype]

    def factor(self, kind: str) -> float:
        return self.k * (PARAM_K_FACTOR if kind == "param" else 1.0)

    def tol(self, noise: float, kind: str = "grad", extra: float = 0.0) -> float:
        return self.factor(kind) * noise + self.floor + extra

    def update_floor(self, lr: float, steps: int) -> float:
        """The absolute parameter floor after `steps` AdamW steps (see PARAM_LR_FLOOR)."""
        return PARAM_LR_FLOOR * lr * steps * min(1.0, EPS[self.dtype] / ADAM_EPS)

    def describe(self) -> str:
        src = (f"single-device {self.noise_dtype} vs float64"
               + (f" x eps ratio {self.scale:.1e}" if self.scale != 1 else ""))
        return (f"err <= {self.k:g} x noise + {self.floor_ulps:g} ulp, params "
                f"{self.factor('param'):g} x + {PARAM_LR_FLOOR * min(1, EPS[self.dtype] / ADAM_EPS):.0e}"
                f" lr/step ({src})")


@dataclass
class Judged:
    """One compared quantity at its worst step: its error and the noise it was judged by."""
    err: float = 0.0
    noise: float = 0.0
    tol: float = 0.0
    step: int = -1
    value: float = math.nan      # the target's value (scalars: the loss, the pre-clip norm)

    @property
    def ratio(self) -> float:
        return self.err / self.tol if self.tol > 0 else (0.0 if self.err == 0 else math.inf)

    @property
    def ok(self) -> bool:
        return self.err <= self.tol   # False for NaN


class Comparison:
    """Per tensor and kind ("grad", "param"), plus the loss and the gradient norm: the worst
    step by err / tol."""

    KINDS = ("grad", "param")

    def __init__(self, names: list[str], shapes: dict, policy: NoisePolicy):
        self.names, self.shapes, self.policy = names, shapes, policy
        self.rows = {n: {k: Judged() for k in self.KINDS} for n in names}
        self.scalars: dict[str, Judged] = {}     # "loss", "grad norm"
        self.missing: set[str] = set()
        self.extra: list[str] = []

    def _judge(self, old: Judged, err: float, noise: float, step: int, kind: str,
               extra: float = 0.0) -> Judged:
        new = Judged(err, noise, self.policy.tol(noise, kind, extra), step)
        key = lambda j: math.inf if math.isnan(j.ratio) else j.ratio  # noqa: E731
        return new if old.step < 0 or key(new) > key(old) else old

    def add(self, kind: str, step: int, got: dict, target: dict, noisy: list,
            floor_abs: float = 0.0):
        """noisy: [(tensors of a noise source, the scale of its error)]; the noise of a tensor
        is the largest scaled error over the sources. floor_abs: an absolute tolerance added
        (parameters: policy.update_floor), relative to each tensor's max |target|."""
        noise = {n: max(rel_err(d[n], target[n]) * sc for d, sc in noisy) for n in self.names
                 if target.get(n) is not None and all(d.get(n) is not None for d, _ in noisy)}
        # One noise sample per tensor can be unusually small (a lucky rounding on a tensor whose
        # entries are all alike). Tensors of the same role in other layers (every layer's
        # mlp.up_proj.weight) have the same conditioning: a tensor is judged against at least
        # the median noise of its role.
        by_role: dict[str, list[float]] = {}
        for n, e in noise.items():
            by_role.setdefault(role(n), []).append(e)
        for n in self.names:
            if n not in got or got[n] is None or n not in noise:
                self.missing.add(f"{kind}:{n}")
                continue
            level = max(noise[n], float(np.median(by_role[role(n)])))
            scale = target[n].detach().abs().max().item() if target[n].numel() else 0.0
            extra = floor_abs / scale if scale > 0 else 0.0
            self.rows[n][kind] = self._judge(self.rows[n][kind], rel_err(got[n], target[n]),
                                             level, step, kind, extra)
        self.extra = sorted(set(got) - set(self.names))

    def add_scalar(self, name: str, step: int, got: float, target: float, noisy: list):
        rel = lambda x: abs(x - target) / abs(target) if target else abs(x - target)  # noqa: E731
        err, noise = rel(got), max(rel(v) * sc for v, sc in noisy)
        self.scalars[name] = self._judge(self.scalars.get(name, Judged()), err, noise, step, name)
        if self.scalars[name].step == step:
            self.scalars[name].value = target

    def all(self):
        """(label, Judged) for everything compared."""
        for n in self.names:
            for k in self.KINDS:
                yield f"{k}:{n}", self.rows[n][k]
        yield from self.scalars.items()

    def max_err(self, kind=None) -> float:
        kinds = [kind] if kind else list(self.KINDS)
        return max((self.rows[n][k].err for n in self.names for k in kinds), default=0.0)

    def max_noise(self, kind=None) -> float:
        kinds = [kind] if kind else list(self.KINDS)
        return max((self.rows[n][k].noise for n in self.names for k in kinds), default=0.0)

    def worst(self) -> tuple[str, Judged]:
        return max(self.all(), key=lambda x: math.inf if math.isnan(x[1].ratio) else x[1].ratio,
                   default=("-", Judged()))


def clip_coef(norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s coefficient."""
    return min(1.0, max_norm / (norm + 1e-6))


def preclip_grads(strat, grads: dict, max_norm: float) -> dict:
    """The gradients before clipping: the clipped ones divided by the coefficient the strategy
    applied, computed from the pre-clip global norm it reports as `grad_norm` (a float or a
    0-d tensor). A wrong norm then shows on the norm's own row; a wrongly scaled gradient on the
    gradient rows, whatever clipping did to it."""
    if not max_norm:
        return grads
    norm = getattr(strat, "grad_norm", None)
    if norm is None:
        raise RuntimeError(f"{strat.name} clips (--clip) but does not report grad_norm")
    coef = clip_coef(float(full_tensor(norm)), max_norm)
    return {n: (g / coef if g is not None else None) for n, g in grads.items()}


# ----------------------------------------------------------------------------------------------
# Running a strategy: shared set-up for the modes
# ----------------------------------------------------------------------------------------------
@dataclass
class Run:
    args: argparse.Namespace
    env: Env
    config: object
    lang: MarkovLanguage
    results: dict = field(default_factory=dict)

    def batch(self, step: int) -> Batch:
        return make_batch(self.lang, step, self.args.batch, self.args.length, self.env.device,
                          ignore=self.args.mode in ("correctness", "plants"))

    def print(self, *a, **k):
        if self.env.is_main:
            print(*a, **k, flush=True)


def perturbed(model, seed: int) -> torch.nn.Module:
    """A copy with every weight nudged: what a rank would hold had it initialised on its own."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g, dtype=torch.float64)
                   .to(p.device, p.dtype))
    return m


def make_pair(run: Run, cls, perturb: bool, with_ref: bool):
    """(reference on rank 0 or None, strategy) from one reference build."""
    ref_model = build_model(run.args, run.config, run.env.device)
    local = ref_model
    if perturb and cls.syncs_initial_params and run.env.rank != 0:
        local = perturbed(ref_model, 1000 + run.env.rank)
    else:
        local = copy.deepcopy(ref_model)
    ref = (reference_class(cls)(ref_model, run.args, run.env)
           if (with_ref and run.env.is_main) else None)
    if not ref:
        del ref_model
    with METER.measuring():  # count the one-time set-up traffic (e.g. the initial broadcast)
        METER.reset()
        strat = cls(local, run.args, run.env)
        setup = METER.snapshot()
    METER.reset()
    return ref, strat, setup


def broadcast_verdict(ok: bool) -> bool:
    t = torch.tensor([1 if ok else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    with METER.paused():
        dist.broadcast(t, 0)
    return bool(t.item())


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def write_json(run: Run, name: str, obj):
    if run.args.out and run.env.is_main:
        os.makedirs(run.args.out, exist_ok=True)
        with open(os.path.join(run.args.out, name), "w") as f:
            json.dump(obj, f, indent=1, default=str)


# ----------------------------------------------------------------------------------------------
# Mode: correctness
# ----------------------------------------------------------------------------------------------
def natives(cls) -> list:
    n = cls.native
    return list(n) if isinstance(n, (list, tuple)) else ([n] if n else [])


def run_correctness(run: Run, cls) -> bool:
    args = run.args
    ok = True
    classes = [cls] + (natives(cls) if args.compare_native else [])
    for c in classes:
        ok &= _correctness_one(run, c)
    return ok


def _reference_in(run: Run, cls, dtype: str):
    """The single-device reference in another dtype, from the same weights."""
    a = copy.copy(run.args)
    a.dtype = dtype
    return reference_class(cls)(build_model(a, run.config, run.env.device), a, run.env)


def _declared_for(plant: Plant, cls, args) -> bool:
    """Whether this run is the configuration a plant declares: every option its args set has
    the same value here (sp.py's plants name their --variant, zero's their --stage, ...)."""
    parser = base_parser("plants", cls.modes, cls.plants)
    cls.add_args(parser)
    unset = object()
    parser.set_defaults(**{k: unset for k in vars(parser.parse_args([]))})
    given = {k: v for k, v in vars(parser.parse_args(list(plant.args))).items() if v is not unset}
    norm = lambda v: os.path.realpath(v) if isinstance(v, str) and os.path.exists(v) else v  # noqa: E731
    return all(norm(getattr(args, k, None)) == norm(v) for k, v in given.items())


def run_plants(run: Run, cls) -> bool:
    """The check of the checks: the clean correctness run must PASS and every planted bug must
    FAIL, in this one configuration. One process group for all of them (a run per plant would
    pay the start-up again each time)."""
    names = (run.args.plants.split(",") if run.args.plants else
             [n for n, p in cls.plants.items() if _declared_for(p, cls, run.args)])
    if not names:
        run.print(f"FAIL plants {cls.name}: no plant is declared for this configuration; "
                  f"name them with --plants, or run one of: " + "; ".join(
                      sorted({' '.join(p.args) for p in cls.plants.values()})))
        return False
    rows = []
    for name in [None] + names:
        args = copy.copy(run.args)
        args.mode, args.plant_bug = "correctness", name
        sub = Run(args, run.env, run.config, run.lang, run.results)
        run.print(f"\n=== plant: {name or '(none: the clean run must PASS)'}")
        passed = _correctness_one(sub, cls)
        rows.append((name or "(none)", passed, passed == (name is None)))
    run.print(f"\nplants: {cls.name} W={run.env.world} {run.args.dtype}"
              f"{' clip=%g' % run.args.clip if run.args.clip else ''}")
    for name, passed, good in rows:
        doc = ({**HARNESS_PLANTS, **cls.plants}[name].doc if name != "(none)"
               else "no bug planted")
        run.print(f"  {name:<24}{'PASS' if passed else 'FAIL':<6}"
                  f"{'as expected' if good else 'WRONG VERDICT':<15}{doc}")
    ok = all(g for _, _, g in rows)
    caught = sum(1 for n, p, _ in rows[1:] if not p)
    run.results["plants"] = [dict(plant=n, passed=p, expected=g) for n, p, g in rows]
    write_json(run, "plants.json", run.results["plants"])
    run.print(f"{'PASS' if ok else 'FAIL'} plants {cls.name} W={run.env.world}: clean run "
              f"{'PASS' if rows[0][1] else 'FAIL'}, {caught}/{len(rows) - 1} planted bugs caught")
    return ok


@dataclass
class NoiseSource:
    """A single-device reference whose distance from the float64 target is a noise sample."""
    ref: Strategy
    scale: float       # multiplies its error (eps64/eps32 for float32 noise in a float64 run)


def noise_sources(run: Run, cls, ref, policy) -> tuple:
    """(target, [NoiseSource]) on rank 0. float32/bfloat16 runs: the reference in that dtype.
    float64 runs: the float32 reference, its error scaled by eps64/eps32 (rounding propagates
    linearly in the unit roundoff: forward, backward, everything). What scaling cannot carry,
    Adam's update error on entries whose gradient is near its eps (a float32 parameter's error
    is floored by its own rounding, an ulp of |p|), the parameter floor covers
    (NoisePolicy.update_floor)."""
    if policy.dtype != "float64":
        return _reference_in(run, cls, "float64"), [NoiseSource(ref, 1.0)]
    return ref, [NoiseSource(_reference_in(run, cls, policy.noise_dtype), policy.scale)]


def _correctness_one(run: Run, cls) -> bool:
    args, env = run.args, run.env
    ref, strat, _ = make_pair(run, cls, perturb=True, with_ref=True)
    policy = NoisePolicy(args.dtype, k=args.tol_k)
    target, sources = noise_sources(run, cls, ref, policy) if env.is_main else (None, [])
    names = [n for n, _ in ref.model.named_parameters()] if ref else []
    shapes = {n: tuple(p.shape) for n, p in ref.model.named_parameters()} if ref else {}
    cmp = Comparison(names, shapes, policy)
    run.print(f"correctness: {strat.name} W={env.world} {args.dtype} model={args.model} "
              f"batch={args.batch} length={args.length} steps={args.steps} "
              f"params={param_count(ref.model) if ref else '?'}"
              f"{' clip=%g' % args.clip if args.clip else ''}"
              f"{' PLANTED BUG: ' + args.plant_bug if args.plant_bug else ''}")
    for s in range(args.steps):
        batch = run.batch(s)
        loss = strat.step(batch)
        grads = preclip_grads(strat, strat.full_grads(), args.clip)
        params = strat.full_params()
        if args.plant_bug == "grad" and env.is_main and grads:
            k = next(iter(grads))
            grads = dict(grads)
            grads[k] = grads[k] * (1 + 1e-6) + 1e-6 * grads[k].abs().max()
        if env.is_main:
            t_loss = target.step(batch)
            n_loss = [src.ref.step(batch) for src in sources]
            t_grads = preclip_grads(target, target.full_grads(), args.clip)
            noisy = [(preclip_grads(x.ref, x.ref.full_grads(), args.clip), x.scale)
                     for x in sources]
            cmp.add("grad", s, grads, t_grads, noisy)
            cmp.add("param", s, params, target.full_params(),
                    [(x.ref.full_params(), x.scale) for x in sources],
                    policy.update_floor(args.lr, s + 1))
            cmp.add_scalar("loss", s, loss, t_loss, [(v, x.scale) for v, x in zip(n_loss, sources)])
            if args.clip:
                norm = lambda x: float(full_tensor(x.grad_norm))  # noqa: E731
                cmp.add_scalar("grad norm", s, norm(strat), norm(target),
                               [(norm(x.ref), x.scale) for x in sources])
            j = cmp.scalars["loss"]
            run.print(f"  step {s}: loss {loss:.12f}  float64 reference {t_loss:.12f}  rel err "
                      f"{abs(loss - t_loss) / abs(t_loss):.2e}  (noise, worst step so far "
                      f"{j.noise:.2e})")
    extra = strat.extra_checks()
    verdict = False
    if env.is_main:
        verdict = _report_correctness(run, strat.name, cmp, extra)
    return broadcast_verdict(verdict)


def _report_correctness(run, name, cmp: Comparison, extra) -> bool:
    args, env, policy = run.args, run.env, cmp.policy
    w = max([len(n) for n in cmp.names] + [12]) + 2
    run.print(f"{'tensor':<{w}}{'shape':<16}{'grad err':>10}{'noise':>10}"
              f"{'param err':>11}{'noise':>10}{'err/tol':>9}  ok")
    bad = []
    for n in cmp.names:
        g, p = cmp.rows[n]["grad"], cmp.rows[n]["param"]
        good = g.ok and p.ok
        if not good:
            bad.append(n)
        run.print(f"{n:<{w}}{str(cmp.shapes[n]):<16}{g.err:>10.1e}{g.noise:>10.1e}"
                  f"{p.err:>11.1e}{p.noise:>10.1e}{max(g.ratio, p.ratio):>9.2f}  "
                  f"{'ok' if good else 'FAIL'}")
    for label, j in cmp.scalars.items():
        run.print(f"{label:<{w}}{'()':<16}{j.err:>10.1e}{j.noise:>10.1e}{'':>21}{j.ratio:>9.2f}"
                  f"  {'ok' if j.ok else 'FAIL'}")
    n = len(cmp.names)
    n_grad = n - sum(1 for m in cmp.missing if m.startswith("grad:"))
    n_param = n - sum(1 for m in cmp.missing if m.startswith("param:"))
    for check, good, detail in extra:
        run.print(f"check {check}: {'ok' if good else 'FAIL'} ({detail})")
    problems = []
    if bad:
        problems.append(f"{len(bad)} tensors over tolerance (first: {bad[0]})")
    if cmp.missing:
        problems.append(f"{len(cmp.missing)} tensors missing (first: {sorted(cmp.missing)[0]})")
    if cmp.extra:
        problems.append(f"unexpected tensors {cmp.extra[:3]}")
    problems += [f"{label} err {j.err:.2e} > tol {j.tol:.1e} (noise {j.noise:.1e})"
                 for label, j in cmp.scalars.items() if not j.ok]
    problems += [f"check {nm} failed" for nm, g, _ in extra if not g]
    worst_label, worst = cmp.worst()
    loss = cmp.scalars.get("loss", Judged())
    summary = (f"{name} W={env.world} {args.dtype}: {args.steps} steps, "
               f"{n_grad}/{n} grads{' (pre-clip)' if args.clip else ''} + {n_param}/{n} params "
               f"compared, max err grad {cmp.max_err('grad'):.1e} (noise {cmp.max_noise('grad'):.1e})"
               f", param {cmp.max_err('param'):.1e} (noise {cmp.max_noise('param'):.1e}), "
               f"loss {loss.err:.1e} (noise {loss.noise:.1e}); worst err/tol {worst.ratio:.2f} "
               f"({worst_label}); {policy.describe()}")
    ok = not problems
    run.results.setdefault("correctness", []).append(dict(
        strategy=name, world=env.world, dtype=args.dtype, steps=args.steps, clip=args.clip,
        plant_bug=args.plant_bug, model=args.model,
        tensors=n, grads_compared=n_grad, params_compared=n_param, max_rel_err=cmp.max_err(),
        max_grad_err=cmp.max_err("grad"), max_param_err=cmp.max_err("param"),
        max_grad_noise=cmp.max_noise("grad"), max_param_noise=cmp.max_noise("param"),
        loss_rel_err=loss.err, loss_noise=loss.noise,
        worst_ratio=worst.ratio, worst=worst_label,
        tol_k=policy.k, tol_k_param=policy.factor("param"), tol_floor=policy.floor, noise_dtype=policy.noise_dtype,
        noise_scale=policy.scale, ok=ok, problems=problems,
        scalars={k: vars(v) for k, v in cmp.scalars.items()},
        rows={n: {k: vars(j) for k, j in r.items()} for n, r in cmp.rows.items()},
        checks=[dict(name=a, ok=b, detail=c) for a, b, c in extra]))
    write_json(run, "correctness.json", run.results["correctness"])
    run.print(("PASS " if ok else "FAIL ") + summary + ("" if ok else " -- " + "; ".join(problems)))
    return ok


# ----------------------------------------------------------------------------------------------
# Mode: learning
# ----------------------------------------------------------------------------------------------
def run_learning(run: Run, cls) -> bool:
    args, env = run.args, run.env
    ref, strat, _ = make_pair(run, cls, perturb=False, with_ref=True)
    floor = run.lang.entropy_rate
    run.print(f"learning: {strat.name} W={env.world} {args.dtype} model={args.model} "
              f"steps={args.steps} lr={args.lr} batch={args.batch} length={args.length}; "
              f"entropy floor {floor:.4f} nats (uniform would be {math.log(run.config.vocab_size):.4f})")
    run.print(f"{'step':>6}{'reference':>12}{strat.name:>12}{'rel diff':>11}{'floor':>9}")
    rows, t0 = [], time.time()
    for s in range(args.steps):
        batch = run.batch(s)
        loss = strat.step(batch)
        ref_loss = ref.step(batch) if ref else float("nan")
        rows.append((s, ref_loss, loss))
        if env.is_main and (s % args.log_every == 0 or s == args.steps - 1):
            run.print(f"{s:>6}{ref_loss:>12.4f}{loss:>12.4f}"
                      f"{abs(loss - ref_loss) / ref_loss:>11.1e}{floor:>9.4f}"
                      f"   [{s + 1}/{args.steps}, {time.time() - t0:.0f}s]")
    for line in strat.learning_lines():
        run.print(line)
    ok = True
    if env.is_main:
        ok = _report_learning(run, strat.name, rows, floor)
    return broadcast_verdict(ok)


LEARNING_TOL = {"float64": 1e-6, "float32": 2e-3, "bfloat16": 5e-2}


def _report_learning(run, name, rows, floor) -> bool:
    args = run.args
    diffs = [abs(l - r) / r for _, r, l in rows]
    first = rows[0][2]
    tail = rows[-min(5, len(rows)):]
    last = sum(l for _, _, l in tail) / len(tail)
    tol = LEARNING_TOL[args.dtype]
    # "well below the initial loss": at least half of the way from the start to the floor
    target = first - (first - floor) / 2
    agree, learned = max(diffs) <= tol, last <= target
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "learning.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "reference", name, "floor"])
            w.writerows([(s, r, l, floor) for s, r, l in rows])
        _plot_learning(args.out, name, rows, floor)
    summary = (f"{name} W={run.env.world} {args.dtype}: loss {first:.3f} -> {last:.3f} "
               f"(floor {floor:.3f}, target <= {target:.3f}), max rel diff vs reference "
               f"{max(diffs):.1e} (tol {tol:.0e})")
    run.results["learning"] = dict(strategy=name, world=run.env.world, dtype=args.dtype,
                                   first=first, last=last, floor=floor,
                                   max_rel_diff=max(diffs), ok=agree and learned)
    run.print(("PASS " if agree and learned else "FAIL ") + summary)
    return agree and learned


def _plot_learning(out, name, rows, floor):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [s for s, _, _ in rows]
    ax.plot(steps, [r for _, r, _ in rows], label="single-device reference", lw=2)
    ax.plot(steps, [l for _, _, l in rows], "--", label=name)
    ax.axhline(floor, color="gray", ls=":", label="entropy floor")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "learning.png"), dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# Mode: benchmark
# ----------------------------------------------------------------------------------------------
def _sync(env):
    if env.device.type == "cuda":
        torch.cuda.synchronize()


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    with METER.paused():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _gather_objects(obj):
    out = [None] * dist.get_world_size()
    with METER.paused():
        dist.all_gather_object(out, obj)
    return out


def _timed_steps(run: Run, strat, timed=contextlib.nullcontext,
                 before_each=lambda: None) -> tuple[float, float]:
    """--warmup steps, then --bench-iters timed ones inside `timed()` (e.g. the comm meter):
    medians of (step, forward) seconds on this rank. CUDA work is synchronised around each step
    and phase, so the times are real."""
    args, env = run.args, run.env
    phase.sync = (lambda: torch.cuda.synchronize()) if env.device.type == "cuda" else None
    for s in range(args.warmup):
        strat.step(run.batch(s))
    times, fwd = [], []
    with timed():
        for i in range(args.bench_iters):
            batch = run.batch(args.warmup + i)
            before_each()
            _sync(env)
            phase.reset()
            t0 = time.perf_counter()
            strat.step(batch)
            _sync(env)
            times.append(time.perf_counter() - t0)
            fwd.append(phase.elapsed.get("forward", float("nan")))
    phase.sync = None
    return sorted(times)[len(times) // 2], sorted(fwd)[len(fwd) // 2]


def bench_strategy(run: Run, strat) -> dict:
    """Timed steps (comm metered, ranks aligned by a barrier), then one tracked step for
    memory. Collective: times are the max over ranks."""
    args = run.args

    def barrier():  # align the ranks' starts (not counted)
        with METER.paused():
            dist.barrier()
    METER.reset()
    step_t, fwd_t = _timed_steps(run, strat, METER.measuring, barrier)
    comm = METER.snapshot(per=args.bench_iters)
    raw_counts = {k: tuple(v) for k, v in METER.counts.items()}
    METER.reset()
    mem = measure_memory(run, strat)
    step_t, fwd_t = _max_over_ranks(step_t), _max_over_ranks(fwd_t)
    comm_sum = {}
    for c in _gather_objects(comm):
        for k, (calls, nbytes) in c.items():
            a = comm_sum.setdefault(k, [0.0, 0.0])
            a[0] += calls
            a[1] += nbytes
    return dict(step_s=step_t, forward_s=fwd_t, tokens_per_s=args.batch * args.length / step_t,
                comm=comm, comm_sum={k: tuple(v) for k, v in comm_sum.items()},
                # a key whose totals are not a multiple of the step count varied between steps
                comm_varied=[k for k, (c, b) in raw_counts.items()
                             if c % args.bench_iters or b % args.bench_iters],
                memory=_gather_objects(mem))


def measure_memory(run: Run, strat, limit: int | None = None, step: int = 10_000) -> dict:
    """One more step under the live-storage tracker (CPU) or the CUDA allocator's peak.
    limit: raise SimulatedOOM when the tracked bytes exceed it (peak mode's CPU budget)."""
    env = run.env
    states = strat.model_states()
    pre = [t for ts in states.values() for t in ts if t is not None]
    batch = run.batch(step)
    if env.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tracker = MemoryTracker(pre, limit)
    with tracker:
        strat.step(batch)
    states = strat.model_states()
    out = {k: unique_bytes(v) for k, v in states.items()}
    out["model_states"] = unique_bytes(t for v in states.values() for t in v)
    out["activations"] = tracker.act_peak
    if env.device.type == "cuda":
        out["peak"] = torch.cuda.max_memory_allocated()
        out["peak_source"] = "torch.cuda.max_memory_allocated"
    else:
        out["peak"] = tracker.peak
        out["peak_source"] = "live-tensor tracker (CPU)"
    return out


def steady_peak(run: Run, strat, limit: int | None = None) -> dict:
    """The peak of a training step in steady state: the first step creates the optimizer's
    states in its optimizer phase, after the activations are gone; from the second step on they
    are live through the forward and backward as well. So two steps are tracked and the second
    step's breakdown is returned, with the peak of both (the first can be the larger one, e.g.
    while AdamW's states are being created next to the full gradients)."""
    first = measure_memory(run, strat, limit, step=0)
    mem = measure_memory(run, strat, limit, step=1)
    mem["peak"] = max(first["peak"], mem["peak"])
    return mem


def run_benchmark(run: Run, cls) -> bool:
    args, env = run.args, run.env
    _, strat, setup = make_pair(run, cls, perturb=False, with_ref=False)
    name = strat.name
    run.print(f"benchmark: {name} W={env.world} {args.dtype} device={env.device.type} "
              f"model={args.model} batch={args.batch} length={args.length} "
              f"warmup={args.warmup} iters={args.bench_iters}")
    n_params = sum(p.numel() for p in strat.full_params().values())
    ours = bench_strategy(run, strat)
    strat.bench = ours   # the timings, for report lines that need them (compose4d's MFU)
    expected, formula, lines = strat.expected_comm(), strat.memory_formula(), strat.report_lines()
    del strat
    native = []
    for ncls in (natives(cls) if args.compare_native else []):
        _, nat, _ = make_pair(run, ncls, perturb=False, with_ref=False)
        native.append((nat.name, bench_strategy(run, nat)))
        del nat
    # The single-device reference, alone on rank 0 with one rank's share of the machine.
    ref = None
    if env.is_main:
        model = build_model(args, run.config, env.device)
        ref = _bench_single(run, reference_class(cls)(model, args, env))
        del model
    with METER.paused():
        dist.barrier()
    ok = True
    if env.is_main:
        ok = _report_benchmark(run, name, cls, n_params, ours, native, ref, expected, setup,
                               formula, lines)
    return broadcast_verdict(ok)


def _bench_single(run: Run, strat) -> dict:
    """bench_strategy for one process, without collectives."""
    step_t, fwd_t = _timed_steps(run, strat)
    return dict(step_s=step_t, forward_s=fwd_t,
                tokens_per_s=run.args.batch * run.args.length / step_t,
                memory=[measure_memory(run, strat)])


def _report_benchmark(run, name, cls, n_params, ours, native, ref, expected, setup, formula,
                      lines) -> bool:
    args, env = run.args, run.env
    elem = torch.tensor([], dtype=DTYPES[args.dtype]).element_size()
    run.print(f"parameters: {n_params:,} ({fmt_bytes(n_params * elem)} in {args.dtype}); "
              f"times are medians over {args.bench_iters} steps, max over ranks")
    hdr = (f"{'':<22}{'step ms':>10}{'fwd ms':>10}{'tokens/s':>12}{'peak/rank':>12}"
           f"{'step vs ref':>13}")
    run.print(hdr)
    rows = [("single device (ref)", ref), (f"{name} (ours)", ours)]
    rows += [(f"{n} (baseline)", r) for n, r in native]
    for label, r in rows:
        peak = max(m["peak"] for m in r["memory"])
        run.print(f"{label:<22}{r['step_s'] * 1e3:>10.1f}{r['forward_s'] * 1e3:>10.1f}"
                  f"{r['tokens_per_s']:>12.0f}{fmt_bytes(peak):>12}"
                  f"{r['step_s'] / ref['step_s']:>12.2f}x")
    if native:
        run.print(f"step time ours / {native[0][0]}: {ours['step_s'] / native[0][1]['step_s']:.3f}")
    run.print(f"memory per rank ({ours['memory'][0]['peak_source']}):")
    run.print(f"  {'rank':<14}{'params':>12}{'grads':>12}{'optimizer':>12}{'states':>12}"
              f"{'activations':>13}{'peak':>12}")
    for label, r in rows:
        for i, m in enumerate(r["memory"]):
            run.print(f"  {label.split()[0] + ':' + str(i):<14}{fmt_bytes(m['params']):>12}"
                      f"{fmt_bytes(m['grads']):>12}{fmt_bytes(m['optimizer']):>12}"
                      f"{fmt_bytes(m['model_states']):>12}{fmt_bytes(m['activations']):>13}"
                      f"{fmt_bytes(m['peak']):>12}")
    if formula:
        run.print(f"  {'formula':<14}" + "".join(
            f"{fmt_bytes(formula[k]):>12}" for k in ("params", "grads", "optimizer",
                                                     "model_states")))
    for line in lines:
        run.print(line)
    # Communication: measured per step vs formula
    W = env.world
    run.print("communication per optimizer step (rank 0 unless marked; bytes = logical buffer, "
              "wire = per-rank ring traffic):")
    run.print(f"  {'op':<24}{'group':<8}{'calls':>7}{'bytes':>14}{'wire/rank':>14}"
              f"{'expected':>22}  formula")
    exp = {(e.op, e.group): e for e in expected}
    measured = ours["comm"]
    comm_ok = True
    for key in sorted(set(measured) | set(exp)):
        e = exp.get(key)
        summed = e is not None and e.ranks == "sum"
        calls, nbytes = (ours["comm_sum"] if summed else measured).get(key, (0, 0))
        wire = nbytes * RING_FACTOR.get(key[0], lambda w: 1.0)(W) / (W if summed else 1)
        # per-rank rows must also be the same every step; summed ones are data-dependent per rank
        match = (e is not None and math.isclose(e.calls, calls) and math.isclose(e.bytes, nbytes)
                 and (summed or list(key) not in map(list, ours["comm_varied"])))
        comm_ok &= match
        etxt = f"{e.calls:g} / {e.bytes:,.0f}" if e else "(none expected)"
        run.print(f"  {key[0]:<24}{key[1]:<8}{calls:>7g}{nbytes:>14,.0f}{wire:>14,.0f}"
                  f"{etxt:>22}  {'ok' if match else 'MISMATCH'} "
                  f"{'[sum over ranks] ' if summed else ''}{e.formula if e else ''}")
    if setup:
        run.print("  one-time set-up: " + ", ".join(
            f"{op}[{g}] {c:g} calls {b:,.0f} B" for (op, g), (c, b) in setup.items()))
    run.results["benchmark"] = dict(
        strategy=name, world=W, dtype=args.dtype, device=env.device.type,
        model=args.model, batch=args.batch, length=args.length, params=n_params,
        ours=_jsonable(ours), native={n: _jsonable(r) for n, r in native},
        reference=_jsonable(ref),
        expected=[e.__dict__ for e in expected], setup=_jsonable({"comm": setup})["comm"],
        memory_formula=formula, comm_ok=comm_ok)
    write_json(run, "benchmark.json", run.results["benchmark"])
    run.print(("PASS " if comm_ok else "FAIL ") + f"{name} W={W} benchmark: "
              f"{ours['tokens_per_s']:.0f} tokens/s, communication "
              f"{'matches' if comm_ok else 'DIFFERS FROM'} the formulas")
    return comm_ok


def _jsonable(r):
    if r is None:
        return None
    r = dict(r)
    for key in ("comm", "comm_sum"):
        if key in r:
            r[key] = {f"{op}|{g}": dict(calls=c, bytes=b) for (op, g), (c, b) in r[key].items()}
    return r


# ----------------------------------------------------------------------------------------------
# Mode: peak (one trial of oom_search.py): one full training step at --length / --batch
# ----------------------------------------------------------------------------------------------
OOM_EXIT = 3
RUN_MARK = "=== run "   # --runs: rank 0 prints this, the run's index and its --out, before each


def run_peak(run: Run, cls) -> bool:
    """Build the strategy, run two full steps (forward, backward, optimizer) under the memory
    tracker (`steady_peak`), and print one machine-readable line from rank 0:
        TRIAL OK {"peak": max over ranks, "ranks": [per-rank memory dicts], ...}
    An out-of-memory (CUDA's, or the CPU tracker going over --mem-budget-gb) prints
        TRIAL OOM rank r: ...
    and exits with code 3 at once: the peers are stopped by torchrun, not left in a collective."""
    args, env = run.args, run.env
    limit = int(args.mem_budget_gb * 2**30) if args.mem_budget_gb else None
    if env.device.type == "cuda" and args.mem_fraction:
        torch.cuda.set_per_process_memory_fraction(args.mem_fraction, env.device)
    try:
        _, strat, _ = make_pair(run, cls, perturb=False, with_ref=False)
        mem = steady_peak(run, strat, limit if env.device.type == "cpu" else None)
    except (SimulatedOOM, torch.OutOfMemoryError) as e:
        kind = "simulated (CPU live-tensor tracker)" if isinstance(e, SimulatedOOM) else "CUDA"
        print(f"TRIAL OOM rank {env.rank} {kind}: {str(e).splitlines()[0][:200]}", flush=True)
        os._exit(OOM_EXIT)
    mems = _gather_objects(mem)
    run.print("TRIAL OK " + json.dumps(dict(
        strategy=strat.name, world=env.world, length=args.length, batch=args.batch,
        dtype=args.dtype, device=env.device.type, peak=max(m["peak"] for m in mems),
        source=mem["peak_source"], ranks=mems)))
    return True


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------
def fail_config(msg: str, rank: int):
    """One line from rank 0, exit code 2. Under torchrun the other ranks wait (up to 30 s) so
    the launcher, which SIGTERMs every worker once one has exited, cannot kill rank 0 before it
    has printed: rank 0's exit code 2 is then torchrun's "root cause"."""
    if rank == 0:
        print(f"error: {msg}", file=sys.stderr, flush=True)
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        time.sleep(30)
    sys.exit(2)


def _validate(cls, args, world: int, rank: int):
    """(config, dtypes) for one run's arguments, or the first violated constraint (exit 2)."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        fail_config("--device cuda: CUDA is not available", rank)
    try:
        config = load_config(args.model)
    except ConfigError as e:
        fail_config(str(e), rank)
    dtypes = args.dtype.split(",") if args.dtype else [None]
    errs = []
    for d in dtypes:
        a = copy.copy(args)
        a.dtype = d
        errs += common_constraints(a, world, config) + cls.constraints(a, world, config)
    known = {**HARNESS_PLANTS, **cls.plants}
    errs += [f"--plants: {n!r} is not a plant of {cls.name} ({', '.join(known)})"
             for n in (args.plants or "").split(",") if n and n not in known]
    if getattr(args, "runs_nested", False):
        errs.append("--runs: a run in the list cannot name another --runs file")
    if errs:
        fail_config(errs[0], rank)
    return config, dtypes


def _execute(cls, args, env: Env, config, dtypes) -> bool:
    """Every (dtype, mode) of one run's arguments, in the process group that exists."""
    modes = ["correctness", "learning", "benchmark"] if args.mode == "all" else [args.mode]
    lang = MarkovLanguage(config.vocab_size, args.seed, args.branching)
    results: dict = {}
    ok = True
    for mode, dtype in [(m, d) for d in dtypes for m in modes]:
        a = copy.copy(args)
        a.dtype = dtype
        if a.dtype is None and env.device.type == "cpu":
            a.dtype = cls.cpu_dtype.get(mode)
        run = Run(resolve_defaults(a, mode, env.device.type, env.world), env, config, lang,
                  results)   # shared: correctness.json lists every dtype's run
        ok &= {"correctness": run_correctness, "learning": run_learning,
               "benchmark": run_benchmark, "peak": run_peak, "plants": run_plants,
               **cls.modes}[mode](run, cls)
    return ok


def _run_list(parser, args) -> list[argparse.Namespace]:
    """--runs FILE: a JSON list of argument lists, each parsed like a command line of its own.
    Each needs its own --out: its verdict goes to OUT/status.json ({"ok": ...})."""
    try:
        with open(args.runs) as f:
            argvs = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--runs {args.runs}: {e}")
    if not isinstance(argvs, list) or not argvs or not all(isinstance(a, list) for a in argvs):
        raise ConfigError(f"--runs {args.runs}: not a non-empty JSON list of argument lists")
    runs = []
    for argv in argvs:
        a = parser.parse_args([str(x) for x in argv])
        if not a.out:
            raise ConfigError(f"--runs: each run needs its own --out ({' '.join(argv)})")
        a.runs_nested, a.runs = bool(a.runs), None
        runs.append(a)
    return runs


def main(cls, argv=None):
    parser = base_parser(os.path.basename(sys.argv[0]), cls.modes, cls.plants)
    cls.add_args(parser)
    args = parser.parse_args(argv)
    rank, world, _ = env_from_os()
    # Validation happens before the process group exists: no collective can hang on bad input.
    try:
        runs = _run_list(parser, args) if args.runs else [args]
    except ConfigError as e:
        fail_config(str(e), rank)
    checked = [(a, *_validate(cls, a, world, rank)) for a in runs]
    env = launch(runs[0])
    ok, clean = True, False
    try:
        for i, (a, config, dtypes) in enumerate(checked):
            if args.runs:
                if env.is_main:
                    print(f"{RUN_MARK}{i} {a.out}", flush=True)
                run_ok = _execute(cls, a, env, config, dtypes)
                if env.is_main:
                    os.makedirs(a.out, exist_ok=True)
                    with open(os.path.join(a.out, "status.json"), "w") as f:
                        json.dump({"ok": run_ok}, f)
                ok &= run_ok
            else:
                ok = _execute(cls, a, env, config, dtypes)
        clean = True
    finally:
        teardown(clean)
    sys.exit(0 if ok else 1)
