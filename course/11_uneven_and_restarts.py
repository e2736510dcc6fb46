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
# - ランクごとにバッチの数が違うエポックを `Join` で最後まで回し、そのとき各ステップの勾配が何になるかを
#   説明する
# - `DistributedSampler` の水増しがあっても正確な検証の指標を計算する
# - DDP でチェックポイントを保存し、どのランクも最新のものを読むようにする
# - ランクのプロセスが死んだときに何が起きるかを読み、torchrun が起動し直した学習をチェックポイントから
#   続ける
#
# レッスン 10 の約束 (全ランクが同じ集団通信を同じ順に呼ぶ) を、ここではランクが足並みをそろえられない
# ときに守ります。レッスン 10 と同じく、失敗は 2 つのランクでわざと起こし、集団通信は 3 秒で時間切れに
# します。失敗させるセルには `raises-exception` のタグが付いていて、次のセルがどのランクが何で失敗したか
# (`ranks.last_failure`) を確かめます。

# %% [markdown] lang="en" tags=["outcomes"]
# # 11 Ranks out of step: uneven data, checkpoints, a rank that dies
#
# After this lesson you can:
#
# - end an epoch whose ranks hold different numbers of batches with `Join`, and say
#   what gradient each step then uses;
# - compute a validation metric that is exact despite `DistributedSampler`'s padding;
# - save a checkpoint under DDP so that every rank reads the latest one;
# - read what happens when a rank's process dies, and go on from a checkpoint after
#   torchrun restarts the run.
#
# Lesson 10's contract (every rank calls the same collectives in the same order) is
# kept here where the ranks cannot keep in step. As in lesson 10, failures are caused on
# purpose on two ranks and collectives time out after 3 s. The cells that fail on
# purpose are tagged `raises-exception`; the cell after each checks which rank failed and
# how (`ranks.last_failure`).

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
# ランクごとにバッチの数が違うと (データを手で分けた、ランクごとに長さの違う系列がある、など)、最後の
# バッチで困ります。ランク 0 が 5 個、ランク 1 が 4 個のバッチで学習すると、ランク 0 の 5 個目の
# 逆伝播は、もう来ないランク 1 の all-reduce を待ち、ランク 1 はエポックの終わりの `barrier` で
# 待ちます。両方とも時間切れになります。

# %% [markdown] lang="en"
# ## Ranks with different numbers of batches
#
# When ranks hold different numbers of batches (data split by hand, sequences of
# different lengths per rank, ...), the last batch is the trouble. With 5 batches on
# rank 0 and 4 on rank 1, rank 0's fifth backward pass waits for an all-reduce from
# rank 1 that never comes, while rank 1 waits in the `barrier` at the end of the epoch.
# Both time out.

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

# %%
failed = ranks.last_failure
print(sorted(failed))
assert sorted(failed) == [0, 1]
assert "backward" in failed[0] and "barrier" in failed[1]  # where each one waited

# %% [markdown] lang="ja"
# 直し方は、`Join` コンテキストマネージャです (`from torch.distributed.algorithms.join import Join`)。
# 入力を使い切ったランクは `Join` の中で待ち、まだ学習しているランクの all-reduce に 0 の勾配で加わります。

# %% [markdown] lang="en"
# The fix is the `Join` context manager (`from torch.distributed.algorithms.join import
# Join`). A rank that has run out of inputs waits inside `Join` and joins the others'
# all-reduces with zero gradients.

# %% [markdown] lang="ja"
# ### 演習: 不揃いなエポックを最後まで回す
#
# 関数 `train_epoch(model, optimizer, batches)` を書いてください。DDP のモデル `model` を、このランクの
# バッチ `batches` (入力と目標値の組のリスト) で 1 バッチ 1 ステップずつ学習させます (損失は
# `nn.functional.mse_loss`)。ランクごとにバッチの数が違っても、全ランクで最後まで終わるようにします。
# 確認のセルは、ランク 0 に 5 個、ランク 1 に 4 個のバッチを渡して両方のランクで実行し、終わったあとの重みを
# `Join` を使った正しい学習の重みと比べます。関数はランクのエンジンで実行されるので、中で使える名前は
# エンジンにあるもの (上の `%%px` セルで import した `torch`、`nn`、`Join` など) です。

# %% [markdown] lang="en"
# ### Exercise: an uneven epoch that ends
#
# Write `train_epoch(model, optimizer, batches)`: train the DDP model `model` on this
# rank's `batches` (a list of input and target pairs), one step per batch (the loss is
# `nn.functional.mse_loss`), so that the epoch ends on every rank even when the ranks
# hold different numbers of batches. The check runs it on both ranks, with 5 batches on
# rank 0 and 4 on rank 1, and compares the weights after it with those of a correct run
# with `Join`. The function runs on the ranks' engines, so the names it uses are the
# engines' (`torch`, `nn`, `Join`, imported there by the `%%px` cells above).

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
# `Join` の中では、各ステップの勾配は、そのステップのバッチを持つランクの勾配の和を world size で割った
# ものです。ランク 1 が抜けたランク 0 の 5 ステップ目では、ランク 0 の勾配の半分です。下のセルはこれを、
# 1 プロセスで手で計算したものと比べます。`Join` の中では `no_sync` による勾配累積も使えます。2 バッチで
# 1 回の更新 (K = 2) にし、ランク 0 に 6 個のバッチを渡すと、ランク 0 の 3 回目の更新はランク 1 が抜けた
# あとで、`no_sync` の中の逆伝播と同期する逆伝播が続きます。これも手で計算したものと比べます。

# %% [markdown] lang="en"
# ### What `Join` computes
#
# Inside `Join`, each step's gradient is the sum of the gradients of the ranks that have
# a batch for it, divided by the world size: at rank 0's fifth step, without rank 1,
# half of rank 0's own. The cell below compares that with one process computing it by
# hand. Gradient accumulation with `no_sync` works inside `Join` too: with one update
# per 2 batches (K = 2) and 6 batches on rank 0, rank 0's third update comes after rank
# 1 has left, and runs a backward pass inside `no_sync`, then a synchronized one. That
# too is compared with the computation by hand.

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


def by_hand(batches, K):
    """The same in one process: every rank's batches, a rank without any adds zeros."""
    every = [None] * world_size
    dist.all_gather_object(every, batches)
    torch.manual_seed(0)
    alone = nn.Linear(10, 10)
    optimizer = torch.optim.SGD(alone.parameters(), lr=0.1)
    for i in range(0, max(len(b) for b in every), K):
        optimizer.zero_grad()
        for group in (b[i:i + K] for b in every):
            for X, y in group:
                (nn.functional.mse_loss(alone(X), y) / len(group) / world_size).backward()
        optimizer.step()
    return alone


longer = batches + batches[:1] if rank == 0 else batches  # 6 and 4 batches
sent_per_update = [(0, [len(s) for s in sent.steps])]  # K = 0: the first run, no Join
for K, mine in ((1, batches), (2, longer)):
    model, counts = joined(mine, K)
    diff = compare.max_abs_diff(list(model.module.parameters()),
                                list(by_hand(mine, K).parameters()))
    print(f"rank {rank}, K = {K}: |Join - by hand| {diff:.1e}")
    assert diff < 1e-6 and compare.replica_max_diff(model) == 0
    sent_per_update.append((K, counts))

# %% [markdown] lang="ja"
# `Join` がないと、ランク 1 には 5 回目の all-reduce がなく、ランク 0 の 5 回目は相手を待ち続けます。
# `Join` の中では、バッチを使い切ったランク 1 が足りない分を 0 の勾配で呼び (枠)、両方のランクの回数が
# そろいます。K = 2 では、`no_sync` の中の逆伝播は何も送りません。

# %% [markdown] lang="en"
# Without `Join`, rank 1 has no fifth all-reduce, and rank 0's fifth waits for a
# partner. Inside `Join`, rank 1, out of batches, makes up the missing ones with zero
# gradients (framed), so both ranks call as many. With K = 2, the backward inside
# `no_sync` sends nothing.

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
# `DistributedSampler` は、データセットの大きさがランクの数で割り切れないとき、**先頭のサンプルを
# 繰り返して**全ランクのサンプル数をそろえます。検証の指標を各ランクで平均し、さらにランク間で平均すると、
# その分だけ正しい値からずれます。
#
# **予想してから実行:** 9 サンプルを 2 ランクに分けると (`shuffle=False`)、ランク 1 はどのサンプルを
# 受け取るでしょうか?

# %% [markdown] lang="en"
# ### `DistributedSampler`'s padding
#
# When the data set's size does not divide by the number of ranks, `DistributedSampler`
# **repeats samples from the start** so that every rank gets as many. A validation
# metric averaged on each rank and then over the ranks is off by that much.
#
# **Predict, then run:** with 9 samples on 2 ranks (`shuffle=False`), which samples
# does rank 1 get?

# %%
# %%px
from torch.utils.data import DistributedSampler

scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])  # per sample: correct?
sampler = DistributedSampler(range(len(scores)), shuffle=False)
mine = scores[list(sampler)]  # this rank's samples, padding included
means = [torch.empty(1) for _ in range(world_size)]
dist.all_gather(means, mine.mean().reshape(1))
averaged = torch.cat(means).mean().item()
print(f"rank {rank}: samples {list(sampler)}")
if rank == 0:
    print(f"mean of the ranks' means {averaged:.4f}, exact {scores.mean().item():.4f}")
order = list(sampler)
assert order == ([0, 2, 4, 6, 8] if rank == 0 else [1, 3, 5, 7, 0])  # 0 twice
assert abs(averaged - scores.mean().item()) > 0.05

dropped = DistributedSampler(range(len(scores)), shuffle=False, drop_last=True)
order_dropped = list(dropped)
assert order_dropped == ([0, 2, 4, 6] if rank == 0 else [1, 3, 5, 7])  # 8: never
shuffled = DistributedSampler(range(len(scores)), shuffle=True, seed=1)
positions = [None] * world_size
dist.all_gather_object(positions, list(shuffled))
real = [i for r, mine in enumerate(positions) for k, i in enumerate(mine)
        if r + k * world_size < len(scores)]  # the padding rule below
assert sorted(real) == list(range(len(scores)))  # shuffled too: each sample once

# %% [markdown] lang="ja"
# 直し方は 2 つあります。`DistributedSampler(..., drop_last=True)` で余りを捨てる (捨てたサンプルは
# 評価されません) か、水増しのサンプルを除いて、和と個数を all-reduce することです。ランク r の k 番目
# (0 から数える) のサンプルは、`r + k × world_size` がデータセットの大きさ以上なら水増しです
# (シャッフルしても同じです)。

# %% [markdown] lang="en"
# There are two fixes: `DistributedSampler(..., drop_last=True)` drops the remainder (the
# dropped samples are never evaluated), or all-reduce sums and counts without the padding.
# The k-th sample (from 0) of rank r is padding when `r + k × world_size` is at least the
# data set's size (shuffled or not).

# %% tags=["hide-input"]
rows = {"DistributedSampler(9)": ranks.pull("order"),
        "drop_last=True": ranks.pull("order_dropped")}
padding = [("DistributedSampler(9)", r, k) for r, mine in enumerate(rows[
    "DistributedSampler(9)"]) for k in range(len(mine)) if r + k * 2 >= 9]
assert padding == [("DistributedSampler(9)", 1, 4)]  # rank 1's last: sample 0 again
fig = diagrams.collectives(rows, fmt="{:.0f}", shade=False, framed=padding,
                           title="sampler_title")

# %% [markdown] lang="ja"
# ### 演習: 正確な検証の指標
#
# 関数 `exact_mean(values, total)` を書いてください。`values` はこのランクの `DistributedSampler`
# の順のサンプルごとの値 (水増しを含む)、`total` はデータセットの大きさです。データセットの各サンプルを
# ちょうど 1 回ずつ数えた平均を、全ランクで同じ値として返します。全ランクが同時に呼ぶので、
# `dist.all_reduce` が使えます。確認のセルは、いくつかの大きさのデータセットで、1 プロセスで計算した平均と
# 比べます。確認は 2 ランクで行うので、水増しはいつもランク 1 の最後のサンプルです。場所ではなく、上の規則で
# 見分けてください (「最後のランクの最後のサンプルを除く」は、3 ランク以上では間違いですが、確認のセルは
# 正解とします)。

# %% [markdown] lang="en"
# ### Exercise: an exact validation metric
#
# Write `exact_mean(values, total)`. `values` holds this rank's per-sample values in
# `DistributedSampler`'s order (padding included); `total` is the data set's size.
# Return the mean over the data set, each sample counted exactly once, the same on every
# rank. Every rank calls it at the same time, so it can use `dist.all_reduce`. The check
# compares with the mean one process computes, for data sets of several sizes. It runs
# on 2 ranks, where the padding is always rank 1's last sample: tell it by the rule
# above, not by its place ("drop the last rank's last sample" is wrong on 3 ranks or
# more, yet passes the check).

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
# DDP では全ランクが同じ重みを持つので、保存するのは 1 つのランク (ランク 0) だけで十分です。保存するのは
# `model.module.state_dict()` です。DDP そのものの `model.state_dict()` ではキーの先頭に `module.` が付き、
# DDP に包んでいないモデルには読み込めません。ほかのランクは `dist.barrier()` で保存の終わりを待ってから、
# `map_location` (テンソルを置くデバイス。ここでは CPU) を付けて読みます。フォルダはランク 0 が作り、
# その名前を全ランクに配ります。

# %% [markdown] lang="en"
# ## Checkpoints under DDP
#
# Under DDP every rank holds the same weights, so one rank (rank 0) writing is enough.
# Write `model.module.state_dict()`: the DDP wrapper's own `model.state_dict()` puts
# `module.` in front of every name and does not load into a model outside DDP. The other
# ranks wait at `dist.barrier()` until rank 0 is done, then read with `map_location`
# (the device the tensors go to: the CPU here). Rank 0 makes the folder and hands its
# name to every rank.

# %%
# %%px
class TwoHeads(nn.Module):
    """Lesson 10's model: a body, a head, and an auxiliary head left unused."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(10, 16)
        self.head = nn.Linear(16, 10)
        self.aux = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))  # aux: unused, as in lesson 10


X, y = torch.randn(8, 10) + rank, torch.randn(8, 10)  # each rank its own batch


def train_step(m):
    m.zero_grad()
    nn.functional.mse_loss(m(X), y).backward()

# %%
# %%px
import tempfile
from pathlib import Path

from labkit import checks

folder = [tempfile.mkdtemp(prefix="labkit-10-") if rank == 0 else None]
dist.broadcast_object_list(folder, src=0)  # one folder, the same on every rank
path = Path(folder[0]) / "checkpoint.pt"
torch.manual_seed(0)
model = DDP(TwoHeads(), find_unused_parameters=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def train(steps):
    for _ in range(steps):
        train_step(model)  # zero_grad, forward, backward
        optimizer.step()


def save(step):
    if rank == 0:  # one writer: every rank holds the same weights
        torch.save({"model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(), "step": step}, path)


train(10)
save(10)
dist.barrier()  # nobody reads before rank 0 has written
state = torch.load(path, map_location="cpu")
print(f"rank {rank}: step {state['step']}, keys {list(state['model'])[:2]} ...")
assert state["step"] == 10 and torch.equal(state["model"]["body.weight"],
                                           model.module.body.weight)
assert list(model.state_dict())[0] == "module.body.weight"  # the wrapper's names
with checks.expect_error(RuntimeError, match="Missing key"):
    TwoHeads().load_state_dict(model.state_dict())

# %% [markdown] lang="ja"
# `barrier` がないと、ランク 1 がランク 0 より先に読むことがあります。前のチェックポイントがあれば、
# ランク 1 は**エラーなしに古いほうを**読み、ほかのランクと違う重みから続けます。実際の学習では偶然起きる
# この順序を、ここでは `barrier` で作ります。

# %% [markdown] lang="en"
# Without the `barrier`, rank 1 may read before rank 0 has written. With an earlier
# checkpoint in place, rank 1 reads **the old one, without an error**, and goes on from
# other weights than the rest. Here a `barrier` forces the order that chance gives a real
# run.

# %%
# %%px
train(5)  # now at step 15
if rank == 1:
    early = torch.load(path, map_location="cpu")["step"]  # before rank 0 writes
dist.barrier()  # only to force that order here
save(15)
dist.barrier()  # the fix: every rank waits for the writer
late = torch.load(path, map_location="cpu")["step"]
if rank == 1:
    print(f"rank 1 read step {early} too early (no error), step {late} after the barrier")
    assert (early, late) == (10, 15)

# %% [markdown] lang="ja"
# ## 学習の途中で死ぬランク
#
# ランクのプロセスが途中で終わると (メモリ不足、ノードの故障)、ほかのランクは次の集団通信でエラーになります。
# labkit はどのランクのプロセスが死んだかを示し、次のセルの前にランクを起動し直します。新しいプロセス
# には、前に作ったものは何も残っていません。続きから学習するには、チェックポイントが要ります。

# %% [markdown] lang="en"
# ## A rank that dies mid-step
#
# When a rank's process ends mid-training (out of memory, a failed node), the other
# ranks fail in their next collective. labkit names the rank whose process died and
# starts the ranks again before the next cell. Nothing made before is left in the new
# processes: going on from where training was needs a checkpoint.

# %% tags=["raises-exception"]
# %%px
from labkit.cluster import launch

if rank == 1:
    launch.crash()  # SIGKILL to itself (os._exit where the system has no SIGKILL)
dist.all_reduce(torch.ones(1))

# %%
failed = ranks.last_failure
print({r: message.strip().splitlines()[-1][:120] for r, message in failed.items()})
assert "process died" in failed[1]

# %%
# %%px
print(f"rank {rank}: a new process, 'model' defined here: {'model' in globals()}")
assert "model" not in globals()

# %% [markdown] lang="ja"
# ノートブックを使わない学習 (クラスタのジョブなど) では、torchrun が起動し直します。`--max-restarts N` を
# 付けると、ランクのどれかが失敗したとき、全ランクを止めて N 回まで起動し直します。起動し直したランクは
# 最初から始まるので、チェックポイントから続けるのはスクリプトの仕事です。`python -m labkit resume` は、
# 上と同じやり方 (ランク 0 が一時ファイルに書いて名前を変え、全ランクが `barrier` で待つ) で 5 ステップ
# ごとに保存し、起動したときにチェックポイントがあれば読みます。`--die-at 12` では、最初の起動でランク 1 が
# ステップ 12 の前に自分を強制終了します。次のセルは torchrun でこれを 2 回、死なずに、そして死なせて
# 実行し、最後の重みのハッシュを比べます。
#
# **予想してから実行:** 起動し直した学習は、どのステップから続けるでしょうか?

# %% [markdown] lang="en"
# A run without a notebook (a job on a cluster) is restarted by torchrun. With
# `--max-restarts N`, when any rank fails, torchrun stops them all and starts them again,
# up to N times. Restarted ranks begin from the start, so going on from a checkpoint is
# the script's job. `python -m labkit resume` saves every 5 steps the way shown above
# (rank 0 writes a temporary file and renames it, every rank waits at a `barrier`), and
# loads the checkpoint if there is one when it starts. With `--die-at 12`, rank 1 kills
# itself before step 12 on the first attempt. The next cell runs it twice under
# torchrun, once without dying and once dying, and compares the final weights' hashes.
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
# ランク 0 の損失をステップごとに並べます。2 回目の起動はステップ 10 のチェックポイントから始まり、
# ステップ 11 と 12 をやり直して、止まらなかった学習とまったく同じ値をたどります。

# %% [markdown] lang="en"
# Rank 0's loss per step: the second attempt starts from step 10's checkpoint, redoes
# steps 11 and 12, and follows the run that never stopped value for value.

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
# | あるランクだけが古いチェックポイントから続ける (エラーなし) | ランク 0 が保存し終える前に読む | 読んだチェックポイントのステップ | ランク 0 だけが保存し、`barrier` のあとで全ランクが読む |
# | ランクのプロセスが死ぬ | メモリ不足、ノードの故障 | labkit が示すランク、torchrun の終了コード | torchrun の `--max-restarts` とチェックポイント |

# %% [markdown] lang="en"
# ## Symptom, cause, fix
#
# | symptom | cause | how to find it | fix |
# |---|---|---|---|
# | a hang at the end of an epoch | ranks with different numbers of batches | where each rank waits (backward, `barrier`) | `Join` |
# | a validation metric that is off | `DistributedSampler`'s padding | each rank's sample indices | all-reduce sums and counts without the padding, or `drop_last=True` |
# | one rank goes on from an older checkpoint (no error) | reading before rank 0 has written | the step each rank read | rank 0 alone writes; every rank reads after a `barrier` |
# | a rank's process dies | out of memory, a failed node | the rank labkit names; torchrun's exit code | torchrun's `--max-restarts` and a checkpoint |

# %% [markdown] lang="ja" tags=["summary"]
# ## 覚えておくこと
#
# - **バッチの数が違うランクには `Join` を使い**、入力を使い切ったランクは 0 の勾配で all-reduce に加わり、
#   和は world size で割られます。
# - **正確な検証の指標は、`DistributedSampler` の水増しを除いた和と個数を all-reduce して**求めます
#   (`drop_last=True` なら余りのサンプルは評価されません)。
# - **チェックポイントはランク 0 だけが `model.module.state_dict()` を保存し、全ランクが `barrier` のあとで
#   読みます**。待たずに読むと、エラーなしに古いチェックポイントを読むことがあります。
# - **起動し直したランクには何も残らないので**、torchrun の `--max-restarts` とチェックポイントを組み合わせ、
#   学習を 1 ビットも違わずに続けます。

# %% [markdown] lang="en" tags=["summary"]
# ## What to remember
#
# - **Ranks with different numbers of batches need `Join`**: a rank out of inputs joins
#   the all-reduces with zero gradients, and the sum is divided by the world size.
# - **An exact metric all-reduces sums and counts without `DistributedSampler`'s
#   padding** (with `drop_last=True` the remainder is never evaluated).
# - **Rank 0 alone writes `model.module.state_dict()`, and every rank reads after a
#   `barrier`**: reading without waiting can give an older checkpoint, without an error.
# - **A restarted rank keeps nothing**, so torchrun's `--max-restarts` with a checkpoint
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
