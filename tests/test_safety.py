"""Local launches listen on 127.0.0.1 only, never on every interface."""

import threading
import time

import psutil
import pytest
from ddp_rank_checks import pause

from labkit import cluster
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


def test_headless_launch_listens_on_loopback_only():
    thread = threading.Thread(target=launch.run, args=(pause, {}, 2))
    thread.start()
    seen = set()
    deadline = time.monotonic() + 30
    while thread.is_alive() and time.monotonic() < deadline:
        seen |= _listening(_ours())
        time.sleep(0.2)
    thread.join()
    assert seen, "saw no listening socket at all: the check did not look"
    assert {ip for _, ip, _ in seen} <= LOOPBACK, seen


def test_engines_listen_on_loopback_only():
    group = cluster.start(2, timeout_s=10, activate=False)
    try:
        seen = _listening(_ours())
    finally:
        group.stop()
    assert seen
    assert {ip for _, ip, _ in seen} <= LOOPBACK, seen
