"""Command line: `python -m labkit <command> ...` runs what the lessons run.

Experiments run on every rank: under torchrun the ranks come from torchrun,
otherwise torch's elastic launcher starts `--world-size` of them here.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__, i18n

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """Bad arguments end with one line that names the problem, and exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _can_write(text: str) -> bool:
    """Whether stdout's encoding has every character of `text`."""
    try:
        text.encode(getattr(sys.stdout, "encoding", None) or "utf-8")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def _doctor(args: argparse.Namespace) -> int:
    from . import doctor

    report = doctor.collect()
    marks = doctor.MARKS if _can_write("".join(doctor.MARKS)) else doctor.ASCII_MARKS
    print(doctor.format_report(report, marks))
    if args.json:
        _write_json(args.json, report.as_dict())
    return 0


def _experiment(args: argparse.Namespace) -> int:
    from . import cli_experiments, workload
    from .cluster import launch, rendezvous

    cfg = workload.Config(
        accum_steps=args.accum, steps=args.steps, batch_per_rank=args.batch_per_rank,
        hidden=args.hidden, depth=args.depth, lr=args.lr, seed=args.seed,
        bucket_cap_mb=args.bucket_cap_mb, repeat=args.repeat)
    world_size = args.world_size
    if launch.under_torchrun():
        import os

        world_size = int(os.environ["WORLD_SIZE"])
    # Every argument is checked here, before a single worker starts.
    rendezvous.check_args(world_size, args.backend, args.port)
    cfg.check()
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    fn = {"nosync": cli_experiments.nosync_experiment,
          "misuse": cli_experiments.misuse_experiment,
          "resume": cli_experiments.resumable_training}[args.command]
    kwargs = {"cfg": cfg}
    if args.command == "resume":
        if not args.checkpoint:
            raise ValueError("resume needs --checkpoint PATH")
        if args.die_at is not None and not 0 <= args.die_at < args.steps:
            raise ValueError("--die-at must be a step of the run, 0 to "
                             f"{args.steps - 1}, got {args.die_at}")
        kwargs.update(checkpoint=args.checkpoint, every=args.checkpoint_every,
                      die_at=args.die_at)
    fault = (args.fault, args.fault_rank) if args.fault else None
    if fault and launch.under_torchrun():
        raise ValueError("--fault works without torchrun only")
    results = launch.run(fn, kwargs, world_size, args.backend, args.timeout,
                         port=args.port, fault=fault)
    if results is None or (launch.under_torchrun() and _rank() != 0):
        return 0
    summary = {k: v for k, v in results[0].items() if k not in ("rank", "config")}
    summary["config"] = results[0]["config"]
    summary["backend"] = args.backend
    for key, value in summary.items():
        if key != "config":
            print(f"{key}: {value}")
    if args.json:
        _write_json(args.json, summary)
    return 0


def _train(args: argparse.Namespace) -> int:
    from . import training

    cfg = training.TrainConfig(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr,
        optimizer=args.optimizer, momentum=args.momentum, hidden=args.hidden,
        depth=args.depth, seed=args.seed, checkpoint_every=args.checkpoint_every)
    if args.resume and not args.checkpoint:
        raise ValueError("--resume needs --checkpoint PATH")
    result = training.fit(cfg, args.checkpoint, resume=args.resume)
    for key in ("steps", "resumed_from", "final_loss", "param_sha256"):
        print(f"{key}: {result[key]}")
    if args.json:
        _write_json(args.json, result)
    return 0


def _dp(args: argparse.Namespace) -> int:
    from . import dp_experiments

    result = dp_experiments.dp_experiment(devices=args.devices, batch=args.batch,
                                      seed=args.seed)
    for key, value in result.items():
        print(f"{key}: {value}")
    if args.json:
        _write_json(args.json, result)
    return 0


def _rank() -> int:
    import os

    return int(os.environ.get("RANK", 0))


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=2)
        f.write("\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m labkit", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=__version__)
    parser.add_argument("--lang", choices=i18n.LANGS, default="en",
                        help="language of the output (default: en)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("doctor", help="what this machine can run")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.set_defaults(func=_doctor)
    helps = {
        "nosync": "gradient accumulation with no_sync: equivalence, all-reduce "
                  "counts, step times",
        "misuse": "the documents' misuses of no_sync: bare call, forward outside, "
                  "stepping inside",
        "resume": "DDP training that checkpoints on rank 0 and resumes (under "
                  "torchrun --max-restarts: after a rank dies)",
    }
    for name, text in helps.items():
        p = sub.add_parser(name, help=text)
        p.add_argument("--world-size", type=int, default=2,
                       help="ranks to start (ignored under torchrun)")
        p.add_argument("--accum", type=int, default=4,
                       help="micro-batches per optimizer step (K)")
        p.add_argument("--steps", type=int, default=10, help="optimizer steps")
        p.add_argument("--backend", default="gloo", help="gloo (CPU) or nccl (GPUs)")
        p.add_argument("--batch-per-rank", type=int, default=16,
                       help="samples per rank in one micro-batch")
        p.add_argument("--hidden", type=int, default=100, help="hidden width")
        p.add_argument("--depth", type=int, default=1, help="hidden layers")
        p.add_argument("--bucket-cap-mb", type=float, default=None,
                       help="DDP bucket size in MiB (default: DDP's own)")
        p.add_argument("--lr", type=float, default=0.05, help="learning rate")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--repeat", type=int, default=5,
                       help="timed optimizer steps per mode")
        p.add_argument("--timeout", type=float, default=60.0,
                       help="seconds before a stuck collective fails")
        p.add_argument("--port", type=int, default=0,
                       help="rendezvous port on 127.0.0.1 (default 0: any free one)")
        p.add_argument("--fault", choices=("raise", "kill", "hang", "stop"),
                       help="make one rank fail on purpose, to see what it looks "
                            "like (stop needs SIGSTOP, which Windows lacks)")
        p.add_argument("--fault-rank", type=int, default=1, metavar="R",
                       help="the rank that fails (default 1)")
        p.add_argument("--json", metavar="FILE", help="write the results as JSON")
        if name == "resume":
            p.add_argument("--checkpoint", metavar="PATH",
                           help="the checkpoint to write, and to resume from")
            p.add_argument("--checkpoint-every", type=int, default=5, metavar="N",
                           help="save every N steps (and at the end)")
            p.add_argument("--die-at", type=int, default=None, metavar="STEP",
                           help="rank 1 kills itself before STEP on torchrun's "
                                "first attempt (SIGKILL; os._exit on Windows)")
        p.set_defaults(func=_experiment)
    p = sub.add_parser("dp", help="data_parallel against one device: outputs and "
                       "gradients (simulated devices without GPUs)")
    p.add_argument("--devices", type=int, default=2,
                   help="devices to split over (simulated without enough GPUs)")
    p.add_argument("--batch", type=int, default=100, help="samples in the batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.set_defaults(func=_dp)
    p = sub.add_parser("train", help="train on the teacher task, with checkpoints")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps in all")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05, help="learning rate")
    p.add_argument("--optimizer", default="momentum",
                   help="sgd, momentum, adam or adamw (default momentum)")
    p.add_argument("--momentum", type=float, default=0.9,
                   help="the momentum of the momentum optimizer")
    p.add_argument("--hidden", type=int, default=100, help="hidden width")
    p.add_argument("--depth", type=int, default=1, help="hidden layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", metavar="PATH", help="save training state here")
    p.add_argument("--checkpoint-every", type=int, default=10, metavar="N",
                   help="save every N steps (and at the end)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the checkpoint at PATH")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.set_defaults(func=_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    i18n.set_lang(args.lang)
    # Redirected or piped, Python on Windows writes cp1252 or cp932 (not UTF-8):
    # what those cannot encode (Japanese in cp1252) is written as \uXXXX escapes
    # instead of ending the command.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):  # ipykernel's streams write UTF-8 anyway
            stream.reconfigure(errors="backslashreplace")
    from .checkpoint import CheckpointError

    try:
        return args.func(args)
    except UnicodeError:  # a ValueError too, but never the learner's input
        raise
    except ValueError as err:  # bad input: one line, no traceback
        parser.exit(2, f"{parser.prog} {args.command}: error: {err}\n")
    except CheckpointError as err:
        parser.exit(1, f"{parser.prog} {args.command}: error: {err}\n")
    except KeyboardInterrupt:
        parser.exit(130, f"{parser.prog} {args.command}: interrupted; ranks stopped\n")
    except Exception as err:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        if isinstance(err, ChildFailedError):
            # The failing rank's traceback is in the message; print it once.
            print(err.format_msg(), file=sys.stderr)
            return 1
        if isinstance(err, SignalException):  # Ctrl-C or kill reached the launcher
            parser.exit(130, f"{parser.prog} {args.command}: stopped by "
                        f"{err.sigval.name}; ranks stopped\n")
        raise


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    from labkit.cluster import launch

    # Under torchrun, record() writes this rank's traceback where torchrun reads it.
    code = record(main)()
    if launch.under_torchrun():
        launch.exit_now(code or 0)  # a rank leaves without finalizing: see exit_now
    sys.exit(code)
