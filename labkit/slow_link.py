"""A slow link you can dial: each all-reduce takes alpha + bytes / beta longer.

On one machine the ranks talk over loopback, far faster than a network. A
`SlowLink(alpha_s, beta_Bps)`, while active, holds back the completion of
every `dist.all_reduce` by the time a link of latency `alpha_s` (seconds) and
bandwidth `beta_Bps` (bytes per second) would take to carry it, on top of the
real collective. DDP's Python comm hooks all send through `dist.all_reduce`
(allreduce_hook, fp16_compress_hook, PowerSGD's P, Q and its uncompressed
tensors), so any of them runs over the link unchanged, and the bytes priced
are what the hook hands over: the compressed payload (2 bytes per element
for fp16; P and Q for PowerSGD), the tensor of the all-reduce. A DDP model
with no comm hook registered all-reduces inside the reducer, in C++, and is
not slowed (no call is recorded): register `default_hooks.allreduce_hook`,
DDP's default in its Python form, as send_less.build does.

The link is serial, like a wire: a collective's delay starts when the real
collective is done and the one before it has left the link. The delay is
waited on the link's own threads (a pool that lives on), never on the thread
that completes the collective: gloo completes futures and runs their
callbacks on its worker threads (two by default, ProcessGroupGloo's
`threads`, serving one queue), and a sleep there would hold one of the two,
and with it the collectives queued behind it. The callbacks of a delayed
future (a comm hook's next steps: PowerSGD's products) then run on the link's
thread, which takes the rank's `torch.set_num_threads` first:
`torch.set_num_threads(1)` in the main thread did not reach a new thread's MKL
products here (torch 2.13, measured: 1.9 CPU seconds per second of a batched
product), and PowerSGD's gradients over the link then differed from the
loopback's by 3.5e-10 (tests/test_slow_link.py).

The hand-off to the link's thread and back costs each all-reduce a little
on top of the rule (`own_cost_s` measures it); the step model over the link
adds it per all-reduce (bench/README.md, `levers_link_own_cost_s`).

Each call's record names the thread that let it complete (`LinkCall.thread`),
written on that thread before the future completes. A `.then` attached after
the call returns cannot tell: on a future already complete it runs at once,
on the caller's thread.
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import math
import os
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import comm, i18n

__all__ = ["LinkCall", "SlowLink", "combined", "crossover_bandwidth", "link_time",
           "own_cost_s", "steps_over_links"]

i18n.register({
    "slow_link_describe": {
        "ja": "遅いリンク: all-reduce 1 回ごとに、実際の通信のあとに α + バイト数 / β "
              "を足しています (α = {alpha_ms:g} ms、β = {beta_MBps:g} MB/s)",
        "en": "Slow link: each all-reduce takes alpha + bytes / beta longer than the "
              "real one (alpha = {alpha_ms:g} ms, beta = {beta_MBps:g} MB/s)",
    },
    # The lesson's plot of the methods' steps against the link's bandwidth.
    "link_beta_MBps": {"ja": "リンクの帯域 β [MB/s]", "en": "link bandwidth β [MB/s]"},
    "step_over_ddp": {"ja": "1 ステップの時間 (DDP に対する比)",
                      "en": "step time over DDP's"},
    "slow_link_ratio_title": {"ja": "遅いリンクでの 1 ステップ (大きな MLP、2 ランク)",
                              "en": "Steps over a slow link (large MLP, 2 ranks)"},
    # The lesson's plot of every timed round, per link.
    "loopback": {"ja": "ループバック", "en": "loopback"},
    "link_rounds_title": {"ja": "リンクごとの 1 ステップ: 測ったすべての回 (ランク 0)",
                          "en": "Steps per link: every timed round (rank 0)"},
})


def _check(alpha_s: float, beta_Bps: float) -> None:
    if not isinstance(alpha_s, (int, float)) or not math.isfinite(alpha_s) \
            or alpha_s < 0:
        raise ValueError(f"alpha_s must be a finite number of seconds >= 0, "
                         f"got {alpha_s!r}")
    if not isinstance(beta_Bps, (int, float)) or math.isnan(beta_Bps) \
            or beta_Bps <= 0:
        raise ValueError(f"beta_Bps must be bytes per second > 0 (inf: no "
                         f"bandwidth term), got {beta_Bps!r}")


def link_time(nbytes: float, alpha_s: float, beta_Bps: float) -> float:
    """Seconds the link adds to one all-reduce of `nbytes`: alpha + bytes / beta."""
    _check(alpha_s, beta_Bps)
    return alpha_s + nbytes / beta_Bps


def combined(ab: comm.AlphaBeta, alpha_s: float, beta_Bps: float,
             world_size: int) -> comm.AlphaBeta:
    """The fitted all-reduce model with the link added to every all-reduce.

    `combined(ab, a, b, n).time(S, n) == ab.time(S, n) + link_time(S, a, b)`
    for every S: alpha grows by a / ring_steps(n), 1 / beta by
    1 / (ring_factor(n) * b). Broadcasts are not delayed by the link, so its
    broadcast_time is not the link's.
    """
    _check(alpha_s, beta_Bps)
    steps, share = comm.ring_steps(world_size), comm.ring_factor(world_size)
    return comm.AlphaBeta(alpha=ab.alpha + alpha_s / steps,
                          beta=1 / (1 / ab.beta + 1 / (share * beta_Bps)))


def crossover_bandwidth(points: Sequence[tuple[float, float]]) -> float | None:
    """The bandwidth below which a method's step is shorter than DDP's.

    `points` are (beta in bytes/s, the method's step over DDP's), beta
    increasing. Going down from the fastest link, the first pair of points
    where the ratio drops from 1 or more to under 1 holds the crossover,
    interpolated in log beta and log ratio. Infinity where the ratio is under
    1 at every point, None where it never is.
    """
    betas = [beta for beta, _ in points]
    if not points or any(b <= a for a, b in zip(betas, betas[1:], strict=False)) \
            or any(not beta > 0 or not ratio > 0 for beta, ratio in points):
        raise ValueError(f"points must be (beta > 0, ratio > 0) pairs, beta "
                         f"increasing, got {points!r}")
    if all(ratio < 1 for _, ratio in points):
        return math.inf
    for (b0, r0), (b1, r1) in zip(points[-2::-1], points[::-1], strict=False):
        if r0 < 1 <= r1:
            f = math.log(r0) / (math.log(r0) - math.log(r1))
            return math.exp(math.log(b0) + f * (math.log(b1) - math.log(b0)))
    return None


# The threads that wait out the delays and complete the delayed futures, whose
# callbacks (a comm hook's next steps) then run there. They live on: with a
# thread started per call (threading.Timer) the link's own cost was 0.34-0.36
# ms per all-reduce and 1.1 ms for PowerSGD's chain of three, against
# 0.22-0.26 and 0.5 ms with these (2026-12-06, 2 ranks, delay 0, medians of
# 200; own_cost_s measures the first). Up to 32: a callback may wait on the
# next delayed all-reduce, holding its thread (PowerSGD's P and Q), so the
# pool must not run out while one waits; idle threads are reused, so only a
# few are ever started.
@functools.cache
def _waiters() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(32, thread_name_prefix="slow_link")


# A process forked from one that used the link has none of its threads
# (Windows has no fork, nor this hook).
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_waiters.cache_clear)


class LinkCall(NamedTuple):
    """One all-reduce over the link: its bytes, the delay the rule adds, the hold.

    Measured: `held_s`, from the real collective's end to the moment the link
    let it complete (the delay, plus any wait for the link to be free), and
    `late_s`, how much later than the link's schedule that was (the link's
    thread waking late on a busy machine). `thread`: the name of the thread
    that let it complete (a `slow_link...` one for `async_op=True`; the
    caller's for a blocking call, which waits where it was called).
    """

    nbytes: int
    delay_s: float
    held_s: float
    late_s: float
    thread: str


class _DelayedWork:
    """An all-reduce's handle whose future completes when the link lets it."""

    def __init__(self, future: torch.futures.Future):
        self._future = future

    def get_future(self) -> torch.futures.Future:
        return self._future

    def wait(self, timeout=None) -> bool:
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()


class SlowLink:
    """`with SlowLink(alpha_s, beta_Bps) as link:` slows every all-reduce down.

    `link.calls` lists a LinkCall per all-reduce since the last `reset()`.
    """

    def __init__(self, alpha_s: float, beta_Bps: float):
        _check(alpha_s, beta_Bps)
        self.alpha_s, self.beta_Bps = float(alpha_s), float(beta_Bps)
        self.calls: list[LinkCall] = []
        self._lock = threading.Lock()
        self._free_at = 0.0  # perf_counter time when the link is free again
        self._original = None

    def describe(self) -> str:
        """What the link adds, in the learner's language."""
        return i18n.t("slow_link_describe", alpha_ms=self.alpha_s * 1e3,
                      beta_MBps=self.beta_Bps / 1e6)

    def reset(self) -> None:
        """Forget the calls so far."""
        with self._lock:
            self.calls = []

    def added_s(self) -> float:
        """Seconds of delay the rule added to the calls so far (their sum)."""
        return sum(call.delay_s for call in self.calls)

    def __enter__(self) -> SlowLink:
        if self._original is not None:
            raise RuntimeError("this SlowLink is already active")
        self._original = dist.all_reduce
        dist.all_reduce = self._slowed(self._original)
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._original
        self._original = None

    def _hold(self, nbytes: int, done_at: float) -> tuple[float, float]:
        """Book the link for one call: (its delay, when it may complete)."""
        delay = link_time(nbytes, self.alpha_s, self.beta_Bps)
        with self._lock:
            release = max(done_at, self._free_at) + delay
            self._free_at = release
        return delay, release

    def _record(self, nbytes: int, delay: float, done_at: float,
                release: float) -> None:
        now, thread = time.perf_counter(), threading.current_thread().name
        with self._lock:
            self.calls.append(LinkCall(nbytes, delay, now - done_at, now - release,
                                       thread))

    def _slowed(self, original):
        signature = inspect.signature(original)  # tensor, async_op: by position or name

        @functools.wraps(original)
        def slowed(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            tensor = bound["tensor"]
            nbytes = tensor.numel() * tensor.element_size()
            work = original(*args, **kwargs)
            if not bound.get("async_op", False):
                done_at = time.perf_counter()
                delay, release = self._hold(nbytes, done_at)
                time.sleep(max(0.0, release - time.perf_counter()))
                self._record(nbytes, delay, done_at, release)
                return work
            delayed = torch.futures.Future()
            threads = torch.get_num_threads()

            def complete(done_at: float, delay: float, release: float,
                         fut: torch.futures.Future) -> None:
                # On one of the link's threads, which lives on: a thread torch
                # did not start keeps MKL's own thread count (one per core)
                # whatever the rank set, so a callback's products here would
                # take the other rank's core and round otherwise.
                if torch.get_num_threads() != threads:
                    torch.set_num_threads(threads)
                wait = release - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                # Recorded here, before the future completes: whoever waits on
                # it finds its record, thread included.
                self._record(nbytes, delay, done_at, release)
                try:
                    delayed.set_result(fut.value())
                except Exception as error:  # the collective failed: pass it on
                    delayed.set_exception(error)

            def release_later(fut: torch.futures.Future) -> None:
                # Runs on gloo's thread: book the link, and leave the waiting
                # to the link's own threads.
                done_at = time.perf_counter()
                _waiters().submit(complete, done_at, *self._hold(nbytes, done_at), fut)

            work.get_future().add_done_callback(release_later)
            return _DelayedWork(delayed)

        return slowed


def own_cost_s(numel: int = 3082, rounds: int = 200) -> float:
    """Run on every rank: what the link's machinery adds to one all-reduce.

    An all-reduce of `numel` floats called as the hooks call it
    (`async_op=True`, then waited), over a link of no delay (alpha 0, beta
    infinite) and on the loopback, taking turns for `rounds` rounds, each
    started together: the ranks' mean of the difference of the medians, and
    never below 0. It is the hand-off to the link's thread and back, which the
    rule alpha + bytes / beta leaves out (the step model adds it per
    all-reduce over the link).
    """
    import statistics

    from . import timing

    tensor = torch.ones(numel)
    link = SlowLink(0.0, math.inf)

    def call() -> None:
        dist.all_reduce(tensor, async_op=True).wait()

    def over_link() -> None:
        with link:
            call()

    times = timing.interleaved({"link": over_link, "loopback": call}, rounds,
                               before=lambda name: dist.barrier())
    own = torch.tensor([statistics.median(times["link"])
                        - statistics.median(times["loopback"])])
    dist.all_reduce(own)
    # The link's call is the loopback's plus a hand-off, so its true cost is not
    # negative: a negative difference of the medians is the load's noise (other
    # processes keeping the cores busy), and `combined` refuses a negative alpha.
    return max(0.0, own.item() / dist.get_world_size())


def steps_over_links(methods: Sequence[str], betas: Sequence[float], alpha_s: float,
                     rounds: int, local: bool = False) -> dict:
    """On each rank: lesson 06's `methods` (send_less) over the slow link at each beta.

    The large MLP; every method first takes PowerSGD's warm-up on loopback (so
    PowerSGD compresses when timed), then every (link, method) pair takes one
    warm-up step and `rounds` steps, the pairs taking turns, so that the
    machine's load falls on every link alike. Returns, per link (math.inf:
    loopback, the link at alpha 0) and method: "step_s" (the median step),
    "bytes" and "calls" (what went over the link in the last step) and
    "link_s" (the median delay the link added to a step), and "rounds_s", the
    step of every timed round, in order (their median is "step_s"). With `local=True`
    each round also times each method's step sending nothing
    (send_less.no_communication), and every link's entry holds its median as
    "local_step_s": the method's local work.
    """
    import functools
    import statistics

    from . import models, send_less, timing, workload

    cfg = send_less.large_config()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = workload.make_dataset(cfg)
    batches = [workload.micro_batches(data, cfg, step, rank, world_size)[0]
               for step in range(8)]
    runs = {name: send_less.build(name, cfg)[:2] for name in methods}
    copies = {name: send_less.build(name, cfg)[:2] for name in methods} if local \
        else {}
    taken = dict.fromkeys(methods, 0)

    def step(name: str, run: tuple | None = None) -> None:
        model, optimizer = run or runs[name]
        X, y = batches[taken[name] % len(batches)]
        taken[name] += run is None  # a copy's step does not move the data on
        optimizer.zero_grad()
        models.MyLoss()(model(X), y).backward()
        optimizer.step()

    def local_step(name: str) -> None:
        with send_less.no_communication():  # the hook runs, sending nothing
            step(name, copies[name])

    warm = {name: functools.partial(step, name) for name in methods}
    warm.update({("local", name): functools.partial(local_step, name)
                 for name in copies})
    timing.interleaved(warm, rounds=1, warmup=send_less.POWERSGD_WARMUP)
    # Loopback is the link at alpha 0, beta infinite: the same machinery, so
    # its own cost (the hand-off to the link's thread) is in every column alike.
    links = {beta: SlowLink(alpha_s if beta < math.inf else 0.0, beta)
             for beta in (math.inf, *betas)}

    def over(beta: float, name: str) -> None:
        if beta == "local":
            return local_step(name)
        with links[beta]:
            step(name)

    def before(pair: tuple) -> None:
        dist.barrier()  # not an all-reduce: no link slows it
        if pair[0] != "local":
            links[pair[0]].reset()

    seen: dict = {}

    def after(pair: tuple) -> None:
        if pair[0] != "local":
            calls = list(links[pair[0]].calls)
            delay = sum(c.delay_s for c in calls)
            seen.setdefault(pair, []).append((sum(c.nbytes for c in calls),
                                              len(calls), delay))

    times = timing.interleaved(
        {(beta, name): functools.partial(over, beta, name)
         for beta in (*links, *(["local"] if local else [])) for name in methods},
        rounds=rounds, before=before, after=after)
    return {beta: {name: {"step_s": statistics.median(times[beta, name]),
                          "rounds_s": list(times[beta, name]),
                          "bytes": seen[beta, name][-1][0],
                          "calls": seen[beta, name][-1][1],
                          "link_s": statistics.median(s[2] for s in seen[beta, name]),
                          **({"local_step_s": statistics.median(times["local", name])}
                             if local else {})}
                   for name in methods} for beta in links}
