"""Assertions that lessons make, with messages in the lesson's language."""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from .i18n import t

__all__ = ["CapturedStderr", "ExpectedError", "captured_stderr", "expect_error",
           "max_abs_diff"]


class ExpectedError:
    """What `expect_error` caught: the exception, once the block has run."""

    exception: BaseException | None = None


@contextmanager
def expect_error(
    exc_type: type[BaseException] | tuple[type[BaseException], ...],
    match: str | None = None,
) -> Iterator[ExpectedError]:
    """Run a block that must raise `exc_type` (its message matching `match`).

    The error is printed and swallowed, so a lesson can show a failure and go
    on; if the block does not fail that way, an AssertionError stops the lesson.
    """
    caught = ExpectedError()
    types = exc_type if isinstance(exc_type, tuple) else (exc_type,)
    name = " / ".join(e.__name__ for e in types)
    try:
        yield caught
    except types as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if match is not None and not re.search(match, str(e)):
            raise AssertionError(t("wrong_message", name=name, pattern=match,
                                   msg=msg)) from e
        caught.exception = e
        print(t("raised_as_expected", name=type(e).__name__, msg=msg))
    else:
        raise AssertionError(t("did_not_raise", name=name))


def max_abs_diff(a: Iterable[torch.Tensor] | torch.Tensor,
                 b: Iterable[torch.Tensor] | torch.Tensor) -> float:
    """Largest absolute elementwise difference between tensors (or lists of them)."""
    if isinstance(a, torch.Tensor):
        a, b = [a], [b]
    a, b = list(a), list(b)
    if len(a) != len(b):
        raise ValueError(f"different numbers of tensors: {len(a)} and {len(b)}")
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape:
            raise ValueError(f"shapes differ: {tuple(x.shape)} and {tuple(y.shape)}")
        if x.numel():
            worst = max(worst, (x.detach() - y.detach()).abs().max().item())
    return worst


class CapturedStderr:
    """What `captured_stderr` caught: `text`, once the block has run."""

    text: str = ""


@contextmanager
def captured_stderr() -> Iterator[CapturedStderr]:
    """Capture file descriptor 2 of this process and of the processes it starts.

    In a notebook, child processes write to the kernel's stderr, which the
    notebook never shows; this makes that lost output visible.
    """
    captured = CapturedStderr()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            captured.text = tmp.read().decode(errors="replace")
