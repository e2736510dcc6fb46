"""The lock (constraints.txt): every package the course installs, at one version.

tools/course.py's set-up installs torch first (its own pin), then the course with
`pip install -c constraints.txt`. These tests check that the lock agrees with
pyproject.toml's ranges, that it pins every package the course's requirements
reach on Linux, macOS and Windows (as far as this machine's installed packages
tell: a package installed only elsewhere, such as pywinpty on Windows, is checked
as a name, its own requirements unread), that the set-up installs through it, and
that this environment is the lock's.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import course
import labkit

tomllib = pytest.importorskip("tomllib", reason="needs Python 3.11+ (tomllib)")

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# The three systems learners bring, as their markers read (Python 3.11, the
# course's); a package for one of them is pinned with its marker.
SYSTEMS = {
    "linux": {"sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
              "platform_machine": "x86_64"},
    "macos": {"sys_platform": "darwin", "platform_system": "Darwin",
              "os_name": "posix", "platform_machine": "arm64"},
    "windows": {"sys_platform": "win32", "platform_system": "Windows", "os_name": "nt",
                "platform_machine": "AMD64"},
}
PY311 = {"python_version": "3.11", "python_full_version": "3.11.7",
         "implementation_name": "cpython", "implementation_version": "3.11.7",
         "platform_python_implementation": "CPython", "platform_release": "",
         "platform_version": ""}


def read_lock(text: str) -> list[Requirement]:
    """The lock's entries (comments and blank lines left out)."""
    return [Requirement(line) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def pyproject_requirements(project: dict = PYPROJECT) -> list[Requirement]:
    """pyproject's dependencies and every extra's, less labkit's own extras."""
    lines = [*project["dependencies"],
             *(line for extra in project["optional-dependencies"].values()
               for line in extra)]
    return [req for line in lines if (req := Requirement(line)).name != "labkit"]


def lock_problems(lock: list[Requirement], required: list[Requirement]) -> list[str]:
    """Where the lock and pyproject's ranges disagree: a pin that is not exact, a
    package pyproject names that the lock leaves out, a pin outside its range, a
    package torch's build owns pinned all the same."""
    problems = [f"{req}: not an exact pin" for req in lock if len(req.specifier) != 1
                or next(iter(req.specifier)).operator != "=="]
    pins: dict[str, list[str]] = {}
    for req in lock:
        pins.setdefault(canonicalize_name(req.name), []).append(
            next(iter(req.specifier)).version)
    problems += [f"{name}: pinned, but torch's build pins it" for name in pins
                 if course.owned_by_torch(name)]
    for req in required:
        name = canonicalize_name(req.name)
        if course.owned_by_torch(name):
            continue
        if name not in pins:
            problems.append(f"{req}: not in the lock")
        problems += [f"{name}=={version}: outside {req}"
                     for version in pins.get(name, [])
                     if not req.specifier.contains(version, prereleases=True)]
    return problems


def unpinned(lock: list[Requirement], roots: list[Requirement], requires,
             system: dict[str, str]) -> list[str]:
    """The packages that `roots` reach on `system` (markers read with its values)
    and that no pin of the lock covers there, each with the package that needs it.
    `requires(name)`: that package's requirements, or None where it is not
    installed here (its own are then unread)."""
    def holds(marker: Marker | None, extra: str = "") -> bool:
        return marker is None or marker.evaluate({**PY311, **system, "extra": extra})

    pinned = {canonicalize_name(req.name) for req in lock if holds(req.marker)}
    missing, seen = [], set()
    todo = [(req, "pyproject.toml") for req in roots if holds(req.marker)]
    while todo:
        req, needed_by = todo.pop()
        name = canonicalize_name(req.name)
        if (name, frozenset(req.extras)) in seen:
            continue
        seen.add((name, frozenset(req.extras)))
        # labkit is the course itself, installed from this folder
        if name != "labkit" and not course.owned_by_torch(name) and name not in pinned:
            missing.append(f"{name} (for {needed_by})")
        for dep in requires(name) or []:
            if any(holds(dep.marker, extra) for extra in ["", *req.extras]):
                todo.append((dep, name))
    return sorted(set(missing))


def installed_requires(name: str) -> list[Requirement] | None:
    try:
        return [Requirement(line) for line in metadata.requires(name) or []]
    except metadata.PackageNotFoundError:
        return None


LOCK = read_lock(course.LOCK.read_text())


def test_the_lock_agrees_with_pyproject_s_ranges():
    assert lock_problems(LOCK, pyproject_requirements()) == []


def test_a_pin_outside_its_range_or_missing_or_loose_is_named():
    required = [Requirement("ipyparallel==9.2.*"), Requirement("nbgrader>=0.9"),
                Requirement("torch>=2.4")]
    good = read_lock("ipyparallel==9.2.0\n    # via labkit\nnbgrader==0.9.6\n")
    assert lock_problems(good, required) == []
    assert lock_problems(read_lock("ipyparallel==9.3.0\nnbgrader==0.9.6\n"),
                         required) == ["ipyparallel==9.3.0: outside ipyparallel==9.2.*"]
    assert lock_problems(read_lock("ipyparallel==9.2.0\n"), required) == [
        "nbgrader>=0.9: not in the lock"]
    loose = read_lock("ipyparallel>=9.2\nnbgrader==0.9.6\n")
    assert lock_problems(loose, required)[0] == "ipyparallel>=9.2: not an exact pin"
    assert lock_problems(read_lock("ipyparallel==9.2.0\nnbgrader==0.9.6\n"
                                   "torch==2.13.0\nnvidia-nccl-cu13==2.29.7\n"),
                         required) == [
        "torch: pinned, but torch's build pins it",
        "nvidia-nccl-cu13: pinned, but torch's build pins it"]


def test_ipyparallel_is_held_to_the_release_whose_code_the_fork_server_copies():
    (req,) = [r for r in pyproject_requirements() if r.name == "ipyparallel"]
    assert req.specifier.contains(metadata.version("ipyparallel"))
    # the next release, minor or major, must pass tests/test_forkserver.py first
    assert not req.specifier.contains("9.3.0") and not req.specifier.contains("10.0")


@pytest.mark.parametrize("system", SYSTEMS)
def test_the_lock_pins_every_package_the_course_installs(system):
    roots = [Requirement(f"labkit[{','.join(PYPROJECT['optional-dependencies'])}]")]
    assert unpinned(LOCK, roots, installed_requires, SYSTEMS[system]) == []


def test_a_package_only_one_system_needs_must_be_pinned_for_it():
    # ipykernel needs appnope on macOS only: a lock without it fails there alone
    fake = {"labkit": [Requirement("ipykernel")],
            "ipykernel": [Requirement("appnope>=0.1.2; platform_system == 'Darwin'"),
                          Requirement("pytest; extra == 'test'")],
            "torch": [Requirement("sympy")]}
    roots = [Requirement("labkit"), Requirement("torch")]
    lock = read_lock("ipykernel==7.4.0\nsympy==1.14.0\n")
    assert unpinned(lock, roots, fake.get, SYSTEMS["linux"]) == []
    assert unpinned(lock, roots, fake.get, SYSTEMS["macos"]) == [
        "appnope (for ipykernel)"]
    # a pin for another system does not count
    mac_only = read_lock("ipykernel==7.4.0\nsympy==1.14.0\n"
                         "appnope==1.0.0 ; sys_platform == 'win32'\n")
    assert unpinned(mac_only, roots, fake.get, SYSTEMS["macos"]) == [
        "appnope (for ipykernel)"]
    # torch is its build's, what it needs is the lock's
    assert unpinned(read_lock("ipykernel==7.4.0\n"), roots, fake.get,
                    SYSTEMS["linux"]) == ["sympy (for torch)"]


def test_the_platform_only_packages_carry_their_system_s_marker():
    """What the lock pins for one system only (today appnope for macOS, colorama
    and pywinpty for Windows; pywin32, which jupyter_core once needed, is no longer
    required by anything): each with a marker, so that pip skips it elsewhere."""
    by_name = {canonicalize_name(req.name): req for req in LOCK}
    for name, system in (("appnope", "macos"), ("pywinpty", "windows"),
                         ("colorama", "windows")):
        marker = by_name[name].marker
        assert marker is not None, name
        assert {s for s, values in SYSTEMS.items()
                if marker.evaluate({**PY311, **values})} == {system}, name


def test_this_environment_is_the_lock_s():
    """Every package installed here that the lock pins for this system is at its
    pinned version: the set-up installed the lock (a .venv set up before the lock
    changed is set up again by the next step of tools/course.py)."""
    differ = []
    for req in LOCK:
        if req.marker is not None and not req.marker.evaluate():
            continue  # markers read this process's own system and Python
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            continue  # an extra not installed here (ecosystem: its own venv)
        if not req.specifier.contains(have, prereleases=True):
            differ.append(f"{req.name}: {have} installed, the lock pins "
                          f"{req.specifier}")
    assert differ == [], f"{sys.prefix} differs from {course.LOCK.name}"


def test_the_set_up_installs_torch_alone_then_everything_through_the_lock(tmp_path):
    plan = course.Course(tmp_path / "venv", dry_run=True)
    plan.grading()
    plan.ecosystem_venv()
    installs = [[part for part in cmd[cmd.index("install") + 1:] if part != "--quiet"]
                for cmd in plan.ran if "install" in cmd]
    assert installs[0] == [course.TORCH]  # the checked torch, first and alone
    assert course.TORCH == f"torch=={labkit.CHECKED_TORCH}"
    assert [cmd[:2] for cmd in installs[1:]] == [["-c", str(course.LOCK)]] * 3
    assert [cmd[2:] for cmd in installs[1:]] == [
        ["-e", ".[dev]"], ["-e", ".[grading]"], ["-e", ".[ecosystem]"]]
    # another torch, as the same first step
    other = course.Course(tmp_path / "venv",
                          f"torch==2.14.1 --index-url {course.CPU_INDEX}", dry_run=True)
    other.setup()
    assert other.ran[1][-3:] == ["torch==2.14.1", "--index-url", course.CPU_INDEX]


def test_the_lock_is_made_for_pyproject_s_oldest_python():
    assert PYPROJECT["requires-python"] == f">={course.PYTHON_FLOOR}"


def test_drop_packages_leaves_torch_s_build_to_torch():
    compiled = ("# header\n#    python tools/course.py lock\n"
                "nvidia-nccl-cu13==2.29.7 ; sys_platform == 'linux'\n    # via torch\n"
                "sympy==1.14.0\n    # via torch\n"
                "torch==2.13.0\n    # via\n    #   labkit\n    #   accelerate\n"
                "triton==3.7.1 ; sys_platform == 'linux'\n    # via torch\n"
                "zipp==4.1.2\n    # via importlib-metadata\n\n"
                "# The following packages were excluded from the output:\n")
    kept = course.drop_packages(compiled, course.TORCH_BUILD_PACKAGES)
    assert [r.name for r in read_lock(kept)] == ["sympy", "zipp"]
    assert "    # via importlib-metadata\n" in kept and "labkit" not in kept
    assert kept.startswith("# header\n") and "were excluded" in kept
