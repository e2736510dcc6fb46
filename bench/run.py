"""Benchmarks of the course: launch, loop overhead, scaling, cost model, course time.

    python bench/run.py [--quick] [--only course|levers|sharding|crossover|localsgd]
        --json FILE [--record]

Speed lives here, never in tests. Alternatives are measured side by side in
one run and reported as ratios, since the machine is shared and noisy.
--record rewrites the table in bench/README.md with this run's figures; with
--only course, levers, sharding, crossover or localsgd, only those rows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOALS = {  # metric: (comparison, target), from the course's performance goals
    "launch_warm_s": ("<=", 0.02),
    "launch_cold_over_accelerate": ("<=", 1.0),
    "launch_speedup_warm_vs_cold": (">=", 10.0),
    "loop_overhead_ratio": ("<=", 1.03),
    "scaling_efficiency_2proc": (">=", 0.8),
    "nosync_model_max_rel_error": ("<=", 0.20),
    "levers_model_max_rel_error": ("<=", 0.20),
    "course_exec_s_ja": ("<=", 300.0),
    "course_exec_s_en": ("<=", 300.0),
}
LANGS = ("ja", "en")
COURSE_KEYS = [f"course_exec_s_{lang}" for lang in LANGS]


def first_step(hidden: int = 100, depth: int = 1) -> float:
    """On each rank: build a DDP model and take one training step."""
    import time

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit import models

    model = DDP(models.WideMLP(hidden=hidden, depth=depth))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    models.MyLoss()(model(torch.randn(32, 10)), torch.randn(32, 10)).backward()
    opt.step()
    return time.perf_counter()


def cold_launch() -> float:
    """Seconds from asking for 2 ranks on a fresh cluster to their first step.

    Fresh engines and controller, forked from this process's fork server
    (labkit.cluster.forkserver), which an earlier start left running.
    """
    from labkit import cluster

    t0 = time.perf_counter()
    ranks = cluster.start(2, activate=False)
    ranks.run(first_step)
    cold = time.perf_counter() - t0
    ranks.stop()
    return cold


def first_launch() -> float:
    """cold_launch in a new process that has imported torch: the fork server's
    start included, as a kernel's first start pays it."""
    return float(_in_new_process("--first-launch")[-1])


def _in_new_process(flag: str) -> list[str]:
    """Run this script with `flag` (see main) in a new process; what it printed."""
    out = subprocess.run([sys.executable, __file__, flag], check=True,
                         capture_output=True, text=True, timeout=300)
    return out.stdout.split()


def accelerate_step() -> None:
    """On each process of accelerate.debug_launcher: first_step through Accelerate."""
    import torch
    from accelerate import Accelerator

    from labkit import models

    accelerator = Accelerator(cpu=True)
    model = models.WideMLP(hidden=100, depth=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = accelerator.prepare(model, opt)
    accelerator.backward(models.MyLoss()(model(torch.randn(32, 10)),
                                         torch.randn(32, 10)))
    opt.step()


def accelerate_launch() -> float | None:
    """Seconds for one accelerate.debug_launcher call (2 processes forked from
    this one) that takes first_step's step; None without Accelerate."""
    try:
        from accelerate import debug_launcher
    except ImportError:
        return None
    t0 = time.perf_counter()
    debug_launcher(accelerate_step, num_processes=2)
    return time.perf_counter() - t0


def accelerate_fresh() -> list[float] | None:
    """Two accelerate_launch calls in a new process that has imported torch and
    Accelerate, but not torch._dynamo (DDP's constructor imports it in each
    forked process); None without Accelerate."""
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return None
    return [float(x) for x in _in_new_process("--accelerate-fresh")[-2:]]


def lightning_launch() -> float | None:
    """Seconds for one Trainer.fit of one step with Lightning's ddp_notebook
    strategy (2 processes forked from this one); None without Lightning."""
    try:
        import lightning as L
    except ImportError:
        return None
    import logging

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from labkit import models

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = models.WideMLP(hidden=100, depth=1)

        def training_step(self, batch, _):
            x, y = batch
            return models.MyLoss()(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    logging.getLogger("lightning").setLevel(logging.ERROR)
    data = DataLoader(TensorDataset(torch.randn(64, 10), torch.randn(64, 10)),
                      batch_size=32)
    environment = dict(os.environ)
    t0 = time.perf_counter()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_notebook",
                        max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(), data)
    seconds = time.perf_counter() - t0
    # Trainer.fit leaves MASTER_PORT and TORCHINDUCTOR_CACHE_DIR set in the
    # calling process; the next labkit start would then replace its fork server
    # (the environment changed).
    os.environ.clear()
    os.environ.update(environment)
    return seconds


def launch_times(repeat: int, cold_repeat: int) -> dict:
    """Asking for 2 ranks until their first DDP step, labkit's and the fork launchers'.

    In each round, in turn: labkit's cold start (fresh engines from the warm fork
    server), accelerate.debug_launcher and Lightning's ddp_notebook from this
    process, which has imported torch._dynamo (as a process that built a DDP
    model or imported Lightning has), and, every other round (each takes a new
    process), labkit's first start and two debug_launcher calls in a new process
    that imported only torch and Accelerate. Then labkit's warm calls.
    """
    import torch._dynamo  # noqa: F401

    from labkit import cluster

    for launcher in ("accelerate", "lightning"):
        # Imported first, as at the top of a notebook: importing Lightning sets
        # PYTORCH_NVML_BASED_CUDA_CHECK, and a fork server started before that
        # would be replaced at the next start (the environment changed).
        try:
            __import__(launcher)
        except ImportError:
            pass
    cold_launch()  # the fork server starts here, as at a kernel's first start
    rounds: dict[str, list] = {"labkit_cold": [], "accelerate_preloaded": [],
                               "lightning_ddp_notebook": [], "labkit_first": [],
                               "accelerate": []}
    for i in range(cold_repeat):
        rounds["labkit_cold"].append(cold_launch())
        rounds["accelerate_preloaded"].append(accelerate_launch())
        rounds["lightning_ddp_notebook"].append(lightning_launch())
        if i % 2 == 0:
            rounds["labkit_first"].append(first_launch())
            rounds["accelerate"].extend(accelerate_fresh() or [None])
    ranks = cluster.start(2, activate=False)
    ranks.run(first_step)
    warm = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        ranks.run(first_step)
        warm.append(time.perf_counter() - t0)
    ranks.stop()
    cold_s, warm_s = statistics.median(rounds["labkit_cold"]), statistics.median(warm)
    results = {"launch_cold_s": cold_s, "launch_warm_s": warm_s,
               "launch_speedup_warm_vs_cold": cold_s / warm_s,
               "launch_first_s": statistics.median(rounds["labkit_first"]),
               "launch_rounds_s": rounds}
    for name in ("accelerate", "accelerate_preloaded", "lightning_ddp_notebook"):
        times = rounds[name]
        if None in times:  # the ecosystem extra is not installed
            results[f"launch_{name}_s"] = results[f"launch_cold_over_{name}"] = None
        else:
            results[f"launch_{name}_s"] = statistics.median(times)
            results[f"launch_cold_over_{name}"] = cold_s / statistics.median(times)
    return results


def loop_ratio(repeat: int, K: int = 4) -> float:
    """On each rank: labkit's accumulation loop against a hand-written one."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from labkit import models, no_sync, workload

    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = workload.Config(accum_steps=K, hidden=512, depth=2, batch_per_rank=256)
    model, _ = workload.wrap(cfg)
    optimizer = workload.make_optimizer(model, cfg)
    dataset = workload.make_dataset(cfg)
    batches = workload.micro_batches(dataset, cfg, 0, rank, world_size)
    criterion = models.MyLoss()

    def labkit_loop():
        optimizer.zero_grad()
        no_sync.accumulate_no_sync(model, criterion, batches)
        optimizer.step()

    def plain_loop():  # the same work, written out as in PyTorch's documentation
        optimizer.zero_grad()
        for i, (X, y) in enumerate(batches):
            if i < K - 1:
                with model.no_sync():
                    (criterion(model(X), y) / K).backward()
            else:
                (criterion(model(X), y) / K).backward()
        optimizer.step()

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    for fn in (labkit_loop, plain_loop):
        timed(fn)  # warm-up
    ratios = []
    for i in range(repeat):  # alternate, and swap who goes first: no order bias
        if i % 2:
            ours = timed(labkit_loop)
            plain = timed(plain_loop)
        else:
            plain = timed(plain_loop)
            ours = timed(labkit_loop)
        ratios.append(ours / plain)
    ratio = torch.tensor(statistics.median(ratios))
    dist.all_reduce(ratio)  # average the two ranks' medians
    return ratio.item() / world_size


def scaling(rounds: int) -> dict | None:
    """On each rank: throughput of 2 ranks over 1 rank, per-rank batch fixed, / 2.

    Each round times one step of rank 0 alone (rank 1 waits), one DDP step of
    both, and one step of both ranks each training its own model, with no
    communication: the ceiling that two processes sharing this machine reach.
    Efficiency and ceiling are medians of the rounds' ratios.
    """
    import statistics
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit import models

    # Samples each rank processes in one step: compute-bound. (With 2048, the
    # 1.1 MB all-reduce, 1.3-3.8 ms, was 5-12% of a 31 ms step.)
    per_rank = 8192

    def trainer(group, ddp=True):
        torch.manual_seed(0)
        model = models.WideMLP(hidden=512, depth=2)
        model = DDP(model, process_group=group) if ddp else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        X, y = torch.randn(per_rank, 10), torch.randn(per_rank, 10)

        def step() -> float:
            t0 = time.perf_counter()
            optimizer.zero_grad()
            models.MyLoss()(model(X), y).backward()
            optimizer.step()
            return time.perf_counter() - t0

        return step

    rank = dist.get_rank()
    solo = dist.new_group([0])
    one = trainer(solo) if rank == 0 else None
    two, apart = trainer(None), trainer(None, ddp=False)
    efficiency, ceiling = [], []
    for _ in range(rounds + 2):  # the first two rounds warm up
        dist.barrier()
        t_one = one() if one is not None else 0.0
        dist.barrier()
        t_two = two()
        dist.barrier()
        t_apart = apart()
        # (2 * per_rank / t_two) / (per_rank / t_one) / 2
        efficiency.append(t_one / t_two)
        ceiling.append(t_one / t_apart)
    if rank != 0:
        return None
    return {"scaling_efficiency_2proc": statistics.median(efficiency[2:]),
            "scaling_ceiling_2proc": statistics.median(ceiling[2:])}


def cost_model(repeat: int) -> dict:
    """On each rank: the step model's worst error over K and two model sizes."""
    import torch.distributed as dist

    from labkit import comm

    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    # A step of the small model lasts milliseconds, where the machine's jitter
    # is largest: it gets three times the rounds (and costs little).
    for name, (hidden, depth, more) in {"doc 004 MLP": (100, 1, 3),
                                        "MLP 1024x3": (1024, 3, 1)}.items():
        times = comm.step_times_by_k(rank, world_size, hidden, depth,
                                     repeat=repeat * more)
        model = comm.fit_step_model(times, fit_on=(1, 2, 4))
        out[name] = {"times": times, "model": model.as_dict(),
                     "max_rel_error": comm.max_rel_error(model, times)}
    return out


# The dialled link of the levers check: the crossover table's latency, and a
# bandwidth at which DDP's all-reduces take twice as long as on the loopback.
LEVERS_LINK = {"alpha_s": 100e-6, "beta_Bps": 5e8}


def levers_over_link(names: tuple, alpha_s: float, beta_Bps: float, steps: int
                     ) -> dict:
    """On each rank: compare_methods with its local steps, over the slow link."""
    from labkit import send_less, slow_link

    with slow_link.SlowLink(alpha_s, beta_Bps):
        return send_less.compare_methods(names, None, steps, True)


def chain_waits(chains: dict) -> dict:
    """On each rank: callback_chain.chain_wait_s per method, on the loopback.

    `chains` maps a method to (numel of each all-reduce, compute per piece).
    """
    from labkit import callback_chain

    # 40 rounds: the chain less its local copy is a difference of two long
    # times, and with 20 it came out negative once under load.
    return {name: callback_chain.chain_wait_s(3, numel, work_s, rounds=40)
            for name, (numel, work_s) in chains.items()}


def chain_shapes(table: dict) -> dict:
    """Per PowerSGD method of a levers table: its all-reduces' numel, its compute
    split evenly over the chain's pieces (its added compute, 4 pieces for 3 calls)."""
    return {name: (row["bytes_per_step"] // 3 // 4,
                   max(0.0, row["added_compute_s"]) / 4)
            for name, row in table.items() if name.startswith("PowerSGD")}


def levers_predictions(both: list[dict], ab, world_size: int = 2,
                       chains: dict | None = None, ab16=None) -> dict:
    """Per method of one compare_methods(..., local=True) run: step, prediction.

    The model with the compute each method adds (its local step minus DDP's,
    DDP + Adam's for ZeRO, the ranks' mean) and without it (bytes only).
    With `chains` (chain_waits' answer), the first also adds what the method's
    all-reduces issued in callbacks cost (callback_chain, measured apart).
    With `ab16` (alpha-beta fitted on float16 all-reduces), it also prices
    fp16's all-reduces by it, and takes what of DDP's communication the
    backward hid (send_less.hidden_s, from DDP's step and local step) as
    hidden by the methods that overlap it too, not by PowerSGD
    (send_less.hides).
    """
    import statistics

    from labkit import callback_chain, send_less

    def local(method: str) -> float:  # the ranks' mean local step
        return statistics.mean(rank[method]["local_step_s"] for rank in both)

    runs, table = both[0], {}
    for name in (name for name in send_less.METHODS if name in runs):
        base_name = "DDP + Adam" if "Adam" in name else "DDP"
        r, base = runs[name], runs[base_name]
        added = local(name) - local(base_name)
        per_call = (chains or {}).get(name, {}).get("per_call_s", 0.0)
        chain = per_call * callback_chain.chained_calls(
            name, r["sent"][-1].all_reduce_calls)
        overlap = {} if ab16 is None else {
            "sent_ab": ab16 if name == "fp16" else None, "hides": send_less.hides(name),
            "ddp_hidden_s": send_less.hidden_s(base["step_s"], local(base_name),
                                               base["sent"][-1], ab, world_size)}
        bytes_only, predicted = (
            send_less.predicted_step_s(base["step_s"], base["sent"][-1],
                                       r["sent"][-1], ab, world_size, *extra, **kw)
            for extra, kw in (((0.0, 0.0), {}), ((added, chain), overlap)))
        table[name] = {"bytes_per_step": r["bytes"][-1], "step_s": r["step_s"],
                       "step_ratio": r["step_s"] / base["step_s"],
                       "local_step_s": [rank[name]["local_step_s"] for rank in both],
                       "added_compute_s": added, "chain_wait_s": chain,
                       "predicted_ratio": predicted / base["step_s"],
                       "bytes_only_ratio": bytes_only / base["step_s"],
                       "error": abs(predicted - r["step_s"]) / r["step_s"],
                       "bytes_only_error": abs(bytes_only - r["step_s"]) / r["step_s"],
                       "final_loss": r["final_loss"]}
    return table


def levers_table(ranks, steps: int) -> dict:
    """Lesson 06's methods on the large MLP, interleaved: bytes, time, the model.

    Per method: bytes per step after PowerSGD's warm-up, the median step time
    over DDP's (both from the same interleaved run; the Adam pair over DDP +
    Adam), and the same ratio predicted by the step model with a compression
    factor (alpha and beta fitted on an all-reduce sweep of this run), with
    the compute the method adds (its step sending nothing, taken in the same
    rounds, minus DDP's) and without it (bytes only). Then the same over the
    dialled link (LEVERS_LINK, slow_link.combined with the fitted model and
    the link's own cost per all-reduce, slow_link.own_cost_s), without ZeRO:
    the link slows all-reduces, not its broadcasts.
    """
    import torch

    from labkit import comm, send_less, slow_link

    both = ranks.run(send_less.compare_methods, send_less.METHODS, None, steps, True)
    sizes = [4**k * 1024 for k in range(2, 8)]
    ab = comm.fit_alpha_beta(sizes, ranks.run(comm.allreduce_sweep, sizes, 5)[0], 2)
    # fp16's all-reduces on their own fit: gloo's float16 sum costs more per byte here
    ab16 = comm.fit_alpha_beta(
        sizes, ranks.run(comm.allreduce_sweep, sizes, 5, torch.float16)[0], 2)
    # PowerSGD's chain of all-reduces in callbacks, measured apart on a chain of
    # its shape (its all-reduces' size, its added compute), never on its steps;
    # on the loopback, and used over the link too, where the link's own delays
    # are in the alpha-beta.
    table = levers_predictions(both, ab)
    chains = ranks.run(chain_waits, chain_shapes(table))[0]
    table = levers_predictions(both, ab, 2, chains, ab16)
    names = tuple(name for name in send_less.METHODS if name != "ZeRO + Adam")
    # Over the link each all-reduce also pays the link's own machinery (the
    # hand-off to its thread and back), measured apart with no delay.
    own = ranks.run(slow_link.own_cost_s)[0]
    alpha, beta = LEVERS_LINK["alpha_s"] + own, LEVERS_LINK["beta_Bps"]
    link = levers_predictions(
        ranks.run(levers_over_link, names, *LEVERS_LINK.values(), steps),
        slow_link.combined(ab, alpha, beta, 2), 2, chains,
        slow_link.combined(ab16, alpha, beta, 2))
    worst = {key: max(row[error] for row in rows.values())
             for key, rows, error in [
                 ("levers_model_max_rel_error", table, "error"),
                 ("levers_bytes_model_max_rel_error", table, "bytes_only_error"),
                 ("levers_link_model_max_rel_error", link, "error"),
                 ("levers_link_bytes_model_max_rel_error", link, "bytes_only_error")]}
    return {"levers": table, "levers_link": link,
            "levers_alpha_beta": {"alpha": ab.alpha, "beta": ab.beta},
            "levers_alpha_beta_fp16": {"alpha": ab16.alpha, "beta": ab16.beta},
            "levers_link_own_cost_s": own, **worst}


# The slow link's bandwidths (bytes/s), slowest first, denser where the
# methods cross (about 0.5-1 GB/s in trial runs), and its latency; loopback
# is measured beside them.
CROSSOVER_BETAS = (1e7, 3e7, 1e8, 2e8, 5e8, 1e9, 2e9, 5e9)
CROSSOVER_ALPHA_S = 100e-6
CROSSOVER_METHODS = ("DDP", "fp16", "PowerSGD r=1")


def crossover_steps(methods: tuple, betas: tuple, alpha_s: float, rounds: int
                    ) -> dict:
    """On each rank: lesson 06's `methods` over the slow link at each beta.

    slow_link.steps_over_links, which lesson 14 runs too: per link (infinity:
    loopback) and method, the median step of interleaved rounds, what went
    over the link per step (bytes, all-reduces) and the delay it added.
    """
    from labkit import slow_link

    return slow_link.steps_over_links(methods, betas, alpha_s, rounds)


def crossover_table(ranks, rounds: int) -> dict:
    """The bandwidth below which fp16 and PowerSGD r=1 beat DDP: measured, predicted.

    Measured: the ratio of medians over the link at each beta, interpolated in
    log beta. Predicted on a fine grid, two ways: lesson 06's step model
    (send_less.predicted_step_s, bytes only) from DDP's step over the link
    (its loopback step plus the link), with the link added to the alpha-beta
    fitted on loopback (slow_link.combined); and each method's measured
    loopback step plus what the link adds to what it sends (all-reduces x
    alpha + bytes / beta).
    """
    import math

    from labkit import comm, send_less, slow_link

    betas, alpha = CROSSOVER_BETAS, CROSSOVER_ALPHA_S
    steps = ranks.run(crossover_steps, CROSSOVER_METHODS, betas, alpha, rounds)[0]
    sizes = [4**k * 1024 for k in range(2, 8)]
    ab = comm.fit_alpha_beta(sizes, ranks.run(comm.allreduce_sweep, sizes, 5)[0], 2)
    loop = steps[math.inf]
    sent = {name: send_less.Sent(loop[name]["bytes"], loop[name]["calls"])
            for name in CROSSOVER_METHODS}
    grid = [10 ** (6 + k / 20) for k in range(121)]  # 1 MB/s to 1 TB/s

    def loopback_plus_link(name: str, beta: float) -> float:
        return (loop[name]["step_s"] + loop[name]["calls"] * alpha
                + loop[name]["bytes"] / beta)

    def model_step(name: str, beta: float) -> float:
        # DDP's step over the link is its loopback step plus the link; the
        # model swaps DDP's communication for the method's, both priced by
        # the fitted all-reduce with the link added (slow_link.combined).
        return send_less.predicted_step_s(loopback_plus_link("DDP", beta), sent["DDP"],
                                          sent[name], slow_link.combined(
                                              ab, alpha, beta, 2), 2)

    def ratios(step, name: str, points) -> list[tuple[float, float]]:
        return [(b, step(name, b) / step("DDP", b)) for b in points]

    def measured(name: str, beta: float) -> float:
        return steps[beta][name]["step_s"]

    table = {}
    for name in CROSSOVER_METHODS[1:]:
        table[name] = {
            "loopback_ratio": loop[name]["step_s"] / loop["DDP"]["step_s"],
            "measured_Bps": slow_link.crossover_bandwidth(
                ratios(measured, name, betas)),
            "predicted_model_Bps": slow_link.crossover_bandwidth(
                ratios(model_step, name, grid)),
            "predicted_loopback_Bps": slow_link.crossover_bandwidth(
                ratios(loopback_plus_link, name, grid)),
        }
    json_beta = {math.inf: "loopback", **{b: f"{b:g}" for b in betas}}
    return {"crossover": table,
            "crossover_steps": {json_beta[b]: v for b, v in steps.items()},
            "crossover_alpha_s": alpha, "crossover_rounds": rounds,
            "crossover_alpha_beta": {"alpha": ab.alpha, "beta": ab.beta}}


def crossover_rounds(quick: bool) -> int:
    return 5 if quick else 15


CROSSOVER_HEADER = "The slow link (slow_link.SlowLink"


def _bps(value: float | None) -> str:
    if value is None:
        return "never"
    return "at every bandwidth" if value == float("inf") else f"{value / 1e6:,.0f} MB/s"


def _crossover_lines(results: dict) -> list[str]:
    """The crossover table, the steps under it, and how they were run."""
    ab, steps = results["crossover_alpha_beta"], results["crossover_steps"]
    lines = ["", f"{CROSSOVER_HEADER}: each all-reduce held alpha + bytes / beta "
             f"after the real one, alpha {results['crossover_alpha_s'] * 1e6:.0f} us; "
             f"lesson 06's large MLP, 2 ranks, {results['crossover_rounds']} "
             f"interleaved rounds per link; {results['date']}, "
             f"{'--quick' if results['quick'] else 'full'}"
             f"{', `--only crossover`' if results.get('only') == 'crossover' else ''}; "
             f"loopback fitted alpha {ab['alpha'] * 1e6:.0f} us, beta "
             f"{ab['beta'] / 1e9:.2f} GB/s). The bandwidth below which the method's "
             "step is shorter than DDP's:", "",
             "| method | step over DDP's, loopback | measured | predicted: step model, "
             "bytes only, link added | predicted: loopback step + link |",
             "|---|---|---|---|---|"]
    fastest = max(float(beta) for beta in steps if beta != "loopback")
    for name, row in results["crossover"].items():
        measured = (f"above {fastest / 1e6:,.0f} MB/s (every link swept)"
                    if row["measured_Bps"] == float("inf")
                    else _bps(row["measured_Bps"]))
        lines.append(f"| {name} | {row['loopback_ratio']:.3f} | {measured} | "
                     f"{_bps(row['predicted_model_Bps'])} | "
                     f"{_bps(row['predicted_loopback_Bps'])} |")
    names = list(next(iter(steps.values())))
    lines += ["", "| link beta | " + " | ".join(f"{n} step (ms)" for n in names)
              + " | DDP: link's delay per step (ms) |",
              "|---|" + "---|" * (len(names) + 1)]
    for beta, row in steps.items():
        label = beta if beta == "loopback" else f"{float(beta) / 1e6:,.0f} MB/s"
        lines.append(f"| {label} | " + " | ".join(
            f"{row[n]['step_s'] * 1e3:.1f}" for n in names)
            + f" | {row['DDP']['link_s'] * 1e3:.1f} |")
    return lines


def _rewrite_results(readme: Path, change: Callable[[list[str]], list[str]]) -> None:
    """Rewrite the lines between bench/README.md's results markers with `change`."""
    text = readme.read_text(encoding="utf-8")
    start, end = text.index(TABLE_START) + len(TABLE_START), text.index(TABLE_END)
    lines = change(text[start:end].strip("\n").split("\n"))
    readme.write_text(text[:start] + "\n" + "\n".join(lines) + "\n" + text[end:],
                      encoding="utf-8")


def _replace_block(lines: list[str], header: str, new: list[str],
                   tables: int = 1) -> list[str]:
    """`lines` with the block that starts at `header` (the blank line before it, the
    header and its `tables` tables, each after a blank line) replaced by `new`, or
    with `new` added at the end when there is no such block yet."""
    if not any(line.startswith(header) for line in lines):
        return lines + new
    first = next(i for i, line in enumerate(lines) if line.startswith(header))
    last = first + 1
    for _ in range(tables):
        while last < len(lines) and not lines[last]:
            last += 1
        while last < len(lines) and lines[last].startswith("|"):
            last += 1
    return lines[:first - 1] + new + lines[last:]


def record_crossover(results: dict, readme: Path) -> None:
    """Replace only the slow link's tables in bench/README.md (add them if absent)."""
    _rewrite_results(readme, lambda lines: _replace_block(
        lines, CROSSOVER_HEADER, _crossover_lines(results), tables=2))


LOCALSGD_HS = (4, 16, 64)
LOCALSGD_ROUNDS = 32  # all-reduces per run: lesson 15's (H = 16, 512 steps)
LOCALSGD_HEADER = "Local SGD and DiLoCo at equal bytes (lesson 15"


def localsgd_runs(Hs: tuple, rounds: int, timing_rounds: int) -> dict:
    """On each rank: DDP, local SGD and DiLoCo at equal bytes sent, per H.

    Lesson 15's task (labkit.local_sgd: the teacher's regression, an MLP of
    width 32, 16 samples per rank and step) and its loops, written again here
    as the lesson writes them in its cells: local SGD averages the parameters
    every H plain-SGD steps (lr 0.1); DDP is local SGD with H = 1 (the lesson
    checks that it is DDP's step, within 1e-6); DiLoCo takes an outer SGD step
    (lr 0.7, momentum 0.9, Nesterov) on the averaged pseudo-gradient every H
    inner steps. Each run makes `rounds` all-reduces of the parameters' size,
    so it takes rounds x H steps. One run of each under CollectiveLog gives
    the bytes and the held-out loss; then `timing_rounds` interleaved rounds
    (timing.interleaved) time every run again, which must reach the same
    loss bit for bit. Per run: this rank's median seconds of the whole run, and
    that over its steps.
    """
    import statistics

    import torch
    import torch.distributed as dist

    from labkit import comm_counting, local_sgd, models, timing

    rank, world_size = dist.get_rank(), dist.get_world_size()
    task = local_sgd.Task()
    dataset = local_sgd.make_dataset(task)
    loss_fn = models.MyLoss()

    def all_reduce_mean(flat: torch.Tensor) -> None:
        flat /= world_size  # divided first, as the lesson and torch's averager do
        dist.all_reduce(flat)

    def train(H: int, steps: int, outer: bool) -> float:
        model = local_sgd.make_model(task)  # the same start on every rank
        params = list(model.parameters())
        inner = torch.optim.SGD(params, lr=0.1)
        global_params = [p.detach().clone() for p in params]  # DiLoCo's θ_global
        outer_opt = torch.optim.SGD(global_params, lr=0.7, momentum=0.9, nesterov=True)
        for step in range(steps):
            X, y = local_sgd.batch(dataset, task, step, rank, world_size)
            inner.zero_grad()
            loss_fn(model(X), y).backward()  # this rank's gradient alone
            inner.step()
            if (step + 1) % H:
                continue
            with torch.no_grad():
                if not outer:  # local SGD: the ranks' mean of the parameters
                    flat = torch.cat([p.reshape(-1) for p in params])
                    all_reduce_mean(flat)
                    offset = 0
                    for p in params:
                        p.copy_(flat[offset:offset + p.numel()].view_as(p))
                        offset += p.numel()
                    continue
                # DiLoCo: Δ = θ_global − mean of θ_local, an outer step, restart
                delta = torch.cat([(g - p).reshape(-1)
                                   for g, p in zip(global_params, params, strict=True)])
                all_reduce_mean(delta)
                offset = 0
                for g in global_params:
                    g.grad = delta[offset:offset + g.numel()].view_as(g).clone()
                    offset += g.numel()
            outer_opt.step()
            with torch.no_grad():
                for g, p in zip(global_params, params, strict=True):
                    p.copy_(g)
        return local_sgd.evaluate(model, dataset, task)

    runs = {("DDP", 1): (1, rounds, False)}
    for H in Hs:
        runs[("local SGD", H)] = (H, rounds * H, False)
        runs[("DiLoCo", H)] = (H, rounds * H, True)
    rows, losses = [], {}
    for (method, H), args in runs.items():
        with comm_counting.CollectiveLog() as log:
            loss = train(*args)
        losses[method, H] = loss
        rows.append({"method": method, "H": H, "steps": args[1],
                     "calls": log.count("all_reduce"), "bytes": log.nbytes(),
                     "ops": sorted({c["op"] for c in log.calls}), "loss": loss})

    def timed_run(key):
        def run_it():
            if train(*runs[key]) != losses[key]:  # the same seeds, the same loss
                raise AssertionError(f"{key}: a second run reached another loss")
        return run_it

    times = timing.interleaved({key: timed_run(key) for key in runs},
                               rounds=timing_rounds, warmup=0,
                               before=lambda _: dist.barrier())
    for row, key in zip(rows, runs, strict=True):
        row["run_s"] = statistics.median(times[key])
        row["step_s"] = row["run_s"] / row["steps"]
    return {"rows": rows, "params": sum(p.numel() for p in
                                        local_sgd.make_model(task).parameters())}


def localsgd_table(ranks, quick: bool) -> dict:
    """DDP, local SGD and DiLoCo at equal bytes: the ranks' rows, the slower step."""
    Hs = LOCALSGD_HS[:2] if quick else LOCALSGD_HS
    timing_rounds = 1 if quick else 3
    both = ranks.run(localsgd_runs, Hs, LOCALSGD_ROUNDS, timing_rounds)
    rows = both[0]["rows"]
    for row, other in zip(rows, both[1]["rows"], strict=True):
        if (row["bytes"], row["loss"]) != (other["bytes"], other["loss"]):
            raise RuntimeError(f"the ranks disagree on {row['method']} H={row['H']}")
        for key in ("run_s", "step_s"):  # the slower rank's
            row[key] = max(row[key], other[key])
    return {"localsgd": rows, "localsgd_rounds": LOCALSGD_ROUNDS,
            "localsgd_timing_rounds": timing_rounds,
            "localsgd_params": both[0]["params"]}


def _localsgd_lines(results: dict) -> list[str]:
    """The table of DDP, local SGD and DiLoCo at equal bytes, and how it was run."""
    rows = results["localsgd"]
    ddp = next(row for row in rows if row["method"] == "DDP")
    lines = ["", f"{LOCALSGD_HEADER}'s task: the teacher's regression, an MLP of "
             f"width 32, {results['localsgd_params']:,} parameters, 2 ranks, 16 "
             "samples per rank and step, plain SGD lr 0.1; DiLoCo's outer step SGD "
             f"lr 0.7, momentum 0.9, Nesterov; each run {results['localsgd_rounds']} "
             "all-reduces of the parameters, counted with CollectiveLog; DDP is "
             f"local SGD with H = 1; {results['date']}, "
             f"{'--quick' if results['quick'] else 'full'}"
             f"{', `--only localsgd`' if results.get('only') == 'localsgd' else ''}; "
             "run and step time: the slower rank's median over "
             f"{results['localsgd_timing_rounds']} interleaved rounds, on this run):",
             "", "| method | H | optimizer steps | all-reduces | bytes sent per rank | "
             "held-out loss (MSE) | over DDP's | run (ms) | step (ms) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['method']} | {row['H']} | {row['steps']:,} | "
                     f"{row['calls']} | {row['bytes']:,} | {row['loss']:.4f} | "
                     f"{row['loss'] / ddp['loss']:.3f} | {row['run_s'] * 1e3:.0f} | "
                     f"{row['step_s'] * 1e3:.3f} |")
    return lines


def record_localsgd(results: dict, readme: Path) -> None:
    """Replace only lesson 15's local SGD table in bench/README.md (or add it)."""
    _rewrite_results(readme, lambda lines: _replace_block(
        lines, LOCALSGD_HEADER, _localsgd_lines(results)))


# Lessons 12 and 13's trainers, by the class each of their cells defines; the cells
# that define them, in the order they run (a %%px cell's source, as the notebook has
# it): lesson 13's FSDP2Adam cell first, since it defines a DDPAdam of its own that
# lesson 12's (the one measured) replaces.
SHARDING_TRAINERS = {"DDP": "DDPAdam", "ZeRO-1": "Zero1", "ZeRO-2": "Zero2",
                     "ZeRO-3": "Zero3", "FSDP2": "FSDP2Adam"}
SHARDING_CELLS = [("13_fsdp2", "class FSDP2Adam:", False),
                  ("12_zero_by_hand",
                   "from labkit import comm_counting, models, sharding", False),
                  ("12_zero_by_hand", "def shard_of_mean_gradient", True),
                  ("12_zero_by_hand", "class DDPAdam:", False),
                  ("12_zero_by_hand", "class Zero1:", False),
                  ("12_zero_by_hand", "class Zero2(", False),
                  ("12_zero_by_hand", "class Zero3Base:", False),
                  ("12_zero_by_hand", "class Zero3(", True)]


def sharding_cells() -> list[str]:
    """Lessons 12 and 13's cells that define their trainers, from the built notebooks.

    Each is found by what it contains; where an exercise and its solution both
    contain it, the solution (tagged "solution") is the one the lesson runs.
    """
    import nbformat

    sources = []
    for stem, marker, solution in SHARDING_CELLS:
        notebook = ROOT / "notebooks" / "en" / f"{stem}.ipynb"
        code = [c for c in nbformat.read(notebook, as_version=4).cells
                if c.cell_type == "code"]
        found = [c.source for c in code if marker in c.source and
                 (not solution or "solution" in c.metadata.get("tags", []))]
        if len(found) != 1:
            raise RuntimeError(f"{notebook.name}: {len(found)} cells contain {marker!r}"
                               f"{' (tagged solution)' if solution else ''}, not 1")
        sources.append(found[0].removeprefix("%%px\n"))
    return sources


def trainer_steps(trainers: dict[str, str], rounds: int, hidden: int = 1024,
                  depth: int = 3, per_rank: int = 64) -> dict:
    """On each rank: lessons 12 and 13's trainers taking turns, a step each, large MLP.

    `trainers` maps a name to the class a lesson cell defined in this rank's
    namespace. Per trainer: the median step time over `rounds` interleaved
    rounds (after two untimed), and one more step's collectives, each call's
    op and bytes, as CollectiveLog saw them, and the bytes this rank writes to
    its sockets in a step (comm.bytes_written_per_call; None without
    /proc/self/io). Torch's DDP gets a comm hook
    (CommCounter, which all-reduces as DDP's default does): its C++ reducer
    would call the process group past the log, the hook calls dist.all_reduce.
    """
    import functools
    import statistics

    import torch
    import torch.distributed as dist

    import __main__  # the ranks' namespace, where the lesson's cells ran
    from labkit import comm, comm_counting, models, timing

    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # one batch for every rank: each takes its part
    X, y = (torch.randn(per_rank * world_size, 10) for _ in range(2))
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    loss_fn = models.MyLoss()
    built = {}
    for name, cls in trainers.items():
        torch.manual_seed(rank)  # the trainers broadcast rank 0's start themselves
        built[name] = getattr(__main__, cls)(models.WideMLP(hidden=hidden, depth=depth))
        if hasattr(built[name], "ddp"):  # before its first forward, as DDP requires
            comm_counting.CommCounter().attach(built[name].ddp)
    steps = {name: functools.partial(t.step, X[mine], y[mine], loss_fn)
             for name, t in built.items()}
    times = timing.interleaved(steps, rounds=rounds, warmup=2,
                               before=lambda _: dist.barrier())
    calls = {}
    for name, step in steps.items():
        with comm_counting.CollectiveLog() as log:
            step()
        calls[name] = [{"op": c["op"], "bytes": c["bytes"]} for c in log.calls]
    # What the step writes to the sockets, as the kernel counts it (Linux only).
    counted = comm.can_count_bytes_written()
    wire = {name: comm.bytes_written_per_call(step, repeat=2) if counted else None
            for name, step in steps.items()}
    return {"step_s": {name: statistics.median(ts) for name, ts in times.items()},
            "calls": calls, "wire": wire, "params": models.count_params(
                models.WideMLP(hidden=hidden, depth=depth))}


def sharding_table(ranks, rounds: int) -> dict:
    """Lessons 12 and 13's trainers on the large MLP, interleaved: time, bytes, model.

    DDP (torch's, with Adam), the lesson's hand-written ZeRO stages 1-3 and its
    FSDP2 class, run from the built notebook's own cells on the ranks. Per
    trainer: each collective's calls and buffer bytes in a step (CollectiveLog's
    measure: a reduce-scatter's input, an all-gather's output), the bytes each
    rank sends in a ring (2(N-1)/N of an all-reduce's buffer, half that of a
    reduce-scatter's or an all-gather's), the same priced as gloo runs it (its
    reduce-scatter all-reduces the whole input), the bytes each rank wrote to
    its sockets in a step (mean of the ranks; None without /proc/self/io), the
    median step time (the slower rank's), and the alpha-beta model's time for
    that step's collectives (alpha and beta fitted on an all-reduce sweep of
    the same run; a reduce-scatter or an all-gather priced as half an
    all-reduce of its buffer, and with the reduce-scatter as a whole one, gloo's).
    """
    import functools

    from labkit import comm

    ranks.execute("import torch.distributed as dist\n"
                  "rank, world_size = dist.get_rank(), dist.get_world_size()")
    for source in sharding_cells():
        ranks.execute(source)
    runs = ranks.run(trainer_steps, SHARDING_TRAINERS, rounds)
    sizes = [4**k * 1024 for k in range(2, 8)]
    ab = comm.fit_alpha_beta(sizes, ranks.run(comm.allreduce_sweep, sizes, 5)[0], 2)
    price = {"all_reduce": ab.time, "reduce_scatter": ab.reduce_scatter_time,
             "all_gather": ab.all_gather_time}
    gloo_price = {**price, "reduce_scatter": functools.partial(
        ab.reduce_scatter_time, implementation="gloo")}
    table = {}
    for name in SHARDING_TRAINERS:
        calls = runs[0]["calls"][name]
        by_op: dict[str, list[int]] = {}
        for c in calls:
            by_op.setdefault(c["op"], []).append(c["bytes"])
        step_s = max(r["step_s"][name] for r in runs)
        predicted = sum(price[c["op"]](c["bytes"], 2) for c in calls)
        sent = sum(c["bytes"] * comm.sent_share(c["op"], 2) for c in calls)
        wire = [r["wire"][name] for r in runs]
        table[name] = {"bytes_per_step": sum(c["bytes"] for c in calls),
                       "sent_per_rank": sent,
                       "sent_per_rank_gloo": sum(
                           c["bytes"] * comm.sent_share(c["op"], 2, "gloo")
                           for c in calls),
                       "wire_per_rank": None if None in wire else sum(wire) / len(wire),
                       "predicted_comm_s_gloo": sum(
                           gloo_price[c["op"]](c["bytes"], 2) for c in calls),
                       "calls": {op: [len(b), sum(b)] for op, b in by_op.items()},
                       "step_s": step_s, "predicted_comm_s": predicted}
    ddp = table["DDP"]
    for row in table.values():
        row["sent_over_ddp"] = row["sent_per_rank"] / ddp["sent_per_rank"]
        row["wire_over_ddp"] = None if row["wire_per_rank"] is None else \
            row["wire_per_rank"] / ddp["wire_per_rank"]
        row["step_over_ddp"] = row["step_s"] / ddp["step_s"]
    return {"sharding": table,
            "sharding_alpha_beta": {"alpha": ab.alpha, "beta": ab.beta},
            "sharding_params": runs[0]["params"], "sharding_rounds": rounds}


def course_exec_s(lang: str) -> dict[str, float]:
    """Seconds to execute each notebook of one language, as `make course` does
    (tools/execute.py: the notebook's folder, its kernel, the same cell timeout)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import execute

    return {notebook.stem: execute.run(notebook)
            for notebook in sorted((ROOT / "notebooks" / lang).glob("*.ipynb"))}


def course_results() -> dict:
    """Both languages' course times, with the load average before and after.

    The load average says how busy the machine was: on a shared one the
    notebooks' times move with it.
    """
    results: dict = {"course_loadavg": {"before": list(os.getloadavg())}}
    for lang in LANGS:
        by_notebook = course_exec_s(lang)
        results[f"course_exec_by_notebook_s_{lang}"] = by_notebook
        results[f"course_exec_s_{lang}"] = sum(by_notebook.values())
    results["course_loadavg"]["after"] = list(os.getloadavg())
    return results


def _machine_and_goals(results: dict) -> dict:
    from labkit import doctor

    report = doctor.collect()
    results["machine"] = {"cpu_cores": report.cpu_cores, "torch": report.torch_version,
                          "python": platform.python_version(),
                          "platform": platform.platform(), "gpus": report.gpus}
    results["date"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    results["goals"] = {k: {"target": f"{op} {v:g}", "met": _met(results[k], op, v)}
                        for k, (op, v) in GOALS.items() if k in results}
    return results


def sharding_rounds(quick: bool) -> int:
    return 20 if quick else 60


def levers_steps(quick: bool) -> int:
    return 40 if quick else 100


def run(quick: bool, only: str | None = None) -> dict:
    if only == "course":
        return _machine_and_goals({"quick": quick, "only": only, **course_results()})
    from labkit import cluster

    if only == "levers":
        ranks = cluster.start(2, activate=False)
        results = {"quick": quick, "only": only,
                   **levers_table(ranks, levers_steps(quick))}
        ranks.stop()
        return _machine_and_goals(results)
    if only == "sharding":
        ranks = cluster.start(2, activate=False)
        results = {"quick": quick, "only": only,
                   **sharding_table(ranks, sharding_rounds(quick))}
        ranks.stop()
        return _machine_and_goals(results)
    if only == "crossover":
        ranks = cluster.start(2, activate=False)
        results = {"quick": quick, "only": only,
                   **crossover_table(ranks, crossover_rounds(quick))}
        ranks.stop()
        return _machine_and_goals(results)
    if only == "localsgd":
        ranks = cluster.start(2, activate=False)
        results = {"quick": quick, "only": only, **localsgd_table(ranks, quick)}
        ranks.stop()
        return _machine_and_goals(results)

    repeat = 5 if quick else 15
    results: dict = {"quick": quick}
    results.update(launch_times(repeat, 4 if quick else 8))
    ranks = cluster.start(2, activate=False)
    results["loop_overhead_ratio"] = ranks.run(loop_ratio, 60 * repeat)[0]
    results.update(ranks.run(scaling, 6 * repeat)[0])
    models = ranks.run(cost_model, 15 if quick else 27)[0]
    results.update(levers_table(ranks, levers_steps(quick)))
    results.update(sharding_table(ranks, sharding_rounds(quick)))
    results.update(crossover_table(ranks, crossover_rounds(quick)))
    results.update(localsgd_table(ranks, quick))
    ranks.stop()
    results["nosync_model"] = models
    results["nosync_model_max_rel_error"] = max(m["max_rel_error"]
                                                for m in models.values())
    results.update(course_results())
    return _machine_and_goals(results)


def _met(value: float | None, op: str, target: float) -> bool | None:
    """Whether a goal is met; None for a figure not measured (an extra missing)."""
    if value is None:
        return None
    return value >= target if op == ">=" else value <= target


def _cell(value: float | None) -> str:
    return "absent (`pip install -e .[ecosystem]`)" if value is None else f"{value:.4g}"


def _met_cell(goal: dict | None) -> str:
    if goal is None or goal["met"] is None:
        return ""
    return "yes" if goal["met"] else "no"


TABLE_START, TABLE_END = "<!-- results:start -->", "<!-- results:end -->"


def _metric_row(results: dict, key: str) -> str:
    goal = results["goals"].get(key)
    return (f"| `{key}` | {_cell(results[key])} | "
            f"{goal['target'] if goal else ''} | {_met_cell(goal)} |")


def _course_lines(results: dict) -> list[str]:
    """Each language's seconds per notebook, and how busy the machine was."""
    load = results["course_loadavg"]
    lines = []
    for lang in LANGS:
        per_notebook = results[f"course_exec_by_notebook_s_{lang}"].items()
        lines += ["", f"Seconds per notebook (`course_exec_s_{lang}`): "
                  + ", ".join(f"{name} {sec:.1f}" for name, sec in per_notebook) + "."]
    lines += ["", "Load average (1, 5, 15 min) before the notebooks: "
              + ", ".join(f"{x:.2f}" for x in load["before"]) + "; after: "
              + ", ".join(f"{x:.2f}" for x in load["after"]) + "."]
    return lines


def record_course(results: dict, readme: Path) -> None:
    """Replace only the course's rows and lines of the table in bench/README.md.

    The other rows keep their last full run; a line dates the course's rows.
    """
    _rewrite_results(readme, lambda lines: _course_replaced(lines, results))


def _course_replaced(lines: list[str], results: dict) -> list[str]:
    """`lines` with the course's metric rows and lines put in place of the old."""
    rows = [_metric_row(results, key) for key in COURSE_KEYS]
    kept: list[str] = []
    for line in lines:
        if line.startswith("| `course_exec_s"):
            kept += rows  # where the course's rows stood (one old row becomes two)
            rows = []
        elif not line.startswith(("Seconds per notebook", "Load average",
                                  "Course rows:")):
            kept.append(line)
    kept = [line for i, line in enumerate(kept)  # no blank line left doubled
            if line or (i and kept[i - 1])]
    # The end of the first table, the metrics'.
    table_end = next(i for i, line in enumerate(kept) if line.startswith("|"))
    while table_end < len(kept) and kept[table_end].startswith("|"):
        table_end += 1
    kept[table_end:table_end] = rows  # the table had no course row yet
    m = results["machine"]
    kept[table_end + len(rows):table_end + len(rows)] = [
        "", f"Course rows: {results['date']}, run alone (`--only course`); "
        f"{m['cpu_cores']} CPU cores, torch {m['torch']}.", *_course_lines(results)]
    return kept


LEVERS_KEYS = ["levers_model_max_rel_error", "levers_bytes_model_max_rel_error",
               "levers_link_model_max_rel_error",
               "levers_link_bytes_model_max_rel_error"]
LEVERS_HEADER = "Ways to send less (lesson 06"


def _levers_rows(rows: dict) -> list[str]:
    lines = ["| method | bytes per step | step time over DDP | compute added (ms) | "
             "callback chain (ms) | predicted | error | predicted, bytes only | "
             "error | final loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['bytes_per_step']:,} | "
                     f"{row['step_ratio']:.3f} | {row['added_compute_s'] * 1e3:.2f} | "
                     f"{row.get('chain_wait_s', 0.0) * 1e3:.2f} | "
                     f"{row['predicted_ratio']:.3f} | {row['error']:.3f} | "
                     f"{row['bytes_only_ratio']:.3f} | {row['bytes_only_error']:.3f} | "
                     f"{row['final_loss']:.4f} |")
    return lines


def _levers_lines(results: dict) -> list[str]:
    """Lesson 06's methods on the loopback and on the dialled link, and how run."""
    ab, link = results["levers_alpha_beta"], LEVERS_LINK
    return ["", f"{LEVERS_HEADER}; large MLP, 2 ranks, "
            f"{levers_steps(results['quick'])} interleaved steps; {results['date']}, "
            f"{'--quick' if results['quick'] else 'full'}"
            f"{', `--only levers`' if results.get('only') == 'levers' else ''}; "
            f"alpha {ab['alpha'] * 1e6:.0f} us, beta {ab['beta'] / 1e9:.2f} GB/s"
            + (f", fitted on float16 alpha {ab16['alpha'] * 1e6:.0f} us, beta "
               f"{ab16['beta'] / 1e9:.2f} GB/s"
               if (ab16 := results.get("levers_alpha_beta_fp16")) else "")
            + "; the Adam pair against DDP + Adam; on the loopback):", "",
            *_levers_rows(results["levers"]), "",
            f"The same over the slow link (alpha {link['alpha_s'] * 1e6:.0f} us, "
            f"beta {link['beta_Bps'] / 1e6:.0f} MB/s on top of the loopback; "
            "without ZeRO, whose broadcasts it does not slow):", "",
            *_levers_rows(results["levers_link"])]


def record_levers(results: dict, readme: Path) -> None:
    """Replace only lesson 06's rows and table in bench/README.md.

    The other rows keep their last full run; the table's line dates these.
    """
    _rewrite_results(readme, lambda lines: _levers_replaced(lines, results))


def _levers_replaced(lines: list[str], results: dict) -> list[str]:
    """`lines` with lesson 06's metric rows and tables put in place of the old."""
    rows = [_metric_row(results, key) for key in LEVERS_KEYS]
    kept: list[str] = []
    for line in lines:
        if line.startswith("| `levers_"):
            kept += rows  # where the old row stood
            rows = []
        else:
            kept.append(line)
    first = next(i for i, line in enumerate(kept) if line.startswith(LEVERS_HEADER))
    last = first + 2  # the blank line after the header, then the table's rows
    while last + 1 < len(kept) and kept[last + 1].startswith("|"):
        last += 1
    if kept[last + 1:last + 3] and kept[last + 2].startswith("The same over the slow"):
        last += 4  # the link's table: a blank line, its line, a blank, its header
        while last + 1 < len(kept) and kept[last + 1].startswith("|"):
            last += 1
    kept[first - 1:last + 1] = _levers_lines(results)
    return kept


SHARDING_HEADER = "Sharded data parallelism (lesson 12"


def _sharding_lines(results: dict) -> list[str]:
    """The table of lesson 12's trainers, with the line that says how it was run."""
    ab = results["sharding_alpha_beta"]
    lines = ["", f"{SHARDING_HEADER}'s classes; the large MLP, "
             f"{results['sharding_params']:,} parameters, 2 ranks, "
             f"{results['sharding_rounds']} interleaved rounds; {results['date']}, "
             f"{'--quick' if results['quick'] else 'full'}"
             f"{', `--only sharding`' if results.get('only') == 'sharding' else ''}; "
             f"alpha {ab['alpha'] * 1e6:.0f} us, beta {ab['beta'] / 1e9:.2f} GB/s):",
             "", "| trainer | collectives per step: calls, buffer bytes | bytes each "
             "rank sends, ring | over DDP | written to sockets (gloo) | over DDP | "
             "step time (ms) | over DDP | alpha-beta communication, ring / gloo "
             "(ms) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, row in results["sharding"].items():
        calls = "; ".join(f"{op} {n}, {b:,} B" for op, (n, b) in row["calls"].items())
        wire = ("not counted (no /proc/self/io) | |" if row["wire_per_rank"] is None
                else f"{row['wire_per_rank']:,.0f} | {row['wire_over_ddp']:.3f} |")
        lines.append(f"| {name} | {calls} | {row['sent_per_rank']:,.0f} | "
                     f"{row['sent_over_ddp']:.3f} | {wire} {row['step_s'] * 1e3:.1f} | "
                     f"{row['step_over_ddp']:.3f} | "
                     f"{row['predicted_comm_s'] * 1e3:.1f} / "
                     f"{row['predicted_comm_s_gloo'] * 1e3:.1f} |")
    return lines


def record_sharding(results: dict, readme: Path) -> None:
    """Replace only lesson 12's table in bench/README.md (add it if absent)."""
    _rewrite_results(readme, lambda lines: _replace_block(
        lines, SHARDING_HEADER, _sharding_lines(results)))


def record(results: dict, readme: Path) -> None:
    """Rewrite the results table in bench/README.md."""
    m = results["machine"]
    rows = [f"Last recorded run: {results['date']}, "
            f"{'--quick' if results['quick'] else 'full'}; {m['cpu_cores']} CPU cores, "
            f"torch {m['torch']}, Python {m['python']}, GPUs: "
            f"{', '.join(m['gpus']) or 'none'}.", "",
            "| metric | value | goal | met |", "|---|---|---|---|"]
    for key in ("launch_cold_s", "launch_first_s", "launch_accelerate_s",
                "launch_accelerate_preloaded_s", "launch_lightning_ddp_notebook_s",
                "launch_cold_over_accelerate", "launch_cold_over_accelerate_preloaded",
                "launch_cold_over_lightning_ddp_notebook", "launch_warm_s",
                "launch_speedup_warm_vs_cold",
                "loop_overhead_ratio", "scaling_efficiency_2proc",
                "scaling_ceiling_2proc",
                "nosync_model_max_rel_error", *LEVERS_KEYS,
                *COURSE_KEYS):
        rows.append(_metric_row(results, key))
    rounds = results["launch_rounds_s"]
    rows += ["", "Launch rounds, in the order measured (s): " + "; ".join(
        f"{name} " + ", ".join("-" if t is None else f"{t:.2f}" for t in times)
        for name, times in rounds.items()) + "."]
    rows += _course_lines(results)
    rows += ["", "Cost model (fitted on K = 1, 2, 4; seconds per update, "
             "sync / no_sync):", "", "| model | K | measured | predicted |",
             "|---|---|---|---|"]
    for name, entry in results["nosync_model"].items():
        from labkit.comm import StepModel

        model = StepModel(**entry["model"])
        for k, (sync_s, nosync_s) in sorted(entry["times"].items(), key=lambda kv:
                                            int(kv[0])):
            rows.append(f"| {name} | {k} | {sync_s:.4f} / {nosync_s:.4f} | "
                        f"{model.predict(int(k), False):.4f} / "
                        f"{model.predict(int(k), True):.4f} |")
    rows += _levers_lines(results)
    rows += _sharding_lines(results)
    rows += _crossover_lines(results)
    rows += _localsgd_lines(results)
    _rewrite_results(readme, lambda _: rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--only",
                        choices=("course", "levers", "sharding", "crossover",
                                 "localsgd"),
                        help="measure only this: sharding = lesson 12's trainers "
                             "(the `sharding` table); levers = lesson 06's methods "
                             "(the `levers` table and its model errors); course = "
                             "every notebook of both languages (course_exec_s_ja, "
                             "course_exec_s_en); crossover = DDP, fp16 and "
                             "PowerSGD r=1 over the slow link at several bandwidths "
                             "(the `crossover` tables); localsgd = DDP, local "
                             "SGD and DiLoCo at equal bytes sent (lesson 15)")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--record", action="store_true",
                        help="rewrite the results table in bench/README.md")
    # what launch_times runs in a new process; prints seconds
    parser.add_argument("--first-launch", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--accelerate-fresh", action="store_true",
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.first_launch:
        import torch  # noqa: F401  (a kernel has imported it)

        print(cold_launch(), flush=True)
        return 0
    if args.accelerate_fresh:
        import accelerate  # noqa: F401
        import torch  # noqa: F401

        print(accelerate_launch(), accelerate_launch(), flush=True)
        return 0
    if args.json is None:
        parser.error("--json FILE is required")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    results = run(args.quick, args.only)
    Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n",
                               encoding="utf-8")
    for key, goal in results["goals"].items():
        print(f"{key:32s} {_cell(results[key]):>10s}   goal {goal['target']:8s} "
              f"{ {True: 'met', False: 'NOT met', None: ''}[goal['met']]}")
    if args.record:
        {"course": record_course, "levers": record_levers,
         "sharding": record_sharding, "crossover": record_crossover,
         "localsgd": record_localsgd}.get(
            args.only, record)(
            results, ROOT / "bench" / "README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
