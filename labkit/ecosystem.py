"""Libraries on top of DDP: how PyTorch Lightning and Hugging Face Accelerate
accumulate gradients (with no_sync underneath).

Both are optional: nothing here imports them unless asked, and every function
says clearly when one is not installed. `python -m labkit.ecosystem NAME`
(under torchrun) trains a tiny model with NAME's gradient accumulation and
counts how often DDP's no_sync() is entered.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from . import i18n

__all__ = ["FRAMEWORKS", "count_no_sync", "counted_no_sync", "no_sync_lines",
           "run_counted"]

i18n.register({
    "framework_skip": {
        "ja": "{name} はインストールされていないので飛ばします "
              "(試すには pip install {name})",
        "en": "{name} is not installed, skipped (to try it: pip install {name})",
    },
    "frameworks_checked": {
        "ja": "確かめたもの: {checked} / 飛ばしたもの: {skipped}。"
              "飛ばしたものについては、この実行は"
              "「中で no_sync を使う」ことを示していません",
        "en": "checked: {checked} / skipped: {skipped}. For those skipped, this run "
              "does not show that they use no_sync",
    },
})

# What each library calls when it accumulates: the functions whose source we read.
FRAMEWORKS = {
    "lightning": ("lightning.pytorch.strategies.parallel",
                  "ParallelStrategy.block_backward_sync"),
    "accelerate": ("accelerate.accelerator", "Accelerator.accumulate",
                   "Accelerator.no_sync"),
}


def no_sync_lines(name: str) -> list[str]:
    """The source lines of `name`'s accumulation helper that call no_sync()."""
    import importlib

    if name not in FRAMEWORKS:
        raise ValueError(f"unknown framework {name!r}: choose one of "
                         f"{', '.join(FRAMEWORKS)}")
    module_name, *qualnames = FRAMEWORKS[name]
    lines = []
    for qualname in qualnames:
        obj = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        lines += [f"{qualname}: {line.strip()}"
                  for line in inspect.getsource(obj).splitlines()
                  if "no_sync" in line
                  and not line.strip().startswith(("#", ">>>", "`", "def "))]
    return lines


@contextmanager
def counted_no_sync() -> Iterator[list[int]]:
    """Count the entries into DDP.no_sync() in the block (one item per entry).

    DDP.no_sync is replaced by a counting wrapper for the block only: it is put
    back however the block ends, so a failed run leaves DDP as torch made it.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    entered: list[int] = []
    original = DDP.no_sync

    def counting(self):
        entered.append(1)
        return original(self)

    DDP.no_sync = counting
    try:
        yield entered
    finally:
        DDP.no_sync = original


def count_no_sync(name: str, accum_steps: int = 4, batches: int = 8) -> dict:
    """Train with `name`'s accumulation under DDP; count no_sync() entries (one rank).

    Runs inside a process started by torchrun. DDP.no_sync is wrapped in a
    counter before the library builds its DDP model, so every entry counts.
    """
    import torch

    if name not in FRAMEWORKS:
        raise ValueError(f"unknown framework {name!r}")
    torch.manual_seed(0)
    per_rank = batches * 2  # two samples a batch on each rank
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    dataset = torch.utils.data.TensorDataset(torch.randn(per_rank * world, 10),
                                             torch.randn(per_rank * world, 10))
    train = _train_accelerate if name == "accelerate" else _train_lightning
    with counted_no_sync() as entered:
        rank, steps, wrapped = train(dataset, accum_steps, world)
    return {"framework": name, "rank": rank, "world_size": world,
            "wrapped_in": wrapped, "batches": batches, "accum_steps": accum_steps,
            "optimizer_steps": steps, "no_sync_entries": len(entered)}


def _train_accelerate(dataset, accum_steps: int, world: int) -> tuple[int, int, str]:
    """Accelerate's accumulation; returns (rank, optimizer steps, wrapper type)."""
    import torch
    from accelerate import Accelerator
    from torch import nn

    accelerator = Accelerator(gradient_accumulation_steps=accum_steps, cpu=True)
    model = nn.Linear(10, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps = 0
    for X, y in loader:
        with accelerator.accumulate(model):  # no_sync() unless it is step time
            accelerator.backward(nn.functional.mse_loss(model(X), y))
            optimizer.step()  # Accelerate skips it between accumulation steps
            steps += accelerator.sync_gradients
            optimizer.zero_grad()
    return accelerator.process_index, steps, type(model).__name__


def _train_lightning(dataset, accum_steps: int, world: int) -> tuple[int, int, str]:
    """Lightning's accumulation; returns (rank, optimizer steps, wrapper type)."""
    import lightning as L
    import torch
    from torch import nn

    seen: set[str] = set()  # what Lightning wrapped the module in, in training

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(10, 10)

        def training_step(self, batch, batch_idx):
            seen.add(type(self.trainer.strategy.model).__name__)
            X, y = batch
            return nn.functional.mse_loss(self.net(X), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp",
                        accumulate_grad_batches=accum_steps, max_epochs=1,
                        logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(), torch.utils.data.DataLoader(dataset, batch_size=2))
    return trainer.global_rank, trainer.global_step, ", ".join(sorted(seen))


def run_counted(name: str, world_size: int = 2, timeout_s: float = 180.0) -> list[dict]:
    """`count_no_sync(name)` on `world_size` ranks under torchrun; results by rank."""
    from .cluster import torchrun

    if name not in FRAMEWORKS:
        raise ValueError(f"unknown framework {name!r}: choose one of "
                         f"{', '.join(FRAMEWORKS)}")
    node, = torchrun.run_nodes(["-m", "labkit.ecosystem", name], nnodes=1,
                                nproc_per_node=world_size, timeout_s=timeout_s)
    # Ranks share one output: take each result object, not each line.
    results = [json.loads(m) for m in re.findall(r"LABKIT_RESULT (\{[^{}]*\})",
                                                 node.output)]
    if node.returncode != 0 or len(results) != world_size:
        raise RuntimeError(f"{name} run failed (exit {node.returncode}):\n"
                           + node.output[-3000:])
    return sorted(results, key=lambda r: r["rank"])


if __name__ == "__main__":  # python -m labkit.ecosystem lightning|accelerate
    # One write per result, so that two ranks' results never interleave.
    sys.stdout.write("LABKIT_RESULT " + json.dumps(count_no_sync(sys.argv[1])) + "\n")
    from .cluster import launch

    launch.exit_now(0)  # flushed, and no abort in gloo's threads at exit: see exit_now
