"""Release and autograde exercise notebooks, honouring nbgrader's conventions.

The cells carry nbgrader's metadata (`{"nbgrader": {"solution": true, "grade_id": ...}}` on a
solution cell, `{"grade": true, "locked": true, "points": n, ...}` on an autograded test cell,
`schema_version` 3), and a solution cell marks its instructor code with `### BEGIN SOLUTION` /
`### END SOLUTION`. So an instructor can run real nbgrader on the same notebooks; this module
is the small part of it the lab needs, with no Jupyter server:

- `release(src_dir, out_dir)`: copy every notebook with outputs cleared, each solution region
  replaced by nbgrader's stub (`# YOUR CODE HERE` / `raise NotImplementedError()`, indented like
  the marker, so the signature and docstring stay) and locked cells made read-only; each
  graded, solution or locked cell gets nbgrader's `checksum` (`compute_checksum`); writes
  `points.json` (points per exercise).
- `grade(notebook, solutions_from=None, release_from=None)`: execute the notebook top to bottom
  (nbclient, errors allowed, CPU is enough) and score each autograded cell: full points if it
  ran without error, else 0 with the error's message (the checks in `fa4lab.exercises` say what
  is wrong). `solutions_from` first puts back the solution cells of an instructor notebook (by
  grade_id). A locked or graded cell whose checksum no longer matches was edited by the student
  (Note [locked cells]): it is graded from the released version.

Command line: `python -m fa4lab.exercises release|grade ...` (`fa4lab.exercises.__main__`).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import re
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat

__all__ = ["BEGIN_SOLUTION", "END_SOLUTION", "CODE_STUB", "ExerciseResult", "GradeReport",
           "release", "strip_solutions", "points_of", "grade", "restore_solutions",
           "compute_checksum", "restore_locked"]

BEGIN_SOLUTION = "### BEGIN SOLUTION"
END_SOLUTION = "### END SOLUTION"
CODE_STUB = ("# YOUR CODE HERE", "raise NotImplementedError()")   # nbgrader's default stub
TEXT_STUB = "YOUR ANSWER HERE"
_NBFORMAT = 4


def _meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def _is_solution(cell) -> bool:
    return bool(_meta(cell).get("solution"))


def _is_graded(cell) -> bool:
    return bool(_meta(cell).get("grade")) and cell.cell_type == "code"


def _is_locked(cell) -> bool:
    """nbgrader's rule: a solution cell never is, a graded cell always is, any other cell when
    its metadata says `locked`."""
    meta = _meta(cell)
    if not meta or meta.get("solution", False):
        return False
    return bool(meta.get("grade", False) or meta.get("locked", False))


# Note [locked cells]
# A student can edit any cell in Jupyter, the locked ones included (`editable: false` is a hint
# to the interface, not a lock). nbgrader's release records a checksum of each graded, solution
# and locked cell; its autograder overwrites the locked cells from the instructor's copy before
# running. Here the checksum is nbgrader's own recipe (`compute_checksum`), so a release made
# here is checked by nbgrader's autograder and the other way round; `grade` compares each locked
# cell with the released one (`release_from`, or its recorded checksum when none is given) and
# grades an edited one from the released source, saying so in the report.

def compute_checksum(cell) -> str:
    """nbgrader's `utils.compute_checksum` of a cell: md5 of its source, its type, whether it is
    a grade, solution and locked cell, its grade_id, and a grade cell's points as a float."""
    meta = _meta(cell)
    if "grade_id" not in meta:
        raise ValueError(f"a {cell.cell_type} cell with nbgrader metadata has no grade_id; give "
                         f"it one (nbgrader identifies graded, solution and locked cells by it)")
    md5 = hashlib.md5()
    for part in (cell.source, cell.cell_type, str(meta.get("grade", False)),
                 str(meta.get("solution", False)), str(_is_locked(cell)), meta["grade_id"]):
        md5.update(part.encode("utf-8"))
    if meta.get("grade", False):
        md5.update(str(float(meta["points"])).encode("utf-8"))
    return md5.hexdigest()


def strip_solutions(source: str, where: str = "cell") -> str:
    """source with each BEGIN/END SOLUTION region replaced by the stub, at the marker's indent."""
    out, inside = [], None
    for line in source.splitlines():
        marker = line.strip()
        if marker == BEGIN_SOLUTION:
            if inside is not None:
                raise ValueError(f"{where}: '{BEGIN_SOLUTION}' inside another solution region")
            inside = line[:len(line) - len(line.lstrip())]
            out += [inside + stub for stub in CODE_STUB]
        elif marker == END_SOLUTION:
            if inside is None:
                raise ValueError(f"{where}: '{END_SOLUTION}' without '{BEGIN_SOLUTION}'")
            inside = None
        elif inside is None:
            out.append(line)
    if inside is not None:
        raise ValueError(f"{where}: '{BEGIN_SOLUTION}' is never closed by '{END_SOLUTION}'")
    return "\n".join(out)


def _release_notebook(nb, name: str):
    for i, cell in enumerate(nb.cells):
        where = f"{name} cell {i}"
        has_marker = BEGIN_SOLUTION in cell.source
        if has_marker and not _is_solution(cell):
            raise ValueError(f"{where} has '{BEGIN_SOLUTION}' but no nbgrader solution metadata; "
                             f'add {{"nbgrader": {{"solution": true, ...}}}} to the cell')
        if _is_solution(cell):
            if cell.cell_type == "code":
                if not has_marker:
                    raise ValueError(f"{where} is a solution cell without a '{BEGIN_SOLUTION}' "
                                     f"region: mark the lines the student writes")
                cell.source = strip_solutions(cell.source, where)
            else:
                cell.source = TEXT_STUB
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        if _meta(cell).get("locked"):
            cell.metadata["editable"] = False
            cell.metadata["deletable"] = False
        if _is_solution(cell) or _is_locked(cell):
            try:
                cell.metadata["nbgrader"]["checksum"] = compute_checksum(cell)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            cell.metadata["nbgrader"]["cell_type"] = cell.cell_type
    return nb


def points_of(nb) -> dict[str, float]:
    """{grade_id: points} of the notebook's autograded cells, in order."""
    points = {}
    for i, cell in enumerate(nb.cells):
        if _is_graded(cell):
            gid = _meta(cell).get("grade_id") or f"cell-{i}"
            if gid in points:
                raise ValueError(f"grade_id {gid!r} appears twice; each graded cell needs its own")
            points[gid] = float(_meta(cell).get("points", 0))
    return points


def ungraded(src_dir: str | Path) -> list[Path]:
    """The notebooks of src_dir without an autograded cell, sorted. (The graded ones are run whole
    by tests/test_course.py, which grades each with its solutions put back and asserts full marks
    and no cell error: `make test` runs only these under nbmake, so no notebook runs twice.)"""
    src = Path(src_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"no folder {src}")
    return [path for path in sorted(src.glob("*.ipynb"))
            if not points_of(_read(path, "notebook"))]


def release(src_dir: str | Path, out_dir: str | Path) -> dict:
    """Write the student version of every notebook of src_dir into out_dir, and points.json.

    Returns the summary written to points.json: {"notebooks": {name: {grade_id: points}},
    "total": points over all notebooks}.
    """
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    paths = sorted(src_dir.glob("*.ipynb"))
    if not paths:
        raise FileNotFoundError(f"no notebooks (*.ipynb) in {src_dir}; pass the instructor "
                                f"notebooks' folder, e.g. notebooks/")
    if out_dir.resolve() == src_dir.resolve():
        raise ValueError(f"release would overwrite the instructor notebooks in {src_dir}; "
                         f"choose another output folder, e.g. course/release")
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"notebooks": {}, "total": 0.0}
    for path in paths:
        nb = _release_notebook(nbformat.read(path, as_version=_NBFORMAT), path.name)
        nbformat.write(nb, out_dir / path.name)
        points = points_of(nb)
        if points:
            summary["notebooks"][path.name] = points
            summary["total"] += sum(points.values())
    (out_dir / "points.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def restore_solutions(nb, instructor_nb):
    """nb with every solution cell's source taken from the instructor's cell of the same
    grade_id (the reverse of `release`, for testing the autograder)."""
    sources = {_meta(c).get("grade_id"): c.source for c in instructor_nb.cells if _is_solution(c)}
    for i, cell in enumerate(nb.cells):
        if _is_solution(cell):
            gid = _meta(cell).get("grade_id")
            if gid not in sources:
                raise ValueError(f"solution cell {i} ({gid!r}) has no cell of that grade_id in "
                                 f"the instructor notebook (it has {sorted(sources)})")
            cell.source = sources[gid]
    return nb


def restore_locked(nb, released=None) -> dict[int, tuple[bool, str]]:
    """Put back every locked or graded cell of nb that was edited since the release (Note
    [locked cells]); returns {cell index: (put back?, what happened)}.

    A cell is edited when its `compute_checksum` differs from that of `released`'s cell of the
    same grade_id (the released notebook, or the instructor's: their locked cells are the
    same), or, where `released` has no such cell or is None, from the checksum the release
    recorded in it. An edited cell is replaced by the released one when there is one; else it
    stays as it is, and its note says why.
    """
    originals = {}
    if released is not None:
        originals = {_meta(c)["grade_id"]: c for c in released.cells
                     if _is_locked(c) and "grade_id" in _meta(c)}
    notes = {}
    for i, cell in enumerate(nb.cells):
        if not _is_locked(cell):
            continue
        gid = _meta(cell).get("grade_id", f"cell-{i}")
        original = originals.get(gid)
        want = compute_checksum(original) if original is not None else _meta(cell).get("checksum")
        if want is None or ("grade_id" in _meta(cell) and compute_checksum(cell) == want):
            continue
        if original is None:
            why = ("the released notebook has no cell of that grade_id" if released is not None
                   else "no released version was given to grade it from: grade with "
                        "release_from= (--release) the released or instructor notebook")
            notes[i] = False, (f"cell {i} ({gid}) was modified after the release (its "
                               f"checksum differs) and {why}")
            continue
        restored = copy.deepcopy(original)
        if restored.cell_type == "code":
            restored.outputs, restored.execution_count = [], None
        nb.cells[i] = restored
        notes[i] = True, f"cell {i} ({gid}) was modified, graded from the released version"
    return notes


@dataclass
class ExerciseResult:
    grade_id: str
    points: float
    earned: float
    message: str      # the check's summary when passed, its failure message otherwise
    note: str = ""    # what the grader did besides running the cell (Note [locked cells])


@dataclass
class GradeReport:
    notebook: str
    exercises: list[ExerciseResult]
    cell_errors: list[str] = field(default_factory=list)   # errors outside the graded cells

    @property
    def earned(self) -> float:
        return sum(e.earned for e in self.exercises)

    @property
    def possible(self) -> float:
        return sum(e.points for e in self.exercises)

    def to_json(self) -> dict:
        return {"notebook": self.notebook, "earned": self.earned, "possible": self.possible,
                "exercises": [asdict(e) for e in self.exercises], "cell_errors": self.cell_errors}

    def text(self) -> str:
        lines = [f"{self.notebook}: {self.earned:g} / {self.possible:g} points"]
        for e in self.exercises:
            mark = "ok  " if e.earned == e.points else "FAIL"
            lines.append(f"  {mark} {e.grade_id}: {e.earned:g} / {e.points:g}")
            if e.note:
                lines.append(f"       note: {e.note}")
            # a pass's summary too: it says what could not be checked here, and why
            lines += ["       " + line for line in e.message.splitlines()]
        lines += [f"  note: {err}" for err in self.cell_errors]
        return "\n".join(lines)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _error_message(outputs) -> str | None:
    for out in outputs:
        if out.get("output_type") == "error":
            return _ANSI.sub("", f"{out.get('ename')}: {out.get('evalue')}")
    return None


def _stdout(outputs) -> str:
    return "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream").strip()


def _read(path: str | Path, what: str):
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no {what} at {path}")
    return nbformat.read(path, as_version=_NBFORMAT)


@contextlib.contextmanager
def _cell_progress(nb, name: str):
    """A tqdm bar on stderr over the notebook's code cells while grading runs (25-50 s for a
    lesson): yields nbclient's on_cell_executed hook."""
    from tqdm.auto import tqdm

    cells = sum(1 for c in nb.cells if c.cell_type == "code")
    with tqdm(total=cells, desc=f"grading {name}", unit="cell", leave=False,
              file=sys.stderr) as bar:
        yield lambda **_: bar.update(1)


def _kernel_manager_class():
    """The grading kernel's manager: over IPC (unix sockets) where there are any, so nothing
    goes over TCP and the kernel says nothing of TCP without encryption on every grade; else
    nbclient's default (TCP on localhost). nbclient owns it, so it shuts the kernel down."""
    import os

    from jupyter_client.manager import AsyncKernelManager

    if os.name != "posix":
        return AsyncKernelManager

    class IpcKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.transport = "ipc"
            # absolute: the kernel runs in the notebook's folder, not ours
            self.ip = str(Path(tempfile.mkdtemp(prefix="fa4lab-grade-")) / "kernel")

    return IpcKernelManager


def grade(notebook: str | Path, *, solutions_from: str | Path | None = None,
          release_from: str | Path | None = None, timeout: int = 600,
          kernel_name: str = "python3") -> GradeReport:
    """Execute `notebook` (a student's, or a release) and score its autograded cells.

    Locked and graded cells edited since the release are graded from `release_from` (the
    released or the instructor notebook; `solutions_from` when not given), or, with neither,
    found by their checksum and scored 0 (`restore_locked`)."""
    from nbclient import NotebookClient

    path = Path(notebook)
    nb = _read(path, "notebook")
    instructor = None if solutions_from is None else _read(solutions_from, "instructor notebook")
    if instructor is not None:
        nb = restore_solutions(nb, instructor)
    released = instructor if release_from is None else _read(release_from, "released notebook")
    edited = restore_locked(nb, released)
    points = points_of(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    results, errors = [], []
    try:
        # a busy machine (a class's submissions graded side by side) starts kernels slowly:
        # nbclient's default 60 s for the kernel to answer stopped whole notebooks unrun
        with _cell_progress(nb, path.name) as done:
            NotebookClient(nb, timeout=timeout, startup_timeout=max(timeout, 300),
                           kernel_name=kernel_name, allow_errors=True,
                           kernel_manager_class=_kernel_manager_class(), on_cell_executed=done,
                           resources={"metadata": {"path": str(path.resolve().parent)}}
                           ).execute()
    except Exception as e:   # a cell past the timeout, a dead kernel: grade what ran
        errors.append(f"execution stopped: {type(e).__name__}: {str(e).splitlines()[0]}")
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        err = _error_message(cell.outputs)
        if cell.execution_count is None and not cell.outputs:
            err = err or "this cell did not run (execution stopped before it)"
        put_back, note = edited.get(i, (True, ""))
        if _is_graded(cell):
            gid = _meta(cell).get("grade_id") or f"cell-{i}"
            pts = points[gid]
            if not put_back:
                err = f"{note}; not graded"
            results.append(ExerciseResult(gid, pts, 0.0 if err else pts,
                                          err or _stdout(cell.outputs), note))
        else:
            if err and cell.execution_count is not None:
                errors.append(f"cell {i} raised {err.splitlines()[0]}")
            if note:
                errors.append(note)
    graded = {r.grade_id for r in results}
    for gid, pts in (points_of(released) if released is not None else {}).items():
        if gid not in graded:
            results.append(ExerciseResult(
                gid, pts, 0.0, f"the graded cell {gid} is missing (deleted, or its nbgrader "
                               f"metadata removed): put the released cell back and run it"))
    return GradeReport(path.name, results, errors)
