"""A ring all-reduce written with point-to-point sends, recorded step by step.

Run `all_reduce` on every rank (`ranks.run(ring.all_reduce, n_values)`): each rank
cuts its tensor into one chunk per rank and, in 2(n - 1) steps, sends one chunk to
its right neighbour and receives one from its left: first adding what it receives
(reduce-scatter), then keeping it (all-gather). Beside its values every chunk
carries the ranks whose parts have been added into it, so what the record says
("chunk 2 of rank 0 holds 3 ranks' sums after step 2") comes from the tensors that
really travelled; `labkit.diagrams.ring` draws it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_reduce", "chunk_sent"]


def chunk_sent(rank: int, step: int, world_size: int) -> int:
    """The chunk `rank` sends to its right neighbour at `step` (0 to 2(n - 1) - 1).

    In the reduce-scatter, rank r starts with its own chunk r and passes on the sum
    it has just grown; after n - 1 steps rank r holds the whole sum of chunk r + 1,
    and the all-gather passes the finished chunks round the ring.
    """
    n = world_size
    if step < n - 1:
        return (rank - step) % n
    return (rank + 1 - (step - (n - 1))) % n


def all_reduce(n_values: int = 8, seed: int = 0) -> dict:
    """A ring all-reduce of `n_values` random values on this rank, step by step.

    Returns the rank's values before and after, `dist.all_reduce`'s result of the
    same tensor, how many ranks' parts each chunk holds after each step (`counts`,
    2(n - 1) + 1 rows, the start included), the chunk sent at each step, and the
    bytes this rank sent.
    """
    n, rank = dist.get_world_size(), dist.get_rank()
    if n_values < n:
        raise ValueError(f"n_values={n_values}: a ring of {n} ranks needs at least "
                         f"one value per rank")
    torch.manual_seed(seed + rank)
    before = torch.randn(n_values)
    expected = before.clone()
    dist.all_reduce(expected)
    values = before.clone()
    chunks = list(values.tensor_split(n))  # views: adding to a chunk changes values
    holds = torch.zeros(n, n)  # holds[c, r] = 1: chunk c holds rank r's part
    holds[:, rank] = 1
    counts, sent, sent_bytes = [holds.sum(1).int().tolist()], [], 0
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(2 * (n - 1)):
        out = chunk_sent(rank, step, n)
        into = chunk_sent(left, step, n)  # what the left neighbour sends now
        message = torch.cat([chunks[out], holds[out]])
        received = torch.empty(len(chunks[into]) + n)
        requests = [dist.isend(message, right), dist.irecv(received, left)]
        for request in requests:
            request.wait()
        sent_bytes += chunks[out].numel() * chunks[out].element_size()
        value, who = received[:-n], received[-n:]
        if step < n - 1:  # reduce-scatter: add the neighbour's partial sum
            chunks[into] += value
            holds[into] += who
        else:  # all-gather: the chunk arrives finished
            chunks[into].copy_(value)
            holds[into] = who
        counts.append(holds.sum(1).int().tolist())
        sent.append(out)
    return {"rank": rank, "world_size": n, "before": before.tolist(),
            "after": values.tolist(), "expected": expected.tolist(),
            "counts": counts, "sent": sent, "sent_bytes": sent_bytes,
            "tensor_bytes": before.numel() * before.element_size()}
