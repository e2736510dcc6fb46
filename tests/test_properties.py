"""Property tests: accumulation equals the large batch over random sizes."""

import torch
from ddp_rank_checks import accumulation_matches_large_batch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from labkit import data, models


@settings(max_examples=60, deadline=None)
@given(world_size=st.integers(1, 8), K=st.integers(1, 6),
       batch_per_rank=st.integers(1, 5), hidden=st.integers(1, 16),
       seed=st.integers(0, 2**16))
def test_averaged_accumulated_gradients_equal_the_large_batch(world_size, K,
                                                              batch_per_rank, hidden,
                                                              seed):
    """The arithmetic DDP + no_sync relies on, for any world size, K and shapes.

    Each simulated rank sums K micro-batch gradients of loss / K; DDP then
    averages the ranks. That equals one process's gradient on all the samples.
    """
    torch.manual_seed(seed)
    model = models.WideMLP(hidden=hidden)
    n = world_size * K * batch_per_rank
    X, y = torch.randn(n, 10), torch.randn(n, 10)
    models.MyLoss()(model(X), y).backward()
    reference = [p.grad.clone() for p in model.parameters()]

    averaged = [torch.zeros_like(g) for g in reference]
    per_micro = world_size * batch_per_rank
    for rank in range(world_size):
        model.zero_grad()
        for i in range(K):
            Xi = data.shard(X[i * per_micro:(i + 1) * per_micro], rank, world_size)
            yi = data.shard(y[i * per_micro:(i + 1) * per_micro], rank, world_size)
            (models.MyLoss()(model(Xi), yi) / K).backward()
        for a, p in zip(averaged, model.parameters(), strict=True):
            a += p.grad / world_size  # what the all-reduce (sum / world size) makes
    for a, r in zip(averaged, reference, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-6)


# The fixture hands back the same running group each time: safe to share.
@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(K=st.integers(1, 5), batch_per_rank=st.integers(1, 8),
       hidden=st.integers(1, 32), seed=st.integers(0, 2**16))
def test_ddp_no_sync_equals_the_large_batch_on_two_ranks(ranks, K, batch_per_rank,
                                                         hidden, seed):
    """Equal gradients, and K micro-batches cost one synchronization's all-reduces.

    The rank function raises (checks.allreduce_calls) when the K micro-batches
    all-reduce more often than one synchronized backward: without no_sync they
    would, K times over, and the gradients alone could not tell.
    """
    calls = ranks.run(accumulation_matches_large_batch, K, batch_per_rank, hidden, seed)
    assert calls[0] == calls[1] >= 1
