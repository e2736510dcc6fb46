"""Assertions that lessons make, with messages in the lesson's language."""

from __future__ import annotations

import os
import re
import statistics
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch

from . import compare, i18n
from .i18n import t

__all__ = ["GRAD_TOL", "RAISING", "CapturedStderr", "ExpectedError", "allreduce_calls",
           "captured_stderr", "expect_error", "faster", "grads_differ", "grads_match",
           "one_sync_per_update", "replicas_equal"]

# float32 sums of the same terms in another order (micro-batches, ranks) differ
# by rounding only: well under this for the course's models.
GRAD_TOL = 1e-6

i18n.register({
    "raised_as_expected": {
        "ja": "想定どおりの例外: {name}: {msg}",
        "en": "Raised as expected: {name}: {msg}",
    },
    "did_not_raise": {
        "ja": "{name} が発生するはずでしたが、何も起きませんでした",
        "en": "Expected {name}, but nothing was raised",
    },
    "wrong_message": {
        "ja": "{name} は発生しましたが、メッセージに {pattern!r} がありません: {msg}",
        "en": "{name} was raised, but its message lacks {pattern!r}: {msg}",
    },
    "check_grads_match": {
        "ja": "勾配が基準と最大 {diff:.2e} 違います (許容は {tol:.0e} まで)。",
        "en": "The gradients differ from the reference by up to {diff:.2e} "
              "(at most {tol:.0e} allowed).",
    },
    "check_grads_differ": {
        "ja": "勾配が基準と {diff:.2e} しか違いません "
              "({floor:.0e} より大きいはずです)。",
        "en": "The gradients differ from the reference by only {diff:.2e} "
              "(more than {floor:.0e} expected).",
    },
    "check_replicas": {
        "ja": "ランク間でパラメータが最大 {diff:.2e} 違います (0 のはずです)。",
        "en": "The ranks' parameters differ by up to {diff:.2e} (0 expected).",
    },
    "check_calls": {
        "ja": "all-reduce が {got} 回でした ({want} 回のはずです)。",
        "en": "{got} all-reduce call(s), {want} expected.",
    },
    "check_sync_per_update": {
        "ja": "K = {K}: 1 回の更新の all-reduce が、同期ありで {sync} 回 "
              "{sync_b} バイト、no_sync で {nosync} 回 {nosync_b} バイトでした "
              "(同期ありは no_sync の K 倍、no_sync は勾配 1 回分の {grad_b} "
              "バイトのはずです)。",
        "en": "K = {K}: one update all-reduces {sync} time(s), {sync_b} bytes, when "
              "synchronized, and {nosync} time(s), {nosync_b} bytes, with no_sync "
              "(expected K times as much synchronized, and one gradient's {grad_b} "
              "bytes with no_sync).",
    },
    "check_faster": {
        "ja": "{slow} の中央値 {slow_ms:.2f} ms は {fast} の中央値 {fast_ms:.2f} ms の "
              "{ratio:.2f} 倍でした ({want:.2f} 倍以上のはずです)。",
        "en": "The median {slow} round, {slow_ms:.2f} ms, took {ratio:.2f} times the "
              "median {fast} round, {fast_ms:.2f} ms ({want:.2f} times or more "
              "expected).",
    },
})


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


# The checks below that raise AssertionError when the claim is false: the claims
# ledger (labkit.ledger.asserts) counts a call of one of them as an assertion.
RAISING = frozenset({"expect_error", "grads_match", "grads_differ", "replicas_equal",
                     "allreduce_calls", "one_sync_per_update", "faster"})


def grads_match(got: Iterable[torch.Tensor], want: Iterable[torch.Tensor],
                tol: float = GRAD_TOL) -> float:
    """Assert the gradients agree to `tol` elementwise; return the largest gap."""
    diff = compare.max_abs_diff(got, want)
    if not diff <= tol:  # also catches NaN
        raise AssertionError(t("check_grads_match", diff=diff, tol=tol))
    return diff


def grads_differ(got: Iterable[torch.Tensor], want: Iterable[torch.Tensor],
                 floor: float = 1e-3) -> float:
    """Assert the gradients differ by more than `floor` somewhere; return the gap."""
    diff = compare.max_abs_diff(got, want)
    if not diff > floor:
        raise AssertionError(t("check_grads_differ", diff=diff, floor=floor))
    return diff


def replicas_equal(model: torch.nn.Module | float) -> float:
    """Assert every rank holds exactly rank 0's parameters.

    Give the model (run on every rank: it gathers the parameters) or a
    difference compare.replica_max_diff has already measured.
    """
    diff = model if isinstance(model, float) else compare.replica_max_diff(model)
    if diff != 0.0:
        raise AssertionError(t("check_replicas", diff=diff))
    return diff


def allreduce_calls(got: int, want: int) -> None:
    """Assert a communication hook counted `want` all-reduce calls."""
    if got != want:
        raise AssertionError(t("check_calls", got=got, want=want))


def one_sync_per_update(K: int, calls: tuple[int, int], nbytes: tuple[int, int],
                        params: int) -> None:
    """Assert what one update of K micro-batches communicates, (sync, no_sync).

    With no_sync the update sends one gradient's worth (float32: 4 bytes a
    parameter) in the calls of one synchronization; synchronizing every
    micro-batch sends K times the calls and K times the bytes.
    """
    (sync, nosync), (sync_b, nosync_b) = calls, nbytes
    grad_b = 4 * params
    if not (nosync >= 1 and sync == K * nosync and nosync_b == grad_b
            and sync_b == K * grad_b):
        raise AssertionError(t("check_sync_per_update", K=K, sync=sync, sync_b=sync_b,
                               nosync=nosync, nosync_b=nosync_b, grad_b=grad_b))


def faster(fast: Sequence[float], slow: Sequence[float], margin: float = 0.2,
           fast_name: str = "no_sync", slow_name: str = "sync") -> float:
    """Assert median(slow) >= (1 + margin) * median(fast); return the ratio.

    Both are seconds of the same interleaved rounds, so a busy moment of a
    shared machine falls on both alike, and a median ignores a stray round.
    Choose `margin` below the smallest ratio that repeated runs measured.
    """
    med_fast, med_slow = statistics.median(fast), statistics.median(slow)
    ratio = med_slow / med_fast
    if not ratio >= 1 + margin:
        raise AssertionError(t("check_faster", fast=fast_name, slow=slow_name,
                               fast_ms=med_fast * 1e3, slow_ms=med_slow * 1e3,
                               ratio=ratio, want=1 + margin))
    return ratio
