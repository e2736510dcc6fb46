"""Several machines, simulated on one: torchrun agents that meet by rendezvous.

On a cluster, one `torchrun` runs on every node with the same `--nnodes`,
`--rdzv-id` and `--rdzv-endpoint` (host:port of one of them). Here each
"node" is a torchrun agent on this machine, and the endpoint is 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["JOB_SCRIPTS", "NODE_SCRIPT", "NodeRun", "command", "free_port",
           "main", "run_nodes"]

_HERE = Path(__file__).resolve().parent
# Lesson 09's job scripts, by scheduler: each has its launcher run
# torchrun_node.sh (beside them) once per node.
JOB_SCRIPTS = {"slurm": _HERE / "slurm_example.sh", "pbs": _HERE / "pbs_example.sh",
               "pjm": _HERE / "pjm_example.sh"}
NODE_SCRIPT = _HERE / "torchrun_node.sh"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    torchrun's c10d rendezvous binds the port itself, so it cannot take an
    already-open socket: the port is free when returned, and a race with
    another program is possible but unlikely.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(args: list[str], *, nnodes: int, nproc_per_node: int,
                     endpoint: str, run_id: str, max_restarts: int = 0,
                     python: str = sys.executable) -> list[str]:
    """The torchrun command line one node runs (the same on every node)."""
    if nnodes < 1 or nproc_per_node < 1:
        raise ValueError(f"nnodes and nproc_per_node must be >= 1, got {nnodes}, "
                         f"{nproc_per_node}")
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    return [python, "-m", "torch.distributed.run",
            "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", run_id,
            # Where this node tells the others to reach it: loopback here.
            "--local-addr", "127.0.0.1",
            "--max-restarts", str(max_restarts), *args]


@dataclass
class NodeRun:
    """What one simulated node did: exit code and output."""

    node: int
    returncode: int | None
    output: str = field(repr=False)


def run_nodes(args: list[str], nnodes: int = 2, nproc_per_node: int = 1,
              timeout_s: float = 120.0, port: int | None = None,
              max_restarts: int = 0) -> list[NodeRun]:
    """Start `nnodes` torchrun agents here and wait for all; stop all on timeout.

    Output goes to files, not pipes, so a talkative node never blocks. On a
    timeout every agent gets SIGTERM (it then stops its workers, which run in
    sessions of their own), and whatever is still alive seconds later, SIGKILL.
    Windows has neither sessions nor SIGKILL: there SIGTERM already ends an
    agent at once (TerminateProcess), and its workers are ended one by one.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    endpoint = f"127.0.0.1:{port or free_port()}"
    run_id = f"labkit-{uuid.uuid4().hex[:8]}"
    cmd = command(args, nnodes=nnodes, nproc_per_node=nproc_per_node,
                           endpoint=endpoint, run_id=run_id, max_restarts=max_restarts)
    from . import rendezvous

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if not rendezvous.libuv_available():  # Windows: see main below
        cmd[cmd.index("torch.distributed.run")] = "labkit.cluster.torchrun"
        env.update(_WITHOUT_LIBUV)
    if max_restarts:
        # torch 2.13's agent keeps one store across restarts, and the new workers
        # can read the dead ones' addresses (dynamic_rendezvous.py): with the
        # default, most restarts tried here failed to connect or hung; with this,
        # none did (lesson 11's and the tests' restarts run with it).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        logs = [open(Path(tmp) / f"node{i}.log", "w+") for i in range(nnodes)]
        # A session (and process group) per agent, so that one killpg ends it
        # and its workers; Popen ignores start_new_session on Windows.
        procs = [subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                                  env=env, start_new_session=True) for log in logs]
        deadline = time.monotonic() + timeout_s
        timed_out = False
        try:
            for proc in procs:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _stop(procs)
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read() + (f"\n[stopped after {timeout_s:g} s]"
                                         if timed_out else ""))
            log.close()
    return [NodeRun(i, p.returncode, out)
            for i, (p, out) in enumerate(zip(procs, outputs, strict=True))]


def _descendants(pid: int) -> list:
    try:
        import psutil

        return psutil.Process(pid).children(recursive=True)
    except Exception:  # psutil missing, or the process is gone
        return []


# Seconds an agent is given to stop its workers after SIGTERM.
GRACE_S = 10.0


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM agents still running, then SIGKILL them and any worker left."""
    alive = [p for p in procs if p.poll() is None]
    workers = [w for p in alive for w in _descendants(p.pid)]
    for proc in alive:
        proc.send_signal(signal.SIGTERM)  # the agent stops its workers
    for proc in alive:
        try:
            proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            if hasattr(os, "killpg"):
                os.killpg(proc.pid, signal.SIGKILL)  # the agent's whole session
            else:  # Windows: no process groups; the workers are ended below
                proc.kill()
            proc.wait()
    for worker in workers:
        try:
            worker.kill()
        except Exception:  # already gone
            pass


# Where torch lacks libuv, what its workers' stores need: USE_LIBUV=0 reaches
# the one each group's rank 0 hosts, and none reaches the client of the agent's
# shared store, which torch builds without use_libuv (2.13, 2.14.1): no sharing.
_WITHOUT_LIBUV = {"USE_LIBUV": "0", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def main() -> None:
    """torchrun, its own stores kept off libuv where torch lacks it.

    torch's rendezvous builds its TCPStores without use_libuv (the c10d and
    static backends, and the store the agent shares with its workers; torch 2.13
    and 2.14.1), so they ask for libuv, and USE_LIBUV=0 does not reach them: on
    Windows torchrun itself stops there. Its workers need _WITHOUT_LIBUV.
    """
    import torch.distributed as dist
    from torch.distributed.run import main as torchrun

    from . import rendezvous

    if not rendezvous.libuv_available():
        real = dist.TCPStore

        class TCPStore(real):
            def __init__(self, *args, **kwargs):
                kwargs.setdefault("use_libuv", False)  # torch passes the rest by name
                super().__init__(*args, **kwargs)

        import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend  # noqa: F401
        import torch.distributed.elastic.rendezvous.static_tcp_rendezvous  # noqa: F401

        for name, module in list(sys.modules.items()):
            if name.startswith("torch.distributed") and getattr(
                    module, "TCPStore", None) is real:
                module.TCPStore = TCPStore
        os.environ.update(_WITHOUT_LIBUV)
    torchrun()


if __name__ == "__main__":
    main()
