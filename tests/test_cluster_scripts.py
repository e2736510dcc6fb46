"""The cluster examples run here, each under its scheduler faked.

labkit/cluster/slurm_example.sh, pbs_example.sh and pjm_example.sh are the job scripts a
learner submits with sbatch, qsub or pjsub. Here each runs with the environment
its scheduler would give it (node list, job id, working folder) describing two
"nodes" that are this machine's loopback addresses, and with a fake of the
launcher it calls (srun, mpirun, mpiexec) that starts the command once per node
here, as the real one would start it once on each node. Each node's torchrun
agent then meets the other at the rendezvous on the first node, and the two
ranks run the course's experiment on gloo: the run must end with world size 2 and
DDP's gradient equal to the whole batch's.
"""

import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from conftest import child_processes, leftovers

from labkit.cluster import torchrun

pytestmark = pytest.mark.procs  # every test here starts processes

ROOT = Path(__file__).resolve().parent.parent
LABKIT = ROOT / "labkit"
NODES = ("127.0.0.1", "127.0.0.2")  # two loopback addresses: two "nodes" here

# The launchers, faked: run the command after the options once per node, in
# parallel, and fail if any node fails. What they were asked is logged; with
# FAKE_DRY set, also how many nodes, from which folder, and nothing is run.
FAKE_LAUNCHER = textwrap.dedent("""\
    #!/bin/bash
    # fake {name}: {count_from}
    echo "{name} $*" >> "$FAKE_LOG"
    count=""
    while [ $# -gt 0 ]; do
        case "$1" in
            -np|-n) count=$2; shift 2 ;;
            -map-by|-hostfile|-machinefile|-npernode) shift 2 ;;
            -*) shift ;;
            *) break ;;
        esac
    done
    {count_line}
    if [ -n "${{FAKE_DRY:-}}" ]; then
        printf '%s\\n' "nodes $count" "cwd $PWD" "$@" > "$FAKE_DRY"
        exit 0
    fi
    pids=()
    for node in $(seq 1 "$count"); do "$@" & pids+=($!); done
    status=0
    for pid in "${{pids[@]}}"; do wait "$pid" || status=$?; done
    exit $status
""")
FAKE_SCONTROL = textwrap.dedent("""\
    #!/bin/bash
    # fake scontrol: `scontrol show hostnames LIST` prints one node a line
    [ "$1 $2" = "show hostnames" ] || exit 1
    tr ',' '\\n' <<< "$3"
""")


def _fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    launchers = {
        # srun: one task per node of the allocation
        "srun": 'count=$SLURM_NNODES',
        # mpirun and mpiexec: -np / -n processes, one per node here
        "mpirun": ': "${count:?mpirun needs -np}"',
        "mpiexec": ': "${count:?mpiexec needs -n}"',
    }
    for name, count_line in launchers.items():
        path = bin_dir / name
        path.write_text(FAKE_LAUNCHER.format(name=name, count_from=count_line,
                                             count_line=count_line))
        path.chmod(0o755)
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    return bin_dir


def _job_folder(tmp_path: Path) -> Path:
    """The folder the job is submitted from: the course's labkit/ and .venv."""
    job = tmp_path / "job"
    job.mkdir()
    (job / "labkit").symlink_to(LABKIT)
    (job / ".venv").symlink_to(ROOT / ".venv")
    return job


def _scheduler_env(scheduler: str, job: Path, tmp_path: Path) -> dict[str, str]:
    nodefile = tmp_path / "nodes"
    nodefile.write_text("".join(f"{node}\n" for node in NODES))
    job_id = f"4242.{scheduler}"
    return {
        "slurm": {"SLURM_JOB_NODELIST": ",".join(NODES), "SLURM_NNODES": "2",
                  "SLURM_JOB_ID": job_id},
        "pbs": {"PBS_NODEFILE": str(nodefile), "PBS_O_WORKDIR": str(job),
                "PBS_JOBID": job_id},
        "pjm": {"PJM_O_NODEINF": str(nodefile), "PJM_O_WORKDIR": str(job),
                "PJM_JOBID": job_id},
    }[scheduler]


def _run_job(cmd, cwd, env, timeout_s=240):
    """Run a job script; past `timeout_s`, stop it with every process it started
    (torchrun's agents stop their workers on SIGTERM), so none is left behind."""
    job = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = job.communicate(timeout=timeout_s)
        return job.returncode, output
    except subprocess.TimeoutExpired:
        started = psutil.Process(job.pid).children(recursive=True)
        os.killpg(job.pid, signal.SIGTERM)
        time.sleep(10)
        for proc in [*started, psutil.Process(job.pid)]:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        output, _ = job.communicate()
        return None, output + f"\n[stopped after {timeout_s} s]"


# The scripts where the package keeps them (labkit/cluster/), as a learner copies them.
SCRIPTS = torchrun.JOB_SCRIPTS
LAUNCHER = {"slurm": "srun", "pbs": "mpirun", "pjm": "mpiexec"}


def _job_env(tmp_path, job, scheduler):
    return {
        "PATH": f"{_fake_bin(tmp_path)}:/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "FAKE_LOG": str(tmp_path / "launcher.log"),
        # what a learner sets for a CPU-only try: one gloo rank per node
        "PROCS_PER_NODE": "1", "BACKEND": "gloo",
        "RDZV_PORT": str(torchrun.free_port()),
        # the "nodes" are this machine's loopback: each tells the other so
        "LOCAL_ADDR": "127.0.0.1",
        "OMP_NUM_THREADS": "1",
        **_scheduler_env(scheduler, job, tmp_path),
    }


def _launched(tmp_path, scheduler, env):
    """What the script asked its launcher for, checked against the scheduler's."""
    launched = (tmp_path / "launcher.log").read_text().splitlines()
    assert len(launched) == 1 and launched[0].startswith(LAUNCHER[scheduler])
    # the launcher was asked for one process per node, with the scheduler's node list
    assert f"torchrun_node.sh 2 {NODES[0]}:{env['RDZV_PORT']} 4242.{scheduler} 1 gloo" \
        in launched[0]


def test_the_slurm_job_script_runs_two_nodes_under_its_faked_scheduler(tmp_path):
    """Run to the end: both nodes' torchrun agents meet and the ranks train."""
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("the job scripts run the course's .venv (make lab creates it)")
    job = _job_folder(tmp_path)
    env = _job_env(tmp_path, job, "slurm")
    before = {p.pid for p in child_processes()}
    returncode, output = _run_job(["bash", str(SCRIPTS["slurm"])], job, env)
    assert returncode == 0, output[-6000:]
    assert leftovers(before) == set()
    _launched(tmp_path, "slurm", env)
    result = json.loads((job / "nosync-4242.slurm.json").read_text())
    assert result["world_size"] == 2
    assert result["grad_max_abs_diff"] <= 1e-6


@pytest.mark.parametrize("scheduler", SCRIPTS)
def test_the_job_script_asks_its_launcher_for_the_node_script_on_each_node(
        tmp_path, scheduler):
    """Every scheduler's script ends in the same command, torchrun_node.sh on
    each node, which the slurm test above runs to the end (once for all three:
    the pbs and pjm runs were the same run). Here each script is checked to ask
    its launcher for it, on both nodes, from the job's folder, with every
    argument; nothing is run."""
    job = _job_folder(tmp_path)
    env = _job_env(tmp_path, job, scheduler)
    env["FAKE_DRY"] = str(tmp_path / "asked")
    returncode, output = _run_job(["bash", str(SCRIPTS[scheduler])], job, env)
    assert returncode == 0, output[-6000:]
    _launched(tmp_path, scheduler, env)
    asked = (tmp_path / "asked").read_text().splitlines()
    assert asked == ["nodes 2", f"cwd {job}", f"{job}/labkit/cluster/torchrun_node.sh",
                     "2", f"{NODES[0]}:{env['RDZV_PORT']}", f"4242.{scheduler}", "1",
                     "gloo", "127.0.0.1"]


def test_the_node_script_says_how_to_call_it():
    done = subprocess.run(["bash", str(torchrun.NODE_SCRIPT), "2"],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert "usage:" in done.stderr and "HEAD_NODE:PORT JOB_ID" in done.stderr


@pytest.mark.parametrize("scheduler", SCRIPTS)
def test_a_job_script_without_its_scheduler_stops_at_once(tmp_path, scheduler):
    """Run by hand (no scheduler), a script names the variable it misses."""
    done = subprocess.run(["bash", str(SCRIPTS[scheduler])], cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin"}, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode != 0
    missing = {"slurm": "SLURM_JOB_NODELIST", "pbs": "PBS_O_WORKDIR",
               "pjm": "PJM_O_WORKDIR"}[scheduler]
    assert f"{missing}: unbound variable" in done.stderr
