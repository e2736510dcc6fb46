"""labkit.local_sgd, and lesson 15's local SGD and DiLoCo cells as written and broken.

The lesson's cells are read from the built notebook and run on the test engines:
as written their assertions pass; with the outer step's momentum removed, or the
parameters' averaging removed, the lesson's assertion fails.
"""

import pytest
import torch
from lesson_cells import finder

from labkit import cluster, local_sgd


def _cells() -> dict[str, str]:
    find = finder("15_communicate_less")
    # A shown cell and the folded cell after it that checks it: run as one.
    return {"local": find("def train_local_sgd("),
            "ddp_and_drift": find("local1, _ = train_local_sgd(H=1")
            + find("assert gap <= 1e-6, gap  # momentum"),
            "bytes": find("for H in (1, 4, 16):"),
            "torch": find("def train_torch_local_sgd(")
            + find("only takes effect when CUDA"),
            "torch_equal": find("documented = train_torch_local_sgd(")
            + find("assert shifted > 1e-4"),
            "diloco": find("def train_diloco(")
            + find("diloco, _ = train_diloco(H=4, steps=32, record=deltas)"),
            "nesterov": find("theta_start, theta_end, deltas = (ranks.pull"),
            "equal_bytes": find("equal_bytes = {}"),
            # the kernel's check on the bytes the ranks sent
            "bytes_check": find('runs = ranks.pull("runs")[0]')}


CELLS = _cells()


def _with(name: str, old: str, new: str) -> str:
    assert CELLS[name].count(old) == 1, old
    return CELLS[name].replace(old, new)


def _define(ranks, changed: dict[str, str] | None = None) -> None:
    """The lesson's definitions on fresh names: the engines are shared by tests."""
    ranks.execute("import torch.distributed as dist\n"
                  "from torch.nn.parallel import DistributedDataParallel as DDP\n"
                  "rank, world_size = dist.get_rank(), dist.get_world_size()")
    ranks.execute((changed or {}).get("local", CELLS["local"]))


def _nesterov_cell(ranks) -> None:
    exec(CELLS["nesterov"], {"ranks": ranks, "torch": torch})


def test_the_lessons_cells_pass_as_written(ranks):
    _define(ranks)
    for name in ("ddp_and_drift", "bytes", "torch", "torch_equal", "diloco"):
        ranks.execute(CELLS[name])
    exec(CELLS["bytes_check"], {"ranks": ranks})
    _nesterov_cell(ranks)


def test_the_outer_step_without_momentum_fails_the_nesterov_check(ranks):
    _define(ranks)
    ranks.execute(_with("diloco", "outer_momentum=0.9, record=None",
                        "outer_momentum=0.0, record=None"))
    with pytest.raises(AssertionError, match="not close"):
        _nesterov_cell(ranks)


def test_nesterov_off_fails_the_nesterov_check(ranks):
    _define(ranks)
    ranks.execute(_with("diloco", "nesterov=outer_momentum > 0", "nesterov=False"))
    with pytest.raises(AssertionError, match="not close"):
        _nesterov_cell(ranks)


@pytest.mark.parametrize(("old", "new"), [
    ("            average_parameters(model)\n", "            pass\n"),
    ("        dist.all_reduce(flat)  # the sum of the ranks' shares: their mean\n", ""),
])
def test_local_sgd_without_the_average_fails(ranks, old, new):
    _define(ranks, {"local": _with("local", old, new)})
    with pytest.raises(cluster.RankError, match="AssertionError"):
        ranks.execute(CELLS["ddp_and_drift"])


def test_the_documented_averager_warmup_is_not_the_loop(ranks):
    _define(ranks)
    ranks.execute(CELLS["torch"])
    with pytest.raises(cluster.RankError, match="AssertionError"):
        ranks.execute(_with("torch_equal", "averager_warmup=W + H - 1",
                            "averager_warmup=W"))


# --- labkit.local_sgd on its own ---


def test_each_rank_gets_its_share_of_the_step_and_never_the_held_out():
    task = local_sgd.Task(n=128, held_out=32, batch_per_rank=4)
    dataset = local_sgd.make_dataset(task)
    X0, _ = local_sgd.batch(dataset, task, 0, 0, 2)
    X1, _ = local_sgd.batch(dataset, task, 0, 1, 2)
    assert torch.equal(torch.cat([X0, X1]), dataset.data[:8])  # DDP's shares
    seen = torch.cat([local_sgd.batch(dataset, task, s, r, 2)[0]
                      for s in range(40) for r in range(2)])
    held = dataset.data[-32:]
    assert not (seen[:, None] == held[None]).all(-1).any()  # the training part only


def test_the_model_starts_the_same_and_the_task_checks_its_sizes():
    task = local_sgd.Task()
    a, b = local_sgd.make_model(task), local_sgd.make_model(task)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(),
                                                 strict=True))
    assert local_sgd.evaluate(a, local_sgd.make_dataset(task), task) > 0.5  # untrained
    with pytest.raises(ValueError, match="held_out"):
        local_sgd.make_dataset(local_sgd.Task(n=10, held_out=10))


def test_divergence_is_zero_for_equal_replicas_and_the_distance_otherwise(ranks):
    def trial():
        import torch
        import torch.distributed as dist

        from labkit import local_sgd

        model = local_sgd.make_model(local_sgd.Task())
        same = local_sgd.divergence(model)
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] += 2.0 * dist.get_rank()
        return same, local_sgd.divergence(model)

    for same, apart in ranks.run(trial):
        assert same == 0
        assert apart == pytest.approx(1.0)  # 0 and 2 on the ranks: 1 from the mean
