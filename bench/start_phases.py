"""Where a cold start of 2 ranks spends its time, phase by phase.

    python bench/start_phases.py [--defaults]
    LABKIT_FORKSERVER=0 python bench/start_phases.py

Starts the controller and the engines as labkit.cluster does, twice: first
with the fork server starting (a kernel's first start), then from the warm
server (every later start). With LABKIT_FORKSERVER=0, as labkit does where it
does not fork (Windows, macOS): new processes, ipyparallel's launchers with
labkit's settings, twice. With --defaults, as plain ipyparallel does (new
processes, 1 s between the controller and the engines, a 3 s heartbeat).
Prints the seconds at which each phase ends. Run it with `py-spy record
--subprocesses` or `python -X importtime` to look inside a phase.
"""

from __future__ import annotations

import argparse
import sys
import time


def phases(defaults: bool) -> None:
    import ipyparallel as ipp

    from labkit.cluster import engine, rendezvous

    t0 = time.perf_counter()

    def mark(what: str) -> None:
        print(f"{time.perf_counter() - t0:6.2f} s  {what}", flush=True)

    if defaults:
        c = ipp.Cluster(n=2, controller_ip="127.0.0.1", engines="local", log_level=40,
                        controller_args=["--IPController.use_threads=True"])
    else:
        c = engine.new_cluster(2)
    try:
        c.start_controller_sync()
        mark("controller process started")
        c.start_engines_sync()
        mark("engine processes started (the controller wrote its connection file)")
        client = c.connect_client_sync()
        client.wait_for_engines(2, timeout=60)
        mark("2 engines registered (admitted at a heartbeat)")
        view = client[:]
        view.apply_sync(lambda: __import__("torch").__version__)
        mark("torch imported on both engines")
        store = rendezvous.local_store(20.0, 0)
        view.scatter("rank", [0, 1], flatten=True, block=True)
        view.apply_sync(lambda port: __import__("labkit.cluster.rendezvous")
                        .cluster.rendezvous
                        .init_rank(rank, 2, "gloo", port, "phases", 20.0, 1),  # noqa: F821
                        store.port)
        mark("process group joined")
        view.apply_sync(lambda: __import__("torch.nn.parallel").nn.parallel
                        .DistributedDataParallel(__import__("torch").nn.Linear(2, 2))
                        and None)
        mark("a DDP model built on both (its constructor imports torch._dynamo)")
    finally:
        c.stop_cluster_sync()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--defaults", action="store_true",
                        help="ipyparallel's defaults: new processes, 3 s heartbeat")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    import labkit.cluster.ranks  # noqa: F401  (torch with it, as in a lesson)

    print(f"{time.perf_counter() - t0:6.2f} s  labkit imported (torch with it; "
          "a lesson has imported it already)", flush=True)
    if not args.defaults:
        from labkit.cluster import forkserver

        why = forkserver.usable()
        print("ranks forked from the fork server" if why is None else
              f"ranks as new processes ({forkserver.VARIABLE}: {why})", flush=True)
    for start in ("first start", "second start") if not args.defaults else ("start",):
        print(f"-- {start}", flush=True)
        phases(args.defaults)
        time.sleep(2)  # the first start's processes end
    return 0


if __name__ == "__main__":
    sys.exit(main())
