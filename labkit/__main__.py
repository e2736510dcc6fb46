"""Command line: `python -m labkit <command> ...` runs what the lessons run."""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__, i18n

__all__ = ["main"]


def _doctor(args: argparse.Namespace) -> int:
    from . import doctor

    report = doctor.collect()
    print(doctor.format_report(report))
    if args.json:
        _write_json(args.json, report.as_dict())
    return 0


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=2)
        f.write("\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m labkit", description=__doc__)
    parser.add_argument("--version", action="version", version=__version__)
    parser.add_argument("--lang", choices=i18n.LANGS, default="en",
                        help="language of the output (default: en)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="what this machine can run")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.set_defaults(func=_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    i18n.set_lang(args.lang)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
