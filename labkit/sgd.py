"""Training knobs on the teacher task: batch size, learning rate, warm-up, data
order, optimizer, scheduler and model size, with loss on held-out data.

Every run starts from the same weights (fixed by the seed) and sees samples in
an order fixed by the seed, so two runs differ only in the knob being turned.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from . import data, i18n, models, timing

__all__ = [
    "OPTIMIZERS",
    "ORDERS",
    "SCHEDULES",
    "SGDConfig",
    "fit",
    "make_optimizer",
    "make_scheduler",
    "scaled",
    "step_time",
    "step_times",
    "throughput",
]

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
SCHEDULES = ("constant", "step", "cosine", "warmup", "warmup_cosine")
ORDERS = ("shuffled", "sorted")

i18n.register({
    "batch_size": {"ja": "バッチサイズ", "en": "batch size"},
    "samples_per_s": {"ja": "1 秒あたりのサンプル数", "en": "samples per second"},
    "throughput_by_batch": {
        "ja": "バッチサイズごとの処理速度 (学習ステップ)",
        "en": "Training throughput by batch size",
    },
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
    "model_size_title": {
        "ja": "モデルの大きさと 1 ステップの時間 (バッチ 256)",
        "en": "Model size and time per step (batch 256)",
    },
})


@dataclass
class SGDConfig:
    """One training run on the teacher task."""

    steps: int = 200
    batch_size: int = 32
    lr: float = 0.05
    optimizer: str = "sgd"
    schedule: str = "constant"
    warmup_steps: int = 0
    order: str = "shuffled"
    hidden: int = 100
    depth: int = 1
    seed: int = 0
    n: int = 2048  # training samples; 1024 more are held out
    eval_every: int = 10

    def check(self) -> None:
        for name in ("steps", "batch_size", "hidden", "depth", "n", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size > self.n:
            raise ValueError(f"batch_size {self.batch_size} is larger than the data "
                             f"set ({self.n} samples)")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        for name, allowed in (("optimizer", OPTIMIZERS), ("schedule", SCHEDULES),
                              ("order", ORDERS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}: choose one "
                                 f"of {', '.join(allowed)}")
        warm = self.schedule.startswith("warmup")
        if warm and not 0 < self.warmup_steps < self.steps:
            raise ValueError(f"schedule {self.schedule!r} needs 0 < warmup_steps < "
                             f"steps, got warmup_steps={self.warmup_steps}")


def scaled(cfg: SGDConfig, batch_size: int, base_batch: int = 32,
           epochs: float | None = None) -> SGDConfig:
    """`cfg` at another batch size with the linear scaling rule: lr x B / base.

    With `epochs`, the step count is set so every batch size sees as many samples.
    """
    steps = cfg.steps if epochs is None else max(1, round(epochs * cfg.n / batch_size))
    return replace(cfg, batch_size=batch_size, lr=cfg.lr * batch_size / base_batch,
                   steps=steps)


def make_optimizer(model: nn.Module, cfg: SGDConfig) -> torch.optim.Optimizer:
    """The optimizer named by `cfg.optimizer`, at learning rate `cfg.lr`."""
    params = model.parameters()
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr)
    if cfg.optimizer == "momentum":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.01)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: SGDConfig):
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


def _data(cfg: SGDConfig):
    """Training and held-out samples of one teacher (same seed, one draw)."""
    full = data.TeacherDataset(n=cfg.n + 1024, seed=cfg.seed)
    X, y = full.data[: cfg.n], full.target[: cfg.n]
    if cfg.order == "sorted":
        # Sorted by the first target: what a file written in some order gives
        # when nobody shuffles it. Consecutive batches then look alike.
        idx = torch.argsort(y[:, 0])
        X, y = X[idx], y[idx]
    return (X, y), (full.data[cfg.n:], full.target[cfg.n:])


def _order(cfg: SGDConfig, epoch: int) -> torch.Tensor:
    if cfg.order == "sorted":
        return torch.arange(cfg.n)
    g = torch.Generator().manual_seed(cfg.seed * 100_003 + epoch)
    return torch.randperm(cfg.n, generator=g)


def fit(cfg: SGDConfig) -> dict:
    """Train; return held-out loss every `eval_every` steps and the time per epoch.

    Held-out loss is on 1024 samples never trained on, so it measures learning,
    not the luck of the last batch. A loss that overflows is reported as inf.
    """
    cfg.check()
    (X, y), (X_val, y_val) = _data(cfg)
    torch.manual_seed(cfg.seed)
    model = models.WideMLP(hidden=cfg.hidden, depth=cfg.depth)
    optimizer = make_optimizer(model, cfg)
    scheduler = make_scheduler(optimizer, cfg)
    criterion = models.MyLoss()
    per_epoch = cfg.n // cfg.batch_size

    def evaluate() -> float:
        with torch.no_grad():  # no graph: evaluation needs no gradients
            loss = criterion(model(X_val), y_val).item()
        return loss if math.isfinite(loss) else math.inf

    steps, losses, lrs, epoch_s = [0], [evaluate()], [], []
    t_epoch, t_eval = time.perf_counter(), 0.0
    for step in range(cfg.steps):
        epoch, i = divmod(step, per_epoch)
        idx = _order(cfg, epoch)[i * cfg.batch_size:(i + 1) * cfg.batch_size]
        optimizer.zero_grad()
        criterion(model(X[idx]), y[idx]).backward()
        optimizer.step()
        lrs.append(optimizer.param_groups[0]["lr"])
        if scheduler is not None:
            scheduler.step()
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            t0 = time.perf_counter()
            steps.append(step + 1)
            losses.append(evaluate())
            t_eval += time.perf_counter() - t0
        if i == per_epoch - 1:  # an epoch ends: its time, without evaluation
            epoch_s.append(time.perf_counter() - t_epoch - t_eval)
            t_epoch, t_eval = time.perf_counter(), 0.0
    return {"steps": steps, "samples": [s * cfg.batch_size for s in steps],
            "heldout_loss": losses, "lr": lrs, "epoch_s": epoch_s,
            "params": models.count_params(model), "config": asdict(cfg)}


def _training_step(hidden: int, depth: int, batch_size: int):
    """One SGD training step of a WideMLP on random data, as a callable."""
    torch.manual_seed(0)
    model = models.WideMLP(hidden=hidden, depth=depth)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    X, y = torch.randn(batch_size, 10), torch.randn(batch_size, 10)
    criterion = models.MyLoss()

    def step():
        optimizer.zero_grad()
        criterion(model(X), y).backward()
        optimizer.step()

    return step


def step_time(hidden: int, depth: int, batch_size: int, repeat: int = 5) -> float:
    """Median seconds of one SGD training step of a WideMLP on random data."""
    return timing.median_time(_training_step(hidden, depth, batch_size),
                              repeat=repeat, warmup=2)


def step_times(widths, depth: int = 1, batch_size: int = 256, rounds: int = 7,
               steps: int = 10) -> dict[int, list[float]]:
    """Seconds per training step of a WideMLP of each width, in every round.

    The widths take turns, `steps` steps at a time, so that a shared
    machine's changing load falls on all of them alike.
    """
    step_fns = {w: _training_step(w, depth, batch_size) for w in widths}

    def run(step):
        for _ in range(steps):
            step()

    times = timing.interleaved({w: (lambda s=s: run(s)) for w, s in step_fns.items()},
                               rounds=rounds, warmup=1)
    return {w: [t / steps for t in ts] for w, ts in times.items()}


def throughput(batch_sizes, hidden: int = 100, depth: int = 1,
               repeat: int = 5) -> dict[int, float]:
    """Training samples per second at each batch size."""
    return {b: b / step_time(hidden, depth, b, repeat) for b in batch_sizes}
