"""Starting ranks, failing ranks and bad arguments, in the notebook and headless."""

import json
import re
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist
from conftest import alive, child_processes, step_time_problems, two_rank_scripts

from labkit import cluster
from labkit.__main__ import main
from labkit.cluster import rendezvous, stalls, torchrun


def _fail_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 got a batch of the wrong shape")
    return "ok"


@pytest.mark.timeout(120)  # reported, not hung
def test_a_raising_rank_is_named_with_its_traceback(ranks):
    with pytest.raises(cluster.RankError, match="rank 1 raised") as err:
        ranks.run(_fail_on_rank_1)
    assert list(err.value.failures) == [1]
    assert "ValueError: rank 1 got a batch of the wrong shape" in err.value.failures[1]
    assert "Traceback" in err.value.failures[1]
    assert ranks.run(lambda: 1) == [1, 1]  # the group is still usable


def test_code_cells_report_their_rank(ranks):
    with pytest.raises(cluster.RankError) as err:
        ranks.execute("if rank == 0:\n    raise KeyError('missing on rank 0')")
    assert list(err.value.failures) == [0]
    assert "KeyError" in err.value.failures[0]


def test_each_engine_knows_its_rank(ranks):
    assert ranks.pull("rank") == [0, 1]
    assert ranks.pull("world_size") == [2, 2]
    backends = ranks.run(lambda: __import__("torch").distributed.get_backend())
    assert backends == ["gloo", "gloo"]


def test_process_group_can_be_recreated(ranks):
    generation = ranks.generation
    ranks.reset_process_group()
    assert ranks.generation == generation + 1
    assert ranks.run(lambda: __import__("torch").distributed.get_world_size()) == [2, 2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be >= 1"),
        ({"world_size": 1000}, "more than 64 ranks"),
        ({"world_size": 2, "backend": "mpi"}, "unknown backend 'mpi'"),
        ({"world_size": 2, "timeout_s": 0}, "timeout_s must be > 0"),
        ({"world_size": 2, "port": 70000}, "port must be 0 .* got 70000"),
    ],
)
def test_bad_arguments_fail_before_any_engine_starts(kwargs, message):
    before = len(child_processes())
    with pytest.raises(ValueError, match=message):
        cluster.start(**kwargs)
    assert len(child_processes()) == before


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="machine has GPUs")
def test_nccl_without_gpus_is_refused():
    with pytest.raises(ValueError, match="nccl' needs CUDA GPUs"):
        rendezvous.check_args(2, "nccl")


@pytest.mark.parametrize("gpus", [0, 4])
def test_nccl_for_the_engines_is_refused_with_what_to_run(fake_gpus, gpus):
    fake_gpus(gpus)
    before = len(child_processes())
    with pytest.raises(ValueError, match=r"(?s)tensors on the CPU.*torchrun .*nccl"):
        cluster.start(2, backend="nccl")
    assert len(child_processes()) == before


@pytest.mark.procs
def test_engines_use_gloo_with_gpus_a_rerun_keeps_its_port_and_stop_leaves_nothing(
        fake_gpus):
    fake_gpus(4)  # this kernel sees 4 GPUs; the cells' tensors would still be on CPU
    before = {p.pid for p in child_processes()}
    port = torchrun.free_port()
    group = cluster.start(1, timeout_s=10, activate=False, port=port)
    try:
        assert group.backend == cluster.ENGINE_BACKEND == "gloo"
        device = group.pull("device")
        assert (group.run(dist.get_backend), device) == (["gloo"], ["cpu"])
        assert len({p.pid for p in child_processes()} - before) >= 2  # ctrl., engine
        # The cell run again: the port its running group holds is not "taken".
        group = cluster.start(1, timeout_s=10, activate=False, port=port)
        assert group.store.port == port
        assert group.run(abs, -7) == [7]
    finally:
        group.stop()
    assert _settles(before)


# A headless run's results in rank order, its taken-port check and the SIGINT
# handler it gives back: test_safety.py's one launch, which also looks at its
# sockets.


# A failing rank of a headless run, named with its traceback and leaving no
# process: test_cli_faults_name_the_rank[raise], the same launch.run, through
# the command line that prints its ChildFailedError.


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["nosync", "--world-size", "0"], "world_size must be >= 1, got 0"),
        (["nosync", "--accum", "0"], "accum_steps must be >= 1, got 0"),
        (["misuse", "--backend", "mpi"], "unknown backend 'mpi'"),
        (["nosync", "--steps", "0"], "steps must be >= 1"),
        (["nosync", "--accum", "x"], "argument --accum: invalid int value"),
        (["nosync", "--port", "-1"], "or 1-65535, got -1"),
    ],
)
def test_cli_bad_arguments_are_one_line(argv, message, capsys):
    before = len(child_processes())
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert len(child_processes()) == before


@pytest.mark.procs
def test_cli_nccl_without_gpus_is_one_line_in_a_real_process():
    result = subprocess.run(
        [sys.executable, "-m", "labkit", "nosync", "--backend", "nccl"],
        capture_output=True, text=True)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if "Warning" not in line]
    assert len(lines) == 1 and "nccl" in lines[0]


def _json_of(cmd, tmp_path):
    out = tmp_path / "result.json"
    subprocess.run(cmd + ["--json", str(out)], check=True, capture_output=True)
    return json.loads(out.read_text())


@pytest.mark.procs
def test_cli_nosync_writes_its_figures(tmp_path):
    started = time.monotonic()
    result = _json_of([sys.executable, "-m", "labkit", "nosync", "--world-size", "2",
                       "--accum", "4", "--steps", "3", "--repeat", "1"], tmp_path)
    took_s = time.monotonic() - started
    assert result["grad_max_abs_diff"] <= 1e-6
    assert result["replica_max_param_diff"] == 0.0
    assert result["allreduce_calls_per_step_sync"] == 4
    assert result["allreduce_calls_per_step_nosync"] == 1
    assert step_time_problems(result, accum_steps=4, repeat=1, within_s=took_s) == []


GOOD = {"step_s_sync": 0.02, "step_s_nosync": 0.01,
        "config": {"accum_steps": 4, "repeat": 1}}


@pytest.mark.parametrize(("changed", "problem"), [
    ({}, None),
    ({"step_s_sync": float("nan")}, "step_s_sync is nan"),
    ({"step_s_nosync": float("inf")}, "step_s_nosync is inf"),
    ({"step_s_sync": 0.0}, "step_s_sync is 0.0"),
    ({"step_s_nosync": -0.01}, "step_s_nosync is -0.01"),
    ({"step_s_sync": None}, "step_s_sync is None"),
    ({"step_s_sync": "0.02"}, "step_s_sync is '0.02'"),
    ({"config": {"accum_steps": 1, "repeat": 1}}, "accum_steps=1, asked 4"),
    ({"config": {"accum_steps": 4}}, "repeat=None, asked 1"),
    # milliseconds, or a whole run's total, read as one step's seconds
    ({"step_s_sync": 20.0}, "is not a part of the 5 s run"),
])
def test_step_times_problems_name_what_a_wrong_report_gets_wrong(changed, problem):
    problems = step_time_problems(GOOD | changed, accum_steps=4, repeat=1,
                                  within_s=5.0)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0], problems


@pytest.mark.procs
def test_cli_misuse_writes_its_figures(tmp_path):
    result = _json_of([sys.executable, "-m", "labkit", "misuse", "--steps", "4"],
                      tmp_path)
    assert result["bare_call_allreduce_calls"] == 4
    assert result["correct_allreduce_calls"] == 1
    assert result["diverged_max_param_diff"] > 1e-3


@pytest.mark.procs
def test_torchrun_runs_the_same_experiment(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
                "-m", "labkit", "nosync", "--accum", "2", "--steps", "2",
                "--repeat", "1"]
    result = _json_of(torchrun, tmp_path)
    assert result["world_size"] == 2
    assert result["allreduce_calls_per_step_sync"] == 2
    assert result["allreduce_calls_per_step_nosync"] == 1
    assert result["grad_max_abs_diff"] <= 1e-6


KERNEL = """
import json, sys, psutil
from labkit import cluster
ranks = cluster.start(2, activate=False)
children = psutil.Process().children(recursive=True)
print(json.dumps([p.pid for p in children]), flush=True)
sys.stdin.read()  # wait to be killed
"""


@pytest.mark.procs
def test_engines_end_when_their_kernel_is_killed():
    """A kernel killed with SIGKILL cannot stop its engines; they stop themselves."""
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(kernel.stdout.readline())
        assert len(pids) >= 3  # controller and two engines (and their helpers)
    finally:
        kernel.kill()
        kernel.wait()
    deadline = time.monotonic() + 30  # the engines look once every 0.5 s
    while time.monotonic() < deadline:
        running = [pid for pid in pids if alive(pid)]
        if not running:
            break
        time.sleep(0.2)
    assert running == []


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        # the traceback, not just an exit code
        ("raise", ["rank      : 1", "RuntimeError: fault injected on rank 1",
                   "Traceback", "in _inject"]),
        ("kill", ["rank      : 1", "SIGKILL"]),
        ("hang", ["Rank 1 failed to pass monitoredBarrier"]),
        # Stopped in the middle of the run: named, and rank 0's stacks shown.
        ("stop", ["StoppedRankError: rank 1 of labkit-", "was stopped",
                  "=== rank 0 of labkit-", "most recent call first"]),
    ],
)
@pytest.mark.procs
@pytest.mark.timeout(180)  # an error within the --timeout, not a hang
def test_cli_faults_name_the_rank(fault, expected):
    before = {p.pid for p in child_processes()}
    result = _cli("misuse", "--steps", "100000", "--fault", fault, "--timeout", "5")
    assert result.returncode == 1
    for text in expected:
        assert text in result.stderr, result.stderr[-2000:]
    assert {p.pid for p in child_processes()} - before == set()


def test_a_taken_port_is_named_before_any_engine_starts():
    import socket

    running = cluster.current()
    before = len(child_processes())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {port} on 127.0.0.1 is already"):
            cluster.start(2, port=port, activate=False)
    # Nothing started, and a running group left as it was.
    assert len(child_processes()) == before
    assert cluster.current() is running
    # The launcher's check, and the next launch on a free port:
    # test_safety.py's headless launch.


@pytest.mark.procs
def test_cli_a_taken_port_is_a_one_line_error():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _cli("nosync", "--port", str(port))
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if "Warning" not in line]
    assert len(lines) == 1 and f"port {port}" in lines[0]


# A KeyboardInterrupt raised inside a weakref callback, as Ctrl-C can be while a
# rank imports (the import system's module locks): Python can only report it.
_UNRAISABLE_CTRL_C = """
import sys, time, weakref
from labkit.cluster import launch
if sys.argv[1] == "hooked":
    launch._catch_swallowed_ctrl_c()
class Lock: pass
def cb(_): raise KeyboardInterrupt
lock = Lock()
ref = weakref.ref(lock, cb)
try:
    del lock  # the callback runs here; its KeyboardInterrupt is unraisable
    time.sleep(5)
    print("ran on")
except KeyboardInterrupt:
    print("stopped")
"""


@pytest.mark.procs
@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT is POSIX's")
@pytest.mark.parametrize(("hook", "out", "reported"),
                         [("hooked", "stopped", False), ("plain", "ran on", True)])
def test_a_ctrl_c_a_callback_swallowed_stops_a_rank_quietly(hook, out, reported):
    result = subprocess.run([sys.executable, "-c", _UNRAISABLE_CTRL_C, hook],
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == out
    assert ("Exception ignored" in result.stderr) == reported, result.stderr


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_ctrl_c_stops_a_headless_run_and_its_ranks():
    import psutil

    proc = subprocess.Popen([sys.executable, "-m", "labkit", "misuse", "--steps",
                             "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        # Wait until both ranks run labkit's code, not a time: a worker still
        # being spawned (importing torch, seconds under load) prints
        # multiprocessing's own traceback when interrupted; torch's worker
        # wrapper takes Ctrl-C quietly only once it runs.
        ranks = []
        while len(ranks) < 2 and proc.poll() is None:
            time.sleep(0.2)
            ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                     if stalls.dump_file(p.pid) is not None]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert "ranks stopped" in err and "Traceback" not in err
    for rank in ranks:  # gone, not left behind
        try:
            rank.wait(timeout=30)
        except psutil.TimeoutExpired:
            pytest.fail(f"rank process {rank.pid} still running after Ctrl-C")


@pytest.mark.procs
def test_background_start_returns_before_the_ranks_are_up():
    before = {p.pid for p in child_processes()}
    group = cluster.start(2, background=True, activate=False)
    try:
        assert not group.ready  # engines take seconds; the call did not wait
        assert group.run(abs, -4) == [4, 4]  # the first use waits
        assert group.ready
    finally:
        group.stop()
    assert {p.pid for p in child_processes()} - before == set() or _settles(before)


@pytest.mark.procs
def test_stop_during_a_background_start_leaves_nothing():
    before = {p.pid for p in child_processes()}
    group = cluster.start(2, background=True, activate=False)
    group.stop()
    assert _settles(before)
    with pytest.raises(RuntimeError, match="stopped"):
        group.run(abs, -1)


def _settles(before, seconds=10):
    deadline = time.monotonic() + seconds
    while {p.pid for p in child_processes()} - before and time.monotonic() < deadline:
        time.sleep(0.1)
    return {p.pid for p in child_processes()} - before == set()


_LATE_RANK = """
import sys, time
import torch, torch.distributed as dist
from labkit.cluster import rendezvous
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=False)
if rank == 0:
    store.set("late/rank 0 joining", "1")
else:  # still importing, on a busy machine: later than the 2 s, and not lost
    store.wait(["late/rank 0 joining"])
    time.sleep(2.5)
t0 = time.perf_counter()
rendezvous.init_rank(rank, 2, "gloo", port, "late", timeout_s=2)
print(f"joined after {time.perf_counter() - t0:.1f} s", flush=True)
if rank == 0:  # a collective rank 1 never joins: the 2 s timeout, not the join's
    t0 = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError as err:
        print(f"timed out after {time.perf_counter() - t0:.1f} s: {err}", flush=True)
    store.set("late/rank 0 done", "1")
else:  # alive until then: rank 0 waits on a live peer, not a closed one
    store.wait(["late/rank 0 done"])
"""


@pytest.mark.procs
def test_a_late_rank_joins_and_collectives_keep_their_short_timeout():
    out = [r.stdout for r in two_rank_scripts(_LATE_RANK)]
    assert all("joined" in o for o in out), out
    # rank 0 waited for the late one longer than a collective may
    waited = re.search(r"joined after ([\d.]+) s", out[0])
    assert waited and float(waited.group(1)) > 2, out[0]
    timed_out = re.search(r"timed out after ([\d.]+) s: .*Timed out waiting 2000ms",
                          out[0])
    assert timed_out, out[0]
    assert float(timed_out.group(1)) < 10  # the collective's 2 s, not the 60 s join
