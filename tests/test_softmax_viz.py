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
    assert slider.min == 0 and slider.max == 6                       # 100 keys: 6 blocks + tail
    assert "after block 0</b> of 0..6" in stepper.text.value         # counted as the slider is
    first_png, first_text = stepper.image.value, stepper.text.value
    slider.value = 3
    assert "after block 3" in stepper.text.value and "after block 0" not in stepper.text.value
    assert stepper.image.value != first_png and stepper.text.value != first_text
    assert "keys 48..63" in stepper.text.value
    slider.value = 6                                                  # the tail block
    assert "keys 96..99" in stepper.text.value
    # after the last block the partial output is the answer
    np.testing.assert_allclose(stepper.trace.partial_out(6), stepper.trace.out)
    with pytest.raises(ValueError, match="out of range"):
        stepper.render_block(7)
    bundle = stepper._repr_mimebundle_()
    assert "image/png" in bundle
