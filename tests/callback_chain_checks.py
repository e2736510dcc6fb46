"""Rank-side trials for test_callback_chain.py, run on every rank of a group.

A separate module so that pytest does not rewrite it: the engines import it
by name and run the same code as the test process sees.
"""

import sys

import torch
import torch.distributed as dist

from labkit import callback_chain


def _in_a_callback() -> bool:
    """Whether the chain's callback (`next_call`) is on the caller's stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "next_call":
            return True
        frame = frame.f_back
    return False


def issuing_threads(calls: int = 3) -> list[bool]:
    """Per all-reduce of callback_chain's chain: whether a callback issued it.

    Asked of the stack, not of the thread: a `.then` attached once the future
    is complete runs at once on the caller's (main) thread, which the load
    decides; gloo's thread runs it otherwise.
    """
    issued, original = [], dist.all_reduce

    def recorded(*args, **kwargs):
        issued.append(_in_a_callback())
        return original(*args, **kwargs)

    dist.all_reduce = recorded
    try:
        callback_chain._chain(torch.ones(8), calls, 1)
    finally:
        dist.all_reduce = original
    return issued
