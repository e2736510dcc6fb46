"""Lesson 09 (ecosystem): what torchrun hands each process, and FSDP's shards.

Messages below; how a grader answers: labkit.exercises.feedback. `_..._trial`
functions run on the ranks.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .. import models
from ..cluster import torchrun
from .feedback import WrongAnswer, register, right

if TYPE_CHECKING:
    from ..cluster import Ranks

__all__ = ['grade_torchrun_env', 'grade_shard_sizes']

register({  # key: (ja, en)
    "ex_env_rank_local": (
        "{name} の RANK が LOCAL_RANK と同じです。これでは、どのノードにもランク 0 "
        "ができてしまいます。ヒント: RANK は全ノードのプロセスの通し番号です。"
        "このノードより前のノードに、node_rank × nproc_per_node "
        "個のプロセスがあります。",
        "{name} gives RANK equal to LOCAL_RANK, so every node would have a rank 0. "
        "Hint: RANK numbers the processes of all nodes; the nodes before this one run "
        "node_rank × nproc_per_node of them."),
    "ex_env_rank_sum": (
        "{name} の RANK が node_rank + LOCAL_RANK で、ノードの間で番号が重なります "
        "(1 ノードあたり 2 プロセスなら、ノード 0 の 2 番目とノード 1 の 1 番目が"
        "どちらもランク 1)。ヒント: 前の各ノードに nproc_per_node 個ずつ"
        "プロセスがあります。",
        "{name} gives RANK = node_rank + LOCAL_RANK, so nodes share numbers (with 2 "
        "processes a node, node 0's second and node 1's first are both rank 1). Hint: "
        "every node before this one runs nproc_per_node processes."),
    "ex_env_rank_interleaved": (
        "{name} は、ノードを順に巡って番号を付けています "
        "(RANK = LOCAL_RANK × nnodes + node_rank)。ヒント: torchrun は"
        "ノードごとにまとめて番号を付けます。ノード 0 のプロセスが先、"
        "次にノード 1 のプロセス、という順です。",
        "{name} numbers the processes across the nodes in turn (RANK = LOCAL_RANK × "
        "nnodes + node_rank). Hint: torchrun numbers node by node: node 0's processes "
        "first, then node 1's, and so on."),
    "ex_env_rank_nnodes": (
        "{name} の RANK が node_rank × nnodes + LOCAL_RANK です。ヒント: 前の各ノード"
        "にあるのは nnodes 個ではなく、nproc_per_node 個ずつのプロセスです。",
        "{name} gives RANK = node_rank × nnodes + LOCAL_RANK. Hint: every node before "
        "this one runs nproc_per_node processes, not nnodes."),
    "ex_env_rank": (
        "{name} の RANK が違います: {got}。ヒント: RANK はノード 0 "
        "のプロセスから順に付けた、全ノードの通し番号です。",
        "{name} gives other RANKs: {got}. Hint: RANK numbers the processes of all "
        "nodes, node 0's first."),
    "ex_env_local": (
        "{name} の LOCAL_RANK が違います: {got}。ヒント: LOCAL_RANK "
        "はノードの中での番号で、どのノードでも 0 から nproc_per_node − 1 までです "
        "(そのノードの GPU を選ぶのに使います)。",
        "{name} gives other LOCAL_RANKs: {got}. Hint: LOCAL_RANK numbers the "
        "processes within the node, 0 to nproc_per_node − 1 on every node (it picks "
        "the node's GPU)."),
    "ex_env_world_nproc": (
        "{name} の WORLD_SIZE が nproc_per_node で、このノードのプロセスだけを"
        "数えています。ヒント: WORLD_SIZE は全ノードのプロセスの数です。",
        "{name} gives WORLD_SIZE = nproc_per_node, the processes of this node only. "
        "Hint: WORLD_SIZE counts the processes of all nodes."),
    "ex_env_world_nodes": (
        "{name} の WORLD_SIZE が nnodes で、ノードの数を数えています。ヒント: "
        "WORLD_SIZE はプロセスの数で、nnodes × nproc_per_node です。",
        "{name} gives WORLD_SIZE = nnodes, the number of nodes. Hint: WORLD_SIZE "
        "counts processes: nnodes × nproc_per_node."),
    "ex_env_world": (
        "{name} の WORLD_SIZE が違います: {got}。ヒント: WORLD_SIZE "
        "は全ノードのプロセスの数で、どのプロセスでも同じです。",
        "{name} gives another WORLD_SIZE: {got}. Hint: WORLD_SIZE is the number of "
        "processes of all nodes, the same in every process."),
    "ex_env_form": (
        "{name} は、そのノードのプロセスごとに 1 つの dict (キーは RANK、LOCAL_RANK、"
        "WORLD_SIZE、値は数) を並べたリストを返すようにします。",
        "{name} should be a list of one dict per process of the node, with the keys "
        "RANK, LOCAL_RANK and WORLD_SIZE (numbers)."),
    "ex_env_count": (
        "{name} のプロセスが {got} 個ですが、このノードで動くのは {nproc} 個です。"
        "ヒント: このノードのプロセスごとに 1 つ、LOCAL_RANK の順に並べます。",
        "{name} lists {got} processes; the node runs {nproc}. Hint: one entry per "
        "process of this node, in LOCAL_RANK order."),
    "ex_env_real": (
        "ノード {node} について、関数は {got} ですが、実際の torchrun は {real} "
        "でした。",
        "For node {node} the function gives {got}, but the real torchrun gave {real}."),
    "ex_env_ok_formula": (
        "2〜32 プロセスのどの場合も式が合っています。",
        "The formulas agree for 2 to 32 processes."),
    "ex_env_ok": (
        "2〜32 プロセスのどの場合も式が合っています。このマシンで実際の torchrun "
        "(2 ノード × 2 プロセス) を実行した結果も同じでした "
        "({nodes}、WORLD_SIZE 4)。",
        "The formulas agree for 2 to 32 processes, and a real torchrun of 2 nodes × 2 "
        "processes here gave the same ({nodes}; WORLD_SIZE 4)."),
    "ex_shard_whole": (
        "values_held({shape}, {rank}, {n}) = {got} はパラメータ全体です。"
        "全ランクがすべてを持つのは DDP です。ヒント: fully_shard では、各ランクは"
        " 0 番目の次元の自分の分だけを持ちます。",
        "values_held({shape}, {rank}, {n}) = {got} is the whole parameter: every rank "
        "holding everything is DDP. Hint: under fully_shard a rank keeps only its "
        "piece of dimension 0."),
    "ex_shard_even": (
        "values_held({shape}, {rank}, {n}) = {got} は、値の数を均等に分けた数です。"
        "ヒント: fully_shard は torch.chunk と同じく行 (0 番目の次元) ごとに切ります。"
        "1 つの行が分かれることはありません。",
        "values_held({shape}, {rank}, {n}) = {got} is an even share of the values. "
        "Hint: fully_shard cuts whole rows (dimension 0), as torch.chunk does; a row "
        "is never split."),
    "ex_shard_padding": (
        "values_held({shape}, {rank}, {n}) = {got} はパディングまで"
        "数えています。ヒント: torch.chunk では、最後のほうのランクの行は"
        "少ないか、ありません。FSDP2 は all-gather のために内部で同じ大きさに"
        "詰めますが、`to_local()` にあるのは (パディングでない) 実データの行"
        "だけです。",
        "values_held({shape}, {rank}, {n}) = {got} counts padding. Hint: torch.chunk "
        "gives the last ranks fewer rows, or none. FSDP2 pads the pieces to one size "
        "inside for its all-gather, but `to_local()` holds only real rows."),
    "ex_shard_spread": (
        "values_held({shape}, {rank}, {n}) = {got} は、numpy.array_split "
        "のように行をできるだけ均等に配った数です。ヒント: レッスン 02 の `scatter` "
        "と同じく、1 つのチャンクは「行数 ÷ ランク数」の切り上げで、"
        "小さくなるのは最後のチャンクだけです。何も持たないランクもあります。",
        "values_held({shape}, {rank}, {n}) = {got} spreads the rows as evenly as "
        "possible, as numpy.array_split does. Hint: as `scatter` in lesson 02, a "
        "piece holds rows / ranks rounded up, only the last is smaller, and some "
        "ranks may hold nothing."),
    "ex_shard_negative": (
        "values_held({shape}, {rank}, {n}) = {got} が負の数です。ヒント: 最後の"
        "チャンクより後ろのランクは何も持たないので、0 です (`max(0, ...)`)。",
        "values_held({shape}, {rank}, {n}) = {got} is negative. Hint: a rank past the "
        "last piece holds nothing: 0 (`max(0, ...)`)."),
    "ex_shard_floor": (
        "values_held({shape}, {rank}, {n}) = {got} は、行数 ÷ ランク数を切り捨てて"
        "配り、余りを最後のランクに回した数です。ヒント: torch.chunk は 1 つの"
        "チャンクを切り上げで決め、小さくなるのは最後のチャンクだけです。",
        "values_held({shape}, {rank}, {n}) = {got} gives each rank rows / ranks "
        "rounded down and the rest to the last. Hint: torch.chunk rounds a piece up; "
        "only the last piece is smaller."),
    "ex_shard_off": (
        "values_held({shape}, {rank}, {n}) = {got} は fully_shard が持つ数と違います。"
        "ヒント: (このランクが受け持つ 0 番目の次元の行数) × (1 行の値の数) です。",
        "values_held({shape}, {rank}, {n}) = {got} is not what fully_shard holds. "
        "Hint: (the rows of this rank's piece of dimension 0) × (the values in one "
        "row)."),
    "ex_shard_ok": (
        "どの数も合っています。この {n} ランクでの fully_shard の実測 "
        "(Linear(5, 1) の重みは 1 行だけなので、すべてランク 0 にあり、"
        "ほかのランクは何も持ちません) とも、3 ランクと 8 ランクでの小さな MLP "
        "の torch.chunk (8 ランクでは、fc2 の 10 行は 5 ランクにしか行き渡りません) "
        "とも一致しました。",
        "Every count matches: fully_shard measured on these {n} ranks (Linear(5, 1)'s "
        "weight has a single row, all on rank 0; the other ranks hold none of it), "
        "and torch.chunk for the tiny MLP on 3 and 8 ranks (on 8, fc2's 10 rows "
        "reach only 5 ranks)."),
})


_ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


# Each process writes its variables to a file of its own (its printed lines
# could interleave with the others'); GROUP_RANK is its node's rank.
_ENV_SCRIPT = """import json, os, sys
names = ("GROUP_RANK", "RANK", "LOCAL_RANK", "WORLD_SIZE")
with open(os.path.join(sys.argv[1], os.environ["RANK"] + ".json"), "w") as f:
    json.dump({k: int(os.environ[k]) for k in names}, f)
"""


def _torchrun_env(nnodes: int, nproc_per_node: int) -> dict[int, list[dict]]:
    """What a real torchrun run hands each process: {node rank: [env by local rank]}."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "env.py"
        script.write_text(_ENV_SCRIPT)
        nodes = torchrun.run_nodes([str(script), tmp], nnodes=nnodes,
                                    nproc_per_node=nproc_per_node, timeout_s=60)
        envs = [json.loads(f.read_text()) for f in Path(tmp).glob("*.json")]
    if len(envs) != nnodes * nproc_per_node or any(n.returncode for n in nodes):
        raise RuntimeError("torchrun failed:\n" + "\n".join(n.output for n in nodes))
    by_node: dict[int, list[dict]] = {}
    for env in sorted(envs, key=lambda e: e["LOCAL_RANK"]):
        by_node.setdefault(env.pop("GROUP_RANK"), []).append(env)
    return by_node


def _env_mistake(got: list[dict], nnodes: int, nproc: int, node_rank: int,
                 worlds: Callable[[], set]) -> tuple[str, str]:
    """The message key of what `got` (one entry per process) gets wrong, and the
    variable it gets wrong; `worlds()`, the WORLD_SIZEs of a case whose nnodes and
    nproc_per_node differ, tells which of the two a WORLD_SIZE is when they don't."""
    local = list(range(nproc))
    ranks, world = [p["RANK"] for p in got], {p["WORLD_SIZE"] for p in got}
    if ranks != [node_rank * nproc + i for i in local]:
        for key, wrong in (("ex_env_rank_local", local),
                           ("ex_env_rank_sum", [node_rank + i for i in local]),
                           ("ex_env_rank_interleaved",
                            [i * nnodes + node_rank for i in local]),
                           ("ex_env_rank_nnodes",
                            [node_rank * nnodes + i for i in local])):
            if ranks == wrong:
                return key, "RANK"
        return "ex_env_rank", "RANK"
    if [p["LOCAL_RANK"] for p in got] != local:
        return "ex_env_local", "LOCAL_RANK"
    if world == {nnodes} and (nnodes != nproc or worlds() == {_DISTINCT[0]}):
        return "ex_env_world_nodes", "WORLD_SIZE"
    return ("ex_env_world_nproc" if world == {nproc} else "ex_env_world"), "WORLD_SIZE"


# A set-up whose nnodes and nproc_per_node differ: (nnodes, nproc_per_node, node_rank).
_DISTINCT = (4, 8, 3)


def grade_torchrun_env(fn: Callable, real: bool = True) -> None:
    """`fn(nnodes, nproc_per_node, node_rank)`: RANK, LOCAL_RANK, WORLD_SIZE of
    each process of that node; then, unless `real` is False, compared with what a
    real torchrun of 2 nodes × 2 processes hands its processes."""
    for nnodes, nproc, node_rank in ((2, 1, 1), (2, 2, 0), (2, 2, 1), (4, 8, 3)):
        name = f"torchrun_env({nnodes}, {nproc}, {node_rank})"
        answer = fn(nnodes, nproc, node_rank)
        try:
            if answer is None or any(process[k] is None for process in answer
                                     for k in _ENV_KEYS):
                raise WrongAnswer("ex_fill_in", name=name)
            got = [{k: int(process[k]) for k in _ENV_KEYS} for process in answer]
        except (KeyError, TypeError, ValueError):
            raise WrongAnswer("ex_env_form", name=name) from None
        if len(got) != nproc:
            raise WrongAnswer("ex_env_count", name=name, got=len(got), nproc=nproc)
        want = [{"RANK": node_rank * nproc + i, "LOCAL_RANK": i,
                 "WORLD_SIZE": nnodes * nproc} for i in range(nproc)]
        if got != want:
            key, field = _env_mistake(got, nnodes, nproc, node_rank, lambda: {
                int(p["WORLD_SIZE"]) for p in fn(*_DISTINCT)})
            raise WrongAnswer(key, name=name, got=[p[field] for p in got])
    if not real:
        right("ex_env_ok_formula")
        return
    seen = _torchrun_env(2, 2)
    for node_rank, envs in sorted(seen.items()):
        got = [{k: int(p[k]) for k in _ENV_KEYS} for p in fn(2, 2, node_rank)]
        if got != envs:
            raise WrongAnswer("ex_env_real", node=node_rank, got=got, real=envs)
    right("ex_env_ok", nodes="; ".join(
        f"node {n}: RANK {', '.join(str(e['RANK']) for e in envs)}"
        for n, envs in sorted(seen.items())))


def _shard_trial(hidden: int, out_features: int) -> list[tuple[tuple, int]]:
    """Runs on every rank: fully_shard a small MLP; each parameter's shape and the
    number of its values held here."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    torch.manual_seed(0)
    model = models.WideMLP(hidden=hidden, out_features=out_features).to(device)
    fully_shard(model, mesh=init_device_mesh(device, (dist.get_world_size(),)))
    return [(tuple(p.shape), p.to_local().numel()) for p in model.parameters()]


def _chunk_numel(shape: tuple, rank: int, world_size: int) -> int:
    """Values of rank `rank`'s piece when dim 0 is cut as torch.chunk cuts it."""
    pieces = torch.empty(shape[0]).chunk(world_size)
    return (len(pieces[rank]) if rank < len(pieces) else 0) * math.prod(shape[1:])


def grade_shard_sizes(ranks: Ranks, fn: Callable) -> None:
    """`fn(shape, rank, world_size)`: values of a parameter one rank holds under
    fully_shard, measured on the ranks and, for more ranks, by torch.chunk."""
    n = ranks.world_size
    measured = ranks.run(_shard_trial, 5, 1)  # Linear(10, 5), Linear(5, 1): odd rows
    cases = [(shape, rank, n, held) for rank, params in enumerate(measured)
             for shape, held in params]
    cases += [(tuple(p.shape), rank, size, _chunk_numel(tuple(p.shape), rank, size))
              for size in (3, 8) for p in models.MLP().parameters()
              for rank in range(size)]
    for shape, rank, size, want in cases:
        got = fn(shape, rank, size)
        if got is None:
            raise WrongAnswer("ex_fill_in", name="values_held(shape, rank, world_size)")
        if got == want:
            continue
        rows, numel = shape[0], math.prod(shape)
        per_row, piece = numel // rows, -(-rows // size)
        spread = rows // size + (rank < rows % size)
        floor = rows // size if rank < size - 1 else rows - (size - 1) * (rows // size)
        key = next((key for key, value in (
            ("ex_shard_whole", numel), ("ex_shard_even", numel / size),
            ("ex_shard_even", math.ceil(numel / size)),
            ("ex_shard_even", numel // size), ("ex_shard_padding", piece * per_row),
            ("ex_shard_spread", spread * per_row), ("ex_shard_floor", floor * per_row))
            if got == value), "ex_shard_negative" if got < 0 else "ex_shard_off")
        raise WrongAnswer(key, shape=shape, rank=rank, n=size, got=got)
    right("ex_shard_ok", n=n)
