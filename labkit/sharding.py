"""Where "each GPU holds part of the parameters" is true: FSDP and ZeRO.

DDP keeps a full copy of everything on every rank. ZeRO stage 1, 2 and 3 shard
the optimizer states, then the gradients, then the parameters; PyTorch's FSDP
(`fully_shard`, "FSDP2") shards all three, like ZeRO-3.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import i18n, models

__all__ = ["STAGES", "fsdp_experiment", "held_bytes", "memory_per_rank"]

STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")

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
    the parameters, momentum and variance). Activations are not included.
    """
    if world_size < 1 or params <= 0:
        raise ValueError(f"need params > 0 and world_size >= 1, got {params}, "
                         f"{world_size}")
    p, g, o = params * param_bytes, params * grad_bytes, params * optimizer_bytes
    n = world_size
    return {"DDP": p + g + o, "ZeRO-1": p + g + o / n, "ZeRO-2": p + (g + o) / n,
            "ZeRO-3": (p + g + o) / n}


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
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    torch.manual_seed(seed)
    reference = models.MLP().to(device)
    model = models.MLP().to(device)
    model.load_state_dict(reference.state_dict())
    mesh = init_device_mesh(device, (world_size,))
    fully_shard(model.fc1, mesh=mesh)  # one unit per layer: gathered one at a time
    fully_shard(model.fc2, mesh=mesh)
    fully_shard(model, mesh=mesh)
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

