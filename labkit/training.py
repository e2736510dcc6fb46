"""Training on the teacher task in one process: the loop of lesson 08's runs.

One loop serves every single-process experiment: batch size and learning rate,
warm-up, data order, optimizer, scheduler, model size, mixed precision, and
checkpoints that a run resumes from. Every run starts from the same weights
(fixed by the seed) and sees its samples in an order fixed by the seed and the
epoch, so two runs differ only in the knob being turned, and a resumed run
ends bit-identical to one never interrupted. The loss that measures learning
is on 1024 held-out samples, never trained on.
"""

from __future__ import annotations

import hashlib
import math
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from . import checkpoint, data, i18n, models

__all__ = [
    "OPTIMIZERS",
    "ORDERS",
    "PRECISIONS",
    "SCHEDULES",
    "TrainConfig",
    "epoch_order",
    "fit",
    "make_optimizer",
    "make_scheduler",
    "param_sha256",
    "scaled",
    "split",
]

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
SCHEDULES = ("constant", "step", "cosine", "warmup", "warmup_cosine")
ORDERS = ("shuffled", "sorted")
PRECISIONS = ("float32", "bfloat16")
HELD_OUT = 1024

i18n.register({
    "samples_seen": {"ja": "学習に使ったサンプル数", "en": "samples seen"},
    "heldout_loss": {"ja": "検証データの損失 (MSE)", "en": "held-out loss (MSE)"},
    "batch_lr_title": {
        "ja": "同じサンプル数での収束: バッチサイズと学習率",
        "en": "Same samples, different batch: convergence and learning rate",
    },
    "order_title": {
        "ja": "データの順序と収束 (バッチ 32、SGD)",
        "en": "Data order and convergence (batch 32, SGD)",
    },
    "optimizer_title": {"ja": "オプティマイザの比較", "en": "Optimizers compared"},
    "schedule_title": {
        "ja": "学習率スケジューラの比較 (Adam)",
        "en": "Learning-rate schedules compared (Adam)",
    },
    "params": {"ja": "パラメータ数", "en": "parameters"},
    "learning_rate": {"ja": "学習率", "en": "learning rate"},
    "lr_title": {
        "ja": "SGD の学習率と 320 ステップ後の検証損失",
        "en": "SGD learning rate and held-out loss after 320 steps",
    },
})


@dataclass
class TrainConfig:
    """One training run on the teacher task."""

    steps: int = 200
    batch_size: int = 32
    lr: float = 0.05
    optimizer: str = "sgd"
    momentum: float = 0.9  # of the "momentum" optimizer
    schedule: str = "constant"
    warmup_steps: int = 0
    order: str = "shuffled"
    hidden: int = 100
    depth: int = 1
    seed: int = 0
    n: int = 2048  # training samples; HELD_OUT more are held out
    eval_every: int = 10
    precision: str = "float32"  # "bfloat16": torch.autocast on the CPU
    checkpoint_every: int = 10  # with a checkpoint path

    def check(self) -> None:
        """Raise ValueError naming a bad setting."""
        for name in ("steps", "batch_size", "hidden", "depth", "n", "eval_every",
                     "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size > self.n:
            raise ValueError(f"batch_size {self.batch_size} is larger than the data "
                             f"set ({self.n} samples)")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        for name, allowed in (("optimizer", OPTIMIZERS), ("schedule", SCHEDULES),
                              ("order", ORDERS), ("precision", PRECISIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}: choose one "
                                 f"of {', '.join(allowed)}")
        warm = self.schedule.startswith("warmup")
        if warm and not 0 < self.warmup_steps < self.steps:
            raise ValueError(f"schedule {self.schedule!r} needs 0 < warmup_steps < "
                             f"steps, got warmup_steps={self.warmup_steps}")


def scaled(cfg: TrainConfig, batch_size: int, base_batch: int = 32,
           epochs: float | None = None) -> TrainConfig:
    """`cfg` at another batch size with the linear scaling rule: lr x B / base.

    With `epochs`, the step count is set so every batch size sees as many samples.
    """
    steps = cfg.steps if epochs is None else max(1, round(epochs * cfg.n / batch_size))
    return replace(cfg, batch_size=batch_size, lr=cfg.lr * batch_size / base_batch,
                   steps=steps)


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer named by `cfg.optimizer`, at learning rate `cfg.lr`."""
    params = model.parameters()
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr)
    if cfg.optimizer == "momentum":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.01)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig):
    """torch's own scheduler for `cfg.schedule`, stepped once per optimizer step."""
    sched = torch.optim.lr_scheduler
    if cfg.schedule == "constant":
        return None
    if cfg.schedule == "step":  # drop the rate to 30 % twice
        return sched.StepLR(optimizer, step_size=max(1, cfg.steps // 3), gamma=0.3)
    if cfg.schedule == "cosine":
        return sched.CosineAnnealingLR(optimizer, T_max=cfg.steps)
    warmup = sched.LinearLR(optimizer, start_factor=1 / cfg.warmup_steps,
                            total_iters=cfg.warmup_steps)
    if cfg.schedule == "warmup":
        return warmup
    cosine = sched.CosineAnnealingLR(optimizer, T_max=cfg.steps - cfg.warmup_steps)
    return sched.SequentialLR(optimizer, [warmup, cosine],
                              milestones=[cfg.warmup_steps])


def split(cfg: TrainConfig):
    """(training, held-out) samples of one teacher: ((X, y), (X_val, y_val))."""
    full = data.TeacherDataset(n=cfg.n + HELD_OUT, seed=cfg.seed)
    X, y = full.data[: cfg.n], full.target[: cfg.n]
    if cfg.order == "sorted":
        # Sorted by the first target: what a file written in some order gives
        # when nobody shuffles it. Consecutive batches then look alike.
        idx = torch.argsort(y[:, 0])
        X, y = X[idx], y[idx]
    return (X, y), (full.data[cfg.n:], full.target[cfg.n:])


def epoch_order(cfg: TrainConfig, epoch: int) -> torch.Tensor:
    """The order of the training samples in `epoch`: a fresh permutation fixed by
    the seed and the epoch, or the stored order when `cfg.order` is "sorted"."""
    if cfg.order == "sorted":
        return torch.arange(cfg.n)
    g = torch.Generator().manual_seed(cfg.seed * 100_003 + epoch)
    return torch.randperm(cfg.n, generator=g)


def param_sha256(model: nn.Module) -> str:
    """A hash of every parameter's bytes: equal hashes mean bit-identical weights."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def fit(cfg: TrainConfig, checkpoint_path: str | Path | None = None,
        resume: bool = False) -> dict:
    """Train `cfg.steps` optimizer steps; return what happened.

    Returned: the training loss of every step (`losses`), the held-out loss
    every `eval_every` steps (`steps`, `samples`, `heldout_loss`; inf if it
    overflowed), the learning rate of every step, the seconds of every step
    and of every epoch (evaluation left out), and a hash of the final weights.
    With `checkpoint_path`, the whole state is saved every `checkpoint_every`
    steps and at the end; with `resume`, the run continues from it.
    """
    cfg.check()
    if resume and checkpoint_path is None:
        raise ValueError("resume needs a checkpoint path")
    (X, y), (X_val, y_val) = split(cfg)
    torch.manual_seed(cfg.seed)
    model = models.WideMLP(hidden=cfg.hidden, depth=cfg.depth)
    optimizer = make_optimizer(model, cfg)
    scheduler = make_scheduler(optimizer, cfg)
    criterion = models.MyLoss()
    per_epoch = cfg.n // cfg.batch_size
    low = cfg.precision == "bfloat16"

    def evaluate() -> float:
        with torch.no_grad():  # no graph: evaluation needs no gradients
            loss = criterion(model(X_val), y_val).item()
        return loss if math.isfinite(loss) else math.inf

    if not resume:
        start = 0
        h = {"steps": [0], "heldout_loss": [evaluate()], "losses": [], "lr": [],
             "step_s": [], "epoch_s": []}
    else:
        state = checkpoint.load(checkpoint_path)
        if state["config"] != asdict(cfg) | {"steps": state["config"]["steps"]}:
            raise ValueError("the checkpoint was written with other settings: "
                             f"{state['config']}")
        built_for = state["config"]["steps"]
        if cfg.schedule != "constant" and built_for != cfg.steps:
            raise ValueError(f"the checkpoint's schedule {cfg.schedule!r} was built "
                             f"for {built_for} steps: resume with steps={built_for}")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])  # for models that draw (dropout)
        start, h = state["step"], state["history"]
    order = None
    for step in range(start, cfg.steps):
        epoch, i = divmod(step, per_epoch)
        if i == 0 or order is None:
            order = epoch_order(cfg, epoch)
        t0 = time.perf_counter()  # a step's time includes gathering its batch
        idx = order[i * cfg.batch_size:(i + 1) * cfg.batch_size]
        Xb, yb = X[idx], y[idx]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
            out = model(Xb)
        loss = criterion(out.float(), yb)  # the loss in float32
        loss.backward()
        optimizer.step()
        h["step_s"].append(time.perf_counter() - t0)
        h["losses"].append(loss.item())
        h["lr"].append(optimizer.param_groups[0]["lr"])
        if scheduler is not None:
            scheduler.step()
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            h["steps"].append(done)
            h["heldout_loss"].append(evaluate())
        if i == per_epoch - 1:  # an epoch ends: its steps' time, without evaluation
            h["epoch_s"].append(sum(h["step_s"][-per_epoch:]))
        if checkpoint_path and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
            checkpoint.save({"model": model.state_dict(),
                             "optimizer": optimizer.state_dict(),
                             "scheduler": (None if scheduler is None
                                           else scheduler.state_dict()),
                             "rng": torch.get_rng_state(), "step": done,
                             "history": h, "config": asdict(cfg)},
                            checkpoint_path)
    timed = h["step_s"][2:] or h["step_s"]  # the first steps warm up
    return {**h, "samples": [s * cfg.batch_size for s in h["steps"]],
            "median_step_s": statistics.median(timed) if timed else None,
            "final_loss": h["losses"][-1] if h["losses"] else None,
            "resumed_from": start, "params": models.count_params(model),
            "param_sha256": param_sha256(model), "config": asdict(cfg)}
