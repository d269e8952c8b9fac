"""The project's shape, from its own source (no imports run): no import cycles, a harness that
imports no strategy, short strategy files, no test switches in the public API, and installed
names that cannot shadow a user's own modules. DESIGN.md's layout, kept true by this file.

Imports are read with `ast`, every one of them: module-level, inside functions (lazy), and under
`if TYPE_CHECKING:`, because each is a dependency a reader has to follow."""
import ast
import os
import re
import tomllib

import pytest

from conftest import ROOT

HARNESS, TRAINER = "harness", "trainer4d"
MAX_LINES = 800          # a strategy file past this gets a sibling for the concept that grew


def pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def modules() -> dict[str, str]:
    """{dotted name: path} of every module the project installs."""
    cfg = pyproject()
    out = {m: os.path.join(ROOT, m + ".py") for m in cfg["py-modules"]}
    for pkg in cfg["packages"]:
        for f in sorted(os.listdir(os.path.join(ROOT, pkg))):
            if f.endswith(".py"):
                name = pkg if f == "__init__.py" else f"{pkg}.{f[:-3]}"
                out[name] = os.path.join(ROOT, pkg, f)
    return out


def imports(name: str, path: str, known) -> set[str]:
    """The project modules `name` imports, anywhere in its source."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()

    def resolve(target: str):
        while target and target not in known:     # harness.meter.METER -> harness.meter
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                resolve(a.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for a in node.names:
                resolve(f"{base}.{a.name}")
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(m, p, mods) for m, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def strategy_files() -> list[str]:
    """The top-level modules: the strategy files, their siblings, compose4d.py, oom_search.py."""
    return [m for m in pyproject()["py-modules"]]


def test_the_import_graph_has_no_cycle():
    g = graph()
    assert sum(len(v) for v in g.values()) > 20, g     # the parser sees the imports at all
    assert cycles(g) == []


def test_the_cycle_finder_sees_a_cycle():
    """The check can fail: a planted two-module and three-module cycle are found."""
    g = graph()
    g["harness.data"] = g["harness.data"] | {"harness.cli"}          # cli imports data already
    assert any({"harness.data", "harness.cli"} <= set(c) for c in cycles(g)), cycles(g)
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_harness_imports_no_strategy():
    """harness/ sits below every strategy file: it imports only itself (and torch, ...)."""
    bad = {m: sorted(t for t in deps if not t.startswith(HARNESS))
           for m, deps in graph().items() if m.startswith(HARNESS)}
    assert {m: d for m, d in bad.items() if d} == {}


def test_no_strategy_imports_the_trainer_package():
    """trainer4d holds the train mode, checkpoints and planners; only compose4d.py uses them."""
    g = graph()
    users = sorted(m for m in strategy_files() if any(t.startswith(TRAINER) for t in g[m]))
    assert users == ["compose4d"], users


@pytest.mark.parametrize("name", strategy_files())
def test_strategy_files_stay_short(name):
    with open(os.path.join(ROOT, name + ".py")) as f:
        n = sum(1 for _ in f)
    assert n <= MAX_LINES, f"{name}.py has {n} lines: give the concept that grew a sibling file"


# The harness modules that turn --plant-bug into the switch (harness/plants.py's planting)
SWITCHES = {"harness.cli", "harness.correctness", "harness.launch"}


def plant_parameters(path: str) -> list[str]:
    """Every function (autograd Functions' forward included) with a parameter named like a
    planted-bug switch, every `.plant*` attribute assigned, and every read of the command line's
    `plant_bug` (attribute or getattr): test switches passed around instead of harness.planted."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            out += [f"{node.name}({a.arg})" for a in args if re.fullmatch(r"plant\w*", a.arg)]
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if re.fullmatch(r"plant\w*", node.attr):
                out.append(f".{node.attr} = (line {node.lineno})")
        if isinstance(node, ast.Attribute) and node.attr == "plant_bug" and \
                isinstance(node.ctx, ast.Load):
            out.append(f".plant_bug read (line {node.lineno})")
        elif isinstance(node, ast.Constant) and node.value == "plant_bug":
            out.append(f"'plant_bug' (line {node.lineno})")
    return out


def test_no_public_api_takes_a_planted_bug():
    """Plants are switched on by the harness (harness.planted), never passed in or read from
    the arguments outside the harness's switch."""
    found = {m: plant_parameters(p) for m, p in modules().items() if m not in SWITCHES}
    assert {m: f for m, f in found.items() if f} == {}


def test_the_plant_finder_sees_a_plant_parameter(tmp_path):
    p = tmp_path / "x.py"
    p.write_text("class F:\n    def forward(ctx, x, group, plant=None):\n        pass\n"
                 "def g(m, args):\n    m.plant = 'x'\n"
                 "    return args.plant_bug != 'no-average' or getattr(args, 'plant_bug')\n")
    assert plant_parameters(str(p)) == ["forward(plant)", ".plant = (line 5)",
                                        ".plant_bug read (line 6)", "'plant_bug' (line 6)"]


def test_installed_names_cannot_shadow_a_users_modules():
    """Top level: only the strategy files, their siblings, compose4d and oom_search; the rest
    lives in packages (a user's own train.py or checkpoint.py then never shadows ours)."""
    cfg = pyproject()
    assert set(cfg["packages"]) == {HARNESS, TRAINER}
    for m in cfg["py-modules"]:
        assert os.path.exists(os.path.join(ROOT, m + ".py")), m
    generic = {"train", "checkpoint", "elastic", "tour", "plan", "utils", "common", "ep_stats"}
    assert not generic & set(cfg["py-modules"])
    # every .py at the top level is installed, or is a script nothing imports (tour.py)
    scripts = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")} - set(cfg["py-modules"])
    assert scripts == {"tour"}, scripts
    g = graph()
    assert not any("tour" in deps for deps in g.values())
