"""Run the unit suite and the lessons again and again; report what varies.

A failure that comes once in four runs needs many runs to be seen, and each
one's whole output to be explained. This script repeats what CI runs
(`pytest tests`, and nbval over each lesson notebook on its own, with the
checks of tools/nbval_record.py, as tools/executed.py runs it), keeps the full
output of every failed run, and prints the distribution: pass rate, and the
median and worst time of each test and each notebook.

    python tools/stress.py unit --runs 10
    python tools/stress.py lessons --runs 5 --busy 1
    python tools/stress.py lessons --runs 5 --only notebooks/en/04_no_sync.ipynb

`--busy N` keeps N cores spinning in other processes meanwhile, as a learner's
laptop with a browser and more open is. Results go to build/stress/<time>/:
runs.jsonl (one line per run), cases.jsonl (one line per test or cell of each
run, with its time and outcome) and the output of each failed run. It is not
part of `make test`: it takes as long as its runs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import executed

ROOT = Path(__file__).resolve().parent.parent


def _spin() -> None:
    while True:
        pass


def _cases(junit: Path) -> list[dict]:
    """Every test case in a junit file: its name, time and outcome."""
    if not junit.exists():
        return []
    cases = []
    for case in ET.parse(junit).iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        cases.append({"case": name, "time_s": float(case.get("time", 0)),
                      "outcome": outcome})
    return cases


def _run_once(label: str, args: list[str], out: Path, index: int,
              timeout_s: float) -> dict:
    """One pytest run; keeps its output when it fails or overruns."""
    junit = out / f"junit-{index:03d}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", f"--junitxml={junit}", *args]
    start = time.monotonic()
    try:
        # pytest writes UTF-8 (UTF-8 mode), whatever the locale's encoding.
        env = {**executed.tools_env(), "PYTHONUTF8": "1"}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True,
                              encoding="utf-8", errors="replace", timeout=timeout_s)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        rc = "timeout"
        output = ((err.stdout or b"").decode(errors="replace")
                  + (err.stderr or b"").decode(errors="replace")
                  + f"\n[stress: stopped after {timeout_s:g} s]")
    wall = time.monotonic() - start
    record = {"label": label, "index": index, "rc": rc, "wall_s": round(wall, 1),
              "passed": rc == 0, "cmd": " ".join(cmd[1:])}
    if rc != 0:
        log = out / f"failed-{index:03d}-{Path(label).stem}.log"
        log.write_text(output)
        record["log"] = str(log.relative_to(ROOT))
        record["failed"] = [line for line in output.splitlines()
                            if line.startswith(("FAILED", "ERROR"))][:20]
    cases = _cases(junit)
    junit.unlink(missing_ok=True)
    with open(out / "cases.jsonl", "a") as f:
        for case in cases:
            f.write(json.dumps({"label": label, "index": index, **case}) + "\n")
    with open(out / "runs.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f} {max(values):7.1f}"


def summarize(out: Path, slowest: int = 15) -> str:
    """The distribution of a finished (or interrupted) stress directory."""
    runs = [json.loads(line) for line in open(out / "runs.jsonl")]
    cases = ([json.loads(line) for line in open(out / "cases.jsonl")]
             if (out / "cases.jsonl").exists() else [])
    lines = [f"# {out.relative_to(ROOT)}", "",
             "target                                   runs pass  median   worst (s)"]
    by_label: dict[str, list[dict]] = {}
    for run in runs:
        by_label.setdefault(run["label"], []).append(run)
    for label, group in by_label.items():
        ok = sum(r["passed"] for r in group)
        lines.append(f"{label[:40]:40} {len(group):4} {ok:4}  "
                     f"{_fmt([r['wall_s'] for r in group])}")
    failed = [r for r in runs if not r["passed"]]
    if failed:
        lines += ["", "failed runs:"]
        for r in failed:
            lines.append(f"- {r['label']} run {r['index']} rc={r['rc']} "
                         f"after {r['wall_s']} s: {r.get('log')}")
            lines += [f"    {name}" for name in r.get("failed", [])]
    by_case: dict[str, list[dict]] = {}
    for case in cases:
        by_case.setdefault(case["case"], []).append(case)
    flaky = {name: group for name, group in by_case.items()
             if any(c["outcome"] == "failed" for c in group)}
    if flaky:
        lines += ["", "cases that failed at least once (failed/runs):"]
        for name, group in sorted(flaky.items()):
            bad = sum(c["outcome"] == "failed" for c in group)
            lines.append(f"- {name}: {bad}/{len(group)}")
    ranked = sorted(by_case.items(), key=lambda kv: -max(c["time_s"] for c in kv[1]))
    if ranked:
        lines += ["", "slowest cases by worst time: median and worst (s), "
                  f"of {len(runs)} runs"]
        for name, group in ranked[:slowest]:
            lines.append(f"{_fmt([c['time_s'] for c in group])}  {name}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("unit", "lessons"))
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--busy", type=int, default=0,
                        help="cores to keep spinning in other processes meanwhile")
    parser.add_argument("--only", nargs="*", default=None,
                        help="unit: pytest arguments instead of `tests`; "
                             "lessons: these notebooks only")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds one run may take before it counts as stalled")
    parser.add_argument("--summarize", type=Path, default=None,
                        help="only print the summary of an earlier stress directory")
    args = parser.parse_args(argv)
    # Started in the background (`nohup ... &`), this process and every child
    # would ignore SIGINT, and the tests of Ctrl-C would fail for that alone. A
    # handler is not inherited across exec, so the children get the default.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.summarize:
        print(summarize(args.summarize.resolve()))
        return 0
    if args.runs < 1 or args.busy < 0:
        parser.error("--runs must be >= 1 and --busy >= 0")
    out = ROOT / "build" / "stress" / time.strftime(f"%Y%m%d-%H%M%S-{args.what}")
    out.mkdir(parents=True)
    if args.what == "unit":
        targets = [(" ".join(args.only or ["tests"]), args.only or ["tests"])]
    else:
        notebooks = args.only or sorted(str(p.relative_to(ROOT)) for p in
                                        (ROOT / "notebooks").glob("*/*.ipynb"))
        # as make test runs them, each run's copies kept here, not in build/executed
        targets = [(nb, [*executed.nbval_args(out / "executed"), nb])
                   for nb in notebooks]
    (out / "settings.json").write_text(json.dumps(
        {**vars(args), "summarize": None, "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
            encoding="utf-8").stdout.strip(), "cores": os.cpu_count()}, indent=1))
    spinners = [mp.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for s in spinners:
        s.start()
    index = 0
    try:
        for run in range(args.runs):
            for label, target in targets:
                record = _run_once(label, target, out, index, args.timeout)
                index += 1
                state = "ok" if record["passed"] else f"FAILED ({record.get('log')})"
                print(f"[{run + 1}/{args.runs}] {label}: {record['wall_s']} s {state}",
                      flush=True)
    finally:
        for s in spinners:
            s.terminate()
        summary = summarize(out)
        (out / "summary.md").write_text(summary + "\n")
        print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
