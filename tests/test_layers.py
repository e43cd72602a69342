"""The package's layers, counting imports inside functions: no import circle anywhere; no module
imports a layer above its own (bottom to top: limits / errors / digest / paths, the spec, the core
modules, plan/ and the call contract (fa4lab.call), kernels/, the API, then the tools: bench/,
fuzz/, viz/, exercises/, distributed/, the CLIs); the core modules never import the kernels (a
device path is handed down: `fa4lab.indexcheck.queue_check`, `fa4lab.kernels.combine.combine`); the
planner never imports the bench, the figures or the kernels, so the plan reads no benchmark record
and draws nothing; the bench hands it what it reads (`fa4lab.bench.records.sweep_figures`,
`fa4lab.bench.calibration`)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import fa4lab

PACKAGE = Path(fa4lab.__file__).parent


def imported(path: Path) -> set[str]:
    """Every module an import statement of `path` names, at any depth of the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_imported_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\ndef g():\n    from fa4lab.bench import records\n")
    assert {"os", "fa4lab.bench", "fa4lab.bench.records"} <= imported(f)


def test_the_plan_layer_imports_neither_bench_viz_nor_kernels():
    bad = {}
    for path in sorted((PACKAGE / "plan").glob("*.py")):
        up = sorted(m for m in imported(path)
                    if m.startswith(("fa4lab.bench.", "fa4lab.viz.", "fa4lab.kernels."))
                    or m in ("fa4lab.bench", "fa4lab.viz", "fa4lab.kernels"))
        if up:
            bad[path.name] = up
    assert not bad, f"plan modules importing upward: {bad}"


# The package's modules by name ("fa4lab", "fa4lab.plan", "fa4lab.plan.key", ...): a package is
# its __init__.py.
def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def module_imports(name: str, path: Path, modules=MODULES) -> set[str]:
    """The modules of `modules` that module `name` (file `path`) imports, at any depth of the
    file: `import a.b.c` and `from a.b import c` name module a.b.c where that is a module, else
    the nearest module above it (`from a.b import f`: a.b, a package's __init__); relative
    imports are resolved against `name`'s package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + [base] * bool(base))
            targets = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph(modules=None) -> dict[str, set[str]]:
    """Each module -> the modules it imports; the package's (`MODULES`) by default, read once."""
    if modules is None:
        return _package_graph()
    return {name: module_imports(name, path, modules) for name, path in modules.items()}


@functools.cache
def _package_graph() -> dict[str, set[str]]:
    return import_graph(MODULES)


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, the
    one `fa4lab.kernels.ptx_flow` finds the PTX's loops with): each is a set of modules that
    import one another round a circle."""
    from fa4lab.kernels.ptx_flow import strongly_connected

    heads: dict[str, list[str]] = {}
    edges = {v: sorted(ws) for v, ws in graph.items()}
    for v, (head, _) in strongly_connected(sorted(graph), edges).items():
        heads.setdefault(head, []).append(v)
    return sorted(sorted(c) for c in heads.values() if len(c) > 1)


def test_import_circles_are_found(tmp_path):
    pkg = tmp_path / "fa4lab"
    (pkg / "sub").mkdir(parents=True)
    files = {"__init__.py": "", "a.py": "def f():\n    from fa4lab.sub import b\n",
             "sub/__init__.py": "", "sub/b.py": "from .. import c\n",
             "c.py": "import fa4lab.a\n", "d.py": "from fa4lab.a import f\n"}
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    modules = {".".join(("fa4lab", *Path(rel).with_suffix("").parts)).removesuffix(".__init__"):
               pkg / rel for rel in files}
    graph = import_graph(modules)
    assert graph["fa4lab.sub.b"] == {"fa4lab.c"} and graph["fa4lab.d"] == {"fa4lab.a"}
    assert import_circles(graph) == [["fa4lab.a", "fa4lab.c", "fa4lab.sub.b"]]


def test_the_package_has_no_import_circle():
    graph = import_graph()
    circles = import_circles(graph)
    assert not circles, "import circles (each module with its imports inside the circle):" + \
        "".join(f"\n{len(c)} modules:" + "".join(f"\n  {m} -> {sorted(graph[m] & set(c))}"
                                                   for m in c) for c in circles)


# Bottom to top; a module's layer is its top-level module's or package's under fa4lab.
LAYERS = (
    ("limits", "errors", "digest", "paths", "hardware", "lessons"),
    ("__init__", "spec", "canonical"),
    ("reference", "reference_backward", "backward_blocks", "online_softmax", "tiling", "gqa",
     "scheduling", "varlen", "varlen_tiles", "varlen_forms", "varlen_metadata", "mods",
     "mods_blocks", "indexcheck", "splitkv", "blockwalk"),
    ("plan", "backward_budget", "call"),
    ("kernels",),
    ("api", "backward"),
    ("bench", "fuzz", "viz", "exercises", "distributed", "cli", "environment", "variants",
     "acceptance", "plan_cli", "__main__"),
)
# The modules below plan/: none imports the kernels, not even inside a function.
CORE = tuple(name for layer in LAYERS[:3] for name in layer if name != "__init__")


def layer_of(name: str) -> int | None:
    top = name.split(".")[1] if "." in name else "__init__"
    return next((i for i, layer in enumerate(LAYERS) if top in layer), None)


def test_every_module_has_a_layer():
    assert [m for m in MODULES if layer_of(m) is None] == []


def test_no_module_imports_a_layer_above_its_own():
    up = sorted((m, t) for m, targets in import_graph().items() for t in targets
                if layer_of(t) > layer_of(m))
    assert not up, f"upward imports: {up}"


def test_the_core_modules_never_import_the_kernels():
    bad = {}
    for name in CORE:
        path = PACKAGE / f"{name}.py"
        kernels = sorted(m for m in imported(path)
                         if m == "fa4lab.kernels" or m.startswith("fa4lab.kernels."))
        if kernels:
            bad[name] = kernels
    assert not bad, f"core modules importing fa4lab.kernels: {bad}"


def test_the_bench_modes_do_not_import_their_dispatcher():
    """`fa4lab.bench.cli` dispatches to the --features, --serving, --backward and --training
    modes; they take the shared run helpers from `fa4lab.bench.runs`, so no import runs back up
    to it."""
    for name in ("features_cli.py", "serving_cli.py", "backward.py", "backward_cli.py",
                 "training_cli.py", "training.py",
                 "runs.py"):
        assert "fa4lab.bench.cli" not in imported(PACKAGE / "bench" / name), name


def _from_imports(source: str):
    """(module, name) of every absolute `from fa4lab... import name` in `source`, at any depth."""
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.ImportFrom) and not node.level and node.module
                and node.module.split(".")[0] == "fa4lab"):
            yield from ((node.module, a.name) for a in node.names)


def test_every_name_imported_from_the_package_exists():
    """Every `from fa4lab.x import name` in the package, the tests, the benchmarks and the
    notebooks names something x has (a function or a submodule): an import inside a function
    runs only when its path does (a GPU path never runs here), so a name moved by a refactor
    would otherwise fail there first."""
    import importlib
    import json

    root = PACKAGE.parent
    sources = [(p, p.read_text()) for d in ("fa4lab", "tests", "benchmarks")
               for p in sorted((root / d).rglob("*.py"))]
    for nb in sorted((root / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        sources.append((nb, "\n".join(line for line in code.splitlines()
                                      if not line.lstrip().startswith(("%", "!")))))
    missing = []
    for path, source in sources:
        for module, name in _from_imports(source):
            found = importlib.import_module(module)
            if not hasattr(found, name) and importlib.util.find_spec(
                    f"{module}.{name}") is None:
                missing.append(f"{path.relative_to(root)}: from {module} import {name}")
    assert not missing, "\n".join(missing)


def test_a_moved_name_is_found(tmp_path):
    assert list(_from_imports("def f():\n    from fa4lab.kernels.compile import scale_args\n")) \
        == [("fa4lab.kernels.compile", "scale_args")]


# The kernel files hold one kernel each and nothing else (their host code lives in launch*.py):
# they may be longer; every other module says one concept in at most MODULE_LINES lines.
MODULE_LINES = 600
KERNEL_FILES = ("fa4lab/kernels/fwd_", "fa4lab/kernels/bwd_")


def test_modules_stay_small():
    root = PACKAGE.parent
    long = {p.relative_to(root).as_posix(): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MODULE_LINES
            and not p.relative_to(root).as_posix().startswith(KERNEL_FILES)}
    assert not long, f"modules over {MODULE_LINES} lines (split them by concept): {long}"
