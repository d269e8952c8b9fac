"""gpu_check.py: everything the suite checks on a GPU, in one prepared command with a time budget.

    python scripts/gpu_check.py OUT --budget-s 330        # on the GPU machine (~390 s limit)
    python scripts/gpu_check.py OUT --device cpu --smoke  # its rehearsal on CPU (tests/test_gpu_check.py)
    python scripts/gpu_check.py OUT --sections memory,cp  # a rerun of the sections that failed

Sections, in this order, each in a process of its own with its own budget (its nominal seconds
x --budget-s / 330, never past the global deadline; a section that cannot get its minimum is
skipped and says so). Each writes OUT/<section>.json (the device, torch / CUDA / transformers
versions, the commands, the figures, pass or fail) as soon as it ends, and as it goes, so a
section cut by its budget still leaves what it measured; everything printed goes to
OUT/gpu_check.log. The exit code is 0 only if every section that ran passed.

  device  every strategy's adapter at W=1 in bf16 correctness, all in one process (one NCCL
          group of one; the issue's order: ddp, zero3, fsdp, tp, pp, cp, ep, compose4d first),
          each strategy's training steps watched for host synchronisations
          (harness/hostsync.py: torch.cuda.set_sync_debug_mode plus a dispatch mode; a sync
          outside its ALLOWED table fails the run); ZeRO-2/3
          bf16 learning; compose4d train: save, resume from the checkpoint, export to HF, reload.
  speed   the reference step (the HF model, SDPA, fused AdamW with fp32 masters) on llama3.2-1b
          in bf16, on the full logits, with the chunked cross-entropy, and with each decoder
          block through torch.compile (a lever: its gain over eager, its first loss within
          0.02): tokens/s, MFU (harness.flops), the top kernels (torch.profiler); compose4d at
          W=1 beside it.
  memory  the longest sequence at W=1 for tp, sp and pp on llama3.2-1b, bf16, batch 1: real
          trials (oom_search.run_trial, a fresh process each) starting at oom_search's
          prediction for this card, a few each, against the prediction.
  cp      scripts/gpu_cp_kernels.py at C = 2, 4, 8: ring attention's block loop against one
          fused call on the whole sequence, causal and on packed documents (--doc-mask).
  fp8     the reference step on llama3.2-1b in bf16 and with each FP8 recipe (fp8.convert:
          tensorwise and rowwise through torch._scaled_mm, blockwise emulated in fp32),
          tokens/s and the loss after the timed steps side by side.

One GPU means world size 1: these prove the device paths, the bf16 numerics, host-sync freedom
and single-GPU speed and memory; the multi-rank semantics are proven on CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib
import io
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SECTIONS = [  # (name, nominal seconds, scaled by --budget-s / their sum; minimum to start)
    ("device", 130, 40), ("speed", 110, 30), ("memory", 90, 30), ("cp", 30, 15), ("fp8", 40, 20)]
NOMINAL = sum(s for _, s, _ in SECTIONS)
GQA = ["--model", "configs/tiny-gqa8.json"]
STRATEGIES = [  # (label, module, adapter class, extra arguments): the order first
    ("ddp", "ddp", "DDP", []),
    ("zero3", "zero", "ZeRO", ["--stage", "3"]),
    ("fsdp", "fsdp", "FSDP", []),
    ("tp", "tp", "TP", GQA),
    ("pp-1f1b", "pp", "PP", ["--schedule", "1f1b"]),
    ("cp-zigzag", "cp_ring", "CP", []),
    ("ep", "ep_moe", "ExpertParallel", []),
    ("compose4d", "compose4d", "Compose4D", ["--grad-accum", "2"]),
    ("zero1", "zero", "ZeRO", ["--stage", "1"]),
    ("zero2", "zero", "ZeRO", ["--stage", "2"]),
    ("sp-megatron", "sp", "SP", GQA),
    ("sp-ulysses", "sp", "SP", GQA + ["--variant", "ulysses"]),
    ("sp-async", "sp", "SP", GQA + ["--async-tp"]),
    ("pp-zb", "pp", "PP", ["--schedule", "zb"]),
    ("ddp-muon", "ddp", "DDP", ["--optimizer", "muon"]),                 # muon.py's modes:
    ("zero2-muon", "zero", "ZeRO", ["--stage", "2", "--optimizer", "muon"]),   # owner,
    ("tp-muon", "tp", "TP", GQA + ["--optimizer", "muon"]),                    # tp-gather
]
LEARNING = ["zero2", "zero3"]        # bf16 learning: failed on the GPU on 2026-11-22
SMOKE_STRATEGIES = ["ddp", "tp", "compose4d"]   # and zero3's learning run


# ----------------------------------------------------------------------------------------------
# Shared by the sections
# ----------------------------------------------------------------------------------------------
def card(device) -> dict:
    """The GPU's name and memory as torch reports them, from a child process (the memory
    section keeps no CUDA context of its own: it would take memory from the trials)."""
    if device != "cuda":
        return {}
    out = subprocess.run([sys.executable, "-c", "import json, torch; p = torch.cuda."
                          "get_device_properties(0); print(json.dumps(dict(device=p.name, "
                          "device_memory_bytes=p.total_memory, multiprocessors="
                          "p.multi_processor_count)))"],
                         capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def machine(device: str, own_context: bool = True) -> dict:
    import torch
    import transformers
    d = dict(date=datetime.date.today().isoformat(), python=platform.python_version(),
             torch=torch.__version__, cuda=torch.version.cuda,
             transformers=transformers.__version__, host=platform.node())
    if device == "cuda" and own_context:
        p = torch.cuda.get_device_properties(0)
        d.update(device=p.name, device_memory_bytes=p.total_memory,
                 multiprocessors=p.multi_processor_count)
    elif device == "cuda":
        d.update(card(device))
    else:
        d.update(device=f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)")
    return d


class Recorder:
    """The section's JSON, rewritten after every item (a section cut by its budget keeps what
    it measured)."""

    def __init__(self, path, section, a, info):
        self.path, self.deadline = path, a.deadline
        self.doc = dict(section=section, ok=None, smoke=a.smoke, **info, items=[])

    def left(self) -> float:
        return self.deadline - time.time()

    def add(self, item: dict):
        self.doc["items"].append(item)
        self.write()

    def write(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=1, default=str)
        os.replace(tmp, self.path)

    def finish(self, ok: bool):
        self.doc["ok"] = bool(ok)
        self.write()
        return 0 if ok else 1


class Tee(io.TextIOBase):
    """stdout to the terminal (the driver's log) and to a buffer (the item's verdict lines)."""

    def __init__(self, real):
        self.real, self.buf = real, io.StringIO()

    def write(self, s):
        self.real.write(s)
        self.buf.write(s)
        return len(s)

    def flush(self):
        self.real.flush()


def verdict_lines(text: str) -> list[str]:
    keep = ("PASS", "FAIL", "error", "Traceback")
    return [ln.strip() for ln in text.splitlines()
            if ln.strip().startswith(keep) or "Error:" in ln][-12:]


def free(device):
    import torch
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ----------------------------------------------------------------------------------------------
# Section 1: the device paths, every strategy in one process
# ----------------------------------------------------------------------------------------------
class InProcess:
    """Strategy runs in this process through the harness's own entry points (cli._validate,
    cli._execute), in one process group made by the first run."""

    def __init__(self, device):
        self.device, self.env = device, None

    def run(self, module, cls_name, argv, watch=None):
        """(ok, printed text, error) of one run; `watch`: a HostSyncs counting inside the
        training steps (cls.step; the train mode's trainer4d.train.step_rows)."""
        from harness import cli
        from harness.launch import base_parser, launch
        cls = getattr(importlib.import_module("rig." + module), cls_name)   # the adapter
        parser = base_parser(module + ".py", cls.modes, cls.plants)
        cls.add_args(parser)
        tee = Tee(sys.stdout)
        ok, err = False, ""
        try:
            with contextlib.redirect_stdout(tee), contextlib.redirect_stderr(tee):
                a = parser.parse_args(argv + ["--device", self.device])
                config, dtypes = cli._validate(cls, a, 1, 0)
                if self.env is None:
                    self.env = launch(a)
                train = importlib.import_module("trainer4d.train")
                owner, name = (train, "step_rows") if a.mode == "train" else (cls, "step")
                with watch.watching(owner, name) if watch else contextlib.nullcontext():
                    ok = cli._execute(cls, a, self.env, config, dtypes)
        except SystemExit as e:          # a configuration refused in one line (exit 2)
            err = f"exit {e.code}"
        except Exception as e:           # noqa: BLE001  (recorded; the next run goes on)
            import traceback
            err = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            traceback.print_exc()
        free(self.device)
        return ok and not err, tee.buf.getvalue(), err


def watched_run(ip, label, mode, module, cls_name, argv, watch) -> dict:
    """One run as a JSON item; with `watch` (a HostSyncs), a host sync outside its ALLOWED
    table fails it."""
    t0 = time.time()
    print(f"=== {label} {' '.join(argv)}", flush=True)
    run_ok, text, err = ip.run(module, cls_name, argv, watch)
    item = dict(label=label, mode=mode, command=f"python {module}.py {' '.join(argv)}",
                ok=run_ok, error=err, seconds=round(time.time() - t0, 1),
                verdicts=verdict_lines(text),
                last=[ln for ln in text.splitlines() if ln.strip()][-4:])
    if watch is not None:
        item["host_syncs"] = watch.report()
        item["ok"] = item["ok"] and item["host_syncs"]["unexpected"] == 0
    print(f"--- {label} {mode}: {'PASS' if item['ok'] else 'FAIL'} {err} "
          f"({item['seconds']} s)" + (f"; host syncs beyond the allowed: "
                                     f"{item['host_syncs']['unexpected_per_step']:g} per step"
                                     if watch else ""), flush=True)
    return item


def device_section(a, rec: Recorder) -> bool:
    from harness.hostsync import HostSyncs
    tmp = tempfile.mkdtemp(prefix="gpu_check_")
    ip = InProcess(a.device)
    labels = SMOKE_STRATEGIES if a.smoke else [s[0] for s in STRATEGIES]
    if a.strategies:
        labels = a.strategies.split(",")
    small = ["--batch", "4", "--length", "32"] if a.smoke else []
    todo = [(lab, ["--mode", "correctness", "--dtype", "bfloat16"] + small) for lab in labels]
    todo += [(lab, ["--mode", "learning", "--dtype", "bfloat16", "--steps",
                    "60" if a.smoke else "100", "--log-every", "50"])
             for lab in (LEARNING[1:] if a.smoke else LEARNING)
             if lab in labels or not a.strategies]
    ok = True
    syncs_total = 0
    for label, mode in todo:
        _, module, cls_name, extra = next(s for s in STRATEGIES if s[0] == label)
        if rec.left() < (8 if a.smoke else 12):
            rec.add(dict(label=label, mode=mode[1], skipped="the section's budget"))
            continue
        argv = mode + extra + ["--out", os.path.join(tmp, label + mode[1])]
        watch = HostSyncs(a.device) if mode[1] == "correctness" else None
        item = watched_run(ip, label, mode[1], module, cls_name, argv, watch)
        syncs_total += item["host_syncs"]["unexpected"] if watch else 0
        ok &= item["ok"]
        rec.add(item)
    rec.doc["host_syncs_unexpected"] = syncs_total
    ok &= train_items(a, rec, ip, tmp)
    return ok


def differ_from_checkpoint(exported: dict, saved: dict) -> list[str]:
    """The names of the saved tensors (a checkpoint's parameters) the export lacks or holds
    otherwise than the saved tensor rounded to the export's dtype."""
    import torch
    return [n for n, t in saved.items() if n not in exported
            or not torch.equal(exported[n].cpu(), t.to(exported[n].dtype).cpu())]


def train_items(a, rec, ip, tmp) -> bool:
    """compose4d's train mode: save every 10 steps, resume from the checkpoint to step 30 and
    export to HF, reload the export on the device, evaluate it and compare every tensor with
    the trainer's final model (the step-30 checkpoint)."""
    from harness.hostsync import HostSyncs
    ck, hf = os.path.join(tmp, "ckpt"), os.path.join(tmp, "hf")
    base = ["--mode", "train", "--dtype", "bfloat16", "--model", "configs/tiny-tied.json",
            "--save", ck, "--log-every", "10"]
    if a.smoke:
        base += ["--batch", "4", "--length", "32"]
    for label, argv in (("train-save", base + ["--steps", "20", "--save-every", "10"]),
                        ("train-resume", base + ["--steps", "30", "--resume", ck,
                                                 "--export-hf", hf])):
        if rec.left() < 10:
            rec.add(dict(label=label, skipped="the section's budget"))
            return True
        item = watched_run(ip, label, "train", "compose4d", "Compose4D", argv,
                           HostSyncs(a.device))
        rec.add(item)
        if not item["ok"]:
            return False
    import torch
    from transformers import AutoModelForCausalLM
    from trainer4d.checkpoint import load_checkpoint
    t0 = time.time()
    try:
        m = AutoModelForCausalLM.from_pretrained(hf).to(a.device)
        x = torch.randint(0, m.config.vocab_size, (2, 32), device=a.device)
        with torch.no_grad():
            loss = m(input_ids=x, labels=x).loss.float().item()
        sane = loss == loss and 0 < loss < 2 * torch.log(torch.tensor(m.config.vocab_size)).item()
        # the trainer's final model: its last checkpoint's parameters (fp32 masters under a
        # bf16 run) in the export's dtype, tensor by tensor, bit for bit
        meta, full = load_checkpoint(ck)
        sd = m.state_dict()
        differ = differ_from_checkpoint(sd, full["param"])
        good = sane and meta["step"] == 30 and not differ
        rec.add(dict(label="hf-reload", ok=good, loss=loss, dtype=str(m.dtype),
                     checkpoint_step=meta["step"], tensors=len(full["param"]),
                     differ_from_checkpoint=differ[:5], seconds=round(time.time() - t0, 1)))
        print(f"--- hf-reload: {'PASS' if good else 'FAIL'} the export reloads on "
              f"{a.device}, loss {loss:.3f} on random tokens; {len(full['param'])} tensors "
              f"against the step-{meta['step']} checkpoint, {len(differ)} differ", flush=True)
    except Exception as e:              # noqa: BLE001
        good = False
        rec.add(dict(label="hf-reload", ok=False, error=f"{type(e).__name__}: {e}"[:300]))
    return good


# ----------------------------------------------------------------------------------------------
# Section 2: speed of the reference step and compose4d at W=1
# ----------------------------------------------------------------------------------------------
def cuda_timed(fn, warmup, iters, device):
    """Median seconds of fn(): the harness's marks (CUDA events on GPU, the clock on CPU)."""
    from harness.meter import mark, seconds_between
    import torch
    cuda = device == "cuda"
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        start = mark(cuda)
        fn()
        end = mark(cuda)
        if cuda:
            torch.cuda.synchronize()
        ts.append(seconds_between(start, end))
    return sorted(ts)[len(ts) // 2]


def top_kernels(fn, device, n=12):
    import torch
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    ev = prof.key_averages()
    key = (lambda e: e.self_device_time_total) if device == "cuda" else \
        (lambda e: e.self_cpu_time_total)
    tot = sum(key(e) for e in ev) or 1
    return [(e.key[:100], round(key(e) / tot, 4)) for e in sorted(ev, key=key, reverse=True)[:n]]


def reference_run(a, model: str, S: int, B: int):
    """(args, config, env, run, batch): compose4d's parser and run at W=1, bf16, SDPA, for the
    reference step's sections (speed, fp8)."""
    from harness import cli
    from harness.launch import base_parser, launch, resolve_defaults
    from harness.run import Run
    from harness.data import MarkovLanguage
    import rig.compose4d
    C4 = rig.compose4d.Compose4D
    parser = base_parser("compose4d.py", C4.modes, C4.plants)
    C4.add_args(parser)
    argv = ["--model", model, "--dtype", "bfloat16", "--attn", "sdpa", "--batch", str(B),
            "--length", str(S), "--device", a.device, "--mode", "benchmark"]
    args = resolve_defaults(parser.parse_args(argv), "benchmark", a.device, 1)
    config, _ = cli._validate(C4, args, 1, 0)
    env = launch(args)
    run = Run(args, env, config, MarkovLanguage(config.vocab_size, 0, 4))
    return args, config, env, run, run.batch(0)


def speed_section(a, rec: Recorder) -> bool:
    import torch
    from harness.flops import mfu, model_flops
    from harness.loss import chunked_loss_sum
    from harness.run import make_pair
    from harness.strategy import Reference
    from harness import dropout
    import rig.compose4d
    model = "tiny" if a.smoke else "llama3.2-1b"
    S, B = (64, 2) if a.smoke else (2048, 4)
    chunk = 64 if a.smoke else 4096
    warm, iters = (1, 2) if a.smoke else (2, 5)
    dev = torch.device(a.device)
    args, config, env, run, batch = reference_run(a, model, S, B)
    tokens = B * S
    flops = model_flops(config, tokens, S)

    class ChunkedReference(Reference):
        """The reference with the chunked cross-entropy (harness/loss.py): no full logits."""

        def objective(self, b):
            with dropout.at(b):
                return chunked_loss_sum(self.model, b.input_ids, b.labels, chunk) / b.n_tokens

    class CompiledReference(ChunkedReference):
        """A lever for the 45% MFU target: each decoder block through torch.compile (inductor
        on CUDA; the smoke run's aot_eager only proves the plumbing: no codegen on a CPU)."""

        def __init__(self, model, args_, env_):
            super().__init__(model, args_, env_)
            from harness.anatomy import parts
            backend = "aot_eager" if a.smoke else "inductor"
            for layer in parts(model).layers:
                layer.compile(backend=backend)

    def row(name, step_s, extra=None):
        peak = torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else None
        r = dict(run=name, model=model, batch=B, length=S, tokens=tokens, step_s=step_s,
                 tokens_per_s=tokens / step_s, model_flops=flops,
                 mfu=mfu(config, tokens, S, step_s, 1, dev), peak_memory_gib=peak,
                 **(extra or {}))
        print(f"--- {name}: step {step_s * 1e3:.1f} ms, {r['tokens_per_s']:,.0f} tokens/s, MFU "
              + (f"{r['mfu']:.1%}" if r["mfu"] else "- (CPU)")
              + (f", peak {peak:.1f} GiB" if peak else ""), flush=True)
        rec.add(r)
        return r

    ok, refs = True, {}
    for name, cls, need in (("reference, full logits", Reference, 15),
                            (f"reference, chunked CE ({chunk} tokens)", ChunkedReference, 15),
                            ("reference, chunked CE, compiled blocks", CompiledReference, 45)):
        if rec.left() < need:
            rec.add(dict(run=name, skipped="the section's budget"))
            continue
        free(a.device)
        from harness.models import build_model
        ref = cls(build_model(args, config, dev), args, env)
        losses = []
        t = cuda_timed(lambda: losses.append(ref.step(batch)), warm, iters, a.device)
        extra = dict(loss_first=losses[0], loss_last=losses[-1],
                     optimizer=type(ref.optimizer).__name__,
                     fused=bool(ref.optimizer.param_groups[0].get("fused")))
        if "compiled" in name:   # the lever's gain, and its loss against the eager run's
            eager = refs.get(f"reference, chunked CE ({chunk} tokens)")
            if eager:   # the same weights and batch: the first loss agrees within bf16's
                extra["eager_over_compiled"] = eager["step_s"] / t
                extra["loss_first_diff"] = d = losses[0] - eager["loss_first"]
                ok &= abs(d) <= 0.02
        elif "chunked" in name:
            extra["top_kernels"] = top_kernels(lambda: ref.step(batch), a.device)
        refs[name] = row(name, t, extra)
        ok &= all(x == x for x in losses)
        del ref
    if rec.left() >= 20:
        free(a.device)
        try:
            _, strat, _ = make_pair(run, rig.compose4d.Compose4D, perturb=False, with_ref=False)
            t = cuda_timed(lambda: strat.step(batch), warm, iters, a.device)
            base = refs.get("reference, full logits")
            row("compose4d W=1 (full logits)", t,
                dict(over_reference=t / base["step_s"] if base else None))
            del strat
        except Exception as e:          # noqa: BLE001
            import traceback
            traceback.print_exc()
            rec.add(dict(run="compose4d W=1", ok=False, error=f"{type(e).__name__}: {e}"[:300]))
            ok = False
    else:
        rec.add(dict(run="compose4d W=1", skipped="the section's budget"))
    return ok and bool(refs)


def fp8_section(a, rec: Recorder) -> bool:
    """The reference step in bf16 and with each FP8 recipe, from the same weights and batch:
    tokens/s, the speed-up over bf16 and the loss after the warm-up and timed steps (each
    recipe's within 0.5 nats of bf16's, and finite, or the row fails)."""
    import torch
    import fp8
    from harness.models import build_model
    from harness.strategy import Reference
    model = (os.path.join(ROOT, "configs", "tiny-fp8.json") if a.smoke   # (128-wide: blockwise)
             else "llama3.2-1b")
    S, B = (128, 2) if a.smoke else (2048, 4)
    warm, iters = (1, 2) if a.smoke else (2, 5)
    args, config, env, run, batch = reference_run(a, model, S, B)
    ok, base = True, None
    for recipe in (None, "tensorwise", "rowwise", "blockwise"):
        name = recipe or "bf16"
        if rec.left() < 10:
            rec.add(dict(run=name, skipped="the section's budget"))
            continue
        free(a.device)
        m = build_model(args, config, torch.device(a.device))
        converted = fp8.convert(m, recipe) if recipe else []
        ref, losses = Reference(m, args, env), []
        t = cuda_timed(lambda: losses.append(ref.step(batch)), warm, iters, a.device)
        r = dict(run=name, model=model, batch=B, length=S, step_s=t, tokens_per_s=B * S / t,
                 converted=len(converted), loss_first=losses[0], loss_last=losses[-1],
                 over_bf16=None if base is None else base["step_s"] / t)
        r["ok"] = all(x == x for x in losses) and (
            base is None or abs(r["loss_last"] - base["loss_last"]) < 0.5)
        base = base or r
        print(f"--- fp8 {name}: step {t * 1e3:.1f} ms, {r['tokens_per_s']:,.0f} tokens/s"
              + (f", {r['over_bf16']:.2f}x bf16's" if r["over_bf16"] else "")
              + f", loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}", flush=True)
        rec.add(r)
        ok &= r["ok"]
        del ref, m
    return ok and base is not None


# ----------------------------------------------------------------------------------------------
# Section 3: the longest sequence at W=1, measured against the prediction
# ----------------------------------------------------------------------------------------------
def memory_section(a, rec: Recorder) -> bool:
    import oom_search
    from harness.models import load_config
    model = "tiny" if a.smoke else "llama3.2-1b"
    cfg = load_config(model)
    strategies = ["tp"] if a.smoke else ["tp", "sp", "pp"]
    step = 256 if a.smoke else 1024
    budget_gb = 0.03 if a.smoke else None
    total = rec.doc.get("device_memory_bytes") or int(budget_gb * 2**30)
    rec.doc.update(model=model, dtype="bfloat16", batch=1, grid=step, card_bytes=total,
                   oom="CUDA OOM (the allocator's)" if a.device == "cuda" else
                   f"simulated: CPU live-tensor tracker over {budget_gb} GiB")
    targs = types.SimpleNamespace(model=model, dtype="bfloat16", device=a.device,
                                  mem_budget_gb=budget_gb, mem_fraction=None, ce_chunk=0,
                                  timeout=max(20.0, min(90.0, rec.left())))
    state = {}
    for s in strategies:
        pred = oom_search.predict_max(s, 1, 1, cfg, total, step, None, step, 2, False)
        state[s] = dict(strategy=s, predicted_max=pred, trials=[], ok_max=None, oom_min=None)
    rec.doc["strategies"] = state
    rounds = 2 if a.smoke else 3
    for r in range(rounds):           # round robin: every strategy gets its first trial first
        for s, st in state.items():
            if st["ok_max"] is not None and st["oom_min"] is not None \
                    and st["oom_min"] - st["ok_max"] <= step:
                continue
            if st["ok_max"] is None and st["oom_min"] is None:
                L = st["predicted_max"] or step
            elif st["oom_min"] is None:
                L = st["ok_max"] + step
            elif st["ok_max"] is None:
                L = st["oom_min"] - step
            else:
                L = st["ok_max"] + step
            if L < step:
                continue
            if rec.left() < 20:
                st["stopped"] = "the section's budget"
                continue
            targs.timeout = max(20.0, min(120.0, rec.left() - 5))
            o = oom_search.run_trial(s, 1, L, 1, targs)
            pred = oom_search.predict_peak(s, 1, L, 1, cfg, 2)["peak"]
            st["trials"].append(dict(length=L, kind=o.kind, peak=o.peak, predicted_peak=pred,
                                     seconds=round(o.seconds, 1), detail=o.detail[:200]))
            if o.kind == "OK":
                st["ok_max"] = max(L, st["ok_max"] or 0)
            elif o.kind == "OOM":
                st["oom_min"] = min(L, st["oom_min"] or L)
            else:
                st["stopped"] = f"{o.kind} at {L}: {o.detail[:200]}"
            print(f"--- {s} L={L}: {o.kind}" + (f", peak {o.peak / 2**20:,.0f} MiB, predicted "
                                                f"{pred / 2**20:,.0f} MiB" if o.peak else "")
                  + f" ({o.seconds:.0f} s)", flush=True)
            rec.write()
    bad = [s for s, st in state.items()
           if any(t["kind"] not in ("OK", "OOM") for t in st["trials"]) or not st["trials"]]
    rec.doc["failed"] = bad
    return not bad


# ----------------------------------------------------------------------------------------------
# Section 4: ring attention's block loop
# ----------------------------------------------------------------------------------------------
def cp_section(a, rec: Recorder) -> bool:
    tmp = tempfile.mkdtemp(prefix="gpu_check_cp_")
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "gpu_cp_kernels.py"), tmp,
           "--device", a.device]
    cmd += ["--seq", "256", "--ranks", "2", "--dtypes", "float32", "--doc-mask", "32"] \
        if a.smoke else ["--ranks", "2,4,8", "--doc-mask", "256"]
    rec.doc["command"] = " ".join(cmd[1:])
    rc = subprocess.run(cmd, cwd=ROOT, timeout=max(10, rec.left())).returncode
    path = os.path.join(tmp, "cp_kernels.json")
    if rc != 0 or not os.path.exists(path):
        rec.doc["rc"] = rc
        return False
    with open(path) as f:
        res = json.load(f)
    rec.doc.update(res)
    # each loop row against whole-sequence SDPA of its dtype and masking (within 4x + 1e-6)
    whole = {(r["dtype"], "docs" in r): r for r in res["rows"]
             if r["C"] == 1 and "SDPA" in r["kernel"]}
    ok = True
    for r in res["rows"]:
        if r["C"] > 1:
            r["accurate"] = r["err"] <= 4 * whole[r["dtype"], "docs" in r]["err"] + 1e-6
            ok &= r["accurate"]
    fused2 = [r for r in res["rows"] if r["C"] == 2 and "fused" in r["kernel"]]
    rec.doc["loop_over_one_call_C2"] = {r["dtype"]: r["over_whole"] for r in fused2}
    rec.doc["docs_loop_over_one_masked_call_C2"] = {
        r["dtype"]: r["over_whole"] for r in res["rows"] if r["C"] == 2 and "docs" in r}
    rec.doc["target_C2"] = "at most 1.5x one fused call (issue 74; reported, not a verdict)"
    rec.add(dict(rc=rc))
    return ok


# ----------------------------------------------------------------------------------------------
# The driver
# ----------------------------------------------------------------------------------------------
def worker(a) -> int:
    info = machine(a.device, own_context=a.worker != "memory")
    rec = Recorder(os.path.join(a.out, f"{a.worker}.json"), a.worker, a, info)
    rec.doc["budget_s"] = round(a.deadline - time.time(), 1)
    rec.write()
    fn = dict(device=device_section, speed=speed_section, memory=memory_section,
              cp=cp_section, fp8=fp8_section)[a.worker]
    return rec.finish(fn(a, rec))


def stream(cmd, log, timeout) -> tuple[int, bool]:
    """Run cmd in its own session, its output to our stdout and the log, killed at timeout."""
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True, env=dict(os.environ,
                                                                     PYTHONUNBUFFERED="1"))

    def pump():
        for line in p.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            log.write(line)
            log.flush()
    th = threading.Thread(target=pump, daemon=True)
    th.start()
    try:
        rc = p.wait(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        rc, timed_out = p.wait(), True
    th.join(timeout=5)
    return rc, timed_out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--budget-s", type=float, default=480.0)
    p.add_argument("--device", default=None, choices=["cuda", "cpu"])
    p.add_argument("--smoke", action="store_true", help="tiny shapes (the CPU rehearsal)")
    p.add_argument("--sections", default=None, help="comma list (default: all, in order)")
    p.add_argument("--strategies", default=None, help="device section: these labels only")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.device is None:
        import torch
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.worker:
        return worker(a)
    names = a.sections.split(",") if a.sections else [n for n, _, _ in SECTIONS]
    unknown = [n for n in names if n not in dict((s, 0) for s, _, _ in SECTIONS)]
    if unknown:
        print(f"error: --sections: {unknown[0]!r} is not one of "
              f"{', '.join(s for s, _, _ in SECTIONS)}", file=sys.stderr)
        return 2
    start = time.time()
    end = start + a.budget_s
    scale = a.budget_s / NOMINAL if not a.sections else a.budget_s / sum(
        s for n, s, _ in SECTIONS if n in names)
    summary = {}
    with open(os.path.join(a.out, "gpu_check.log"), "a") as log:
        log.write(f"$ python scripts/gpu_check.py {' '.join(argv or sys.argv[1:])}\n")
        for name, nominal, minimum in SECTIONS:
            if name not in names:
                continue
            left = end - time.time()
            budget = min(nominal * scale, left)
            path = os.path.join(a.out, f"{name}.json")
            if budget < minimum * (0.25 if a.smoke else 1):
                with open(path, "w") as f:
                    json.dump(dict(section=name, ok=None, skipped=f"{left:.0f} s left of the "
                                   f"global budget, under the section's minimum {minimum} s"),
                              f, indent=1)
                summary[name] = "skipped"
                print(f"### {name}: skipped ({left:.0f} s left)", flush=True)
                continue
            print(f"### {name}: budget {budget:.0f} s", flush=True)
            log.write(f"### {name}: budget {budget:.0f} s\n")
            t0 = time.time()
            cmd = [sys.executable, os.path.abspath(__file__), a.out, "--worker", name,
                   "--device", a.device, "--deadline", str(time.time() + budget)]
            cmd += ["--smoke"] if a.smoke else []
            cmd += ["--strategies", a.strategies] if a.strategies else []
            rc, timed_out = stream(cmd, log, budget + 10)
            doc = {}
            if os.path.exists(path):
                with open(path) as f:
                    doc = json.load(f)
            doc.update(section=name, rc=rc, timed_out=timed_out,
                       seconds=round(time.time() - t0, 1), budget_s=round(budget, 1))
            doc["ok"] = bool(doc.get("ok")) and rc == 0
            with open(path, "w") as f:
                json.dump(doc, f, indent=1, default=str)
            summary[name] = "PASS" if doc["ok"] else "FAIL"
            line = f"### {name}: {summary[name]} (rc {rc}{', cut by its budget' if timed_out else ''}, {doc['seconds']} s)"
            print(line, flush=True)
            log.write(line + "\n")
        total = f"gpu_check: {summary} in {time.time() - start:.0f} s"
        print(total, flush=True)
        log.write(total + "\n")
    ran = [v for v in summary.values() if v != "skipped"]
    return 0 if ran and all(v == "PASS" for v in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
