import pytest
import torch
from torch import nn

from labkit import models


@pytest.mark.parametrize("cls", [models.MLPAsWritten, models.TwoLinearAsWritten])
def test_as_written_fails_on_a_batch(cls):
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        cls()(torch.randn(100, 10))


@pytest.mark.parametrize("cls", [models.MLPAsWritten, models.TwoLinearAsWritten])
def test_as_written_drops_the_batch_dimension_of_one(cls):
    assert cls()(torch.randn(1, 10)).shape == (10,)


@pytest.mark.parametrize(
    ("fixed", "original"),
    [(models.MLP, models.MLPAsWritten), (models.TwoLinear, models.TwoLinearAsWritten)],
)
def test_corrected_model_keeps_the_batch_and_the_numbers(fixed, original):
    torch.manual_seed(0)
    orig = original()
    model = fixed()
    model.load_state_dict(orig.state_dict())
    X = torch.randn(100, 10)
    out = model(X)
    assert out.shape == (100, 10)
    assert torch.equal(model(X[:1])[0], orig(X[:1]))
    for i in (0, 42, 99):  # rows do not mix
        torch.testing.assert_close(out[i], model(X[i : i + 1])[0])


def test_parameter_counts_match_the_documents():
    assert models.count_params(models.TwoLinear()) == 2 * (10 * 10 + 10)
    assert models.count_params(models.MLP()) == 10 * 100 + 100 + 100 * 10 + 10


def test_myloss_is_mean_squared_error():
    a, b = torch.randn(64, 10), torch.randn(64, 10)
    torch.testing.assert_close(models.MyLoss()(a, b), nn.MSELoss()(a, b))


def test_wide_mlp_shapes_and_bad_sizes():
    m = models.WideMLP(hidden=32, depth=3)
    assert m(torch.randn(5, 10)).shape == (5, 10)
    assert models.count_params(m) == 10 * 32 + 32 + 2 * (32 * 32 + 32) + 32 * 10 + 10
    with pytest.raises(ValueError, match="depth"):
        models.WideMLP(depth=0)


@pytest.mark.parametrize("cls", [models.MLP, models.TwoLinear, models.WideMLP])
@pytest.mark.parametrize("shape", [(100, 7), (10,), (4, 2, 3)])
def test_a_shape_the_model_cannot_take_is_named(cls, shape):
    with pytest.raises(ValueError, match=r"shape \(batch, 10\); got shape"):
        cls()(torch.randn(*shape))


def test_per_sample_shapes_that_flatten_to_ten_are_taken():
    assert models.MLP()(torch.randn(3, 2, 5)).shape == (3, 10)
