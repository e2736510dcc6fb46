"""labkit.timing.interleaved: the one helper that times candidates in turns.

Fake candidates record every call, so the order, the warm-up and what is kept
are checked exactly, without timing anything real.
"""

import itertools

import pytest

from labkit import timing


def _recording(calls, names):
    """Candidates that log their calls and return 1, 2, 3, ... per candidate."""
    def candidate(name):
        counter = itertools.count(1)

        def call():
            calls.append(name)
            return float(next(counter))
        return call
    return {name: candidate(name) for name in names}


def test_rounds_take_turns_after_a_warm_up_that_is_not_kept():
    calls = []
    times = timing.interleaved(_recording(calls, "ab"), rounds=3, warmup=2,
                               before=lambda n: calls.append(f"before {n}"),
                               after=lambda n: calls.append(f"after {n}"),
                               clock=False)
    warm = ["before a", "a", "before b", "b"]  # no after() in the warm-up
    turn = ["before a", "a", "after a", "before b", "b", "after b"]
    assert calls == warm * 2 + turn * 3
    # The candidates' own seconds, the two warm-up calls dropped.
    assert times == {"a": [3.0, 4.0, 5.0], "b": [3.0, 4.0, 5.0]}


def test_a_sample_is_the_mean_of_repeat_calls_in_a_row():
    calls = []
    times = timing.interleaved(_recording(calls, "ab"), rounds=2, warmup=1,
                               repeat={"a": 3, "b": 1})
    # Warm-up: one call each; then each round a's three calls, then b's one.
    assert calls == ["a", "b"] + ["a", "a", "a", "b"] * 2
    assert {n: len(ts) for n, ts in times.items()} == {"a": 2, "b": 2}
    assert all(t >= 0 for ts in times.values() for t in ts)


def test_the_clock_times_the_call_and_not_before_or_after():
    ticks = []  # 0: before() or after(), 1: the clock read
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(timing.time, "perf_counter", lambda: ticks.append(1) or len(ticks))
        times = timing.interleaved({"a": lambda: None}, rounds=2, warmup=0,
                                   before=lambda n: ticks.append(0),
                                   after=lambda n: ticks.append(0))
    # before, t0, t1, after, per round: a sample spans only the call.
    assert times == {"a": [1, 1]}
    assert ticks == [0, 1, 1, 0] * 2


def test_bad_rounds_warmup_or_repeat_are_refused():
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        timing.interleaved({"a": lambda: None}, rounds=0)
    with pytest.raises(ValueError, match="warmup must be >= 0"):
        timing.interleaved({"a": lambda: None}, warmup=-1)
    with pytest.raises(ValueError, match="repeat must be >= 1"):
        timing.interleaved({"a": lambda: None}, repeat=0)
    with pytest.raises(ValueError, match="repeat must be >= 1"):
        timing.timed(lambda: None, repeat=0)
