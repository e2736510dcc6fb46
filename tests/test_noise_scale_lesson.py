"""Lesson 15's section on batch size: its cells as written, and with one line changed.

The cells are read from the built notebook and run on the test engines. As
written their assertions pass; with the per-rank capture removed from the
comm hook (the averaged gradient noted as the small batch's), one step's
estimates made of the averaged norms, a learning rate held fixed over the
batch sizes, the accumulation dropped, or DDP's plain average kept for
unequal batches, the assertion that claim rests on fails.
"""

import pytest
from lesson_cells import finder

from labkit import cluster


def _cells() -> dict[str, str]:
    find = finder("15_communicate_less")
    # A shown cell and the folded cell after it that checks it: run as one.
    return {"measure": find("measured.register_comm_hook(norms, capture)")
            + find("B_simple = noise_scale.simple_noise_scale("),
            "per_step": find("per_step_traces = ["),
            "critical": find("def steps_to_target(")
            + find("assert mean_steps(8, lr_at[8]) == steps_at[8]"),
            "unequal": find("counts = (3, 13)")
            + find("gap = checks.grads_differ(mean_of_means")}


CELLS = _cells()
# What the unequal-batch cell needs of the critical-batch cell, without its runs.
TRAINER = "trainer = DDP(nn.Linear(16, 1, bias=False))\n"


def _with(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, old
    return source.replace(old, new)


def _run(ranks, *sources: str) -> None:
    # what the lesson's earlier cells imported on the ranks
    ranks.execute("import torch\nimport torch.distributed as dist\n"
                  "from torch.nn.parallel import DistributedDataParallel as DDP\n"
                  "rank, world_size = dist.get_rank(), dist.get_world_size()")
    for source in sources:
        ranks.execute(source)


def test_the_sections_cells_pass_as_written(ranks, capsys):
    _run(ranks, CELLS["measure"], CELLS["per_step"], CELLS["critical"],
         CELLS["unequal"])
    out = capsys.readouterr().out
    assert "B_simple = 17.4" in out and "exact, on all 4096 samples" in out
    assert "steps at each B: {2: " in out and "weighted by count" in out


CAPTURED_BEFORE = ('    norms["small"].append(grad.square().sum().item())  '
                   "# this rank's b samples\n")
CAPTURED_AFTER = ('        norms["big"].append(mean.square().sum().item())  '
                  "# all N·b samples\n")

# (the cell changed, the text replaced, its replacement, what it runs first)
BROKEN = {
    "the per-rank capture removed: the averaged gradient noted as the small one": (
        "measure", CAPTURED_BEFORE, "", ()),
    "one step's tr(Σ) estimated from the averaged norms: never negative": (
        "per_step", "estimated_trace(b, world_size * b, s, g)",
        "estimated_trace(b, world_size * b, g2_small, g2_big)", ("measure",)),
    "the per-step ratios taken of the averaged norms: no miss": (
        "per_step", "simple_noise_scale(b, world_size * b, s, g)",
        "simple_noise_scale(b, world_size * b, g2_small, g2_big)", ("measure",)),
    "a learning rate held fixed over the batch sizes": (
        "critical", "    steps_at[B], lr = best_lr(B, lr)\n",
        "    steps_at[B], lr = mean_steps(B, 0.085), 0.085\n", ("measure",)),
    "the accumulation dropped: K = 1 whatever the batch": (
        "critical", "    K = B // (world_size * b)", "    K = 1", ("measure",)),
    "DDP's plain average kept for unequal batches": (
        "unequal", "no_sync.accumulate_by_count(trainer",
        "no_sync.accumulate_no_sync(trainer", ("measure", TRAINER)),
    "equal batches: the plain average is already exact": (
        "unequal", "counts = (3, 13)", "counts = (8, 8)", ("measure", TRAINER)),
}


@pytest.mark.parametrize("mistake", BROKEN)
def test_each_broken_line_fails_the_sections_assertion(ranks, mistake):
    cell, old, new, before = BROKEN[mistake]
    source = _with(CELLS[cell], old, new)
    if cell == "measure":  # the small batch's norm noted after the averaging
        source = _with(source, CAPTURED_AFTER, CAPTURED_AFTER + CAPTURED_AFTER.replace(
            'norms["big"]', 'norms["small"]'))
    _run(ranks, *(CELLS.get(name, name) for name in before))
    with pytest.raises(cluster.RankError, match="AssertionError"):
        ranks.execute(source)


def _claims() -> list[str]:
    """The critical-batch cell's assertions on the measured steps, one each."""
    return [line for line in CELLS["critical"].splitlines()
            if line.startswith("assert") and "steps_at" in line
            and "mean_steps" not in line]


def test_the_claim_on_the_noise_scale_at_the_target_fails_if_it_moved():
    """Had the noise scale grown as the paper's tasks do (30 from 17.6), the value
    measured at the start would not stand for the run: the assertion says so."""
    claim = [line for line in CELLS["critical"].splitlines()
             if line.startswith("assert") and "at_target" in line]
    assert len(claim) == 1
    start = {"noise_scale": 17.6}
    with pytest.raises(AssertionError):
        exec(claim[0], {"exact": start, "at_target": {"noise_scale": 30.0}})
    exec(claim[0], {"exact": start, "at_target": {"noise_scale": 18.8}})


def test_the_claims_on_the_steps_fail_where_the_steps_do_not_flatten():
    """Steps falling in proportion all the way (no critical batch): only the
    claim about small batches holds; those about large ones fail."""
    claims = _claims()
    assert len(claims) == 4
    batches = [2, 4, 8, 16, 32, 64, 128, 256]
    proportional = {"steps_at": {B: 1024 / B for B in batches}, "B_simple": 17.4,
                    "s_min": 4.0, "batches": batches}
    exec(claims[0], dict(proportional))  # small batches: 4 times as few steps
    for claim in claims[1:]:
        with pytest.raises(AssertionError):
            exec(claim, dict(proportional))
    measured = {**proportional, "s_min": 3.3, "steps_at": dict(zip(
        batches, [45.3, 23.7, 13.3, 8.7, 5.7, 4.0, 4.0, 3.3], strict=True))}
    for claim in claims:  # the lesson's run, as it printed it
        exec(claim, dict(measured))


@pytest.mark.parametrize("factor", [0.5, 2.0], ids=["halved", "doubled"])
def test_the_paper_s_curve_fails_with_the_noise_scale_off_twofold(factor):
    """The lesson's steps against the paper's curve: with B_simple off by 2 either
    way, the claim that the curve fits fails."""
    curve = _claims()[-1]
    assert "s_min * (1 + B_simple / B)" in curve
    batches = [2, 4, 8, 16, 32, 64, 128, 256]
    measured = {"B_simple": 17.387, "s_min": 10 / 3, "batches": batches,
                "steps_at": dict(zip(batches, [136 / 3, 71 / 3, 40 / 3, 26 / 3, 17 / 3,
                                               4.0, 4.0, 10 / 3], strict=True))}
    exec(curve, dict(measured))
    with pytest.raises(AssertionError):
        exec(curve, {**measured, "B_simple": factor * 17.387})
