"""The notebook sequence: one table, read by notebook 00 and checked against notebooks/."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Lesson:
    notebook: str
    title: str
    teaches: str
    tier: str


LESSONS = (
    Lesson("00_start_here.ipynb", "Start here", "the map of the lab and what this machine can run",
           "CPU"),
    Lesson("01_online_softmax.ipynb", "The online-softmax state machine",
           "naive -> safe -> online softmax, exp2, conditional rescaling, LSE, failure modes; "
           "graded: update_state, merge_states", "CPU"),
    Lesson("02_tiles_masks_gqa.ipynb", "Tiles, masks, GQA and scheduling",
           "SKIP/FULL/MASKED/TAIL tiles, sliding windows, pack-GQA, persistent and LPT schedules; "
           "graded: n_block_range, the tile classifier", "CPU"),
    Lesson("03_tmem_layout.ipynb", "The TMEM layout of S, P and O",
           "tensor-memory columns, P aliasing S, the 512-column budget", "CPU"),
    Lesson("04_roles_and_barriers.ipynb", "Warp roles and the mbarrier graph",
           "warp roles, the protocol table, a simulated timeline, a data-carrying simulation where "
           "a removed barrier corrupts the output, mutation checks", "CPU"),
    Lesson("05_b200_kernel.ipynb", "The B200 forward kernel in the CuTe DSL",
           "the kernel role by role, compiled for sm_100a, PTX/SASS and the audit",
           "CPU compile; B200 to run"),
    Lesson("06_hopper_port.ipynb", "The Hopper port",
           "the same design with wgmma and registers, validated on an H100/H200",
           "CPU compile; Hopper GPU to run"),
    Lesson("07_correctness_and_throughput.ipynb", "Correctness and throughput",
           "tile widgets, recompile, check, benchmark beside the peers",
           "CPU plan and records; GPU to measure"),
)


def lesson_table_markdown() -> str:
    """The table notebook 00 shows and the README carries between `<!-- lessons:begin -->` and
    `<!-- lessons:end -->` (`python -m fa4lab.lessons` prints it; a test keeps them equal)."""
    rows = ["| notebook | what it teaches | runs on |", "|---|---|---|"]
    rows += [f"| `{x.notebook}` {x.title} | {x.teaches} | {x.tier} |" for x in LESSONS]
    return "\n".join(rows)


if __name__ == "__main__":
    print(lesson_table_markdown())
