"""Lesson 09's helpers, and lesson 08's rank-side ones: torchrun on two simulated
nodes, FSDP shards, ZeRO arithmetic, BatchNorm under DDP, optional frameworks."""

import json
import re
import sys

import pytest
from conftest import child_processes, leftovers, unavailable

from labkit import batchnorm, doctor, ecosystem, sharding
from labkit.cluster import launch, torchrun


@pytest.mark.procs
def test_two_torchrun_nodes_run_one_experiment(tmp_path):
    before = {p.pid for p in child_processes()}
    out = tmp_path / "two_nodes.json"
    nodes = torchrun.run_nodes(
        ["-m", "labkit", "nosync", "--accum", "2", "--steps", "2", "--repeat", "1",
         "--json", str(out)], nnodes=2, nproc_per_node=1, timeout_s=150)
    assert [n.returncode for n in nodes] == [0, 0], nodes[0].output[-2000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2
    assert result["allreduce_calls_per_step_sync"] == 2
    assert result["allreduce_calls_per_step_nosync"] == 1
    assert result["grad_max_abs_diff"] <= 1e-6
    assert leftovers(before) == set()


@pytest.mark.procs
@pytest.mark.timeout(180)  # stopped, not left running
def test_a_run_past_its_timeout_is_stopped_with_its_workers():
    before = {p.pid for p in child_processes()}
    lone = torchrun.command(["-m", "labkit", "nosync"], nnodes=2,
                                      nproc_per_node=1, endpoint="127.0.0.1:1",
                                      run_id="x")
    assert lone[:3] == [sys.executable, "-m", "torch.distributed.run"]
    # A run far longer than its timeout: both agents and their workers must go.
    nodes = torchrun.run_nodes(["-m", "labkit", "misuse", "--steps", "100000"],
                                nnodes=2, nproc_per_node=1, timeout_s=8)
    assert all(n.returncode != 0 and "stopped after 8 s" in n.output for n in nodes)
    # each agent had its worker running, and stopped it: not stopped before it began
    assert all("closing signal SIGTERM" in n.output for n in nodes), \
        [n.output[-2000:] for n in nodes]
    assert leftovers(before) == set()


def test_the_torchrun_command_needs_positive_sizes():
    with pytest.raises(ValueError, match="must be >= 1"):
        torchrun.command([], nnodes=0, nproc_per_node=1,
                                   endpoint="127.0.0.1:1", run_id="x")
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        torchrun.run_nodes([], timeout_s=0)


def test_zero_arithmetic_matches_the_paper():
    per_rank = sharding.memory_per_rank(7.5e9, 64)
    assert list(per_rank) == list(sharding.STAGES)
    assert [round(b / 1e9, 1) for b in per_rank.values()] == [120.0, 31.4, 16.6, 1.9]
    assert sharding.memory_per_rank(100, 1)["ZeRO-3"] == 1600
    with pytest.raises(ValueError, match="world_size >= 1"):
        sharding.memory_per_rank(100, 0)


def _global_batch_norm_vs_one_process(rank, world_size):
    import torch
    import torch.distributed as dist

    x = batchnorm.local_batch(rank)
    every = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(every, x)
    whole = torch.nn.functional.batch_norm(torch.cat(every), None, None, training=True)
    mine = whole[rank * len(x):(rank + 1) * len(x)]
    return (batchnorm.global_batch_norm(x) - mine).abs().max().item()


def _on_ranks(rank, world_size):
    return {"fsdp": sharding.fsdp_experiment(rank, world_size),
            "synced_vs_whole": _global_batch_norm_vs_one_process(rank, world_size),
            "built": batchnorm.buffers_after_construction(rank),
            "syncbn": batchnorm.syncbn_error()}


@pytest.mark.procs
def test_fsdp_shards_and_batchnorm_on_two_ranks():
    results = launch.run(_on_ranks, {}, world_size=2)
    for r in results:
        fsdp = r["fsdp"]
        assert fsdp["local_numel"] * 2 == fsdp["full_numel"] == 2110
        assert fsdp["shards"]["fc1.weight"] == {"global": (100, 10), "local": (50, 10),
                                                "placement": "S(0)"}
        assert fsdp["grad_max_abs_diff"] <= 1e-6
        assert r["synced_vs_whole"] < 1e-5  # SyncBatchNorm's normalization, by hand
    for rank, r in enumerate(results):
        built = r["built"]
        assert built["broadcast_buffers=False"]["running_mean0"] == rank
        if "forward_sync_buffers=False" in built:
            assert built["forward_sync_buffers=False"]["running_mean0"] == 0
    if not __import__("torch").cuda.is_available():
        assert "only work with GPU modules" in results[0]["syncbn"]


def test_frameworks_are_optional():
    assert doctor.version("surely-not-installed-package") is None
    with pytest.raises(ValueError, match="unknown framework"):
        ecosystem.no_sync_lines("horovod")
    with pytest.raises(ValueError, match="unknown framework"):
        ecosystem.run_counted("horovod")


@pytest.mark.parametrize("name", list(ecosystem.FRAMEWORKS))
def test_frameworks_call_no_sync_where_they_accumulate(name):
    """Their source; that they enter it, counted, is lesson 09's cell, run by
    tests/test_claims_ledger.py where they are installed (make ecosystem-check)."""
    if doctor.version(name) is None:
        unavailable(f"{name} is not installed: pyproject's ecosystem extra (make "
                    "ecosystem-check installs it in build/ecosystem-venv)",
                    "LABKIT_REQUIRE_ECOSYSTEM")
    # a call of a model's no_sync(), not only a line that names it
    calls = [line for line in ecosystem.no_sync_lines(name)
             if re.search(r"\.no_sync\(", line.partition(": ")[2])]
    assert calls, ecosystem.no_sync_lines(name)


def test_the_no_sync_counter_counts_and_puts_no_sync_back_after_an_error():
    """A run that fails inside the counter leaves DDP.no_sync as torch made it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    original = DDP.no_sync
    with pytest.raises(RuntimeError, match="failed inside"):
        with ecosystem.counted_no_sync() as entered:
            assert DDP.no_sync is not original
            DDP.no_sync(object())  # calling counts; the block need not be entered
            DDP.no_sync(object())
            raise RuntimeError("failed inside")
    assert len(entered) == 2
    assert DDP.no_sync is original
