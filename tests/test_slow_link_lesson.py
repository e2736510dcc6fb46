"""Lesson 14's slow link: its cells as written, and with the link's delay removed.

The section "A slow link you can dial" asserts that an all-reduce over the link
takes at least the link's delay, that the delay each step gets is calls × α +
bytes / β, and that the slowest link makes fp16 and PowerSGD beat DDP. These
tests run those cells, read from the built notebook, on the test engines and in
this process (the kernel's cells): as written they pass; with the delay skipped
(the link books it but lets the call go) or priced at 0, the cell's assertion
fails. The measurement runs on fewer links and rounds than the lesson's, to take
seconds.
"""

import pytest
from lesson_cells import finder

from labkit import cluster


def _cells() -> dict[str, str]:
    """The section's cells, by a line each contains (no magic line)."""
    find = finder("14_slow_link")
    # A shown cell and the folded cell after it that checks it: run as one.
    return {"one": find("ALPHA, BETA = 1e-3, 100e6")
            + find("assert one_s >= delay"),
            "measure": find("over = slow_link.steps_over_links("),
            "table": find('over = ranks.pull("over")')
            + find("What each method hands the link per step"),
            "rounds": find('steps = ranks.pull("over")[0]'),
            "solution": find("return (S_ddp - S_fp16) / (t_fp16 - t_ddp)"),
            "crossover": find("def predicted_crossover(name):")
            + find("def loopback_plus_link(name, beta):")}


CELLS = _cells()
RANK_NAMES = ("import torch.distributed as dist\n"
              "rank, world_size = dist.get_rank(), dist.get_world_size()")
SAVE = ("from labkit import slow_link\n"
        "_saved = slow_link.SlowLink, slow_link.link_time\n")
# The link books each call's delay but lets it complete at once.
NO_WAIT = "from slow_link_checks import NoWaitLink\nslow_link.SlowLink = NoWaitLink\n"
# The rule prices every call at 0 s.
FREE = "slow_link.link_time = lambda nbytes, alpha_s, beta_Bps: 0.0\n"
UNDO = "slow_link.SlowLink, slow_link.link_time = _saved\n"


def _with(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, old
    return source.replace(old, new)


# Two links and three rounds: the same assertions, in seconds.
SHORT = _with(_with(CELLS["measure"], "BETAS = (1e8, 2e8, 5e8, 1e9, 2e9, 5e9)",
                    "BETAS = (1e8, 5e8)"), "rounds=12", "rounds=3")
# A link that only books its delay waits for nothing: at 1 MB/s it books seconds a
# step, more than any step takes, however loaded the machine (at 100 MB/s a busy
# machine's step could outlast the booked 85 ms and hide the missing wait).
BOOKED = _with(SHORT, "BETAS = (1e8, 5e8)", "BETAS = (1e6, 5e8)")


def _measure(ranks, patch: str = "", measure: str = SHORT) -> None:
    ranks.execute(RANK_NAMES + "\n" + SAVE)
    try:
        ranks.execute(CELLS["one"])  # its imports; the section's first cell
        ranks.execute(patch + measure)
    finally:
        ranks.execute(UNDO)


def _kernel(name: str, namespace: dict) -> None:
    exec(compile(CELLS[name], f"<cell {name}>", "exec"), namespace)


def _fails_at(name: str, namespace: dict, line: str) -> None:
    """The kernel's cell `name` fails its assertion on the line containing `line`."""
    with pytest.raises(AssertionError) as caught:
        _kernel(name, namespace)
    where = next(entry for entry in reversed(caught.traceback)
                 if entry.path == f"<cell {name}>")
    assert line in CELLS[name].splitlines()[where.lineno]


def test_one_allreduce_takes_at_least_the_links_delay(ranks):
    ranks.execute(RANK_NAMES)
    ranks.execute(CELLS["one"])
    assert ranks.pull("nbytes") == [4 * 2**20] * 2
    assert all(one_s >= 0.0429 for one_s in ranks.pull("one_s"))


@pytest.mark.parametrize("patch", [NO_WAIT, FREE], ids=["delay skipped",
                                                        "delay priced at 0"])
def test_one_allreduce_fails_without_the_delay(ranks, patch):
    ranks.execute(RANK_NAMES + "\n" + SAVE)
    try:
        with pytest.raises(cluster.RankError, match="AssertionError"):
            ranks.execute(patch + CELLS["one"])
    finally:
        ranks.execute(UNDO)


# The delay slept on the thread that completes the collective (gloo's), as a
# link without threads of its own would: what slow_link's threads avoid.
ON_GLOOS_THREAD = """
class _Here:
    def submit(self, fn, *args):
        fn(*args)


_saved_waiters = slow_link._waiters
slow_link._waiters = _Here
"""


def test_one_allreduce_fails_when_gloos_thread_waits(ranks):
    ranks.execute(RANK_NAMES + "\n" + SAVE)
    try:
        with pytest.raises(cluster.RankError,
                           match=r"assert all\(call.thread.startswith"):
            ranks.execute(ON_GLOOS_THREAD + CELLS["one"])
        assert ranks.pull("two_s")[0] >= 2 * 0.0429  # the link's timing held ...
    finally:  # ... only the thread was wrong
        ranks.execute(UNDO + "slow_link._waiters = _saved_waiters\n")


# The main thread set back past the delays before it looks at the futures, as a
# busy machine can: the checks must hold all the same.
LATE = "    time.sleep(0.3)  # set back past the delays\n"


def test_one_allreduce_passes_with_a_late_main_thread(ranks):
    ranks.execute(RANK_NAMES)
    ranks.execute(_with(CELLS["one"], "returned_s = time.perf_counter() - start\n",
                        "returned_s = time.perf_counter() - start\n" + LATE))
    assert all(two_s >= 0.3 for two_s in ranks.pull("two_s"))


def test_the_sections_measurement_passes_its_assertions(ranks):
    _measure(ranks)
    namespace = {"ranks": ranks}
    _kernel("table", namespace)
    assert set(namespace["steps"]) == {float("inf"), 1e8, 5e8}  # loopback, two links
    _kernel("rounds", {"ranks": ranks})  # every round drawn: the same run passes


@pytest.mark.parametrize(("patch", "line"), [
    (NO_WAIT, 'assert row[name]["step_s"] >= row[name]["link_s"]'),
    (FREE, 'assert math.isclose(row[name]["link_s"], added)')],
    ids=["delay skipped", "delay priced at 0"])
def test_the_steps_fail_without_the_delay(ranks, patch, line):
    _measure(ranks, patch, BOOKED)
    _fails_at("table", {"ranks": ranks}, line)


def _crossover_namespace(t_psgd: float) -> dict:
    """What the crossover cell reads, for a run whose steps are made up."""
    import math

    from labkit import slow_link

    rows = {"DDP": (15e-3, 8_482_856, 2), "fp16": (16e-3, 4_241_428, 2),
            "PowerSGD r=1": (t_psgd, 36_984, 3)}
    loop = {name: {"step_s": t, "bytes": S, "calls": c}
            for name, (t, S, c) in rows.items()}
    betas = (1e8, 1e9)
    steps = {beta: {name: {"step_s": t + c * 1e-4 + S / beta}
                    for name, (t, S, c) in rows.items()} for beta in betas}
    namespace = {"math": math, "slow_link": slow_link, "loop": loop,
                 "METHODS": tuple(rows), "BETAS": betas, "LINK_ALPHA": 1e-4,
                 "ratio": lambda b, name: (steps[b][name]["step_s"]
                                           / steps[b]["DDP"]["step_s"]),
                 "t_ddp": 15e-3, "t_fp16": 16e-3, "S_ddp": 8_482_856,
                 "S_fp16": 4_241_428, "calls": 2, "alpha_s": 1e-4}
    _kernel("solution", namespace)
    return namespace


@pytest.mark.parametrize("t_psgd", [15.05e-3, 14e-3], ids=["pays below", "always"])
def test_the_predicted_crossover_is_where_the_curves_cross(t_psgd):
    namespace = _crossover_namespace(t_psgd)
    _kernel("crossover", namespace)
    assert namespace["crossover"]["fp16"] == pytest.approx(4_241_428 / 1e-3)


def test_the_crossover_check_fails_with_powersgds_extra_call_left_out():
    # PowerSGD makes one all-reduce more than DDP: its α stays in the formula
    namespace = _crossover_namespace(15.05e-3)
    CELLS["crossover_no_alpha"] = _with(
        CELLS["crossover"], ' + (m["calls"] - d["calls"]) * LINK_ALPHA', "")
    _fails_at("crossover_no_alpha", namespace,
              "assert math.isclose(on_grid, predicted, rel_tol=1e-3)")


class _Pulled:
    """Ranks whose pulled "over" is made up: the rounds figure's cell reads it."""

    def __init__(self, over):
        self.over = over

    def pull(self, name):
        assert name == "over"
        return [self.over, self.over]


def _over(broken: str = "") -> dict:
    """steps_over_links' answer on loopback and 100 MB/s, made up, and `broken`."""
    import math
    import statistics

    def entry(rounds_s, link_s):
        return {"step_s": statistics.median(rounds_s), "rounds_s": rounds_s,
                "link_s": link_s, "bytes": 8, "calls": 2}

    over = {beta: {name: entry([0.06, 0.07, 0.08], 0.05 if beta < math.inf else 0.0)
                   for name in ("DDP", "fp16")} for beta in (math.inf, 1e8)}
    if broken == "short round":  # a step shorter than the delay the link added
        over[1e8]["DDP"] = entry([0.06, 0.04, 0.08], 0.05)
    elif broken == "fewer rounds":  # one pair timed fewer rounds
        over[1e8]["fp16"] = entry([0.06, 0.07], 0.05)
    elif broken == "other median":  # the median shown is not these rounds'
        over[1e8]["fp16"]["step_s"] = 0.065
    return over


@pytest.mark.parametrize(("broken", "line"), [
    ("short round", 'assert min(row["rounds_s"]) >= row["link_s"]'),
    ("fewer rounds", "assert len(counts) == 1"),
    ("other median", 'assert statistics.median(row["rounds_s"]) == row["step_s"]')])
def test_the_rounds_figure_fails_on_rounds_that_break_the_measurement(broken, line):
    import matplotlib.pyplot as plt

    try:
        _kernel("rounds", {"ranks": _Pulled(_over())})  # made up, and sound
        _fails_at("rounds", {"ranks": _Pulled(_over(broken))}, line)
    finally:
        plt.close("all")
