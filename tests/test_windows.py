"""The ranks as a Windows learner's machine starts them, faked on Linux in every
process (tests/windows_fakes/sitecustomize.py, on PYTHONPATH): torch without
libuv, Windows' interface names, psutil refusing SIGINT, no os.fork, no SIGUSR1,
a cp932 standard output, no bash.

Each fake is shown to break what labkit did before (the old call, run under it;
cp932 and no bash in tests/test_output_encoding.py, with a Windows path for
nbgrader's config, which no process meets), and with all of them at once lessons
03 and 10 run whole. sys.platform stays
"linux": the standard library chooses its Windows code by it at import, and the
rules labkit follows here depend on what the system does, not on its name.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import _add_tests_to_path, child_processes, leftovers

from labkit import cluster
from labkit.cluster import cpus, forkserver, ranks, rendezvous

ROOT = Path(__file__).resolve().parent.parent
FAKES = Path(__file__).resolve().parent / "windows_fakes"
ALL = ("libuv", "ifnames", "sigint", "fork", "sigusr1", "cp932", "nobash")
NO_LIBUV = "use_libuv was requested but PyTorch was built without libuv support"


def windows_env(*fakes: str) -> dict[str, str]:
    """This process's environment with the fakes' folder first on PYTHONPATH."""
    path = [str(FAKES), str(ROOT / "tools"), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, LABKIT_FAKE_WINDOWS=",".join(fakes),
                PYTHONPATH=os.pathsep.join(filter(None, path)))


def python(code: str, *fakes: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          env=windows_env(*fakes), capture_output=True, text=True,
                          timeout=250)


# --- the CPUs the ranks' threads are shared out from --------------------------


def _cgroups(tmp_path: Path, me: str, files: dict[str, str]) -> tuple[str, str]:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "self").write_text(me)
    return str(tmp_path), str(tmp_path / "self")


@pytest.mark.parametrize(("me", "files", "expected"), [
    ("0::/\n", {}, 8),  # no quota file: the affinity
    ("0::/\n", {"cpu.max": "max 100000\n"}, 8),  # no quota
    ("0::/\n", {"cpu.max": "200000 100000\n"}, 2),  # a JupyterHub limit of 2
    ("0::/\n", {"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: rounded up
    ("0::/\n", {"cpu.max": "1000 100000\n"}, 1),  # never 0
    ("0::/hub/user\n", {"hub/user/cpu.max": "max 100000",
                        "hub/cpu.max": "300000 100000"}, 3),  # a parent's quota
    ("0::/hub/user\n", {"hub/user/cpu.max": "400000 100000",
                        "cpu.max": "100000 100000"}, 1),  # the smallest counts
    ("4:cpu,cpuacct:/\n0::/\n", {"cpu,cpuacct/cpu.cfs_quota_us": "300000",
                                 "cpu,cpuacct/cpu.cfs_period_us": "100000"}, 3),
    ("4:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1",
                   "cpu/cpu.cfs_period_us": "100000"}, 8),  # v1, no quota
    ("0::/\n", {"cpu.max": "garbage"}, 8),  # unreadable: no quota
])
def test_usable_cpus_takes_the_cgroup_quota_under_the_affinity(
        monkeypatch, tmp_path, me, files, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert cpus.usable_cpus(*_cgroups(tmp_path, me, files)) == expected


def test_usable_cpus_where_there_is_no_affinity_nor_cgroup(monkeypatch, tmp_path):
    """macOS and Windows: os.cpu_count()."""
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert cpus.usable_cpus(str(tmp_path), str(tmp_path / "missing")) == 6
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert cpus.usable_cpus(str(tmp_path), str(tmp_path / "missing")) == 3


def test_the_ranks_threads_come_from_the_usable_cpus(monkeypatch):
    """Not marked procs: start is stopped before it starts anything."""
    monkeypatch.setattr(ranks, "usable_cpus", lambda: 3)

    class Started(Exception):
        pass

    def launch(self):
        raise Started(self.threads_per_rank)

    monkeypatch.setattr(ranks.Ranks, "_launch", launch)
    monkeypatch.setattr(ranks.notebook, "install_hooks", lambda current: None)
    with pytest.raises(Started, match="^1$"):
        cluster.start(2, activate=False)  # 3 // 2
    with pytest.raises(Started, match="^3$"):
        cluster.start(1, activate=False)


# --- the interface gloo binds to ----------------------------------------------


def test_loopback_is_found_by_its_address_under_windows_names(monkeypatch):
    """psutil names Windows' interfaces as libuv does (the friendly name), which is
    what gloo's transport there matches GLOO_SOCKET_IFNAME against."""
    import socket
    from types import SimpleNamespace

    import psutil

    def addr(ip):
        return SimpleNamespace(family=socket.AF_INET, address=ip)

    monkeypatch.setattr(psutil, "net_if_addrs", lambda: {
        "Ethernet": [addr("192.168.1.20")],
        "Loopback Pseudo-Interface 1": [addr("127.0.0.1")]})
    assert rendezvous.loopback_interface() == "Loopback Pseudo-Interface 1"


# --- a hung rank's stacks without SIGUSR1 ------------------------------------


@pytest.mark.parametrize(("code", "shown"), [
    (0, "Thread 0x1 (idle): \"MainThread\"\n    all_reduce"),
    (127, "(no stacks: this system has no SIGUSR1"),  # py-spy missing or refused
])
def test_without_sigusr1_a_report_reads_the_stacks_with_py_spy(monkeypatch, code,
                                                                shown):
    """Not marked procs: py-spy's run is faked."""
    from labkit.cluster import stalls

    monkeypatch.setattr(stalls, "_dump_signal", lambda: None)
    monkeypatch.setattr(stalls, "py_spy_dump", lambda pid: subprocess.CompletedProcess(
        ["py-spy"], code, shown if code == 0 else "", "py-spy is not installed"))
    report = stalls.stacks_report({"rank 0": os.getpid()})
    assert report.startswith(f"=== rank 0 (pid {os.getpid()}, ")
    assert shown in report


# --- a torch without libuv -----------------------------------------------------


def test_stores_ask_for_libuv_only_where_torch_has_it(monkeypatch):
    """In this process: dist.TCPStore replaced by one that refuses libuv."""
    real = dist.TCPStore

    class NoLibuv(real):
        def __init__(self, *args, use_libuv=True, **kwargs):
            if use_libuv:
                raise dist.DistStoreError(NO_LIBUV)
            super().__init__(*args, use_libuv=False, **kwargs)

    monkeypatch.setattr(dist, "TCPStore", NoLibuv)
    monkeypatch.setattr(rendezvous, "_libuv", None)
    with pytest.raises(dist.DistStoreError, match=NO_LIBUV):  # labkit's old call
        dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert not rendezvous.libuv_available()
    store = rendezvous.local_store(5)
    client = rendezvous.tcp_store("127.0.0.1", store.port, is_master=False)
    client.set("k", "v")
    assert store.get("k") == b"v"
    monkeypatch.setattr(rendezvous, "_libuv", None)
    monkeypatch.setattr(dist, "TCPStore", real)
    assert rendezvous.libuv_available()  # this Linux torch has it


# --- each fake in every process: the old code fails, labkit's works ------------


@pytest.mark.procs
def test_store_and_interface_fakes_break_the_old_calls_and_not_labkit_s():
    """One process with both fakes: the calls labkit made before fail as torch
    fails on Windows; a one-rank group joins through labkit's."""
    run = python("""
        import os, socket, torch, torch.distributed as dist
        from labkit.cluster import rendezvous

        # before: dist.TCPStore(...) without use_libuv
        try:
            dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        except dist.DistStoreError as err:
            print("old store:", err)
        # before: "lo" or "lo0" from socket.if_nameindex(), else the first name
        names = [name for _, name in socket.if_nameindex()]
        os.environ["GLOO_SOCKET_IFNAME"] = names[0]
        try:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0,
                                    world_size=1)
        except RuntimeError as err:
            print("old interface:", str(err).splitlines()[0])
        del os.environ["GLOO_SOCKET_IFNAME"]

        store = rendezvous.local_store(10)
        rendezvous.init_rank(0, 1, "gloo", store.port, "w", timeout_s=10)
        t = torch.ones(2)
        dist.all_reduce(t)
        print("labkit:", os.environ["GLOO_SOCKET_IFNAME"], t.tolist())
        """, "libuv", "ifnames")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"old store: {NO_LIBUV}" in run.stdout
    assert "Unable to find address for: loopback_0" in run.stdout
    assert "labkit: lo [1.0, 1.0]" in run.stdout


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_the_command_line_s_launcher_runs_without_libuv():
    """torch's elastic agent, as `python -m labkit nosync` starts it, meets its
    workers on labkit's store, not on a TCPStore of torch's own."""
    run = subprocess.run(
        [sys.executable, "-m", "labkit", "nosync", "--world-size", "2", "--steps",
         "1", "--hidden", "8"], cwd=ROOT, env=windows_env("libuv", "ifnames"),
        capture_output=True, text=True, timeout=270)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "allreduce_calls_per_step_nosync: 1" in run.stdout


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_a_hung_rank_where_sigint_is_refused_is_named_and_replaced(monkeypatch):
    """psutil refuses SIGINT in the engines' nannies (as on Windows): the hung
    rank is named, the learner told why it was not interrupted, and the next
    call gets fresh ranks."""
    from ddp_rank_checks import hang_on_rank_1

    for name, value in windows_env("sigint").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(forkserver.VARIABLE, "0")  # the nannies must import the fake
    monkeypatch.setattr(ranks, "_said_why", False)
    before = {p.pid for p in child_processes()}
    group = cluster.start(2, timeout_s=3, task_timeout_s=5, activate=False)
    try:
        _add_tests_to_path(group)
        pids = group.run(os.getpid)
        with pytest.raises(cluster.RankError) as err:
            group.run(hang_on_rank_1)
        said = err.value.failures[1]
        assert "rank 1 did not finish within 5 s (hung?) and could not be " \
               "interrupted" in said, said
        assert "only SIGTERM, CTRL_C_EVENT and CTRL_BREAK_EVENT" in said, said
        assert group.damage == "restart"
        assert group.run(abs, -2) == [2, 2]
        assert set(group.run(os.getpid)).isdisjoint(pids)  # fresh ranks
    finally:
        group.stop()
    assert leftovers(before) == set()


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_torchrun_nodes_run_without_libuv():
    """torchrun's own stores (its rendezvous, the one its agent shares) and its
    workers' stores stay off libuv where torch lacks it."""
    run = python("""
        from labkit.cluster import torchrun
        runs = torchrun.run_nodes(["-m", "labkit", "nosync", "--steps", "1",
                                   "--hidden", "8"], nnodes=1, nproc_per_node=2,
                                  timeout_s=200)
        print("returncodes", [r.returncode for r in runs])
        print(runs[0].output[-3000:])
        """, "libuv")
    assert "returncodes [0]" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]


# --- everything at once: the lessons ------------------------------------------


@pytest.mark.procs
@pytest.mark.timeout(900)
def test_lessons_03_and_10_run_whole_as_on_windows(tmp_path):
    """Every cell of the English lessons 03, 10 and 11_uneven_and_restarts (ranks, a
    hang and its stacks, torchrun's restart) with every fake in every process, as
    make test runs them."""
    import executed
    import nbformat

    lessons = [ROOT / "notebooks" / "en" / name
               for name in ("03_ddp.ipynb", "10_troubleshooting.ipynb",
                            "11_uneven_and_restarts.ipynb")]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *executed.nbval_args(tmp_path),
         *map(str, lessons)],
        cwd=ROOT, env=windows_env(*ALL), capture_output=True, encoding="cp932",
        errors="replace", timeout=870)  # what the cp932 fake writes
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    said = ""
    for lesson in lessons:
        ran = nbformat.read(executed.copy_of(lesson, tmp_path), as_version=4)
        said += "".join(out.get("text", "") for cell in ran.cells
                        for out in cell.get("outputs", ()))
    assert "has no os.fork" in said  # the fakes reached the kernel
