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
# 全ランクが同じ更新をし、レプリカはいつも同じままです。記事 000 の「各 GPU はモデルのパラメータの
# 一部を保持し」は DDP ではなく、パラメータを分割して持つ **FSDP** や **ZeRO** の説明です。
#
# このレッスンを終えると、次のことができます。
#
# - broadcast、all-reduce、reduce-scatter、all-gather、barrier が各ランクの値をどう変えるかを言い当てる
# - 等しい大きさのシャードの勾配の平均が、全体バッチの勾配と等しい理由を 1 行の式で説明する
# - `DistributedSampler` と `set_epoch` で、ランクに重ならないデータを毎エポック新しい順番で配る
# - 1 プロセスの学習ループを DDP のスクリプトに書き換え、`torchrun` で起動して、1 プロセスと同じ
#   重みになることを確かめる

# %% [markdown] lang="en" tags=["outcomes"]
# # 03 DistributedDataParallel
#
# With `DistributedDataParallel` (DDP), several **processes** (ranks) each hold a
# **full copy of the model** (a replica) and share out the data. During the backward pass
# the gradients are averaged by an all-reduce, so every rank makes the same update and
# the replicas stay identical. Doc 000's "each GPU holds part of the model's parameters"
# describes **FSDP** or **ZeRO**, which shard the parameters, not DDP.
#
# After this lesson you can:
#
# - predict what broadcast, all-reduce, reduce-scatter, all-gather and barrier do to
#   each rank's values;
# - say in one line of algebra why the mean of equal shards' gradients is the whole
#   batch's gradient;
# - give the ranks disjoint data, in a new order each epoch, with `DistributedSampler`
#   and `set_epoch`;
# - turn a one-process training loop into a DDP script, launch it with `torchrun`, and
#   check that it reaches the one-process weights.

# %%
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %% [markdown] lang="ja"
# 次のセルで 2 つのランクの起動を始めます。起動は裏で進むので、その間に先を読めます。

# %% [markdown] lang="en"
# The next cell starts two ranks. They boot in the background, so you can read on
# meanwhile.

# %%
import time

from labkit import cluster

t0 = time.perf_counter()
ranks = cluster.start(2, background=True)  # returns at once; the ranks boot meanwhile

# %% [markdown] lang="ja" tags=["core"]
# ## ランクを起動する
#
# `cluster.start(2)` は 2 つのエンジン (Python プロセス) を 127.0.0.1 で起動し、エンジン i をランク i
# にして、gloo のプロセスグループに参加させます (このレッスンのテンソルは CPU にあるので、GPU のある
# マシンでも gloo です)。以後、`%%px` で始まるセルは**全ランクで**実行され、各エンジンには `rank`、
# `world_size`、`device` があります。最初の `%%px` セルは、ランクごとに別のプロセスであることを
# 確かめます (`torchrun` が GPU 1 台に 1 プロセスを起動するのと同じです)。

# %% [markdown] lang="en" tags=["core"]
# ## Start the ranks
#
# `cluster.start(2)` starts two engines (Python processes) on 127.0.0.1, makes engine i
# rank i, and joins them in a gloo process group (this lesson's tensors live on the
# CPU, so gloo even on a machine with GPUs). From now on, a cell that starts with
# `%%px` runs **on every rank**, where `rank`, `world_size` and `device` are defined.
# The first `%%px` cell checks that each rank is a process of its own, as `torchrun`
# starts one per GPU.

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
print(f"rank {rank} of {world_size}, backend {dist.get_backend()}, "
      f"device {device}, processes {pids}")
assert (dist.get_backend(), device) == ("gloo", "cpu")  # on any machine
assert len(set(pids)) == world_size  # one process per rank

# %% [markdown] lang="ja" tags=["core"]
# ## 5 つの集団通信
#
# 集団通信は、グループの**全ランクが同じ呼び出しをする**通信です。ランク 0 は `[1, 2]`、ランク 1 は
# `[11, 12]` を持ち、それぞれのコピーで次の 5 つを実行します。
#
# - `broadcast(x, src=0)`: ランク 0 の値を全ランクへ配る (DDP が作るときに重みをそろえる)
# - `all_reduce(x)`: 全ランクの和を全ランクへ (DDP が勾配を平均する)
# - `reduce_scatter_single(out, x)`: 和を切り分け、ランク r には r 番目の部分だけ (ZeRO と FSDP)
# - `all_gather_single(out, x)`: 全ランクの値をランクの順に並べて全ランクへ (ZeRO と FSDP)
# - `barrier()`: 全ランクがそこに着くまで、誰も先へ進まない
#
# **予想してから実行:** それぞれのあとで、各ランクは何を持っているでしょうか? barrier の前にランク 1
# だけが 1 秒眠ると、ランク 0 は barrier で何秒待つでしょうか?

# %% [markdown] lang="en" tags=["core"]
# ## Five collectives
#
# A collective is a call that **every rank of the group makes**. Rank 0 holds `[1, 2]`,
# rank 1 holds `[11, 12]`, and each runs these five on its own copies:
#
# - `broadcast(x, src=0)`: rank 0's values to every rank (DDP's weights at the start);
# - `all_reduce(x)`: the ranks' sum, to every rank (DDP's gradients);
# - `reduce_scatter_single(out, x)`: the sum in pieces, piece r to rank r (ZeRO, FSDP);
# - `all_gather_single(out, x)`: every rank's values in rank order, to every rank
#   (ZeRO, FSDP);
# - `barrier()`: no rank goes on until every rank has arrived.
#
# **Predict, then run:** what does each rank hold after each one? If rank 1 alone sleeps
# 1 s before the barrier, how long does rank 0 wait in it?

# %%
# %%px
import time

x = torch.tensor([1.0, 2.0]) + 10 * rank  # rank 0: [1, 2]; rank 1: [11, 12]
b, s, piece, gathered = x.clone(), x.clone(), torch.empty(1), torch.empty(2 * world_size)
dist.broadcast(b, src=0)
dist.all_reduce(s)  # the sum, by default
dist.reduce_scatter_single(piece, x.clone())  # piece r of the sum, on rank r
dist.all_gather_single(gathered, x)
seen = {"x (before)": x, "dist.broadcast(x, src=0)": b, "dist.all_reduce(x)": s,
        "dist.reduce_scatter_single(out, x)": piece,
        "dist.all_gather_single(out, x)": gathered}
seen = [(name, t.tolist()) for name, t in seen.items()]  # a list keeps the order
if rank == 1:
    time.sleep(1.0)  # rank 1 arrives late
start = time.perf_counter()
dist.barrier()
waited = time.perf_counter() - start
print(f"rank {rank}: {seen}; waited {waited:.2f} s in the barrier")

# %% [markdown] lang="ja"
# 2 つのランクから集めた値を、上から順に並べます。all-reduce の結果は、reduce-scatter (和の切れ端) の
# あとに all-gather (切れ端を全員へ) をした結果と同じです。レッスン 05 のリング all-reduce はこの 2 段で
# 動きます。

# %% [markdown] lang="en"
# The values pulled from the two ranks, one row per collective. The all-reduce's result
# is what a reduce-scatter (the sum, in pieces) followed by an all-gather (every piece
# to everyone) gives: lesson 05's ring all-reduce works in these two phases.

# %%
seen = ranks.pull("seen")
rows = {name: [dict(s)[name] for s in seen] for name, _ in seen[0]}
assert rows["dist.broadcast(x, src=0)"] == [[1, 2], [1, 2]]
assert rows["dist.all_reduce(x)"] == [[12, 14], [12, 14]]
assert rows["dist.reduce_scatter_single(out, x)"] == [[12], [14]]  # piece r of the sum
assert rows["dist.all_gather_single(out, x)"] == [[1, 2, 11, 12]] * 2
waited = ranks.pull("waited")
assert waited[0] > 0.5  # rank 0 waited for rank 1 (which slept 1 s)
pieces = rows["dist.reduce_scatter_single(out, x)"]
assert rows["dist.all_reduce(x)"][0] == pieces[0] + pieces[1]  # the pieces, gathered
fig = diagrams.collectives(rows)

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## 各ランクはモデル全体を持つ
#
# わざとランクごとに違うシードでモデルを作り、DDP で包む前と後でランク間のパラメータの差を比べます。
#
# **予想してから実行:** 2 ランクのとき、各ランクが持つパラメータはいくつで、DDP で包んだ後の差は
# いくつでしょうか? (モデルは 2110 パラメータの小さな MLP です)

# %% [markdown] lang="en" tags=["deep-dive"]
# ## Every rank holds the whole model
#
# Build the model with a different seed on each rank on purpose, and compare the ranks'
# parameters before and after wrapping it in DDP.
#
# **Predict, then run:** with 2 ranks, how many parameters does each rank hold, and how
# far apart are the ranks after wrapping? (The model is a tiny MLP of 2,110
# parameters.)

# %%
# %%px
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import comm_counting, compare, data, models

torch.manual_seed(rank)  # different initial weights on each rank, on purpose
model = models.MLP()
before = compare.replica_max_diff(model)
model = DDP(model)  # broadcasts rank 0's parameters and buffers
after = compare.replica_max_diff(model)
n_params = models.count_params(model.module)
print(f"rank {rank}: {n_params} parameters; "
      f"max difference before DDP {before:.3f}, after {after}")
assert n_params == 2110  # the whole model, not a part of it
assert before > 0 and after == 0.0

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## `DistributedSampler` と `set_epoch`
#
# 各ランクはデータの自分の分で学習し、その分は**重なってはいけません**。`DistributedSampler` は
# データセットの添字をランクの数に分け、各ランクに重ならない部分を渡します。`shuffle=True` の並びは
# シードと**エポック番号**で決まるので、毎エポック `sampler.set_epoch(epoch)` を呼びます。
# 呼び忘れると、毎エポック同じ順番になります。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## `DistributedSampler` and `set_epoch`
#
# Each rank trains on its own share of the data, and the shares **must not overlap**.
# `DistributedSampler` splits a data set's indices among the ranks, giving each rank a
# part that overlaps no other. With `shuffle=True` the order depends on the seed and on
# the **epoch number**, so call `sampler.set_epoch(epoch)` every epoch. Forget it and every
# epoch repeats the same order.

# %%
# %%px
from torch.utils.data import DistributedSampler

dataset = data.MyDataset(n=16)
sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                             shuffle=True, seed=0)
with_set_epoch, without_set_epoch = [], []
for epoch in range(3):
    sampler.set_epoch(epoch)
    with_set_epoch.append(list(sampler))
forgetful = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                               shuffle=True, seed=0)
for epoch in range(3):
    without_set_epoch.append(list(forgetful))  # set_epoch never called
print(f"rank {rank}, with set_epoch {with_set_epoch}, without {without_set_epoch}")

# %% [markdown] lang="ja"
# 集めた添字は、各エポックで重ならずに全 16 サンプルを覆い、`set_epoch` なしでは毎回同じ順番です。

# %% [markdown] lang="en"
# The indices pulled from the ranks cover all 16 samples in every epoch without overlap,
# and without `set_epoch` the order never changes.

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
# 飛ばしても先に進めます。`epoch_orders` は、このランクが各エポックで受け持つ添字のリストを返す関数です。ところが、並びが
# 毎エポック同じになってしまいます。直してください。確認のセルは、この関数を両方のランクで実行し
# (`rank` と `world_size` は引数で渡されます)、各エポックでランクの添字が重ならずに全 16 サンプルを
# 覆っているか、並びがエポックごとに変わるかを確かめます。関数はランクのエンジンで実行されるので、
# 中で使う名前はエンジンにあるもの (前の `%%px` セルで import した `DistributedSampler` など) です。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## Exercise (optional): add `set_epoch`
#
# You can skip it. `epoch_orders` returns the indices this rank gets in each epoch. But the order is the
# same every epoch: fix it. The check runs the function on both ranks (`rank` and
# `world_size` come as arguments) and checks that in every epoch the ranks' indices
# cover all 16 samples without overlap, and that the order changes from epoch to epoch.
# The function runs on the ranks' engines, so the names it uses are the engines' (such
# as `DistributedSampler`, imported there by the `%%px` cell above).

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
# 左辺は 1 プロセスで全体バッチを使った勾配、右辺は各ランクの勾配の平均 (DDP の all-reduce ÷ $N$) です。
# DDP の 1 ステップは次のとおりです。
#
# 1. 作るとき: ランク 0 の重みを broadcast (上で確かめました)
# 2. 各ランク: 自分の分で順伝播と逆伝播
# 3. 逆伝播の途中: 勾配を all-reduce し、$N$ で割る
# 4. 各ランク: 同じ勾配で `optimizer.step()`。だからレプリカは同じままです
#
# 次のセルでは、各ランクが同じ全体バッチ (64 サンプル) のうち自分の 32 サンプルだけを DDP モデルに通し、
# 1 プロセスで全体バッチを通した勾配と比べます (float32 で 1e-6 以下)。

# %% [markdown] lang="en" tags=["core"]
# ## DDP's gradient = the whole batch's gradient
#
# Split a global batch $B$ of $N b$ samples into $N$ shares $B_r$ of $b$ samples, one per
# rank. With a loss that is a mean over samples, the gradient of a sum is the sum of
# the gradients, so
#
# $$\nabla \frac{1}{Nb}\sum_{i \in B} \ell_i = \frac{1}{N}\sum_{r=1}^{N} \nabla \frac{1}{b}\sum_{i \in B_r} \ell_i$$
#
# The left side is one process's gradient on the whole batch; the right side is the
# mean of the ranks' gradients (DDP's all-reduce, divided by $N$). One DDP step is:
#
# 1. at construction: broadcast rank 0's weights (checked above);
# 2. on each rank: forward and backward on its own share;
# 3. during backward: all-reduce the gradients and divide by $N$;
# 4. on each rank: `optimizer.step()` with the same gradient, so the replicas stay equal.
#
# The next cell checks it: each rank's 32 of 64 samples against one process on all 64.

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
grad_diff = compare.max_abs_diff([p.grad for p in model.parameters()],
                                [p.grad for p in local.parameters()])
print(f"rank {rank}: max |DDP grad - whole-batch grad| = {grad_diff:.2e}")
assert grad_diff <= 1e-6

# %% [markdown] lang="ja" tags=["core"]
# ## 演習: 勾配の平均を手で書く
#
# DDP が逆伝播の中でしていること (上の手順 3) を、自分で書いてみます。`dist.all_reduce(t)` は全ランクの
# `t` を足し合わせ、その和を各ランクの `t` に書き込みます。`average_gradients(model, world_size)` を
# 完成させ、各パラメータの `.grad` を全ランクの平均にしてください。
#
# 確認のセルは、DDP で包まないモデルで各ランクが自分の 32 サンプルの勾配を求めたあとにこの関数を呼び、
# 全体バッチ (64 サンプル) の勾配と比べます。ランク数が変わっても正しいように、2 ではなく引数の
# `world_size` で割ります。

# %% [markdown] lang="en" tags=["core"]
# ## Exercise: average the gradients by hand
#
# Write what DDP does during the backward pass (step 3 above) yourself.
# `dist.all_reduce(t)` adds up every rank's `t` and writes the sum into `t` on every
# rank. Complete `average_gradients(model, world_size)` so that every parameter's
# `.grad` becomes the mean over the ranks.
#
# The check uses a model without DDP: each rank computes the gradient of its own 32
# samples, calls this function, and compares with the whole batch's (64 samples)
# gradient. Divide by the argument `world_size`, not by 2, to stay right on any number
# of ranks.

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
# DDP は勾配を**バケット**にまとめ、逆伝播でバケットの勾配がそろうたびに all-reduce を 1 回実行します
# (バケットの大きさとその理由はレッスン 05 で扱います)。通信フック (`comm_counting.CommCounter`) で、
# 3 回の逆伝播のそれぞれで送ったバイト数を数えます。オプティマイザは使いません。通信は逆伝播の中で
# 起きます。フォワードフックは、動いたモジュールを記録します。
#
# **予想してから実行:** この小さな MLP (2110 パラメータ、float32) で、1 回の逆伝播は何回 all-reduce し、
# 何バイト送るでしょうか?

# %% [markdown] lang="en" tags=["deep-dive"]
# ## What is communicated, and when
#
# DDP groups gradients into **buckets** and runs one all-reduce per bucket as soon as the
# backward pass has filled it (bucket sizes are lesson 05's). A
# communication hook (`comm_counting.CommCounter`) counts the bytes sent in each of 3
# backward passes; no optimizer: the communication happens inside the backward pass.
# A forward hook records which modules ran.
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
# ランクから集めた記録を図にします。どちらのランクでも、逆伝播のたびに全勾配 (2110 × 4 = 8440 バイト)
# を 1 回で送っています。動いたのは DDP を作ったときのモジュールだけでした
# (毎ステップ複製する DataParallel との違いです)。

# %% [markdown] lang="en"
# Pulled from the ranks: each backward sent all gradients (2110 × 4 = 8440 bytes) in
# one call. Only the module DDP was built with ran: DataParallel, unlike DDP, copies it
# every step.

# %% tags=["hide-input"]
steps = ranks.pull("log.steps")  # per rank, per backward: the bytes of each all-reduce
assert steps == [[[2110 * 4]] * 3] * 2  # every gradient once, in one call, per backward
fig = diagrams.collectives({labkit.t("backward_n", k=k): [s[k - 1] for s in steps]
                            for k in (1, 2, 3)}, fmt="{:.0f}", title="ddp_bytes_title")

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## 学習してもレプリカは一致したまま
#
# `DistributedSampler` と `DataLoader` で教師ネットワークの課題を 3 エポック学習し、
# 最後に全ランクのパラメータを比べます。全ランクが同じ平均勾配で同じ更新をするので、
# 差はちょうど 0 です。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## Replicas stay identical through training
#
# Train on the teacher task for 3 epochs with `DistributedSampler` and `DataLoader`,
# then compare every rank's parameters. Every rank applies the same update from the
# same averaged gradient, so the difference is exactly 0.

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
replica_diff = compare.replica_max_diff(model)
print(f"rank {rank}: {len(losses)} steps, last loss {losses[-1]:.3f}, "
      f"max parameter difference between ranks {replica_diff}")
assert replica_diff == 0.0

# %% [markdown] lang="ja"
# 各ランクの損失は自分のデータの分だけなので、ランクごとに少し違います。

# %% [markdown] lang="en"
# Each rank's loss covers only its own data, so the ranks' curves differ a little.

# %%
fig = plots.loss_curves({f"rank {r}": h for r, h in enumerate(ranks.pull("losses"))})

# %% [markdown] lang="ja" tags=["core"]
# ## 自分の DDP スクリプト
#
# 仕事では、DDP をエンジンではなく、`torchrun` で起動するふつうのスクリプトとして動かします。演習のセルは、
# レッスン 01 の 1 プロセスの学習ループ (256 サンプル、2 エポックに縮めたもの) を `%%writefile` で
# ファイル `ddp_train.py` に書き出します。
# `TODO` の 5 か所を直して、DDP のスクリプトにしてください。
#
# 1. 最初に `dist.init_process_group(backend)`。torchrun が渡す環境変数 (`RANK`、`WORLD_SIZE`、
#    `MASTER_ADDR` など) をこの呼び出しが読みます。バックエンドは、プロセスごとに GPU があれば
#    (`torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])`) nccl で device は
#    `cuda:LOCAL_RANK`、なければ gloo で CPU です。続けて `dist.get_rank()` と `dist.get_world_size()`
# 2. モデルを device に置いて `DDP(...)` で包む (オプティマイザを作る前)。バッチも device へ
# 3. `sampler = DistributedSampler(dataset, seed=0)` を `DataLoader(..., sampler=sampler)` に渡す
#    (`shuffle=True` は外す)。各ランクのバッチは `64 // world_size` にして、全体のバッチを 64 のままにする
# 4. 各エポックの初めに `sampler.set_epoch(epoch)`
# 5. 表示はランク 0 だけ。最後に `dist.destroy_process_group()`
#
# 確認のセルは、このファイルを torchrun で 2 プロセスとして実行し、1 プロセスのループと比べます。

# %% [markdown] lang="en" tags=["core"]
# ## Your own DDP script
#
# At work, DDP runs as a plain script that `torchrun` launches. The exercise cell
# writes lesson 01's training loop (256 samples, 2 epochs) to `ddp_train.py`
# (`%%writefile`). Fix its five `TODO`s to make it a DDP script:
#
# 1. First, `dist.init_process_group(backend)`: it reads the environment variables
#    torchrun sets (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, …). The backend is nccl on
#    device `cuda:LOCAL_RANK` when each process has a GPU of its own
#    (`torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])`), else gloo
#    on the CPU. Then `dist.get_rank()` and `dist.get_world_size()`.
# 2. Put the model on the device and wrap it, `DDP(...)`, before building the
#    optimizer; move each batch to the device too.
# 3. `sampler = DistributedSampler(dataset, seed=0)`, passed as `DataLoader(...,
#    sampler=sampler)` without `shuffle=True`; each rank's batch is `64 // world_size`,
#    so the global batch stays 64.
# 4. `sampler.set_epoch(epoch)` at the start of each epoch.
# 5. Print on rank 0 only; end with `dist.destroy_process_group()`.
#
# The check runs the file under torchrun as 2 processes and compares it with the
# one-process loop.

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
# これを子プロセスとして実行します (`torchrun.run_nodes` は `python -m torch.distributed.run` を
# 起動するので macOS でも Windows でも同じで、5 分を過ぎればワーカーごと止めます)。

# %% [markdown] lang="en"
# ### Launch it with torchrun
#
# In a terminal this is `torchrun --nproc-per-node=2 ddp_train.py` (on a cluster, see
# lesson 09). The next cell runs it as a child process (`torchrun.run_nodes` starts
# `python -m torch.distributed.run`, the same on macOS and Windows, and stops it with
# its workers after 5 minutes).

# %%
from pathlib import Path

from labkit.cluster import torchrun

for old in Path().glob("ddp_train_rank*.pt"):
    old.unlink()  # an earlier run's replicas
node, = torchrun.run_nodes(["ddp_train.py"], nnodes=1, nproc_per_node=2, timeout_s=300)
print(node.output)
assert node.returncode == 0, "torchrun failed: what it printed is above"

# %% [markdown] lang="ja"
# 次のセルは、保存された 2 つのレプリカどうしを比べ、1 プロセスで全体バッチ 64 を使ったループの重み
# とも比べます。1 レプリカの `DistributedSampler` はエポックの並び全体を返し、ランク r の分はその
# 1 つおきなので、各ステップの 2 ランクの 32 サンプルを合わせると 1 プロセスのバッチになります。
#
# **予想してから実行:** 2 つのレプリカの差と、1 プロセスの重みとの差は、それぞれどれくらいでしょうか?

# %% [markdown] lang="en"
# The next cell compares the two saved replicas with each other and with the loop on
# one process, whole batches of 64. A `DistributedSampler` for one replica yields the
# epoch's whole order and rank r's share is every other index of it, so each step's
# two shares of 32 make up the one process's batch.
#
# **Predict, then run:** how far apart are the two replicas, and how far are they from
# the one-process weights?

# %%
from torch.utils.data import DataLoader, DistributedSampler

replicas = [torch.load(f"ddp_train_rank{r}.pt") for r in range(2)]
apart = compare.max_abs_diff(replicas[0].values(), replicas[1].values())
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
diff = compare.max_abs_diff(model.state_dict().values(), replicas[0].values())
print(f"replicas apart by {apart}; DDP against one process: {diff:.1e}")
assert apart == 0.0  # identical replicas
assert diff <= 1e-5  # the whole batch's updates, up to float32 rounding

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## ランクでエラーが起きたら
#
# `%%px` のセルでランクが例外を出すと、そのランクの番号とトレースバックがセルに表示されます
# (`[1:execute] ValueError …`)。次のセルはランク 1 だけでわざと失敗します。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## When a rank fails
#
# When a rank raises in a `%%px` cell, the cell shows that rank's number and traceback
# (`[1:execute] ValueError …`). The next cell fails on rank 1 only, on purpose.

# %% tags=["raises-exception"]
# %%px
if rank == 1:
    raise ValueError(f"rank {rank} got a batch of the wrong shape")
print(f"rank {rank} is fine")

# %%
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

# %%
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
# 全体バッチ 1024 サンプルを、1 ランクはすべて計算します。2 ランクでは各ランクが半分の 512 サンプルを
# 計算し、その代わりに勾配を全部 (全パラメータ × 4 バイト) all-reduce します。次のセルは、
# 110 万パラメータの MLP でこの 2 つを数えます。浮いた時間が通信の時間より長いかは、レッスン 05 で
# 測ります。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## Time per step with world size 1 and 2
#
# Of a global batch of 1024 samples one rank computes all; two ranks compute 512 each
# and in exchange all-reduce every gradient (all parameters × 4 bytes), as the next
# cell counts for a 1.1 M-parameter MLP. Whether the time saved exceeds the time spent
# communicating is lesson 05's question.

# %%
# %%px
big = DDP(models.WideMLP(hidden=1024, depth=2))
counter = comm_counting.CommCounter().attach(big)
X_mine = data.shard(torch.randn(1024, 10), rank, world_size)  # of the global batch
for _ in range(2):  # step 1 sizes the buckets; count step 2
    counter.reset()
    big(X_mine).pow(2).mean().backward()
print(f"rank {rank}: {len(X_mine)} of 1024 samples, {counter.bytes:,} bytes all-reduced")
assert len(X_mine) == 1024 // world_size
assert counter.bytes == models.count_params(big.module) * 4  # every gradient

# %% [markdown] lang="ja" tags=["core"]
# ## 後片付け
#
# エンジンはカーネルの終了とともに止まりますが、明示的に止めることもできます。スクリプトが保存した
# レプリカのファイルも消します (`ddp_train.py` は残します)。

# %% [markdown] lang="en" tags=["core"]
# ## Clean up
#
# The engines stop with the kernel, but they can also be stopped explicitly. The
# replica files the script saved go too (`ddp_train.py` stays).

# %%
ranks.stop()
assert cluster.current() is None
for f in Path().glob("ddp_train_rank*.pt"):
    f.unlink()

# %% [markdown] lang="ja" tags=["summary"]
# ## 覚えておくこと
#
# - **集団通信は全ランクが同じ呼び出しをする通信**で、broadcast は 1 つのランクの値を配り、all-reduce は
#   和を全員に、reduce-scatter は和の切れ端をそれぞれに、all-gather は全員の値を全員に渡し、barrier は
#   全員がそろうまで待ちます。
# - **DDP の各ランクはモデル全体を持ち**、作るときにランク 0 の重みを broadcast でそろえます
#   (パラメータを分けて持つのは FSDP や ZeRO です)。
# - **等しい大きさのシャードの勾配の平均は、全体バッチの勾配**で、損失がサンプルの平均なら、
#   微分が和と交換できることから 1 行で導けます。
# - **`DistributedSampler` はランクに重ならないデータを配り**、毎エポック `set_epoch(epoch)` を
#   呼ばないと、毎エポック同じ順番になります。
# - **DDP のスクリプトは 1 プロセスのループに 5 か所を足したもの**で (プロセスグループ、`DDP(model)`、
#   sampler と `set_epoch`、ランク 0 だけの表示、`destroy_process_group`)、`torchrun` で起動すると
#   1 プロセスで全体バッチを使った学習と同じ重みになります。

# %% [markdown] lang="en" tags=["summary"]
# ## What to remember
#
# - **A collective is a call every rank makes**: broadcast hands out one rank's values,
#   all-reduce gives everyone the sum, reduce-scatter gives each rank a piece of it,
#   all-gather gives everyone everyone's values, and barrier waits until all have come.
# - **Every DDP rank holds the whole model**, made equal by a broadcast of rank 0's
#   weights when DDP is built (sharding the parameters is FSDP's or ZeRO's).
# - **The mean of equal shards' gradients is the whole batch's gradient**, in one line
#   of algebra for a loss that is a mean over samples.
# - **`DistributedSampler` gives the ranks disjoint data**, and without
#   `set_epoch(epoch)` each epoch repeats the same order.
# - **A DDP script is a one-process loop plus five changes** (the process group,
#   `DDP(model)`, the sampler and `set_epoch`, printing on rank 0, `destroy_process_group`);
#   launched with `torchrun`, it reaches the weights of one process on the whole batch.

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
