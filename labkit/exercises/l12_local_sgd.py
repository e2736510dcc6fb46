"""Lesson 15 (communicate less often): DiLoCo's outer step, written by the learner.

Messages beside the grader; how a grader answers: labkit.exercises.feedback.
`_outer_trial` runs on the ranks: a few rounds of seeded inner steps, each
followed by the learner's outer step, recording θ_global, the momentum and
θ_local before and after. The truth is computed here, in the kernel, from what
the ranks held before each call; the wrong answers it is compared with serve
only to name the mistake in a hint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..i18n import t
from .feedback import WrongAnswer, register, right

if TYPE_CHECKING:
    from ..cluster import Ranks

__all__ = ["grade_diloco_outer_step"]

register({  # key: (ja, en)
    "ex_dl_undefined": (
        "ランク {rank} に {name} がありません。先に、それを定義する %%px のセルを"
        "実行してください。",
        "Rank {rank} has no {name}: run the %%px cell that defines it first."),
    "ex_dl_round": ("{round} ラウンド目、ランク {rank}",
                    "round {round} on rank {rank}"),
    "ex_dl_sign": (
        "{case}で、θ_global が逆向きに動きました。疑似勾配の符号が逆です。ヒント: "
        "Δ = θ_global − (全ランクの θ_local の平均) です。Δ を勾配として引くので、"
        "θ_global は平均した θ_local のほうへ進みます。",
        "For {case}, θ_global moved the wrong way: the pseudo-gradient's sign is "
        "flipped. Hint: Δ = θ_global − (the ranks' mean of θ_local); subtracting Δ "
        "as a gradient moves θ_global towards the averaged θ_local."),
    "ex_dl_no_average": (
        "{case}で、θ_global がこのランクの疑似勾配だけで動きました。ランクで平均して"
        "いません (ランクごとに θ_global が違ってしまいます)。ヒント: "
        "`dist.all_reduce(delta)` で和をとり、world_size で割ります。",
        "For {case}, θ_global moved by this rank's pseudo-gradient alone: the "
        "average over the ranks is missing (and θ_global now differs between "
        "ranks). Hint: sum with `dist.all_reduce(delta)`, then divide by "
        "world_size."),
    "ex_dl_sum": (
        "{case}で、疑似勾配がランクの平均ではなく和になっています。ヒント: "
        "all-reduce のあと world_size で割ります。",
        "For {case}, the pseudo-gradient is the ranks' sum, not their mean. Hint: "
        "divide by world_size after the all-reduce."),
    "ex_dl_old_momentum": (
        "{case}で、θ_global が lr × (Δ + μ × m) だけ動きましたが、その m が"
        "このラウンドで更新する前のモーメンタムです。更新したあとの m で "
        "θ_global −= lr × m とする、ふつうの (heavy-ball) モーメンタムも同じ値に"
        "なります。ヒント: 先に m = μ × m + Δ と更新し、その新しい m で "
        "θ_global −= lr × (Δ + μ × m) とします (torch.optim.SGD の nesterov=True "
        "と同じ式です)。",
        "For {case}, θ_global moved by lr × (Δ + μ × m) with m the momentum from "
        "before this round's update: Nesterov's step taken before m is updated, "
        "which is also what plain (heavy-ball) momentum, θ_global −= lr × m with m "
        "updated, gives. Hint: update m first, m = μ × m + Δ, then step with the new "
        "m: θ_global −= lr × (Δ + μ × m) (torch.optim.SGD's nesterov=True)."),
    "ex_dl_no_momentum": (
        "{case}で、θ_global が lr × Δ だけ動きました。更新にモーメンタムが入って"
        "いません。ヒント: モーメンタムをその場で更新し (m = μ × m + Δ)、それを"
        "使って θ_global −= lr × (Δ + μ × m) とします。",
        "For {case}, θ_global moved by lr × Δ alone: the step has no momentum in it. "
        "Hint: update the momentum in place, m = μ × m + Δ, and step with it: "
        "θ_global −= lr × (Δ + μ × m)."),
    "ex_dl_local": (
        "{case}で、外側の更新を θ_local (ランクのモデルのパラメータ) に適用して"
        "います。ヒント: 外側のオプティマイザが動かすのは θ_global "
        "(`global_params`) です。モデルはそのあと θ_global をコピーして再開します。",
        "For {case}, the outer update went to θ_local (the rank's model "
        "parameters). Hint: the outer optimizer steps θ_global (`global_params`); "
        "the model then restarts from a copy of θ_global."),
    "ex_dl_no_accumulation": (
        "{case}で、`momentum` が前のラウンドのままです。モーメンタムがラウンドを"
        "またいでたまりません。ヒント: 変数に新しいテンソルを代入し直したり、"
        "ラウンドごとに新しいオプティマイザを作ったりせず、渡された `momentum` を"
        "その場で更新します: `m.mul_(mu).add_(delta)`。",
        "For {case}, `momentum` is what it was before the round: the momentum never "
        "accumulates across rounds. Hint: do not rebind a name to a new tensor or "
        "make a new optimizer every round; update the `momentum` you are given in "
        "place: `m.mul_(mu).add_(delta)`."),
    "ex_dl_no_restart": (
        "{case}で、θ_global は正しいのですが、モデルのパラメータ (θ_local) が "
        "θ_global と違います。ヒント: 外側のステップのあと、どのランクも θ_global から"
        "再開します: `p.copy_(g)`。",
        "For {case}, θ_global is right but the model's parameters (θ_local) differ "
        "from it. Hint: after the outer step every rank restarts from θ_global: "
        "`p.copy_(g)`."),
    "ex_dl_off": (
        "{case}で、θ_global が正解と最大 {diff:.1e} 違います。ヒント: Δ = "
        "θ_global − (全ランクの θ_local の平均)、m = μ × m + Δ、θ_global −= lr × "
        "(Δ + μ × m) の順です。",
        "For {case}, θ_global is off by up to {diff:.1e}. Hint: in this order: "
        "Δ = θ_global − (the ranks' mean of θ_local), m = μ × m + Δ, "
        "θ_global −= lr × (Δ + μ × m)."),
    "ex_dl_ok": (
        "{rounds} ラウンドのどれでも、θ_global とモーメンタムは torch.optim.SGD "
        "(nesterov=True) に平均した疑似勾配を渡したときと同じで、どのランクも "
        "θ_global から再開しました。",
        "In all {rounds} rounds θ_global and the momentum equal torch.optim.SGD's "
        "(nesterov=True) stepped with the averaged pseudo-gradient, and every rank "
        "restarted from θ_global."),
})

_ROUNDS = 3
_LR, _MU = 0.7, 0.9
_TOLERANCE = 1e-5


def _flat(tensors) -> torch.Tensor:
    return torch.cat([x.detach().reshape(-1).clone() for x in tensors])


def _outer_trial(name: str, rounds: int) -> list[dict]:
    """Runs on every rank: seeded inner steps, then the learner's outer step."""
    from IPython import get_ipython
    from torch import nn

    shell = get_ipython()
    rank = dist.get_rank()
    if shell is None or name not in shell.user_ns:
        raise NameError(t("ex_dl_undefined", name=name, rank=rank))
    fn = shell.user_ns[name]
    torch.manual_seed(0)  # the same θ on every rank
    model = nn.Linear(5, 3)
    g = torch.Generator().manual_seed(100 + rank)  # each rank pulled elsewhere
    targets = [torch.randn(p.shape, generator=g) for p in model.parameters()]
    global_params = [p.detach().clone() for p in model.parameters()]
    momentum = [torch.zeros_like(p) for p in global_params]
    out = []
    for _ in range(rounds):
        with torch.no_grad():  # 3 inner steps on a quadratic: towards the target
            for _ in range(3):
                for p, c in zip(model.parameters(), targets, strict=True):
                    p.sub_(0.3 * (p - c))
        record = {"G": _flat(global_params), "M": _flat(momentum),
                  "L": _flat(model.parameters())}
        fn(model, global_params, momentum)
        record |= {"G1": _flat(global_params), "M1": _flat(momentum),
                   "L1": _flat(model.parameters())}
        out.append(record)
    return out


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool((a - b).abs().max() <= _TOLERANCE)


def _judge(k: int, rank: int, records: list[list[dict]]) -> None:
    """Raise WrongAnswer if rank `rank`'s round `k` is not DiLoCo's outer step."""
    r = records[rank][k]
    n = len(records)
    G, M, L = r["G"], r["M"], r["L"]
    own = G - L
    delta = torch.stack([records[i][k]["G"] - records[i][k]["L"]
                         for i in range(n)]).mean(0)
    case = t("ex_dl_round", round=k + 1, rank=rank)

    def nesterov(d):
        m = _MU * M + d
        return G - _LR * (d + _MU * m), m

    want_G, want_M = nesterov(delta)
    if _close(r["G1"], want_G) and _close(r["M1"], want_M):
        if not _close(r["L1"], r["G1"]):
            raise WrongAnswer("ex_dl_no_restart", case=case)
        return
    if _close(r["G1"], G) and _close(r["M1"], M) and _close(r["L1"], L):
        raise WrongAnswer("ex_fill_in", name="diloco_outer_step(...)")
    if _close(r["G1"], G) or _close(r["L1"], L - _LR * (delta + _MU * want_M)):
        raise WrongAnswer("ex_dl_local", case=case)
    plain = G - _LR * delta  # the averaged pseudo-gradient's step, no momentum
    if _close(r["M1"], M) and not _close(M, want_M):
        raise WrongAnswer("ex_dl_no_momentum" if _close(r["G1"], plain)
                          else "ex_dl_no_accumulation", case=case)
    for key, d in (("ex_dl_sign", -delta), ("ex_dl_no_average", own),
                   ("ex_dl_sum", n * delta)):
        if _close(r["G1"], nesterov(d)[0]):
            raise WrongAnswer(key, case=case)
    # Nesterov's step with the momentum before its update, and heavy-ball
    # momentum, both move θ_global by lr × (Δ + μM). With M = 0 (round 1) that
    # is lr × Δ, the step with no momentum at all: a later round tells them apart.
    started = not _close(M, torch.zeros_like(M))
    if started and _close(r["G1"], G - _LR * (delta + _MU * M)):
        raise WrongAnswer("ex_dl_old_momentum", case=case)
    if _close(r["G1"], plain):
        if not started and k + 1 < len(records[rank]):
            _judge(k + 1, rank, records)
        raise WrongAnswer("ex_dl_no_momentum", case=case)
    raise WrongAnswer("ex_dl_off", case=case,
                      diff=(r["G1"] - want_G).abs().max().item())


def grade_diloco_outer_step(ranks: Ranks, name: str = "diloco_outer_step") -> None:
    """The function `name(model, global_params, momentum)`, defined on the ranks by a
    %%px cell: DiLoCo's outer step (lr 0.7, Nesterov momentum 0.9), tried for a
    few rounds after seeded inner steps that pull each rank elsewhere."""
    records = ranks.run(_outer_trial, name, _ROUNDS)
    for k in range(_ROUNDS):
        for rank in range(len(records)):
            _judge(k, rank, records)
    right("ex_dl_ok", rounds=_ROUNDS)
