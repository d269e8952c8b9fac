"""oom_search.py: the longest sequence (or largest micro-batch) that fits, per strategy and world
size: measured by real training steps, and predicted by a formula.

    python oom_search.py --strategy tp --nproc 2 --lo 1024 --hi 65536 --step 512 --mem-budget-gb 1

Trials: one `torchrun <strategy>.py --mode peak` per value, binary-searched on the --step grid
(on CPU an OOM is the live-tensor tracker's over --mem-budget-gb); --simulate: FakeTensorMode.
Prediction (--predict; bytes per rank; e bytes/element, b sequences of length S, h hidden, a
heads, V vocabulary):
    states       zero.model_state_bytes ((e + e + 2e) per parameter; half precision 2 + 2 + 12)
                 as the strategy divides them: ZeRO-1/2/3 and FSDP over W (+ one gathered
                 unit), TP/SP the layers / T, PP the stage's share (pp_schedule.split_layers);
                 --lora R: e per parameter, gradients and AdamW states for the adapters only
                 (lora.layer_numel: r (9h + 2kv + 3I) per layer, TP's split)
    activations  harness.recompute.activation_bytes per layer (the suite's one model, exact
                 against the CPU's live storage; on an H100 in bf16 the peak ran 7% above it:
                 docs/gpu.md), its TP/SP split; / W of the tokens under Ulysses and CP; under
                 1F1B (M = P) stage r holds P - r micro-batches
    logits       (2e + 4) V per token, + 4V in half precision (/ T vocab-parallel; PP: last stage)
    cp blocks    4 b a (S/2C)^2 e: cp_ring's pure block kernel's backward
    fp8 cast     --fp8: one cast's scaled copy and 1-byte result, tokens x max(h, I/T) x
                 (max(e, 4) + 1, + 4 in half precision): an estimate, not a bound (--simulate
                 counts the casts exactly: under sp and pp the dW GEMM's transposed copies of dY
                 and X reach 1.9x it)
    peak         states + activations + logits + cp blocks + fp8 cast (PP: the largest stage)
More (each term's source, the search, the simulation): docs/internals.md, 'oom_search.py'.

Run:  python oom_search.py --strategy tp --nproc 2 --lo 1024 --mem-budget-gb 1
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> (script, its Strategy class, extra args)
STRATEGIES = {
    "ddp": ("ddp.py", "DDP", []),
    "zero1": ("zero.py", "ZeRO", ["--stage", "1"]),
    "zero2": ("zero.py", "ZeRO", ["--stage", "2"]),
    "zero3": ("zero.py", "ZeRO", ["--stage", "3"]),
    "fsdp": ("fsdp.py", "FSDP", []),
    "tp": ("tp.py", "TP", []),
    "sp": ("sp.py", "SP", ["--variant", "megatron"]),
    "ulysses": ("sp.py", "SP", ["--variant", "ulysses"]),
    "cp": ("cp_ring.py", "CP", ["--variant", "zigzag"]),
    "pp": ("pp.py", "PP", ["--schedule", "1f1b"]),
}
DATA_PARALLEL = {"ddp", "zero1", "zero2", "zero3", "fsdp"}
CHUNKED_CE = {"ddp", "tp"}   # the strategies that take --ce-chunk (harness/loss.py)


def trial_args(strategy: str, nproc: int, length: int, batch: int,
               ce_chunk: int = 0, lora: int = 0, fp8: str | None = None) -> list[str]:
    """The strategy's command-line arguments for one trial (--batch = sequences per replica)."""
    script, _, extra = STRATEGIES[strategy]
    glob = batch * nproc if strategy in DATA_PARALLEL or strategy == "pp" else batch
    if strategy == "pp":
        extra = extra + ["--microbatches", str(nproc)]
    if ce_chunk:
        extra = extra + ["--ce-chunk", str(ce_chunk)]
    extra = extra + (["--lora", str(lora)] if lora else []) + (["--fp8", fp8] if fp8 else [])
    return [script, *extra, "--length", str(length), "--batch", str(glob)]


# ----------------------------------------------------------------------------------------------
# One trial
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Outcome:
    kind: str                   # OK | OOM | crash | timeout | invalid
    peak: int | None = None     # max over ranks, bytes
    seconds: float = 0.0
    detail: str = ""


def run_trial(strategy, nproc, length, batch, args) -> Outcome:
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    script, *rest = trial_args(strategy, nproc, length, batch, getattr(args, "ce_chunk", 0),
                               getattr(args, "lora", 0), getattr(args, "fp8", None))
    cmd += [os.path.join(HERE, script), *rest, "--mode", "peak", "--model", args.model,
            "--timeout", str(args.timeout)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.device:
        cmd += ["--device", args.device]
    if args.mem_budget_gb:
        cmd += ["--mem-budget-gb", str(args.mem_budget_gb)]
    if args.mem_fraction:
        cmd += ["--mem-fraction", str(args.mem_fraction)]
    # (faulthandler: a worker killed by a signal prints its Python stack, which the crash's
    # detail then names)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=HERE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)      # torchrun and every worker
        proc.communicate()
        return Outcome("timeout", seconds=time.time() - t0, detail=f"over {args.timeout:g} s")
    return classify(proc.returncode, out, err, time.time() - t0)


def classify(rc: int, out: str, err: str, seconds: float = 0.0) -> Outcome:
    """A trial's outcome from its exit code and output. A trial that printed TRIAL OK measured
    its peak on every rank (rank 0 gathered them): a worker that dies after that, in the group's
    teardown or the interpreter's exit, leaves the measurement standing, and the detail says how
    the process ended. A crash names torchrun's root cause (exit code or signal) and the worker's
    first error line or, under faulthandler, the first frame of the fatal signal's stack."""
    text = out + err
    lines = text.splitlines()
    root = lines[max((i for i, l in enumerate(lines) if l.startswith("Root Cause")), default=0):]
    exitcode = [l.strip() for l in root if l.strip().startswith(("exitcode", "traceback : Sig"))]
    cur = next((i for i, l in enumerate(lines) if l.startswith("Current thread")), len(lines))
    fatal = [l.strip() for l in lines if l.startswith("Fatal Python error")][:1] + [
        l.strip() for l in lines[cur:] if re.match(r'  File ".*", line \d+ in ', l)][:1]
    # (faulthandler's format: the crashing thread's stack after "Current thread")
    ended = "; ".join(exitcode[:2] + fatal) or f"exit {rc}"
    for line in out.splitlines():
        if line.startswith("TRIAL OK "):
            res = json.loads(line[len("TRIAL OK "):])
            note = "" if rc == 0 else f"; then exit {rc} after the measurement: {ended[:200]}"
            return Outcome("OK", res["peak"], seconds, res.get("source", "") + note)
    oom = [l for l in lines if "TRIAL OOM" in l]
    if oom:
        return Outcome("OOM", None, seconds, oom[0][oom[0].index("TRIAL OOM"):][:160])
    errors = [l for l in lines if l.startswith("error:")]
    if errors:
        return Outcome("invalid", None, seconds, errors[0])
    why = [l.strip() for l in lines if re.search(r"\w(Error|Exception)\b.*: ", l)
           and "ChildFailedError" not in l]
    return Outcome("crash", None, seconds, f"exit {rc}: {ended[:200]}"
                   + (f" ({why[0][:200]})" if why else ""))


# ----------------------------------------------------------------------------------------------
# The search (pure: `trial(x) -> Outcome`, so tests can drive it with fakes)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class SearchResult:
    best: int | None                      # largest value whose trial was OK
    best_peak: int | None
    failed_at: int | None = None          # smallest value seen to fail (OOM)
    stopped: str = ""                     # why the search ended early (crash, timeout, invalid)
    trials: list = dataclasses.field(default_factory=list)   # (value, Outcome)


def search(trial, lo: int, hi: int | None, step: int, retries: int = 1,
           progress=lambda msg: None, cap: int = 1 << 22) -> SearchResult:
    """Largest x on the grid {lo, lo + step, ...} (up to hi) with trial(x).kind == "OK",
    assuming OK below some threshold and OOM above it."""
    res = SearchResult(None, None)

    def probe(x) -> str:
        for attempt in range(retries + 1):
            o = trial(x)
            res.trials.append((x, o))
            progress(f"  {x:>8}: {o.kind}" + (f" peak {o.peak / 2**20:,.1f} MiB" if o.peak else "")
                     + (f" ({o.detail})" if o.detail and (o.kind != "OK" or "exit" in o.detail)
                        else "")
                     + f"  [{o.seconds:.1f}s]")
            if o.kind not in ("crash", "timeout"):
                break
        if o.kind == "OK":
            if res.best is None or x > res.best:
                res.best, res.best_peak = x, o.peak
        elif o.kind == "OOM":
            res.failed_at = x if res.failed_at is None else min(res.failed_at, x)
        else:
            res.stopped = f"{o.kind} at {x}: {o.detail}"
        return o.kind

    def snap(x):  # onto the grid
        return lo + ((x - lo) // step) * step

    if probe(lo) != "OK":
        return res
    good = lo
    if hi is None:                                 # double until a trial fails
        x = max(2 * lo, lo + step)
        while x <= cap:
            k = probe(snap(x))
            if k != "OK":
                if k != "OOM":
                    return res
                break
            good, x = snap(x), 2 * x
        else:
            return res
        bad = snap(x)
    else:
        hi = snap(hi)
        if hi == lo:
            return res
        k = probe(hi)
        if k == "OK":
            return res
        if k != "OOM":
            return res
        bad = hi
    while bad - good > step:                       # invariant: good OK, bad OOM
        mid = snap((good + bad) // 2)
        if mid <= good:
            mid = good + step
        k = probe(mid)
        if k == "OK":
            good = mid
        elif k == "OOM":
            bad = mid
        else:
            break
    return res


# ----------------------------------------------------------------------------------------------
# Prediction
# ----------------------------------------------------------------------------------------------
def predict_peak(strategy: str, W: int, L_seq: int, b: int, cfg, elem: int = 4,
                 eager: bool = False, ce_chunk: int = 0, lora: int = 0,
                 fp8: str | None = None) -> dict:
    """Predicted peak bytes per rank (the largest rank), by category (see the docstring)."""
    h, I, V, Ly = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    a = cfg.num_attention_heads
    kv = cfg.num_key_value_heads * (h // a)
    tied = cfg.tie_word_embeddings
    T = W if strategy in ("tp", "sp") else 1
    from lora import layer_numel as lora_layer_numel
    layer_a = lora_layer_numel(cfg, lora, T) if lora else 0   # (LoRA: what trains, per rank)
    layer_params = 2 * h * h + 2 * kv * h + 3 * h * I + 2 * h       # q,o + k,v + MLP + norms
    embed = V * h
    head = (0 if tied else embed) + h                                # lm_head + final norm
    psi = Ly * layer_params + embed + head
    tokens = b * L_seq
    # optimizer bytes per parameter: m and v in the run's dtype, or, in half precision, the
    # fp32 master and fp32 m and v (harness.precision, zero.ZeroOptimizer)
    opt_e = 12 if elem < 4 else 2 * elem
    # --- activations per layer: harness.recompute.activation_bytes (the suite's one model,
    # byte for byte against the live storage); TP splits heads and MLP width, SP also the
    # norms' tokens; Ulysses and CP hold 1/W of every sequence's tokens
    from harness.recompute import activation_bytes
    attn = "eager" if eager and strategy != "cp" else "sdpa"    # (cp: the ring's own kernel)
    one = activation_bytes(cfg, b, L_seq, elem, "none", attn, tp=T, sp=strategy == "sp")
    act_layer = one["per_layer"] / (W if strategy in ("ulysses", "cp") else 1)
    # logits, the loss's fp32 log-softmax, the logits' grad; half-precision logits are upcast
    # to an fp32 copy first (lm_loss_sum, tp's vocab-parallel CE)
    logits_tok = V * (2 * elem + 4 + (4 if elem < 4 else 0))
    # --fp8: X and W are saved in their own dtype (fp8.py, as torchao), so states and
    # activations are unchanged; one cast at a time holds a scaled copy (fp32; half precision
    # first upcasts: + 4) and its 1-byte result, of an operand up to tokens x max(h, I / T)
    # features (MLP's width split under TP; Ulysses and CP's tokens / W): an estimate
    cast = 0
    if fp8:
        toks = b * L_seq / (W if strategy in ("ulysses", "cp") else 1)
        cast = toks * max(h, I / T) * (max(elem, 4) + 1 + (4 if elem < 4 else 0))
    if strategy == "pp":
        # pp_schedule.split_layers' balanced split; 1F1B with M = W micro-batches of b: stage r
        # holds W - r of them in flight; the first stage has the embedding, the last the head
        # + logits
        from pp_schedule import split_layers
        last = embed + h if W > 1 else head   # the last stage holds its own copy of a tied head
        bounds = split_layers([float(layer_params)] * Ly, embed, embed + h, W)
        stages = []
        for r, rng in enumerate(bounds):
            n = len(rng) * layer_params + (embed if r == 0 else 0) + (last if r == W - 1 else 0)
            n_t = len(rng) * layer_a if lora else n       # the parameters that train
            stages.append(dict(
                stage=r, states=(n + n_t * bool(lora)) * elem + n_t * (elem + opt_e),
                activations=act_layer * len(rng) *
                (W - r), attention_blocks=0, logits=tokens * logits_tok if r == W - 1 else 0))
        for d in stages:
            d["fp8_cast"] = cast
            d["peak"] = d["states"] + d["activations"] + d["logits"] + cast
        return max(stages, key=lambda d: d["peak"])
    # --- model states: params e, grads e, AdamW m and v 2e (opt_e): ZeRO's table (zero.py)
    from zero import model_state_bytes
    stage = {"zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}.get(strategy, 0)
    if strategy in ("tp", "sp"):   # the layers' matrices and the vocabulary split T ways
        psi = Ly * (layer_params - 2 * h) / T + Ly * 2 * h + (embed + head - h) / T + h
    # (LoRA: every parameter held, gradients and AdamW states for the adapters only)
    held, trains = (psi + Ly * layer_a, Ly * layer_a) if lora else (psi, psi)
    s_held, s_t = (model_state_bytes(n, stage, W, elem, elem, opt_e) for n in (held, trains))
    states = s_held["params"] + s_t["grads"] + s_t["optimizer"]
    if stage == 3:   # one gathered unit and its full gradient (LoRA: the adapters')
        states += (max(layer_params, embed) + (layer_a or max(layer_params, embed))) * elem
    acts = act_layer * Ly
    blocks = 0
    if strategy == "cp":  # cp_ring's pure-torch kernel: score blocks of (S/2C)^2 per head; its
        c = L_seq / (2 * W)   # backward holds s, p, dP and dS of one block at a time
        blocks = 4 * b * a * c * c * elem
    # --- logits and loss (vocab-parallel under TP/SP; a sequence shard under Ulysses/CP)
    vocab = V / T if strategy in ("tp", "sp") else V
    tok_logits = tokens / (W if strategy in ("ulysses", "cp") else 1)
    # the logits e, the fp32 log-softmax 4, the gradient e; lm_loss_sum also upcasts half
    # logits to an fp32 copy (+4; measured 12 B per bf16 logit); tp's vocab-parallel CE works
    # in its own fp32 copy, which becomes the gradient (its measured peak fits 2e + 4)
    per_logit = 2 * elem + 4 + (4 if elem < 4 and strategy not in ("tp", "sp") else 0)
    logits = tok_logits * vocab * per_logit
    if ce_chunk and strategy in CHUNKED_CE:
        # forward: one chunk's logits beside the fp32 (fp64) gradients of the hidden states
        # and the head kept for the backward; backward: those and their scaled copies in e
        # (harness/loss.py)
        acc, n = max(elem, 4), tok_logits
        logits = max(min(ce_chunk, n) * vocab * per_logit + acc * (n + vocab) * h,
                     (acc + elem) * (n + vocab) * h)
    return dict(states=states, activations=acts, attention_blocks=blocks, logits=logits,
                fp8_cast=cast, peak=states + acts + blocks + logits + cast)


def predict_max(strategy, W, b, cfg, budget, lo, hi, step, elem, eager,
                ce_chunk: int = 0, lora: int = 0, fp8: str | None = None) -> int | None:
    """The largest grid length whose predicted peak fits the budget (the formula is monotone)."""
    ok = lambda L: predict_peak(strategy, W, L, b, cfg, elem, eager,  # noqa: E731
                                ce_chunk, lora, fp8)["peak"] <= budget
    r = search(lambda x: Outcome("OK" if ok(x) else "OOM"), lo, hi or (1 << 22), step)
    return r.best


# ----------------------------------------------------------------------------------------------
# Simulation: the real training step under FakeTensorMode, as rank 0 of a fake process group
# ----------------------------------------------------------------------------------------------
def simulate_peak(strategy: str, W: int, length: int, batch: int, model: str,
                  dtype: str = "float32", attn: str = "sdpa", rank: int = 0,
                  ce_chunk: int = 0, lora: int = 0, fp8: str | None = None) -> dict:
    """Peak bytes of rank 0 of a world of W for one full step, without allocating: the model is
    built on the meta device and materialised as FakeTensors, the process group is torch's fake
    backend (collectives return at once), and the harness's live-tensor tracker counts the fake
    storages exactly as it counts real ones. The logged loss is NaN (`scalar`)."""
    import importlib
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoModelForCausalLM
    from harness import (DTYPES, ConfigError, Env, MarkovLanguage, Run, base_parser,
                         common_constraints, load_config, make_batch, model_kwargs,
                         keep_float64, resolve_defaults, steady_peak)
    script, cls_name, _ = STRATEGIES[strategy]
    strat_cls = getattr(importlib.import_module("rig." + script[:-3]), cls_name)
    parser = base_parser(script)
    strat_cls.add_args(parser)
    argv = trial_args(strategy, W, length, batch, ce_chunk, lora, fp8)[1:] + [
        "--mode", "peak", "--model", model, "--dtype", dtype, "--device", "cpu", "--attn", attn]
    args = resolve_defaults(parser.parse_args(argv), "peak", "cpu", W)
    config = load_config(model)
    errs = common_constraints(args, W, config) + strat_cls.constraints(args, W, config)
    if errs:
        raise ConfigError(errs[0])
    lang = MarkovLanguage(config.vocab_size, 0, args.branching)
    batch_ = make_batch(lang, 0, args.batch, args.length, "cpu")
    batch_.n_tokens  # computed on real tensors, before fake mode
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=W)
    saved = Run.batch
    Run.batch = lambda self, step: batch_
    try:
        with torch.device("meta"):
            net = AutoModelForCausalLM.from_config(config, **model_kwargs(config, attn))
        if lora:   # peft's layers on the meta model (the base frozen)
            from harness.lora_setup import wrap
            wrap(net, args)
        if fp8:   # (before the strategy: its scopes and tp's carry find the converted layers)
            strat_cls.convert_fp8(net, fp8)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake:
            made = {}   # id(meta parameter) -> fake one, so tied weights stay one tensor
            for m in net.modules():
                for k, p in list(m._parameters.items()):
                    if p is not None:
                        if id(p) not in made:
                            made[id(p)] = torch.nn.Parameter(
                                torch.empty(p.shape, dtype=DTYPES[dtype]),
                                requires_grad=p.requires_grad)
                        m._parameters[k] = made[id(p)]
                for k, b in list(m._buffers.items()):
                    if b is not None:
                        m._buffers[k] = torch.empty(b.shape, dtype=b.dtype)
            keep_float64(net).train()
            env = Env(rank, W, rank, torch.device("cpu"), "fake")
            strat = strat_cls(net, args, env)
            run = Run(args, env, config, lang)
            mem = steady_peak(run, strat)
    finally:
        Run.batch = saved
        dist.destroy_process_group()
    return mem


def simulated_trial(strategy, W, length, batch, args, budget) -> Outcome:
    """Rank 0, and under PP also the last stage (it holds the logits) and the stage the formula
    ranks largest (in-flight micro-batches x layers: with heavy embeddings the middle stages get
    more layers); every other strategy gives rank 0 the largest share."""
    t0 = time.time()
    ranks = [0]
    if strategy == "pp" and W > 1:   # first, last, and the stage the formula ranks largest
        from harness import DTYPES, load_config
        big = predict_peak("pp", W, length, batch, load_config(args.model),
                           DTYPES[args.dtype or "float32"].itemsize,
                           args.attn == "eager", lora=getattr(args, "lora", 0),
                           fp8=getattr(args, "fp8", None))["stage"]
        ranks = sorted({0, W - 1, big})
    try:
        peak = max(simulate_peak(strategy, W, length, batch, args.model,
                                 args.dtype or "float32", args.attn, r,
                                 getattr(args, "ce_chunk", 0), getattr(args, "lora", 0),
                                 getattr(args, "fp8", None))["peak"]
                   for r in ranks)
    except Exception as e:  # a strategy whose step needs real values (reported, never an OOM)
        return Outcome("crash", None, time.time() - t0,
                       f"simulation unsupported: {type(e).__name__} {str(e)[:80]}")
    kind = "OK" if peak <= budget else "OOM"
    return Outcome(kind, peak, time.time() - t0,
                   f"FakeTensorMode, rank{'s' if len(ranks) > 1 else ''} "
                   f"{', '.join(map(str, ranks))} of a fake group")


if __name__ == "__main__":   # python oom_search.py ...: the command line is rig/oom_search.py
    from rig.oom_search import main
    sys.exit(main())
