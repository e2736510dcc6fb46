"""Rank-side trials for test_slow_link.py, run on every rank of a group.

A separate module so that pytest does not rewrite it: the engines import it
by name and run the same code as the test process sees.
"""

import threading
import time

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import comm, slow_link

WIDTH = 256  # two 256 x 256 layers: about 0.5 MB of gradients, two buckets


def _hook(name):
    if name == "allreduce":
        return default_hooks.allreduce_hook, None
    if name == "fp16":
        return default_hooks.fp16_compress_hook, None
    state = powersgd.PowerSGDState(None, matrix_approximation_rank=1,
                                   start_powerSGD_iter=2)
    return powersgd.powerSGD_hook, state


class NoWaitLink(slow_link.SlowLink):
    """A link that books each call's delay but lets it complete at once."""

    def _hold(self, nbytes, done_at):
        delay, _ = super()._hold(nbytes, done_at)
        return delay, done_at


def _model(hook_name):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
    # PowerSGD in one bucket (as send_less does): two would race on gloo.
    model = DDP(module, bucket_cap_mb=0.1 if hook_name != "powersgd" else 100)
    hook, state = _hook(hook_name)
    model.register_comm_hook(state, hook)
    return model


def step_over_link(hook_name, alpha_s, beta_Bps, steps=3, no_wait=False):
    """Train two copies, one over the link, one not; the link's record.

    Returns the last step's calls (nbytes, delay_s, held_s), that step's
    seconds over the link, the largest gradient difference between the two
    copies at any step, and the gradients' bytes.
    """
    rank = torch.distributed.get_rank()
    plain, slowed = _model(hook_name), _model(hook_name)
    link = (NoWaitLink if no_wait else slow_link.SlowLink)(alpha_s, beta_Bps)
    g = torch.Generator().manual_seed(rank)  # ranks see different data
    worst = 0.0
    for _ in range(steps):
        X = torch.randn(32, WIDTH, generator=g)
        plain.zero_grad()
        plain(X).square().mean().backward()
        slowed.zero_grad()
        link.reset()
        with link:
            start = time.perf_counter()
            slowed(X).square().mean().backward()
            step_s = time.perf_counter() - start
        for a, b in zip(plain.parameters(), slowed.parameters(), strict=True):
            worst = max(worst, (a.grad - b.grad).abs().max().item())
    nbytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    return [tuple(c) for c in link.calls], step_s, worst, nbytes


def blocking_allreduce(alpha_s, beta_Bps):
    """One blocking all-reduce over the link: its record and its seconds."""
    link = slow_link.SlowLink(alpha_s, beta_Bps)
    with link:
        start = time.perf_counter()
        torch.distributed.all_reduce(torch.ones(WIDTH))
        seconds = time.perf_counter() - start
    return [tuple(c) for c in link.calls], seconds


def completing_threads(calls):
    """The names of the threads that completed `calls` async all-reduces over a link.

    As the link recorded them, on the completing thread before the future was
    complete: what a `.then` attached after the call returned cannot tell.
    """
    with slow_link.SlowLink(1e-4, float("inf")) as link:
        for _ in range(calls):
            torch.distributed.all_reduce(torch.ones(8), async_op=True).wait()
    return [call.thread for call in link.calls]


def late_then(calls):
    """A caller that attaches `.then` only once the future is complete.

    As a main thread set back longer than the delay would: returns the threads
    the `.then` callbacks ran on, and those the link recorded.
    """
    ran_on = []
    with slow_link.SlowLink(1e-4, float("inf")) as link:
        for _ in range(calls):
            future = torch.distributed.all_reduce(torch.ones(8),
                                                  async_op=True).get_future()
            future.wait()
            ran_on.append(future.then(lambda fut: threading.current_thread().name)
                          .wait())
    return ran_on, [call.thread for call in link.calls]


def own_cost_with_link_faster(by_s, rounds):
    """slow_link.own_cost_s where every step over the link timed `by_s` shorter.

    As noise on a busy machine can make the link's median the smaller.
    """
    from labkit import timing

    saved = timing.interleaved

    def interleaved(*args, **kwargs):
        times = saved(*args, **kwargs)
        times["link"] = [seconds - by_s for seconds in times["link"]]
        return times

    timing.interleaved = interleaved
    try:
        own = slow_link.own_cost_s(rounds=rounds)
    finally:
        timing.interleaved = saved
    # what bench's levers model does with it: the link's alpha plus its own cost
    slow_link.combined(comm.AlphaBeta(30e-6, 2e9), 100e-6 + own, 5e8, 2)
    return own


def step_model_inputs(rounds):
    """The step model's measured inputs over the link (bench --only levers), used.

    The link's own cost and the callback chain's wait, measured as the lesson
    measures them, then handed to `slow_link.combined` and
    `send_less.predicted_step_s` as the lesson hands them.
    """
    from labkit import callback_chain, send_less

    own = slow_link.own_cost_s(rounds=rounds)
    chain = callback_chain.chain_wait_s(3, 3082, 1e-3, rounds=rounds)
    ab = slow_link.combined(comm.AlphaBeta(30e-6, 2e9), 100e-6 + own, 5e8, 2)
    send_less.predicted_step_s(0.02, send_less.Sent(8_000_000, 2),
                               send_less.Sent(40_000, 3), ab, 2, 0.001,
                               2 * chain["per_call_s"])
    return own, chain["per_call_s"]


class _SlowHandOff:
    """The link's threads, each hand-off to them `extra_s` slower."""

    def __init__(self, pool, extra_s):
        self.pool, self.extra_s = pool, extra_s

    def submit(self, fn, *args):
        time.sleep(self.extra_s)
        return self.pool.submit(fn, *args)


def own_cost_with_hand_off(extra_s, rounds):
    """slow_link.own_cost_s with every hand-off to the link's threads extra_s slower."""
    saved = slow_link._waiters
    pool = saved()
    slow_link._waiters = lambda: _SlowHandOff(pool, extra_s)
    try:
        return slow_link.own_cost_s(rounds=rounds)
    finally:
        slow_link._waiters = saved
