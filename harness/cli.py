"""cli.py: The entry point every strategy file calls: `main(StrategyClass)`. Validates every run's
arguments before the process group exists, launches once, and runs each (dtype, mode) of each
run (`--runs FILE`: several argument lists in one process group).
"""
from __future__ import annotations

import argparse
import atexit
import copy
import gc
import json
import os
import sys
import time

import torch

from .benchmark import run_benchmark, run_peak
from .correctness import run_correctness, run_plants
from .data import MarkovLanguage
from .launch import Env, base_parser, env_from_os, fail_config, launch, resolve_defaults, teardown
from .learning import run_learning
from .lora_setup import constraints as lora_constraints
from .dropout import dropping, rate_fields, rates
from .models import LOW_PRECISION, ConfigError, common_constraints, load_config, resolve_attn
from .nccl import nccl_checked
from .plants import planting
from .run import Run
from . import selfcheck
from .strategy import HARNESS_PLANTS


RUN_MARK = "=== run "   # --runs: rank 0 prints this, the run's index and its --out, before each


def _validate(cls, args, world: int, rank: int):
    """(config, dtypes) for one run's arguments, or the first violated constraint (exit 2)."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        fail_config("--device cuda: CUDA is not available", rank)
    try:
        config = load_config(args.model, getattr(args, "dropout", None))
        args.attn, line = resolve_attn(config, args.attn)
    except ConfigError as e:
        fail_config(str(e), rank)
    dtypes = args.dtype.split(",") if args.dtype else [None]
    errs = []
    if getattr(args, "lora", 0) and not cls.lora:
        errs.append(f"--lora: {cls.name} does not train LoRA adapters (lora: ddp, zero, fsdp, "
                    f"tp, sp, cp, pp, compose4d)")
    for d in dtypes:
        a = copy.copy(args)
        a.dtype = d
        errs += common_constraints(a, world, config) + lora_constraints(a, config)
        if not errs:   # (a strategy's own checks may build the model: its options hold first)
            errs += cls.constraints(a, world, config)
    if getattr(args, "doc_mask", False) and not cls.doc_mask:
        errs.append(f"--doc-mask: {cls.name} does not mask packed documents yet (ddp, zero, "
                    f"zero++, fsdp, tp, sp, pp, cp, ep, compose4d do)")
    if getattr(args, "fp8", None) and cls.convert_fp8 is None:
        errs.append(f"--fp8: {cls.name} does not train in FP8 yet (ddp, zero, fsdp, tp, sp, "
                    f"pp, cp, ep, compose4d do)")
    bench = args.mode == "benchmark" and cls.fp8_benchmark and args.fp8 == "tensorwise"
    fp8_modes = ("correctness", "learning", "plants", "peak")
    if getattr(args, "fp8", None) and (args.mode not in fp8_modes and not bench
                                       or getattr(args, "compare_native", False)
                                       or getattr(args, "paired", False)):
        errs.append("--fp8: --mode correctness, learning, plants or peak (fsdp: benchmark with "
                    "tensorwise), without PyTorch's baselines (the other benchmarks' formulas "
                    "do not count the amax all-reduces yet, and the baselines do not train in "
                    "FP8)")
    low = [d for d in dtypes if d in LOW_PRECISION]
    if (getattr(args, "fp8", None) and args.mode in ("correctness", "plants") and low
            and not (args.fp8 == "tensorwise" and cls.fp8_amax_log)):
        errs.append(f"--fp8 {args.fp8} in {low[0]}: the tensors there are compared only within "
                    f"FP8's own noise, beside an exact check of the scales that tensorwise runs "
                    f"on ddp, zero, fsdp, tp, sp, cp, ep and compose4d; prove FP8 with --dtype "
                    f"float64, train it in {low[0]} with --mode learning")
    if getattr(args, "ce_chunk", 0) > 0 and not cls.chunked_ce:
        errs.append(f"--ce-chunk: {cls.name} computes its loss on the full logits (chunked: "
                    f"ddp.py's plain head and tp.py's vocab-parallel head)")
    if args.optimizer not in cls.optimizers:
        errs.append(f"--optimizer {args.optimizer}: {cls.name} steps with "
                    f"{' or '.join(cls.optimizers)} (muon: ddp, zero, fsdp, tp, sp, pp, cp, "
                    f"ep, compose4d)")
    if args.optimizer != "adamw" and getattr(args, "compare_native", False):
        errs.append(f"--compare-native: PyTorch's baselines step with AdamW; --optimizer "
                    f"{args.optimizer} runs without them")
    if args.optimizer == "muon" and args.muon_mode not in cls.muon_modes:
        errs.append(f"--muon-mode {args.muon_mode}: {cls.name} runs Muon's "
                    f"{' or '.join(cls.muon_modes)} mode")
    known = {**HARNESS_PLANTS, **cls.plants}
    errs += [f"--plants: {n!r} is not a plant of {cls.name} ({', '.join(known)})"
             for n in (args.plants or "").split(",") if n and n not in known]
    if getattr(args, "runs_nested", False):
        errs.append("--runs: a run in the list cannot name another --runs file")
    if not errs and rate_fields(config):
        errs += _dropout_errors(config, args)
    if errs:
        fail_config(errs[0], rank)
    try:   # (a planted bug in the re-implemented forward is the check's to refuse)
        with planting(args.plant_bug):
            selfcheck.check(cls, args, config, rank)
    except ConfigError as e:
        fail_config(str(e), rank)
    if rates(config) and rank == 0:
        eager = ("; attention: eager, with the masks" if getattr(config, "attention_dropout", 0)
                 else "")
        line = (f"dropout {rates(config)}: masks keyed by global coordinates "
                f"(harness/dropout.py){eager}" + (f"; {line}" if line else ""))
    if line and rank == 0:
        print(line, flush=True)   # which attention --attn auto chose, and why
    return config, dtypes


class _TorchMasks(torch.overrides.TorchFunctionMode):
    """Records each dropout torch would draw itself: entered beneath the keyed ones (a layer's
    FunctionalDropout and HiddenDropout never call torch's), it sees only the others, and names
    the model's line that called it."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call = dropping(func, args, kwargs)
        if call is not None:
            import traceback
            where = next((f"{os.path.basename(f.filename)}:{f.lineno}"
                          for f in reversed(traceback.extract_stack()[:-1])
                          if f"{os.sep}torch{os.sep}" not in f.filename
                          and f.filename != __file__), "?")
            self.seen.append(f"p={call[1]} at {where}")
        return func(*args, **kwargs)


def _dropout_errors(config, args) -> list[str]:
    """Where the model drops, found by running it: one training-mode forward of the config cut
    short (selfcheck.truncated; random weights, float32, this process's CPU, 0.1-0.3 s) with
    the keyed dropout installed and a recorder beneath it. A dropout torch would still draw
    itself (outside the decoder layers, which the layer-by-layer strategies run without the
    model's forward) or one the keys cannot place (not the residual stream) is refused: its
    masks would be another function at every layout. A rate the forward never applies (GPT-2's
    summary_first_dropout, a field the family does not read) draws nothing and passes."""
    from transformers import AutoModelForCausalLM
    from .data import Batch
    from .dropout import at
    from .models import finish_model, model_kwargs
    small = selfcheck.truncated(config)
    try:   # (the random init from its own generator state: the run's is left as it was)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = finish_model(AutoModelForCausalLM.from_config(
                small, **model_kwargs(small, args.attn)).float(), args)
        ids = torch.randint(0, small.vocab_size, (2, min(args.length, 16)),
                            generator=torch.Generator().manual_seed(0))
        with _TorchMasks() as rec, at(Batch(ids, ids, 0)):
            model(input_ids=ids)
    except (ValueError, RuntimeError) as e:
        if not str(e).startswith("dropout:"):
            raise
        return [f"{e} (--dropout 0 turns the model's dropout off)"]
    if rec.seen:
        return [f"dropout: {rec.seen[0]} draws torch's masks, which differ at every layout: "
                f"outside the decoder layers, where the harness does not key it by coordinates "
                f"(set its rate to 0 in the config)"]
    return []


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
        fn = {"correctness": run_correctness, "learning": run_learning,
              "benchmark": run_benchmark, "peak": run_peak, "plants": run_plants,
              **cls.modes}[mode]
        # --nccl-semantics: each run's record checked after it (plants: each planted run's)
        with planting(a.plant_bug):   # the planted bug, if any, is on for this run only
            ok &= (nccl_checked(fn, run, cls) if a.nccl_semantics and mode != "plants"
                   else fn(run, cls))
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
        # a directory an earlier run of the list saves (compose4d's --save): a later run may
        # resume from it although it does not exist yet when the list is validated
        a.saved_by_earlier_runs = [r.save for r in runs if getattr(r, "save", None)]
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
    # The imports' objects (torch's, transformers' and the model classes' the validation
    # imported) live as long as the process: moved out of the collector's generations, a full
    # collection (release_memory between models, teardown) no longer walks them (0.3 s each,
    # six per correctness run). Collected first, so no garbage is frozen with them.
    gc.collect()
    gc.freeze()
    env = launch(runs[0])
    ok, clean = True, False
    try:
        for i, (a, config, dtypes) in enumerate(checked):
            if args.runs:
                if env.is_main:
                    print(f"{RUN_MARK}{i} {a.out}", flush=True)
                t0 = time.perf_counter()
                run_ok = _execute(cls, a, env, config, dtypes)
                if env.is_main:   # (seconds: the tests' report of the costliest runs)
                    os.makedirs(a.out, exist_ok=True)
                    with open(os.path.join(a.out, "status.json"), "w") as f:
                        json.dump({"ok": run_ok, "seconds": time.perf_counter() - t0}, f)
                ok &= run_ok
            else:
                ok = _execute(cls, a, env, config, dtypes)
        clean = True
    finally:
        teardown(clean)
    # Exit without the interpreter's finalisation, as tests/forkserver.py's workers and
    # tests/spawned.py's ranks do: gloo's threads there have aborted finished, passing ranks
    # after the group was destroyed (SIGABRT, "terminate called without an active exception";
    # pytorch/pytorch#179291: tensors a gloo work still holds freed without the interpreter),
    # which CI saw end oom_search's tp and sp trials. Everything is written; atexit runs first.
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        f.flush()
    os._exit(0 if ok else 1)
