"""Lesson 03 (ddp): averaging gradients by hand, a one-process loop made a DDP script,
and set_epoch's shuffling.

Messages below; how a grader answers: labkit.exercises.feedback. `_..._trial`
functions run on the ranks; `record_run` runs inside each process torchrun
starts for `grade_ddp_script`, around the learner's script.
"""

from __future__ import annotations

import copy
import json
import os
import runpy
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader, DistributedSampler

from .. import compare, models
from .. import data as datasets
from ..cluster import torchrun
from ..i18n import t
from .feedback import WrongAnswer, off, register, right

if TYPE_CHECKING:
    from ..cluster import Ranks

__all__ = ["grade_average_gradients", "grade_ddp_script", "grade_set_epoch",
           "record_run"]

register({  # key: (ja, en)
    "ex_epochs": ("エポック {epoch} で、ランクの添字が重なっているか、"
                  "欠けているサンプルがあります。ヒント: 全ランクが同じ `seed` "
                  "と同じエポック番号を使えば、1 つの並びを重ならずに分け合います。",
                  "In epoch {epoch} the ranks' indices overlap or miss samples. "
                  "Hint: with the same `seed` and the same epoch number on every "
                  "rank, the ranks share one order without overlap."),
    "ex_epoch_count": ("ランク {rank} の関数が、{num_epochs} エポックに {got} "
                       "個の並びを返しました。ヒント: エポックごとに "
                       "`list(sampler)` を 1 つ返します。",
                       "On rank {rank} the function returned {got} orders for "
                       "{num_epochs} epochs. Hint: return one `list(sampler)` per "
                       "epoch."),
    "ex_repeats": ("エポック {a} と {b} の並びが同じです。ヒント: 各エポックの初めに "
                   "`sampler.set_epoch(epoch)` を呼びます。",
                   "Epochs {a} and {b} have the same order. Hint: call "
                   "`sampler.set_epoch(epoch)` at the start of each epoch."),
    "ex_epochs_ok": ("どのエポックでも、ランクは全 {n} サンプルを重ならずに分け合い、"
                     "並びはエポックごとに変わりました。",
                     "In every epoch the ranks share all {n} samples without "
                     "overlap, and the order changes from epoch to epoch."),
    "ex_grads_apart": ("ランクの勾配が {diff:.1e} 違います。各ランクの `.grad` は、"
                       "まだ自分の分のデータの勾配です。ヒント: 各パラメータの "
                       "`p.grad` そのものを `dist.all_reduce` します (コピーを "
                       "all-reduce しても `p.grad` は変わりません)。",
                       "The ranks' gradients differ by {diff:.1e}: each `.grad` "
                       "still holds its own share's gradient. Hint: all-reduce each "
                       "parameter's `p.grad` itself (all-reducing a copy leaves "
                       "`p.grad` as it was)."),
    "ex_grads_one_rank": (
        "ランク {good} の勾配は全体バッチの勾配になりましたが、ランク {bad} "
        "はなっていません。ヒント: どのランクも同じ行を実行します。"
        "`if rank == 0:` の中に置いた処理は、ほかのランクでは起きません。",
        "Rank {good} got the whole batch's gradient, rank {bad} did not. Hint: "
        "every rank runs the same lines; what sits under `if rank == 0:` happens "
        "on no other rank."),
    "ex_grads_summed": (
        "勾配が全体バッチの勾配のちょうど {ratio:.0f} 倍です。ヒント: all-reduce "
        "は全ランクの値を足し合わせます。平均にするには world size で割ります。",
        "The gradients are exactly {ratio:.0f} times the whole batch's. Hint: "
        "all-reduce adds up the ranks' values; divide by the world size for their "
        "mean."),
    "ex_mean_hint": ("平均 = 全ランクの和 ÷ world size です。",
                     "the mean is the ranks' sum divided by the world size."),
    "ex_grads_ok": ("どのランクの勾配も、全体バッチの勾配と同じになりました。DDP "
                    "が逆伝播の中で行っていることです。",
                    "Every rank's gradient equals the whole batch's: what DDP does "
                    "during backward."),
})


def _epoch_trial(fn: Callable, n: int, num_epochs: int) -> list[list[int]]:
    """Runs on every rank: the learner's index lists, one per epoch."""
    orders = fn(datasets.MyDataset(n=n), dist.get_rank(), dist.get_world_size(),
                num_epochs)
    return [[int(i) for i in order] for order in orders]


def grade_set_epoch(ranks: Ranks, fn: Callable, n: int = 16,
                    num_epochs: int = 3) -> None:
    """`fn(dataset, rank, world_size, num_epochs)`: a rank's indices in each epoch."""
    per_rank = ranks.run(_epoch_trial, fn, n, num_epochs)
    for rank, orders in enumerate(per_rank):
        if len(orders) != num_epochs:
            raise WrongAnswer("ex_epoch_count", rank=rank, got=len(orders),
                              num_epochs=num_epochs)
    for epoch in range(num_epochs):
        seen = [i for orders in per_rank for i in orders[epoch]]
        if len(seen) != n or set(seen) != set(range(n)):
            raise WrongAnswer("ex_epochs", epoch=epoch)
    for b in range(1, num_epochs):
        for a in range(b):
            if all(orders[a] == orders[b] for orders in per_rank):
                raise WrongAnswer("ex_repeats", a=a, b=b)
    right("ex_epochs_ok", n=n)


def _average_trial(fn: Callable) -> dict:
    """Runs on every rank: its share's gradient averaged by `fn`, vs the whole batch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = models.MLP()
    local, criterion = copy.deepcopy(model), models.MyLoss()
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(64, 10, generator=g), torch.randn(64, 10, generator=g)
    criterion(model(datasets.shard(X, rank, world_size)),
              datasets.shard(y, rank, world_size)).backward()
    fn(model, world_size)
    criterion(local(X), y).backward()
    grad, want = compare.flat(compare.grads(model)), compare.flat(compare.grads(local))
    return {"apart": compare.rank_max_diff(grad),
            "diff": compare.max_abs_diff(grad, want),
            "ratio": (grad @ want / (want @ want)).item()}


def grade_average_gradients(ranks: Ranks, fn: Callable) -> None:
    """`fn(model, world_size)`: every `.grad` becomes the mean over the ranks."""
    results = ranks.run(_average_trial, fn)
    r = results[0]
    if r["apart"] > 0:
        good = [rank for rank, x in enumerate(results) if x["diff"] <= 1e-6]
        if good:  # right on some ranks only: work done on one rank
            raise WrongAnswer("ex_grads_one_rank", good=good[0], bad=next(
                rank for rank, x in enumerate(results) if x["diff"] > 1e-6))
        raise WrongAnswer("ex_grads_apart", diff=r["apart"])
    if r["diff"] > 1e-6:
        if abs(r["ratio"] - ranks.world_size) < 1e-3:
            raise WrongAnswer("ex_grads_summed", ratio=r["ratio"])
        raise off("p.grad", r["diff"], "ex_mean_hint")
    right("ex_grads_ok")


# --- the learner's DDP script, run under torchrun -------------------------------

# What the exercise's one-process loop trains: the DDP script must reach the same
# weights with a global batch of BATCH samples, BATCH // world_size per rank.
N, BATCH, NUM_EPOCHS, LR = 256, 64, 2, 0.05
WORLD_SIZE = 2

register({  # key: (ja, en)
    "ex_script_missing": (
        "ファイル {name} がありません。ヒント: 演習のセル "
        "(`%%writefile` で始まるセル) を先に実行します。",
        "There is no file {name}. Hint: run the exercise cell (the one starting "
        "with `%%writefile`) first."),
    "ex_script_failed": (
        "スクリプトが torchrun の下で失敗しました。失敗したランクの最後の行:\n{err}",
        "The script failed under torchrun. The last lines of the failing rank:\n"
        "{err}"),
    "ex_script_no_init": (
        "スクリプトが `dist.init_process_group` を呼んでいません。"
        "2 つのプロセスはそれぞれ独りで学習しました。ヒント: 最初に "
        "`dist.init_process_group(backend)` を呼びます。"
        "相手の場所は torchrun が環境変数で渡します。",
        "The script never calls `dist.init_process_group`: the two processes each "
        "trained alone. Hint: call `dist.init_process_group(backend)` first; torchrun "
        "hands over where to meet in environment variables."),
    "ex_script_no_ddp": (
        "モデルが `DDP(model)` で包まれていません。勾配が平均されず、"
        "ランクごとに違う更新をします。ヒント: `model = DDP(model)` を、"
        "オプティマイザを作る前に書きます。",
        "The model is never wrapped in `DDP(model)`: no gradient is averaged and each "
        "rank makes its own update. Hint: `model = DDP(model)`, before the optimizer "
        "is built."),
    "ex_script_no_sampler": (
        "`DistributedSampler` がありません。どのランクも全データを読みます。"
        "ヒント: `sampler = DistributedSampler(dataset)` を作り、"
        "`DataLoader(..., sampler=sampler)` に渡します "
        "(`shuffle=True` は外します)。",
        "There is no `DistributedSampler`: every rank reads all the data. Hint: build "
        "`sampler = DistributedSampler(dataset)` and pass `DataLoader(..., "
        "sampler=sampler)` (drop `shuffle=True`)."),
    "ex_script_set_epoch": (
        "{num_epochs} エポックで `sampler.set_epoch` の引数は {got} でした。"
        "ヒント: 各エポックの初めに `sampler.set_epoch(epoch)` を呼びます。"
        "呼ばなければ毎エポック同じ順番です。",
        "In {num_epochs} epochs `sampler.set_epoch` got {got}. Hint: call "
        "`sampler.set_epoch(epoch)` at the start of each epoch; without it every epoch "
        "repeats one order."),
    "ex_script_batch": (
        "各ランクが {num_epochs} エポックで {got} 回更新しました。"
        "1 プロセスのループは {want} 回です。ヒント: 全体のバッチ {batch} "
        "サンプルを {world_size} ランクで分けるので、各ランクのバッチは "
        "`{batch} // world_size` です。",
        "Each rank made {got} updates in {num_epochs} epochs; the one-process loop "
        "makes {want}. Hint: the global batch of {batch} samples is shared by "
        "{world_size} ranks, "
        "so each rank's batch is `{batch} // world_size`."),
    "ex_script_logs": (
        "ランク {rank} も {count} 行を表示しました。同じ行がランクの数だけ出ます。"
        "ヒント: 表示は `if rank == 0:` の中だけにします。",
        "Rank {rank} printed {count} line(s) too: every line appears once per rank. "
        "Hint: print under `if rank == 0:` only."),
    "ex_script_no_destroy": (
        "スクリプトがプロセスグループを閉じずに終わりました。ヒント: 最後に "
        "`dist.destroy_process_group()` を呼びます。",
        "The script ends without closing the process group. Hint: call "
        "`dist.destroy_process_group()` last."),
    "ex_script_apart": (
        "学習のあと、ランクのパラメータが {diff:.1e} 違います。ヒント: "
        "どのランクも同じ `DDP(model)` で、同じ回数だけ `backward()` と "
        "`optimizer.step()` を行います。",
        "After training the ranks' parameters differ by {diff:.1e}. Hint: every rank "
        "runs `backward()` and `optimizer.step()` on the same `DDP(model)`, the same "
        "number of times."),
    "ex_script_weights": ("2 エポック後の重み", "The weights after 2 epochs"),
    "ex_script_hint": (
        "1 プロセスのループと同じ初期値 (`torch.manual_seed(0)`)、学習率、"
        "データ、エポック数のままにし、変えるのは DDP に要る行だけにします。",
        "keep the one-process loop's seed (`torch.manual_seed(0)`), learning rate, "
        "data and epochs; change only the lines DDP needs."),
    "ex_script_ok": (
        "2 つのプロセスが torchrun の下で学習し、レプリカは一致し、重みは "
        "1 プロセスで全体バッチ ({batch} サンプル) を使った学習と "
        "{diff:.0e} 以内で同じです。",
        "Two processes trained under torchrun, their replicas are equal, and the "
        "weights match one process trained on the whole batch ({batch} samples) to "
        "within {diff:.0e}."),
})


class _CountingOut:
    """sys.stdout that counts the lines a process prints, and passes them on."""

    def __init__(self, out):
        self.out, self.lines = out, 0

    def write(self, text: str) -> int:
        self.lines += text.count("\n")
        return self.out.write(text)

    def __getattr__(self, name):
        return getattr(self.out, name)


def record_run(script: str, out: str) -> None:
    """Runs in each process torchrun starts: the learner's script, watched.

    Records what the script called (the group, DDP, the sampler and set_epoch,
    optimizer steps, lines printed), its error if any, and the optimizer's final
    parameters, into `out`; the script runs with `out` as its working directory.
    """
    rank = int(os.environ["RANK"])
    seen = {"init": 0, "ddp": 0, "samplers": 0, "set_epoch": [], "steps": 0,
            "destroyed": False, "error": None}
    optimizers: list = []
    init, destroy = dist.init_process_group, dist.destroy_process_group

    def watched(cls, name, note):
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            note(self, *args, **kwargs)
            return original(self, *args, **kwargs)
        setattr(cls, name, wrapper)

    def init_group(*args, **kwargs):
        seen["init"] += 1
        return init(*args, **kwargs)

    def destroy_group(*args, **kwargs):
        seen["destroyed"] = True
        return destroy(*args, **kwargs)

    dist.init_process_group, dist.destroy_process_group = init_group, destroy_group
    watched(DDP, "__init__", lambda *a, **k: seen.__setitem__("ddp", seen["ddp"] + 1))
    watched(DistributedSampler, "__init__",
            lambda *a, **k: seen.__setitem__("samplers", seen["samplers"] + 1))
    watched(DistributedSampler, "set_epoch",
            lambda self, epoch: seen["set_epoch"].append(int(epoch)))
    watched(torch.optim.Optimizer, "__init__",
            lambda self, *a, **k: optimizers.append(self))
    register_optimizer_step_post_hook(
        lambda *a: seen.__setitem__("steps", seen["steps"] + 1))
    stdout = sys.stdout = _CountingOut(sys.stdout)
    os.chdir(out)
    failed = False
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        failed = done.code not in (None, 0)
        if failed:
            seen["error"] = f"SystemExit({done.code!r})"
    except BaseException:  # the script's own error: recorded, then the exit code 1
        seen["error"] = traceback.format_exc(limit=-3)
        failed = True
    finally:
        sys.stdout = stdout.out
        seen["lines"] = stdout.lines
        params = [p.detach().cpu() for opt in optimizers[:1]
                  for group in opt.param_groups for p in group["params"]]
        torch.save(params, Path(out) / f"params{rank}.pt")
        (Path(out) / f"seen{rank}.json").write_text(json.dumps(seen))
        if dist.is_initialized():  # so that the process exits, the script's fault aside
            destroy()
    if failed:
        sys.exit(1)


_WATCH = """import sys
from labkit.exercises.l03_ddp import record_run
record_run(sys.argv[1], sys.argv[2])
"""


def _one_process() -> list[torch.Tensor]:
    """The exercise's loop on one process, whole batches of BATCH, in the order a
    DistributedSampler of one replica gives: the weights the DDP script must reach."""
    torch.manual_seed(0)
    model = models.MLP()
    criterion = models.MyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    dataset = datasets.TeacherDataset(n=N, seed=0)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, seed=0)
    for epoch in range(NUM_EPOCHS):
        sampler.set_epoch(epoch)
        for X, y in DataLoader(dataset, batch_size=BATCH, sampler=sampler):
            optimizer.zero_grad()
            criterion(model(X), y).backward()
            optimizer.step()
    return [p.detach() for p in model.parameters()]


def _first_traceback(output: str) -> str:
    """The first traceback in torchrun's output (a worker's, printed before the
    agent's summary), or the output's end when there is none."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Traceback")),
                 None)
    if start is None:
        return output
    end = next((i for i in range(start + 1, len(lines))
                if lines[i] and not lines[i][0].isspace()), len(lines) - 1)
    return "\n".join(lines[start:end + 1])


def grade_ddp_script(path: str | os.PathLike = "ddp_train.py",
                     timeout_s: float = 300.0) -> None:
    """Run the script at `path` under torchrun on WORLD_SIZE processes and check it
    against the one-process loop; no process is left behind, even on a timeout."""
    script = Path(path).resolve()
    if not script.is_file():
        raise WrongAnswer("ex_script_missing", name=str(script))
    with tempfile.TemporaryDirectory() as out:
        watch = Path(out) / "watch.py"  # each process: record_run around the script
        watch.write_text(_WATCH)
        node, = torchrun.run_nodes([str(watch), str(script), out], nnodes=1,
                                   nproc_per_node=WORLD_SIZE, timeout_s=timeout_s)
        seen, params = [], []
        for rank in range(WORLD_SIZE):
            f = Path(out) / f"seen{rank}.json"
            seen.append(json.loads(f.read_text()) if f.exists() else None)
            p = Path(out) / f"params{rank}.pt"
            params.append(torch.load(p) if p.exists() else [])
    failed = next((s for s in seen if s is None or s["error"]), False)
    if failed is not False or node.returncode != 0:
        if failed and not failed["init"]:
            raise WrongAnswer("ex_script_no_init")
        tail = failed["error"] if failed else _first_traceback(node.output)
        raise WrongAnswer("ex_script_failed",
                          err="\n".join(tail.strip().splitlines()[-8:]))
    first = seen[0]
    if not first["init"]:
        raise WrongAnswer("ex_script_no_init")
    if not first["ddp"]:
        raise WrongAnswer("ex_script_no_ddp")
    if not first["samplers"]:
        raise WrongAnswer("ex_script_no_sampler")
    if first["set_epoch"] != list(range(NUM_EPOCHS)):
        raise WrongAnswer("ex_script_set_epoch", num_epochs=NUM_EPOCHS,
                          got=first["set_epoch"])
    want = NUM_EPOCHS * N // BATCH
    if first["steps"] != want:
        raise WrongAnswer("ex_script_batch", got=first["steps"], want=want,
                          num_epochs=NUM_EPOCHS, batch=BATCH, world_size=WORLD_SIZE)
    for rank, s in enumerate(seen[1:], start=1):
        if s["lines"]:
            raise WrongAnswer("ex_script_logs", rank=rank, count=s["lines"])
    if not all(s["destroyed"] for s in seen):
        raise WrongAnswer("ex_script_no_destroy")
    if not params[0] or any(len(p) != len(params[0]) for p in params):
        raise WrongAnswer("ex_script_no_ddp")  # no optimizer, or not the same model
    apart = max(compare.max_abs_diff(params[0], p) for p in params[1:])
    if apart > 0:
        raise WrongAnswer("ex_script_apart", diff=apart)
    diff = compare.max_abs_diff(params[0], _one_process())
    if diff > 1e-5:
        raise off(t("ex_script_weights"), diff, "ex_script_hint")
    right("ex_script_ok", batch=BATCH, diff=1e-5)
