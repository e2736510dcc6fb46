import matplotlib
import pytest

matplotlib.use("Agg")


@pytest.fixture(autouse=True)
def _lang_and_figures():
    """Each test starts in English and leaves no figure open."""
    import matplotlib.pyplot as plt

    import labkit

    labkit.set_lang("en")
    yield
    labkit.set_lang("en")
    plt.close("all")


def _add_tests_to_path(group):
    from pathlib import Path

    group.execute(f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})")


@pytest.fixture(scope="session")
def _two_ranks():
    from labkit import cluster

    group = cluster.start(2, timeout_s=10, activate=False)
    _add_tests_to_path(group)
    yield group
    group.stop()


@pytest.fixture
def ranks(_two_ranks):
    """Two engines in one gloo group, shared by the tests that need ranks.

    Rank-side test functions live in tests/ddp_rank_checks.py; the engines
    import it by name, so the tests folder goes on their sys.path. A test that
    starts a cluster of its own stops this one (one group per kernel): it is
    started again for the next test that needs it.
    """
    if _two_ranks.view is None:
        _two_ranks.restart()
        _add_tests_to_path(_two_ranks)
    return _two_ranks


def child_processes():
    """Live processes started (directly or not) by this test process."""
    import psutil

    return [p for p in psutil.Process().children(recursive=True) if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture
def fake_gpus(monkeypatch):
    """`fake_gpus(n)`: this process sees n CUDA devices (engines it starts see none).

    No GPU has been available to this project; the choices labkit makes from
    the device count are tested this way.
    """
    import torch

    def fake(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_device_name",
                            lambda device=None: f"Fake GPU {device}")
        monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)

    return fake
