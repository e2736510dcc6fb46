"""What a chain of all-reduces issued from future callbacks costs, beyond its parts.

torch's PowerSGD hook (torch/distributed/algorithms/ddp_comm_hooks/
powerSGD_hook.py, the end of `powerSGD_hook`) sends three all-reduces one
after the other: the uncompressed tensors from the hook, then P and Q, each
issued inside a `Future.then` callback and waited there (`.wait()`). P's
product comes before the first; unpacking the uncompressed tensors before
P's all-reduce; P's orthogonalization and Q's product before Q's; the
decompression after it. The chain here splits the compute evenly over those
four places, a model of where it falls. gloo completes a future on one of its
worker threads and runs the callbacks there. Each all-reduce is also a point
where a rank waits for the other: on a loaded machine, whichever rank the
scheduler set back last decides when the chain goes on.

The step model prices each all-reduce by alpha-beta (isolated calls, both
ranks ready) and the compute by the method's step sending nothing, where the
callbacks run inline on the main thread and no rank waits for another. What
the chain adds beyond those two is measured here, once, on a chain of the same
shape with a fixed matrix product for its compute: `chain_wait_s`.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from . import send_less, timing

__all__ = ["chain_wait_s", "chained_calls"]


def chained_calls(name: str, calls: int) -> int:
    """How many of a method's `calls` all-reduces per step are issued in a callback.

    PowerSGD: two of each bucket's three (P and Q); DDP's, fp16's and the
    others' hooks issue theirs from the hook itself.
    """
    return calls * 2 // 3 if name.startswith("PowerSGD") else 0


_A = torch.full((256, 256), 0.5)
_B = torch.empty(256, 256)


def _work(n: int) -> None:
    """A fixed piece of compute: `n` products of one 256 x 256 matrix by itself."""
    for _ in range(n):
        torch.mm(_A, _A, out=_B)


def _chain(tensor: torch.Tensor, calls: int, n: int) -> None:
    """PowerSGD's shape: work, an all-reduce, then per callback work and the next."""
    _work(n)
    future = dist.all_reduce(tensor, async_op=True).get_future()

    def next_call(done):  # on gloo's thread, as the hook's callbacks run
        _work(n)
        return dist.all_reduce(tensor, async_op=True).get_future().wait()[0]

    for _ in range(calls - 1):
        future = future.then(next_call)
    future.then(lambda done: _work(n)).wait()


def chain_wait_s(calls: int = 3, numel: int = 3082, work_s: float = 2e-3,
                 rounds: int = 20) -> dict[str, float]:
    """Run on every rank: the seconds a chain adds per all-reduce issued in a callback.

    Three candidates take turns for `rounds` rounds, each started together
    (a barrier): the chain (`calls` all-reduces of `numel` floats, the first
    from the caller, the others each inside a callback after `work_s` seconds
    of compute, compute after the last too), the same chain sending nothing
    (`send_less.no_communication`: the callbacks run inline), and blocking
    all-reduces in a row (their mean, times `calls`). Returns the ranks' mean
    medians ("chain_s", "local_s", "isolated_s") and "per_call_s": the median
    over rounds of (chain - local - isolated), over the `calls - 1`
    all-reduces issued in callbacks.
    """
    if calls < 2:
        raise ValueError(f"calls must be at least 2 (one issued in a callback), "
                         f"got {calls}")
    tensor = torch.ones(numel)
    # The same work on both ranks: as many products as the slower rank fits in work_s.
    one = min(timing.timed(lambda: _work(10)) for _ in range(3)) / 10
    n = torch.tensor([max(1.0, work_s / one)])
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    n = int(n.item())

    def local():
        with send_less.no_communication():
            _chain(tensor, calls, n)

    fns = {"chain_s": lambda: _chain(tensor, calls, n), "local_s": local,
           "isolated_s": lambda: dist.all_reduce(tensor)}
    # An isolated all-reduce as the alpha-beta fit times it: the mean of calls
    # in a row (comm.allreduce_time), `calls` of them.
    times = timing.interleaved(fns, rounds, before=lambda name: dist.barrier(),
                               repeat={"chain_s": 1, "local_s": 1, "isolated_s": 10})
    times["isolated_s"] = [calls * seconds for seconds in times["isolated_s"]]
    # Per round, the chain less its parts taken in the same round: the load
    # drifts between rounds, less within one; the median of those differences.
    extra = [chain - local - isolated for chain, local, isolated
             in zip(*times.values(), strict=True)]
    found = torch.tensor([statistics.median(times[name]) for name in fns]
                         + [statistics.median(extra) / (calls - 1)])
    dist.all_reduce(found)
    return dict(zip([*fns, "per_call_s"], (found / dist.get_world_size()).tolist(),
                    strict=True))

