"""labkit.sharding: what a rank holds, by formula and by measurement."""

import torch

from labkit import sharding


def test_held_bytes_counts_each_storage_once_and_a_freed_one_as_nothing():
    flat = torch.zeros(10)  # 40 bytes, viewed twice below
    weight = torch.nn.Parameter(torch.zeros(3))  # 12 bytes, tied below
    held = [flat, flat[2:5], flat.view(2, 5), weight, weight, None]
    assert sharding.held_bytes(held) == 40 + 12
    weight.data.untyped_storage().resize_(0)  # freed as ZeRO-3 frees a gathered layer
    assert sharding.held_bytes(held) == 40
