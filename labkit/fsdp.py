"""FSDP2 (`fully_shard`) measured: what a rank holds, what it sends, its checkpoints.

Where FSDP2 keeps a parameter (torch/distributed/fsdp/_fully_shard/_fsdp_param.py):
each `FSDPParam` holds its rank's dim-0 chunk as a DTensor (`sharded_param`, the
module's registered parameter while sharded); a unit's all-gather fills
`all_gather_outputs` (one flat tensor per parameter), of which the parameter the
module computes with is a view; `free_unsharded_param` frees them by resizing
their storages to 0, after the forward when `reshard_after_forward=True` and
after the backward in every case. `held_param_bytes` reads both places with
`sharding.held_bytes`, so what it reports is storage actually allocated.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from . import i18n
from .comm_counting import CollectiveLog
from .sharding import STAGES, held_bytes, memory_per_rank

__all__ = [
    "checkpoint_mismatches",
    "held_param_bytes",
    "layer_units",
    "load_checkpoint",
    "mixed_precision_experiment",
    "reshard_experiment",
    "shard_layers",
    "smallest_world_size",
    "traffic",
]

Batch = tuple[torch.Tensor, torch.Tensor]

i18n.register({
    "memory_share": {"ja": "1 ランクのメモリ / DDP のメモリ",
                     "en": "memory per rank / DDP's"},
    "when_to_shard_title": {"ja": "モデル状態のメモリ (Adam、float32)",
                            "en": "Model-state memory (Adam, float32)"},
    # gb: the budget per rank in GB (1e9 bytes); billions and oku (1e8): the model's
    # parameters, in the unit each language counts them in
    "budget_line": {"ja": "予算: 1 ランク {gb:g} GB ({oku:g} 億パラメータのモデル)",
                    "en": "budget: {gb:g} GB per rank ({billions:g}B-parameter model)"},
})


def layer_units(model: nn.Module) -> list[nn.Module | list[nn.Module]]:
    """The submodules that hold parameters themselves, in order: one unit each.

    Modules that share a parameter (tied weights) come as one list, one unit:
    FSDP2 refuses a parameter already managed by another unit (a ValueError
    that says to use `fully_shard([module_a, module_b])`). The root's own
    parameters are left to the root's unit.
    """
    units: list[list[nn.Module]] = []
    owner: dict[int, int] = {}  # id(parameter) -> its unit's index
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if not name or not params:
            continue
        shared = {owner[id(p)] for p in params if id(p) in owner}
        if len(shared) > 1:
            raise ValueError(f"{name} shares parameters with two earlier units")
        index = shared.pop() if shared else len(units)
        if index == len(units):
            units.append([])
        units[index].append(module)
        for p in params:
            owner[id(p)] = index
    return [unit[0] if len(unit) == 1 else unit for unit in units]


def shard_layers(model: nn.Module, mesh=None, **options) -> nn.Module:
    """`fully_shard` each of `layer_units(model)`, then the root; `options` to each.

    One unit per layer: a unit's parameters are gathered just before its
    forward, so a rank holds one layer whole at a time, not the model.
    """
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(device, (dist.get_world_size(),))
    for unit in layer_units(model):
        fully_shard(unit, mesh=mesh, **options)
    return fully_shard(model, mesh=mesh, **options)


def _fsdp_params(model: nn.Module) -> list:
    """Every FSDPParam of the model's units, each once (torch's internals)."""
    from torch.distributed.fsdp import FSDPModule

    groups: dict[int, object] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                groups[id(group)] = group
    if not groups:
        raise ValueError(f"{type(model).__name__} has no fully_shard unit: "
                         "call fully_shard (or shard_layers) first")
    return [p for group in groups.values() for p in group.fsdp_params]


def held_param_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of parameters this rank holds now: its shards and the gathered copies.

    "sharded": the DTensor shards FSDP2 keeps for good; "gathered": the
    all-gather outputs that hold whole parameters (0 once freed).
    """
    params = _fsdp_params(model)
    gathered = [t for p in params
                for t in (*p.all_gather_outputs, *p._unsharded_inner_tensors)]
    return {"sharded": held_bytes(p.sharded_param for p in params),
            "gathered": held_bytes(gathered)}


def traffic(calls: Sequence[dict]) -> dict[str, dict[str, int]]:
    """CollectiveLog calls summed per op: {"all_gather": {"calls": n, "bytes": b}}."""
    out: dict[str, dict[str, int]] = {}
    for call in calls:
        entry = out.setdefault(call["op"], {"calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += call["bytes"]
    return out


def _step_phases(model: nn.Module, batch: Batch, loss_fn: Callable) -> dict:
    """One forward and backward, watched: traffic and held bytes of each phase."""
    X, y = batch
    with CollectiveLog() as log:
        loss = loss_fn(model(X), y)
        forward = traffic(log.calls)
        between = held_param_bytes(model)
        log.reset()
        loss.backward()
        backward = traffic(log.calls)
    return {"loss": loss.item(), "forward": forward, "backward": backward,
            "held_between": between, "held_after": held_param_bytes(model)}


def reshard_experiment(make_model: Callable[[], nn.Module], batch: Batch,
                       loss_fn: Callable, reshard_after_forward: bool,
                       seed: int = 0) -> dict:
    """On each rank: one step of `make_model()` under fully_shard, watched.

    The root gets the same `reshard_after_forward` as the layers (by default
    FSDP2 keeps the root's parameters, which backward needs first). Returns
    the traffic of the forward and of the backward (CollectiveLog), and the
    parameter bytes held between them and after the backward.
    """
    torch.manual_seed(seed)  # the same weights on every rank: fully_shard
    # keeps each rank's own chunk of what it is given, and broadcasts nothing
    model = shard_layers(make_model(), reshard_after_forward=reshard_after_forward)
    return _step_phases(model, batch, loss_fn)


def mixed_precision_experiment(make_model: Callable[[], nn.Module], batch: Batch,
                               loss_fn: Callable, seed: int = 0) -> dict:
    """On each rank: one step in float32 and one under MixedPrecisionPolicy.

    The policy is bfloat16 parameters for the compute (gathered in bfloat16)
    and float32 gradients for the reduce-scatter; the shards stay float32.
    Returns each run's phases (as reshard_experiment) with the output's,
    gradients' and shards' dtypes, and the two losses.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                  reduce_dtype=torch.float32)
    runs = {}
    for name, options in {"float32": {}, "bfloat16": {"mp_policy": policy}}.items():
        torch.manual_seed(seed)
        model = shard_layers(make_model(), **options)
        X, y = batch
        dtypes: dict[str, torch.dtype] = {}

        def loss_of(output, target, dtypes=dtypes):
            dtypes["output"] = output.dtype
            return loss_fn(output.float(), target)  # the loss in float32 either way

        runs[name] = _step_phases(model, (X, y), loss_of)
        runs[name]["dtypes"] = {
            "output": str(dtypes["output"]),
            "grads": sorted({str(p.grad.dtype) for p in model.parameters()
                             if p.grad is not None}),
            "shards": sorted({str(p.dtype) for p in model.parameters()})}
    return runs


def checkpoint_mismatches(state_dict: dict, path: str | Path) -> list[str]:
    """What keeps a torch.distributed.checkpoint at `path` from loading into
    `state_dict`: keys missing from it, and tensors of another shape."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    problems = [f"{key}: not in the checkpoint" for key in state_dict
                if key not in saved]
    for key, value in state_dict.items():
        entry = saved.get(key)
        if isinstance(entry, TensorStorageMetadata) and torch.is_tensor(value) \
                and tuple(entry.size) != tuple(value.shape):
            problems.append(f"{key}: saved {tuple(entry.size)}, this model "
                            f"{tuple(value.shape)}")
    return problems


def load_checkpoint(model: nn.Module, path: str | Path) -> nn.Module:
    """Load a checkpoint saved by `dcp.save` on any number of ranks into `model`.

    In a process without a process group (a kernel) `dcp.load` reads every
    rank's shard and fills whole tensors: resharding from N shards to 1.
    A model the checkpoint does not fit is a ValueError naming each key.
    """
    import torch.distributed.checkpoint as dcp

    state = model.state_dict()
    problems = checkpoint_mismatches(state, path)
    if problems:
        raise ValueError(f"the checkpoint at {path} does not fit "
                         f"{type(model).__name__}: " + "; ".join(problems))
    with warnings.catch_warnings():  # a single process is what this is for
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path))
    model.load_state_dict(state)
    return model


def smallest_world_size(params: float, budget_bytes: float, stage: str,
                        most: int = 4096, **byte_counts: int) -> int | None:
    """The fewest ranks on which `stage` keeps a model's states within a budget.

    Model states only (parameters, gradients, optimizer state, by
    `sharding.memory_per_rank(params, n, **byte_counts)`), per rank; None when
    no world size up to `most` does (a stage that keeps something whole never
    gets below that part, however many ranks).
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if budget_bytes <= 0 or most < 1:
        raise ValueError(f"need budget_bytes > 0 and most >= 1, got {budget_bytes}, "
                         f"{most}")
    return next((n for n in range(1, most + 1)
                 if memory_per_rank(params, n, **byte_counts)[stage] <= budget_bytes),
                None)
