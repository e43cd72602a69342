"""The H200's L2 size is stated once, in fa4lab.hardware (Note [H200 L2]), and the device agrees."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fa4lab.hardware import H200_L2_BYTES, H200_L2_SOURCES, h200_l2_text

ROOT = Path(__file__).resolve().parents[1]
# The GH100 L2 figures written out (the full die's and the H100 SXM5's): "60 MB", "50MiB",
# in bytes, or H200_L2_BYTES's own expression. Other sizes near "L2" (a 256 MiB call, FA4's
# 50 MiB K/V budget in fa4lab.tiling) are other quantities.
FIGURE = re.compile(r"\b[56]0\s?(MB|MiB)\b|\b(62914560|52428800)\b|\b60 \* 1024 \* 1024\b")


def _texts():
    for pattern in ("fa4lab/**/*.py", "notebooks/*.ipynb", "notebooks/*.md", "*.md",
                    "benchmarks/*.md"):
        for path in ROOT.glob(pattern):
            if path.name != "hardware.py":
                yield path, path.read_text()


def test_no_other_file_states_an_l2_size():
    found = []
    for path, text in _texts():
        for line_no, line in enumerate(text.splitlines(), 1):
            if "L2" in line and FIGURE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{line_no}: {line.strip()}")
    assert not found, ("an L2 size is written out outside fa4lab/hardware.py; read "
                       "H200_L2_BYTES or show h200_l2_text() instead:\n" + "\n".join(found))


def test_both_figures_are_named_with_their_sources():
    text = h200_l2_text()
    assert str(H200_L2_BYTES) in text and f"{H200_L2_BYTES / 2**20:g} MiB" in text
    assert "as the device reports it" in text and "as the datasheet gives it" in text
    assert all(s in text for s in H200_L2_SOURCES)


@pytest.mark.sm90
def test_the_h200_reports_the_recorded_l2():
    import torch

    name = torch.cuda.get_device_name(0)
    if "H200" not in name:
        pytest.skip(f"{name} is not an H200: Note [H200 L2] records the H200's figure")
    reported = torch.cuda.get_device_properties(0).L2_cache_size
    assert reported == H200_L2_BYTES, (
        f"{name} reports L2_cache_size = {reported} bytes; fa4lab.hardware.H200_L2_BYTES says "
        f"{H200_L2_BYTES}: correct H200_L2_BYTES and its source (Note [H200 L2])")
