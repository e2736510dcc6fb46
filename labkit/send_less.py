"""Ways to send less than DDP's plain all-reduce, on one workload, side by side.

Each method is DDP on the same model and data with one change: a comm hook
that compresses (fp16, PowerSGD at rank r), ZeroRedundancyOptimizer, or one of
DDP's switches. Every method's gradients go through a Python comm hook (plain
DDP through torch's default hook in its Python form, `allreduce_hook`), so a
comm_counting.CollectiveLog sees every byte handed to `dist.all_reduce` and
`dist.broadcast`. `compare_methods` trains the methods in turn, one step of
each at a time, and returns what each sent, how long its steps took, its loss
and the memory its gradients and optimizer state hold.
"""

from __future__ import annotations

import contextlib
import functools
import math
import statistics
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from . import comm, comm_counting, i18n, models, timing, workload

__all__ = ["METHODS", "Sent", "bucket_counts", "build",
           "compare_methods", "error_feedback_trial", "hidden_s", "hides",
           "large_config", "no_communication", "optimizer_state_bytes",
           "predicted_step_s", "storage_bytes"]

# Lesson 06's table and plots of the methods side by side.
i18n.register({
    "levers_title": {"ja": "通信を減らす方法の比較 (大きな MLP、2 ランク)",
                     "en": "Ways to send less, side by side (large MLP, 2 ranks)"},
    "sent_per_step": {"ja": "1 ステップに送るバイト数", "en": "bytes sent per step"},
    "step_ms_median": {"ja": "1 ステップの時間 [ミリ秒]", "en": "time per step [ms]"},
    "final_loss": {"ja": "最後の損失 (全データ)", "en": "final loss (all data)"},
    "memory_mib": {"ja": "勾配・バケット・オプティマイザの状態 [MiB]",
                   "en": "gradients, buckets, optimizer state [MiB]"},
    "levers_loss_title": {"ja": "方法ごとの学習曲線", "en": "Training loss by method"},
})

# PowerSGD sends plain all-reduces for its first steps (start_powerSGD_iter,
# at least 2 with error feedback): the warm-up.
POWERSGD_WARMUP = 10
# One bucket for PowerSGD: with two, its all-reduces of P and Q ran in different
# orders on the two ranks of a gloo group, and the run aborted or hung.
ONE_BUCKET_MB = 100

METHODS = ("DDP", "fp16", "PowerSGD r=1", "PowerSGD r=2", "PowerSGD r=4",
           "gradient_as_bucket_view", "static_graph", "DDP + Adam", "ZeRO + Adam")


def large_config(**changes) -> workload.Config:
    """Lesson 05's large MLP (hidden 1024, depth 3), one micro-batch per step."""
    return workload.Config(**{"hidden": 1024, "depth": 3, "accum_steps": 1, **changes})


class Sent(NamedTuple):
    """What one step handed to collectives, all-reduces and broadcasts apart.

    They cost differently: in a ring all-reduce every rank sends, in a
    broadcast only the source does.
    """

    all_reduce_bytes: int
    all_reduce_calls: int
    broadcast_bytes: int = 0
    broadcast_calls: int = 0

    @classmethod
    def of(cls, log: comm_counting.CollectiveLog) -> Sent:
        """What `log` has recorded since its last reset."""
        return cls(log.nbytes("all_reduce"), log.count("all_reduce"),
                   log.nbytes("broadcast"), log.count("broadcast"))


class _Buffers:
    """A comm hook around another that keeps the bucket buffers it was handed."""

    def __init__(self, hook, state):
        self.hook, self.state, self.storages = hook, state, {}

    @staticmethod
    def run(buffers, bucket):  # unannotated: DDP rejects string annotations
        storage = bucket.buffer().untyped_storage()
        buffers.storages[storage.data_ptr()] = storage.nbytes()
        return buffers.hook(buffers.state, bucket)


def storage_bytes(model: nn.Module, buffers: dict[int, int] | None = None) -> int:
    """Bytes of the distinct storages behind the gradients and the bucket buffers.

    With `gradient_as_bucket_view=True` each `.grad` is a view into DDP's
    bucket, so the two share storage and count once.
    """
    found = dict(buffers or {})
    for p in model.parameters():
        if p.grad is not None:
            storage = p.grad.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return sum(found.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's optimizer state (ZeRO: of the shard this rank updates)."""
    zero = isinstance(optimizer, ZeroRedundancyOptimizer)
    local = optimizer.optim if zero else optimizer
    return sum(v.numel() * v.element_size() for state in local.state.values()
               for v in state.values() if torch.is_tensor(v))


def build(name: str, cfg: workload.Config
          ) -> tuple[DDP, torch.optim.Optimizer, _Buffers]:
    """Method `name` of METHODS on a new model: DDP model, optimizer, comm hook."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    kwargs = {"bucket_cap_mb": cfg.bucket_cap_mb}
    hook, state = default_hooks.allreduce_hook, None
    if name == "fp16":
        hook = default_hooks.fp16_compress_hook
    elif name.startswith("PowerSGD"):
        kwargs["bucket_cap_mb"] = ONE_BUCKET_MB
        hook = powersgd.powerSGD_hook
        state = powersgd.PowerSGDState(
            None, matrix_approximation_rank=int(name.split("=")[1]),
            start_powerSGD_iter=POWERSGD_WARMUP)
    elif name in ("gradient_as_bucket_view", "static_graph"):
        kwargs[name] = True
    model = DDP(workload.make_model(cfg), **kwargs)
    buffers = _Buffers(hook, state)
    model.register_comm_hook(buffers, _Buffers.run)
    # The Adam pair compares with each other only: Adam at its usual 1e-3.
    if name == "ZeRO + Adam":
        optimizer = ZeroRedundancyOptimizer(model.parameters(),
                                            optimizer_class=torch.optim.Adam, lr=1e-3)
    elif name == "DDP + Adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        optimizer = workload.make_optimizer(model, cfg)
    return model, optimizer, buffers


def compare_methods(names: Sequence[str] = METHODS, cfg: workload.Config | None = None,
                    steps: int = 40, local: bool = False) -> dict[str, dict]:
    """Run on every rank: each method for `steps` steps, one step of each in turn.

    Every method starts from the same weights and sees this rank's same
    micro-batch at each step; the ranks start each timed step together.
    Returns per method: "bytes" and "calls" per step (lists: PowerSGD's
    warm-up shows), "sent" (per step, a Sent: all-reduces and broadcasts
    apart), "wire" (per step, the bytes this rank wrote to its sockets, or
    None where /proc/self/io is missing), "step_s" (median after the warm-up),
    "loss" (the ranks' mean, per step), "final_loss" (on the whole data set),
    "grad_bytes" and "state_bytes" (the memory of gradients and buckets, and
    of the optimizer state, on this rank).

    With `local=True`, each round also takes, right after each method's step,
    the same step of a copy of the method sending nothing (`no_communication`)
    and returns its median as "local_step_s": the method's local work, timed
    under the same load as its step. A method's minus DDP's (DDP + Adam's for
    ZeRO) is the compute it adds, `predicted_step_s`'s `added_compute_s`.
    """
    if steps < POWERSGD_WARMUP + 2:
        raise ValueError(f"steps must be at least {POWERSGD_WARMUP + 2} (PowerSGD's "
                         f"warm-up, then its first compressed step), got {steps}")
    cfg = cfg or large_config()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dataset = workload.make_dataset(cfg)
    criterion = models.MyLoss()
    # Each step's micro-batch, the same for every method; made before the clock runs.
    batches = [workload.micro_batches(dataset, cfg, step, rank, world_size)[0]
               for step in range(steps)]
    runs = {}
    for name in names:
        model, optimizer, buffers = build(name, cfg)
        runs[name] = {"model": model, "optimizer": optimizer, "buffers": buffers,
                      "bytes": [], "calls": [], "sent": [], "wire": [], "loss": []}
    copies = {name: build(name, cfg)[:2] for name in names} if local else {}
    counts_wire = comm.can_count_bytes_written()
    sent = comm_counting.CollectiveLog()

    def train_step(run: dict) -> None:
        X, y = batches[len(run["loss"])]  # the loss list grows by one per step
        run["optimizer"].zero_grad()
        run["last_loss"] = loss = criterion(run["model"](X), y)
        loss.backward()
        run["optimizer"].step()

    def local_step(model: DDP, optimizer: torch.optim.Optimizer) -> None:
        X, y = batches[0]  # the values do not change the work
        with no_communication():
            optimizer.zero_grad()
            criterion(model(X), y).backward()
            optimizer.step()

    def before(name: str | tuple[str, str]) -> None:
        dist.barrier()
        if isinstance(name, tuple):  # a copy sending nothing
            return
        sent.reset()
        runs[name]["buffers"].storages.clear()  # DDP rebuilds its buckets after step 1
        runs[name]["written"] = comm.bytes_written() if counts_wire else 0

    def after(name: str | tuple[str, str]) -> None:
        if isinstance(name, tuple):
            return
        run = runs[name]
        run["wire"].append(comm.bytes_written() - run["written"] if counts_wire
                           else None)
        run["bytes"].append(sent.nbytes())
        run["calls"].append(len(sent.calls))
        run["sent"].append(Sent.of(sent))
        run["loss"].append(run["last_loss"].item())

    fns: dict = {}
    for name, run in runs.items():
        fns[name] = functools.partial(train_step, run)
        if local:
            fns[name, "local"] = functools.partial(local_step, *copies[name])
    with sent:
        times = timing.interleaved(fns, rounds=steps, warmup=0, before=before,
                                   after=after)
    out = {}
    for name, run in runs.items():
        losses = torch.tensor(run["loss"])
        dist.all_reduce(losses)
        with torch.no_grad():
            final = criterion(run["model"].module(dataset.data), dataset.target).item()
        out[name] = {
            "bytes": run["bytes"], "calls": run["calls"], "sent": run["sent"],
            "wire": run["wire"],
            "step_s": statistics.median(times[name][POWERSGD_WARMUP + 1:]),
            "loss": (losses / world_size).tolist(), "final_loss": final,
            "grad_bytes": storage_bytes(run["model"], run["buffers"].storages),
            "state_bytes": optimizer_state_bytes(run["optimizer"]),
        }
        if local:
            out[name]["local_step_s"] = statistics.median(
                times[name, "local"][POWERSGD_WARMUP + 1:])
    return out


def bucket_counts(caps: Sequence[float | None], cfg: workload.Config | None = None,
                  steps: int = 3) -> dict[float | None, list[int]]:
    """Run on every rank: DDP's all-reduces per step for each `bucket_cap_mb`.

    None is DDP's own default (25 MB, with a first bucket of 1 MB). DDP sends
    its first step as one bucket, then rebuilds its buckets.
    """
    cfg = cfg or large_config()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    X, y = workload.micro_batches(workload.make_dataset(cfg), cfg, 0, rank,
                                  world_size)[0]
    out = {}
    for cap in caps:
        model = DDP(workload.make_model(cfg), bucket_cap_mb=cap)
        counter = comm_counting.CommCounter().attach(model)
        out[cap] = []
        for _ in range(steps):
            counter.reset()
            models.MyLoss()(model(X), y).backward()
            out[cap].append(counter.calls)
    return out


def hides(name: str) -> bool:
    """Whether method `name`'s all-reduces can overlap the backward, as DDP's do.

    PowerSGD runs in one bucket (ONE_BUCKET_MB), ready only when the backward
    has ended: nothing left to hide its all-reduces behind.
    """
    return name.split(" r=")[0] != "PowerSGD"


def predicted_step_s(ddp_step_s: float, ddp_sent: Sent, sent: Sent,
                     ab: comm.AlphaBeta, world_size: int,
                     added_compute_s: float = 0.0, chain_wait_s: float = 0.0, *,
                     sent_ab: comm.AlphaBeta | None = None, ddp_hidden_s: float = 0.0,
                     hides: bool = True) -> float:
    """Lesson 05's step model with a compression factor: a method's step time.

    DDP's measured step with its communication, `ddp_sent` (what DDP's step
    handed to collectives), swapped for the method's `sent`: each all-reduce
    an equal share of the all-reduced bytes, timed as a ring all-reduce, and
    each broadcast an equal share of the broadcast bytes, timed as one source
    sending (AlphaBeta.broadcast_time). By default the model knows only what
    is sent: the compute a method adds (casting, PowerSGD's products and
    orthogonalization) is not in it, nor how much of DDP's communication the
    backward pass hid. `added_compute_s`, the seconds the method's local work
    adds to DDP's (`compare_methods(..., local=True)`'s "local_step_s", the
    method's minus DDP's), is added to the step; it may be negative (ZeRO
    updates only its shard). `chain_wait_s`, what the method's all-reduces
    issued one after the other in future callbacks add beyond their
    alpha-beta time and that compute (PowerSGD's P and Q; measured apart by
    `callback_chain.chain_wait_s`), is added too.

    `sent_ab` prices the method's all-reduces where what they sum costs
    otherwise than DDP's float32 (fp16's: gloo's float16 all-reduce costs
    more per byte here; `comm.allreduce_sweep(..., dtype=torch.float16)`).
    `ddp_hidden_s` is what of DDP's communication its backward hid
    (`hidden_s`): a method whose all-reduces overlap the backward as DDP's do
    (`hides`) hides as much, at most its own all-reduces' time; one that
    sends only after the backward (PowerSGD in one bucket, `hides=False`)
    hides none. Broadcasts
    (ZeRO's, in the optimizer's step) are never hidden.
    """
    for name, value in (("added_compute_s", added_compute_s),
                        ("chain_wait_s", chain_wait_s), ("ddp_hidden_s", ddp_hidden_s)):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number of seconds, "
                             f"got {value!r}")
    if ddp_hidden_s < 0:
        raise ValueError(f"ddp_hidden_s must be >= 0 (hidden_s), got {ddp_hidden_s!r}")

    def all_reduces(s: Sent, model: comm.AlphaBeta) -> float:
        if not s.all_reduce_calls:
            return 0.0
        return s.all_reduce_calls * model.time(s.all_reduce_bytes / s.all_reduce_calls,
                                               world_size)

    def broadcasts(s: Sent) -> float:
        if not s.broadcast_calls:
            return 0.0
        return s.broadcast_calls * ab.broadcast_time(
            s.broadcast_bytes / s.broadcast_calls, world_size)

    ddp, mine = Sent(*ddp_sent), Sent(*sent)
    own = all_reduces(mine, sent_ab or ab)
    hidden = min(ddp_hidden_s, own) if hides else 0.0
    return (ddp_step_s - all_reduces(ddp, ab) - broadcasts(ddp) + ddp_hidden_s
            + own - hidden + broadcasts(mine) + added_compute_s + chain_wait_s)


def hidden_s(ddp_step_s: float, ddp_local_step_s: float, ddp_sent: Sent,
             ab: comm.AlphaBeta, world_size: int) -> float:
    """What of DDP's communication its backward hid: local step + alpha-beta - step.

    Never below 0: a step longer than its local work and its all-reduces'
    alpha-beta time holds overhead the model leaves in every method's step.
    """
    return max(0.0, ddp_local_step_s + predicted_step_s(0.0, Sent(0, 0), ddp_sent, ab,
                                                         world_size) - ddp_step_s)


class _Done:
    """The handle of a collective that did nothing: complete, its tensor as is."""

    def __init__(self, tensor: torch.Tensor):
        self._future = torch.futures.Future()
        self._future.set_result([tensor])

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


@contextlib.contextmanager
def no_communication() -> Iterator[None]:
    """While active, `dist.all_reduce` and `dist.broadcast` send nothing.

    Each returns at once, leaving its tensor as it is (a complete handle when
    asked for one): every comm hook and ZeRO's broadcasts go through them, so a
    step under it does a method's local work only. DDP's C++ code calls the
    process group past them (its broadcast when built, static_graph's first
    step), and so does any other collective.
    """
    originals = dist.all_reduce, dist.broadcast

    def nothing(tensor=None, *args, async_op=False, **kwargs):  # ZeRO: tensor=...
        return _Done(tensor) if async_op else None

    dist.all_reduce, dist.broadcast = nothing, nothing
    try:
        yield
    finally:
        dist.all_reduce, dist.broadcast = originals


def error_feedback_trial(use_error_feedback: bool, steps: int = 40, n: int = 16,
                         r: int = 1) -> list[float]:
    """Run on every rank: what PowerSGD's error feedback gives back, step by step.

    A layer whose gradient is the same n x n matrix C at every step, sent by
    PowerSGD at rank `r` after a warm-up of 2 steps. Returns, for each step
    after the warm-up, how far the sum of the gradients applied so far is from
    the true sum k C, relative to it. Without error feedback what the rank-r
    approximation drops is lost at every step; with it, it is added to the
    next step's gradient, so the sum catches up.
    """
    torch.manual_seed(0)
    target = torch.randn(n, n)  # the same on every rank: the mean is C too
    model = DDP(nn.Linear(n, n, bias=False))
    state = powersgd.PowerSGDState(None, matrix_approximation_rank=r,
                                   start_powerSGD_iter=2,
                                   use_error_feedback=use_error_feedback)
    model.register_comm_hook(state, powersgd.powerSGD_hook)
    applied, errors = torch.zeros(n, n), []
    for step in range(steps):
        model.zero_grad()
        # model(I) is W transposed, so the loss is sum(W * C): its gradient is C
        (model(torch.eye(n)) * target.T).sum().backward()
        if step >= 2:
            applied += model.module.weight.grad
            k = step - 1
            errors.append(((applied - k * target).norm() / (k * target).norm()).item())
    return errors
