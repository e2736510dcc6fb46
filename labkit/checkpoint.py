"""Training-state checkpoints that survive a crash mid-write.

A checkpoint is written to a temporary file in the same folder, flushed and
fsynced, then moved over the old one with os.replace, which is atomic: a
process killed while saving leaves the previous checkpoint whole. The folder is
fsynced too, so that the rename survives a power cut; Windows cannot open a
folder as a file (os.open raises PermissionError), and there that step is
skipped: the rename is still atomic, only not forced to disk. Loading uses
torch.load(weights_only=True), which refuses arbitrary pickled objects, so
every value saved here is a tensor or a plain Python value.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

__all__ = ["CheckpointError", "can_sync_folder", "load", "save"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing or cannot be read."""


def save(state: dict, path: str | os.PathLike) -> Path:
    """Write `state` to `path` atomically; returns the path."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(f".{path.name}.*.tmp"):  # left by a killed save
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _sync_folder(folder)  # and so is the rename, where the system allows it
    return path


def _sync_folder(folder: Path) -> bool:
    """fsync `folder`; False where the system cannot open a folder (Windows)."""
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:  # PermissionError on Windows; an fsync error still raises
        return False
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return True


def can_sync_folder(folder: str | os.PathLike = ".") -> bool:
    """Whether `save` can force its rename to disk here (not on Windows)."""
    return _sync_folder(Path(folder))


def load(path: str | os.PathLike) -> dict:
    """Read a checkpoint written by `save`, accepting tensors and plain values only."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated, not a checkpoint, or unsafe content
        raise CheckpointError(f"cannot read checkpoint {path}: {err}") from err
