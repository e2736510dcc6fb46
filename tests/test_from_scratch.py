"""Lesson 06's DDP written by hand: its cells as written, and with one line changed.

The lesson defines `ScratchDDP` in a `%%px` cell (the solution of its exercise)
and asserts, in the cell after, that it matches torch's DDP. These tests run
those very cells (read from the built notebook) on the test engines: as
written, the grader and the lesson's assertions pass; with one of a learner's
typical mistakes put in, the grader names it, and the lesson's assertions fail.
"""

from pathlib import Path

import nbformat
import pytest

from labkit import cluster, exercises

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "notebooks" / "en" / "06_beyond_no_sync.ipynb"

SEND = "            work = dist.all_reduce(flat, async_op=True)\n"
WAIT = "            work.wait()\n"
AVERAGE = ("            flat /= self.world_size  # the sum of the ranks' gradients "
           "-> their mean\n")
SKIP_IN_NO_SYNC = ("        if not self.require_sync:\n            return  # "
                   "accumulate locally; the next synced backward sends the sum\n")
RESET = "        self.pending = [len(b) for b in self.buckets]"  # the last line
KEEP = "            self.in_flight.append((self.buckets[i], flat, work))\n"
WHEN_COMPLETE = ("        if self.pending[i] == 0:  # the bucket is complete: send it, "
                 "don't wait\n")
JOIN = "            flat = torch.cat([q.grad.flatten() for q in self.buckets[i]])\n"
COPY_BACK = ("            for q, g in zip(bucket, flat.split([q.numel() for q in "
             "bucket]), strict=True):\n                q.grad.copy_(g.view_as(q))\n")
RESET_IN_FLIGHT = "        self.in_flight = []\n"

# A mistake: (what the solution's text becomes, the grader's message key).
MISTAKES = {
    "not averaged": ([(AVERAGE, "")], "ex_scratch_sum"),
    "waits in the hook": ([(SEND, SEND + WAIT)], "ex_scratch_early"),
    "a blocking all-reduce": (
        [(SEND, "            work = dist.all_reduce(flat)\n"), (WAIT, "")],
        "ex_scratch_early"),
    "counts never reset": ([(RESET, "", -1)], "ex_scratch_unsent"),
    "sends inside no_sync": ([(SKIP_IN_NO_SYNC, "")], "ex_scratch_no_sync"),
    "sends after the backward pass": (
        [(SEND + KEEP, "            self.in_flight.append((self.buckets[i], flat, "
                       "None))\n"),
         (WAIT, "            dist.all_reduce(flat)\n")],
        "ex_scratch_late"),
    # Fewer all-reduces than torch's DDP, none overlapping the backward pass.
    "one all-reduce for the whole model": (
        [(WHEN_COMPLETE + JOIN,
          "        if sum(self.pending) == 0:  # every gradient is here\n"
          "            everything = [q for b in self.buckets for q in b]\n"
          "            flat = torch.cat([q.grad.flatten() for q in everything])\n"),
         (KEEP, "            self.in_flight.append((everything, flat, work))\n")],
        "ex_scratch_too_few"),
    # As many all-reduces as torch's DDP, but all after the last gradient.
    "every bucket sent after the last gradient": (
        [(WHEN_COMPLETE + JOIN + SEND + KEEP,
          "        if sum(self.pending) == 0:  # every gradient is here\n"
          "            for bucket in self.buckets:\n"
          "                flat = torch.cat([q.grad.flatten() for q in bucket])\n"
          "                work = dist.all_reduce(flat, async_op=True)\n"
          "                self.in_flight.append((bucket, flat, work))\n")],
        "ex_scratch_no_overlap"),
    "one all-reduce per parameter": (
        [(WHEN_COMPLETE + JOIN + SEND + KEEP,
          "        flat = p.grad.flatten()\n"
          "        work = dist.all_reduce(flat, async_op=True)\n"
          "        self.in_flight.append(([p], flat, work))\n")],
        "ex_scratch_too_many"),
    "the result never copied back": ([(COPY_BACK, "")], "ex_scratch_not_copied"),
    "divides in the hook too": (
        [(SEND, "            flat /= self.world_size\n" + SEND)], "ex_scratch_off"),
    "counts off inside no_sync": (
        [(SKIP_IN_NO_SYNC, ""),
         (WHEN_COMPLETE, "        if self.pending[i] == 0 and self.require_sync:\n")],
        "ex_scratch_counted_in_no_sync"),
}

# Mistakes whose gradients often come out right, so that the lesson's own
# assertions may pass: only the check, which watches the class, tells them.
UNSEEN_BY_VALUES = {
    # Usually complete by finish_sync, so the values are right by chance.
    "never waits": ([(WAIT, "")], "ex_scratch_unwaited"),
    # The check's steps see the same batch, so the stale entries hold right values.
    "in_flight never reset": ([(RESET_IN_FLIGHT, "")], "ex_scratch_in_flight"),
}


def _cells() -> dict[str, str]:
    """The lesson's %%px cells these tests run, without the magic line."""
    cells = nbformat.read(LESSON, as_version=4).cells
    solution = next(c.source for c in cells if "solution" in c.metadata.get("tags", []))
    compare = next(c.source for c in cells
                   if "from_scratch.compare_with_ddp(ScratchDDP)" in c.source)
    compared = next(c.source for c in cells  # its folded check, run with it
                    if 'assert update["calls_in_no_sync"] == 0' in c.source)
    compare += "\n" + compared.removeprefix("%%px\n")
    overlap = next(c.source for c in cells if 's["overlapped"] for s in' in c.source)
    base = next(c.source for c in cells if "class BucketedDDP" in c.source)
    imports = next(c.source for c in cells if c.cell_type == "code"
                   and "from labkit import from_scratch" in c.source)
    return {name: source.removeprefix("%%px\n") for name, source in
            [("imports", imports), ("base", base), ("solution", solution),
             ("compare", compare), ("overlap", overlap)]}


def _with(source: str, edits) -> str:
    for old, new, *which in edits:
        assert source.count(old) >= 1, old
        if which:  # only the last one
            at = source.rindex(old)
            source = source[:at] + new + source[at + len(old):]
        else:
            source = source.replace(old, new)
    return source


def _define(ranks, source: str) -> None:
    ranks.execute("rank, world_size = dist.get_rank(), dist.get_world_size()")
    ranks.execute(source)


@pytest.fixture
def lesson(ranks):
    cells = _cells()
    ranks.execute("import torch.distributed as dist")
    ranks.execute(cells["imports"])
    ranks.execute(cells["base"])
    return cells


def test_the_lessons_scratch_ddp_passes_the_check_and_the_lessons_assertions(
        ranks, lesson, capsys):
    _define(ranks, lesson["solution"])
    exercises.grade_scratch_ddp(ranks)
    assert "✓" in capsys.readouterr().out
    ranks.execute(lesson["compare"])
    ranks.execute(lesson["overlap"])
    counts = ranks.pull("result")[0]["steps"]
    assert [s["calls"] for s in counts] == [8, 8, 8]  # 7 weights of 1 MB, 1 MB buckets


@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_typical_mistake_is_named_and_fails_the_lesson(ranks, lesson, mistake):
    edits, key = MISTAKES[mistake]
    _define(ranks, _with(lesson["solution"], edits))
    with pytest.raises(exercises.WrongAnswer) as wrong:
        exercises.grade_scratch_ddp(ranks)
    assert wrong.value.key == key
    with pytest.raises(cluster.RankError):
        ranks.execute(lesson["compare"])
        ranks.execute(lesson["overlap"])


@pytest.mark.parametrize("mistake", UNSEEN_BY_VALUES)
def test_mistakes_the_values_may_hide_are_named(ranks, lesson, mistake):
    edits, key = UNSEEN_BY_VALUES[mistake]
    _define(ranks, _with(lesson["solution"], edits))
    with pytest.raises(exercises.WrongAnswer) as wrong:
        exercises.grade_scratch_ddp(ranks)
    assert wrong.value.key == key


def test_the_check_says_what_a_too_short_or_late_answer_lacks(ranks, lesson):
    """The two answers the check once passed: named with their counts."""
    _define(ranks, _with(lesson["solution"],
                         MISTAKES["one all-reduce for the whole model"][0]))
    with pytest.raises(exercises.WrongAnswer) as wrong:
        exercises.grade_scratch_ddp(ranks)
    assert "In step 2 you made 1 all-reduce(s), torch's DDP 8" in str(wrong.value)
    _define(ranks, _with(lesson["solution"],
                         MISTAKES["every bucket sent after the last gradient"][0]))
    with pytest.raises(exercises.WrongAnswer) as wrong:
        exercises.grade_scratch_ddp(ranks)
    assert "In step 1 all 8 of your all-reduces start once the backward pass" in str(
        wrong.value)


def test_waiting_in_the_hook_leaves_nothing_overlapped(ranks, lesson):
    """The lesson's claim: with `work.wait()` in the hook the count drops to 0."""
    _define(ranks, _with(lesson["solution"], MISTAKES["waits in the hook"][0]))
    ranks.execute("from labkit import from_scratch\n"
                  "result = from_scratch.compare_with_ddp(ScratchDDP)")
    for result in ranks.pull("result"):
        assert [s["overlapped"] for s in result["steps"]] == [0, 0, 0]
    _define(ranks, lesson["solution"])
    ranks.execute("result = from_scratch.compare_with_ddp(ScratchDDP)")
    for result in ranks.pull("result"):  # as the lesson asserts: load can hide a step
        assert sum(s["overlapped"] for s in result["steps"]) >= 1


def test_the_check_names_a_class_the_ranks_do_not_have(ranks):
    with pytest.raises(cluster.RankError) as err:
        exercises.grade_scratch_ddp(ranks, "NoSuchDDP")
    assert "NoSuchDDP" in str(err.value)


def test_the_error_feedback_figure_asserts_what_it_draws(ranks):
    """The lesson's PowerSGD trial and its figure; with feedback off in both runs,
    the figure's cell refuses to draw."""
    import labkit
    from labkit import plots

    cells = nbformat.read(LESSON, as_version=4).cells
    trial = next(c.source for c in cells
                 if "error_feedback_trial(use_error_feedback=True)" in c.source)
    draw = next(c.source for c in cells if 'ranks.pull("with_feedback")' in c.source)
    ranks.execute("from labkit import send_less")
    ranks.execute(trial.removeprefix("%%px\n"))
    scope = {"ranks": ranks, "labkit": labkit, "plots": plots}
    exec(draw, scope)  # as written: the sum catches up with feedback only
    assert len(scope["fig"].axes[0].lines) == 2
    ranks.execute(trial.removeprefix("%%px\n").replace("use_error_feedback=True",
                                                       "use_error_feedback=False"))
    with pytest.raises(AssertionError):
        exec(draw, {"ranks": ranks, "labkit": labkit, "plots": plots})
