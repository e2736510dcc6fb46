"""Where the course runs besides `make lab`: a dev container (VS Code, Codespaces),
Binder, conda, and Colab. Each configuration parses, names commands and files that
exist, and pins the torch the course was checked with (labkit.CHECKED_TORCH);
elsewhere, labkit.require says the torch differs."""

import json
import re
import shlex
import subprocess
import warnings
from pathlib import Path

import pytest

import labkit

ROOT = Path(__file__).resolve().parent.parent
PIN = f"torch=={labkit.CHECKED_TORCH}"
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def _jsonc(path: Path) -> dict:
    """A JSON-with-comments file whose comments are whole lines (no trailing commas,
    as the dev container spec wants)."""
    lines = [line for line in path.read_text().splitlines()
             if not line.lstrip().startswith("//")]
    return json.loads("\n".join(lines))


def _extras() -> set[str]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return set(pyproject["project"]["optional-dependencies"])


def test_the_makefile_pins_the_torch_the_course_was_checked_with():
    assert re.search(r"^TORCH \?= (\S+)$", (ROOT / "Makefile").read_text(),
                     re.M).group(1) == PIN
    assert f"- {PIN}" in (ROOT / "environment.yml").read_text()


def test_the_dev_container_sets_up_with_the_readme_s_command():
    config = _jsonc(ROOT / ".devcontainer" / "devcontainer.json")
    assert config["image"].startswith("mcr.microsoft.com/devcontainers/python:3.11")
    make, target, torch = shlex.split(config["postCreateCommand"])
    assert (make, target) == ("make", "setup")
    assert torch == f"TORCH={PIN} {CPU_INDEX}"
    # the target exists and is what make lab runs first
    dry = subprocess.run(["make", "-n", "-C", str(ROOT), target],
                         capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert re.search(r"^lab: \$\(STAMP\)$", (ROOT / "Makefile").read_text(), re.M)
    assert re.search(r"^setup: \$\(STAMP\)$", (ROOT / "Makefile").read_text(), re.M)
    # JupyterLab's port (make lab keeps JupyterLab's default) is forwarded
    assert config["forwardPorts"] == [8888] and "8888" in config["portsAttributes"]
    assert config["hostRequirements"]["cpus"] >= 2  # the kernel and two ranks


def test_the_binder_build_installs_the_course_with_the_cpu_torch():
    binder = ROOT / "binder"
    assert (binder / "runtime.txt").read_text().strip() == "python-3.11"
    post_build = binder / "postBuild"
    assert post_build.stat().st_mode & 0o111, "repo2docker runs postBuild: executable"
    assert subprocess.run(["bash", "-n", str(post_build)]).returncode == 0
    script = post_build.read_text()
    assert script.startswith("#!/bin/bash\n") and "set -euo pipefail" in script
    installs = [line for line in script.splitlines() if "pip install" in line]
    assert installs[0].endswith(f"install --no-cache-dir {PIN} {CPU_INDEX}")
    extra = re.search(r'-e "\.\[(\w+)\]"', installs[1]).group(1)
    assert extra in _extras()
    copied = re.search(r"^cp (\S+) ", script, re.M).group(1)
    assert (ROOT / copied).is_file()
    # with a binder/ folder, repo2docker ignores the root's environment.yml: no mix
    assert not (ROOT / ".binder").exists()


def test_require_warns_when_torch_is_not_the_checked_one(monkeypatch):
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the checked torch, any build: no warning
        monkeypatch.setattr(torch, "__version__", f"{labkit.CHECKED_TORCH}+cu128")
        assert labkit.require("0.1.0") == labkit.__version__
    monkeypatch.setattr(torch, "__version__", "2.11.0+cpu")  # Colab's, late 2026
    for lang in ("ja", "en"):
        labkit.set_lang(lang)
        with pytest.warns(labkit.TorchVersionWarning) as caught:
            labkit.require("0.1.0")
        message = str(caught[0].message)
        assert "2.11.0+cpu" in message and labkit.CHECKED_TORCH in message
        assert ("確かめて" in message) == (lang == "ja")
    labkit.set_lang("en")


def test_versions_compare_by_their_numbers():
    assert labkit.torch_note("2.13.0") is None
    assert labkit.torch_note("2.13.0a0+git1234") is None
    assert labkit.torch_note("2.14.0.dev20261201+cpu") is not None
    assert labkit._parse("2.14.0a0+git1") == (2, 14, 0)
