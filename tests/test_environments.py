"""Where the course runs besides `make lab`: a dev container (VS Code, Codespaces),
Binder, conda, and Colab. Each configuration parses, names commands and files that
exist, pins the torch the course was checked with (labkit.CHECKED_TORCH), and
installs an extra of pyproject's whose requirements this environment (made by
make setup, and tested) satisfies; elsewhere, labkit.require says the torch
differs. Building them (a container, Binder, conda) is not tested here.
"""

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


def _extras() -> dict[str, list[str]]:
    """pyproject's extras: {name: its requirements}."""
    tomllib = pytest.importorskip("tomllib", reason="needs Python 3.11+ (tomllib)")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return pyproject["project"]["optional-dependencies"]


def unmet(extra: str, extras: dict[str, list[str]], installed) -> list[str]:
    """The requirements of `extra` (with the extras it names, labkit[...]) that
    `installed(name)` (a version, or None) does not satisfy, each as written."""
    from packaging.requirements import Requirement

    missing, todo, seen = [], [extra], set()
    while todo:
        if (name := todo.pop()) in seen:
            continue
        seen.add(name)
        if name not in extras:
            missing.append(f"labkit[{name}]: no such extra")
            continue
        for line in extras[name]:
            req = Requirement(line)
            if req.name == "labkit":
                todo += sorted(req.extras)
            elif (version := installed(req.name)) is None or \
                    not req.specifier.contains(version, prereleases=True):
                missing.append(f"{line} (installed: {version})")
    return missing


def _installed(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _make_n(target: str) -> list[str]:
    """What `make TARGET` runs, as if pyproject.toml had changed (so the set-up
    shows), run here by no one."""
    dry = subprocess.run(["make", "--no-print-directory", "-n", "-W", "pyproject.toml",
                          "-C", str(ROOT), target], capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    return dry.stdout.splitlines()


def test_unmet_names_a_requirement_out_of_range_missing_or_an_unknown_extra():
    extras = {"lab": ["numpy>=2", "ipykernel"], "dev": ["labkit[lab]", "pytest>=8"],
              "odd": ["labkit[nope]"]}
    versions = {"numpy": "2.1.0", "ipykernel": "6.0", "pytest": "8.3"}
    assert unmet("dev", extras, versions.get) == []
    assert unmet("dev", extras, (versions | {"numpy": "1.26"}).get) == [
        "numpy>=2 (installed: 1.26)"]
    assert unmet("dev", extras, lambda name: versions.get(name)
                 if name != "ipykernel" else None) == ["ipykernel (installed: None)"]
    assert unmet("odd", extras, versions.get) == ["labkit[nope]: no such extra"]


@pytest.mark.procs  # make -n
def test_the_environments_install_extras_this_environment_satisfies():
    """make setup's dev (which this venv was made with), binder's and conda's: no
    pin in pyproject that the course's tested environment does not meet."""
    import yaml

    extras = _extras()
    conda = yaml.safe_load((ROOT / "environment.yml").read_text())
    (pip,) = [d["pip"] for d in conda["dependencies"] if isinstance(d, dict)]
    assert pip[0] == PIN  # torch first, alone, as make setup installs it
    conda_extra = re.fullmatch(r"-e \.\[(\w+)\]", pip[1]).group(1)
    setup_extra = re.search(r'-e "\.\[(\w+)\]"', "\n".join(_make_n("setup"))).group(1)
    assert conda_extra == setup_extra == "dev"  # "the same environment as make lab"
    assert "python=3.11" in conda["dependencies"]
    binder = re.search(r'-e "\.\[(\w+)\]"', (ROOT / "binder" / "postBuild")
                       .read_text()).group(1)
    for extra in {setup_extra, binder}:
        assert unmet(extra, extras, _installed) == [], extra


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
    # what make setup runs is what make lab runs first, then JupyterLab
    setup, lab = _make_n(target), _make_n("lab")
    assert any("pip install" in line for line in setup)
    assert lab[:len(setup)] == setup and len(lab) == len(setup) + 1
    assert " lab " in lab[-1] and lab[-1].startswith(".venv/bin/jupyter")
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
    assert extra in _extras()  # and met: the test above
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
