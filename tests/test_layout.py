"""The project's shape, from its own source (no imports run). The layout it keeps true is written
in rig/__init__.py's docstring (and docs/internals.md):

    learner files   the top-level modules (ddp.py, zero.py, fsdp.py, tp.py, ..., compose4d.py):
                    the algorithm and nothing else, at most MAX_LINES lines (compose4d
                    COMPOSE_LINES); no harness adapter (no Strategy / Reference subclass); they
                    import torch, each other, and only the harness helpers in LEARNER_HARNESS
    rig/            the test rig, one module per learner file: imports learner files and harness
    harness/        imports nothing of the project but itself
    trainer4d/      the trainer's helpers; no learner file but compose4d imports it
A learner file's `if __name__ == "__main__":` block is the script's entry (torchrun ddp.py):
it imports its own rig module and nothing else, and is not a dependency of the module.
And: no import cycles, no test switches in the public API, installed names that cannot shadow a
user's own modules.

Imports are read with `ast`, every one of them: module-level, inside functions (lazy), and under
`if TYPE_CHECKING:`, because each is a dependency a reader has to follow."""
import ast
import os
import re
import tomllib

import pytest

from conftest import ROOT

HARNESS, RIG, TRAINER = "harness", "rig", "trainer4d"
MAX_LINES = 450          # a learner file past this gets a sibling for the concept that grew
COMPOSE_LINES = 400      # compose4d.py: mostly the grid, the step and imports of the others
# What a learner file may import from the harness: the planted-bug switch, and what the
# algorithm itself needs (the data's Batch, the loss normalisation, dropout masks that do not
# depend on the layout, the mixed-precision rules, the meter's phase marks and group names, the
# model's parts, recompute's checkpoint test, two small collective helpers); compose4d also
# reads a checkpoint's shards. Keep it small: anything else is the rig's.
LEARNER_HARNESS = {"harness.plants", "harness.data", "harness.loss", "harness.dropout",
                   "harness.precision", "harness.meter", "harness.models", "harness.recompute",
                   "harness.collectives"}
COMPOSE_EXTRA = {"harness.loading", "trainer4d.schedule", "trainer4d.pipeline"}
# Top-level tools, not learner files: they drive the harness (oom_search runs trials, simulates a
# step under FakeTensorMode). Short and rig-free like the rest, but any harness module.
TOOLS = {"oom_search"}
ADAPTER_BASES = {"Strategy", "Reference", "DTensorBaseline"}


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


def is_main_block(node) -> bool:
    """`if __name__ == "__main__":`"""
    t = node.test if isinstance(node, ast.If) else None
    return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name)
            and t.left.id == "__name__" and isinstance(t.comparators[0], ast.Constant)
            and t.comparators[0].value == "__main__")


def reexports(package: str) -> dict[str, str]:
    """{name: defining module} for a package's `from .module import name` re-exports."""
    with open(os.path.join(ROOT, package, "__init__.py")) as f:
        tree = ast.parse(f.read())
    return {a.asname or a.name: f"{package}.{n.module}" for n in tree.body
            if isinstance(n, ast.ImportFrom) and n.level == 1 and n.module for a in n.names}


def imports(name: str, path: str, known, main_block: bool = False) -> set[str]:
    """The project modules `name` imports, anywhere in its source but its `__main__` block (or,
    main_block=True, only there). `from harness import X` counts as X's own module."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    harness_names = reexports(HARNESS)
    mains = [n for n in tree.body if is_main_block(n)]
    if main_block:
        nodes = [x for m in mains for x in ast.walk(m)]
    else:
        skip = {id(x) for m in mains for x in ast.walk(m)}
        nodes = [x for x in ast.walk(tree) if id(x) not in skip]

    def resolve(target: str):
        head, _, last = target.rpartition(".")
        if head == HARNESS and last in harness_names:
            target = harness_names[last]
        while target and target not in known:     # harness.meter.METER -> harness.meter
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in nodes:
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
    """The top-level modules, the learner files: the strategy files, their siblings, compose4d.py,
    oom_search.py."""
    return [m for m in pyproject()["py-modules"]]


def adapter_classes(path: str) -> list[str]:
    """Classes in `path` that subclass a harness adapter base (Strategy, Reference, ...)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", None)
                     for b in node.bases}
            if bases & ADAPTER_BASES:
                out.append(node.name)
    return out


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
    """harness/ sits below every strategy file and the rig: it imports only itself."""
    bad = {m: sorted(t for t in deps if not t.startswith(HARNESS))
           for m, deps in graph().items() if m.startswith(HARNESS)}
    assert {m: d for m, d in bad.items() if d} == {}


def learner_import_errors(g: dict[str, set[str]]) -> dict[str, list[str]]:
    learners = set(strategy_files())
    out = {}
    for m in learners:
        allowed = learners | LEARNER_HARNESS | (COMPOSE_EXTRA if m == "compose4d" else set())
        if m in TOOLS:
            allowed = learners | {t for t in g[m] if t.startswith(HARNESS)}
        bad = sorted(t for t in g[m] if t not in allowed)
        if bad:
            out[m] = bad
    return out


def test_learner_files_import_only_learner_files_and_a_few_harness_helpers():
    """A learner reads one file without opening the harness: it imports torch, other learner
    files and LEARNER_HARNESS; never the rig, never the harness's adapter contract or runner."""
    assert learner_import_errors(graph()) == {}


def test_the_learner_import_check_sees_a_bad_import():
    g = graph()
    g["ddp"] = g["ddp"] | {"harness.strategy", "rig.tp"}
    assert learner_import_errors(g) == {"ddp": ["harness.strategy", "rig.tp"]}


def test_no_adapter_class_in_a_learner_file(tmp_path):
    """The Strategy / Reference subclasses live in rig/ (the finder sees one when planted)."""
    found = {m: adapter_classes(os.path.join(ROOT, m + ".py")) for m in strategy_files()}
    assert {m: c for m, c in found.items() if c} == {}
    p = tmp_path / "x.py"
    p.write_text("import harness\nclass A(harness.Strategy):\n    pass\n"
                 "class B(Reference):\n    pass\nclass C:\n    pass\n")
    assert adapter_classes(str(p)) == ["A", "B"]


@pytest.mark.parametrize("name", strategy_files())
def test_a_learner_files_main_hands_over_to_its_rig(name):
    """The `__main__` block, if any: two or three lines importing `rig.<name>` and nothing else
    of the project (the script's entry: torchrun <name>.py)."""
    path = os.path.join(ROOT, name + ".py")
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    mains = [n for n in tree.body if is_main_block(n)]
    if not mains or name in TOOLS:
        return
    assert len(mains) == 1 and mains[0].end_lineno - mains[0].lineno <= 2, name
    assert imports(name, path, modules(), main_block=True) == {f"{RIG}.{name}"}


def test_the_rig_and_the_trainer():
    """Every rig module is some learner file's rig; harness and trainer4d import no rig."""
    g = graph()
    rigs = {m for m in g if m.startswith(RIG + ".")}
    assert rigs and {m.partition(".")[2] for m in rigs} <= set(strategy_files()), rigs
    users = sorted(m for m, deps in g.items() if not m.startswith(RIG)
                   and any(t.startswith(RIG) for t in deps))
    assert users == [], users


def test_no_strategy_imports_the_trainer_package():
    """trainer4d holds the train mode, checkpoints and planners; only compose4d.py uses them."""
    g = graph()
    users = sorted(m for m in strategy_files() if any(t.startswith(TRAINER) for t in g[m]))
    assert users == ["compose4d"], users


@pytest.mark.parametrize("name", strategy_files())
def test_strategy_files_stay_short(name):
    with open(os.path.join(ROOT, name + ".py")) as f:
        n = sum(1 for _ in f)
    limit = COMPOSE_LINES if name == "compose4d" else MAX_LINES
    assert n <= limit, f"{name}.py has {n} lines: give the concept that grew a sibling file"


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
    assert set(cfg["packages"]) == {HARNESS, RIG, TRAINER}
    for m in cfg["py-modules"]:
        assert os.path.exists(os.path.join(ROOT, m + ".py")), m
    generic = {"train", "checkpoint", "elastic", "tour", "plan", "utils", "common", "ep_stats"}
    assert not generic & set(cfg["py-modules"])
    # every .py at the top level is installed, or is a script nothing imports (tour.py)
    scripts = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")} - set(cfg["py-modules"])
    assert scripts == {"tour"}, scripts
    g = graph()
    assert not any("tour" in deps for deps in g.values())


def woven_plants(path: str) -> list[str]:
    """Every `planted(...)` call that is not, alone, the test of an `if` or of a one-line
    conditional (`planted("x")` or `not planted("x")`): a plant woven into a larger expression
    of the algorithm's own (`if cond and not planted("x"):`), which a reader has to parse to
    read the correct line (DESIGN.md: the correct line, then `if planted("x"): <the bug>`)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    parent = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "planted"):
            continue
        test = parent[node]
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            test, up = test, parent[test]
        else:
            test, up = node, test
        if not (isinstance(up, (ast.If, ast.IfExp)) and up.test is test):
            out.append(f"line {node.lineno}")
    return out


@pytest.mark.parametrize("name", strategy_files())
def test_a_plant_stands_beside_the_line_it_breaks(name):
    assert woven_plants(os.path.join(ROOT, name + ".py")) == []


def test_the_woven_plant_finder_sees_a_woven_plant(tmp_path):
    p = tmp_path / "x.py"
    p.write_text("if planted('a'):\n    x = 1\n"                      # beside: fine
                 "y = 1 if not planted('b') else 2\n"                 # a one-line conditional
                 "if ready and not planted('c'):\n    x = 2\n"        # woven
                 "z = planted('d')\n"                                 # a flag read elsewhere
                 "if planted('e') and x:\n    pass\n")                # woven
    assert sorted(woven_plants(str(p))) == ["line 4", "line 6", "line 7"]


def test_each_run_line_names_a_script_and_flags_that_exist():
    """A learner file's `Run:` line (nanoGPT's header) is a command a reader can paste: its
    script exists and every flag it passes is an argument some parser defines (rig/, harness/);
    the learner files that run under torchrun have one."""
    import glob
    import re
    defined = set()
    for path in glob.glob(os.path.join(ROOT, "rig", "*.py")) + glob.glob(
            os.path.join(ROOT, "harness", "*.py")):
        with open(path) as f:
            defined |= set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", f.read()))
    missing = []
    for name in strategy_files():
        with open(os.path.join(ROOT, name + ".py")) as f:
            src = f.read()
        run = re.search(r"^Run: +(.*)$", src, re.M)
        if run is None:
            if "from rig." in src and "__main__" in src:
                missing.append(f"{name}.py: no Run: line")
            continue
        if "torchrun" not in run.group(1):
            continue
        script = re.search(r"(\w+\.py)", run.group(1)).group(1)
        assert os.path.exists(os.path.join(ROOT, script)), run.group(0)
        missing += [f"{name}.py: {flag}" for flag in re.findall(r"(--[\w-]+)", run.group(1))
                    if flag != "--nproc_per_node" and flag not in defined]
    assert missing == [], missing
