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
# # 03 DistributedDataParallel
#
# `DistributedDataParallel` (DDP) では、複数の**プロセス** (ランク) がそれぞれ**モデル全体の複製**
# (レプリカ) を持ち、データを分け合って学習します。逆伝播の途中で勾配を all-reduce で平均するので、
# レプリカはいつも同じままです。記事 000 の「各 GPU はモデルのパラメータの一部を保持し」は
# **FSDP** や **ZeRO** の説明です。
#
# このレッスンを終えると、次のことができます。
#
# - broadcast、all-reduce、reduce-scatter、all-gather、barrier の結果を言い当てる
# - 等しいシャードの勾配の平均が全体バッチの勾配である理由を、1 行の式で説明する
# - `DistributedSampler` と `set_epoch` で、重ならないデータを毎エポック新しい順番で配る
# - 学習ループを DDP のスクリプトに書き換え、`torchrun` で起動して、1 プロセスと比べて確かめる

# %% [markdown] lang="en" tags=["outcomes"]
# # 03 DistributedDataParallel
#
# With `DistributedDataParallel` (DDP), several **processes** (ranks) each hold a
# **full copy of the model** (a replica) and share out the data; an all-reduce averages
# the gradients during backward, so the replicas stay identical. Doc 000's "each GPU
# holds part of the model's parameters" describes **FSDP** or **ZeRO**.
#
# After this lesson you can:
#
# - predict what broadcast, all-reduce, reduce-scatter, all-gather and barrier return;
# - say in one line of algebra why equal shards' mean gradient is the whole batch's;
# - give the ranks disjoint data, newly ordered each epoch (`DistributedSampler`,
#   `set_epoch`);
# - turn a training loop into a DDP script, launch it with `torchrun`, and check it
#   against one process.

# %%
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %%
from labkit import cluster

ranks = cluster.start(2, background=True)  # two ranks; they boot while you read on

# %% [markdown] lang="ja" tags=["core"]
# ## ランクを起動する
#
# `cluster.start(2)` は 2 つのエンジン (Python プロセス) を起動し、gloo のプロセスグループに参加させます。
# `%%px` で始まるセルは**全ランクで**実行され、各エンジンには `rank`、`world_size`、`device` があります。
# 次のセルは、ランクごとに別のプロセスであることを確かめます (`torchrun` も GPU 1 台に 1 プロセスです)。

# %% [markdown] lang="en" tags=["core"]
# ## Start the ranks
#
# `cluster.start(2)` starts two engines (Python processes) in a gloo process group. A
# `%%px` cell runs **on every rank**, where `rank`, `world_size` and `device` are
# defined. The next cell checks that each rank is a process of its own (as under
# `torchrun`, one per GPU).

# %%
import torch

from labkit import checks, compare, data, diagrams, exercises, models, plots

ranks.wait()

# %%
# %%px
import os

import torch
import torch.distributed as dist

pids = [None] * world_size
dist.all_gather_object(pids, os.getpid())  # every rank's process id
backend = dist.get_backend()
print(f"rank {rank} of {world_size}, backend {backend}, processes {pids}")

# %% tags=["hide-input"]
# %%px
assert (backend, device) == ("gloo", "cpu")  # on any machine
assert len(set(pids)) == world_size  # one process per rank

# %% [markdown] lang="ja" tags=["core"]
# ## 5 つの集団通信
#
# 集団通信は、グループの**全ランクが同じ呼び出しをする**通信です。ランク 0 は `[1, 2]`、ランク 1 は
# `[11, 12]` を持ち、それぞれ次の 5 つを実行します。
#
# - `broadcast(x, src=0)`: ランク 0 の値を全ランクへ (DDP の初期の重み)
# - `all_reduce(x)`: 和を全ランクへ (DDP の勾配)
# - `reduce_scatter_single(out, x)`: 和の r 番目の部分をランク r へ (ZeRO、FSDP)
# - `all_gather_single(out, x)`: 全ランクの値を順に並べて全ランクへ
# - `barrier()`: 全ランクが着くまで、誰も先へ進まない
#
# **予想してから実行:** それぞれのあとで、各ランクは何を持っているでしょうか? barrier の前にランク 1
# だけが 1 秒眠ると、ランク 0 は barrier で何秒待つでしょうか?

# %% [markdown] lang="en" tags=["core"]
# ## Five collectives
#
# A collective is a call **every rank of the group makes**. Rank 0 holds `[1, 2]`, rank
# 1 `[11, 12]`; each runs:
#
# - `broadcast(x, src=0)`: rank 0's values to all (DDP's first weights);
# - `all_reduce(x)`: the sum, to all (DDP's gradients);
# - `reduce_scatter_single(out, x)`: piece r of the sum to rank r (ZeRO, FSDP);
# - `all_gather_single(out, x)`: everyone's values, in rank order, to all;
# - `barrier()`: no rank goes on until all have arrived.
#
# **Predict, then run:** what does each rank hold after each? If rank 1 alone sleeps 1 s
# before the barrier, how long does rank 0 wait there?

# %%
# %%px
import time

x = torch.tensor([1.0, 2.0]) + 10 * rank  # rank 0: [1, 2]; rank 1: [11, 12]
b, s, piece, gathered = x.clone(), x.clone(), torch.empty(1), torch.empty(2 * world_size)
dist.broadcast(b, src=0)
dist.all_reduce(s)  # the sum, by default
dist.reduce_scatter_single(piece, x.clone())  # piece r of the sum, on rank r
dist.all_gather_single(gathered, x)
seen = [(name, t.tolist()) for name, t in [  # a list keeps the order
    ("x (before)", x), ("broadcast(x, src=0)", b), ("all_reduce(x)", s),
    ("reduce_scatter_single(out, x)", piece), ("all_gather_single(out, x)", gathered)]]
if rank == 1:
    time.sleep(1.0)  # rank 1 arrives late
start = time.perf_counter()
dist.barrier()
waited = time.perf_counter() - start

# %% [markdown] lang="ja"
# 1 行が 1 つの集団通信です。all-reduce は、reduce-scatter のあとに切れ端を all-gather したものと
# 同じです。レッスン 05 のリング all-reduce はこの 2 段で動きます。

# %% [markdown] lang="en"
# One row per collective. An all-reduce equals a reduce-scatter followed by an
# all-gather of the pieces: lesson 05's ring all-reduce works in these two phases.

# %% tags=["hide-input"]
seen = ranks.pull("seen")
rows = {name: [dict(s)[name] for s in seen] for name, _ in seen[0]}
assert rows["broadcast(x, src=0)"] == [[1, 2], [1, 2]]
assert rows["all_reduce(x)"] == [[12, 14], [12, 14]]
assert rows["reduce_scatter_single(out, x)"] == [[12], [14]]  # piece r of the sum
assert rows["all_gather_single(out, x)"] == [[1, 2, 11, 12]] * 2
waited = ranks.pull("waited")
print("seconds waited in the barrier, by rank:", [round(w, 2) for w in waited])
assert waited[0] > 0.5  # rank 0 waited for rank 1 (which slept 1 s)
pieces = rows["reduce_scatter_single(out, x)"]
assert rows["all_reduce(x)"][0] == pieces[0] + pieces[1]  # the pieces, gathered
fig = diagrams.collectives(rows)

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## 各ランクはモデル全体を持つ
#
# ランクごとにわざと違うシードでモデルを作り、DDP で包む前と後のランク間の差を比べます。
#
# **予想してから実行:** 各ランクが持つパラメータはいくつで、包んだ後の差はいくつでしょうか?
# (モデルは 2110 パラメータの MLP です)

# %% [markdown] lang="en" tags=["deep-dive"]
# ## Every rank holds the whole model
#
# Seed each rank differently, on purpose, and compare the ranks before and after
# wrapping the model in DDP.
#
# **Predict, then run:** how many parameters does each rank hold, and how far apart are
# the ranks after wrapping? (It is an MLP of 2,110 parameters.)

# %%
# %%px
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import comm_counting, compare, data, models

torch.manual_seed(rank)  # different initial weights on each rank, on purpose
model = models.MLP()
before = compare.replica_max_diff(model)
model = DDP(model)  # broadcasts rank 0's parameters and buffers
after = compare.replica_max_diff(model)

# %% tags=["hide-input"]
# %%px
n_params = models.count_params(model.module)
print(f"rank {rank}: {n_params} parameters; "
      f"max difference before DDP {before:.3f}, after {after}")
assert n_params == 2110  # the whole model, not a part of it
assert before > 0 and after == 0.0

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## `DistributedSampler` と `set_epoch`
#
# 各ランクが学習するデータの分は**重なってはいけません**。`DistributedSampler` はデータセットの添字を
# ランクに重ならないように分けます。シャッフルする (既定) ときの並びはシードと**エポック番号**で決まるので、
# 毎エポック `sampler.set_epoch(epoch)` を呼びます。呼び忘れると、毎エポック同じ順番になります。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## `DistributedSampler` and `set_epoch`
#
# The ranks' shares of the data **must not overlap**: `DistributedSampler` splits the
# indices among the ranks. Shuffled (the default), the order depends on the seed and the
# **epoch number**, so call `sampler.set_epoch(epoch)` every epoch; forget it and every
# epoch repeats the same order.

# %%
# %%px
from torch.utils.data import DistributedSampler

dataset = data.MyDataset(n=16)
sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=0)
forgetful = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=0)
with_set_epoch, without_set_epoch = [], []
for epoch in range(3):
    sampler.set_epoch(epoch)
    with_set_epoch.append(list(sampler))
    without_set_epoch.append(list(forgetful))  # set_epoch never called

# %% [markdown] lang="ja"
# 添字は各エポックで重ならずに全 16 サンプルを覆い、`set_epoch` なしでは毎回同じ順番です。

# %% [markdown] lang="en"
# The indices cover all 16 samples in every epoch without overlap, and without
# `set_epoch` the order never changes.

# %% tags=["hide-input"]
per_rank = ranks.pull("with_set_epoch")
for epoch in range(3):
    parts = [set(indices[epoch]) for indices in per_rank]
    assert parts[0].isdisjoint(parts[1])
    assert parts[0] | parts[1] == set(range(16))
assert per_rank[0][0] != per_rank[0][1]  # a new order each epoch
forgetful = ranks.pull("without_set_epoch")
assert all(order == forgetful[0][0] for order in forgetful[0])  # the same every epoch
rows = {labkit.t("epoch_set", e=e): [r[e] for r in per_rank] for e in range(3)}
rows.update({labkit.t("epoch_unset", e=e): [r[e] for r in forgetful] for e in range(3)})
fig = diagrams.collectives(rows, fmt="{:.0f}", shade=False, title="sampler_epochs_title")

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## 演習 (任意): `set_epoch` を足す
#
# 飛ばしても先に進めます。`epoch_orders` は、このランクが各エポックで受け持つ添字を返しますが、並びが
# 毎エポック同じです。直してください。確認のセルは両方のランクのエンジン (`DistributedSampler` を
# import 済み) で実行し、各エポックの添字が全 16 個を重ならずに覆い、並びが変わるかを確かめます。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## Exercise (optional): add `set_epoch`
#
# You can skip it. `epoch_orders` returns this rank's indices for each epoch, in the same
# order every epoch: fix it. The check runs it on both ranks' engines (where
# `DistributedSampler` is imported) and checks each epoch: all 16, no overlap, a new
# order.

# %% tags=["exercise", "optional"]
from torch.utils.data import DistributedSampler


def epoch_orders(dataset, rank, world_size, num_epochs):
    """The indices this rank gets in each epoch, in a new order every epoch."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=0)
    orders = []
    for epoch in range(num_epochs):
        orders.append(list(sampler))
    return orders

# %% tags=["solution"]
def epoch_orders(dataset, rank, world_size, num_epochs):
    """The indices this rank gets in each epoch, in a new order every epoch."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=0)
    orders = []
    for epoch in range(num_epochs):
        sampler.set_epoch(epoch)  # the same number on every rank: one shared order
        orders.append(list(sampler))
    return orders

# %%
exercises.grade_set_epoch(ranks, epoch_orders)

# %% [markdown] lang="ja" tags=["core"]
# ## DDP の勾配 = 全バッチの勾配
#
# 全体バッチ $B$ ($N b$ サンプル) を $N$ ランクが $b$ サンプルずつ分け、ランク $r$ の分を $B_r$ とします。
# 損失がサンプルの平均なら、微分は和と交換できるので
#
# $$\nabla \frac{1}{Nb}\sum_{i \in B} \ell_i = \frac{1}{N}\sum_{r=1}^{N} \nabla \frac{1}{b}\sum_{i \in B_r} \ell_i$$
#
# 左辺は 1 プロセスの全体バッチの勾配、右辺は各ランクの勾配の平均 (DDP の all-reduce ÷ $N$) です。
# DDP の 1 ステップは次のとおりです。
#
# 1. 作るとき: ランク 0 の重みを broadcast (上で確かめました)
# 2. 各ランク: 自分の分で順伝播と逆伝播
# 3. 逆伝播の途中: 勾配を all-reduce し、$N$ で割る
# 4. 各ランク: 同じ勾配で `optimizer.step()`。だからレプリカは同じままです
#
# 次のセルで、64 サンプル (各ランク 32) について確かめます。

# %% [markdown] lang="en" tags=["core"]
# ## DDP's gradient = the whole batch's gradient
#
# Split a global batch $B$ of $N b$ samples into $N$ shares $B_r$ of $b$ samples. For a
# loss that is a mean over samples, the gradient of a sum being the sum of gradients,
#
# $$\nabla \frac{1}{Nb}\sum_{i \in B} \ell_i = \frac{1}{N}\sum_{r=1}^{N} \nabla \frac{1}{b}\sum_{i \in B_r} \ell_i$$
#
# Left: one process on the whole batch; right: the mean of the ranks' gradients (DDP's
# all-reduce, divided by $N$). One DDP step is:
#
# 1. at construction: broadcast rank 0's weights (checked above);
# 2. each rank: forward and backward on its share;
# 3. during backward: all-reduce the gradients, divide by $N$;
# 4. each rank: `optimizer.step()` with the same gradient, so the replicas stay equal.
#
# The next cell checks it on 64 samples, 32 per rank.

# %%
# %%px
import copy

torch.manual_seed(0)
model = DDP(models.MLP())
local = copy.deepcopy(model.module)  # the same weights, outside DDP
criterion = models.MyLoss()

torch.manual_seed(1)
X, y = torch.randn(64, 10), torch.randn(64, 10)  # the same on every rank
criterion(model(data.shard(X, rank, world_size)), data.shard(y, rank, world_size)).backward()
criterion(local(X), y).backward()

# %% tags=["hide-input"]
# %%px
grad_diff = compare.max_abs_diff([p.grad for p in model.parameters()],
                                [p.grad for p in local.parameters()])
print(f"rank {rank}: max |DDP grad - whole-batch grad| = {grad_diff:.2e}")
assert grad_diff <= 1e-6

# %% [markdown] lang="ja" tags=["core"]
# ## 演習: 勾配の平均を手で書く
#
# 手順 3 を自分で書きます。`average_gradients(model, world_size)` を完成させ、各 `.grad` を全ランクの
# 平均にしてください。`dist.all_reduce(t)` は全ランクの `t` の和を各ランクの `t` に書き込みます。
# 2 ではなく `world_size` で割ります。確認のセルは DDP なしでこの関数を使い、64 サンプル全体の勾配と
# 比べます。

# %% [markdown] lang="en" tags=["core"]
# ## Exercise: average the gradients by hand
#
# Write step 3 yourself: complete `average_gradients(model, world_size)` so that every
# `.grad` becomes the mean over the ranks. `dist.all_reduce(t)` writes the sum of all
# ranks' `t` into each rank's `t`; divide by `world_size`, not 2. The check runs it
# without DDP and compares with the gradient of all 64 samples.

# %% tags=["exercise"]
import torch.distributed as dist


def average_gradients(model, world_size):
    """Make every parameter's .grad the mean over the ranks, as DDP does."""
    for p in model.parameters():
        pass  # TODO: an all-reduce, then turn the sum into a mean

# %% tags=["solution"]
def average_gradients(model, world_size):
    """Make every parameter's .grad the mean over the ranks, as DDP does."""
    for p in model.parameters():
        dist.all_reduce(p.grad)  # the sum over the ranks, in place, on every rank
        p.grad /= world_size  # the sum becomes the mean

# %%
exercises.grade_average_gradients(ranks, average_gradients)

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## 何が、いつ通信されるか
#
# DDP は勾配を**バケット**にまとめ、逆伝播でバケットがそろうたびに all-reduce します (理由はレッスン 05)。
# 通信フックで 3 回の逆伝播のバイト数を数えます。通信は逆伝播の中で起きるので、オプティマイザは
# 使いません。
#
# **予想してから実行:** この小さな MLP (2110 パラメータ、float32) で、1 回の逆伝播は何回 all-reduce し、
# 何バイト送るでしょうか?

# %% [markdown] lang="en" tags=["deep-dive"]
# ## What is communicated, and when
#
# DDP groups gradients into **buckets** and all-reduces each one as soon as the backward
# pass has filled it (why: lesson 05). A communication hook counts the bytes of 3
# backward passes (no optimizer: it all happens inside them).
#
# **Predict, then run:** for this tiny MLP (2,110 parameters, float32), how many
# all-reduces does one backward pass make, and how many bytes do they send?

# %%
# %%px
torch.manual_seed(0)
model = DDP(models.MLP())
log = comm_counting.CommCounter(per_step=True).attach(model)
ran = []  # the modules whose forward ran
model.module.register_forward_hook(lambda module, args, out: ran.append(module))
for step in range(3):
    log.step()
    criterion(model(data.shard(X, rank, world_size)),
              data.shard(y, rank, world_size)).backward()
assert len(ran) == 3 and all(m is model.module for m in ran)  # no copies of the model

# %% [markdown] lang="ja"
# どちらのランクも、逆伝播のたびに全勾配 (2110 × 4 = 8440 バイト) を 1 回で送りました。動いたのは
# DDP を作ったときのモジュールだけです (DataParallel は毎ステップ複製します)。

# %% [markdown] lang="en"
# Each backward sent all gradients (2110 × 4 = 8440 bytes) in one call, and only the
# module DDP was built with ran (DataParallel copies it every step).

# %% tags=["hide-input"]
steps = ranks.pull("log.steps")  # per rank, per backward: the bytes of each all-reduce
assert steps == [[[2110 * 4]] * 3] * 2  # every gradient once, in one call, per backward
fig = diagrams.collectives({labkit.t("backward_n", k=k): [s[k - 1] for s in steps]
                            for k in (1, 2, 3)}, fmt="{:.0f}", title="ddp_bytes_title")

# %% [markdown] lang="ja"
# **1 ステップをランクごとに描きます。** 層の多いモデル (約 13.7 万パラメータ) を `bucket_cap_mb=0.25` で
# 包み、順伝播、各パラメータの勾配ができた時刻、バケットごとの all-reduce、`backward()` が戻る時刻、
# オプティマイザのステップを記録します (`buckets.Timeline` の通信フックは DDP の既定と同じ all-reduce を
# して、時刻を書き留めるだけです)。1 ステップ目は全勾配を 1 つのバケットで送るので (レッスン 05)、
# 2 ステップ目を描きます。
#
# **予想してから実行:** 最初のバケットの all-reduce は、逆伝播が終わる前に始まるでしょうか?
# オプティマイザは、all-reduce が終わる前にステップを始めることがあるでしょうか?

# %% [markdown] lang="en"
# **One step, drawn rank by rank.** A deeper model (about 137 k parameters) wrapped with
# `bucket_cap_mb=0.25` records its forward, when each parameter's gradient is written,
# each bucket's all-reduce, when `backward()` returns, and the optimizer's step
# (`buckets.Timeline`'s comm hook all-reduces as DDP's default does and notes the
# times). Step 1 sends every gradient in one bucket (lesson 05), so step 2 is drawn.
#
# **Predict, then run:** does the first bucket's all-reduce start before the backward
# pass ends? Can the optimizer step before the all-reduces are done?

# %%
# %%px
from labkit import buckets

torch.manual_seed(0)
model = DDP(models.WideMLP(hidden=256, depth=3), bucket_cap_mb=0.25)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
X_mine, y_mine = data.shard(X, rank, world_size), data.shard(y, rank, world_size)
with buckets.Timeline(model, buckets.allreduce_hook) as timeline:
    for step in range(2):  # step 1 builds the buckets; step 2 is a training run's
        record = timeline.train_step(model, X_mine, y_mine, criterion, optimizer)

# %% tags=["hide-input"]
from labkit import buckets

steps = ranks.pull("timeline.steps")  # per rank: step 1, step 2
assert [[len(step["events"]) for step in s] for s in steps] == [[1, 3]] * 2  # the rebuild
per_rank = [s[-1] for s in steps]
buckets.check_step(per_rank)  # on every rank: overlap, all done before backward returns
fig = plots.timelines({labkit.t("rank_panel", rank=r, n=len(step["events"])): step
                       for r, step in enumerate(per_rank)}, title="ddp_step_title")

# %% [markdown] lang="ja"
# どちらのランクでも、最初のバケットの all-reduce は、最後の勾配ができる前、逆伝播の途中 (勾配の印の
# あいだ) で始まります。`backward()` はすべての all-reduce が終わってから戻るので、オプティマイザは
# 平均された勾配でステップします。セルはこの 2 つを各ランクで確かめています (`buckets.check_step`)。

# %% [markdown] lang="en"
# On both ranks the first bucket's all-reduce starts during the backward pass (between
# the gradients' ticks), before the last gradient is written. `backward()` returns only
# once every all-reduce is done, so the optimizer steps on averaged gradients. The cell
# checks both on each rank (`buckets.check_step`).

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## 学習してもレプリカは一致したまま
#
# `DistributedSampler` と `DataLoader` で 3 エポック学習します。全ランクが同じ平均勾配で同じ更新を
# するので、ランク間のパラメータの差はちょうど 0 です。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## Replicas stay identical through training
#
# Three epochs with `DistributedSampler` and `DataLoader`: the same averaged gradient
# gives every rank the same update, so the ranks' parameters differ by exactly 0.

# %%
# %%px
from torch.utils.data import DataLoader

torch.manual_seed(0)
model = DDP(models.MLP())
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
dataset = data.TeacherDataset(n=1024, seed=0)
sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=0)
loader = DataLoader(dataset, batch_size=32, sampler=sampler)
losses = []
for epoch in range(3):
    sampler.set_epoch(epoch)
    for X, y in loader:
        optimizer.zero_grad()
        loss = criterion(model(X), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

# %% tags=["hide-input"]
# %%px
replica_diff = compare.replica_max_diff(model)
print(f"rank {rank}: {len(losses)} steps, last loss {losses[-1]:.3f}, "
      f"max parameter difference between ranks {replica_diff}")
assert replica_diff == 0.0

# %% [markdown] lang="ja"
# 各ランクの損失は自分のデータの分だけなので、ランクごとに少し違います。

# %% [markdown] lang="en"
# Each rank's loss is on its own data, so the curves differ a little.

# %% tags=["hide-input"]
fig = plots.loss_curves({f"rank {r}": h for r, h in enumerate(ranks.pull("losses"))})

# %% [markdown] lang="ja" tags=["core"]
# ## 自分の DDP スクリプト
#
# 仕事では、DDP を `torchrun` で起動するスクリプトとして動かします。演習のセルは、レッスン 01 の
# ループ (256 サンプル、2 エポック) を `ddp_train.py` に書き出します。`TODO` の 5 か所を直してください。
#
# 1. 最初に `dist.init_process_group(backend)`。torchrun が渡す環境変数 (`RANK`、`WORLD_SIZE`、
#    `MASTER_ADDR` など) を読みます。プロセスごとに GPU があれば
#    (`torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])`) nccl で device は
#    `cuda:LOCAL_RANK`、なければ gloo で CPU です。続けて `dist.get_rank()` と `dist.get_world_size()`
# 2. モデルを device に置いて `DDP(...)` で包む (オプティマイザを作る前)。バッチも device へ
# 3. `sampler = DistributedSampler(dataset, seed=0)` を `DataLoader(..., sampler=sampler)` に渡し
#    (`shuffle=True` は外す)、各ランクのバッチを `64 // world_size` にして全体を 64 のままにする
# 4. 各エポックの初めに `sampler.set_epoch(epoch)`
# 5. 表示はランク 0 だけ。最後に `dist.destroy_process_group()`
#
# 確認のセルは、これを torchrun の 2 プロセスで実行し、1 プロセスと比べます。

# %% [markdown] lang="en" tags=["core"]
# ## Your own DDP script
#
# At work, DDP runs as a script that `torchrun` launches. The exercise cell writes
# lesson 01's loop (256 samples, 2 epochs) to `ddp_train.py`; fix its five `TODO`s:
#
# 1. First, `dist.init_process_group(backend)`, which reads what torchrun sets
#    (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, …): nccl on `cuda:LOCAL_RANK` when each
#    process has a GPU (`torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])`),
#    else gloo on the CPU. Then `dist.get_rank()` and `dist.get_world_size()`.
# 2. The model on the device, wrapped in `DDP(...)` before the optimizer is built;
#    each batch on the device too.
# 3. Pass `sampler = DistributedSampler(dataset, seed=0)` as `DataLoader(...,
#    sampler=sampler)`, without `shuffle=True`, with a batch of `64 // world_size`.
# 4. `sampler.set_epoch(epoch)` at the start of each epoch.
# 5. Print on rank 0 only; end with `dist.destroy_process_group()`.
#
# The check runs it under torchrun, 2 processes, against one process.

# %% tags=["exercise"]
# %%writefile ddp_train.py
import torch
from torch.utils.data import DataLoader

from labkit import data, models

rank, world_size = 0, 1  # TODO 1: join the process group torchrun describes
torch.manual_seed(0)  # the same initial weights on every run
model = models.MLP()  # TODO 2: on the device, wrapped in DDP
criterion = models.MyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
dataset = data.TeacherDataset(n=256, seed=0)
loader = DataLoader(dataset, batch_size=64, shuffle=True)  # TODO 3: this rank's share
for epoch in range(2):
    # TODO 4: a new order each epoch
    for X, y in loader:
        optimizer.zero_grad()
        loss = criterion(model(X), y)
        loss.backward()
        optimizer.step()
    print(f"epoch {epoch}: loss {loss.item():.4f}")  # TODO 5: on rank 0 only
torch.save(model.state_dict(), f"ddp_train_rank{rank}.pt")  # TODO 5: leave the group

# %% tags=["solution"]
# %%writefile ddp_train.py
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from labkit import data, models

# torchrun says who this process is, and where the others wait, in the environment
on_gpu = torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])  # one each
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else "cpu"
dist.init_process_group("nccl" if on_gpu else "gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # the same initial weights on every run
model = DDP(models.MLP().to(device))  # broadcasts rank 0's weights
criterion = models.MyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
dataset = data.TeacherDataset(n=256, seed=0)
sampler = DistributedSampler(dataset, seed=0)  # this rank's share, shuffled
loader = DataLoader(dataset, batch_size=64 // world_size, sampler=sampler)
for epoch in range(2):
    sampler.set_epoch(epoch)  # a new order each epoch, the same on every rank
    for X, y in loader:
        X, y = X.to(device), y.to(device)
        optimizer.zero_grad()
        loss = criterion(model(X), y)
        loss.backward()  # DDP averages the gradients over the ranks here
        optimizer.step()
    if rank == 0:  # one line per epoch, not one per rank
        print(f"epoch {epoch}: loss on rank 0's share {loss.item():.4f}")
torch.save(model.module.state_dict(), f"ddp_train_rank{rank}.pt")  # each rank's replica
dist.destroy_process_group()

# %%
exercises.grade_ddp_script("ddp_train.py")

# %% [markdown] lang="ja"
# ### torchrun で起動する
#
# 端末では `torchrun --nproc-per-node=2 ddp_train.py` です (クラスタではレッスン 09)。次のセルは
# これを子プロセスとして実行します。
#
# <details><summary>測り方</summary>
#
# `torchrun.run_nodes` は `python -m torch.distributed.run` を起動するので macOS でも Windows でも同じで、
# 5 分を過ぎればワーカーごと止めます。
#
# </details>

# %% [markdown] lang="en"
# ### Launch it with torchrun
#
# In a terminal this is `torchrun --nproc-per-node=2 ddp_train.py` (clusters: lesson
# 09); the next cell runs it as a child process.
#
# <details><summary>How this was measured</summary>
#
# `torchrun.run_nodes` starts `python -m torch.distributed.run`, the same on macOS and
# Windows, and stops it with its workers after 5 minutes.
#
# </details>

# %%
from pathlib import Path

from labkit.cluster import torchrun

for old in Path().glob("ddp_train_rank*.pt"):
    old.unlink()  # an earlier run's replicas
node, = torchrun.run_nodes(["ddp_train.py"], nnodes=1, nproc_per_node=2, timeout_s=300)

# %% tags=["hide-input"]
print(node.output)
assert node.returncode == 0, "torchrun failed: what it printed is above"

# %% [markdown] lang="ja"
# 次のセルは、保存された 2 つのレプリカどうしを比べ、1 プロセスの重みとも比べます。
#
# **予想してから実行:** 2 つのレプリカの差と、1 プロセスの重みとの差は、それぞれどれくらいでしょうか?

# %% [markdown] lang="en"
# The next cell compares the saved replicas with each other and with one process.
#
# **Predict, then run:** how far apart are the two replicas, and how far are they from
# the one-process weights?

# %%
from torch.utils.data import DataLoader, DistributedSampler

torch.manual_seed(0)  # the one-process loop, whole batches of 64
model = models.MLP()
criterion = models.MyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
dataset = data.TeacherDataset(n=256, seed=0)
sampler = DistributedSampler(dataset, num_replicas=1, rank=0, seed=0)  # the whole order
for epoch in range(2):
    sampler.set_epoch(epoch)
    for X, y in DataLoader(dataset, batch_size=64, sampler=sampler):
        optimizer.zero_grad()
        criterion(model(X), y).backward()
        optimizer.step()

# %% tags=["hide-input"]
replicas = [torch.load(f"ddp_train_rank{r}.pt") for r in range(2)]
apart = compare.max_abs_diff(replicas[0].values(), replicas[1].values())
diff = compare.max_abs_diff(model.state_dict().values(), replicas[0].values())
print(f"replicas apart by {apart}; DDP against one process: {diff:.1e}")
assert apart == 0.0  # identical replicas
assert diff <= 1e-5  # the whole batch's updates, up to float32 rounding

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## ランクでエラーが起きたら
#
# ランクの例外は、その番号とトレースバックとともにセルに表示されます (`[1:execute] ValueError …`)。
# 次のセルはランク 1 だけでわざと失敗します。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## When a rank fails
#
# A rank's exception shows in the cell with its number and traceback
# (`[1:execute] ValueError …`); here rank 1 fails on purpose.

# %% tags=["raises-exception"]
# %%px
if rank == 1:
    raise ValueError(f"rank {rank} got a batch of the wrong shape")
print(f"rank {rank} is fine")

# %% tags=["hide-input"]
assert ranks.run(lambda: 42) == [42, 42]  # only rank 1 raised; the engines still work

# %% [markdown] lang="ja"
# <details><summary>ノートブックから <code>mp.spawn</code> を使わない理由</summary>
#
# `torch.multiprocessing.spawn(train, nprocs=2)` は新しい Python プロセスを起動し、`train` を名前で
# 探します。セルで定義した関数はカーネルの `__main__` にしかないので、子プロセスは見つけられずに
# 終了し (`Can't get attribute 'train'`)、そのトレースバックはノートブックに出ないカーネルの標準エラーに
# 書かれます。次のセルは、それを取り出して見せます。エンジンは起動したまま残るプロセスで、`%%px` の
# コードはそこで実行されるので、何もピクル化せず、各ランクの出力もセルに出ます。
#
# </details>

# %% [markdown] lang="en"
# <details><summary>Why not <code>mp.spawn</code> from a notebook</summary>
#
# `torch.multiprocessing.spawn(train, nprocs=2)` starts new Python processes that look
# `train` up by name. A function defined in a cell exists only in the kernel's
# `__main__`, so the children exit (`Can't get attribute 'train'`), and their traceback
# goes to the kernel's stderr, which the notebook never shows; the next cell captures
# it. Engines are processes that stay up, and `%%px` code runs in them: nothing is
# pickled, and each rank's output appears in the cell.
#
# </details>

# %% tags=["hide-input"]
import torch.multiprocessing as mp


def train(rank):  # defined in a cell: it lives in the kernel's __main__
    print(f"rank {rank} training")


with checks.captured_stderr() as lost:
    with checks.expect_error(mp.ProcessExitedException, match="exit code 1"):
        mp.spawn(train, nprocs=2)
assert "Can't get attribute 'train'" in lost.text

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## world size 1 と 2 の 1 ステップの時間
#
# 全体バッチ 1024 のうち、2 ランクはそれぞれ 512 サンプルを計算する代わりに、全勾配
# (パラメータ数 × 4 バイト) を all-reduce します。得になるかはレッスン 05 で測ります。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## Time per step with world size 1 and 2
#
# Of a global batch of 1024, two ranks compute 512 samples each, at the price of an
# all-reduce of every gradient (parameters × 4 bytes); lesson 05 times the trade.

# %%
# %%px
big = DDP(models.WideMLP(hidden=1024, depth=2))
counter = comm_counting.CommCounter().attach(big)
X_mine = data.shard(torch.randn(1024, 10), rank, world_size)  # of the global batch
for _ in range(2):  # step 1 sizes the buckets; count step 2
    counter.reset()
    big(X_mine).pow(2).mean().backward()

# %% tags=["hide-input"]
# %%px
print(f"rank {rank}: {len(X_mine)} of 1024 samples, {counter.bytes:,} bytes all-reduced")
assert len(X_mine) == 1024 // world_size
assert counter.bytes == models.count_params(big.module) * 4  # every gradient

# %% [markdown] lang="ja" tags=["core"]
# ## 後片付け
#
# エンジンを止め、保存したレプリカを消します (`ddp_train.py` は残します)。

# %% [markdown] lang="en" tags=["core"]
# ## Clean up
#
# Stop the engines and delete the saved replicas (`ddp_train.py` stays).

# %%
ranks.stop()
assert cluster.current() is None
for f in Path().glob("ddp_train_rank*.pt"):
    f.unlink()

# %% [markdown] lang="ja" tags=["summary"]
# ## 覚えておくこと
#
# - **集団通信は全ランクが同じ呼び出しをする通信**です。broadcast は 1 つのランクの値を、all-reduce は
#   和を、reduce-scatter は和の切れ端を、all-gather は全員の値を配り、barrier は全員を待ちます。
# - **DDP の各ランクはモデル全体を持ち**、ランク 0 の重みの broadcast でそろえます
#   (分けて持つのは FSDP や ZeRO です)。
# - **等しいシャードの勾配の平均は、全体バッチの勾配**です (損失がサンプルの平均のとき)。
# - **`DistributedSampler` はランクに重ならないデータを配り**、`set_epoch(epoch)` を呼ばないと
#   毎エポック同じ順番になります。
# - **DDP のスクリプトは 1 プロセスのループに 5 か所を足したもの**で (プロセスグループ、`DDP(model)`、
#   sampler と `set_epoch`、ランク 0 だけの表示、`destroy_process_group`)、`torchrun` で起動すると
#   1 プロセスと同じ重みになります。

# %% [markdown] lang="en" tags=["summary"]
# ## What to remember
#
# - **A collective is a call every rank makes**: broadcast hands out one rank's values,
#   all-reduce the sum, reduce-scatter a piece of it, all-gather everyone's values;
#   barrier waits for all.
# - **Every DDP rank holds the whole model**, made equal by a broadcast of rank 0's
#   weights (FSDP and ZeRO shard it).
# - **The mean of equal shards' gradients is the whole batch's gradient** when the loss
#   is a mean over samples.
# - **`DistributedSampler` gives the ranks disjoint data**; without `set_epoch(epoch)`
#   each epoch repeats the same order.
# - **A DDP script is a one-process loop plus five changes** (process group,
#   `DDP(model)`, sampler and `set_epoch`, rank-0 printing, `destroy_process_group`);
#   under `torchrun` it reaches one process's weights.

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

selfcheck.show("03_ddp")

# %% tags=["self-check"]
# Your answers, "a", "b", "c" or "d" for each question; then run this cell.
my_answers = {1: None, 2: None, 3: None}
selfcheck.check("03_ddp", my_answers)
