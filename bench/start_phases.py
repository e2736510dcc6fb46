"""Where a cold start of 2 ranks spends its time, phase by phase.

    python bench/start_phases.py [--defaults]

Starts the controller and the engines as labkit.cluster does (with
--defaults: as plain ipyparallel does) and prints the seconds at which each
phase ends. Run it with `py-spy record --subprocesses` or `python -X importtime`
to look inside a phase.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--defaults", action="store_true",
                        help="ipyparallel's defaults: 3 s heartbeat, late torch import")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()

    def mark(what: str) -> None:
        print(f"{time.perf_counter() - t0:6.2f} s  {what}", flush=True)

    import ipyparallel as ipp

    mark("ipyparallel imported")
    from labkit.cluster import engine, rendezvous

    mark("labkit imported (torch with it; a lesson has imported it already)")
    if args.defaults:
        controller_args, config = ["--IPController.use_threads=True"], None
    else:
        controller_args, config = engine.CONTROLLER_ARGS, engine.config()
    c = ipp.Cluster(n=2, controller_ip="127.0.0.1", engines="local", log_level=40,
                    controller_args=controller_args, config=config)
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
    finally:
        c.stop_cluster_sync()
    return 0


if __name__ == "__main__":
    sys.exit(main())
