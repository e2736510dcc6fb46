"""The ranks in a notebook: `%%px` cells wait for them and find them repaired.

IPython runs these hooks around every cell of the kernel that started ranks.
Before a cell, the ranks are watched (labkit.cluster.stalls) and, for a cell
that uses the px magics, waited for (after a background start) and repaired
(after a failed cell); after a cell that failed on the ranks, what the failure
broke is noted for the next one, and which ranks failed how (`last_failure`).
"""

from __future__ import annotations

from collections.abc import Callable

from . import failures

__all__ = ["install_hooks"]

_installed: dict[str, Callable] = {}


def install_hooks(current: Callable) -> None:
    """Register the cell hooks once in this IPython kernel (nothing outside one).

    `current()` returns the running ranks, or None.
    """
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or _installed:
        return
    _installed["current"] = current
    shell.events.register("pre_run_cell", _before_cell)
    shell.events.register("post_run_cell", _after_cell)


def _uses_px(info) -> bool:
    cell = getattr(info, "raw_cell", "") or ""
    return "%px" in cell or "%autopx" in cell


def _before_cell(info) -> None:
    ranks = _installed["current"]()
    if ranks is None:
        return
    # Watched from the start: a cell that waits for ranks still booting is
    # watched too (its report then shows where the start stands).
    ranks.watch.push("this cell", ranks.stall_s)
    if _uses_px(info):
        ranks.last_failure = None
        ranks.wait()
        ranks._repair()


def _after_cell(result) -> None:
    import ipyparallel as ipp

    ranks, err = _installed["current"](), getattr(result, "error_in_exec", None)
    if ranks is None:
        return
    ranks.watch.pop()
    # %%px shows each rank's error as it streams, then raises this wrapper
    # around the CompositeError (ipyparallel 9's magics).
    if isinstance(err, ipp.error.AlreadyDisplayedError):
        err = err.original_error
    if isinstance(err, ipp.error.CompositeError):
        ranks.note_damage(err)
        ranks.last_failure = failures.failures(err.elist, ranks._rank_of)
