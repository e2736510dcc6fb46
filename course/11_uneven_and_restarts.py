# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown] lang="ja" tags=["outcomes"]
# # 11 足並みがそろわないランク: 不揃いなデータ、チェックポイント、落ちるランク
#
# このレッスンを終えると、次のことができます。
#
# - ランクごとにバッチの数が違うエポックを `Join` で最後まで回し、各ステップの勾配が何になるかを説明する
# - `DistributedSampler` の水増しがあっても正確な検証の指標を計算する
# - DDP でチェックポイントを保存し、どのランクも最新のものを読むようにする
# - ランクが死んで torchrun が起動し直した学習を、チェックポイントから続ける
#
# 失敗はレッスン 10 と同じく、わざと起こします (タグ `raises-exception`)。

# %% [markdown] lang="en" tags=["outcomes"]
# # 11 Ranks out of step: uneven data, checkpoints, a rank that dies
#
# After this lesson you can:
#
# - end an epoch whose ranks hold different numbers of batches with `Join`, and say
#   what gradient each step uses;
# - compute a validation metric exact despite `DistributedSampler`'s padding;
# - save a checkpoint under DDP so that every rank reads the latest one;
# - go on from a checkpoint after torchrun restarts a run whose rank died.
#
# As in lesson 10, failures are caused on purpose (cells tagged `raises-exception`).

# %%
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %%
from labkit import cluster, diagrams, exercises

ranks = cluster.start(2, timeout_s=3)  # a collective waits 3 s at most

# %%
# %%px
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join  # the fix of the first section
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import comm_counting, compare

# %% [markdown] lang="ja"
# ## ランクごとに数の違う入力
#
# ランク 0 に 5 個、ランク 1 に 4 個のバッチがあると、ランク 0 の 5 個目の逆伝播は来ない all-reduce を待ち、
# ランク 1 はエポックの終わりの `barrier` で待ちます。

# %% [markdown] lang="en"
# ## Ranks with different numbers of batches
#
# With 5 batches on rank 0 and 4 on rank 1, rank 0's fifth backward waits for an
# all-reduce that never comes, while rank 1 waits in the `barrier` ending the epoch.

# %% tags=["raises-exception"]
# %%px
g = torch.Generator().manual_seed(rank)
batches = [(torch.randn(4, 10, generator=g), torch.randn(4, 10, generator=g))
           for _ in range(5 - rank)]  # rank 0: 5 batches, rank 1: 4
torch.manual_seed(0)
model = DDP(nn.Linear(10, 10))
sent = comm_counting.CommCounter(per_step=True).attach(model)  # DDP's all-reduces
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for X, y in batches:
    sent.step()  # the all-reduces that follow are this update's
    optimizer.zero_grad()
    nn.functional.mse_loss(model(X), y).backward()
    optimizer.step()
dist.barrier()  # the end of the epoch

# %% tags=["hide-input"]
failed = ranks.last_failure
print(sorted(failed))
assert sorted(failed) == [0, 1]
assert "backward" in failed[0] and "barrier" in failed[1]  # where each one waited

# %% [markdown] lang="ja"
# 直し方は `Join` です。その中では、入力を使い切ったランクが 0 の勾配でほかのランクの all-reduce に加わります。

# %% [markdown] lang="en"
# The fix is `Join`: inside it, a rank out of inputs joins the others' all-reduces with
# zero gradients.

# %% [markdown] lang="ja"
# ### 演習: 不揃いなエポックを最後まで回す
#
# `train_epoch(model, optimizer, batches)` を書いてください。DDP のモデル `model` を、このランクのバッチ
# `batches` (入力と目標値の組のリスト) で 1 バッチ 1 ステップずつ学習させ (損失は `nn.functional.mse_loss`)、
# バッチの数が違っても全ランクで終わるようにします。確認のセルは 5 個と 4 個のバッチで重みを正しい学習と
# 比べます。関数はエンジンで実行されます。

# %% [markdown] lang="en"
# ### Exercise: an uneven epoch that ends
#
# Write `train_epoch(model, optimizer, batches)`: train the DDP model `model` on this
# rank's `batches` (a list of input and target pairs), one step per batch (the loss is
# `nn.functional.mse_loss`), so that the epoch ends on every rank whatever the number
# of batches. The check compares the weights with a correct run, on 5 and 4 batches.
# It runs on the engines.

# %% tags=["exercise"]
def train_epoch(model, optimizer, batches):
    """One step per batch of this rank; must end on every rank, whatever the count."""
    for X, y in batches:  # TODO: the rank with fewer batches leaves the others waiting
        optimizer.zero_grad()
        nn.functional.mse_loss(model(X), y).backward()
        optimizer.step()

# %% tags=["solution"]
def train_epoch(model, optimizer, batches):
    """One step per batch of this rank; must end on every rank, whatever the count."""
    with Join([model]):  # a rank out of batches shadows the others' all-reduces
        for X, y in batches:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(X), y).backward()
            optimizer.step()

# %%
exercises.grade_uneven_epoch(ranks, train_epoch)

# %% [markdown] lang="ja"
# ### `Join` が計算するもの
#
# `Join` の中の各ステップの勾配は、ランクの勾配の和を world size で割ったものです。ランク 0 の 5 ステップ目
# では、ランク 0 の勾配の半分です。`no_sync` による勾配累積 (K = 2) も使えます。どちらも 1 プロセスで手で
# 計算したものと比べます。

# %% [markdown] lang="en"
# ### What `Join` computes
#
# Inside `Join`, each step's gradient is the sum of the ranks' gradients divided by the
# world size: at rank 0's fifth step, half of rank 0's own. Accumulation with `no_sync`
# works too (K = 2). Both are compared with one process computing by hand.

# %%
# %%px
from contextlib import nullcontext


def joined(batches, K):
    """A DDP model trained under Join, an update per K batches, and its all-reduces."""
    torch.manual_seed(0)
    model = DDP(nn.Linear(10, 10))
    sent = comm_counting.CommCounter(per_step=True).attach(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([model]):
        for i in range(0, len(batches), K):
            sent.step()
            optimizer.zero_grad()
            group = batches[i:i + K]
            for j, (X, y) in enumerate(group):
                with model.no_sync() if j < len(group) - 1 else nullcontext():
                    (nn.functional.mse_loss(model(X), y) / len(group)).backward()
            optimizer.step()
        sent.step()  # what Join sends for this rank once its batches are done
    return model, [len(s) for s in sent.steps]

# %% tags=["hide-input"]
# %%px
longer = batches + batches[:1] if rank == 0 else batches  # 6 and 4 batches
sent_per_update = [(0, [len(s) for s in sent.steps])]  # K = 0: the first run, no Join
weights = {}  # K: this rank's weights after the epoch under Join
for K, mine in ((1, batches), (2, longer)):
    model, counts = joined(mine, K)
    assert compare.replica_max_diff(model) == 0
    weights[K] = [p.detach() for p in model.module.parameters()]
    sent_per_update.append((K, counts))

# %% tags=["hide-input"]
import torch
from torch import nn

from labkit import compare


def by_hand(every, K):
    """Join's updates in one process on every rank's batches; a rank without any adds zeros."""
    torch.manual_seed(0)
    alone = nn.Linear(10, 10)  # the same initial weights as the ranks'
    for i in range(0, max(len(b) for b in every), K):
        alone.zero_grad()
        for group in (b[i:i + K] for b in every):
            for X, y in group:
                (nn.functional.mse_loss(alone(X), y) / len(group) / len(every)).backward()
        with torch.no_grad():
            for p in alone.parameters():
                p -= 0.1 * p.grad  # SGD, lr 0.1, as on the ranks
    return list(alone.parameters())


weights = ranks.pull("weights")  # per rank: K -> its weights after the epoch
for K, name in ((1, "batches"), (2, "longer")):
    reference = by_hand(ranks.pull(name), K)
    for r, held in enumerate(weights):
        diff = compare.max_abs_diff(held[K], reference)
        print(f"rank {r}, K = {K}: |Join - by hand| {diff:.1e}")
        assert diff < 1e-6

# %% [markdown] lang="ja"
# `Join` の中では、ランク 1 が足りない all-reduce を 0 の勾配で補います (枠)。

# %% [markdown] lang="en"
# Inside `Join`, rank 1 makes up the missing all-reduces with zero gradients (framed).

# %% tags=["hide-input"]
shown = ranks.pull("sent_per_update")  # per rank: (K, all-reduces of each update)
rows, framed = {}, []
for K, _ in shown[0]:
    label = labkit.t("join_k", k=K) if K else labkit.t("join_without")
    counts = [dict(r)[K] for r in shown]
    if K:  # under Join the last entry: what was sent after the rank's own updates
        assert len({sum(c) for c in counts}) == 1  # as many on every rank
        assert [c[-1] for c in counts] == [0, 1]  # the shadow: rank 1's, of zeros
        framed += [(label, r, len(c) - 1) for r, c in enumerate(counts) if c[-1]]
        counts = [c if c[-1] else c[:-1] for c in counts]
    rows[label] = counts
assert rows[labkit.t("join_without")] == [[1] * 5, [1] * 4]  # rank 0's 5th: alone
fig = diagrams.collectives(rows, fmt="{:.0f}", framed=framed,
                           title="join_sent_title")

# %% [markdown] lang="ja"
# ### `DistributedSampler` の水増し
#
# データセットがランクの数で割り切れないとき、`DistributedSampler` は**先頭のサンプルを繰り返します**。
# ランクごとに平均した指標はずれます。
#
# **予想してから実行:** 9 サンプルを 2 ランクに分けると (`shuffle=False`)、ランク 1 はどのサンプルを
# 受け取るでしょうか?

# %% [markdown] lang="en"
# ### `DistributedSampler`'s padding
#
# When the data set does not divide by the number of ranks, `DistributedSampler`
# **repeats samples from the start**: a metric averaged per rank is off.
#
# **Predict, then run:** with 9 samples on 2 ranks (`shuffle=False`), which samples
# does rank 1 get?

# %%
# %%px
from torch.utils.data import DistributedSampler

scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])  # per sample: correct?
sampler = DistributedSampler(range(len(scores)), shuffle=False)
order = list(sampler)  # this rank's samples, padding included
means = [torch.empty(1) for _ in range(world_size)]
dist.all_gather(means, scores[order].mean().reshape(1))
averaged = torch.cat(means).mean().item()

# %% tags=["hide-input"]
# %%px
print(f"rank {rank}: samples {order}")
if rank == 0:
    print(f"mean of the ranks' means {averaged:.4f}, exact {scores.mean().item():.4f}")
assert order == ([0, 2, 4, 6, 8] if rank == 0 else [1, 3, 5, 7, 0])  # 0 twice
assert abs(averaged - scores.mean().item()) > 0.05
order_dropped = list(DistributedSampler(range(len(scores)), shuffle=False, drop_last=True))
assert order_dropped == ([0, 2, 4, 6] if rank == 0 else [1, 3, 5, 7])  # 8: never
order_shuffled = list(DistributedSampler(range(len(scores)), shuffle=True, seed=1))

# %% [markdown] lang="ja"
# 直し方は、`drop_last=True` で余りを捨てる (そのサンプルは評価されません) か、水増しを除いて和と個数を
# all-reduce することです。ランク r の k 番目 (0 から) のサンプルは、`r + k × world_size` がデータセットの
# 大きさ以上なら水増しです (シャッフルしても同じ)。

# %% [markdown] lang="en"
# Two fixes: `drop_last=True` drops the remainder (never evaluated), or all-reduce sums
# and counts without the padding. Rank r's k-th sample (from 0) is padding when
# `r + k × world_size` is at least the data set's size (shuffled or not).

# %% tags=["hide-input"]
rows = {"DistributedSampler(9)": ranks.pull("order"),
        "drop_last=True": ranks.pull("order_dropped")}
padding = [("DistributedSampler(9)", r, k) for r, mine in enumerate(rows[
    "DistributedSampler(9)"]) for k in range(len(mine)) if r + k * 2 >= 9]
assert padding == [("DistributedSampler(9)", 1, 4)]  # rank 1's last: sample 0 again
shuffled = ranks.pull("order_shuffled")
real = [i for r, mine in enumerate(shuffled) for k, i in enumerate(mine)
        if r + k * len(shuffled) < 9]  # the padding rule
assert sorted(real) == list(range(9))  # shuffled too: each sample once
fig = diagrams.collectives(rows, fmt="{:.0f}", shade=False, framed=padding,
                           title="sampler_title")

# %% [markdown] lang="ja"
# ### 演習: 正確な検証の指標
#
# `exact_mean(values, total)` を書いてください。`values` はこのランクの `DistributedSampler` の順の
# サンプルごとの値 (水増しを含む)、`total` はデータセットの大きさです。各サンプルをちょうど 1 回ずつ数えた
# 平均を全ランクで返します (全ランクが同時に呼ぶので `dist.all_reduce` が使えます)。確認はいくつかの大きさで
# 1 プロセスの平均と比べます。水増しは、2 ランクでの場所 (ランク 1 の最後) ではなく上の規則で見分けてください。

# %% [markdown] lang="en"
# ### Exercise: an exact validation metric
#
# Write `exact_mean(values, total)`. `values` holds this rank's per-sample values in
# `DistributedSampler`'s order (padding included); `total` is the data set's size.
# Return the mean over the data set, each sample once, on every rank (all call it at
# once: use `dist.all_reduce`). The check compares with one process for several sizes.
# Tell the padding by the rule above, not by its place on 2 ranks (rank 1's last).

# %% tags=["exercise"]
def exact_mean(values, total):
    """The mean over the whole data set, each sample once (every rank calls it)."""
    return values.mean()  # TODO: this rank's samples only, padding included

# %% tags=["solution"]
def exact_mean(values, total):
    """The mean over the whole data set, each sample once (every rank calls it)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    k = torch.arange(len(values))
    real = (rank + k * world_size) < total  # False for the padding
    sums = torch.stack([values[real].sum(), real.sum().to(values.dtype)])
    dist.all_reduce(sums)  # the sum and the count over all ranks
    return sums[0] / sums[1]

# %%
exercises.grade_exact_mean(ranks, exact_mean)

# %% [markdown] lang="ja"
# ## DDP でのチェックポイント
#
# 全ランクが同じ重みを持つので、保存はランク 0 だけで十分です。保存するのは `model.module.state_dict()`
# です (DDP の `model.state_dict()` はキーに `module.` が付き、包んでいないモデルに読み込めません)。ほかの
# ランクは `dist.barrier()` で保存の終わりを待ってから、`map_location` を付けて読みます。

# %% [markdown] lang="en"
# ## Checkpoints under DDP
#
# Every rank holds the same weights, so rank 0 writes `model.module.state_dict()` (the
# wrapper's `model.state_dict()` prefixes `module.` and does not load outside DDP). The
# others wait at `dist.barrier()`, then read with `map_location`.

# %%
# %%px
import tempfile
from pathlib import Path

folder = [tempfile.mkdtemp(prefix="labkit-10-") if rank == 0 else None]
dist.broadcast_object_list(folder, src=0)  # one folder, the same on every rank
path = Path(folder[0]) / "checkpoint.pt"
torch.manual_seed(0)
model = DDP(nn.Linear(10, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
X, y = torch.randn(8, 10) + rank, torch.randn(8, 10)  # each rank its own batch


def train(steps):
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(X), y).backward()
        optimizer.step()


def save(step):
    if rank == 0:  # one writer: every rank holds the same weights
        torch.save({"model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(), "step": step}, path)


train(10)
save(10)
dist.barrier()  # nobody reads before rank 0 has written
state = torch.load(path, map_location="cpu")

# %% tags=["hide-input"]
# %%px
from labkit import checks

print(f"rank {rank}: step {state['step']}, keys {list(state['model'])}; "
      f"the wrapper's {list(model.state_dict())}")

assert state["step"] == 10 and torch.equal(state["model"]["weight"], model.module.weight)
assert list(model.state_dict())[0] == "module.weight"  # the wrapper's names
with checks.expect_error(RuntimeError, match="Missing key"):
    nn.Linear(10, 10).load_state_dict(model.state_dict())

# %% [markdown] lang="ja"
# `barrier` がないと、ランク 1 が**エラーなしに古いチェックポイントを**読むことがあります。ここでは
# その順序を `barrier` で作ります。

# %% [markdown] lang="en"
# Without the `barrier`, rank 1 may read **the old checkpoint, without an error**; here a
# `barrier` forces that order.

# %%
# %%px
train(5)  # now at step 15
if rank == 1:
    early = torch.load(path, map_location="cpu")["step"]  # before rank 0 writes
dist.barrier()  # only to force that order here
save(15)
dist.barrier()  # the fix: every rank waits for the writer
late = torch.load(path, map_location="cpu")["step"]

# %% tags=["hide-input"]
# %%px
if rank == 1:
    print(f"rank 1 read step {early} too early (no error), step {late} after the barrier")
    assert (early, late) == (10, 15)

# %% [markdown] lang="ja"
# ## 学習の途中で死ぬランク
#
# ランクのプロセスが途中で終わると (メモリ不足、ノードの故障)、ほかのランクは次の集団通信でエラーになります。
# labkit はランクを起動し直しますが、新しいプロセスには何も残っていません。続けるにはチェックポイントが要ります。

# %% [markdown] lang="en"
# ## A rank that dies mid-step
#
# When a rank's process dies (out of memory, a failed node), the others fail in their
# next collective. labkit starts new ranks, with nothing left: going on needs a
# checkpoint.

# %% tags=["raises-exception"]
# %%px
from labkit.cluster import launch

if rank == 1:
    launch.crash()  # SIGKILL to itself (os._exit where the system has no SIGKILL)
dist.all_reduce(torch.ones(1))

# %% tags=["hide-input"]
failed = ranks.last_failure
print({r: message.strip().splitlines()[-1][:120] for r, message in failed.items()})
assert "process died" in failed[1]

# %% tags=["hide-input"]
# %%px
print(f"rank {rank}: a new process, 'model' defined here: {'model' in globals()}")
assert "model" not in globals()

# %% [markdown] lang="ja"
# クラスタでは torchrun の `--max-restarts N` が、どれかのランクが失敗したとき全ランクを N 回まで起動し
# 直します。チェックポイントから続けるのはスクリプトの仕事です。`python -m labkit resume` は上と同じやり方で
# 5 ステップごとに保存し、起動時に読みます。`--die-at 12` ではランク 1 がステップ 12 の前に死にます。
# 死なない実行と比べます。
#
# **予想してから実行:** 起動し直した学習は、どのステップから続けるでしょうか?

# %% [markdown] lang="en"
# On a cluster, torchrun `--max-restarts N` starts all ranks again, up to N times, when
# one fails; going on from a checkpoint is the script's job. `python -m labkit resume`
# saves every 5 steps as above and loads the checkpoint when it starts; with
# `--die-at 12` rank 1 dies before step 12. Compare with a run that never dies.
#
# **Predict, then run:** from which step does the restarted run go on?

# %%
import json
import tempfile
from pathlib import Path

from labkit.cluster import torchrun

ranks.stop()  # the CPUs go to torchrun's workers
resume = ["-m", "labkit", "resume", "--steps", "20", "--accum", "1",
          "--checkpoint-every", "5"]
die_at = 12
runs = {}
with tempfile.TemporaryDirectory() as tmp:
    for name, dies in (("uninterrupted", []),
                       ("restarted", ["--die-at", str(die_at)])):
        nodes = torchrun.run_nodes(resume + dies + [
            "--checkpoint", f"{tmp}/{name}.pt", "--json", f"{tmp}/{name}.json"],
            nnodes=1, nproc_per_node=2, max_restarts=1)
        assert [n.returncode for n in nodes] == [0], nodes[0].output[-3000:]
        runs[name] = json.loads(Path(tmp, f"{name}.json").read_text())

# %% tags=["hide-input"]
a, b = runs["uninterrupted"], runs["restarted"]
# torchrun's agent reports the first failure it saw: rank 1, killed (-9), or rank 0,
# aborted by the broken connection (-6) or stopped by the agent (-15)
failures = [line for line in nodes[0].output.splitlines() if "failed (exitcode" in line]
print(failures[0][failures[0].index("failed"):])
for name, run in runs.items():
    print(f"{name:13s} {run['param_sha256'][:16]} (attempt {run['attempt']}, "
          f"from step {run['resumed_from']})")
assert a["config"] == b["config"] and (a["attempt"], a["resumed_from"]) == (0, 0)
assert (b["attempt"], b["resumed_from"]) == (1, 10)  # the checkpoint of step 10
assert b["param_sha256"] == a["param_sha256"]  # bit for bit the same weights

# %% [markdown] lang="ja"
# ランク 0 の損失です。起動し直した学習は、ステップ 10 からもう一方と同じ値をたどります。

# %% [markdown] lang="en"
# Rank 0's loss: the restarted run follows the other from step 10.

# %% tags=["hide-input"]
from labkit import plots

n, restart = a["config"]["steps"], b["resumed_from"]
assert len(a["losses"]) == n and a["losses"][-1] < a["losses"][0]  # it learns
assert b["losses"] == a["losses"][restart:]  # the same loss at every step, bit for bit
fig = plots.line_chart(
    {labkit.t("run_uninterrupted"): (range(1, n + 1), a["losses"]),
     labkit.t("run_restarted"): (range(restart + 1, n + 1), b["losses"])},
    xlabel="step", ylabel="loss", title="resume_title",
    marks={labkit.t("restart_mark", s=restart): restart,
           labkit.t("death_mark", r=1): die_at})

# %% [markdown] lang="ja"
# ## 症状、原因、直し方
#
# | 症状 | 原因 | 調べ方 | 直し方 |
# |---|---|---|---|
# | エポックの終わりで止まる | ランクごとにバッチの数が違う | 待っている場所 (逆伝播と `barrier`) | `Join` |
# | 検証の指標がずれる | `DistributedSampler` の水増し | ランクごとのサンプルの番号 | 水増しを除いて和と個数を all-reduce、または `drop_last=True` |
# | あるランクだけ古いチェックポイントから続ける | 保存し終える前に読む | 読んだステップ | ランク 0 が保存し、`barrier` のあとで読む |
# | ランクのプロセスが死ぬ | メモリ不足、ノードの故障 | labkit が示すランク、torchrun の終了コード | torchrun の `--max-restarts` とチェックポイント |

# %% [markdown] lang="en"
# ## Symptom, cause, fix
#
# | symptom | cause | how to find it | fix |
# |---|---|---|---|
# | a hang at the end of an epoch | ranks with different numbers of batches | where each rank waits (backward, `barrier`) | `Join` |
# | a validation metric that is off | `DistributedSampler`'s padding | each rank's sample indices | sums and counts without padding, all-reduced; or `drop_last=True` |
# | one rank goes on from an older checkpoint | reading before rank 0 has written | the step each rank read | rank 0 writes; all read after a `barrier` |
# | a rank's process dies | out of memory, a failed node | the rank labkit names; torchrun's exit code | torchrun's `--max-restarts` and a checkpoint |

# %% [markdown] lang="ja" tags=["summary"]
# ## 覚えておくこと
#
# - **バッチの数が違うランクには `Join` を使います**。入力を使い切ったランクは 0 の勾配で all-reduce に加わります。
# - **正確な検証の指標は、`DistributedSampler` の水増しを除いた和と個数を all-reduce して**求めます
#   (`drop_last=True` なら余りは評価されません)。
# - **ランク 0 だけが `model.module.state_dict()` を保存し、全ランクは `barrier` のあとで読みます**。
#   待たずに読むと、エラーなしに古いチェックポイントを読むことがあります。
# - **起動し直したランクには何も残らないので**、torchrun の `--max-restarts` とチェックポイントで、学習を
#   1 ビットも違わずに続けます。

# %% [markdown] lang="en" tags=["summary"]
# ## What to remember
#
# - **Ranks with different numbers of batches need `Join`**: a rank out of inputs joins
#   the all-reduces with zero gradients.
# - **An exact metric all-reduces sums and counts without `DistributedSampler`'s
#   padding** (or `drop_last=True`, leaving the remainder out).
# - **Rank 0 alone writes `model.module.state_dict()`; every rank reads after a
#   `barrier`**, or may read an older checkpoint without an error.
# - **A restarted rank keeps nothing**: torchrun's `--max-restarts` with a checkpoint
#   resumes a run bit for bit.

# %% [markdown] lang="ja" tags=["self-check"]
# ## 確認問題
#
# 次の 3 問に答えてから先へ進んでください。答えの折りたたみは、自分で答えを決めてから開きます。

# %% [markdown] lang="en" tags=["self-check"]
# ## Self-check
#
# Answer the three questions before reading on; open an answer's fold only after
# answering.

# %% tags=["self-check"]
from labkit import selfcheck

selfcheck.show("11_uneven_and_restarts")

# %% tags=["self-check"]
# Your answers, "a", "b", "c" or "d" for each question; then run this cell.
my_answers = {1: None, 2: None, 3: None}
selfcheck.check("11_uneven_and_restarts", my_answers)
