"""labkit.fsdp: FSDP2's units, what a rank holds and sends, and its checkpoints."""

import functools

import pytest
import torch
from torch import nn

from labkit import fsdp, models, plots


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
