"""labkit as a learner installs it: a built wheel, not this source tree.

A wheel holds only what pyproject's package list and package data name, so a
module, subpackage or data file left out works here (editable install) and
breaks after `pip install labkit`. This builds the wheel, installs it into a
fresh venv and runs it from outside the repository.
"""

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

import course

pytestmark = pytest.mark.procs  # every test here starts processes

ROOT = Path(__file__).resolve().parent.parent


def _source_files() -> set[str]:
    """The files under labkit/ that the package needs at run time."""
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "labkit").rglob("*")
            if p.is_file() and p.suffix in (".py", ".sh", ".toml")
            and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # From a copy of what the build reads, so that no earlier build's leftovers
    # (build/lib, *.egg-info) can fill a gap in the package list.
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "labkit", src / "labkit",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # No build isolation: the venv's setuptools builds it, with no download.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(out), str(src)],
                   check=True, capture_output=True, text=True)
    wheel, = out.glob("labkit-*.whl")
    return wheel


@pytest.mark.timeout(300)
def test_the_wheel_holds_every_module_and_data_file(wheel):
    with zipfile.ZipFile(wheel) as zf:
        packed = {name for name in zf.namelist() if name.startswith("labkit/")}
    missing = _source_files() - packed
    assert not missing, f"left out of the wheel: {sorted(missing)}"


@pytest.mark.timeout(300)
def test_an_installed_wheel_imports_every_module_and_runs_doctor(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    # where a venv keeps them on each system (Windows: Scripts, Lib), as the
    # workflow for three systems needs; only Linux has run this
    python = course.python_in(env_dir)
    site = course.purelib(python)
    # torch and the rest come from this environment's site-packages, added as a
    # plain path: its .pth files (among them the editable labkit) are not run.
    deps, = (p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (site / "labkit_test_deps.pth").write_text(deps + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                    "--quiet", "--no-deps", str(wheel)],
                   check=True, capture_output=True, text=True)
    check = (
        "import importlib, pathlib, pkgutil, labkit\n"
        "where = pathlib.Path(labkit.__file__).parent\n"
        f"assert where.is_relative_to({str(site)!r}), where\n"
        "names = [m.name for m in pkgutil.walk_packages(labkit.__path__, 'labkit.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "from labkit.cluster import torchrun\n"
        "for script in [*torchrun.JOB_SCRIPTS.values(), torchrun.NODE_SCRIPT]:\n"
        "    assert script.is_file(), script\n"
        "print(*names)\n"
        # then `python -m labkit doctor`, in the same process: runpy is what -m runs
        "import runpy, sys\n"
        "sys.argv = ['labkit', 'doctor']\n"
        "try:\n"
        "    runpy.run_module('labkit', run_name='__main__', alter_sys=True)\n"
        "except SystemExit as exit_:\n"
        "    assert not exit_.code, exit_.code\n"
    )
    # From a folder outside the repository, and without this run's PYTHONPATH,
    # so that no other labkit can be imported.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([str(python), "-c", check], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    expected = {p.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
                for p in _source_files() if p.endswith(".py")} - {"labkit"}
    names, _, doctor = run.stdout.partition("\n")
    assert set(names.split()) == expected
    assert "torch" in doctor
