"""labkit.noise_scale: the two-batch estimators, the exact reference, the plot.

The estimators are checked against the equation they solve (any sizes and
values, with hypothesis) and against gradients drawn from a known Gaussian;
the exact reference against a loop over samples; and the lesson's tolerance
against the spread of the very estimate it makes, redrawn 300 times.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import labkit
from labkit import noise_scale


@settings(max_examples=200, deadline=None)
@given(b_small=st.integers(1, 4096), factor=st.integers(2, 64),
       trace=st.floats(1e-3, 1e6), norm_sq=st.floats(1e-3, 1e6))
def test_the_estimators_solve_the_two_batch_equations(b_small, factor, trace,
                                                     norm_sq):
    """With E|G_B|² = |G|² + tr(Σ)/B exactly, both estimates are exact."""
    b_big = factor * b_small
    small, big = norm_sq + trace / b_small, norm_sq + trace / b_big
    assert math.isclose(noise_scale.estimated_trace(b_small, b_big, small, big),
                        trace, rel_tol=1e-6, abs_tol=1e-9 * (small + big) * b_small)
    assert math.isclose(noise_scale.estimated_norm_sq(b_small, b_big, small, big),
                        norm_sq, rel_tol=1e-6, abs_tol=1e-9 * big * b_big)


def test_the_estimators_are_unbiased_on_a_known_gaussian():
    """Per-sample gradients ~ N(G, diag(s²)): the averages find tr(Σ) and |G|²."""
    g = torch.Generator().manual_seed(0)
    G = torch.tensor([1.0, -2.0, 0.5, 0.0], dtype=torch.float64)
    std = torch.tensor([3.0, 1.0, 2.0, 4.0], dtype=torch.float64)
    b_small, b_big, steps = 4, 16, 20_000
    draws = G + std * torch.randn(steps, b_big, 4, generator=g, dtype=torch.float64)
    small = draws[:, :b_small].mean(1).square().sum(1).mean().item()
    big = draws.mean(1).square().sum(1).mean().item()
    trace, norm_sq = std.square().sum().item(), G.square().sum().item()
    # Standard errors over 20,000 steps: about 1% of each.
    assert noise_scale.estimated_trace(b_small, b_big, small, big) == \
        pytest.approx(trace, rel=0.03)
    assert noise_scale.estimated_norm_sq(b_small, b_big, small, big) == \
        pytest.approx(norm_sq, rel=0.05)
    assert noise_scale.simple_noise_scale(b_small, b_big, small, big) == \
        pytest.approx(trace / norm_sq, rel=0.06)
    # |G_big|² alone is biased by tr(Σ)/B_big: 30/16 on 5.25, far outside that.
    assert big == pytest.approx(norm_sq + trace / b_big, rel=0.03)
    assert big > 1.2 * norm_sq


def test_exact_stats_agree_with_a_loop_over_samples():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    X, y = torch.randn(40, 3), torch.randn(40, 2)
    loss_fn = nn.MSELoss()
    rows = []
    for i in range(len(X)):
        model.zero_grad()
        loss_fn(model(X[i:i + 1]), y[i:i + 1]).backward()
        rows.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    loop = torch.stack(rows).double()
    torch.testing.assert_close(
        noise_scale.per_sample_grads(model, loss_fn, X, y).double(), loop,
        rtol=1e-5, atol=1e-6)
    mean = loop.mean(0)
    stats = noise_scale.exact_stats(model, loss_fn, X, y)
    assert stats["trace"] == pytest.approx((loop - mean).square().sum(1).mean().item(),
                                           rel=1e-5)
    assert stats["norm_sq"] == pytest.approx(mean.square().sum().item(), rel=1e-5)
    assert stats["noise_scale"] == pytest.approx(stats["trace"] / stats["norm_sq"])
    # The whole batch's gradient is the mean of the samples' gradients.
    model.zero_grad()
    loss_fn(model(X), y).backward()
    whole = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
    torch.testing.assert_close(whole, mean, rtol=1e-5, atol=1e-6)


def test_the_lessons_tolerance_covers_300_redraws_of_its_estimate():
    """The lesson: b = 8 per rank, 2 ranks, 200 steps at zero weights, within 25%."""
    X, y = noise_scale.regression_data()
    model = nn.Linear(16, 1, bias=False)
    nn.init.zeros_(model.weight)
    per_sample = noise_scale.per_sample_grads(model, nn.MSELoss(), X, y)
    exact = noise_scale.exact_stats(model, nn.MSELoss(), X, y)["noise_scale"]
    estimates = noise_scale.simulated_estimates(per_sample, b=8, world_size=2,
                                                steps=200, repeats=300)
    worst = (estimates / exact - 1).abs().max().item()
    assert 0.05 < worst < 0.25  # measured: 0.17 (noisy, but well inside)
    # With the small batch read after the averaging, the estimate collapses.
    assert noise_scale.simple_noise_scale(8, 16, 3.0, 3.0) == 0


def test_regression_data_is_the_same_for_a_seed_and_has_no_label_noise():
    X, y = noise_scale.regression_data(n=64)
    X2, y2 = noise_scale.regression_data(n=64)
    assert torch.equal(X, X2) and torch.equal(y, y2)
    w = torch.linalg.lstsq(X, y).solution
    assert (X @ w - y).abs().max() < 1e-4  # a linear model fits it exactly


@pytest.mark.parametrize("lang", ["ja", "en"])
def test_the_plot_marks_the_noise_scale_in_both_languages(lang):
    labkit.set_lang(lang)
    fig = noise_scale.steps_vs_batch({2: 45.3, 8: 13.3, 64: 4.0}, 17.4, s_min=3.3)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("17.4" in label for label in labels)
    assert ax.get_xlabel() == labkit.i18n.t("global_batch")
    assert len(ax.lines) == 3  # measured, the paper's curve, the noise scale
