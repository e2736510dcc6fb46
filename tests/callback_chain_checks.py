"""Rank-side trials for test_callback_chain.py, run on every rank of a group.

A separate module so that pytest does not rewrite it: the engines import it
by name and run the same code as the test process sees.
"""

import threading

import torch
import torch.distributed as dist

from labkit import callback_chain


def issuing_threads(calls: int = 3) -> list[bool]:
    """Per all-reduce of callback_chain's chain: whether the main thread issued it."""
    issued, original = [], dist.all_reduce

    def recorded(*args, **kwargs):
        issued.append(threading.current_thread() is threading.main_thread())
        return original(*args, **kwargs)

    dist.all_reduce = recorded
    try:
        callback_chain._chain(torch.ones(8), calls, 1)
    finally:
        dist.all_reduce = original
    return issued
