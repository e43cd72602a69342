"""How much of the sm100 kernel's code the sm90 kernel also runs, by module, in lines of code.

    python -m fa4lab.kernels.sharing           # the markdown table the README shows
    python -m fa4lab.kernels.sharing --json

No B200 has run the sm100 kernel; the sm90 kernel runs on an H200. Whatever the sm100 kernel
shares with the sm90 kernel (the tile scheduler, the pack-GQA views, the protocol emitter) is
compiled into the sm90 kernel too and so is validated on the H200; the rest only a B200 can
test. This module measures that share from the source text: it parses the files with `ast` and
imports neither the kernels nor the CuTe DSL, so it runs on any machine in under a second.

The rule, per kernel (`kernels/fwd_sm100.py`, `kernels/fwd_sm90.py`):

* Entry point: the kernel class, the class of the kernel file with a `@cute.kernel` method, as
  a whole: every method, the host side (`__init__` reading the plan, `__call__` building the
  layouts and launching) included, since it is what builds the device code.
* Reachable: anything a reachable function references by name, transitively, through every
  module of `fa4lab.kernels` it imports (`from fa4lab.kernels.device import scheduler` then
  `scheduler.block_range`, `from ... import OnlineSoftmax`, `import ... as mask_mod`, relative
  and function-local imports), resolving `module.attr` through the import aliases. Names bound
  inside the function (arguments, assignments) shadow module names; type annotations are not
  references. A module-level constant that a function reads brings in what its initialiser
  references.
* Classes are taken whole and conservatively: a class that is referenced is reachable with all
  of its methods (no type inference: `self.sites.bar_sync(...)` is covered because `Sites` is
  referenced where `self.sites` is made, and every method of `Sites` then counts).
* Not counted: module-level code (imports, constants) and module-level functions no reachable
  function references. The sm90 kernel's reach only decides the "also run" column; code that
  only the sm90 kernel reaches is not in the table at all.

A function's lines of code are its non-blank, non-comment lines (decorators and nested
functions included, docstrings excluded, found with the tokenizer), each line counted once: a
class's own lines are its header and class-level statements, its methods count as functions. A
function reachable from both kernels counts as shared; one only the sm100 kernel reaches counts
as sm100-only wherever it lives (`kernels/device/` included).
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import tokenize
from dataclasses import asdict, dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]
SM100 = "kernels/fwd_sm100.py"
SM90 = "kernels/fwd_sm90.py"

_NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
             tokenize.ENCODING, tokenize.ENDMARKER}
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


@dataclass(frozen=True)
class Row:
    """One module's part of the sm100 kernel's code, in lines of code."""

    module: str                    # relative to the package, e.g. "kernels/fwd_sm100.py"
    lines_sm100: int               # lines the sm100 kernel reaches
    lines_shared: int              # of those, lines the sm90 kernel reaches too
    functions_sm100_only: tuple[str, ...]   # qualified names only the sm100 kernel reaches

    @property
    def share(self) -> float:
        return self.lines_shared / self.lines_sm100 if self.lines_sm100 else 0.0


@dataclass(frozen=True)
class _Mod:
    """A module or package by dotted name (it may lie outside the analysed package)."""

    name: str


@dataclass(frozen=True)
class _Sym:
    """A name looked up in a module's top level."""

    module: str
    name: str


@dataclass
class _Module:
    name: str                      # dotted, e.g. "fa4lab.kernels.device.scheduler"
    rel: str                       # relative to the package directory
    is_package: bool
    code_lines: frozenset[int]     # lines of code, docstrings taken out
    defs: dict[str, ast.AST]       # top-level functions and classes
    imports: dict[str, _Mod | _Sym]
    assigns: dict[str, list[ast.expr]]


@dataclass(frozen=True)
class _Unit:
    """A counted piece of code: a top-level function, a class's own lines, or a method."""

    node: ast.AST
    lines: int
    members: tuple[str, ...]       # a class's methods (qualified names)


def _code_lines(source: str) -> frozenset[int]:
    """Lines holding at least one token that is not a comment or layout."""
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in _NOT_CODE:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return frozenset(lines)


def _span(node) -> set[int]:
    """The lines of a definition, its decorators included."""
    start = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
    return set(range(start, node.end_lineno + 1))


def _docstring_lines(node) -> set[int]:
    lines: set[int] = set()
    for n in ast.walk(node):
        if isinstance(n, _DEFS) and n.body and isinstance(n.body[0], ast.Expr):
            value = n.body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                lines.update(range(n.body[0].lineno, n.body[0].end_lineno + 1))
    return lines


def _top_level(stmts):
    """Module-level statements, looking inside if / try / with blocks but not into definitions."""
    for s in stmts:
        yield s
        if isinstance(s, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody"):
                yield from _top_level(getattr(s, field, []))
            for handler in getattr(s, "handlers", []):
                yield from _top_level(handler.body)


def _children(node):
    """Child nodes, without type annotations (they are not references)."""
    for field, value in ast.iter_fields(node):
        if field in ("annotation", "returns"):
            continue
        if isinstance(value, ast.AST):
            yield value
        elif isinstance(value, list):
            yield from (v for v in value if isinstance(v, ast.AST))


def _local_names(node) -> set[str]:
    """Names a function binds itself (one scope for it and its nested functions)."""
    names: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.arg):
            names.add(n.arg)
        elif isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            names.add(n.id)
        elif isinstance(n, _DEFS) and n is not node:
            names.add(n.name)
    return names


class _Package:
    """The package's modules under `<package>.kernels`, parsed on demand, and their units."""

    def __init__(self, package_dir: Path):
        self.dir = package_dir
        self.name = package_dir.name
        self.scope = f"{self.name}.kernels"
        self._modules: dict[str, _Module | None] = {}
        self._assign_refs: dict[tuple[str, str], set] = {}
        self._units: dict[tuple[str, str], _Unit] = {}
        self._edges: dict[tuple[str, str], set] = {}

    # ---- modules ----
    def _paths(self, dotted: str) -> tuple[Path, Path] | None:
        parts = dotted.split(".")
        if parts[0] != self.name:
            return None
        base = self.dir.joinpath(*parts[1:])
        return base.parent / f"{base.name}.py", base

    def _owns(self, dotted: str) -> bool:
        return dotted == self.scope or dotted.startswith(self.scope + ".")

    def _is_module(self, dotted: str) -> bool:
        if self.scope.startswith(dotted + "."):      # a package on the way down to `kernels`
            return True
        paths = self._paths(dotted)
        return self._owns(dotted) and paths is not None and (paths[0].is_file()
                                                             or paths[1].is_dir())

    def module(self, dotted: str) -> _Module | None:
        if dotted not in self._modules:
            self._modules[dotted] = self._load(dotted)
        return self._modules[dotted]

    def module_of(self, rel: str) -> _Module:
        dotted = ".".join([self.name, *Path(rel).with_suffix("").parts])
        mod = self.module(dotted)
        if mod is None:
            raise FileNotFoundError(f"{rel}: no such module under {self.scope}")
        return mod

    def _load(self, dotted: str) -> _Module | None:
        paths = self._paths(dotted)
        if not self._owns(dotted) or paths is None:
            return None
        file, package = paths
        is_package = not file.is_file()
        if is_package:
            file = package / "__init__.py"
            if not file.is_file():
                return None
        source = file.read_text()
        tree = ast.parse(source, filename=str(file))
        mod = _Module(dotted, file.relative_to(self.dir).as_posix(), is_package,
                      _code_lines(source) - _docstring_lines(tree), {}, {}, {})
        for s in _top_level(tree.body):
            if isinstance(s, _DEFS):
                mod.defs[s.name] = s
            elif isinstance(s, (ast.Import, ast.ImportFrom)):
                mod.imports.update(self._bindings(mod, s))
            elif isinstance(s, (ast.Assign, ast.AnnAssign)) and s.value is not None:
                targets = s.targets if isinstance(s, ast.Assign) else [s.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            mod.assigns.setdefault(n.id, []).append(s.value)
        return mod

    def _bindings(self, mod: _Module, stmt) -> dict[str, _Mod | _Sym]:
        """What an import statement binds, as module or symbol references."""
        if isinstance(stmt, ast.Import):
            return {a.asname or a.name.split(".")[0]: _Mod(a.name if a.asname
                                                           else a.name.split(".")[0])
                    for a in stmt.names}
        base = stmt.module or ""
        if stmt.level:
            parts = mod.name.split(".")
            package = parts if mod.is_package else parts[:-1]
            package = package[:len(package) - (stmt.level - 1)]
            base = ".".join(package + ([stmt.module] if stmt.module else []))
        return {a.asname or a.name: self._attr(base, a.name) for a in stmt.names
                if a.name != "*"}

    def _attr(self, module: str, name: str) -> _Mod | _Sym:
        sub = f"{module}.{name}"
        return _Mod(sub) if self._is_module(sub) else _Sym(module, name)

    # ---- name resolution ----
    def _deref(self, target):
        """Follow a symbol through re-exporting imports to where it is bound."""
        seen = set()
        while isinstance(target, _Sym) and target not in seen:
            seen.add(target)
            mod = self.module(target.module)
            if mod is None or target.name in mod.defs or target.name not in mod.imports:
                break
            target = mod.imports[target.name]
        return target

    def _targets(self, target, attrs: list[str]) -> set[tuple[str, str]]:
        """The units `target.attr1.attr2...` reaches."""
        target = self._deref(target)
        for attr in attrs:
            if not isinstance(target, _Mod):
                break
            target = self._deref(self._attr(target.name, attr))
        if isinstance(target, _Mod):      # a module used as a value: all of it, conservatively
            mod = self.module(target.name)
            return {(mod.name, n) for n in mod.defs} if mod else set()
        if isinstance(target, _Sym):
            mod = self.module(target.module)
            if mod is None:
                return set()
            if target.name in mod.defs:
                return {(mod.name, target.name)}
            if target.name in mod.assigns:
                return self._assigned(mod, target.name)
        return set()

    def _assigned(self, mod: _Module, name: str) -> set[tuple[str, str]]:
        key = (mod.name, name)
        if key not in self._assign_refs:
            self._assign_refs[key] = set()       # a cycle ends here
            refs = set()
            for value in mod.assigns[name]:
                refs |= self._refs(mod, value, {}, set())
            self._assign_refs[key] = refs
        return self._assign_refs[key]

    def _refs(self, mod: _Module, node, local_imports: dict, local_names: set[str]):
        """Units referenced by name inside `node`."""
        out: set[tuple[str, str]] = set()

        def resolve(name: str):
            if name in local_imports:
                return local_imports[name]
            if name in local_names:
                return None
            return _Sym(mod.name, name)

        def visit(n):
            if isinstance(n, ast.Attribute):
                attrs, base = [], n
                while isinstance(base, ast.Attribute):
                    attrs.append(base.attr)
                    base = base.value
                if not isinstance(base, ast.Name):
                    visit(base)
                    return
                target = resolve(base.id)
                if target is not None:
                    out.update(self._targets(target, attrs[::-1]))
                return
            if isinstance(n, ast.Name):
                target = resolve(n.id) if isinstance(n.ctx, ast.Load) else None
                if target is not None:
                    out.update(self._targets(target, []))
                return
            for child in _children(n):
                visit(child)

        visit(node)
        return out

    def _function_refs(self, mod: _Module, node) -> set[tuple[str, str]]:
        local_imports: dict = {}
        for n in ast.walk(node):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                local_imports.update(self._bindings(mod, n))
        return self._refs(mod, node, local_imports, _local_names(node) - set(local_imports))

    # ---- units and reachability ----
    def unit(self, key: tuple[str, str]) -> _Unit:
        if key not in self._units:
            self._build(key)
        return self._units[key]

    def _build(self, key: tuple[str, str]) -> None:
        mod = self.module(key[0])
        top, _, member = key[1].partition(".")
        node = mod.defs[top]
        lines = _span(node)
        members: tuple[str, ...] = ()
        if isinstance(node, ast.ClassDef) and not member:
            methods = [s for s in node.body if isinstance(s, (ast.FunctionDef,
                                                              ast.AsyncFunctionDef))]
            for m in methods:
                lines -= _span(m)
            members = tuple(f"{top}.{m.name}" for m in methods)
            edges = set().union(*[self._refs(mod, s, {}, set()) for s in node.body
                                  if s not in methods],
                                *[self._refs(mod, x, {}, set())
                                  for x in node.bases + node.keywords + node.decorator_list])
            edges |= {(mod.name, m) for m in members}
        else:
            if member:
                node = next(s for s in node.body if isinstance(s, _DEFS) and s.name == member)
                lines = _span(node)
            edges = self._function_refs(mod, node)
        self._units[key] = _Unit(node, len(lines & mod.code_lines), members)
        self._edges[key] = edges

    def kernel_classes(self, rel: str) -> list[tuple[str, str]]:
        """The classes of a kernel file that have a `@cute.kernel` method."""
        mod = self.module_of(rel)

        def is_kernel(d):
            return (isinstance(d, ast.Attribute) and d.attr == "kernel") or (
                isinstance(d, ast.Name) and d.id == "kernel")

        keys = [(mod.name, name) for name, node in mod.defs.items()
                if isinstance(node, ast.ClassDef)
                and any(is_kernel(d) for s in node.body if isinstance(s, ast.FunctionDef)
                        for d in s.decorator_list)]
        if not keys:
            raise ValueError(f"{rel}: no class with a @cute.kernel method (the kernel class)")
        return keys

    def reach(self, rel: str) -> set[tuple[str, str]]:
        """Every unit reachable from the kernel class of `rel`."""
        todo = self.kernel_classes(rel)
        seen = set(todo)
        while todo:
            key = todo.pop()
            self.unit(key)
            for nxt in self._edges[key] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen


def share(package_dir: Path | str | None = None, sm100: str = SM100,
          sm90: str = SM90) -> list[Row]:
    """One row per module holding code the sm100 kernel reaches: the kernel file first."""
    pkg = _Package(Path(package_dir) if package_dir is not None else PACKAGE_DIR)
    reach_sm100, reach_sm90 = pkg.reach(sm100), pkg.reach(sm90)
    by_module: dict[str, list[tuple[str, str]]] = {}
    for key in reach_sm100:
        by_module.setdefault(key[0], []).append(key)
    rows = []
    for name, keys in by_module.items():
        keys.sort(key=lambda k: (pkg.unit(k).node.lineno, k[1]))
        lines = {k: pkg.unit(k).lines for k in keys}
        rows.append(Row(module=pkg.module(name).rel,
                        lines_sm100=sum(lines.values()),
                        lines_shared=sum(n for k, n in lines.items() if k in reach_sm90),
                        functions_sm100_only=tuple(k[1] for k in keys if k not in reach_sm90)))
    return sorted(rows, key=lambda r: (r.module != sm100, r.module))


def totals(rows: list[Row]) -> Row:
    """The sum over `rows`; its sm100-only names are qualified as "module:name"."""
    return Row(module="total",
               lines_sm100=sum(r.lines_sm100 for r in rows),
               lines_shared=sum(r.lines_shared for r in rows),
               functions_sm100_only=tuple(f"{r.module}:{f}" for r in rows
                                          for f in r.functions_sm100_only))


def _percent(row: Row) -> str:
    return f"{100 * row.share:.0f}%" if row.lines_sm100 else "-"


def markdown(rows: list[Row]) -> str:
    """The table: module | lines of the sm100 kernel | of which the sm90 kernel runs | share."""
    out = ["| module | lines in the sm100 kernel's device code "
           "| of which also run by the sm90 kernel | share |",
           "|---|---:|---:|---:|"]
    for r in rows:
        out.append(f"| `{r.module}` | {r.lines_sm100} | {r.lines_shared} | {_percent(r)} |")
    t = totals(rows)
    out.append(f"| **total** | **{t.lines_sm100}** | **{t.lines_shared}** "
               f"| **{_percent(t)}** |")
    return "\n".join(out) + "\n"


def _as_json(rows: list[Row]) -> str:
    def record(r: Row) -> dict:
        return {**asdict(r), "functions_sm100_only": list(r.functions_sm100_only),
                "share": round(r.share, 4)}

    return json.dumps({"rows": [record(r) for r in rows], "total": record(totals(rows))},
                      indent=2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m fa4lab.kernels.sharing",
        description="How much of the sm100 kernel's code the sm90 kernel also runs, by module.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    args = parser.parse_args(argv)
    rows = share()
    print(_as_json(rows) if args.json else markdown(rows).rstrip("\n"))


if __name__ == "__main__":
    main()
