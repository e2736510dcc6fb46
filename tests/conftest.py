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
