"""labkit.sharding: what a rank holds, by formula and by measurement."""

import pytest
import torch
from torch import nn

from labkit import models, sharding


def test_held_bytes_counts_each_storage_once_and_a_freed_one_as_nothing():
    flat = torch.zeros(10)  # 40 bytes, viewed twice below
    weight = torch.nn.Parameter(torch.zeros(3))  # 12 bytes, tied below
    held = [flat, flat[2:5], flat.view(2, 5), weight, weight, None]
    assert sharding.held_bytes(held) == 40 + 12
    weight.data.untyped_storage().resize_(0)  # freed as ZeRO-3 frees a gathered layer
    assert sharding.held_bytes(held) == 40


def test_memory_parts_shards_one_more_part_per_stage():
    parts = sharding.memory_parts(1000, 4, **sharding.FP32_ADAM)
    assert parts["DDP"] == {"parameters": 4000, "gradients": 4000, "optimizer": 8000}
    assert parts["ZeRO-1"] == {"parameters": 4000, "gradients": 4000, "optimizer": 2000}
    assert parts["ZeRO-2"] == {"parameters": 4000, "gradients": 1000, "optimizer": 2000}
    assert parts["ZeRO-3"] == {"parameters": 1000, "gradients": 1000, "optimizer": 2000}
    # memory_per_rank is their sum, and keeps lesson 09's mixed-precision defaults
    assert sharding.memory_per_rank(1000, 4, **sharding.FP32_ADAM)["ZeRO-2"] == 7000
    assert sharding.memory_per_rank(7.5e9, 64)["DDP"] == 16 * 7.5e9
    with pytest.raises(ValueError, match="world_size >= 1"):
        sharding.memory_parts(1000, 0)


def test_flat_parameters_pads_views_and_shards():
    a = nn.Parameter(torch.arange(3.0))
    b = nn.Parameter(torch.arange(4.0).view(2, 2) + 10)
    flat = sharding.FlatParameters([a, b], world_size=2)
    assert (flat.numel, flat.shard_numel, flat.full.numel()) == (7, 4, 8)
    assert flat.full.tolist() == [0, 1, 2, 10, 11, 12, 13, 0]  # one zero of padding
    assert a.data_ptr() == flat.full.data_ptr() and b.shape == (2, 2)
    flat.full[3] = -1.0  # what is written into full is what the model computes with
    assert b[0, 0].item() == -1.0
    assert flat.shard(0).tolist() == [0, 1, 2, -1] and flat.shard(1).tolist() == [
        11, 12, 13, 0]
    assert flat.shard(1).data_ptr() == flat.full[4:].data_ptr()  # a view, no copy
    with pytest.raises(ValueError, match="rank must be in"):
        flat.shard(2)


def test_flat_grad_holds_the_gradients_once_and_zero_where_none():
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    flat = sharding.FlatParameters([a, b], world_size=4)  # 5 values -> 8
    (a * torch.tensor([1.0, 2.0, 3.0])).sum().backward()  # b gets no gradient
    grads = flat.flat_grad()
    assert grads.tolist() == [1, 2, 3, 0, 0, 0, 0, 0]
    assert sharding.held_bytes([a.grad, b.grad, grads]) == 8 * 4  # views of one buffer


def test_flat_parameters_rejects_a_tied_weight_listed_twice_and_no_parameters():
    w = nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="listed twice"):
        sharding.FlatParameters([w, w], 2)
    with pytest.raises(ValueError, match="need parameters"):
        sharding.FlatParameters([], 2)


def test_shard_units_put_a_tied_weight_at_the_root_and_skip_the_frozen():
    model = models.TiedMLP()
    units = sharding.shard_units(model)
    assert [m for m, _ in units] == [model.hidden, model.head, model]  # root last
    assert [[id(p) for p in ps] for _, ps in units] == [
        [id(model.hidden.weight), id(model.hidden.bias)],
        [id(model.head.bias)],
        [id(model.embed.weight)],  # tied: used by embed and head, so the root's
    ]
    every = {id(p) for _, ps in units for p in ps}
    assert id(model.frozen.weight) not in every and id(model.frozen.bias) not in every


def test_held_by_part_counts_the_optimizers_state():
    p = nn.Parameter(torch.ones(5))
    adam = torch.optim.Adam([p])
    p.grad = torch.ones(5)
    adam.step()
    assert sharding.held_by_part([p], [p.grad], adam) == {
        "parameters": 20, "gradients": 20, "optimizer": 20 + 20 + 4}  # and `step`


def test_tied_mlp_ties_freezes_and_names_bad_tokens():
    model = models.TiedMLP(vocab=33, hidden=16)
    assert model.head.weight is model.embed.weight
    assert models.count_params(model) == 33 * 16 + 16 * 16 + 16 + 33  # frozen: none
    assert model(torch.tensor([0, 32])).shape == (2, 33)
    with pytest.raises(ValueError, match=r"must be in \[0, 33\)"):
        model(torch.tensor([33]))
    with pytest.raises(ValueError, match="token ids"):
        model(torch.zeros(2, 16))


def test_reduce_scatter_and_all_gather_price_one_all_reduce():
    from labkit import comm

    ab = comm.AlphaBeta(alpha=1e-4, beta=1e9)
    for n in (2, 4, 8):
        nbytes = 8e6
        rs, ag = ab.reduce_scatter_time(nbytes, n), ab.all_gather_time(nbytes, n)
        assert rs + ag == pytest.approx(ab.time(nbytes, n))
        # the ring: n - 1 steps, each rank sending (n - 1) / n of the bytes
        assert rs == pytest.approx((n - 1) * 1e-4 + (n - 1) / n * nbytes / 1e9)
    assert ab.all_gather_time(8e6, 1) == 0.0
