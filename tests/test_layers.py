"""The package's layers: the planner never imports the bench or the figures (counting imports
inside functions), so the plan reads no benchmark record and draws nothing; the bench hands it
what it reads (`fa4lab.bench.records.sweep_figures`, `fa4lab.bench.calibration`)."""

from __future__ import annotations

import ast
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


def test_the_plan_layer_imports_neither_bench_nor_viz():
    bad = {}
    for path in sorted((PACKAGE / "plan").glob("*.py")):
        up = sorted(m for m in imported(path)
                    if m.startswith(("fa4lab.bench", "fa4lab.viz"))
                    or m in ("fa4lab.bench", "fa4lab.viz"))
        if up:
            bad[path.name] = up
    assert not bad, f"plan modules importing upward: {bad}"


def test_the_bench_modes_do_not_import_their_dispatcher():
    """`fa4lab.bench.cli` dispatches to the --features and --serving modes; they take the
    shared run helpers from `fa4lab.bench.runs`, so no import runs back up to it."""
    for name in ("features_cli.py", "serving_cli.py", "runs.py"):
        assert "fa4lab.bench.cli" not in imported(PACKAGE / "bench" / name), name
