"""How ranks find each other: argument checks, a loopback store, process groups.

Shared by the notebook's engines (labkit.cluster.ranks) and the command line's
launcher (labkit.cluster.launch), so both check arguments the same way, bind
to 127.0.0.1 and join alike.
"""

from __future__ import annotations

import datetime
import errno
import os
import socket

import torch
import torch.distributed as dist

__all__ = [
    "BACKENDS",
    "JOIN_TIMEOUT_S",
    "MAX_LOCAL_WORLD_SIZE",
    "check_args",
    "init_from_env",
    "init_rank",
    "libuv_available",
    "local_store",
    "loopback_interface",
    "set_collective_timeout",
    "tcp_store",
]

BACKENDS = ("gloo", "nccl")
# More ranks than this on one machine is a typo, not an experiment.
MAX_LOCAL_WORLD_SIZE = 64
# How long ranks wait for each other to join a group. Importing torch takes
# about 3 s here and much longer on a loaded machine; the collectives after the
# join keep their own, shorter timeout.
JOIN_TIMEOUT_S = 60.0


def check_args(world_size: int, backend: str = "gloo", port: int = 0) -> None:
    """Raise ValueError naming the bad argument, before any worker starts."""
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ValueError(f"world_size must be an integer, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if world_size > MAX_LOCAL_WORLD_SIZE:
        raise ValueError(
            f"world_size={world_size} is more than {MAX_LOCAL_WORLD_SIZE} ranks on one "
            "machine; use torchrun across machines for that"
        )
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be 0 (any free port) or 1-65535, got {port}")
    if port:
        # Found taken here, not once the engines or workers are up (and a
        # running group stopped for them): the store binds it only then.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    raise _port_taken(port) from None
                raise
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: choose one of "
                         f"{', '.join(BACKENDS)}")
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            raise ValueError("backend 'nccl' needs CUDA GPUs and this machine has "
                             "none; use backend 'gloo'")
        if world_size > gpus:
            raise ValueError(f"backend 'nccl' needs one GPU per rank: world_size="
                             f"{world_size} but only {gpus} GPU(s)")


def _port_taken(port: int) -> ValueError:
    return ValueError(f"port {port} on 127.0.0.1 is already in use; use port 0 to "
                      "let the system pick a free one")


def loopback_interface() -> str:
    """The name gloo knows the loopback interface by: "lo" on Linux, "lo0" on
    macOS, "Loopback Pseudo-Interface 1" on Windows.

    Found by its address, 127.0.0.1, among psutil's interfaces: on Windows
    psutil names them by their friendly name, as libuv (gloo's transport there)
    does, while socket.if_nameindex() gives names like "loopback_0" that gloo
    cannot find.
    """
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1"
               for a in addresses):
            return name
    return "lo"


# Whether this torch's TCPStore has its libuv server: None until asked.
_libuv: bool | None = None
_NO_LIBUV = "built without libuv support"


def libuv_available() -> bool:
    """Whether this torch can run a TCPStore on libuv, its default since 2.4.

    torch's Windows wheels are built without it, and a TCPStore that asks for it
    there raises "use_libuv was requested but PyTorch was built without libuv
    support" before it touches the network. torch has no Python call that says
    so; this asks once, with a store on a socket of our own on 127.0.0.1.
    """
    global _libuv
    if _libuv is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            sock.listen(1)
            fd = os.dup(sock.fileno())  # the store closes it once it has it
            try:
                dist.TCPStore("127.0.0.1", sock.getsockname()[1], is_master=True,
                              wait_for_workers=False, use_libuv=True,
                              master_listen_fd=fd)
                _libuv = True
            except RuntimeError as err:  # DistStoreError, raised before it took fd
                os.close(fd)
                if _NO_LIBUV not in str(err):
                    raise
                _libuv = False
    return _libuv


def tcp_store(host: str, port: int, **kwargs) -> dist.TCPStore:
    """`dist.TCPStore(host, port, **kwargs)`, on libuv only where torch has it.

    Left to itself TCPStore asks for libuv, and USE_LIBUV=0 reaches only the
    stores torch's own rendezvous makes, not a direct call.
    """
    return dist.TCPStore(host, port, use_libuv=libuv_available(), **kwargs)


def local_store(timeout_s: float, port: int = 0) -> dist.TCPStore:
    """A TCPStore server on 127.0.0.1 and a port the OS picks (or `port`).

    TCPStore on its own listens on every interface; binding the socket here
    first keeps it on loopback, and port 0 means no other program can race us
    for it. Ranks connect to `store.port`. `check_args` has checked `port`.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
        port = sock.getsockname()[1]
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise _port_taken(port) from None
        raise
    # The store takes the file descriptor over and closes it when it is freed.
    return tcp_store(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _prepare(backend: str, gpu: int, threads: int | None) -> str:
    """What a rank sets before it joins; returns its device name."""
    if threads:
        torch.set_num_threads(threads)  # ranks sharing few cores must not oversubscribe
    # gloo opens its own sockets on the interface of the host name: keep them local.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    if backend != "nccl":
        return "cpu"
    torch.cuda.set_device(gpu)
    return f"cuda:{torch.cuda.current_device()}"


def init_rank(rank: int, world_size: int, backend: str, port: int, prefix: str,
              timeout_s: float, threads: int | None = None) -> str:
    """Join the process group through our store on 127.0.0.1:`port`; returns
    the rank's device name.

    The collective timeout is short (`timeout_s`) so that a rank that never
    arrives at a collective turns into an error within seconds, not gloo's
    default 30 minutes. Joining may take longer: a rank still importing torch
    on a busy machine is late, not lost (see JOIN_TIMEOUT_S).
    """
    gpu = rank % torch.cuda.device_count() if backend == "nccl" else 0
    device = _prepare(backend, gpu, threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    join = datetime.timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_S))
    client = tcp_store("127.0.0.1", port, is_master=False, timeout=join)
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, client),
                            rank=rank, world_size=world_size, timeout=join)
    if timeout_s < JOIN_TIMEOUT_S:
        set_collective_timeout(timeout_s)
    return device


def set_collective_timeout(timeout_s: float) -> None:
    """Make the default group's collectives time out after `timeout_s`.

    torch 2.13 has no public way to change a group's timeout after it is made;
    its private `_set_pg_timeout` does it for gloo and nccl (measured here on
    gloo: a group joined with 30 s, then set to 2 s, timed out a lone all_reduce
    after 2.0 s). torch 2.14 made it public, `dist.set_timeout(timeout, group)`,
    and its `_set_pg_timeout` now only calls that with a FutureWarning (read in
    2.14.1's distributed_c10d.py). Without either the group keeps the join's
    timeout.
    """
    set_timeout = (getattr(dist, "set_timeout", None)
                   or getattr(dist.distributed_c10d, "_set_pg_timeout", None))
    if set_timeout is not None:
        set_timeout(datetime.timedelta(seconds=timeout_s))


def init_from_env(backend: str, timeout_s: float) -> tuple[int, int]:
    """Join the process group torchrun made; returns (rank, world size).

    torchrun's environment names the rank, the world size, this rank's GPU
    (LOCAL_RANK) and where the group meets.
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _prepare(backend, int(os.environ.get("LOCAL_RANK", rank)), None)
    if not libuv_available():
        os.environ.setdefault("USE_LIBUV", "0")  # env://'s store reads it
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world_size
