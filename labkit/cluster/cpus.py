"""The CPUs this process may use: what the ranks' threads are shared out from.

On a shared server (a JupyterHub, a container) a process is often given fewer
CPUs than the machine has, by its CPU affinity or by its cgroup's CPU quota;
os.cpu_count() counts the machine's.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from .. import i18n

__all__ = ["usable_cpus"]

i18n.register({
    # labkit doctor's line
    "usable_cpus": {
        "ja": "使える CPU (cgroup の上限など)",
        "en": "CPUs usable (cgroup quota, affinity)",
    },
})


def usable_cpus(cgroup: str = "/sys/fs/cgroup", me: str = "/proc/self/cgroup") -> int:
    """The CPUs this process may really use, which on a shared server (a
    JupyterHub, a container) are fewer than the machine's.

    Its CPU affinity where the system has one (Linux), capped by the CPU quota
    of its cgroup (`me` names it) and of the cgroups above it, rounded up;
    os.cpu_count() where there is neither (macOS, Windows).
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    quotas = [q for q in map(_quota, _cgroup_files(Path(cgroup), Path(me))) if q]
    return max(1, min([cpus, *quotas]))


def _cgroup_files(root: Path, me: Path) -> list[tuple[Path, Path | None]]:
    """The quota files that bound this process: (cpu.max, None) for cgroup v2,
    from its own cgroup up to the root; (quota, period) for cgroup v1."""
    try:
        lines = me.read_text().splitlines()
    except OSError:  # not Linux
        return []
    found = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            folder = root / path.strip().lstrip("/")
            while True:
                found.append((folder / "cpu.max", None))
                if folder == root or root not in folder.parents:
                    break
                folder = folder.parent
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own
            for mount in ("cpu", "cpu,cpuacct"):
                folder = root / mount / path.strip().lstrip("/")
                found.append((folder / "cpu.cfs_quota_us",
                              folder / "cpu.cfs_period_us"))
    return found


def _quota(files: tuple[Path, Path | None]) -> int | None:
    """The CPUs one quota file allows, rounded up; None: no quota (or no file)."""
    quota_file, period_file = files
    try:
        words = quota_file.read_text().split()
        if period_file is not None:
            words.append(period_file.read_text().strip())
        quota, period = words[0], int(words[1])
    except (OSError, IndexError, ValueError):
        return None
    if quota in ("max", "-1") or period <= 0:
        return None
    return max(1, math.ceil(int(quota) / period))
