"""benchmark.py: Modes `benchmark` and `peak`.

benchmark  --warmup steps, then --bench-iters timed steps (a fixed count: adaptive counts deadlock
           because ranks decide differently). Step and forward time, tokens/s, memory per rank,
           communication per step by op and group beside the strategy's formulas
           (`expected_comm`), the single-device reference, and with --compare-native PyTorch's
           implementation.
peak       (oom_search.py's trials) two full steps under the memory tracker, the steady-state
           peak: `TRIAL OK {json}`, or `TRIAL OOM ...` and exit code 3 when --mem-budget-gb (CPU,
           simulated) or the CUDA allocator runs out.
"""
from __future__ import annotations

import json
import math
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist

from .memory import OOM_EXIT, SimulatedOOM, measure_memory, steady_peak
from .meter import METER, RING_FACTOR, mark, quantile, seconds_between
from .models import DTYPES, build_model
from .report import jsonable, fmt_bytes, write_json
from .run import Run, gather_objects, max_over_ranks, broadcast_verdict, make_pair
from .overlap import plot as plot_overlap, profile_steps
from .plants import planting
from .strategy import natives, reference_class
from .timing import sync, timed_steps


def bench_strategy(run: Run, strat) -> dict:
    """Timed steps (comm metered, ranks aligned by a barrier), then one tracked step for
    memory. Collective: times are the max over ranks."""
    args = run.args

    def barrier():  # align the ranks' starts (not counted)
        with METER.paused():
            dist.barrier()
    METER.reset()
    step_t, fwd_t = timed_steps(run, strat, METER.measuring, barrier)
    comm = METER.snapshot(per=args.bench_iters)
    raw_counts = {k: tuple(v) for k, v in METER.counts.items()}
    METER.reset()
    # more steps under torch.profiler, the median one kept: the share of communication hidden
    # behind compute
    after = args.warmup + args.bench_iters
    ov, spans = None, None
    if args.overlap_steps > 0:   # (the same on every rank: the gather below is collective)
        with METER.paused():
            ov, spans = profile_steps(strat, [run.batch(after + i)
                                              for i in range(args.overlap_steps)], run.env.device)
    mem = measure_memory(run, strat)
    step_t, fwd_t = max_over_ranks(step_t), max_over_ranks(fwd_t)
    comm_sum = {}
    for c in gather_objects(comm):
        for k, (calls, nbytes) in c.items():
            a = comm_sum.setdefault(k, [0.0, 0.0])
            a[0] += calls
            a[1] += nbytes
    return dict(step_s=step_t, forward_s=fwd_t, tokens_per_s=args.batch * args.length / step_t,
                comm=comm, comm_sum={k: tuple(v) for k, v in comm_sum.items()},
                # a key whose totals are not a multiple of the step count varied between steps
                comm_varied=[k for k, (c, b) in raw_counts.items()
                             if c % args.bench_iters or b % args.bench_iters],
                memory=gather_objects(mem),
                overlap=gather_objects(ov) if ov is not None else None, spans=spans)


def overlap_share(r: dict) -> float | None:
    """The hidden share over all ranks: hidden seconds / communication seconds, summed (None:
    no communication, or not measured)."""
    if r["overlap"] is None:
        return None
    comm = sum(o["comm_s"] for o in r["overlap"])
    return sum(o["hidden_s"] for o in r["overlap"]) / comm if comm else None


def _step_seconds(run: Run, strat, batch) -> float:
    env = run.env
    cuda = env.device.type == "cuda"
    sync(env)
    start = mark(cuda)
    strat.step(batch)
    end = mark(cuda)
    sync(env)
    return seconds_between(start, end)


def paired_ratios(run: Run, cls, names: list) -> dict:
    """Step-time ratios measured interleaved: ours and every baseline (and the single-device
    reference, on rank 0 while the others wait) built side by side, then --paired rounds of one
    step each, ranks aligned by a barrier before every step; a step's time is the max over
    ranks. The order inside a round alternates (ours first in even rounds, last in odd ones:
    A B, B A, ...), so neither side always runs on the caches and allocator state the other
    left. Returns {baseline name: dict(ratios=sorted ours/theirs, one per round, ours_s=...,
    theirs_s=... the per-round step seconds)}. Interleaving shares every drift of the machine
    (other load, clocks, caches) between the two sides of each ratio, where timing one
    implementation after the other does not."""
    args, env = run.args, run.env

    def barrier():
        with METER.paused():
            dist.barrier()
    sides = [make_pair(run, c, perturb=False, with_ref=False)[1]
             for c in [cls] + natives(cls, args)]
    ref = (reference_class(cls)(build_model(args, run.config, env.device), args, env)
           if env.is_main else None)
    for s in range(args.warmup):
        for k, strat in enumerate(sides):
            with planting(None) if k else nullcontext():
                strat.step(run.batch(s))
        if ref is not None:
            ref.step(run.batch(s))
    times = [[] for _ in sides]
    ref_times = []
    slots = list(range(len(sides))) + [None]   # None: the reference, on rank 0 only
    with METER.paused():
        for i in range(args.paired):
            batch = run.batch(args.warmup + i)
            for k in (slots if i % 2 == 0 else slots[::-1]):
                barrier()
                if k is not None:
                    with planting(None) if k else nullcontext():   # a plant is ours only
                        times[k].append(_step_seconds(run, sides[k], batch))
                elif ref is not None:
                    ref_times.append(_step_seconds(run, ref, batch))
    ranks = gather_objects(times)
    times = [[max(r[k][i] for r in ranks) for i in range(args.paired)] for k in range(len(sides))]
    theirs = dict(zip(names, times[1:]))
    if env.is_main:
        theirs["single device"] = ref_times
    out = {n: dict(ratios=sorted(o / t for o, t in zip(times[0], ts)), ours_s=times[0],
                   theirs_s=ts) for n, ts in theirs.items()}
    del sides, ref
    return out


def _no_spans(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "spans"}


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
    for ncls in (natives(cls, args) if args.compare_native else []):
        with planting(None):   # PyTorch's own runs without our planted bug
            _, nat, _ = make_pair(run, ncls, perturb=False, with_ref=False)
            native.append((nat.name, bench_strategy(run, nat)))
        del nat
    paired = paired_ratios(run, cls, [n for n, _ in native]) if args.paired else {}
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
                               formula, lines, paired)
    return broadcast_verdict(ok)


def _bench_single(run: Run, strat) -> dict:
    """bench_strategy for one process, without collectives."""
    step_t, fwd_t = timed_steps(run, strat)
    return dict(step_s=step_t, forward_s=fwd_t,
                tokens_per_s=run.args.batch * run.args.length / step_t,
                memory=[measure_memory(run, strat)])


def _report_benchmark(run, name, cls, n_params, ours, native, ref, expected, setup, formula,
                      lines, paired) -> bool:
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
        run.print(f"step time ours / {native[0][0]}: {ours['step_s'] / native[0][1]['step_s']:.3f}"
                  + ("" if paired else " (timed one after the other: --paired N interleaves)"))
    ratios = {}
    for base, pr in paired.items():
        xs = pr["ratios"]
        ratios[base] = dict(median=quantile(xs, 0.5), p10=quantile(xs, 0.1),
                            p90=quantile(xs, 0.9), n=len(xs),
                            ours_ms=1e3 * quantile(sorted(pr["ours_s"]), 0.5),
                            theirs_ms=1e3 * quantile(sorted(pr["theirs_s"]), 0.5))
        run.print(f"step time ours / {base}, {len(xs)} interleaved pairs (order alternating): "
                  f"median {ratios[base]['median']:.3f} (p10 {ratios[base]['p10']:.3f}, "
                  f"p90 {ratios[base]['p90']:.3f}); median steps {ratios[base]['ours_ms']:.1f} "
                  f"/ {ratios[base]['theirs_ms']:.1f} ms")
    for label, r in rows[1:]:
        if r["overlap"] is None:
            run.print(f"overlap {label}: not measured (--overlap-steps 0)")
            continue
        share = overlap_share(r)
        o = r["overlap"][0]
        run.print(f"overlap {label}: " + ("no communication in the step" if share is None else
                  f"{share:.0%} of communication time hidden behind compute (all ranks; rank 0: "
                  f"comm {o['comm_s'] * 1e3:.1f} ms, exposed {o['exposed_s'] * 1e3:.1f} ms; "
                  f"the median of {args.overlap_steps} profiled steps)"))
    if args.out and all(r["spans"] is not None for _, r in rows[1:]):
        path = plot_overlap([(label.split()[0], r["spans"]) for label, r in rows[1:]],
                            os.path.join(args.out, "overlap.png"),
                            f"{name} W={env.world} {args.dtype}: rank 0's step, communication "
                            f"vs compute")
        if path:
            run.print(f"overlap timeline: {path}")
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
        P = METER.sizes.get(key[1], W)   # the group's ranks (node, replicate, tp, ...)
        wire = nbytes * RING_FACTOR.get(key[0], lambda w: 1.0)(P) / (W if summed else 1)
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
        ours=jsonable(_no_spans(ours)), native={n: jsonable(_no_spans(r)) for n, r in native},
        reference=jsonable(ref),
        expected=[e.__dict__ for e in expected], setup=jsonable({"comm": setup})["comm"],
        memory_formula=formula, comm_ok=comm_ok, group_sizes=dict(METER.sizes),
        overlap_share=overlap_share(ours), paired=ratios)
    write_json(run, "benchmark.json", run.results["benchmark"])
    run.print(("PASS " if comm_ok else "FAIL ") + f"{name} W={W} benchmark: "
              f"{ours['tokens_per_s']:.0f} tokens/s, communication "
              f"{'matches' if comm_ok else 'DIFFERS FROM'} the formulas")
    return comm_ok


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
    mems = gather_objects(mem)
    run.print("TRIAL OK " + json.dumps(dict(
        strategy=strat.name, world=env.world, length=args.length, batch=args.batch,
        dtype=args.dtype, device=env.device.type, peak=max(m["peak"] for m in mems),
        source=mem["peak_source"], ranks=mems)))
    return True
