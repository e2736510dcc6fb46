import math

import pytest
import torch

import labkit
from labkit import checks, compare


def test_expect_error_catches_and_reports(capsys):
    with checks.expect_error(ValueError, match="bad") as caught:
        raise ValueError("bad input")
    assert isinstance(caught.exception, ValueError)
    assert "Raised as expected: ValueError: bad input" in capsys.readouterr().out


def test_expect_error_in_japanese(capsys):
    labkit.set_lang("ja")
    with checks.expect_error((KeyError, IndexError)):
        [][1]
    assert "想定どおりの例外: IndexError" in capsys.readouterr().out


def test_expect_error_fails_when_nothing_is_raised():
    with pytest.raises(AssertionError, match="Expected ValueError"):
        with checks.expect_error(ValueError):
            pass


def test_expect_error_fails_on_the_wrong_message():
    with pytest.raises(AssertionError, match="lacks 'shape'"):
        with checks.expect_error(ValueError, match="shape"):
            raise ValueError("something else")


def test_expect_error_lets_other_errors_through():
    with pytest.raises(TypeError):
        with checks.expect_error(ValueError):
            raise TypeError("not this one")


def test_max_abs_diff():
    a = [torch.zeros(3), torch.ones(2)]
    b = [torch.tensor([0.0, 0.5, 0.0]), torch.ones(2)]
    assert compare.max_abs_diff(a, b) == 0.5
    assert compare.max_abs_diff(torch.ones(2), torch.ones(2)) == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        compare.max_abs_diff(torch.ones(2), torch.ones(3))
    with pytest.raises(ValueError, match="numbers of tensors"):
        compare.max_abs_diff(a, b[:1])


def test_require_names_both_versions():
    assert labkit.require("0.0.1") == labkit.__version__
    with pytest.raises(RuntimeError, match="needs 99.0 or newer"):
        labkit.require("99.0")


def test_a_nan_anywhere_is_a_nan_difference_and_fails_the_checks():
    """max() of Python floats keeps 0.0 over NaN; the comparison must not."""
    nan, ok = torch.tensor([float("nan"), 1.0]), torch.tensor([0.0, 1.0])
    assert math.isnan(compare.max_abs_diff(nan, ok))
    assert math.isnan(compare.max_abs_diff([ok, nan, ok], [ok, ok, ok]))
    with pytest.raises(AssertionError):
        checks.grads_match([nan], [ok])
