"""bench/run.py's `--only localsgd`: it trains as lesson 15 does, and records its table.

The bench writes local SGD and DiLoCo again (the lesson writes them in its
cells on purpose). The test on the ranks runs the lesson's cells, read from
the built notebook, beside the bench's own rank function, and asks for the
same held-out losses bit for bit, and for DiLoCo's outer momentum to matter
(without it the loss differs). The others check the README's block and the
check that both ranks agree, with no ranks.
"""

import importlib.util
import inspect
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "notebooks" / "en" / "15_communicate_less.ipynb"
_spec = importlib.util.spec_from_file_location("bench_run", ROOT / "bench" / "run.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _cell(text: str) -> str:
    found = [c.source for c in nbformat.read(LESSON, as_version=4).cells
             if c.cell_type == "code" and text in c.source]
    assert len(found) == 1, (text, len(found))
    return found[0].removeprefix("%%px\n") + "\n"


def test_the_bench_trains_as_lesson_14_s_cells_do(ranks):
    ranks.execute("import torch.distributed as dist\n"
                  "rank, world_size = dist.get_rank(), dist.get_world_size()")
    ranks.execute(_cell("def train_local_sgd("))
    ranks.execute(_cell("def train_diloco("))
    ranks.execute(inspect.getsource(bench.localsgd_runs))
    ranks.execute(
        "bench_rows = localsgd_runs((4,), 4, 1)['rows']\n"  # 4 all-reduces per run
        "lesson_losses = {('DDP', 1): train_local_sgd(1, 4)[1][-1][1],\n"
        "                 ('local SGD', 4): train_local_sgd(4, 16)[1][-1][1],\n"
        "                 ('DiLoCo', 4): train_diloco(4, 16)[1][-1][1]}\n"
        "no_momentum = train_diloco(4, 16, outer_momentum=0.0)[1][-1][1]\n"
        "psi = sum(p.numel() for p in local_sgd.make_model(task).parameters())")
    rows, lesson, no_momentum, psi = (ranks.pull(name)[0] for name in (
        "bench_rows", "lesson_losses", "no_momentum", "psi"))
    assert {(r["method"], r["H"]): r["loss"] for r in rows} == lesson
    assert {(r["steps"], r["calls"], r["bytes"]) for r in rows[1:]} == {
        (16, 4, 4 * psi * 4)}  # equal bytes: 4 all-reduces of the float32 parameters
    assert (rows[0]["steps"], rows[0]["bytes"]) == (4, 4 * psi * 4)
    diloco = next(r["loss"] for r in rows if r["method"] == "DiLoCo")
    assert abs(diloco - no_momentum) > 1e-3  # the outer momentum is in the bench's


def _results(loss: float = 0.5, only: str | None = "localsgd") -> dict:
    rows = [{"method": "DDP", "H": 1, "steps": 32, "calls": 32, "bytes": 87296,
             "loss": 1.0, "run_s": 0.064, "step_s": 0.002},
            {"method": "DiLoCo", "H": 16, "steps": 512, "calls": 32, "bytes": 87296,
             "loss": loss, "run_s": 0.128, "step_s": 0.00025}]
    return {"localsgd": rows, "localsgd_rounds": 32, "localsgd_timing_rounds": 3,
            "localsgd_params": 682, "date": "2026-12-03 19:50 UTC", "quick": False,
            "only": only}


README = """# Bench

<!-- results:start -->
Last recorded run: then.

| metric | value | goal | met |
|---|---|---|---|
| `x` | 1 |  |  |

The slow link (slow_link.SlowLink: ...):

| method | measured |
|---|---|
| fp16 | 1 MB/s |
<!-- results:end -->

After.
"""


def test_recording_adds_the_table_once_and_keeps_the_others(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(README, encoding="utf-8")
    bench.record_localsgd(_results(0.5), readme)
    bench.record_localsgd(_results(0.25), readme)  # replaces, does not add
    text = readme.read_text(encoding="utf-8")
    assert text.count(bench.LOCALSGD_HEADER) == 1
    assert "| DiLoCo | 16 | 512 | 32 | 87,296 | 0.2500 | 0.250 | 128 | 0.250 |" in text
    assert "0.5000" not in text and "`--only localsgd`" in text
    assert "| fp16 | 1 MB/s |\n\nLocal SGD and DiLoCo" in text  # the slow link's kept
    assert text.endswith("|\n<!-- results:end -->\n\nAfter.\n")


class _Ranks:
    """Stands for two ranks that return these rows."""

    def __init__(self, *rows):
        self.rows = rows

    def run(self, fn, *args):
        return [{"rows": [dict(r) for r in rows], "params": 682} for rows in self.rows]


def test_the_table_refuses_ranks_that_disagree():
    rows = _results()["localsgd"]
    both = bench.localsgd_table(_Ranks(rows, rows), quick=True)["localsgd"]
    assert [r["loss"] for r in both] == [1.0, 0.5]
    other = [dict(rows[0]), dict(rows[1], loss=0.4)]
    with pytest.raises(RuntimeError, match="the ranks disagree on DiLoCo H=16"):
        bench.localsgd_table(_Ranks(rows, other), quick=True)
