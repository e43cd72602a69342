"""python -m fa4lab.exercises release SRC_DIR OUT_DIR | grade NOTEBOOK [--solutions-from NB] ... |
ungraded DIR

release: the student notebooks (solutions stubbed, outputs cleared, locked cells checksummed)
and points.json.
grade: execute a notebook and print the points per exercise with each failing check's message
(--json: the same as JSON); a locked cell the student edited is graded from the released
notebook (--release). Grading exits 0 whatever the score; a missing file is exit 2.
ungraded: the notebooks of DIR without an autograded cell, one path a line (`make test` runs
these under nbmake; the graded ones run whole when tests/test_course.py grades them with their
solutions put back).
"""

from __future__ import annotations

import argparse
import json
import sys

from fa4lab.exercises import notebook


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fa4lab.exercises",
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rel = sub.add_parser("release", help="write the student notebooks and points.json")
    rel.add_argument("src_dir", help="the instructor notebooks, e.g. notebooks/")
    rel.add_argument("out_dir", help="where the release goes, e.g. course/release")
    gra = sub.add_parser("grade", help="execute a notebook and score its autograded cells")
    gra.add_argument("notebook")
    gra.add_argument("--solutions-from", metavar="INSTRUCTOR_NB",
                     help="put back this notebook's solution cells first (by grade_id)")
    gra.add_argument("--release", metavar="RELEASED_NB",
                     help="grade locked cells the student edited from this notebook (the "
                          "released or instructor one; default: --solutions-from)")
    gra.add_argument("--json", action="store_true", help="print the report as JSON")
    gra.add_argument("--timeout", type=int, default=600, help="seconds per cell (600)")
    ung = sub.add_parser("ungraded", help="list the notebooks without an autograded cell")
    ung.add_argument("src_dir")
    args = parser.parse_args(argv)
    try:
        if args.command == "ungraded":
            for path in notebook.ungraded(args.src_dir):
                print(path)
            return 0
        if args.command == "release":
            summary = notebook.release(args.src_dir, args.out_dir)
            for name, points in summary["notebooks"].items():
                listed = ", ".join(f"{gid} {p:g}" for gid, p in points.items())
                print(f"{name}: {listed}")
            print(f"released into {args.out_dir}: {summary['total']:g} points in all "
                  f"(points.json)")
            return 0
        report = notebook.grade(args.notebook, solutions_from=args.solutions_from,
                                release_from=args.release, timeout=args.timeout)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_json(), indent=1) if args.json else report.text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
