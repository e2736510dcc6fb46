"""labkit.cluster.rendezvous: how the ranks' collectives get their timeout."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from labkit.cluster import rendezvous


def test_the_public_set_timeout_is_used_where_torch_has_it(monkeypatch):
    """torch 2.14's dist.set_timeout, not the private one that now warns."""
    calls = []
    monkeypatch.setattr(dist, "set_timeout",
                        lambda t, group=None: calls.append(("public", t)),
                        raising=False)
    monkeypatch.setattr(dist.distributed_c10d, "_set_pg_timeout",
                        lambda t, group=None: calls.append(("private", t)))
    rendezvous.set_collective_timeout(2.5)
    assert calls == [("public", datetime.timedelta(seconds=2.5))]


def test_torch_2_13s_private_function_is_the_fallback(monkeypatch):
    calls = []
    monkeypatch.delattr(dist, "set_timeout", raising=False)
    monkeypatch.setattr(dist.distributed_c10d, "_set_pg_timeout",
                        lambda t, group=None: calls.append(t))
    rendezvous.set_collective_timeout(3)
    assert calls == [datetime.timedelta(seconds=3)]

