"""Checks of the exercises on scaling up: large-batch learning rates and
SyncBatchNorm (lesson 06), torchrun's ranks and FSDP's shards (lesson 07).

As in labkit.exercises: a right answer prints its verdict, a wrong one raises
WrongAnswer naming the mistake and a hint. `_..._trial` functions run on ranks.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import (
    exercise_messages_scale,  # noqa: F401  (registers the messages)
    models,
    sgd,
    torchrun,
)
from .feedback import WrongAnswer, off, right

if TYPE_CHECKING:
    from .cluster import Ranks

__all__ = [
    "check_global_statistics",
    "check_shard_sizes",
    "check_torchrun_env",
    "check_warmup_schedule",
]

# Lesson 06's warm-up run: lr 0.2 suits batch 32; LinearLR over 20 steps.
BASE_LR, BASE_BATCH, WARMUP_STEPS = 0.2, 32, 20


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-9)


def _warmup_lrs(peak: float, steps: int) -> list[float]:
    """The rate at each optimizer step under torch's LinearLR, as sgd.fit uses it."""
    cfg = sgd.SGDConfig(lr=peak, schedule="warmup", warmup_steps=WARMUP_STEPS,
                        steps=steps)
    optimizer = sgd.make_optimizer(torch.nn.Linear(1, 1), cfg)
    scheduler = sgd.make_scheduler(optimizer, cfg)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()  # no gradients: nothing moves, but the order is torch's
        scheduler.step()
    return lrs


def check_warmup_schedule(fn: Callable, batch_sizes=(128, 512, 2048)) -> None:
    """`fn(step, batch_size)`: the linearly scaled rate with LinearLR's warm-up."""
    steps = 3 * WARMUP_STEPS
    for batch in batch_sizes:
        ratio = batch / BASE_BATCH
        want = _warmup_lrs(BASE_LR * ratio, steps)
        got = [fn(step, batch) for step in range(steps)]
        if any(lr is None for lr in got):
            raise WrongAnswer("ex_fill_in", name=f"lr_at(step, {batch})")
        got = [float(lr) for lr in got]
        peak, last = want[-1], got[-1]
        if not _close(last, peak):
            key = ("ex_lr_not_scaled" if _close(last, BASE_LR) else "ex_lr_sqrt"
                   if _close(last, BASE_LR * math.sqrt(ratio)) else "ex_lr_peak")
            raise WrongAnswer(key, batch=batch, got=last)
        if _close(got[0], peak):
            raise WrongAnswer("ex_lr_no_warmup", batch=batch)
        if not _close(got[0], want[0]):
            key = ("ex_lr_from_zero" if got[0] == 0 else "ex_lr_from_base"
                   if _close(got[0], BASE_LR) else "ex_lr_start")
            raise WrongAnswer(key, batch=batch, got=got[0])
        reached = next(step for step, lr in enumerate(got) if _close(lr, peak))
        if reached != WARMUP_STEPS:
            raise WrongAnswer("ex_lr_warmup_end", batch=batch, step=reached)
        if (diff := max(abs(g - w) for g, w in zip(got, want, strict=True))) > 1e-6:
            raise off(f"lr_at(step, {batch})", diff, "ex_lr_hint")
    peak = BASE_LR * 512 / BASE_BATCH
    right("ex_lr_ok", first=_warmup_lrs(peak, 1)[0], peak=peak, steps=WARMUP_STEPS)


def _bn_batch(rank: int, features: int = 4) -> torch.Tensor:
    """Rank `rank`'s samples: 3 + 6 × rank of them, further out on higher ranks."""
    g = torch.Generator().manual_seed(200 + rank)
    return torch.randn(3 + 6 * rank, features, generator=g) * (1 + rank) + 3.0 * rank


def _statistics_trial(fn: Callable) -> list[list[float]] | None:
    """Runs on every rank: `fn` on this rank's batch; its mean and variance."""
    out = fn(_bn_batch(dist.get_rank()))
    if out is None:
        return None
    return [torch.as_tensor(v, dtype=torch.float64).reshape(-1).tolist() for v in out]


def _diagnose(got: list[torch.Tensor], want: list[torch.Tensor],
              wrong: list[tuple[str, list[torch.Tensor]]], what: str,
              hint: str) -> None:
    """Raise WrongAnswer unless every rank's `got` is `want`, naming the mistake."""

    def matches(values: list[torch.Tensor]) -> bool:
        return all(torch.allclose(g, v, rtol=1e-4, atol=1e-5)
                   for g, v in zip(got, values, strict=True))

    if matches(want):
        return
    for key, values in wrong:
        if matches(values):
            raise WrongAnswer(key, what=what)
    raise off(what, max((g - w).abs().max().item()
                        for g, w in zip(got, want, strict=True)), hint)


def check_global_statistics(ranks: Ranks, fn: Callable) -> None:
    """`fn(x)` on every rank: each feature's mean and biased variance over all ranks."""
    results = ranks.run(_statistics_trial, fn)
    if any(r is None for r in results):
        raise WrongAnswer("ex_fill_in", name="global_mean_var(x)")
    batches = [_bn_batch(rank).double() for rank in range(ranks.world_size)]
    whole = torch.cat(batches)
    features = whole.shape[1]
    if any(len(r) != 2 or any(len(v) != features for v in r) for r in results):
        raise WrongAnswer("ex_bn_shape", features=features)
    means = [torch.tensor(r[0], dtype=torch.float64) for r in results]
    variances = [torch.tensor(r[1], dtype=torch.float64) for r in results]
    mean = whole.mean(0)

    def each(stat: Callable) -> list[torch.Tensor]:
        return [stat(b) for b in batches]

    def same(value: torch.Tensor) -> list[torch.Tensor]:
        return ranks.world_size * [value]

    _diagnose(means, same(mean), [
        ("ex_bn_local", each(lambda b: b.mean(0))),
        ("ex_bn_count", each(lambda b: whole.sum(0) / len(b))),
        ("ex_bn_mean_of_means", same(torch.stack(each(lambda b: b.mean(0))).mean(0))),
        ("ex_bn_not_divided", same(whole.sum(0))),
    ], "mean", "ex_bn_hint")
    counts = torch.tensor([len(b) for b in batches], dtype=torch.float64)
    local_vars = torch.stack(each(lambda b: b.var(0, unbiased=False)))
    _diagnose(variances, same(whole.var(0, unbiased=False)), [
        ("ex_bn_local", each(lambda b: b.var(0, unbiased=False))),
        ("ex_bn_local", each(lambda b: b.var(0))),
        ("ex_bn_var_of_vars", same(local_vars.mean(0))),
        ("ex_bn_var_of_vars", same(counts @ local_vars / counts.sum())),
        ("ex_bn_unbiased", same(whole.var(0))),
        ("ex_bn_squares", same(whole.pow(2).mean(0))),
        ("ex_bn_not_divided", same((whole - mean).pow(2).sum(0))),
    ], "var", "ex_bn_hint")
    right("ex_bn_ok", counts=" + ".join(str(len(b)) for b in batches), total=len(whole))


_ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
# Each process writes its variables to a file of its own (its printed lines
# could interleave with the others'); GROUP_RANK is its node's rank.
_ENV_SCRIPT = """import json, os, sys
names = ("GROUP_RANK", "RANK", "LOCAL_RANK", "WORLD_SIZE")
with open(os.path.join(sys.argv[1], os.environ["RANK"] + ".json"), "w") as f:
    json.dump({k: int(os.environ[k]) for k in names}, f)
"""


def _torchrun_env(nnodes: int, nproc_per_node: int) -> dict[int, list[dict]]:
    """What a real torchrun run hands each process: {node rank: [env by local rank]}."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "env.py"
        script.write_text(_ENV_SCRIPT)
        nodes = torchrun.run_nodes([str(script), tmp], nnodes=nnodes,
                                    nproc_per_node=nproc_per_node, timeout_s=60)
        envs = [json.loads(f.read_text()) for f in Path(tmp).glob("*.json")]
    if len(envs) != nnodes * nproc_per_node or any(n.returncode for n in nodes):
        raise RuntimeError("torchrun failed:\n" + "\n".join(n.output for n in nodes))
    by_node: dict[int, list[dict]] = {}
    for env in sorted(envs, key=lambda e: e["LOCAL_RANK"]):
        by_node.setdefault(env.pop("GROUP_RANK"), []).append(env)
    return by_node


def _env_mistake(got: list[dict], nnodes: int, nproc: int,
                 node_rank: int) -> tuple[str, str]:
    """The message key of what `got` (one entry per process) gets wrong, and the
    variable it gets wrong."""
    local = list(range(nproc))
    ranks, world = [p["RANK"] for p in got], {p["WORLD_SIZE"] for p in got}
    if ranks != [node_rank * nproc + i for i in local]:
        for key, wrong in (("ex_env_rank_local", local),
                           ("ex_env_rank_sum", [node_rank + i for i in local]),
                           ("ex_env_rank_interleaved",
                            [i * nnodes + node_rank for i in local])):
            if ranks == wrong:
                return key, "RANK"
        return "ex_env_rank", "RANK"
    if [p["LOCAL_RANK"] for p in got] != local:
        return "ex_env_local", "LOCAL_RANK"
    return ("ex_env_world_nproc" if world == {nproc} else "ex_env_world"), "WORLD_SIZE"


def check_torchrun_env(fn: Callable, real: bool = True) -> None:
    """`fn(nnodes, nproc_per_node, node_rank)`: RANK, LOCAL_RANK, WORLD_SIZE of
    each process of that node; then, unless `real` is False, compared with what a
    real torchrun of 2 nodes × 2 processes hands its processes."""
    for nnodes, nproc, node_rank in ((2, 1, 1), (2, 2, 0), (2, 2, 1), (4, 8, 3)):
        name = f"torchrun_env({nnodes}, {nproc}, {node_rank})"
        answer = fn(nnodes, nproc, node_rank)
        try:
            if answer is None or any(process[k] is None for process in answer
                                     for k in _ENV_KEYS):
                raise WrongAnswer("ex_fill_in", name=name)
            got = [{k: int(process[k]) for k in _ENV_KEYS} for process in answer]
        except (KeyError, TypeError, ValueError):
            raise WrongAnswer("ex_env_form", name=name) from None
        if len(got) != nproc:
            raise WrongAnswer("ex_env_count", name=name, got=len(got), nproc=nproc)
        want = [{"RANK": node_rank * nproc + i, "LOCAL_RANK": i,
                 "WORLD_SIZE": nnodes * nproc} for i in range(nproc)]
        if got != want:
            key, field = _env_mistake(got, nnodes, nproc, node_rank)
            raise WrongAnswer(key, name=name, got=[p[field] for p in got])
    if not real:
        right("ex_env_ok_formula")
        return
    seen = _torchrun_env(2, 2)
    for node_rank, envs in sorted(seen.items()):
        got = [{k: int(p[k]) for k in _ENV_KEYS} for p in fn(2, 2, node_rank)]
        if got != envs:
            raise WrongAnswer("ex_env_real", node=node_rank, got=got, real=envs)
    right("ex_env_ok", nodes="; ".join(
        f"node {n}: RANK {', '.join(str(e['RANK']) for e in envs)}"
        for n, envs in sorted(seen.items())))


def _shard_trial(hidden: int, out_features: int) -> list[tuple[tuple, int]]:
    """Runs on every rank: fully_shard a small MLP; each parameter's shape and the
    number of its values held here."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    torch.manual_seed(0)
    model = models.WideMLP(hidden=hidden, out_features=out_features).to(device)
    fully_shard(model, mesh=init_device_mesh(device, (dist.get_world_size(),)))
    return [(tuple(p.shape), p.to_local().numel()) for p in model.parameters()]


def _chunk_numel(shape: tuple, rank: int, world_size: int) -> int:
    """Values of rank `rank`'s piece when dim 0 is cut as torch.chunk cuts it."""
    pieces = torch.empty(shape[0]).chunk(world_size)
    return (len(pieces[rank]) if rank < len(pieces) else 0) * math.prod(shape[1:])


def check_shard_sizes(ranks: Ranks, fn: Callable) -> None:
    """`fn(shape, rank, world_size)`: values of a parameter one rank holds under
    fully_shard, measured on the ranks and, for more ranks, by torch.chunk."""
    n = ranks.world_size
    measured = ranks.run(_shard_trial, 5, 1)  # Linear(10, 5), Linear(5, 1): odd rows
    cases = [(shape, rank, n, held) for rank, params in enumerate(measured)
             for shape, held in params]
    cases += [(tuple(p.shape), rank, size, _chunk_numel(tuple(p.shape), rank, size))
              for size in (3, 8) for p in models.MLP().parameters()
              for rank in range(size)]
    for shape, rank, size, want in cases:
        got = fn(shape, rank, size)
        if got is None:
            raise WrongAnswer("ex_fill_in", name="values_held(shape, rank, world_size)")
        if got == want:
            continue
        rows, numel = shape[0], math.prod(shape)
        per_row, piece = numel // rows, -(-rows // size)
        spread = rows // size + (rank < rows % size)
        key = next((key for key, value in (
            ("ex_shard_whole", numel), ("ex_shard_even", numel / size),
            ("ex_shard_even", math.ceil(numel / size)),
            ("ex_shard_even", numel // size), ("ex_shard_padding", piece * per_row),
            ("ex_shard_spread", spread * per_row)) if got == value), "ex_shard_off")
        raise WrongAnswer(key, shape=shape, rank=rank, n=size, got=got)
    right("ex_shard_ok", n=n)
