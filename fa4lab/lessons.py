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
           "tensor-memory columns, P aliasing S, the 512-column budget, head_dim 256 with one Q "
           "tile and two S buffers; graded: the TMEM allocator", "CPU"),
    Lesson("04_roles_and_barriers.ipynb", "Warp roles and the mbarrier graph",
           "warp roles, the protocol table, a simulated timeline, a data-carrying simulation where "
           "a removed barrier corrupts the output, mutation checks; graded: the barrier list of a "
           "new role", "CPU"),
    Lesson("05_b200_kernel.ipynb", "The B200 forward kernel in the CuTe DSL",
           "a ladder of four kernels (one MMA, scores only, one Q tile with two S buffers, the "
           "full kernel), the kernel role by role in excerpts, compiled for sm_100a, PTX/SASS "
           "and the audit; graded: a softcap score_mod",
           "CPU compile; B200 to run"),
    Lesson("06_hopper_port.ipynb", "The Hopper port",
           "the same design with wgmma and registers, validated on an H100/H200; graded: a "
           "chunked-local mask_mod",
           "CPU compile; Hopper GPU to run"),
    Lesson("07_correctness_and_throughput.ipynb", "Correctness and throughput",
           "tile widgets, recompile, check, benchmark beside the peers",
           "CPU plan and records; GPU to measure"),
    Lesson("08_design_your_variant.ipynb", "Design your variant",
           "a sliding window, softcap, document mask_mod, head_dim (192, 128) or pack-GQA decode "
           "through the plan report (evidence, assumptions, contract, a falsifiable experiment, "
           "risks), the kernel's hooks, compile and audit, validation and the experiment; "
           "graded: prediction_held",
           "CPU plan, compile, audit, simulation; GPU to validate and measure"),
    Lesson("09_ring_attention.ipynb", "Ring attention: the online softmax across GPUs",
           "context parallelism: the (out, lse) merge across devices, the ring loop simulated "
           "and over gloo, zig-zag vs contiguous sharding, a modelled timeline and scaling "
           "efficiency from 128k to 1M tokens",
           "CPU (gloo, model); 2+ GPUs to measure (NCCL, not yet measured)"),
    Lesson("10_backward.ipynb", "The backward pass",
           "why the forward keeps O and LSE, not P; D = rowsum(dO * O) and the five MMAs of a "
           "tile; key blocks outside and three ways to accumulate dQ (a model); the backward's "
           "TMEM map at head_dim 64 and 128; the B200 backward's plan (roles, SMEM, the barrier "
           "protocol, a modelled timeline) and upstream's 2-CTA MMA; graded: one tile's "
           "backward step",
           "CPU (float64; costs, TMEM and the plan are a model); the sm90 backward kernel on "
           "H100/H200"),
)


BEGIN, END = "<!-- lessons:begin -->\n", "\n<!-- lessons:end -->"


def lesson_table_markdown() -> str:
    """The table notebook 00 shows and the README carries between `<!-- lessons:begin -->` and
    `<!-- lessons:end -->` (`python -m fa4lab.lessons` writes it there; a test keeps them
    equal)."""
    rows = ["| notebook | what it teaches | runs on |", "|---|---|---|"]
    rows += [f"| `{x.notebook}` {x.title} | {x.teaches} | {x.tier} |" for x in LESSONS]
    return "\n".join(rows)


def write_readme(path) -> bool:
    """Put `lesson_table_markdown()` between the lessons markers of the README at `path`,
    touching nothing else; True when the file changed."""
    from pathlib import Path

    path = Path(path)
    text = path.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"{path} needs exactly one {BEGIN.strip()} and one {END.strip()} line")
    head, rest = text.split(BEGIN)
    new = head + BEGIN + lesson_table_markdown() + END + rest.split(END, 1)[1]
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    from pathlib import Path

    readme = Path(__file__).resolve().parents[1] / "README.md"
    print(f"{readme.name}: " + ("lesson table rewritten" if write_readme(readme)
                                else "lesson table already up to date"))
