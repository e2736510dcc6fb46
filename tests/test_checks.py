import math
import warnings

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


@pytest.mark.parametrize("lang", ["ja", "en"])
def test_require_is_silent_for_each_checked_torch_and_names_them_for_another(
        monkeypatch, lang):
    labkit.set_lang(lang)
    assert labkit.CHECKED_TORCH_VERSIONS == ("2.13.0", "2.14.1")
    # any build of a checked version: the CPU wheel, PyPI's CUDA one, a source build
    for have in ("2.13.0+cpu", "2.14.1+cu130", "2.14.1", "2.13.0a0+git1"):
        monkeypatch.setattr(torch, "__version__", have)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert labkit.require("0.1.0") == labkit.__version__
    # a version between, after, or before them: each checked one named
    for have in ("2.14.0+cpu", "2.15.0", "2.11.0+cpu"):
        monkeypatch.setattr(torch, "__version__", have)
        with pytest.warns(labkit.TorchVersionWarning) as caught:
            labkit.require("0.1.0")
        message = str(caught[0].message)
        expected = {
            "ja": f"torch 2.13.0 と 2.14.1 で確かめてあります。"
                  f"ここの torch は {have} です",
            "en": f"checked with torch 2.13.0 and 2.14.1; this is torch {have}."}
        assert expected[lang] in message, message
    labkit.set_lang("en")


def test_torch_note_lists_three_checked_versions_in_each_language(monkeypatch):
    monkeypatch.setattr(labkit, "CHECKED_TORCH_VERSIONS",
                        ("2.12.0", "2.13.0", "2.14.1"))
    assert labkit.torch_note("2.12.0+cpu") is None
    labkit.set_lang("ja")
    assert "torch 2.12.0、2.13.0 と 2.14.1 で" in labkit.torch_note("2.11.0")
    labkit.set_lang("en")
    assert "torch 2.12.0, 2.13.0 and 2.14.1;" in labkit.torch_note("2.11.0")


def test_a_nan_anywhere_is_a_nan_difference_and_fails_the_checks():
    """max() of Python floats keeps 0.0 over NaN; the comparison must not."""
    nan, ok = torch.tensor([float("nan"), 1.0]), torch.tensor([0.0, 1.0])
    assert math.isnan(compare.max_abs_diff(nan, ok))
    assert math.isnan(compare.max_abs_diff([ok, nan, ok], [ok, ok, ok]))
    with pytest.raises(AssertionError):
        checks.grads_match([nan], [ok])
