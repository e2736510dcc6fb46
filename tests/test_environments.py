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
import signal
import subprocess
import sys
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


def _conda_pip() -> list[str]:
    import yaml

    conda = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert "python=3.11" in conda["dependencies"]
    (pip,) = [d["pip"] for d in conda["dependencies"] if isinstance(d, dict)]
    return pip


def test_the_environments_install_extras_this_environment_satisfies():
    """make setup's dev (which this venv was made with), lab's, binder's and
    conda's: no pin in pyproject that the course's tested environment does not
    meet."""
    extras = _extras()
    conda_extra = re.fullmatch(r"-e \.\[(\w+)\]", _conda_pip()[-1]).group(1)
    setup_extra = re.search(r"-e '\.\[(\w+)\]'", "\n".join(
        map(shlex.join, _setup_plan(ROOT / "build" / "no-venv")))).group(1)
    assert setup_extra == "dev" and conda_extra == "lab"  # a learner's, as lab's
    binder = re.search(r'-e "\.\[(\w+)\]"', (ROOT / "binder" / "postBuild")
                       .read_text()).group(1)
    assert set(course.EXTRAS) <= set(extras)
    for extra in {setup_extra, conda_extra, binder, *course.EXTRAS}:
        assert unmet(extra, extras, _installed) == [], extra
    assert "labkit[lab]" in extras["dev"]  # dev holds lab (course.EXTRAS' order)


def test_conda_s_environment_has_the_cpu_torch_and_a_command_that_uses_it(capsys):
    """environment.yml: one pip call (conda's), the CPU index beside PyPI (its
    2.13.0+cpu is the newest 2.13.0), torch pinned, the rest at the lock's
    versions; its header's command opens the course with the environment's
    Python, making no .venv and installing nothing."""
    pip = _conda_pip()
    assert pip == [f"--extra-index-url {course.CPU_INDEX}", PIN,
                   f"-c {course.LOCK.name}", "-e .[lab]"]
    header = (ROOT / "environment.yml").read_text().split("\nname:")[0]
    (command,) = re.findall(r"^#\s+(python tools/course\.py .*)$", header, re.M)
    python, script, *args = shlex.split(command)
    options = course.parse([*args, "--dry-run"])
    assert options.no_venv and options.step == "lab"
    capsys.readouterr()
    course.main([*args, "--dry-run"])
    (line,) = capsys.readouterr().out.splitlines()  # no venv, no pip: JupyterLab
    assert line.startswith(f"{sys.executable} -m jupyterlab ")
    with pytest.raises(SystemExit, match="with --no-venv there is none"):
        course.main(["clean-venv", "--no-venv"])  # the conda environment stays


def test_python_older_than_the_floor_is_refused_in_one_line(monkeypatch):
    problem = course.python_problem((3, 9, 6), "/usr/bin/python3")
    assert "\n" not in problem
    assert "Python 3.9.6 (/usr/bin/python3)" in problem
    assert f"needs Python {course.PYTHON_FLOOR} or newer" in problem
    assert "install Python 3.11" in problem
    assert course.python_problem((3, 10, 0), "x") is None
    assert course.python_problem((3, 14, 1), "x") is None
    # before anything is made or printed
    monkeypatch.setattr(course.sys, "version_info", (3, 9, 6, "final", 0))
    with pytest.raises(SystemExit) as refused:
        course.main(["setup", "--venv", "/nonexistent/venv"])
    assert str(refused.value.code).startswith("course.py: this is Python 3.9.6 (")


def _fake_runs(monkeypatch) -> list[list[str]]:
    """Course.run recording its commands, running none but `-m venv` (a folder)."""
    ran = []

    def run(self, cmd, env=None, terminal=False):
        cmd = [str(part) for part in cmd]
        ran.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            Path(cmd[3], "bin").mkdir(parents=True, exist_ok=True)
            Path(cmd[3], "bin", "python").touch()
    monkeypatch.setattr(course.Course, "run", run)
    return ran


def _pyvenv(venv: Path, line: str) -> None:
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    (venv / "pyvenv.cfg").write_text(f"home = /usr/bin\n{line}\n")
    (venv / "kept").touch()


@pytest.mark.parametrize("line", ["version = 3.9.6", "version_info = 3.9.6.final.0"])
def test_a_venv_made_by_another_python_is_made_again(monkeypatch, tmp_path, capsys,
                                                     line):
    """A failed set-up under Python 3.9, then 3.11: not the same failure again.
    (venv's pyvenv.cfg says `version`, virtualenv's `version_info`.)"""
    ran = _fake_runs(monkeypatch)
    venv = tmp_path / ".venv"
    _pyvenv(venv, line)
    monkeypatch.setattr(course, "RUNNING", "3.11")
    course.Course(venv, PIN).setup()
    assert f"{venv} was made by Python 3.9, this is Python 3.11: making it again" \
        in capsys.readouterr().out
    assert not (venv / "kept").exists()
    assert ran[0][1:] == ["-m", "venv", str(venv)]
    # made by this Python: kept, no venv made
    ran.clear()
    other = tmp_path / "same"
    _pyvenv(other, "version = 3.11.7")
    course.Course(other, PIN).setup()
    assert (other / "kept").exists() and "made by" not in capsys.readouterr().out
    assert [cmd for cmd in ran if "venv" in cmd] == []


def test_lab_installs_a_learner_s_extra_and_the_other_steps_add_dev(monkeypatch,
                                                                    tmp_path):
    """lab: torch, then `.[lab]`; test (or unit, setup) after it adds `.[dev]`
    only; then neither installs again. pip shows its progress (no --quiet)."""
    ran = _fake_runs(monkeypatch)
    venv = tmp_path / ".venv"
    course.Course(venv, PIN).lab()
    assert [cmd[4:] for cmd in ran if "pip" in cmd] == [
        [PIN], ["-c", str(course.LOCK), "-e", ".[lab]"]]
    assert ran[-1][1:3] == ["-m", "jupyterlab"]
    assert (venv / ".labkit-installed").read_text() == "lab\n"
    ran.clear()
    course.Course(venv, PIN).unit()
    assert ran[0] == [str(course.python_in(venv)), "-m", "pip", "install", "-c",
                      str(course.LOCK), "-e", ".[dev]"]
    assert ran[1][1:3] == ["-m", "pytest"] and len(ran) == 2
    ran.clear()
    course.Course(venv, PIN).lab()
    course.Course(venv, PIN).unit()
    assert [cmd for cmd in ran if "pip" in cmd] == []
    # a stamp written before extras were recorded (empty) was dev's
    (venv / ".labkit-installed").write_text("")
    assert course.installed_extra(venv / ".labkit-installed") == "dev"


def test_linux_without_an_nvidia_driver_gets_the_cpu_torch(tmp_path, capsys):
    no_driver, driver = tmp_path / "none", tmp_path / "version"
    driver.touch()
    nothing = lambda name: None  # noqa: E731
    torch, note = course.default_torch("linux", no_driver, nothing)
    assert shlex.split(torch) == [PIN, "--no-deps", "--index-url", course.CPU_INDEX]
    assert "CPU build" in note and "--torch" in note and "\n" not in note
    assert course.default_torch("linux", driver, nothing) == (PIN, None)
    assert course.default_torch("linux", no_driver, lambda name: "/usr/bin/" + name) \
        == (PIN, None)
    for system in ("darwin", "win32"):  # PyPI's torch there is the CPU build
        assert course.default_torch(system, no_driver, nothing) == (PIN, None)
    # --torch still chooses; without it, the default, said as it installs
    assert course.parse(["lab"]).torch is None
    chosen = course.Course(tmp_path / "v", f"{PIN} --index-url x", dry_run=True)
    assert chosen.torch_note is None and chosen.torch.endswith("x")
    plan = course.Course(tmp_path / "v", None, dry_run=True)
    plan.torch_note = "course.py: the note"
    plan.setup()
    assert "course.py: the note" in capsys.readouterr().out


class _Child:
    def __init__(self, *args, **kwargs):
        pass

    def wait(self):
        self.sigint = signal.getsignal(signal.SIGINT)
        _Child.seen = self.sigint
        return 3


def test_jupyterlab_gets_ctrl_c_and_course_py_exits_with_its_status(monkeypatch,
                                                                    tmp_path):
    """While JupyterLab runs, this process ignores SIGINT (JupyterLab asks
    "Shut down this Jupyter server?"), then restores it and exits as it did."""
    monkeypatch.setattr(course.subprocess, "Popen", _Child)
    before = signal.getsignal(signal.SIGINT)
    plan = course.Course(tmp_path, PIN)
    with pytest.raises(SystemExit) as done:
        plan.run(["jupyter"], terminal=True)
    assert done.value.code == 3 and _Child.seen == signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) == before


@pytest.mark.procs  # a Python started with its child
@pytest.mark.skipif(sys.platform == "win32", reason="process groups: POSIX")
def test_ctrl_c_in_the_terminal_reaches_the_child_with_no_traceback():
    """Ctrl-C signals the terminal's process group: course.py and JupyterLab. The
    child (Python's default handler: KeyboardInterrupt) exits 3 on it."""
    child = ("import os, signal, sys, time\n"
             "try:\n    os.killpg(os.getpgid(0), signal.SIGINT); time.sleep(20)\n"
             "except KeyboardInterrupt:\n    sys.exit(3)\n")
    parent = ("import sys; sys.path.insert(0, 'tools'); import course\n"
              f"course.Course(course.ROOT / 'build' / 'no-venv', 'x')"
              f".run([sys.executable, '-c', {child!r}], terminal=True)\n")
    # SIGINT at its default, as in a terminal: a shell's background job (CI run
    # with `&`, nohup) starts with SIGINT ignored, which its children inherit
    # and Python keeps, and then neither process could be interrupted at all.
    done = subprocess.run([sys.executable, "-c", parent], cwd=ROOT, text=True,
                          capture_output=True, timeout=60, start_new_session=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                           signal.SIG_DFL))
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr


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
        if options.step == "setup":  # the default torch, as a learner's
            assert options.torch is None and not options.no_venv
    assert steps == ["setup", "unit", "nbval"]
    assert not [step for step in job["steps"] if "if" in step]  # one way everywhere
    # UTF-8 output on every system (Windows' pipes are cp1252 otherwise)
    assert job["env"] == {"PYTHONUTF8": "1", "PYTHONIOENCODING": "utf-8"}
    lesson = course.parse(shlex.split(runs[-1])[2:]).args
    assert "cluster.start(" in (ROOT / lesson[0]).read_text()  # a lesson with ranks


def test_the_dev_container_sets_up_with_the_readme_s_command(monkeypatch, tmp_path):
    config = _jsonc(ROOT / ".devcontainer" / "devcontainer.json")
    assert config["image"].startswith("mcr.microsoft.com/devcontainers/python:3.11")
    python, script, *args = shlex.split(config["postCreateCommand"])
    assert (python, script) == ("python", "tools/course.py")
    options = course.parse(args)
    assert (options.step, options.torch) == ("setup", f"{PIN} {CPU_INDEX}")
    # the set-up installs dev, which holds lab: lab then only opens JupyterLab
    ran = _fake_runs(monkeypatch)
    venv = tmp_path / ".venv"
    course.Course(venv, options.torch).setup()
    assert any("install" in cmd for cmd in ran) and ".[dev]" in ran[-1]
    ran.clear()
    course.Course(venv, options.torch).lab()
    assert len(ran) == 1
    assert ran[-1][:3] == [str(course.python_in(venv)), "-m", "jupyterlab"]
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
