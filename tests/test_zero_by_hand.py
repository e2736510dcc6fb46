"""Lesson 12's ZeRO stages by hand: its cells as written, and with one line changed.

The lesson defines `Zero1`, `Zero2`, `Zero3Base` and `Zero3` (the solution of
its second exercise) in `%%px` cells and asserts, in the cells after, that each
trains like torch's DDP and one process (accumulating gradients too), holds
what its stage holds, and sends what its stage sends. These tests run those
very cells, read from the built notebook, on the test engines: as written, the
assertions and the exercise's check pass; with one of the typical mistakes put
in (the gather skipped, the averaging dropped, a shard offset off by one, the
backward re-gather removed, a gradient assigned where it should add, ...), the
lesson's assertions fail, and the check names the mistakes a learner makes in
that exercise.
"""

import os

import pytest
from lesson_cells import finder

from labkit import cluster, exercises, models


def _cells() -> dict[str, str]:
    """The lesson's cells these tests run, by a line each contains (no magic line)."""
    find = finder("12_zero_by_hand")
    return {
        "imports": find("from labkit import comm_counting, models, sharding"),
        "ddp": find("class DDPAdam:"),
        "memory_run": find("def memory_run("),  # with DDP's memory, checked
        "zero1": find("class Zero1:"),
        "helpers": find("def train(make"),
        "alone": find("def alone("),
        "references": find("def compare("),
        "check1": find("zero1 = train(Zero1)"),
        "shard_of_mean": find("def shard_of_mean_gradient", "solution"),
        "zero2": find("class Zero2("),
        "check2": find("zero2 = train(Zero2)"),
        "zero3base": find("class Zero3Base:"),
        "zero3": find("class Zero3(", "solution"),
        "zero3_exercise": find("class Zero3(", "exercise"),
        "check3": find("zero3 = train(Zero3)"),
        "gathered": find("sharding.trace_gathers("),
        "gathered_figure": find('ranks.pull("gathered")'),
        "accumulate_def": find("def train_accumulating("),
        "accumulate": find("one_accumulating = alone("),
        "memory": find("memory_table = {}"),
        "memory_table": find('ranks.pull("memory_table")'),
        "traffic": find("def traffic("),
        "sent": find("def sent(calls)"),
        "wire": finder("13_fsdp2")("S_wire = "),  # what gloo writes: lesson 13's cell
        "wire_step": find("def wire_per_step("),
    }


CELLS = _cells()
DEFINITIONS = ("imports", "ddp", "memory_run", "zero1", "helpers", "alone",
               "references", "shard_of_mean", "zero2", "zero3base", "zero3",
               "accumulate_def")
CHECKS = ("check1", "check2", "check3", "accumulate", "memory", "traffic",
          "sent", "wire", "wire_step")


def _with(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, old
    return source.replace(old, new)


def _define(ranks, changed: dict[str, str] | None = None) -> None:
    """Run the lesson's definitions on the ranks, some of them changed."""
    ranks.execute("import torch.distributed as dist\n"
                  "rank, world_size = dist.get_rank(), dist.get_world_size()")
    for name in DEFINITIONS:
        ranks.execute((changed or {}).get(name, CELLS[name]))


def _memory_table(ranks) -> None:
    """The kernel's cell of the memory table, with what the lesson's kernel has."""
    psi = models.count_params(models.WideMLP(10, 63, 2, 10))
    exec(CELLS["memory_table"], {"ranks": ranks, "psi": psi})


def test_the_lessons_stages_pass_its_assertions_and_the_check(ranks, capsys):
    _define(ranks)
    for name in CHECKS:
        ranks.execute(CELLS[name])
    _memory_table(ranks)
    exercises.grade_zero3_frees(ranks)
    out = capsys.readouterr().out
    assert "bit for bit DDP's: True" in out and "1.5003 x DDP" in out
    assert "each rank holds only its shards, 1668 bytes" in out
    assert "Zero3, 2 micro-batches a step" in out


# (the cell changed, the text replaced, its replacement, the check that fails)
BROKEN = {
    "stage 1 without the initial broadcast": (
        "zero1", "            dist.broadcast(p.detach(), src=0)\n",
        "            pass\n", "check1"),
    "stage 1 with the gather skipped": (
        "zero1",
        "        dist.all_gather_single(self.flat.full, self.shard.detach())"
        "  # and the others'\n", "", "check1"),
    "stage 1 with the averaging dropped": (
        "zero1", "self.shard.grad = mine.div_(self.world_size)",
        "self.shard.grad = mine", "check1"),
    # One value short per shard: gloo itself refuses the reduce-scatter's sizes.
    "stage 1 with the shard size unpadded": (
        "zero1", "        mine = grads.chunk(self.world_size)[self.rank]",
        "        s = self.flat.numel // self.world_size\n"
        "        mine = grads[self.rank * s:(self.rank + 1) * s]", "check1"),
    "stage 1 all-reducing instead": (
        "zero1", "        dist.reduce_scatter_single(mine, grads)",
        "        dist.all_reduce(grads)", "sent"),
    "stage 2 keeping the whole gradient": (
        "zero2",
        "        self.model.zero_grad()  # no view of it left: it goes when this "
        "returns\n",
        "", "check2"),
    "stage 3 without the initial broadcast": (
        "zero3base", "            dist.broadcast(p.detach(), src=0)\n",
        "            pass\n", "check3"),
    "stage 3 with the forward gather skipped": (
        "zero3base",
        "            module.register_forward_pre_hook(lambda m, args, flat=flat: "
        "self.gather(flat))\n", "", "check3"),
    "stage 3 with the backward re-gather removed": (
        "zero3", "        output.register_hook(lambda grad: self.gather(flat))  "
                 "# back before backward\n", "", "check3"),
    "stage 3 keeping the gathered parameters after backward": (
        "zero3", "    def after_backward(self, flat):\n"
                 "        flat.full.untyped_storage().resize_(0)\n",
        "    def after_backward(self, flat):\n        pass\n", "check3"),
    # Gradient accumulation: two backward passes before a step must add up.
    "stage 1 zeroing the gradients at the start of its step": (
        "zero1", "        loss = loss_fn(self.model(X), y)\n",
        "        self.model.zero_grad()\n        loss = loss_fn(self.model(X), y)\n",
        "accumulate"),
    "stage 3 assigning each shard's gradient instead of adding to it": (
        "zero3base",
        "shard.grad = mean if shard.grad is None else shard.grad.add_(mean)",
        "shard.grad = mean", "accumulate"),
    "stage 3 with the averaging dropped": (
        "shard_of_mean", "    return shard / world_size  # the sum -> the mean\n",
        "    return shard\n", "check3"),
}


@pytest.mark.parametrize("mistake", BROKEN)
def test_each_broken_stage_fails_the_lessons_assertion(ranks, mistake):
    cell, old, new, check = BROKEN[mistake]
    _define(ranks, {cell: _with(CELLS[cell], old, new)})
    needs = CHECKS[:CHECKS.index(check)]  # what the failing cell reads, run as written
    for name in needs if check == "sent" else ():
        ranks.execute(CELLS[name])
    with pytest.raises(cluster.RankError):
        ranks.execute(CELLS[check])


# What gloo writes to its sockets (the cells after "sent"): priced as the ring's,
# or sent by a stage other than the one whose collectives were recorded.
WIRE_BROKEN = {
    "another collective profiled": (
        "wire", '    collectives["reduce_scatter"]()\n',
        '    collectives["all_gather"]()\n', None),
    "the reduce-scatter priced as the ring's half": (
        "wire", 'comm.sent_share(op, world_size, "gloo")',
        "comm.sent_share(op, world_size)", None),
    "the stages priced as the ring's": (
        "wire_step", 'shares(stage, "gloo")', 'shares(stage, "ring")', None),
    "stage 1 with the gather skipped, after its collectives were recorded": (
        "wire_step", "", "", ("zero1", "ZeRO-1", "        dist.all_gather_single("
                              "self.flat.full, self.shard.detach())"
                              "  # and the others'\n")),
}


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc")
@pytest.mark.parametrize("mistake", WIRE_BROKEN)
def test_the_wire_bytes_fail_when_priced_or_sent_otherwise(ranks, mistake):
    check, old, new, stage = WIRE_BROKEN[mistake]
    _define(ranks)
    for name in CHECKS[:CHECKS.index(check)]:
        ranks.execute(CELLS[name])
    if stage:  # the trainer changed after traffic_table recorded the right one
        cell, name, line = stage
        ranks.execute(_with(CELLS[cell], line, ""))
        ranks.execute(f'trainers["{name}"] = Zero{name[-1]}')
    with pytest.raises(cluster.RankError, match="AssertionError"):
        ranks.execute(_with(CELLS[check], old, new) if old else CELLS[check])


OFF_BY_ONE = """
from labkit import sharding
_shard = sharding.FlatParameters.shard
def _off_by_one(self, rank):  # rank 1's shard starts one value early: same size
    s = self.shard_numel
    return self.full[rank * s - rank:(rank + 1) * s - rank]
sharding.FlatParameters.shard = _off_by_one
"""


@pytest.mark.parametrize("check", ["check1", "check2", "check3"])
def test_a_shard_offset_off_by_one_fails_each_stage(ranks, check):
    _define(ranks)
    ranks.execute(OFF_BY_ONE)
    try:
        ranks.execute(CELLS["helpers"])
        ranks.execute(CELLS["references"])  # trained before the patch
        with pytest.raises(cluster.RankError, match="AssertionError"):
            ranks.execute(CELLS[check])
    finally:
        ranks.execute("sharding.FlatParameters.shard = _shard")


def test_the_memory_table_fails_when_a_stage_holds_more(ranks):
    """Stage 2 keeping the whole gradient: the table's tolerance does not hide it."""
    cell, old, new, _ = BROKEN["stage 2 keeping the whole gradient"]
    _define(ranks, {cell: _with(CELLS[cell], old, new)})
    with pytest.raises(cluster.RankError, match="ZeRO-2"):
        ranks.execute(CELLS["memory"])


SOLUTION_FORWARD = ("        flat.full.untyped_storage().resize_(0)  # free: the shard "
                    "stays\n")
REGATHER = ("        output.register_hook(lambda grad: self.gather(flat))  # back "
            "before backward\n")
SOLUTION_BACKWARD = ("    def after_backward(self, flat):\n"
                     "        flat.full.untyped_storage().resize_(0)\n")
SHARD = "self.shards[self.units.index(flat)]"

# A learner's mistake in the Zero3 exercise: (edits of the solution, the check's key).
MISTAKES = {
    "del of a local name": (
        [(SOLUTION_FORWARD, "        full = flat.full\n        del full\n"),
         (SOLUTION_BACKWARD, "    def after_backward(self, flat):\n"
                             "        full = flat.full\n        del full\n")],
        "ex_z3_kept"),
    "del of the attribute": ([(SOLUTION_FORWARD, "        del flat.full\n")],
                             "ex_z3_deleted"),
    "zero_() that keeps the memory": (
        [(SOLUTION_FORWARD, "        flat.full.zero_()\n"),
         (SOLUTION_BACKWARD, "    def after_backward(self, flat):\n"
                             "        flat.full.zero_()\n")],
        "ex_z3_zeroed"),
    "the shard freed too": (
        [(SOLUTION_BACKWARD, SOLUTION_BACKWARD
          + f"        {SHARD}.untyped_storage().resize_(0)\n")],
        "ex_z3_shard_freed"),
    "freed after forward, not after backward": (
        [(SOLUTION_BACKWARD, "    def after_backward(self, flat):\n        pass\n")],
        "ex_z3_kept"),
    "freed after backward, not after forward": (
        [(SOLUTION_FORWARD, "")], "ex_z3_kept"),
    "never gathered again before backward": ([(REGATHER, "")], "ex_z3_no_regather"),
}


def _zero3_with(mistake: str) -> str:
    """The lesson's Zero3 cell with one of MISTAKES made in it."""
    answer = CELLS["zero3"]
    for old, new in MISTAKES[mistake][0]:
        answer = _with(answer, old, new)
    return answer


@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_typical_mistake_is_named_and_fails_the_lesson(ranks, mistake):
    key = MISTAKES[mistake][1]
    _define(ranks, {"zero3": _zero3_with(mistake)})
    with pytest.raises(exercises.WrongAnswer) as wrong:
        exercises.grade_zero3_frees(ranks)
    assert wrong.value.key == key
    with pytest.raises(cluster.RankError):
        ranks.execute(CELLS["check3"])


def test_the_hints_say_which_pass_keeps_the_memory(ranks):
    _define(ranks, {"zero3": _zero3_with("freed after forward, not after backward")})
    with pytest.raises(exercises.WrongAnswer, match="After the backward pass.*"
                       "free in `after_backward` too"):
        exercises.grade_zero3_frees(ranks)


def test_the_exercise_as_given_is_not_right_yet(ranks):
    _define(ranks, {"zero3": CELLS["zero3_exercise"]})
    with pytest.raises(exercises.WrongAnswer, match="After the forward pass"):
        exercises.grade_zero3_frees(ranks)


def test_the_check_names_a_class_the_ranks_do_not_have(ranks):
    with pytest.raises(exercises.WrongAnswer, match="NoSuchZero3"):
        exercises.grade_zero3_frees(ranks, "NoSuchZero3")


@pytest.mark.parametrize("mistake", ["zero_() that keeps the memory",
                                     "never gathered again before backward"])
def test_the_hints_speak_the_notebooks_language(ranks, mistake):
    import labkit

    _define(ranks, {"zero3": _zero3_with(mistake)})
    labkit.set_lang("ja")
    with pytest.raises(exercises.WrongAnswer, match="ヒント") as wrong:
        exercises.grade_zero3_frees(ranks)
    assert "resize_(0)" in str(wrong.value) or "register_hook" in str(wrong.value)


@pytest.mark.parametrize("mistake", [None, "freed after backward, not after forward",
                                     "freed after forward, not after backward"])
def test_the_gathered_bytes_figure_holds_one_layer_at_a_time(ranks, mistake):
    """The figure's cell passes on the lesson's Zero3, and fails on one that keeps a
    layer gathered after its forward or after its backward pass."""
    import matplotlib.pyplot as plt

    _define(ranks, {"zero3": _zero3_with(mistake)} if mistake else None)
    ranks.execute(CELLS["gathered"])
    from labkit import diagrams

    cell = {"ranks": ranks, "diagrams": diagrams}  # imported above it in the lesson
    try:
        if mistake:
            with pytest.raises(AssertionError):
                exec(CELLS["gathered_figure"], cell)
        else:
            exec(CELLS["gathered_figure"], cell)
            assert max(b for _, _, b in cell["trace"]) == 4 * 4032  # the middle layer
    finally:
        plt.close("all")
