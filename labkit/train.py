"""Single-process training on the teacher task, resumable from a checkpoint.

Which samples a step uses depends only on the seed and the step number, so a
run resumed from a checkpoint ends bit-identical to one never interrupted.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import checkpoint, data, models

__all__ = ["TrainConfig", "param_sha256", "train"]


@dataclass
class TrainConfig:
    """What to train and how."""

    steps: int = 50
    batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    hidden: int = 100
    depth: int = 1
    seed: int = 0
    checkpoint_every: int = 10

    def check(self) -> None:
        for name in ("steps", "batch_size", "hidden", "depth", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


def param_sha256(model: torch.nn.Module) -> str:
    """A hash of every parameter's bytes: equal hashes mean bit-identical weights."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _batch(dataset, cfg: TrainConfig, step: int):
    """The samples of `step`: each epoch is a fresh permutation fixed by the seed."""
    per_epoch = len(dataset) // cfg.batch_size
    epoch, i = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(cfg.seed * 100_003 + epoch)
    idx = torch.randperm(len(dataset), generator=g)[i * cfg.batch_size:
                                                     (i + 1) * cfg.batch_size]
    return dataset.data[idx], dataset.target[idx]


def train(cfg: TrainConfig, checkpoint_path: str | Path | None = None,
          resume: bool = False) -> dict:
    """Train `cfg.steps` steps; save every `checkpoint_every`; resume if asked."""
    cfg.check()
    if resume and checkpoint_path is None:
        raise ValueError("resume needs a checkpoint path")
    dataset = data.TeacherDataset(n=2048, seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    model = models.WideMLP(hidden=cfg.hidden, depth=cfg.depth)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    criterion = models.MyLoss()
    start, losses = 0, []
    if resume:
        state = checkpoint.load(checkpoint_path)
        if state["config"] != asdict(cfg) | {"steps": state["config"]["steps"]}:
            raise ValueError("the checkpoint was written with other settings: "
                             f"{state['config']}")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        start, losses = state["step"], list(state["losses"])
    for step in range(start, cfg.steps):
        X, y = _batch(dataset, cfg, step)
        optimizer.zero_grad()
        loss = criterion(model(X), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        done = step + 1
        if checkpoint_path and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
            checkpoint.save({"model": model.state_dict(),
                             "optimizer": optimizer.state_dict(),
                             "rng": torch.get_rng_state(), "step": done,
                             "losses": losses, "config": asdict(cfg)},
                            checkpoint_path)
    return {"steps": cfg.steps, "resumed_from": start, "losses": losses,
            "final_loss": losses[-1] if losses else None,
            "param_sha256": param_sha256(model), "config": asdict(cfg)}
