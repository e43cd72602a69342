"""Lesson 01's figures and the block stepper widget."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.figure import Figure

from fa4lab.online_softmax import adversarial_inputs, online_attention, variant_errors
from fa4lab.viz.softmax import (
    BlockStepper,
    plot_exp2_poly3_error,
    plot_row_max,
    plot_variant_errors,
)


@pytest.fixture
def qkv(rng):
    return (rng.standard_normal((1, 8, 2, 8)), rng.standard_normal((1, 100, 1, 8)),
            rng.standard_normal((1, 100, 1, 8)))


def test_figures_are_figures(qkv):
    q, k, v = qkv
    t = online_attention(q, k, v, block_n=16, trace=True, rescale_threshold=8.0)
    errors = {"random": variant_errors(q, k, v, block_n=16),
              "rising 1e4": variant_errors(*adversarial_inputs("rising", seqlen_k=64), block_n=16)}
    for fig in (plot_row_max(t), plot_variant_errors(errors), plot_exp2_poly3_error()):
        assert isinstance(fig, Figure)
        assert fig.axes and fig.axes[0].has_data()
        plt.close(fig)


def test_block_stepper_moves_with_the_slider(qkv):
    q, k, v = qkv
    stepper = BlockStepper(q, k, v, block_n=16, causal=True)
    slider = stepper.controls["block"]
    assert slider.min == 1 and slider.max == 7                       # 100 keys: 6 blocks + tail
    assert slider.value == 1
    assert "after block 1</b> of 7 (keys 0..15)" in stepper.text.value
    first_png, first_text = stepper.image.value, stepper.text.value
    slider.value = 4
    assert "after block 4</b> of 7" in stepper.text.value and "after block 1" not in \
        stepper.text.value
    assert stepper.image.value != first_png and stepper.text.value != first_text
    assert "keys 48..63" in stepper.text.value                       # the fourth block
    slider.value = 7                                                  # the tail block
    assert "keys 96..99" in stepper.text.value
    # after the last block the partial output is the answer
    np.testing.assert_allclose(stepper.trace.partial_out(6), stepper.trace.out)
    for outside in (0, 8):
        with pytest.raises(ValueError, match="out of range"):
            stepper.render_block(outside)
    bundle = stepper._repr_mimebundle_()
    assert "image/png" in bundle


def test_block_stepper_counts_like_its_slider(qkv):
    """Every slider position: the label names the same block number, out of the slider's
    maximum, and its key range is that block's; the row_max plot counts blocks the same way."""
    q, k, v = qkv
    stepper = BlockStepper(q, k, v, block_n=32, causal=False)
    slider = stepper.controls["block"]
    n = len(stepper.trace.steps)
    assert (slider.min, slider.max) == (1, n)
    assert f"over {n} K/V blocks" in stepper.title
    for block in range(slider.min, slider.max + 1):
        slider.value = block
        n0, n1 = stepper.trace.blocks[block - 1]
        assert f"after block {block}</b> of {slider.max} (keys {n0}..{n1 - 1})" in \
            stepper.text.value
    fig = plot_row_max(stepper.trace)
    xs = fig.axes[0].lines[0].get_xdata()
    assert (min(xs), max(xs)) == (slider.min, slider.max)
    plt.close(fig)



def test_the_rescale_legend_entry_only_with_rescales(qkv):
    """A 'rescale event' legend entry only where markers are drawn: with every rescale skipped
    (a threshold above any rise) there is none; rescaling at every rise, there is one."""
    q, k, v = qkv

    def labels(threshold):
        t = online_attention(q, k, v, block_n=16, trace=True, rescale_threshold=threshold)
        fig = plot_row_max(t)
        found = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
        plt.close(fig)
        return found, t.rescales

    quiet, none = labels(64.0)
    assert none == 0 and "rescale event" not in quiet
    eager, some = labels(0.0)
    assert some > 0 and "rescale event" in eager
