"""docs.py: every measured figure the docs quote comes from a file under results/, through here.

    python scripts/docs.py             # check: each quoted figure against its source (exit 1 if any differs)
    python scripts/docs.py --write     # rewrite every quoted figure and table from its source

README.md and docs/*.md quote a measured figure in one of two forms, both HTML comments that a
Markdown viewer does not show:

    ddp takes <!--fig results/bench-cpu.json [strategy=ddp,world=2,baseline=torch-ddp].ours_ms ,.0f-->749<!--/fig--> ms

    <!--table bench-->
    | strategy | baseline | ... |        (rendered by TABLES["bench"] from results/bench-cpu.json)
    <!--/table-->

A figure's path walks the JSON: a key, a list index, or `[k=v,...]`, the one list element whose
fields equal those values (exactly one must match; a space in a value is written %20). A figure that a formula gives (an exact
byte count, which the strategy's benchmark test asserts against the same formula) names `=` as
its source and the formula's instance as its path, without spaces:

    <!--fig = 18*131072+3*2048 ,-->2,365,440<!--/fig--> B
    <!--fig = 4*PSI_TINY ,-->723,200<!--/fig--> B       (Ψ counted from the tiny preset's model)
 Its format is a Python format spec, optionally
followed by a scale: `/MiB` or `/GiB` (bytes), `/1e12` (FLOPs as TFLOP), `*100` (a share as a percentage). So a figure
cannot drift from its results file: editing one by hand, or rerunning a benchmark without
`--write`, fails tests/test_docs.py.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from urllib.parse import unquote

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIG = re.compile(r"<!--fig (\S+) (\S+) (\S+?)-->(.*?)<!--/fig-->", re.S)
TABLE = re.compile(r"(<!--table (\S+)-->\n)(.*?)(<!--/table-->)", re.S)
SCALES = {"/MiB": 1 / 2**20, "/GiB": 1 / 2**30, "/1e12": 1e-12, "*100": 100.0, "": 1.0}


def pages() -> list[str]:
    return [os.path.join(HERE, "README.md")] + sorted(glob.glob(os.path.join(HERE, "docs", "*.md")))


def load(path: str):
    with open(os.path.join(HERE, path)) as f:
        return json.load(f)


def walk(data, path: str):
    """The value at `path` (the module docstring's syntax)."""
    for step in re.findall(r"\[[^\]]*\]|[^.\[\]]+", path):
        if step.startswith("["):
            want = {k: unquote(v) for k, v in (kv.split("=", 1) for kv in step[1:-1].split(","))}
            hits = [x for x in data if all(str(x.get(k)) == v for k, v in want.items())]
            if len(hits) != 1:
                raise KeyError(f"{step} matches {len(hits)} elements, not one")
            data = hits[0]
        elif isinstance(data, list):
            data = data[int(step)]
        else:
            data = data[step]
    return data


def model_sizes() -> dict[str, int]:
    """The parameter counts a formula may name, counted from the presets' models (meta device),
    so that a formula's Ψ follows the code: PSI_TINY, PSI_SMALL, PSI_TINY_MOE and its dense and
    expert parts (PSI_TINY_MOE_DENSE, PSI_TINY_MOE_EXPERTS)."""
    import torch
    from transformers import AutoModelForCausalLM
    sys.path.insert(0, HERE)
    from harness import load_config
    from ep_moe import is_expert
    out = {}
    for preset in ("tiny", "small", "tiny-moe"):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(load_config(preset))
        key = "PSI_" + preset.upper().replace("-", "_")
        named = dict(model.named_parameters())
        out[key] = sum(p.numel() for p in named.values())
        if preset == "tiny-moe":
            out[key + "_EXPERTS"] = sum(p.numel() for n, p in named.items() if is_expert(n))
            out[key + "_DENSE"] = out[key] - out[key + "_EXPERTS"]
    return out


_SIZES: dict = {}


def formula(expr: str):
    """An arithmetic expression: numbers, the names of model_sizes(), + - * / // ** % and
    parentheses, nothing else."""
    if not re.fullmatch(r"[0-9eE.+\-*/%() A-Z_]+", expr):
        raise ValueError(f"not an arithmetic expression: {expr}")
    names = set(re.findall(r"\b[A-Z][A-Z_]+\b", expr))
    if names and not _SIZES:
        _SIZES.update(model_sizes())
    if names - set(_SIZES):
        raise ValueError(f"unknown names {sorted(names - set(_SIZES))} (known: {sorted(_SIZES)})")
    return eval(expr, {"__builtins__": {}}, dict(_SIZES))   # noqa: S307 (arithmetic only)


def render_figure(source: str, path: str, fmt: str) -> str:
    scale = next((s for s in SCALES if s and fmt.endswith(s)), "")
    value = formula(path) if source == "=" else walk(load(source), path)
    if scale:
        value = value * SCALES[scale]
    return format(value, fmt[:len(fmt) - len(scale)])


# -- tables -------------------------------------------------------------------------------------
def _bench():
    sys.path.insert(0, os.path.join(HERE, "scripts"))
    import bench
    return bench.wide_table(load("results/bench-cpu.json"))


def _tour(excerpt: bool = False):
    """The tour's summary (results/tour-cpu.json); excerpt: the first entry of each family."""
    d = load("results/tour-cpu.json")
    hdr = ["strategy", "W", "dtype", "grads+params", "max rel err", "worst err/tol", "result"]
    rows, seen = [], set()
    for r in d["rows"]:
        family = r["strategy"].split()[0].rstrip("123")
        if excerpt and family in seen:
            continue
        seen.add(family)
        rows.append([r["strategy"], r["world"], r["dtype"], r["compared"], r["max_rel_err"],
                     r["worst_ratio"], r["result"]])
    widths = [max(len(str(x)) for x in col) for col in zip(hdr, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip()
             for row in [hdr] + rows]
    more = f"... {len(d['rows']) - len(rows)} more entries\n" if excerpt else ""
    return ("```\n" + "\n".join(lines) + f"\n{more}{d['passed']} passed, {d['failed']} failed"
            "\n```")


def _load_memory():
    d = load("results/load-memory-float64-cpu.json")
    by = {}
    for r in d["rows"]:
        by.setdefault(r["world"], {})[r["load"]] = r["ranks"]
    lines = ["| W (pp) | model | held by the largest stage | `--load shards`: during the load / "
             "whole build | `--load full`: during the load / whole build |", "|---|---|---|---|---|"]

    def span(ranks, key):
        lo, hi = (f"+{v:,.0f}" for v in (min(x[key] for x in ranks), max(x[key] for x in ranks)))
        return lo if lo == hi else f"{lo} to {hi}"

    for w, loads in sorted(by.items()):
        s, f = loads["shards"], loads["full"]
        lines.append(f"| {w} | {s[0]['model_mib']:,.0f} MiB | "
                     f"{max(x['held_mib'] for x in s):,.0f} MiB | "
                     f"{span(s, 'load_growth_mib')} / {span(s, 'build_growth_mib')} MiB | "
                     f"{span(f, 'load_growth_mib')} / {span(f, 'build_growth_mib')} MiB |")
    return "\n".join(lines)


def _recompute():
    d = load("results/recompute-small-cpu.json")
    lines = ["| attention | mode | per layer, measured = formula | whole model's activation peak "
             "| step time (median) | extra time: median of paired rounds (p10 to p90) |",
             "|---|---|---|---|---|---|"]
    for r in d["rows"]:
        x = r["extra"]
        extra = "-" if x is None else f"{x['median']:+.0%} ({x['p10']:+.0%} to {x['p90']:+.0%})"
        lines.append(f"| {r['attn']} | {r['mode']} | {int(r['measured_bytes_per_layer']):,} B | "
                     f"{r['whole_model_bytes'] / 2**20:,.0f} MiB | {r['step_ms']:,.0f} ms | "
                     f"{extra} |")
    return "\n".join(lines)


def _oracles():
    d = load("results/library-oracles-cpu.json")
    worlds = sorted({r["world"] for r in d["rows"]})
    cases = {}
    for r in d["rows"]:
        cases.setdefault(r["case"], {})[r["world"]] = r["value"]
    lines = ["| case (ours vs the oracle; a control must differ) | " +
             " | ".join(f"W={w}" for w in worlds) + " |", "|---|" + "---|" * len(worlds)]
    for case, by in cases.items():
        lines.append(f"| {case} | " + " | ".join(by.get(w, "-") for w in worlds) + " |")
    return "\n".join(lines)


def _plan():
    with open(os.path.join(HERE, "results", "elastic-plan-5b.txt")) as f:
        text = "".join(line for line in f if not line.startswith("#"))   # the command line
    return "```\n" + text.rstrip("\n") + "\n```"


TABLES = {"bench": _bench, "tour": _tour, "tour-excerpt": lambda: _tour(excerpt=True),
          "load-memory": _load_memory, "recompute": _recompute, "oracles": _oracles,
          "elastic-plan": _plan}


# -- docs/correctness.md, docs/testing.md (planted bugs from the code; the realistic checkpoint) --
def _plant_groups():
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    try:
        import tour
        return tour.plant_groups()   # (script, world, args, [names]) from each strategy's `plants`
    except ImportError as e:          # a strategy file that does not import: one problem line
        raise ValueError(f"tour.plant_groups(): {e}") from e


def _plants():
    groups = _plant_groups()
    lines = ["| script | W | configuration | planted bugs (`--plant-bug NAME`) |", "|---|---|---|---|"]
    for script, world, args, names in groups:
        conf = " ".join(a.replace("configs/", "") for a in args) or "(defaults)"
        lines.append(f"| `{script}` | {world} | `{conf}` | " + ", ".join(f"`{n}`" for n in names)
                     + " |")
    return "\n".join(lines) + "\n\n" + _plant_count()


def _plant_count():
    groups = _plant_groups()
    return (f"{sum(len(g[3]) for g in groups)} planted bugs in {len(groups)} configurations "
            f"({len({g[0] for g in groups})} strategy files).")


def _realistic():
    d = load("results/realistic-cpu.json")
    keys = ("grad_err", "grad_noise", "param_err", "param_noise", "loss_err", "loss_noise")
    lines = ["| strategy | W | dtype | grad err | grad noise | param err | param noise | loss err "
             "| loss noise | worst err/tol | verdict |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        lines.append(f"| {r['strategy']} | {r['world']} | {r['dtype']} | "
                     + " | ".join(f"{r[k]:.1e}" for k in keys)
                     + f" | {r['worst_ratio']:.2f} | {r['verdict']} |")

    def span(kind):
        xs = [r[f"{kind}_err"] / r[f"{kind}_noise"] for r in d["rows"] if r[f"{kind}_err"] > 0]
        return f"{min(xs):.2g} to {max(xs):.2g}"

    eps = {"float64": 2.0 ** -52, "float32": 2.0 ** -23}
    ulps = ", ".join(f"{dt} {max(r['loss_err'] for r in d['rows'] if r['dtype'] == dt) / e:.1f}"
                     for dt, e in eps.items())
    worst = max(d["rows"], key=lambda r: r["worst_ratio"])
    lines += ["", f"Largest error / largest noise: gradients {span('grad')}, parameters "
              f"{span('param')}, loss {span('loss')}. The largest loss error in units of "
              f"roundoff: {ulps}. Worst row: {worst['worst_ratio']:.2f} of its tolerance "
              f"({worst['strategy']}, W={worst['world']}, {worst['dtype']})."]
    return "\n".join(lines)


def _calibration():
    d = load("results/verdict-calibration-cpu.json")
    m = d["machine"]
    lines = ["| strategy | W | float64 runs / fails / max err/tol | float32 | bfloat16 |",
             "|---|---|---|---|---|"]
    cells = {(r["strategy"], r["world"], r["dtype"]): r for r in d["rows"]}
    for key, world in dict.fromkeys((r["strategy"], r["world"]) for r in d["rows"]):
        lines.append(f"| {key} | {world} | " + " | ".join(
            f"{c['runs']} / {c['fails']} / {c['max_ratio']:.2f}" if c else "-"
            for c in (cells.get((key, world, dt)) for dt in ("float64", "float32", "bfloat16")))
            + " |")
    s = d["separation"]
    refused = "; ".join(f"{r['strategy']} W={r['world']}: {r['reason']}" for r in d["refused"])
    other = "; ".join(f"{p['script']} {p['plant']}: {p['caught_by']}" for p in d["plants"]
                      if p["plant"] and not p["ok"] and p["caught_by"] != "err/tol")
    lines += ["", f"Machine: {m['model_name']}, family {m['family']} model {m['model']}, "
              f"AVX-512 {'yes' if m['avx512'] else 'no'}, {m['cores']} cores, torch {m['torch']}; "
              f"{d['seconds'] / 60:.0f} min. Runs {sum(r['runs'] for r in d['rows'])}, fails "
              f"{sum(r['fails'] for r in d['rows'])}. **Margin**: the largest err/tol of a correct "
              f"run is {s['correct_max_ratio']:.2f}. **Separation**: of {s['plants']} planted-bug "
              f"runs, {s['caught_on_tensor']} FAIL on a tensor, the closest at err/tol "
              f"{s['plant_min_ratio']:.3g} ({s['plant_min']}), {s['caught_by_check']} on another "
              f"check ({other}), {s['missed']} missed; the plants' clean runs: "
              f"{s['clean_fails']} fails."
              + (f" Not taken at W=3: {refused}." if refused else "")]
    return "\n".join(lines)


TABLES.update({"plants": _plants, "plant-count": _plant_count, "realistic": _realistic,
               "calibration": _calibration})


# -- docs/benchmarks.md: communication and memory per strategy (results/strategies-cpu.json) ------
# per-rank wire bytes: a ring all-reduce sends 2(W-1)/W of its buffer, the other ops (W-1)/W
STRATEGY_COMM = {
    "ddp": "all-reduce 2(W−1)/W·Ψb",
    "zero-1": "reduce-scatter + all-gather, (W−1)/W·Ψb each",
    "zero-2": "reduce-scatter + all-gather, (W−1)/W·Ψb each",
    "zero-3": "all-gather twice (forward, backward) + reduce-scatter: 3(W−1)/W·Ψb",
    "fsdp": "(3Ψ−Ψ_root)(W−1)/W·b: the root unit stays gathered",
    "tp": "all-reduce 2(W−1)/W·((4L+2)·N·H·b + 3·N·b)",
    "sp megatron": "all-gather (6L+3), reduce-scatter (4L+1), (W−1)/W·N·H·b each; "
                   "all-reduce N·H·b + 3·N·b + Ψ_norm·b",
    "sp ulysses": "all-to-all (W−1)/W·2L(2H+2H_kv)·N/W·b; all-reduce 2(W−1)/W·Ψb",
    "cp zigzag": "ring (6W−4)·L·N/W·H_kv·b; all-reduce 2(W−1)/W·Ψb",
    "pp 1f1b": "activations or their gradients across one boundary: N·H·b",
}
OPS = {"all_reduce": "all-reduce", "all_gather_into_tensor": "all-gather",
       "reduce_scatter_tensor": "reduce-scatter", "all_to_all_single": "all-to-all",
       "isend": "send"}


def _strategies_comm():
    d = load("results/strategies-cpu.json")
    lines = ["| strategy | sent per rank per step | total | formula |", "|---|---|---|---|"]
    for r in d["rows"]:
        ops = ", ".join(f"{OPS.get(op, op)} {v / 2**20:,.1f}"
                        for op, v in sorted(r["wire"].items()))
        lines.append(f"| {r['label']} | {ops} MiB | {sum(r['wire'].values()) / 2**20:,.1f} MiB | "
                     f"{STRATEGY_COMM.get(r['label'], '')} |")
    return "\n".join(lines)


def _strategies_memory():
    d = load("results/strategies-cpu.json")
    keys = ("params", "grads", "optimizer")
    lines = ["| strategy | params | grads | optimizer | model states | activations | peak |",
             "|---|---|---|---|---|---|---|"]
    rows = [(r["label"], r["memory"]) for r in d["rows"]]
    rows.append(("single device (whole batch)", d["rows"][0]["reference_memory"]))
    for label, m in rows:
        mib = [m[k] / 2**20 for k in keys]
        lines.append(f"| {label} | " + " | ".join(f"{v:,.1f}" for v in mib)
                     + f" | {sum(mib):,.1f} | {m['activations'] / 2**20:,.1f} | "
                       f"{m['peak'] / 2**20:,.1f} |")
    return "\n".join(lines)


# -- docs/gpu.md: the raw runs under results/gpu/ -------------------------------------------------
def _gpu_file(path):
    with open(os.path.join(HERE, "results", "gpu", path)) as f:
        return f.read()


def _gpu_w1():
    """Per script: its PASS lines out of its verdicts, and the bf16 learning run's distance from
    the reference, in the first run (summary.json) and after the fixes (the logs)."""
    first = load("results/gpu/w1-first/summary.json")
    diff = re.compile(r"max rel diff vs reference (\S+) \(tol (\S+)\)")
    tol = next(m.group(2) for r in first.values() for v in r.get("verdicts", [])
               for m in [diff.search(v)] if m)
    lines = [f"| script | first run | after the fixes | bf16 learning, max relative difference "
             f"from the reference (tolerance {tol}): first / after |", "|---|---|---|---|"]

    def summary(vs):
        fails = [v.split(":")[0].split(" W=1 ")[-1] + (" learning" if diff.search(v) else "")
                 for v in vs if v.startswith("FAIL")]
        return f"{len(vs) - len(fails)}/{len(vs)} PASS" + "".join(f"; FAIL {f}" for f in fails)

    def learned(vs):
        return next((m.group(1) for v in vs for m in [diff.search(v)] if m), "")

    for label, r in first.items():
        then = [v for v in r.get("verdicts", []) if v.startswith(("PASS", "FAIL"))]
        path = os.path.join(HERE, "results", "gpu", "w1-after-fixes", f"{label}.log")
        now = None
        if os.path.exists(path):
            with open(path) as f:
                now = [ln.strip() for ln in f if ln.startswith(("PASS", "FAIL"))]
        a = summary(then) if then else ("exit 0" if r["rc"] == 0 else f"exit {r['rc']}")
        b = summary(now) if now else "not run again"
        c = " / ".join(x for x in (learned(then), learned(now or [])) if x) or "-"
        lines.append(f"| {label} | {a} | {b} | {c} |")
    return "\n".join(lines)


def _gpu_perf():
    lines = ["| run | tokens/step | S | step ms | tokens/s | MFU | peak memory |",
             "|---|---|---|---|---|---|---|"]
    for path in ("perf-16k-tokens/perf.json", "perf-8k-tokens/perf.json"):
        for r in load(f"results/gpu/{path}"):
            lines.append(f"| reference (HF model + AdamW, fp32 masters) | "
                         f"{r['batch'] * r['length']:,} | {r['length']} | "
                         f"{r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
                         f"{r['max_memory_gib']:.1f} GiB |")
    tail = load("results/gpu/perf-8k-tokens/perf.json")[0]["compose4d_log_tail"]
    head = next(ln for ln in tail if ln.startswith("benchmark:"))
    batch, length = (int(re.search(rf"{k}=(\d+)", head).group(1)) for k in ("batch", "length"))
    ref = next(ln for ln in tail if ln.startswith("single device (ref)")).split()
    ours = next(ln for ln in tail if "(ours)" in ln).split(")")[-1].split()
    mfu = re.search(r"MFU ([\d.]+%)", next(ln for ln in tail if "MFU" in ln)).group(1)
    lines.append(f"| compose4d W=1, benchmark mode (its reference beside it: {ref[3]} ms, "
                 f"{ours[5].rstrip('x')}× its step time) | {batch * length:,} | {length} | "
                 f"{ours[0]} | {int(ours[2]):,} | {mfu} | {float(ours[3]):.1f} {ours[4]} |")
    return "\n".join(lines)


GPU_KERNELS = [("GEMM (nvjet)", ("nvjet",)), ("flash attention (cuDNN)", ("sdpa",)),
               ("copies", ("direct_cop", "bfloat16_copy", "::bfloa")),
               ("cross-entropy softmax", ("SoftMax",)), ("AdamW (multi-tensor)", ("multi_tensor",))]


def _gpu_kernels():
    lines = ["| run | " + " | ".join(k for k, _ in GPU_KERNELS) + " | rest of the top 15 |",
             "|---|" + "---|" * (len(GPU_KERNELS) + 1)]
    for tokens in ("16k", "8k"):
        r = load(f"results/gpu/perf-{tokens}-tokens/perf.json")[0]
        for s in (2048, 4096):
            rows = [ln for ln in _gpu_file(f"perf-{tokens}-tokens/profile-{s}.txt").splitlines()
                    if re.search(r"\d%\s", ln) and not ln.startswith(("Self", "-"))]
            share = {k: 0.0 for k, _ in GPU_KERNELS}
            rest = 0.0
            for ln in rows:
                pct = float(re.findall(r"([\d.]+)%", ln)[2])   # the third %: Self CUDA %
                kind = next((k for k, keys in GPU_KERNELS if any(x in ln for x in keys)), None)
                if kind:
                    share[kind] += pct
                else:
                    rest += pct
            lines.append(f"| {r['batch'] * r['length']:,} tokens, S={s} | "
                         + " | ".join(f"{share[k]:.1f}%" if share[k] else "-"
                                      for k, _ in GPU_KERNELS)
                         + f" | {rest:.1f}% |")
    return "\n".join(lines)


def _predict():
    sys.path.insert(0, HERE)
    import oom_search
    from harness import load_config
    return oom_search, load_config


def _gpu_oom_tp():
    oom_search, load_config = _predict()
    cfg = load_config("llama3.2-1b")
    text = _gpu_file("oom_search-tp-w1.txt").split("\nsp W=1")[0]
    trials = sorted((int(n), kind, rest) for n, kind, rest in
                    re.findall(r"^\s+(\d+): (OK|OOM)(.*)$", text, re.M))
    lines = ["| length | measured peak | predicted (`predict_peak`) | predicted / measured |",
             "|---|---|---|---|"]
    for n, kind, rest in trials:
        pred = oom_search.predict_peak("tp", 1, n, 1, cfg, 2)["peak"] / 2**20
        if kind == "OK":
            got = float(re.search(r"peak ([\d,.]+) MiB", rest).group(1).replace(",", ""))
            lines.append(f"| {n:,} | {got:,.0f} MiB (OK) | {pred:,.0f} MiB | {pred / got:.4f} |")
        else:
            m = re.search(r"Tried to allocate ([\d.]+ GiB).*?of which ([\d.]+ [GM]iB) is free",
                          rest)
            lines.append(f"| {n:,} | CUDA OOM (asked for {m.group(1)}, {m.group(2)} free) | "
                         f"{pred:,.0f} MiB | |")
    card = float(re.search(r"total capacity of ([\d.]+) GiB", text).group(1))
    fits = max(n for n, kind, _ in trials if kind == "OK")
    first_oom = min(n for n, kind, _ in trials if kind == "OOM" and n > fits)
    spare = card - oom_search.predict_peak("tp", 1, first_oom, 1, cfg, 2)["peak"] / 2**30
    lines += ["", f"The card: {card} GiB ({card * 1024:,.0f} MiB). Longest length that fit: "
              f"{fits:,}. At {first_oom:,}, which ran out of memory, the prediction leaves "
              f"{spare:.1f} GiB of the card unused."]
    return "\n".join(lines)


def _gpu_cp_kernels():
    d = load("results/gpu/cp_kernels.json")
    cs = sorted({r["C"] for r in d["rows"]})
    lines = ["| dtype | kernel | " + " | ".join(f"C={c}" + (" (whole-sequence SDPA)" if c == 1
                                                         else "") for c in cs) + " |",
             "|---|---|" + "---|" * len(cs)]
    by = {}
    for r in d["rows"]:
        by.setdefault((r["dtype"], "pure" if "pure" in r["kernel"] else "fused"), {})[r["C"]] = r
    for dtype in ("bfloat16", "float32"):
        fused, pure = by[(dtype, "fused")], by[(dtype, "pure")]
        name = re.search(r"fused \((\S+)\)", fused[max(cs)]["kernel"]).group(1)
        for label, row in ((f"fused (`{name}`)", fused), ("pure torch", pure)):
            lines.append(f"| {dtype} | {label} | " + " | ".join(
                f"{row[c]['err']:.1e}, {row[c]['ms']:.2f} ms" if c in row else "" for c in cs)
                + " |")
        lines.append(f"| {dtype} | pure / fused time | " + " | ".join(
            f"{pure[c]['ms'] / fused[c]['ms']:.2f}" if c in pure else "" for c in cs) + " |")
    return "\n".join(lines)


# the run of 2026-11-26 (scripts/gpu_check.py): one file per section
GPU_CHECK = "results/gpu/2026-11-26-h100"


def _gpu_check_device():
    d = load(f"{GPU_CHECK}/device.json")
    lines = ["| run | verdict | seconds | host syncs per step: allowed / other (dispatch, cuda) |",
             "|---|---|---|---|"]
    for i in d["items"]:
        verdict = "PASS" if i.get("ok") else f"FAIL {i.get('error', '')}"
        hs, syncs = i.get("host_syncs"), "-"
        if hs and hs["steps"]:
            b, n = hs["by_detector"], hs["steps"]
            syncs = (f"{b['dispatch']['allowed'] / n:g} / {b['dispatch']['unexpected'] / n:g}, "
                     f"{b['cuda']['allowed'] / n:g} / {b['cuda']['unexpected'] / n:g}")
        mode = i.get("mode") or "reload"
        lines.append(f"| {i['label']} {mode} | {verdict} | {i.get('seconds', '-')} | {syncs} |")
    return "\n".join(lines)


def _gpu_check_speed():
    d = load(f"{GPU_CHECK}/speed.json")
    lines = ["| run | tokens/step (B x S) | step ms | tokens/s | MFU | peak memory |",
             "|---|---|---|---|---|---|"]
    for r in d["items"]:
        ratio = (f" ({r['over_reference']:.2f}x the reference's step)"
                 if r.get("over_reference") else "")
        lines.append(f"| {r['run']}{ratio} | {r['tokens']:,} ({r['batch']} x {r['length']}) | "
                     f"{r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
                     f"{r['peak_memory_gib']:.1f} GiB |")
    return "\n".join(lines)


def _gpu_check_memory():
    d = load(f"{GPU_CHECK}/memory.json")
    seed = {"tp": "19k", "sp": "19k", "pp": "15k"}
    lines = ["| strategy | predicted max (grid 1,024) | longest that fit | shortest that ran out | "
             "measured peak at the longest | predicted there | seed's table |",
             "|---|---|---|---|---|---|---|"]
    for s, st in d["strategies"].items():
        best = max((t for t in st["trials"] if t["kind"] == "OK"), key=lambda t: t["length"],
                   default=None)
        oom = min((t["length"] for t in st["trials"] if t["kind"] == "OOM"), default=None)
        lines.append(f"| {s} | {st['predicted_max']:,} | {best['length']:,} | "
                     f"{oom:,} | {best['peak'] / 2**20:,.0f} MiB | "
                     f"{best['predicted_peak'] / 2**20:,.0f} MiB | {seed[s]} |")
    lines.append("")
    lines.append(f"The card: {d['card_bytes'] / 2**30:.2f} GiB as torch reports it "
                 f"({d['device']}), batch 1, bf16, fresh process per trial.")
    return "\n".join(lines)


def _gpu_check_cp():
    d = load(f"{GPU_CHECK}/cp.json")
    lines = ["| dtype | C | fused loop ms | one fused call ms | loop / one call | "
             "max rel. error (whole-sequence SDPA's) |", "|---|---|---|---|---|---|"]
    whole = {r["dtype"]: r for r in d["rows"] if r["C"] == 1 and "SDPA" in r["kernel"]}
    once = {r["dtype"]: r for r in d["rows"] if r["C"] == 1 and "one call" in r["kernel"]
            and "fused" in r["kernel"]}
    for r in d["rows"]:
        if r["C"] > 1 and "fused" in r["kernel"]:
            lines.append(f"| {r['dtype']} | {r['C']} | {r['ms']:.2f} | {once[r['dtype']]['ms']:.2f}"
                         f" | {r['over_whole']:.2f} | {r['err']:.1e} "
                         f"({whole[r['dtype']]['err']:.1e}) |")
    return "\n".join(lines)


def _oom_predict():
    oom_search, load_config = _predict()
    budget, worlds = 80 * 2**30, (1, 2, 8)
    lines = ["| model | strategy | " + " | ".join(f"W={w}" for w in worlds) + " |",
             "|---|---|" + "---|" * len(worlds)]
    for model in ("llama3.2-1b", "llama3-8b"):
        cfg = load_config(model)
        for s, name in (("tp", "tp"), ("sp", "sp (Megatron)"), ("pp", "pp (1F1B)")):
            cells = []
            for w in worlds:
                n = oom_search.predict_max(s, w, 1, cfg, budget, 512, None, 512, 2, False)
                states = oom_search.predict_peak(s, w, 512, 1, cfg, 2)["states"] / 2**30
                cells.append(f"{n:,}" if n else f"none: states alone {states:,.1f} GiB")
            lines.append(f"| {model} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _families():
    if os.path.join(HERE, "scripts") not in sys.path:
        sys.path.insert(0, os.path.join(HERE, "scripts"))
    from families import table
    return table(load("results/families-cpu.json")["rows"])


TABLES.update({"families": _families})


def _fsdp_designs():
    if os.path.join(HERE, "scripts") not in sys.path:
        sys.path.insert(0, os.path.join(HERE, "scripts"))
    from fsdp_designs import table
    return table(load("results/fsdp-designs-cpu.json")["rows"])


TABLES.update({"fsdp-designs": _fsdp_designs})


def _script_table(module: str, results: str, fn: str = "table"):
    """A table drawn by a measurement script's own table() (or `fn`) from its results file."""
    if os.path.join(HERE, "scripts") not in sys.path:
        sys.path.insert(0, os.path.join(HERE, "scripts"))
    import importlib
    return lambda: getattr(importlib.import_module(module), fn)(load(results))


TABLES.update({"muon": _script_table("muon_bench", "results/muon-cpu.json"),
               "muon-text": _script_table("muon_text", "results/muon-text-cpu.json"),
               "lora-text": _script_table("lora_text", "results/lora-text-cpu.json"),
               "lora-memory": _script_table("lora_text", "results/lora-text-cpu.json",
                                            "memory_table")})


def _plan_validation():
    from trainer4d.steptime import table
    return table(load("results/plan-validation.json"))


TABLES["plan-validation"] = _plan_validation
TABLES.update({"strategies-comm": _strategies_comm, "strategies-memory": _strategies_memory,
               "gpu-w1": _gpu_w1, "gpu-perf": _gpu_perf, "gpu-kernels": _gpu_kernels,
               "gpu-oom-tp": _gpu_oom_tp, "gpu-cp-kernels": _gpu_cp_kernels,
               "oom-predict": _oom_predict, "gpu-check-device": _gpu_check_device,
               "gpu-check-speed": _gpu_check_speed, "gpu-check-memory": _gpu_check_memory,
               "gpu-check-cp": _gpu_check_cp})


# -- check and write ------------------------------------------------------------------------------
def process(text: str, write: bool) -> tuple[str, list[str]]:
    """(the text with every figure and table rendered, [one line per difference])."""
    problems = []

    def fig(m):
        source, path, fmt, quoted = m.groups()
        try:
            want = render_figure(source, path, fmt)
        except (OSError, KeyError, IndexError, ValueError, TypeError) as e:
            problems.append(f"figure {source} {path}: {type(e).__name__}: {e}")
            return m.group(0)
        if want != quoted:
            problems.append(f"figure {source} {path}: the page says {quoted!r}, the file {want!r}")
        return m.group(0).replace(f"-->{quoted}<!--", f"-->{want}<!--")

    def table(m):
        opening, name, body, closing = m.groups()
        if name not in TABLES:
            problems.append(f"table {name}: no such table (known: {', '.join(TABLES)})")
            return m.group(0)
        try:
            want = TABLES[name]() + "\n"
        except (OSError, KeyError, ValueError) as e:
            problems.append(f"table {name}: {type(e).__name__}: {e}")
            return m.group(0)
        if want != body:
            problems.append(f"table {name}: differs from its results file")
        return opening + want + closing

    starts = {m.start() for m in FIG.finditer(text)}
    for i in (i for i in range(len(text)) if text.startswith("<!--fig ", i) and i not in starts
              and text[i - 1:i] != "`"):     # (one quoted in inline code: an example)
        problems.append(f"a figure marker that does not parse (source, path and format, no "
                        f"spaces): {text[i:i + 80]!r}")
    text = TABLE.sub(table, FIG.sub(fig, text))
    return text, problems


def check(paths=None, write=False) -> list[str]:
    out = []
    for path in paths or pages():
        with open(path) as f:
            text = f.read()
        new, problems = process(text, write)
        out += [f"{os.path.relpath(path, HERE)}: {p}" for p in problems]
        if write and new != text:
            with open(path, "w") as f:
                f.write(new)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the figures and tables")
    ap.add_argument("pages", nargs="*", help="default: README.md and docs/*.md")
    a = ap.parse_args()
    problems = check(a.pages or None, a.write)
    for p in problems:
        print(p)
    if a.write:
        problems = check(a.pages or None)    # what is left: figures whose source is missing
    print(f"{'FAIL' if problems else 'PASS'} docs: {len(problems)} figure(s) differ from results/")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
