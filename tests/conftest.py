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


@pytest.fixture(scope="session")
def ranks():
    """Two engines in one gloo group, shared by the tests that need ranks.

    Rank-side test functions live in the test modules; the engines import them
    by module name, so the tests folder goes on their sys.path.
    """
    from pathlib import Path

    from labkit import cluster

    group = cluster.start(2, timeout_s=10, activate=False)
    group.execute(f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})")
    yield group
    group.stop()


def child_processes():
    """Live processes started (directly or not) by this test process."""
    import psutil

    return [p for p in psutil.Process().children(recursive=True) if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]
