"""Where the course runs besides this machine: Linux, macOS and Windows through
tools/course.py (which make's targets call), a workflow for the three systems, a
dev container (VS Code, Codespaces), Binder, conda, and Colab. Each configuration
parses, names commands and files that exist, pins the torch the course was checked
with (labkit.CHECKED_TORCH), and installs an extra of pyproject's whose
requirements this environment (made by the set-up, and tested) satisfies, through
the lock; elsewhere, labkit.require says the torch differs. Building them (a
container, Binder, conda) and running the workflow are not tested here.
"""

import json
import re
import shlex
import subprocess
import warnings
from pathlib import Path

import pytest

import course
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


def _make_n(target: str, *variables: str) -> list[str]:
    """What `make TARGET` runs, run here by no one."""
    dry = subprocess.run(["make", "--no-print-directory", "-n", "-C", str(ROOT),
                          target, *variables], capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    return dry.stdout.splitlines()


def _setup_plan(venv: Path, torch: str = course.TORCH) -> list[list[str]]:
    """The commands tools/course.py's set-up runs into a new `venv`, run by no one."""
    plan = course.Course(venv, torch, dry_run=True)
    plan.setup()
    return plan.ran


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
    assert pip[0] == PIN  # torch first, alone, as the set-up installs it
    assert pip[1] == f"-c {course.LOCK.name}"  # the rest at the lock's versions
    conda_extra = re.fullmatch(r"-e \.\[(\w+)\]", pip[2]).group(1)
    setup_extra = re.search(r"-e '\.\[(\w+)\]'", "\n".join(
        map(shlex.join, _setup_plan(ROOT / "build" / "no-venv")))).group(1)
    assert conda_extra == setup_extra == "dev"  # "the same environment as make lab"
    assert "python=3.11" in conda["dependencies"]
    binder = re.search(r'-e "\.\[(\w+)\]"', (ROOT / "binder" / "postBuild")
                       .read_text()).group(1)
    for extra in {setup_extra, binder}:
        assert unmet(extra, extras, _installed) == [], extra


def test_the_set_up_pins_the_torch_the_course_was_checked_with():
    assert course.TORCH == PIN
    # one default, tools/course.py's: the Makefile passes only a torch asked for
    assert re.search(r"^TORCH \?=$", (ROOT / "Makefile").read_text(), re.M)
    assert f"- {PIN}" in (ROOT / "environment.yml").read_text()


@pytest.mark.procs  # make -n
def test_each_make_target_runs_the_step_of_its_name_in_tools_course_py():
    """make and the no-make way run one code: each target is a course.py step."""
    makefile = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    targets = [*re.search(r"^STEPS := (.*)$", makefile, re.M).group(1).split(),
               *re.findall(r"^([a-z-]+):", makefile, re.M)]
    steps = set(course.STEPS)
    assert set(targets) == steps  # every step has its target, and no more
    for target in targets:
        (line,) = _make_n(target)
        python, script, *args = shlex.split(line)
        assert (python, script) == ("python3", "tools/course.py")
        assert args[:2] == ["--venv", ".venv"] and args[2] == target, line
        course.parse(args)  # an option course.py lacks ends here
    (lab,) = _make_n("lab", "TORCH=torch==2.13.0 --index-url x",
                     "LAB_ROOT=dist/student", "LAB_ARGS=--no-browser")
    options = course.parse(shlex.split(lab)[2:])
    assert (options.torch, options.root, options.args) == (
        "torch==2.13.0 --index-url x", "dist/student", ["--no-browser"])


def test_the_steps_run_with_the_venv_s_python_on_each_system(monkeypatch, tmp_path):
    """Windows keeps a venv's Python in Scripts\\python.exe (forced here: no
    Windows machine has run this)."""
    assert course.python_in(tmp_path) == tmp_path / "bin" / "python"
    monkeypatch.setattr(course.os, "name", "nt")
    assert course.python_in(tmp_path) == tmp_path / "Scripts" / "python.exe"
    plan = course.Course(tmp_path / ".venv", dry_run=True)
    plan.lint()
    assert all(cmd[0] == str(tmp_path / ".venv" / "Scripts" / "python.exe")
               for cmd in plan.ran[1:])
    # lab's --allow-root where there is no os.geteuid (Windows): never
    monkeypatch.delattr(course.os, "geteuid", raising=False)
    plan.lab()
    assert "--allow-root" not in plan.ran[-1]


def test_every_step_s_pytest_lists_its_skips(tmp_path):
    """A test skipped for a missing tool says so in the step's own summary (-rs):
    on macOS and Windows, where there is no unshare, that is how the step says
    what it did not check. A dry run writes nothing (a real run's times stay)."""
    plan = course.Course(tmp_path / ".venv", dry_run=True)
    root = tmp_path / "repo"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(course, "ROOT", root)
        plan.test()
        plan.check()
    assert not root.exists()
    runs = [cmd for cmd in plan.ran if cmd[1:3] == ["-m", "pytest"]]
    assert len(runs) == len(["unit", "ecosystem", "nbval", "site", "nbgrader", "check"])
    assert [cmd for cmd in runs if "-rs" not in cmd] == []


def test_the_workflow_for_three_systems_calls_steps_and_files_that_exist():
    """It has never run (README): here, that it parses and that what it runs
    exists; a step or a notebook renamed fails this."""
    import yaml

    workflow = yaml.safe_load((ROOT / ".github/workflows/platforms.yml").read_text())
    assert workflow.get("on", workflow.get(True))  # YAML reads a bare `on` as True
    job = workflow["jobs"]["course"]
    systems = job["strategy"]["matrix"]["os"]
    assert {s.split("-")[0] for s in systems} == {"ubuntu", "macos", "windows"}
    runs = [step["run"] for step in job["steps"] if "run" in step]
    steps = []
    for run in runs:
        python, script, *args = shlex.split(run)
        assert (python, script) == ("python", "tools/course.py"), run
        options = course.parse(args)
        steps.append(options.step)
        for path in options.args:
            assert (ROOT / path).is_file(), path
        if options.step == "setup":
            assert options.torch.split()[0] == PIN
    assert steps == ["setup", "setup", "unit", "nbval"]
    # Linux takes the CPU build; macOS and Windows PyPI's (a CPU build there)
    linux, other = (s for s in job["steps"] if s.get("run", "").endswith(
        ("cpu\"", "setup")))
    assert linux["if"] == "runner.os == 'Linux'" and CPU_INDEX in linux["run"]
    assert other["if"] == "runner.os != 'Linux'"
    lesson = course.parse(shlex.split(runs[-1])[2:]).args
    assert "cluster.start(" in (ROOT / lesson[0]).read_text()  # a lesson with ranks


def test_the_dev_container_sets_up_with_the_readme_s_command():
    config = _jsonc(ROOT / ".devcontainer" / "devcontainer.json")
    assert config["image"].startswith("mcr.microsoft.com/devcontainers/python:3.11")
    python, script, *args = shlex.split(config["postCreateCommand"])
    assert (python, script) == ("python", "tools/course.py")
    options = course.parse(args)
    assert (options.step, options.torch) == ("setup", f"{PIN} {CPU_INDEX}")
    # what the set-up runs is what lab runs first, then JupyterLab
    venv = ROOT / "build" / "no-venv"
    lab = course.Course(venv, options.torch, dry_run=True)
    lab.lab()
    setup = _setup_plan(venv, options.torch)
    assert any("install" in cmd for cmd in setup)
    assert lab.ran[:len(setup)] == setup and len(lab.ran) == len(setup) + 1
    assert lab.ran[-1][:3] == [str(course.python_in(venv)), "-m", "jupyterlab"]
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
    assert f" -c {course.LOCK.name} " in installs[1]  # the rest at the lock's versions
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
