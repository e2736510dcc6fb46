"""What communication costs: all-reduce sweeps, the alpha-beta model, DDP steps.

The alpha-beta model here assumes a ring all-reduce over n ranks: the data is
cut into n chunks, reduce-scattered around the ring in n - 1 steps and
all-gathered in n - 1 more. So one all-reduce of S bytes takes
2(n-1) * alpha + f(n) * S / beta: alpha is the fixed latency of one step,
beta the bandwidth of a link, and f(n) = 2(n-1)/n the share of S each rank
sends (and receives). Bus bandwidth, as nccl-tests reports it, is
algbw * f(n): comparable across world sizes and with a link's speed. Other
algorithms take other steps (a tree about 2 log2 n); the model covers the ring
only, and is a model: gloo on CPU tensors runs a segmented ring (more, smaller
sends than 2(n-1) for large messages), nccl picks ring or tree by size.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from . import i18n, no_sync, timing, workload

__all__ = [
    "IMPLEMENTATIONS",
    "LINKS",
    "AlphaBeta",
    "StepModel",
    "allreduce_rounds",
    "allreduce_sweep",
    "allreduce_time",
    "bandwidths",
    "bytes_written",
    "bytes_written_per_call",
    "can_count_bytes_written",
    "fit_alpha_beta",
    "fit_step_model",
    "max_rel_error",
    "predicted_speedup",
    "ring_factor",
    "ring_steps",
    "sent_per_allreduce",
    "sent_share",
    "step_times_by_k",
]

# Lesson 05's plots.
i18n.register({
    "message_bytes": {"ja": "メッセージの大きさ [バイト]",
                      "en": "message size [bytes]"},
    "allreduce_ms": {"ja": "all-reduce 1 回の時間 [ミリ秒]",
                     "en": "one all-reduce [ms]"},
    "alpha_beta_model": {"ja": "α–β モデル", "en": "alpha-beta model"},
    "allreduce_title": {
        "ja": "all-reduce の時間: 実測と α–β モデル (2 ランク)",
        "en": "All-reduce time: measured and the alpha-beta model (2 ranks)",
    },
    "model_vs_measured": {
        "ja": "1 回の更新の時間: 実測 (点) とモデル (破線、K = 1, 2, 4 から)",
        "en": "Time per update: measured (dots), model (dashed, fitted on K = 1, 2, 4)",
    },
    "world_size_n": {"ja": "ランク数 (GPU 数)", "en": "ranks (GPUs)"},
    "speedup": {"ja": "1 ランクと比べた速度向上 (倍)", "en": "speed-up over one rank"},
    "explorer_title": {
        "ja": "モデルによる予測 (測定ではありません)",
        "en": "Predicted by the model (not a measurement)",
    },
    # Lessons 05 and 06 where /proc/self/io is missing (macOS, Windows).
    "bytes_sent_not_counted": {
        "ja": "この OS には /proc/self/io がない (Linux のものです) ため、"
              "各ランクが送ったバイト数は数えられません。2(n−1)/n の比はここでは"
              "確かめず、Linux で tests/test_comm.py が確かめます",
        "en": "This system has no /proc/self/io (it is Linux's): the bytes each rank "
              "sent cannot be counted, so the 2(n−1)/n share is not checked here; "
              "tests/test_comm.py checks it on Linux",
    },
    "bytes_written_not_counted": {
        "ja": "この OS には /proc/self/io がないため、ソケットに書き込んだバイト数は"
              "数えられません。集団通信に渡したバイト数 (上の数) は確かめました",
        "en": "This system has no /proc/self/io: the bytes written to sockets cannot "
              "be counted here; the bytes handed to collectives (above) are checked",
    },
})

# How each implementation sends a collective: "ring" is the textbook ring (NCCL's
# ring algorithm); "gloo" is torch's gloo backend, whose reduce-scatter of a
# tensor all-reduces a copy of the whole input and keeps its own chunk
# (ProcessGroupGloo::reduce_scatter_tensor_coalesced), so it sends, and takes,
# an all-reduce's worth. Its all-gather is gloo's own, the ring's share.
IMPLEMENTATIONS = ("ring", "gloo")
_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) \
            or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")


def ring_factor(world_size: int) -> float:
    """Share of the data each rank sends (and receives) in a ring all-reduce."""
    _check_world_size(world_size)
    return 2 * (world_size - 1) / world_size


def sent_share(op: str, world_size: int, implementation: str = "ring") -> float:
    """Share of a collective's whole buffer S that each rank sends.

    Ring: an all-reduce 2(n-1)/n, a reduce-scatter (of its input) or an
    all-gather (into its output) (n-1)/n, the all-reduce's two halves. Gloo
    sends the ring's shares except for the reduce-scatter, an all-reduce there.
    """
    _check_world_size(world_size)
    if op not in _COLLECTIVES:
        raise ValueError(f"op must be one of {_COLLECTIVES}, got {op!r}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    if op == "all_reduce" or (op == "reduce_scatter" and implementation == "gloo"):
        return ring_factor(world_size)
    return ring_factor(world_size) / 2


def ring_steps(world_size: int) -> int:
    """Latency steps of a ring all-reduce: n-1 reduce-scatter, n-1 all-gather."""
    _check_world_size(world_size)
    return 2 * (world_size - 1)


def allreduce_sweep(sizes: Sequence[int], repeat: int = 10,
                    dtype: torch.dtype = torch.float32) -> list[float]:
    """Median seconds of one all-reduce per message size in bytes (collective):
    the medians of allreduce_rounds."""
    return [statistics.median(r) for r in allreduce_rounds(sizes, repeat, dtype)]


def allreduce_rounds(sizes: Sequence[int], repeat: int = 10,
                     dtype: torch.dtype = torch.float32) -> list[list[float]]:
    """Seconds of one all-reduce per message size in bytes, every one of `repeat`
    timed rounds (collective).

    `dtype` is what is summed: on this course's machine gloo's float16
    all-reduce cost more per byte, and one took longer than a float32 one of
    twice its bytes (bench/README.md), so a model fitted on float32 prices it
    too low.
    """
    size = torch.empty((), dtype=dtype).element_size()
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    buffers = [torch.ones(max(1, nbytes // size), dtype=dtype, device=device)
               for nbytes in sizes]
    # The sizes take turns: a busy moment falls on one round of every size, which
    # the median drops. Timed one size after the other, a stall could inflate the
    # small sizes alone until the times stopped growing with the size, and
    # fit_alpha_beta found no bandwidth (it happened once in the ZeRO lesson). The ranks
    # line up before each call: a large all-reduce ends at different moments on
    # each rank, and without the barrier that skew fell on the next, small size
    # (4 KiB measured 3.3 ms once).
    times = timing.interleaved(
        {i: functools.partial(dist.all_reduce, x) for i, x in enumerate(buffers)},
        rounds=repeat, warmup=2, device=device, before=lambda _: dist.barrier())
    return [times[i] for i in range(len(buffers))]


def bandwidths(nbytes: float, seconds: float, world_size: int) -> tuple[float, float]:
    """(algorithm bandwidth, bus bandwidth) in bytes per second, as nccl-tests.

    busbw = algbw * 2(n-1)/n: a ring rank sends 2(n-1)/n * S bytes in time t,
    so its links carry busbw bytes per second whatever n is.
    """
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    algbw = nbytes / seconds
    return algbw, algbw * ring_factor(world_size)


def can_count_bytes_written() -> bool:
    """Whether this system tells the bytes a process wrote (Linux's /proc/self/io).

    macOS and Windows have no /proc: lessons 05 and 06 then say what they do not
    count (the messages above) and assert the rest.
    """
    return os.path.exists("/proc/self/io")


def bytes_written() -> int:
    """Bytes this process has passed to write-like system calls (Linux only)."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines() if line)
    except OSError as e:
        raise RuntimeError("counting sent bytes needs /proc/self/io (Linux)") from e
    return int(fields["wchar"])


def bytes_written_per_call(collective: Callable[[], object], repeat: int = 3) -> float:
    """Bytes this rank writes per call of `collective` (collective, Linux only).

    One untimed call first (connections, buffers), the ranks lined up around
    the count. Every write of the process counts (prints too, on ipyparallel's
    sockets): measure buffers of megabytes and print nothing inside.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    collective()
    dist.barrier()
    before = bytes_written()
    for _ in range(repeat):
        collective()
    written = (bytes_written() - before) / repeat
    dist.barrier()
    return written


def sent_per_allreduce(nbytes: int, repeat: int = 3) -> float:
    """Bytes this rank sends in one all-reduce of `nbytes`, over S (collective).

    Counted by the kernel (/proc/self/io's wchar: gloo writes to its TCP
    sockets), so it measures what the algorithm sends, headers included; a
    ring sends 2(n-1)/n of S. Other writes of the process in the meantime
    count too: use messages of megabytes.
    """
    if nbytes < 4 or repeat < 1:
        raise ValueError(f"need nbytes >= 4 and repeat >= 1, got {nbytes} and {repeat}")
    x = torch.ones(nbytes // 4)
    dist.all_reduce(x)  # warm-up: connections and buffers
    dist.barrier()
    before = bytes_written()
    for _ in range(repeat):
        dist.all_reduce(x)
    sent = (bytes_written() - before) / repeat
    dist.barrier()
    return sent / (4 * x.numel())


@dataclass
class AlphaBeta:
    """Ring all-reduce time = ring_steps(n) * alpha + ring_factor(n) * bytes / beta."""

    alpha: float  # seconds per ring step (the latency of one send)
    beta: float  # bytes per second of one link

    def time(self, nbytes: float, world_size: int) -> float:
        if world_size == 1:
            return 0.0
        return (ring_steps(world_size) * self.alpha
                + ring_factor(world_size) * nbytes / self.beta)

    def reduce_scatter_time(self, nbytes: float, world_size: int,
                            implementation: str = "ring") -> float:
        """A reduce-scatter of a `nbytes` input, as `implementation` runs it.

        Ring: the first half of the all-reduce, n-1 steps, each rank sending
        (n-1)/n of the bytes: alpha and beta are the all-reduce's own (fitted
        per step and per byte), so reduce-scatter plus all-gather of the same
        buffer price exactly one all-reduce. Gloo: a whole all-reduce
        (sent_share), the copy it reduces not priced.
        """
        whole = self.time(nbytes, world_size)
        if sent_share("reduce_scatter", world_size, implementation) \
                == sent_share("all_reduce", world_size):
            return whole  # gloo: the all-reduce itself
        return whole / 2

    def all_gather_time(self, nbytes: float, world_size: int) -> float:
        """A ring all-gather into a `nbytes` output: the all-reduce's second half."""
        return self.time(nbytes, world_size) / 2

    def broadcast_time(self, nbytes: float, world_size: int) -> float:
        """A broadcast priced as its source sending the message to each other rank.

        On 2 ranks that is one message, alpha + S / beta, where a ring
        all-reduce takes two latency steps. For more ranks a tree would take
        fewer rounds: an upper bound there.
        """
        if world_size == 1:
            return 0.0
        return (world_size - 1) * (self.alpha + nbytes / self.beta)


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float],
                   world_size: int) -> AlphaBeta:
    """Per-step alpha and beta, least squares on relative error.

    Fitted at one world size, the model extrapolates to others through the
    ring's step count and byte share (AlphaBeta.time).
    """
    if world_size < 2:
        raise ValueError("fitting needs at least 2 ranks")
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError(f"need as many times as sizes, at least 2; got {len(sizes)} "
                         f"sizes and {len(seconds)} times")
    if min(seconds) <= 0:
        raise ValueError("every time must be > 0")
    steps = float(ring_steps(world_size))
    x = torch.tensor([ring_factor(world_size) * s for s in sizes], dtype=torch.float64)
    t = torch.tensor(list(seconds), dtype=torch.float64)
    # Minimize sum(((steps * alpha + x / beta) - t) / t)^2: linear in (alpha, 1/beta).
    A = torch.stack([steps / t, x / t], dim=1)
    sol = torch.linalg.lstsq(A, torch.ones_like(t).unsqueeze(1)).solution.squeeze(1)
    alpha, inv_beta = sol.tolist()
    if inv_beta <= 0:
        raise ValueError("the times do not grow with the size: no bandwidth to fit")
    return AlphaBeta(max(alpha, 0.0), 1 / inv_beta)


@dataclass
class StepModel:
    """Time of one optimizer step of K micro-batches, from measured parts."""

    compute_s: float  # forward + backward of one micro-batch, no communication
    sync_s: float  # what one synchronization adds (all-reduce and DDP's own work)
    optimizer_s: float  # optimizer.step() and the rest of a step

    def predict(self, K: int, no_sync: bool) -> float:
        syncs = 1 if no_sync else K
        return K * self.compute_s + syncs * self.sync_s + self.optimizer_s

    def as_dict(self) -> dict:
        return asdict(self)


def fit_step_model(times: dict[int, tuple[float, float]],
                   fit_on: Sequence[int] = (1, 2, 4)) -> StepModel:
    """Fit compute, sync and optimizer time on the measured step times of `fit_on`.

    `times` maps K to (seconds with every micro-batch synchronized, seconds
    with no_sync). Each is linear in the parts: sync mode K*compute + K*sync +
    optimizer, no_sync mode K*compute + sync + optimizer. Fitting on small K
    and checking on large K tests the model on steps it has not seen.

    Each part is a time, so none may be negative: of the fits that leave
    out some parts (set to 0) and have no negative part, the one with the
    smallest error is kept (non-negative least squares, by trying every
    subset of the three parts). A free fit can make o negative when the first
    micro-batch costs less than the others (its backward writes the
    gradients; the later ones add to them).
    """
    rows, t = [], []
    for k in fit_on:
        sync_s, nosync_s = times[k]
        rows += [[k, k, 1.0], [k, 1.0, 1.0]]
        t += [sync_s, nosync_s]
    y = torch.tensor(t, dtype=torch.float64).unsqueeze(1)
    # Relative least squares: a 2 ms and a 200 ms step weigh the same.
    A = torch.tensor(rows, dtype=torch.float64) / y
    best, best_residual = [0.0, 0.0, 0.0], math.inf
    for parts in itertools.chain.from_iterable(
            itertools.combinations(range(3), n) for n in (3, 2, 1)):
        sol = torch.linalg.lstsq(A[:, list(parts)], torch.ones_like(y)).solution
        if (sol < 0).any():
            continue
        residual = (A[:, list(parts)] @ sol - 1).square().sum().item()
        if residual < best_residual:
            best, best_residual = [0.0, 0.0, 0.0], residual
            for part, value in zip(parts, sol.squeeze(1).tolist(), strict=True):
                best[part] = value
    return StepModel(*best)


def max_rel_error(model: StepModel, times: dict[int, tuple[float, float]]) -> float:
    """Worst abs(predicted - measured) / measured over every K and both modes."""
    errors = []
    for k, (sync_s, nosync_s) in times.items():
        errors.append(abs(model.predict(k, False) - sync_s) / sync_s)
        errors.append(abs(model.predict(k, True) - nosync_s) / nosync_s)
    return max(errors)


def step_times_by_k(rank: int, world_size: int, hidden: int, depth: int,
                    ks: Sequence[int] = (1, 2, 4, 8), repeat: int = 5,
                    bucket_cap_mb: float | None = None,
                    ) -> dict[int, tuple[float, float]]:
    """Measured (sync, no_sync) seconds of one optimizer step for each K.

    One model for every K, timed in turn over `repeat` rounds
    (no_sync.interleaved_step_times).
    """
    cfg = workload.Config(accum_steps=max(ks), hidden=hidden, depth=depth,
                          repeat=repeat, bucket_cap_mb=bucket_cap_mb)
    cfg.check()
    model, _ = workload.wrap(cfg)
    dataset = workload.make_dataset(cfg)
    batches = workload.micro_batches(dataset, cfg, 1, rank, world_size)
    return no_sync.interleaved_step_times(model, workload.make_optimizer(model, cfg),
                                         batches, ks, repeat)


# Nominal one-direction link bandwidths in bytes/s, from the vendors' published
# figures, for extrapolation only: they are not measured here.
LINKS = {
    "PCIe 4.0 x16": 32e9,
    "InfiniBand NDR (400 Gb/s)": 50e9,
    "NVLink 4 (H100 SXM, 900 GB/s both ways)": 450e9,
}


def predicted_speedup(world_size: int, K: int, no_sync: bool,
                      bucket_bytes: Sequence[float], compute_s: float, ab: AlphaBeta,
                      overhead_s: float = 0.0) -> float:
    """Samples per second on `world_size` ranks over one rank, by the model.

    Each rank computes K micro-batches of its own (compute_s each); every
    synchronization all-reduces `bucket_bytes` (the buckets DDP sent, as a
    comm_counting.CommCounter saw them), one after the other with no overlap,
    plus DDP's own `overhead_s`. One rank needs no communication at all.
    """
    _check_world_size(world_size)
    if K < 1:
        raise ValueError(f"K must be >= 1, got {K}")
    if not bucket_bytes or min(bucket_bytes) <= 0:
        raise ValueError(f"bucket_bytes must be non-empty and positive, got "
                         f"{list(bucket_bytes)}")
    if compute_s <= 0 or overhead_s < 0:
        raise ValueError(f"compute_s must be > 0 and overhead_s >= 0, got "
                         f"{compute_s} and {overhead_s}")
    sync_s = sum(ab.time(b, world_size) for b in bucket_bytes) + (
        overhead_s if world_size > 1 else 0.0)
    step = StepModel(compute_s, sync_s, 0.0).predict(K, no_sync)
    return world_size * K * compute_s / step


def allreduce_time(numel: int, repeat: int = 10, group=None,
                   dtype: torch.dtype = torch.float32) -> float:
    """Median seconds of one all-reduce of `numel` values of `dtype` (collective)."""
    x = torch.ones(numel, dtype=dtype)
    if dist.get_backend(group) == "nccl":
        x = x.cuda()

    def run():
        dist.all_reduce(x, group=group)

    dist.barrier(group=group)
    return timing.median_time(run, repeat=repeat, warmup=2, device=x.device)
