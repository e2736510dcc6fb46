"""Local launches listen on 127.0.0.1 only, never on every interface."""

import os
import signal
import socket
import threading

import psutil
import pytest
from ddp_rank_checks import my_rank_once_seen

from labkit.cluster import launch

pytestmark = pytest.mark.procs  # every test here starts processes

LOOPBACK = {"127.0.0.1", "::1"}


def _listening(processes):
    found = set()
    for proc in processes:
        try:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found.add((proc.pid, conn.laddr.ip, conn.laddr.port))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def _ours():
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def test_headless_launch_listens_on_loopback_only_and_gives_results_in_rank_order(
        tmp_path):
    """One launch for what a headless run must do: refuse a taken port before
    starting anything, listen on loopback only (looked at while the ranks wait
    for it), give the results in rank order, and give back the SIGINT handler."""
    before = signal.getsignal(signal.SIGINT)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {port} on 127.0.0.1 is already"):
            launch.run(my_rank_once_seen, {"seen_flag": ""}, world_size=2, port=port)
    flag = tmp_path / "seen"
    seen, done = set(), threading.Event()

    def look():
        while not done.is_set():
            seen.update(_listening(_ours()))
            if len({pid for pid, _, _ in seen} - {os.getpid()}) >= 2:
                flag.touch()  # both ranks' sockets seen: they may finish
            done.wait(0.1)

    looker = threading.Thread(target=look)
    looker.start()
    try:
        # The next launch, on a free port, works.
        results = launch.run(my_rank_once_seen, {"seen_flag": str(flag)}, world_size=2)
    finally:
        done.set()
        looker.join()
    assert results == [(0, 2, "gloo"), (1, 2, "gloo")]
    # torch's agent installs its own SIGINT handler; Ctrl-C must be a
    # KeyboardInterrupt again afterwards (a notebook kernel, a test process).
    assert signal.getsignal(signal.SIGINT) is before
    assert flag.exists(), f"saw no rank listening: {seen}"
    assert {ip for _, ip, _ in seen} <= LOOPBACK, seen


def test_engines_listen_on_loopback_only(ranks):
    """The shared ranks are started as a notebook starts them (cluster.start)."""
    seen = _listening(_ours())
    assert len({pid for pid, _, _ in seen} - {os.getpid()}) >= 2  # more than ours
    assert {ip for _, ip, _ in seen} <= LOOPBACK, seen
