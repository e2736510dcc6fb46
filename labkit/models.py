"""The two documents' models and loss, as written and corrected.

The "as written" classes keep the documents' `x.view(-1)`, which flattens the
whole batch into one vector; the corrected ones flatten each sample instead.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "MLP",
    "MLPAsWritten",
    "MyLoss",
    "TiedMLP",
    "TwoLinear",
    "TwoLinearAsWritten",
    "WideMLP",
    "count_params",
]


def _check_input(model: nn.Module, x: torch.Tensor, features: int) -> None:
    """A clear error for a shape the model cannot take, instead of a matmul error."""
    if x.dim() < 2 or x[0].numel() != features:
        raise ValueError(
            f"{type(model).__name__} takes a batch of samples with {features} values "
            f"each, shape (batch, {features}); got shape {tuple(x.shape)}"
        )


class TwoLinearAsWritten(nn.Module):
    """Doc 000's model exactly as printed: two Linear(10, 10) after x.view(-1)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 10)
        self.fc2 = nn.Linear(10, 10)

    def forward(self, x):
        x = x.view(-1)  # the bug: a batch (N, 10) becomes one vector (N*10,)
        x = self.fc1(x)
        x = self.fc2(x)
        return x


class TwoLinear(TwoLinearAsWritten):
    """Doc 000's model, corrected: flatten each sample, keep the batch."""

    def forward(self, x):
        _check_input(self, x, self.fc1.in_features)
        x = x.flatten(1)  # (N, ...) -> (N, features)
        return self.fc2(self.fc1(x))


class MLPAsWritten(nn.Module):
    """Doc 004's model exactly as printed: Linear(10, 100), ReLU, Linear(100, 10)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 100)
        self.fc2 = nn.Linear(100, 10)

    def forward(self, x):
        x = x.view(-1)  # the bug, as in doc 000
        x = self.fc1(x)
        x = torch.relu(x)
        x = self.fc2(x)
        return x


class MLP(MLPAsWritten):
    """Doc 004's model, corrected: flatten each sample, keep the batch."""

    def forward(self, x):
        _check_input(self, x, self.fc1.in_features)
        x = x.flatten(1)
        return self.fc2(torch.relu(self.fc1(x)))


class WideMLP(nn.Module):
    """An MLP of any width and depth, for experiments where size matters."""

    def __init__(self, in_features: int = 10, hidden: int = 100, depth: int = 1,
                 out_features: int = 10):
        super().__init__()
        if min(in_features, hidden, depth, out_features) < 1:
            raise ValueError(
                "in_features, hidden, depth and out_features must all be >= 1, got "
                f"{in_features}, {hidden}, {depth}, {out_features}"
            )
        layers: list[nn.Module] = [nn.Linear(in_features, hidden), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(hidden, hidden), nn.ReLU()]
        layers.append(nn.Linear(hidden, out_features))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        _check_input(self, x, self.net[0].in_features)
        return self.net(x.flatten(1))


class TiedMLP(nn.Module):
    """Tokens in, logits out; the output layer shares the embedding's weight.

    A small model with the two things data-parallel code most often gets wrong:
    a TIED weight (registered twice, in `embed` and `head`, one tensor) and a
    FROZEN layer (`frozen`, requires_grad False: no gradient, never updated).
    """

    def __init__(self, vocab: int = 33, hidden: int = 16):
        super().__init__()
        if min(vocab, hidden) < 1:
            raise ValueError(f"vocab and hidden must be >= 1, got {vocab}, {hidden}")
        self.embed = nn.Embedding(vocab, hidden)
        self.hidden = nn.Linear(hidden, hidden)
        self.frozen = nn.Linear(hidden, hidden).requires_grad_(False)
        self.head = nn.Linear(hidden, vocab)
        self.head.weight = self.embed.weight  # tied: one (vocab, hidden) tensor

    def forward(self, tokens):
        vocab = self.embed.num_embeddings
        if tokens.dtype != torch.long or tokens.dim() != 1:
            raise ValueError(f"TiedMLP takes a batch of token ids, shape (batch,), "
                             f"dtype long; got {tuple(tokens.shape)} {tokens.dtype}")
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab):
            raise ValueError(f"token ids must be in [0, {vocab}), got "
                             f"{tokens.min().item()}..{tokens.max().item()}")
        x = torch.relu(self.hidden(self.embed(tokens)))
        return self.head(torch.tanh(self.frozen(x)))


class MyLoss(nn.Module):
    """Doc 004's custom loss: the mean squared error (same as nn.MSELoss())."""

    def forward(self, output, target):
        return torch.mean((output - target) ** 2)


def count_params(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
