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
fields equal those values (exactly one must match). A figure that a formula gives (an exact
byte count, which the strategy's benchmark test asserts against the same formula) names `=` as
its source and the formula's instance as its path, without spaces:

    <!--fig = 18*131072+3*2048 ,-->2,365,440<!--/fig--> B
 Its format is a Python format spec, optionally
followed by a scale: `/MiB` or `/GiB` (bytes), `*100` (a share as a percentage). So a figure
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

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIG = re.compile(r"<!--fig (\S+) (\S+) (\S+?)-->(.*?)<!--/fig-->", re.S)
TABLE = re.compile(r"(<!--table (\S+)-->\n)(.*?)(<!--/table-->)", re.S)
SCALES = {"/MiB": 1 / 2**20, "/GiB": 1 / 2**30, "*100": 100.0, "": 1.0}


def pages() -> list[str]:
    return [os.path.join(HERE, "README.md")] + sorted(glob.glob(os.path.join(HERE, "docs", "*.md")))


def load(path: str):
    with open(os.path.join(HERE, path)) as f:
        return json.load(f)


def walk(data, path: str):
    """The value at `path` (the module docstring's syntax)."""
    for step in re.findall(r"\[[^\]]*\]|[^.\[\]]+", path):
        if step.startswith("["):
            want = dict(kv.split("=", 1) for kv in step[1:-1].split(","))
            hits = [x for x in data if all(str(x.get(k)) == v for k, v in want.items())]
            if len(hits) != 1:
                raise KeyError(f"{step} matches {len(hits)} elements, not one")
            data = hits[0]
        elif isinstance(data, list):
            data = data[int(step)]
        else:
            data = data[step]
    return data


def formula(expr: str):
    """An arithmetic expression: numbers, + - * / // ** % and parentheses, nothing else."""
    if not re.fullmatch(r"[0-9eE.+\-*/%() ]+", expr):
        raise ValueError(f"not an arithmetic expression: {expr}")
    return eval(expr, {"__builtins__": {}})   # noqa: S307 (checked above: arithmetic only)


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
             "| step time | extra time |", "|---|---|---|---|---|---|"]
    for r in d["rows"]:
        lines.append(f"| {r['attn']} | {r['mode']} | {int(r['measured_bytes_per_layer']):,} B | "
                     f"{r['whole_model_bytes'] / 2**20:,.0f} MiB | {r['step_ms']:,.0f} ms | "
                     f"{r['extra'] or '-'} |")
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
    sys.path.insert(0, HERE)
    import tour
    return tour.plant_groups()   # (script, world, args, [names]) from each strategy's `plants`


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
        return f"{min(xs):.1f} to {max(xs):.1f}"

    eps = {"float64": 2.0 ** -52, "float32": 2.0 ** -23}
    ulps = ", ".join(f"{dt} {max(r['loss_err'] for r in d['rows'] if r['dtype'] == dt) / e:.1f}"
                     for dt, e in eps.items())
    worst = max(d["rows"], key=lambda r: r["worst_ratio"])
    lines += ["", f"Largest error / largest noise: gradients {span('grad')}, parameters "
              f"{span('param')}, loss {span('loss')}. The largest loss error in units of "
              f"roundoff: {ulps}. Worst row: {worst['worst_ratio']:.2f} of its tolerance "
              f"({worst['strategy']}, W={worst['world']}, {worst['dtype']})."]
    return "\n".join(lines)


TABLES.update({"plants": _plants, "plant-count": _plant_count, "realistic": _realistic})


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
