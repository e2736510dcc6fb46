"""Where "each GPU holds part of the parameters" is true: FSDP and ZeRO.

DDP keeps a full copy of everything on every rank. ZeRO stage 1, 2 and 3 shard
the optimizer states, then the gradients, then the parameters; PyTorch's FSDP
(`fully_shard`, "FSDP2") shards all three, like ZeRO-3.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from . import i18n, models

__all__ = [
    "FP32_ADAM",
    "STAGES",
    "FlatParameters",
    "fsdp_experiment",
    "held_by_part",
    "held_bytes",
    "memory_parts",
    "memory_per_rank",
    "shard_units",
    "trace_gathers",
]

STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
# Adam in float32: 4 bytes a parameter, 4 a gradient, 8 of state (exp_avg and
# exp_avg_sq, 4 each). Adam's third state, `step`, is one 4-byte scalar tensor
# per parameter tensor, not per element: it is left out of the formula.
FP32_ADAM = {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8}
_Trainer = TypeVar("_Trainer")

i18n.register({
    "gb_per_rank": {"ja": "1 ランクあたりのメモリ [GB]", "en": "memory per rank [GB]"},
    "zero_title": {
        "ja": "75 億パラメータ、64 ランク: モデル状態のメモリ (ZeRO 論文の例)",
        "en": "7.5B parameters, 64 ranks: model-state memory (the ZeRO paper's case)",
    },
})


def memory_per_rank(params: float, world_size: int, param_bytes: int = 2,
                    grad_bytes: int = 2, optimizer_bytes: int = 12) -> dict[str, float]:
    """Bytes of model states per rank: parameters, gradients, optimizer states.

    Defaults are the ZeRO paper's mixed-precision Adam: float16 parameters and
    gradients (2 + 2 bytes) and 12 bytes of optimizer state (a float32 copy of
    the parameters, momentum and variance); `**FP32_ADAM` is Adam in float32.
    Activations are not included. Each stage's parts: `memory_parts`.
    """
    parts = memory_parts(params, world_size, param_bytes, grad_bytes, optimizer_bytes)
    return {stage: sum(part.values()) for stage, part in parts.items()}


def memory_parts(params: float, world_size: int, param_bytes: int = 2,
                 grad_bytes: int = 2,
                 optimizer_bytes: int = 12) -> dict[str, dict[str, float]]:
    """Per stage, the bytes per rank of parameters, gradients and optimizer state.

    Stage 1 shards the optimizer state, stage 2 the gradients too, stage 3
    the parameters too: a sharded part is divided by the world size.
    """
    if world_size < 1 or params <= 0:
        raise ValueError(f"need params > 0 and world_size >= 1, got {params}, "
                         f"{world_size}")
    p, g, o = params * param_bytes, params * grad_bytes, params * optimizer_bytes
    n = world_size
    return {stage: {"parameters": p / n if k >= 3 else p,
                    "gradients": g / n if k >= 2 else g,
                    "optimizer": o / n if k >= 1 else o}
            for k, stage in enumerate(STAGES)}


class FlatParameters:
    """Parameters moved into one flat buffer, padded to a multiple of world_size.

    Each parameter's data becomes a view of `full`, so whatever is written into
    `full` (an all-gather, say) is what the model computes with. The padding
    (at most world_size - 1 zeros at the end) lets every rank's shard have the
    same numel, as all-gather and reduce-scatter need. A shard may cut a tensor
    anywhere: fit for optimizers that work element by element (SGD, Adam,
    AdamW), not for those that use a whole tensor's norm or shape (Adafactor,
    Muon).
    """

    def __init__(self, params: Iterable[nn.Parameter], world_size: int):
        self.params = list(params)
        if world_size < 1 or not self.params:
            raise ValueError(f"need parameters and world_size >= 1, got "
                             f"{len(self.params)} parameters, world_size {world_size}")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("a parameter is listed twice (a tied weight?): "
                             "list each tensor once")
        self.world_size = world_size
        self.numel = sum(p.numel() for p in self.params)
        self.shard_numel = -(-self.numel // world_size)  # ceil
        first = self.params[0]
        self.full = torch.zeros(self.shard_numel * world_size, dtype=first.dtype,
                                device=first.device)
        for p, view in zip(self.params, self._views(self.full), strict=True):
            view.copy_(p.detach())
            p.data = view

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view of a flat buffer laid out like `full`."""
        sizes = [p.numel() for p in self.params]
        pieces = flat[:self.numel].split(sizes)
        return [x.view_as(p) for x, p in zip(pieces, self.params, strict=True)]

    def shard(self, rank: int) -> torch.Tensor:
        """Rank `rank`'s shard of `full`: a view, elements [rank*s, (rank+1)*s)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return self.full[rank * self.shard_numel:(rank + 1) * self.shard_numel]

    def flat_grad(self) -> torch.Tensor:
        """The parameters' gradients in one padded flat buffer (zeros where None).

        Each parameter's `.grad` becomes a view of it, so the gradient is held
        once: a new buffer, laid out like `full`.
        """
        flat = torch.zeros_like(self.full)
        for p, view in zip(self.params, self._views(flat), strict=True):
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
        return flat


def shard_units(model: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """The model's trainable parameters grouped by the module that gathers them.

    Each module takes the trainable parameters registered on it directly. A
    parameter registered on several modules (a tied weight) goes to the root,
    whose gather spans the whole forward pass; frozen parameters go nowhere.
    Modules without parameters of their own are left out; the root is last.
    """
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                owners.setdefault(id(p), []).append(module)
    units, seen = [], set()
    for module in model.modules():
        mine = [p for p in module.parameters(recurse=False)
                if p.requires_grad and id(p) not in seen
                and (module is model or len(owners[id(p)]) == 1)]
        seen.update(id(p) for p in mine)
        if module is not model and mine:
            units.append((module, mine))
    shared = [p for p in model.parameters() if id(p) not in seen and p.requires_grad]
    root = [p for p in model.parameters(recurse=False) if p.requires_grad]
    mine = root + [p for p in shared if all(p is not q for q in root)]
    if mine:
        units.append((model, mine))
    return units


def held_by_part(parameters: Iterable[torch.Tensor], gradients: Iterable[torch.Tensor],
                 optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes held (`held_bytes`) by parameters, gradients and the optimizer's state."""
    state = [v for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor)]
    return {"parameters": held_bytes(parameters), "gradients": held_bytes(gradients),
            "optimizer": held_bytes(state)}


def held_bytes(tensors) -> int:
    """Bytes of memory the tensors hold: each storage counted once.

    A tensor's storage is the memory it owns (`untyped_storage().nbytes()`),
    so a view, a tied weight or a shard's view of a flat buffer is counted with
    its storage, once; a storage resized to 0 (freed) counts 0. A DTensor counts
    its local part, which is what this rank holds. None entries are skipped.
    """
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # a DTensor: what this rank holds
            t = t.to_local()
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes(), t.device)
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def fsdp_experiment(rank: int, world_size: int, seed: int = 0) -> dict:
    """Shard doc 004's MLP with fully_shard; compare with the unsharded model.

    Runs on every rank of a gloo (or nccl) group. Each rank holds dim-0 chunks
    of every parameter; the forward pass gathers them, and the gradient each
    rank ends with is its chunk of the whole batch's gradient.
    """
    from .fsdp import shard_layers  # fsdp builds on this module

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    torch.manual_seed(seed)
    reference = models.MLP().to(device)
    model = models.MLP().to(device)
    model.load_state_dict(reference.state_dict())
    shard_layers(model)  # one unit per layer (fc1, fc2), then the root
    shards = {name: {"global": tuple(p.shape), "local": tuple(p.to_local().shape),
                     "placement": str(p.placements[0])}
              for name, p in model.named_parameters()}
    local_numel = sum(p.to_local().numel() for p in model.parameters())

    torch.manual_seed(seed + 1)
    X, y = torch.randn(64, 10, device=device), torch.randn(64, 10, device=device)
    per = len(X) // world_size
    part = slice(rank * per, (rank + 1) * per)
    criterion = models.MyLoss()
    criterion(model(X[part]), y[part]).backward()  # this rank's share of the batch
    criterion(reference(X), y).backward()  # one process, the whole batch
    grad_diff = max((p.grad.full_tensor() - r.grad).abs().max().item()
                    for p, r in zip(model.parameters(), reference.parameters(),
                                    strict=True))
    return {"rank": rank, "shards": shards, "local_numel": local_numel,
            "full_numel": models.count_params(reference),
            "grad_max_abs_diff": grad_diff}


def trace_gathers(trainer: _Trainer) -> _Trainer:
    """After each gather and each free of a ZeRO-3 trainer, note what it holds gathered.

    `trainer` is built like the ZeRO-by-hand lesson's `Zero3`: `units` (a
    `FlatParameters` a layer) and the methods `gather(flat)`,
    `after_forward(flat, output)` and `after_backward(flat)`. On this trainer
    only, each is wrapped to append to `trainer.trace`, after it ran, the event
    ("gather" or "free"), the layer's index in `units` and the bytes every
    layer's `full` then holds (`held_bytes`). Returns the trainer.
    """
    trainer.trace = []

    def noted(method, event):
        def call(flat, *args):
            method(flat, *args)
            held = held_bytes(f.full for f in trainer.units)
            trainer.trace.append((event, trainer.units.index(flat), held))
        return call

    trainer.gather = noted(trainer.gather, "gather")
    trainer.after_forward = noted(trainer.after_forward, "free")
    trainer.after_backward = noted(trainer.after_backward, "free")
    return trainer
