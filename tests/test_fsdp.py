"""labkit.fsdp, and lesson 13's FSDP2 cells as written and with one line changed.

The lesson's cells are read from the built notebook, as tests/test_from_scratch.py
reads lesson 06's: as written their assertions pass; with the broadcast
dropped, one rank's batch wrong, or the checkpoint's load skipped, they fail.
"""

import functools
from pathlib import Path

import nbformat
import pytest
import torch
from torch import nn

from labkit import cluster, fsdp, models, plots, sharding

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "notebooks" / "en" / "13_fsdp2.ipynb"


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight, a layer between."""

    def __init__(self, vocab: int = 7, hidden: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.hidden = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.relu(self.hidden(self.embed(tokens))))


def test_layer_units_put_modules_that_share_a_weight_in_one_unit():
    model = Tied()
    assert fsdp.layer_units(model) == [[model.embed, model.head], model.hidden]
    model.head.weight = nn.Parameter(model.embed.weight.detach().clone())  # untied
    assert fsdp.layer_units(model) == [model.embed, model.hidden, model.head]


def test_layer_units_are_the_layers_with_parameters():
    model = models.WideMLP(hidden=8, depth=2)
    linears = [m for m in model.net if isinstance(m, nn.Linear)]
    assert fsdp.layer_units(model) == linears  # not the ReLUs, not the Sequential


def test_traffic_sums_calls_and_bytes_per_op():
    calls = [{"op": "all_gather", "bytes": 8}, {"op": "reduce_scatter", "bytes": 4},
             {"op": "all_gather", "bytes": 2}]
    assert fsdp.traffic(calls) == {"all_gather": {"calls": 2, "bytes": 10},
                                   "reduce_scatter": {"calls": 1, "bytes": 4}}


def test_held_param_bytes_of_a_model_never_sharded_is_a_clear_error():
    with pytest.raises(ValueError, match="no fully_shard unit"):
        fsdp.held_param_bytes(Tied())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_loads_whole_and_one_of_another_shape_is_named(tmp_path):
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    saved = Tied()
    dcp.save(saved.state_dict(), checkpoint_id=str(tmp_path))  # one process: no_dist
    loaded = fsdp.load_checkpoint(Tied(), tmp_path)
    for key, value in saved.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert loaded.head.weight is loaded.embed.weight  # still tied
    with pytest.raises(ValueError, match=r"embed\.weight: saved \(7, 4\), this "
                                         r"model \(7, 8\)"):
        fsdp.load_checkpoint(Tied(hidden=8), tmp_path)
    bigger = Tied()
    bigger.extra = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"extra\.weight: not in the checkpoint"):
        fsdp.load_checkpoint(bigger, tmp_path)


def test_the_memory_plot_says_which_points_are_measured():
    import matplotlib.pyplot as plt

    from labkit import i18n

    i18n.set_lang("ja")
    try:
        fig = plots.memory_vs_world_size(
            {"DDP": ([1, 2, 4], [1.0, 1.0, 1.0]), "ZeRO-3": ([1, 2, 4], [1, .5, .25])},
            {"DDP": (2, 1.0), "ZeRO-3": (2, 0.51)}, ylabel="world_size",
            title="world_size", budget=(0.3, "予算"))
        labels = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
    finally:
        i18n.set_lang("en")
    plt.close(fig)
    assert labels == ["DDP", "ZeRO-3", "予算", "線: 式", "印: 2 ランクで実測"]


def test_smallest_world_size_finds_where_a_stage_first_fits():
    adam = sharding.FP32_ADAM  # 16 bytes a parameter under DDP
    assert fsdp.smallest_world_size(100, 1600, "DDP", **adam) == 1  # exactly fits
    assert fsdp.smallest_world_size(100, 1599, "DDP", **adam) is None
    assert fsdp.smallest_world_size(100, 400, "ZeRO-3", **adam) == 4
    assert fsdp.smallest_world_size(100, 399, "ZeRO-3", **adam) == 5
    # ZeRO-2 keeps its 400 bytes of parameters whole: never under that
    assert fsdp.smallest_world_size(100, 400, "ZeRO-2", most=10**4, **adam) is None
    with pytest.raises(ValueError, match="stage must be one of"):
        fsdp.smallest_world_size(100, 400, "ZeRO-4")
    with pytest.raises(ValueError, match="budget_bytes > 0"):
        fsdp.smallest_world_size(100, 0, "DDP")


# --- on two ranks ---

MAKE = functools.partial(Tied, vocab=7, hidden=4)
BATCH = (torch.tensor([0, 3, 6, 1]), torch.tensor([2, 2, 5, 0]))
LOSS = nn.functional.cross_entropy


def test_reshard_after_forward_trades_a_gather_in_backward_for_memory(ranks):
    kept, freed = (ranks.run(fsdp.reshard_experiment, MAKE, BATCH, LOSS, raf)
                   for raf in (False, True))
    for a, b in zip(kept, freed, strict=True):  # each rank
        gathered = a["forward"]["all_gather"]["bytes"]
        assert gathered == b["forward"]["all_gather"]["bytes"] > 0
        # True: nothing gathered is held between forward and backward, and the
        # backward gathers all of it again; False: all of it is held instead.
        assert b["held_between"]["gathered"] == 0
        assert b["backward"]["all_gather"] == b["forward"]["all_gather"]
        assert a["held_between"]["gathered"] == gathered
        assert "all_gather" not in a["backward"]
        assert a["backward"]["reduce_scatter"] == b["backward"]["reduce_scatter"]
        assert a["held_between"]["sharded"] * 2 == gathered  # a half on each rank
        assert a["held_after"]["gathered"] == b["held_after"]["gathered"] == 0
        assert a["loss"] == b["loss"]


def test_mixed_precision_gathers_bfloat16_and_reduces_float32(ranks):
    for run in ranks.run(fsdp.mixed_precision_experiment, MAKE, BATCH, LOSS):
        full, mixed = run["float32"], run["bfloat16"]
        assert mixed["forward"]["all_gather"]["bytes"] * 2 == \
            full["forward"]["all_gather"]["bytes"]
        assert mixed["backward"]["reduce_scatter"] == full["backward"]["reduce_scatter"]
        assert mixed["dtypes"] == {"output": "torch.bfloat16",
                                   "grads": ["torch.float32"],
                                   "shards": ["torch.float32"]}
        assert full["dtypes"]["output"] == "torch.float32"
        assert mixed["loss"] != full["loss"]  # computed in bfloat16 indeed
        assert abs(mixed["loss"] - full["loss"]) < 0.05 * full["loss"]


# --- the lesson's own cells ---

BROADCAST = ("        for p in model.parameters():  # fully_shard sends nothing: "
             "start alike\n            dist.broadcast(p.data, src=0)\n")
MY_PART = "    mine_part = slice(rank * per, (rank + 1) * per)\n"
LOAD = ("    loaded = fsdp.load_checkpoint(models.TiedMLP(), checkpoint_dir)  "
        "# 2 shards -> 1\n")


def _lesson_cells() -> dict[str, str]:
    """The cells these tests run, by what they contain; %%px cells without the magic."""
    code = [c for c in nbformat.read(LESSON, as_version=4).cells
            if c.cell_type == "code"]

    def one(marker, solution=False):
        found = [c.source for c in code if marker in c.source
                 and (not solution or "solution" in c.metadata.get("tags", []))]
        assert len(found) == 1, (marker, len(found))
        return found[0].removeprefix("%%px\n")

    # A cell the learner reads runs with the folded cell that checks it.
    return {"fsdp2": one("class FSDP2Adam:"),
            "shards": one("tied = models.TiedMLP()") + "\n" + one("shard_rows = []"),
            "shards_figure": one('ranks.pull("shard_rows")'),
            "parity": one("compared = {") + "\n" + one("vs_one = max("),
            "reshard": one("fsdp.reshard_experiment("),
            "mixed": one("fsdp.mixed_precision_experiment("),
            "save": one("dcp.save(") + "\n" + one("entry = sharded_state["),
            "load": one("fsdp.load_checkpoint(")}


def _changed(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, old
    return source.replace(old, new)


@pytest.fixture
def lesson(ranks):
    cells = _lesson_cells()
    ranks.execute("import torch.distributed as dist\n"
                  "rank, world_size = dist.get_rank(), dist.get_world_size()")
    ranks.execute(cells["fsdp2"])  # FSDP2Adam, and DDPAdam to compare with
    ranks.execute(cells["shards"])  # the model the parity cell starts from
    return cells


def _load_in_kernel(ranks, source: str) -> dict:
    """Run the lesson's kernel cell that loads the checkpoint; its namespace."""
    namespace = {"ranks": ranks, "torch": torch, "fsdp": fsdp, "models": models}
    try:
        exec(compile(source, "lesson 13, the kernel's load", "exec"), namespace)
    finally:  # the directory is gone, whether the cell's assertions held or not
        assert not Path(ranks.pull("checkpoint_dir")[0]).exists()
    return namespace


def test_the_lesson_s_fsdp2_cells_pass_as_written(ranks, lesson):
    for name in ("parity", "reshard", "mixed", "save"):
        ranks.execute(lesson[name])
    assert ranks.pull("vs_ddp") == [0.0, 0.0]
    assert max(ranks.pull("vs_one")) <= 1e-6
    loaded = _load_in_kernel(ranks, lesson["load"])["loaded"]
    assert loaded.head.weight is loaded.embed.weight


def test_fsdp2_parity_fails_when_one_rank_trains_on_the_wrong_part(ranks, lesson):
    wrong = _changed(lesson["parity"], MY_PART, "    mine_part = slice(0, per)\n")
    with pytest.raises(cluster.RankError, match="AssertionError"):
        ranks.execute(wrong)  # rank 1 trains on rank 0's samples
    assert min(ranks.pull("vs_one")) > 1e-3


def test_fsdp2_parity_fails_without_the_broadcast(ranks, lesson):
    ranks.execute(_changed(lesson["fsdp2"], BROADCAST, ""))
    with pytest.raises(cluster.RankError, match="AssertionError"):
        ranks.execute(lesson["parity"])  # each rank's shard cut from its own start
    assert min(ranks.pull("vs_ddp")) > 1e-3


def test_the_resharding_check_fails_when_the_load_is_skipped(ranks, lesson):
    for name in ("parity", "save"):
        ranks.execute(lesson[name])
    skipped = _changed(lesson["load"], LOAD, "    loaded = models.TiedMLP()\n")
    with pytest.raises(AssertionError, match="embed.weight"):
        _load_in_kernel(ranks, skipped)  # a fresh random model, not the checkpoint


ONE_ROW = 'fully_shard(one_row, mesh=init_device_mesh("cpu", (world_size,)))\n'


def test_the_shards_figure_draws_each_rank_s_rows_of_torch_chunk(ranks, lesson):
    import matplotlib.pyplot as plt

    from labkit import diagrams

    cell = {"ranks": ranks, "diagrams": diagrams}  # the lesson's first cell imports it
    exec(lesson["shards_figure"], cell)
    plt.close(cell["fig"])
    rows = {name: [(start, stop) for r in cell["shards"]
                   for n, _, start, stop in r if n == name]
            for name in ("embed.weight", "one_row.weight")}
    assert rows == {"embed.weight": [(0, 17), (17, 33)],  # 33 rows: 17 and 16
                    "one_row.weight": [(0, 1), (1, 1)]}  # rank 1: empty


def test_the_shards_check_fails_where_fully_shard_cuts_another_dim(ranks, lesson):
    along_columns = ONE_ROW.replace(
        "))\n", "),\n            shard_placement_fn=lambda p: Shard(p.dim() - 1))\n")
    cut = _changed(lesson["shards"], ONE_ROW,
                   "from torch.distributed.tensor import Shard\n" + along_columns)
    with pytest.raises(cluster.RankError, match="one_row.weight"):
        ranks.execute(cut)  # each rank holds 8 of its 16 columns, not chunk's rows
