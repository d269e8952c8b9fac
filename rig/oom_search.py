"""The command line of oom_search.py (`python oom_search.py --strategy tp --nproc 2 ...`): the
arguments, the search per strategy and world size, the --compare report. The search, the trial,
the prediction and the simulation are oom_search.py's."""
from __future__ import annotations

import argparse
import json
import sys

import oom_search
from oom_search import (CHUNKED_CE, HERE, STRATEGIES, predict_max, predict_peak, run_trial,
                        search, simulated_trial)


def parse(argv=None):
    p = argparse.ArgumentParser(description=oom_search.__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--strategy", default="all",
                   help="comma list of %s, or all" % ", ".join(STRATEGIES))
    p.add_argument("--nproc", default="1,2", help="comma list of world sizes")
    p.add_argument("--search", default="length", choices=["length", "micro-batch"])
    p.add_argument("--lo", type=int, default=None, help="default: --step")
    p.add_argument("--hi", type=int, default=None, help="default: double from lo until a failure")
    p.add_argument("--step", type=int, default=None, help="grid (default 256 for length, 1 for "
                   "micro-batch)")
    p.add_argument("--length", type=int, default=256, help="fixed length for --search micro-batch")
    p.add_argument("--batch", type=int, default=1,
                   help="sequences per model replica (fixed for --search length)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None, choices=["cpu", "cuda"])
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--mem-budget-gb", type=float, default=None,
                   help="CPU: simulated OOM above this many GiB of live tensors per rank")
    p.add_argument("--mem-fraction", type=float, default=None,
                   help="CUDA: fraction of the GPU's memory each process may use")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per trial")
    p.add_argument("--retries", type=int, default=1, help="re-runs of a crashed/timed-out trial")
    p.add_argument("--predict", action="store_true", help="print the analytic estimate beside it")
    p.add_argument("--ce-chunk", type=int, default=0,
                   help="the trials' --ce-chunk (ddp and tp): the loss N tokens of logits at a "
                        "time, and the prediction's logits term follows it")
    p.add_argument("--lora", type=int, default=0, metavar="R", help="LoRA adapters of rank R "
                   "on every projection, the rest frozen (0: full training)")
    p.add_argument("--fp8", default=None, choices=["tensorwise", "rowwise"],
                   help="the trials train the decoder linears in FP8 (fp8.py); the prediction "
                        "adds one cast's workspace (blockwise: emulated in fp32, not searched)")
    p.add_argument("--simulate", action="store_true",
                   help="no real trials: each one is the real step under FakeTensorMode as rank 0 "
                        "of a fake world of N (any model size, on a laptop)")
    p.add_argument("--compare", action="store_true",
                   help="no search: at --length and --batch, the peak measured by a real trial "
                        "beside the predicted and the simulated peak")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    a = p.parse_args(argv)
    names = list(STRATEGIES) if a.strategy == "all" else a.strategy.split(",")
    bad = [n for n in names if n not in STRATEGIES]
    if bad:
        p.exit(2, f"error: unknown strategy {bad[0]} (choose from {', '.join(STRATEGIES)})\n")
    a.strategies = names
    if a.ce_chunk < 0 or (a.ce_chunk and set(names) - CHUNKED_CE):
        p.exit(2, f"error: --ce-chunk {a.ce_chunk}: >= 0, and for the strategies that chunk "
                  f"their loss ({', '.join(sorted(CHUNKED_CE))})\n")
    if a.lora < 0:
        p.exit(2, f"error: --lora {a.lora}: the adapters' rank must be >= 1 (0: no LoRA)\n")
    a.worlds = [int(x) for x in a.nproc.split(",")]
    if a.step is None:
        a.step = 256 if a.search == "length" else 1
    if a.lo is None:
        a.lo = a.step
    if a.lo < 1 or a.step < 1 or (a.hi is not None and a.hi < a.lo):
        p.exit(2, "error: need 1 <= --lo <= --hi and --step >= 1\n")
    if (a.device != "cuda" or a.simulate) and not a.mem_budget_gb and not a.compare:
        p.exit(2, "error: on CPU --mem-budget-gb is required (the OOM is simulated against it)\n")
    return a


def compare(args, cfg, elem, log) -> int:
    """Measured vs predicted vs simulated peak at one length: how far each estimate can be
    trusted (the README's agreement table comes from this)."""
    rows = []
    for name in args.strategies:
        for W in args.worlds:
            o = run_trial(name, W, args.length, args.batch, args)
            pred = predict_peak(name, W, args.length, args.batch, cfg, elem,
                                args.attn == "eager", args.ce_chunk, args.lora, args.fp8)["peak"]
            sim = simulated_trial(name, W, args.length, args.batch, args, float("inf"))
            rows.append(dict(strategy=name, world=W, measured=o.peak, measured_kind=o.kind,
                             predicted=pred, simulated=sim.peak, simulated_note=sim.detail))
            log(f"{name} W={W}: measured {o.kind} {o.peak}, predicted {pred}, simulated "
                f"{sim.peak or sim.detail}")
    if args.json:
        print(json.dumps(dict(model=args.model, length=args.length, batch=args.batch,
                              results=rows), indent=1))
        return 0
    mib = lambda v: f"{v / 2**20:,.1f}" if v else "-"  # noqa: E731
    ratio = lambda v, m: f"{v / m:.3f}" if v and m else "-"  # noqa: E731
    print(f"\n{args.model}, length {args.length}, batch {args.batch} per replica; peak MiB of "
          f"rank 0 (CPU: live-tensor tracker)")
    print(f"{'strategy':<10}{'W':>3}{'measured':>10}{'predicted':>11}{'ratio':>7}"
          f"{'simulated':>11}{'ratio':>7}")
    for r in rows:
        m = r["measured"]
        print(f"{r['strategy']:<10}{r['world']:>3}{mib(m):>10}{mib(r['predicted']):>11}"
              f"{ratio(r['predicted'], m):>7}{mib(r['simulated']):>11}"
              f"{ratio(r['simulated'], m):>7}")
    return 0


def main(argv=None):
    args = parse(argv)
    sys.path.insert(0, HERE)
    from harness import DTYPES, load_config
    cfg = load_config(args.model)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    elem = DTYPES[dtype].itemsize
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else \
        (lambda m: print(m, flush=True))
    if args.compare:
        return compare(args, cfg, elem, log)
    budget = (args.mem_budget_gb or 0) * 2**30
    what = "length" if args.search == "length" else "micro-batch"
    if args.simulate:
        oom_kind = f"simulated: FakeTensorMode peak of rank 0 over {args.mem_budget_gb:g} GiB"
    elif args.device == "cuda":
        oom_kind = "CUDA OOM" + (f" at memory fraction {args.mem_fraction}"
                                 if args.mem_fraction else "")
    else:
        oom_kind = (f"simulated OOM: CPU live-tensor tracker over {args.mem_budget_gb:g} GiB "
                    "per rank")
    log(f"oom_search: max {what} per strategy and world size, model {args.model}, "
        f"{'length %d' % args.length if what == 'micro-batch' else 'batch %d per replica' % args.batch}"
        f", {oom_kind}")
    rows = []
    for name in args.strategies:
        for W in args.worlds:
            log(f"{name} W={W}:")

            def trial(x, name=name, W=W):
                L, b = (x, args.batch) if what == "length" else (args.length, x)
                if args.simulate:
                    return simulated_trial(name, W, L, b, args, budget)
                return run_trial(name, W, L, b, args)
            r = search(trial, args.lo, args.hi, args.step, 0 if args.simulate else args.retries,
                       log)
            row = dict(strategy=name, world=W, max=r.best, peak_at_max=r.best_peak,
                       failed_at=r.failed_at, stopped=r.stopped,
                       trials=[(x, o.kind, o.peak, round(o.seconds, 1)) for x, o in r.trials])
            if args.predict:
                if what == "length":
                    row["predicted_max"] = predict_max(
                        name, W, args.batch, cfg, budget, args.lo, args.hi, args.step, elem,
                        args.attn == "eager", args.ce_chunk, args.lora, args.fp8)
                if r.best:
                    L, b = (r.best, args.batch) if what == "length" else (args.length, r.best)
                    row["predicted_peak_at_max"] = predict_peak(
                        name, W, L, b, cfg, elem, args.attn == "eager", args.ce_chunk,
                        args.lora, args.fp8)["peak"]
            rows.append(row)
    if args.json:
        print(json.dumps(dict(model=args.model, search=what, budget_gb=args.mem_budget_gb,
                              oom=oom_kind, results=rows), indent=1))
        return 0
    mib = lambda v: f"{v / 2**20:,.1f}" if v else "-"  # noqa: E731
    print(f"\n{'strategy':<10}{'W':>3}{'max ' + what:>18}{'predicted max':>15}"
          f"{'peak at max MiB':>17}{'predicted MiB':>15}  note")
    for r in rows:
        print(f"{r['strategy']:<10}{r['world']:>3}{str(r['max'] or '-'):>18}"
              f"{str(r.get('predicted_max') or '-'):>15}{mib(r['peak_at_max']):>17}"
              f"{mib(r.get('predicted_peak_at_max')):>15}  {r['stopped']}")
    print(f"({oom_kind})")
    return 0
