"""train.py: compose4d's train mode (`compose4d.py --mode train`): a logged run with checkpoints,
preemption and elastic restarts, outside the comparisons (no reference).

    torchrun --nproc_per_node=4 compose4d.py --tp 2 --pp 2 --mode train --steps 200 \\
        --lr-schedule cosine --lr-warmup 20 --save ckpt --export-hf hf_out
    torchrun --nproc_per_node=2 compose4d.py --pp 2 --mode train --steps 300 --resume ckpt

Preemption: SIGTERM sets a flag; the ranks agree on it once per step, at no extra cost: the flag
rides as a second element of the step's loss all-reduce (compose4d.Parallel4D.loss_flag_norm),
read with the loss (the step's one host read). The step in flight finishes and is saved at its
end, then the process exits 0. `--preempt-at micro-batch` also agrees before each micro-batch's first forward (pipeline.Cut,
the row pp.Pipeline.run walks: a MAX all-reduce and a host read per micro-batch, a global barrier that serialises the
pipeline), so a 1F1B step can be cut mid-way: the checkpoint then keeps the step's reduced
gradients and records which rows are done (`cut`), and the resumed run finishes that step from the
saved gradient sum (`step_rows`), on whatever layout it restarts with, so the result equals the
uninterrupted run. Either way the resumed run equals the uninterrupted one, with one condition: a
MoE model's auxiliary loss is per micro-batch, so a resume or re-plan must keep the rows of every
micro-batch (objective_changes; the elastic planner only takes plans that do), or it is refused
in one line before training.
Elastic (--elastic): each (re)start re-plans micro-batch, grad-accum and ZeRO stage for the world
size it finds (elastic.plan_world), keeping the checkpoint's global batch within a tolerance.
Checkpoints: checkpoint.py (layout-independent, atomic; with the data position).
Real text: --data (harness/corpus.py, harness/train_data.py), --eval-every (held-out loss through
pipeline.evaluate), --prompt (a greedy sample from the gathered model, as the export gives it).
Loading: with --model a safetensors directory each rank reads only its shard onto a meta-device
model (harness/loading.py), and prints its peak memory during the build. Logs: --out's
train.jsonl, TensorBoard events, loss.png (harness/trainlog.py).
"""
import json
import os
import signal
import time

import torch
import torch.distributed as dist

from harness import DTYPES, METER, Batch, Run, build_model, is_moe, loading
from harness.flops import mfu
from harness.loading import has_safetensors, meta_model
from harness.models import has_weights
from harness.recompute import apply_recompute, recompute_what
from harness.run import gather_objects, same_build
from harness.trainlog import TrainLog, memory_now
from harness import train_data

import compose_moe
from . import elastic
from .checkpoint import (dropout_of, export_hf, find_checkpoint, hf_model,  # noqa: F401
                         latest_dir, load_checkpoint, restore, save_checkpoint, trained)


class Preemption:
    """SIGTERM (from the batch system, or torchrun passing it on) sets a flag. The ranks agree
    on it through `Parallel4D.loss_flag_norm` once per step (no collective of its own), or, under
    `--preempt-at micro-batch`, also with `agreed` (one MAX all-reduce and a host read) before
    every micro-batch, so all of them stop after the same micro-batch."""

    def __init__(self):
        self.flag, self.at = False, None
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame):
        self.flag, self.at = True, self.at or time.time()

    def report(self, what: str, t_save: float, grace_s: float) -> str:
        """The save's line: its own time, the time since the signal (on the rank that got it),
        and a warning when that passes --grace-s (the batch system's SIGTERM-to-SIGKILL wait: a
        real one would have killed the job mid-save, leaving the previous checkpoint)."""
        now = time.time()
        line = f"SIGTERM: saved {what} in {now - t_save:.2f} s"
        if self.at is None:
            return line + f" (grace {grace_s:g} s)"
        since = now - self.at
        line += f", {since:.2f} s after the signal (grace {grace_s:g} s)"
        if since > grace_s:
            line += (f"\nwarning: the save ended {since:.2f} s after SIGTERM, past --grace-s "
                     f"{grace_s:g}: a batch system would have killed the job first (the previous "
                     f"checkpoint stays the one to resume)")
        return line

    def agreed(self, device) -> bool:
        t = torch.tensor([int(self.flag)], dtype=torch.int32, device=device)
        with METER.paused():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


def step_rows(strat, batch: Batch, rows=None, mb=None, stop=None, partial=None,
              flag=lambda: False, cut=True):
    """compose4d.Parallel4D.run_step over rows. Over the global batch's rows `rows` (default: all
    of them, split into contiguous dp shares of --grad-accum micro-batches; else each dp rank
    takes its contiguous share of `rows` in micro-batches of at most `mb`). `stop(m) -> bool`,
    asked on every rank before forward m (trainer4d.pipeline.Cut), may end the step once
    micro-batches 0..m-1 are drained (`cut`: its answer agreed across ranks; else it is a local
    callback that must return False): the gradients are then reduced and kept, nothing is
    updated, and the processed rows are returned, for a mid-step checkpoint. `partial`: a
    restored mid-step gradient (sum over the rows already done) to start from. `flag()`: this
    rank's preemption flag, read after the micro-batches and agreed with the loss.
    Returns (global loss or None when cut, (processed rows, loss sum) or None, agreed flag)."""
    local = mbs = None
    if rows is not None:
        D, dp = strat.grid.size["dp"], strat.me["dp"]
        my_rows = [list(r) for r in split_even(rows, D)][dp]
        local = strat.local_batch(batch, my_rows)       # and this cp rank's tokens of each
        mbs = [local.rows(i, min(i + mb, len(my_rows))) for i in range(0, len(my_rows), mb)]
    start = (lambda: add_partial(strat, partial)) if partial is not None else None
    loss, ce, stopping = strat.run_step(batch, local, mbs, stop, start, flag, cut)
    if loss is None:     # cut: the gradients kept, the rows done returned
        return None, (processed(strat, batch, strat.cut_row.completed), ce), stopping
    return loss, None, stopping


def processed(strat, batch: Batch, k: int) -> list[int]:
    """Global rows done when every dp rank has run its first k micro-batches (fresh step)."""
    D, M = strat.grid.size["dp"], strat.args.grad_accum
    n = batch.input_ids.shape[0] // D
    mb = n // M
    return [d * n + i for d in range(D) for i in range(k * mb)]


def add_partial(strat, full: dict[str, torch.Tensor]):
    """Put a restored partial gradient (the reduced sum over the rows already done) where this
    layout's reductions count it exactly once: on rank 0 of every group that will sum it
    (Parallel4D.shared_over, the rule the global norm counts by): ZeRO-1 adds the full buffers
    on one rank of the unit's group, ZeRO-2/3 each rank its own shard; a tp-partial gradient
    on tp rank 0, a dense unit under HSDP on replica 0; the tied head's copy nowhere."""
    z = strat.zero
    for u in trained(z):   # (--lora: the frozen base has no gradient)
        # in the dtype it is added to: bf16 full gradients (ZeRO-1), fp32 shards (ZeRO-2, bf16)
        flat = torch.zeros(u.padded, device=u.full.device,
                           dtype=u.full.dtype if strat.args.zero == 1 else u.grad_shard.dtype)
        for n, p, off in zip(u.names, u.params, u.offsets):
            shared = strat.shared_over(u, n, p)
            if shared is None or not strat.first_in(shared[0]):
                continue
            t = strat.local(n, full[n].to(flat.device, flat.dtype))
            flat[off:off + p.numel()] = t.reshape(-1)
        if strat.args.zero == 1:
            u.grad_full.add_(flat)      # reduce-scattered (summed) with this step's own
        else:
            u.grad_shard.add_(flat[u.rank * u.shard_numel:(u.rank + 1) * u.shard_numel])


def split_even(rows, parts):
    """Contiguous shares of `rows`, as even as possible (the first ones one larger)."""
    q, r = divmod(len(rows), parts)
    out, i = [], 0
    for p in range(parts):
        n = q + (1 if p < r else 0)
        out.append(rows[i:i + n])
        i += n
    return out



def saved_meta(args) -> dict | None:
    """The meta.json of the checkpoint --resume would continue (None: a fresh run)."""
    d = latest_dir(args.resume)
    if d is None:
        return None
    with open(os.path.join(d, "meta.json")) as f:
        return json.load(f)


def target_batch(args, meta: dict | None) -> int:
    """The global batch an elastic run keeps: the checkpoint's (meta), or --batch for a fresh
    run."""
    return args.batch if meta is None else meta.get("global_batch", args.batch)


def objective_changes(meta: dict | None, config, args, B: int, D: int, M: int) -> str | None:
    """Why resuming `meta` with global batch B on dp D in M micro-batches would optimise another
    objective than the run it continues (None: it would not). A MoE model's auxiliary loss is
    per micro-batch (compose_moe), so the rows that share each micro-batch must stay the same
    (compose_moe.micro_batch_sets; with one micro-batch any dp keeps them)."""
    if meta is None or not compose_moe.objective_per_micro_batch(config, args):
        return None
    if "grad_accum" not in meta:
        return ("the MoE auxiliary loss is per micro-batch, and the checkpoint (saved before "
                "checkpoints recorded their split) does not say how its rows were grouped: "
                "resume with --aux-coef 0, or from a newer checkpoint")
    # (the batch the saved run ran: an elastic run's target may differ from it)
    was = (meta.get("batch", meta.get("global_batch", B)), meta["layout"]["dp"],
           meta["grad_accum"])
    if compose_moe.micro_batch_sets(*was) == compose_moe.micro_batch_sets(B, D, M):
        return None
    return (f"the MoE auxiliary loss is per micro-batch, and global batch {B} on dp {D} in {M} "
            f"micro-batches groups the rows otherwise than the saved run's (batch {was[0]}, dp "
            f"{was[1]}, grad-accum {was[2]}): another objective; keep its split, or resume with "
            f"--aux-coef 0")


def replan(world: int, config, args, meta: dict | None) -> elastic.Plan:
    """--elastic: the batch, grad-accum and ZeRO stage for the world size this run (re)starts
    on (compose4d's constraints call it before the process group exists). A MoE run with the
    auxiliary loss keeps only plans whose micro-batches hold the same rows (objective_changes):
    the resume is then exact, and without one the re-plan is refused. meta: the checkpoint's
    (saved_meta), None for a fresh run."""
    keep = None
    if meta is not None and compose_moe.objective_per_micro_batch(config, args):
        keep = lambda dp, g, a: objective_changes(meta, config, args, g, dp, a) is None  # noqa
    return elastic.replan(world, config, args, target_batch(args, meta), keep=keep)


def build(run: Run, cls):
    """The strategy for this run's layout. From a checkpoint directory with safetensors
    (--load shards, the default) the model is built on the meta device and each rank reads only
    its shard (harness/loading.py); otherwise every rank builds the whole model and keeps its
    part. Each rank's peak resident memory during the build is printed beside the model's
    size (Linux)."""
    args, env = run.args, run.env
    before = loading.rss_reset()
    # (a MoE directory stores experts one by one, not as the fused tensors a shard is cut from)
    if args.load == "shards" and has_safetensors(args.model) and not is_moe(run.config):
        strat, how = cls(meta_model(run.config, args), args, env), "read its shard"
        load = strat.load_report["grow"]
    else:
        model, how = build_model(args, run.config, env.device), "built all"
        load = None if before is None else loading.rss_peak() - before
        if not has_weights(args.model):   # (checkpoint files: the same bytes on every rank)
            same_build(model, env)
        strat = cls(model, args, env)
    if args.recompute != "none":
        apply_recompute(strat.model, args.recompute)
        run.print(f"recompute {args.recompute}: {recompute_what(strat.model)}")
    peak = loading.rss_peak()
    held = sum(p.numel() * p.element_size() for p in strat.model.parameters())
    with torch.device("meta"):
        whole = sum(p.numel() for p in meta_model(run.config, args).parameters())
    whole *= DTYPES[args.dtype].itemsize
    build = None if before is None or peak is None else peak - before
    mib = lambda x: "n/a" if x is None else f"{x / 2**20:.1f} MiB"  # noqa: E731
    ranks = gather_objects(dict(rank=env.rank, load=load, build=build, held=held))
    for r in ranks:
        run.print(f"load rank {r['rank']}: {how} of {args.model}; holds {mib(r['held'])} of the "
                  f"{mib(whole)} model ({args.dtype}); peak resident memory +{mib(r['load'])} "
                  f"during the load, +{mib(r['build'])} during the whole build (with ZeRO's "
                  f"buffers)")
    run.results["load"] = dict(how=how, whole=whole, ranks=ranks)
    return strat


def run_train(run: Run, cls) -> bool:
    """A logged training run with checkpoints; SIGTERM saves at the end of the step in flight
    (mid-step under --preempt-at micro-batch, 1F1B) and exits 0;
    with --elastic the batch is re-planned for the world size the run (re)starts on; --data
    trains on text, --eval-every evaluates on held-out documents, --prompt samples at the end."""
    args, env = run.args, run.env
    d, problems = find_checkpoint(args.resume)
    if problems and d:   # (none intact at all: refused before the group, compose_constraints)
        run.print(f"warning: {'; '.join(problems)}; resuming from {os.path.basename(d)}")
    meta, full = load_checkpoint(args.resume, d) if d else (None, None)
    target = target_batch(args, meta)
    if args.elastic:     # feasible: checked in compose_constraints
        plan = replan(env.world, run.config, args, meta)
        args.batch, args.grad_accum, args.zero = plan.global_batch, plan.grad_accum, plan.zero
    strat = build(run, cls)
    data = train_data.DataSource(train_data.open_corpus(args, run.config), run.lang, args,
                                 env.device)
    if data.corpus is not None:
        run.print(f"data: {data.corpus.describe()}")
    start, offset, restarts, cut = 0, 0, 0, None
    if meta:
        restore(strat, meta, full)
        start, offset = meta["step"], meta.get("samples", meta["step"] * args.batch)
        restarts, cut = meta.get("restarts", 0) + 1, meta.get("cut")
        run.print(f"resumed from {args.resume} at step {start}, sample {offset}"
                  + (f", micro-batch position: {len(cut['rows_done'])} of {cut['global_batch']} "
                     f"sequences done" if cut else "")
                  + f" (saved by layout {meta['layout']}, restart {restarts})")
    D = strat.grid.size["dp"]
    mb = args.batch // (D * args.grad_accum)
    run.print(f"train: {strat.name} W={env.world} {args.dtype} model={args.model} "
              f"global batch={args.batch} (target {target}) micro-batch={mb} "
              f"grad-accum={args.grad_accum} length={args.length} steps {start}..{args.steps} "
              f"lr={args.lr} ({args.lr_schedule}, warm-up {args.lr_warmup})")
    log = TrainLog(args.out, env.is_main, resume=bool(meta))
    pre = Preemption()
    extra = lambda off, **kw: dict(samples=off, global_batch=target, restarts=restarts,  # noqa
                                   batch=args.batch, grad_accum=args.grad_accum,
                                   data=data.fingerprint, doc_mask=bool(args.doc_mask),
                                   length=args.length, **kw)
    t0, tok = time.time(), 0
    end = min(args.steps, args.stop_at or args.steps)
    s = start
    if args.eval_every and start < end:   # the baseline: held-out loss before this run's steps
        ev, ppl = train_data.evaluate(strat, data)
        log.write(dict(step=start - 1, eval_loss=ev, eval_ppl=ppl))
        run.print(f"held-out loss before step {start}: {ev:.4f} (perplexity {ppl:.2f})")
    while s < end:
        t_step = time.time()
        G = cut["global_batch"] if cut else args.batch
        batch = data.train(s, G, offset)
        rows = partial = None
        if cut:      # finish the step a SIGTERM cut: the rows not done yet, from its gradients
            rows = [r for r in range(G) if r not in set(cut["rows_done"])]
            partial = full["grad"]
        def sigterm_hook(m, s=s):   # before forward m: micro-batch m - 1 is the last done
            if (args.test_sigkill_at == f"{s}:{m}" and env.rank == env.world - 1
                    and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
                print(f"test hook: SIGKILL at {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)   # test hook: a worker dies mid-step
            if args.test_sigterm_at == f"{s}:{m - 1}" and env.is_main:
                # under torchrun the launcher passes it on to every rank; alone, to ourselves
                os.kill(os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid(),
                        signal.SIGTERM)
                pre.flag, pre.at = True, pre.at or time.time()
        def stop(m):           # --preempt-at micro-batch: agree before every micro-batch
            sigterm_hook(m)
            return pre.agreed(env.device)
        # The default (--preempt-at step) asks nothing per micro-batch: the flag is agreed with
        # the step's loss and acted on after the update. Only the test hook looks in (locally).
        mid_step = (args.preempt_at == "micro-batch" and rows is None and args.save
                    and args.schedule == "1f1b")                          # (V = 1)
        hook = stop if mid_step else (sigterm_hook if args.test_sigterm_at
                                      or args.test_sigkill_at else None)
        loss, stopped, stopping = step_rows(strat, batch, rows, mb, hook, partial,
                                            flag=lambda: pre.flag, cut=mid_step)
        if stopped:                                  # SIGTERM inside the step: save mid-step
            done, loss_sum = stopped
            t1 = time.time()
            d = save_checkpoint(strat, args.save, s, extra(offset, cut=dict(
                rows_done=done, loss_sum=loss_sum, global_batch=G)), grads=True,
                keep=args.keep)
            run.print(pre.report(f"{d} after {len(done)} of {G} sequences of step {s}", t1,
                                 args.grace_s))
            break
        if cut:
            loss += cut["loss_sum"] / batch.n_tokens
            cut, full = None, None
        offset += G
        tok += G * args.length
        dt_step = time.time() - t_step
        row = dict(step=s, loss=loss, lr=strat.learning_rate(s), grad_norm=strat.last_norm,
                   tokens_per_s=G * args.length / max(dt_step, 1e-9))
        row["memory_bytes"], row["memory_source"] = memory_now(env.device)
        row["mfu"] = mfu(run.config, G * args.length, args.length, dt_step, env.world,
                         env.device)
        if args.eval_every and ((s + 1) % args.eval_every == 0 or s == end - 1):
            row["eval_loss"], row["eval_ppl"] = train_data.evaluate(strat, data)
        log.write(row)
        if s % args.log_every == 0 or s == end - 1 or "eval_loss" in row:
            dt = time.time() - t0
            run.print(f"step {s:>5}  loss {loss:.6f}  grad norm {strat.last_norm:.4f}  "
                      f"lr {strat.learning_rate(s):.2e}  {tok / max(dt, 1e-9):,.0f} tok/s  "
                      + (f"held-out loss {row['eval_loss']:.4f} ppl {row['eval_ppl']:.2f}  "
                         if "eval_loss" in row else "")
                      + f"world {env.world} global batch {G} micro {mb} accum {args.grad_accum} "
                      f"restarts {restarts}  [{s + 1}/{args.steps}, {dt:.0f}s]")
        run.results.setdefault("all_losses", []).append((s, loss))
        s += 1
        if args.save and stopping:     # SIGTERM seen by some rank before this step's loss
            t1 = time.time()
            d = save_checkpoint(strat, args.save, s, extra(offset), keep=args.keep)
            run.print(pre.report(f"{d} at the end of step {s - 1}", t1, args.grace_s))
            break
        if args.save and args.save_every and s % args.save_every == 0 and s < end:
            save_checkpoint(strat, args.save, s, extra(offset), keep=args.keep)
    else:
        if args.save and end > start:
            t1 = time.time()
            d = save_checkpoint(strat, args.save, end, extra(offset), keep=args.keep)
            run.print(f"saved {d} in {time.time() - t1:.2f} s")
        finish(run, strat)
    png = log.close(f"{strat.name} W={env.world} {args.dtype}, "
                    f"{os.path.basename(args.data or 'synthetic')} ({args.model})")
    if png:
        run.print(f"wrote {png}")
    if args.out and env.is_main:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "train.json"), "w") as f:
            json.dump(dict(strategy=strat.name, losses=run.results.get("all_losses", [])), f)
    return True


def finish(run: Run, strat):
    """At the end of a run: the HF export and the greedy sample, from one gather of the full
    parameters (a collective), the model rebuilt from HF's own modules on rank 0, so the
    printed continuation is the one the exported directory gives."""
    args, env = run.args, run.env
    if not (args.export_hf or args.prompt):
        return
    full = strat.full_params()
    tok = train_data.tokenizer_dir(args)
    if args.export_hf:
        export_hf(strat, args.export_hf, tokenizer=tok, full=full)
        run.print(f"exported an HF model to {args.export_hf}")
    if args.prompt and env.is_main:
        text = train_data.greedy(hf_model(strat, full), tok, args.prompt, args.gen_tokens)
        run.print(f"prompt: {args.prompt!r}")
        run.print(f"greedy continuation: {text!r}")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "sample.json"), "w") as f:
                json.dump(dict(prompt=args.prompt, continuation=text,
                               tokens=args.gen_tokens), f)
