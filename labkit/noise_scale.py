"""The gradient noise scale: its two-batch estimators, an exact reference, a plot.

McCandlish et al. (2018), "An Empirical Model of Large-Batch Training",
appendix A.1. The mean gradient of B samples drawn independently, G_B, has

    E‖G_B‖² = ‖G‖² + tr(Σ) / B

(G the mean gradient over the data, Σ the covariance of one sample's
gradient). Two batch sizes give two such equations, solved here for unbiased
estimates of ‖G‖² and tr(Σ); the simple noise scale is B_simple = tr(Σ) / ‖G‖².
Under DDP the two sizes are free: each rank's gradient before the all-reduce
(b samples) and the average after it (N·b samples). The lesson captures them
in a comm hook written in its cell.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.ticker import FuncFormatter, LogLocator
from torch import nn
from torch.func import functional_call, grad, vmap

from . import i18n, plots

__all__ = [
    "estimated_norm_sq",
    "estimated_trace",
    "exact_stats",
    "per_sample_grads",
    "regression_data",
    "simple_noise_scale",
    "simulated_estimates",
    "steps_vs_batch",
]

i18n.register({
    "global_batch": {"ja": "全体バッチのサイズ B (N·b·K)",
                     "en": "global batch size B (N·b·K)"},
    "steps_to_target": {"ja": "目標の損失までのステップ数",
                        "en": "steps to the target loss"},
    "steps_vs_batch_title": {"ja": "バッチを大きくしても、ステップ数は S_min より"
                                   "減らない",
                             "en": "A larger batch saves steps, down to S_min"},
    "measured_steps": {"ja": "実測 (学習率はバッチごとに最良のもの)",
                       "en": "measured (best learning rate per batch)"},
    "paper_model": {"ja": "論文の式 S_min (1 + B_simple / B)",
                    "en": "the paper's S_min (1 + B_simple / B)"},
    "noise_scale_line": {"ja": "測ったノイズスケール B_simple = {value:.1f}",
                         "en": "measured noise scale B_simple = {value:.1f}"},
})


def estimated_norm_sq(b_small: float, b_big: float, g2_small: float,
                      g2_big: float) -> float:
    """Unbiased ‖G‖² from the squared norms of mean gradients of two batch sizes."""
    return (b_big * g2_big - b_small * g2_small) / (b_big - b_small)


def estimated_trace(b_small: float, b_big: float, g2_small: float,
                    g2_big: float) -> float:
    """Unbiased tr(Σ) from the squared norms of mean gradients of two batch sizes."""
    return (g2_small - g2_big) / (1 / b_small - 1 / b_big)


def simple_noise_scale(b_small: float, b_big: float, g2_small: float,
                       g2_big: float) -> float:
    """B_simple = tr(Σ) / ‖G‖², both estimated from the same (averaged) norms.

    Average `g2_small` and `g2_big` over many steps first: each estimate is
    unbiased, their ratio is not, and one step's tr(Σ) can even be negative.
    """
    return (estimated_trace(b_small, b_big, g2_small, g2_big)
            / estimated_norm_sq(b_small, b_big, g2_small, g2_big))


def per_sample_grads(model: nn.Module, loss_fn: Callable, X: torch.Tensor,
                     y: torch.Tensor) -> torch.Tensor:
    """One row per sample: the gradient of its loss, all parameters flattened."""
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss_of_one(p, x, t):
        return loss_fn(functional_call(model, p, (x.unsqueeze(0),)), t.unsqueeze(0))

    grads = vmap(grad(loss_of_one), in_dims=(None, 0, 0))(params, X, y)
    return torch.cat([g.reshape(len(X), -1) for g in grads.values()], dim=1)


def exact_stats(model: nn.Module, loss_fn: Callable, X: torch.Tensor,
                y: torch.Tensor) -> dict[str, float]:
    """tr(Σ), ‖G‖² and B_simple of the data set (X, y), computed exactly.

    Σ is the covariance of one sample's gradient over the n samples (divided
    by n): the one that E‖G_B‖² = ‖G‖² + tr(Σ) / B holds with when a batch
    draws its B samples uniformly, with replacement.
    """
    g = per_sample_grads(model, loss_fn, X, y).double()
    mean = g.mean(0)
    trace = (g - mean).square().sum(1).mean().item()
    norm_sq = mean.square().sum().item()
    return {"trace": trace, "norm_sq": norm_sq, "noise_scale": trace / norm_sq}


def simulated_estimates(per_sample: torch.Tensor, b: int, world_size: int,
                        steps: int, repeats: int, seed: int = 0) -> torch.Tensor:
    """B_simple as the lesson estimates it, `repeats` times, in one process.

    Each step draws b samples per rank (with replacement); the small batch's
    squared norm is averaged over the ranks and steps, the big one's (all N·b
    samples) over the steps. Their spread sizes the lesson's tolerance.
    """
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(repeats):
        idx = torch.randint(0, len(per_sample), (steps, world_size, b), generator=gen)
        small = per_sample[idx].mean(2)  # (steps, ranks, params)
        g2_small = small.square().sum(-1).mean().item()
        g2_big = small.mean(1).square().sum(-1).mean().item()
        out.append(simple_noise_scale(b, world_size * b, g2_small, g2_big))
    return torch.tensor(out)


def regression_data(n: int = 4096, features: int = 16, seed: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear task without label noise: y = X w, inputs of unequal scales.

    The inputs' standard deviations run from 1 down to 0.5, so plain gradient
    descent needs a few steps (the directions of small scale learn slowly);
    with no label noise every batch size can reach any loss above 0.
    """
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(0, torch.log10(torch.tensor(0.5)).item(), features)
    X = torch.randn(n, features, generator=g) * scales
    w = torch.randn(features, 1, generator=g)
    return X, X @ w


def steps_vs_batch(steps: Mapping[int, float], noise_scale: float,
                   s_min: float | None = None):
    """Steps to the target against the global batch, log-log, B_simple marked.

    `s_min` draws the paper's S = S_min (1 + B_noise / B) with B_noise taken
    as the measured `noise_scale`; the y axis is labelled 1, 2, 5, 10, ...
    """
    sizes: Sequence[int] = sorted(steps)

    def build():
        fig, ax = plt.subplots(figsize=(6.5, 4))
        ax.plot(sizes, [steps[b] for b in sizes], "o-",
                label=i18n.t("measured_steps"))
        if s_min is not None:
            ax.plot(sizes, [s_min * (1 + noise_scale / b) for b in sizes], "--",
                    color="gray", label=i18n.t("paper_model"))
        ax.axvline(noise_scale, color=plots.VERMILLION, linestyle=":",
                   label=i18n.t("noise_scale_line", value=noise_scale))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_locator(plt.NullLocator())
        ax.set_xticks(sizes, [f"{b:g}" for b in sizes])
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.set_xlabel(i18n.t("global_batch"))
        ax.set_ylabel(i18n.t("steps_to_target"))
        ax.set_title(i18n.t("steps_vs_batch_title"))
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        return fig

    return plots.checked_figure(build)
