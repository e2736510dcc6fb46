"""Lesson 10 run whole, and its claims that a cell could not show safely.

Those claims run in separate processes: plain gloo ends a rank's process when the
ranks' tensors differ in shape, and torch 2.13 crashes building a DDP model on
the CPU under TORCH_DISTRIBUTED_DEBUG=DETAIL (the lesson turns DETAIL off
before its DDP sections for that reason). Each has a control that runs the same
script without the fault and exits 0. The Flight Recorder's limits on gloo
(kept entries, the analyzer) are shown in one process.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import two_rank_scripts

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "notebooks" / "en" / "10_troubleshooting.ipynb"

_MISMATCH = """
import os, sys
import torch, torch.distributed as dist
from labkit.cluster import rendezvous
rank, port, numel = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rendezvous.init_rank(rank, 2, "gloo", port, "mismatch", timeout_s=10)
dist.all_reduce(torch.ones(numel + rank * int(sys.argv[4])))  # 4 values against 5
print("done", flush=True)
dist.destroy_process_group()
os._exit(0)  # as labkit's launcher does: gloo's threads can abort a plain exit
"""


def _two_ranks(extra: int) -> list[subprocess.CompletedProcess]:
    return two_rank_scripts(_MISMATCH, "4", str(extra))


@pytest.mark.procs
def test_plain_gloo_ends_a_rank_when_the_shapes_differ():
    ranks = _two_ranks(extra=1)
    killed = [r for r in ranks if r.returncode == -signal.SIGABRT]
    assert killed, [(r.returncode, r.stdout[-500:]) for r in ranks]
    assert "gloo::EnforceNotMet" in killed[0].stdout
    assert "done" not in killed[0].stdout  # it ended inside the all_reduce
    assert "Is there a distributed collective mismatch" in killed[0].stdout


@pytest.mark.procs
def test_the_same_all_reduce_with_equal_shapes_ends_well():
    ranks = _two_ranks(extra=0)
    assert [r.returncode for r in ranks] == [0, 0]
    assert all("done" in r.stdout for r in ranks)


_DDP = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
DDP(torch.nn.Linear(2, 2))
print("built", flush=True)
"""


def _build_ddp(debug: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISTRIBUTED_DEBUG"}
    if debug:
        env["TORCH_DISTRIBUTED_DEBUG"] = debug
    return subprocess.run([sys.executable, "-c", _DDP], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.procs
def test_ddp_on_the_cpu_crashes_under_detail_in_torch_2_13():
    crashed = _build_ddp("DETAIL")
    assert crashed.returncode == -signal.SIGSEGV, (crashed.returncode,
                                                  crashed.stderr[-500:])
    assert "built" not in crashed.stdout


@pytest.mark.procs
def test_ddp_on_the_cpu_builds_under_info_and_without_debug():
    for debug in ("INFO", None):
        built = _build_ddp(debug)
        assert built.returncode == 0 and "built" in built.stdout, built.stderr[-500:]


_FLIGHT_RECORDER = """
import json, os, pickle, subprocess, sys, tempfile
import torch, torch.distributed as dist
from torch._C import _distributed_c10d as c10d
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
for _ in range(2100):
    dist.all_reduce(torch.ones(1))
entries = json.loads(c10d._dump_fr_trace_json())["entries"]
seqs = [e["collective_seq_id"] for e in entries]
print("kept", len(entries), seqs[0], seqs[-1])
dump = pickle.loads(c10d._dump_fr_trace(includeStackTraces=False))
print("groups", sorted(dump["pg_config"]))

def analyze(dump):
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "rank_0"), "wb") as f:
        pickle.dump(dump, f)
    analyzer = "torch.distributed.flight_recorder.fr_trace"
    return subprocess.run([sys.executable, "-m", analyzer, folder],
                          capture_output=True, text=True)

as_recorded = analyze(dump)
last = as_recorded.stderr.strip().splitlines()[-1:]
print("as recorded", as_recorded.returncode, last)
dump["pg_config"] = {"0": dump["pg_config"][""]}  # the name the entries use
print("group named", analyze(dump).returncode)
"""


@pytest.mark.procs
def test_the_flight_recorder_keeps_2000_gloo_collectives_its_analyzer_cannot_read():
    """Lesson 10's Flight Recorder claims, in torch 2.13 with gloo: on without any
    setting, the last 2,000 collectives kept; the analyzer fails on the record
    because its group name is empty, and reads it once the group is named."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCH_FR_", "TORCH_NCCL_TRACE"))}
    run = subprocess.run([sys.executable, "-c", _FLIGHT_RECORDER], env=env,
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-1000:]
    lines = run.stdout.splitlines()
    assert "kept 2000 101 2100" in lines
    assert "groups ['']" in lines
    assert "as recorded 1 [\"KeyError: ('0', 0)\"]" in lines
    assert "group named 0" in lines


# What py-spy 0.4.3 prints where it may not read another process (measured here
# as the user `nobody` against a root process).
_REFUSING_PY_SPY = """#!/bin/sh
echo "Permission Denied: Try running again with elevated permissions by going \\
'sudo env \\"PATH=\\$PATH\\" !!'" >&2
exit 1
"""


_SPY_RANK = """
import os, sys
import torch, torch.distributed as dist
from labkit.cluster import rendezvous, stalls
rank, port, world_size = int(sys.argv[1]), int(sys.argv[2]), 2
rendezvous.init_rank(rank, world_size, "gloo", port, "spy", timeout_s=8)
stalls.enable_dumps(f"rank {rank}")  # as every engine of the lesson does
loss = torch.ones(1)
try:
    exec(sys.argv[3])
except Exception as err:
    print("raised:", type(err).__name__, flush=True)
    os._exit(3)  # as labkit's launcher does: gloo's threads can abort a plain exit
sys.stdout.flush()
os._exit(0)
"""


def test_the_stack_cell_shows_labkit_s_dump_where_py_spy_is_refused(tmp_path,
                                                                   monkeypatch):
    """Lesson 10's py-spy cell, run as its two ranks run it, on a laptop without
    the right to read another process (py-spy refused): rank 1 says so and shows
    rank 0's stack from labkit's own dump, rank 0 waiting in all_reduce; rank 0's
    collective times out, as its `raises-exception` tag says. (nbval runs the
    whole lesson with the real py-spy, and checks that each tagged cell raises.)"""
    import nbformat

    fake = tmp_path / "py-spy"
    fake.write_text(_REFUSING_PY_SPY)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    nb = nbformat.read(LESSON, as_version=4)
    (cell,) = [c for c in nb.cells if c.cell_type == "code"
               and "stalls.py_spy_dump" in c.source]
    assert "raises-exception" in cell.metadata.get("tags", [])
    source = cell.source.removeprefix("%%px\n")
    rank0, rank1 = two_rank_scripts(_SPY_RANK, source, timeout_s=120)
    assert rank0.returncode == 3 and "raised:" in rank0.stdout, rank0.stdout[-2000:]
    shown = rank1.stdout
    assert rank1.returncode == 0, shown[-3000:]
    assert "Permission Denied" in shown and "labkit's own stack dump" in shown, shown
    assert "in all_reduce" in shown  # what labkit's dump found instead


def test_the_lesson_tags_each_failure_it_shows_on_purpose():
    """Lesson 10's failures are shown by cells tagged `raises-exception` (nbval,
    with tools/nbval_record.py, fails a tagged cell that raises nothing and an
    untagged one that raises; JupyterLab's Run All goes past tagged ones only:
    tests/test_browser.py)."""
    import nbformat

    nb = nbformat.read(LESSON, as_version=4)
    meant = [c for c in nb.cells if "raises-exception" in c.metadata.get("tags", [])]
    assert len(meant) >= 8 and all(c.cell_type == "code" for c in meant)


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_torchrun_restarts_a_killed_rank_and_the_run_ends_bit_for_bit(tmp_path):
    from labkit.cluster import torchrun

    resume = ["-m", "labkit", "resume", "--steps", "12", "--accum", "1",
              "--checkpoint-every", "4"]
    straight = torchrun.run_nodes(resume + ["--checkpoint", str(tmp_path / "a.pt"),
                                            "--json", str(tmp_path / "a.json")],
                                  nnodes=1, nproc_per_node=2, timeout_s=120)
    died = torchrun.run_nodes(resume + ["--checkpoint", str(tmp_path / "b.pt"),
                                        "--die-at", "6"],
                              nnodes=1, nproc_per_node=2, timeout_s=120)
    restarted = torchrun.run_nodes(resume + ["--checkpoint", str(tmp_path / "c.pt"),
                                             "--die-at", "6",
                                             "--json", str(tmp_path / "c.json")],
                                   nnodes=1, nproc_per_node=2, timeout_s=120,
                                   max_restarts=1)
    a, c = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ac")
    assert straight[0].returncode == 0 and restarted[0].returncode == 0
    # No restart: the run fails. torchrun's agent reports the first failure it saw:
    # rank 1's -9, or under load rank 0's -6 (gloo aborts on the broken connection)
    # or -15 (the agent stopped it): 3 of 10 runs here with two busy cores.
    assert died[0].returncode != 0 and "failed (exitcode" in died[0].output
    assert (a["attempt"], a["resumed_from"]) == (0, 0)
    assert (c["attempt"], c["resumed_from"]) == (1, 4)  # the checkpoint before step 6
    assert c["param_sha256"] == a["param_sha256"]


def test_resume_needs_a_checkpoint_and_restarts_are_counted_from_zero(capsys):
    from labkit.__main__ import main
    from labkit.cluster import torchrun

    with pytest.raises(SystemExit) as exited:
        main(["resume", "--steps", "2"])
    assert exited.value.code == 2
    assert "resume needs --checkpoint PATH" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["resume", "--steps", "10", "--checkpoint", "x.pt", "--die-at", "12"])
    assert "--die-at must be a step of the run, 0 to 9, got 12" in (
        capsys.readouterr().err)
    with pytest.raises(ValueError, match="max_restarts must be >= 0"):
        torchrun.command([], nnodes=1, nproc_per_node=1, endpoint="127.0.0.1:1",
                         run_id="x", max_restarts=-1)


@pytest.mark.procs
def test_py_spy_is_found_beside_python_and_its_absence_is_said(monkeypatch):
    """Lesson 10's `stalls.py_spy_dump`: a kernel started by `make lab` may not
    have the environment's bin/ on PATH; py-spy beside its Python still runs."""
    from labkit.cluster import stalls

    monkeypatch.setenv("PATH", "/nonexistent")
    found = stalls.py_spy_dump(os.getpid())
    assert found.returncode == 0 and "Thread" in found.stdout or (
        "Permission Denied" in found.stderr), (found.returncode, found.stderr)
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    missing = stalls.py_spy_dump(os.getpid())
    assert missing.returncode == 127 and "py-spy is not installed" in missing.stderr


def test_find_unused_parameters_adds_an_all_reduce_a_comm_hook_does_not_see():
    """Lesson 10: find_unused_parameters=True all-reduces the map of used
    parameters at every step (Int, one value per parameter), besides the
    gradients; the Flight Recorder sees it, a comm hook (CommCounter) does not.
    Every parameter is used here, so the extra all-reduce is the setting's cost
    alone."""
    import torch
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit import comm_counting

    def collectives_of_a_step(find_unused):
        model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)),
                    find_unused_parameters=find_unused)
        counter = comm_counting.CommCounter().attach(model)
        for _ in range(3):  # past the bucket rebuild of step 2
            counter.reset()
            before = len(json.loads(c10d._dump_fr_trace_json())["entries"])
            model(torch.ones(2, 4)).sum().backward()
        entries = json.loads(c10d._dump_fr_trace_json())["entries"][before:]
        return [(e["profiling_name"], e["input_dtypes"], e["input_sizes"])
                for e in entries], counter.calls

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        plain, plain_hooked = collectives_of_a_step(False)
        unused, unused_hooked = collectives_of_a_step(True)
    finally:
        dist.destroy_process_group()
    gradients = ("gloo:all_reduce", ["Float"], [[4 * 4 + 4 + 4 + 1]])
    assert plain == [gradients]
    assert unused == [gradients, ("gloo:all_reduce", ["Int"], [[4]])]  # 4 parameters
    assert plain_hooked == unused_hooked == 1  # the hook sees the gradients only


class _Pulled:
    """What the figure cell of "Parameters the forward pass does not use" reads."""

    def __init__(self, got_grad, failures):
        self.got_grad, self.last_failure = got_grad, failures

    def pull(self, name):
        assert name == "got_grad"
        return self.got_grad


_NAMES = ("body.weight", "body.bias", "head.weight", "head.bias", "aux.weight",
          "aux.bias")
# The end of DDP's error on each rank, as torch 2.13 writes it under INFO.
_DDP_SAYS = {r: f"RuntimeError: Expected to have finished reduction ...\n"
                f"Parameters which did not receive grad for rank {r}: aux.bias, "
                f"aux.weight\nParameter indices which did not receive grad for rank "
                f"{r}: 4 5" for r in (0, 1)}


@pytest.mark.parametrize(("got", "passes"), [
    ((True,) * 4 + (False,) * 2, True),  # as the ranks record it
    ((True,) * 5 + (False,), False),  # a rank that saw a gradient for aux.weight
    ((False,) * 6, False)],  # recorded after zero_grad(set_to_none=True)
    ids=["as run", "aux.weight with a gradient", "all None"])
def test_the_gradients_figure_holds_each_rank_s_grad_to_ddp_s_error(got, passes):
    import matplotlib.pyplot as plt
    from lesson_cells import finder

    cell = finder("10_troubleshooting")('got_grad = ranks.pull("got_grad")')
    as_run = list(zip(_NAMES, (True,) * 4 + (False,) * 2, strict=True))
    ranks = _Pulled([as_run, list(zip(_NAMES, got, strict=True))], _DDP_SAYS)
    try:
        if passes:
            exec(compile(cell, "<figure cell>", "exec"), {"ranks": ranks})
        else:
            with pytest.raises(AssertionError):
                exec(compile(cell, "<figure cell>", "exec"), {"ranks": ranks})
    finally:
        plt.close("all")
