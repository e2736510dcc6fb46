# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown] lang="ja"
# # 03 DistributedDataParallel
#
# `DistributedDataParallel` (DDP) では、複数の**プロセス** (ランク) がそれぞれ**モデル全体の複製**
# (レプリカ) を持ち、データを分け合って学習します。逆伝播の途中で勾配を all-reduce で平均するので、
# 全ランクが同じ更新をし、レプリカはいつも同じままです。
#
# 記事 000 は「各 GPU はモデルのパラメータの一部を保持し」と書いていますが、これは DDP ではなく
# **FSDP** や **ZeRO** (パラメータを分割して持つ方式) の説明です。このレッスンで、DDP の各ランクが
# 全パラメータを持つことを確かめます。
#
# このレッスンで見ること:
# 1. ランクをノートブックから起動する (ipyparallel のエンジン)
# 2. 各ランクが全パラメータを持ち、DDP が最初にそろえること
# 3. `DistributedSampler` と `set_epoch`
# 4. DDP の平均勾配 = 1 プロセスで全バッチを使った勾配
# 5. 何が、いつ通信されるか (all-reduce の回数とバイト数)
# 6. 学習後もレプリカが一致すること、ランクのエラーの見え方
# 7. ノートブックから `mp.spawn` を使わない理由
# 8. world size 1 と 2 の 1 ステップの時間
# 9. スレッドの DataParallel (レッスン 02) とプロセスの DDP の時間

# %% [markdown] lang="en"
# # 03 DistributedDataParallel
#
# With `DistributedDataParallel` (DDP), several **processes** (ranks) each hold a
# **full copy of the model** (a replica) and share out the data. During the backward pass
# the gradients are averaged by an all-reduce, so every rank makes the same update and
# the replicas stay identical.
#
# Doc 000 says "each GPU holds part of the model's parameters". That describes **FSDP**
# or **ZeRO** (which shard the parameters), not DDP. This lesson checks that every DDP
# rank holds all the parameters.
#
# In this lesson:
# 1. start ranks from the notebook (ipyparallel engines)
# 2. every rank holds all parameters, and DDP makes them equal at the start
# 3. `DistributedSampler` and `set_epoch`
# 4. DDP's averaged gradient = one process's gradient on the whole batch
# 5. what is communicated, and when (all-reduce calls and bytes)
# 6. replicas still equal after training; how a rank's error shows
# 7. why not `mp.spawn` from a notebook
# 8. time per step with world size 1 and 2
# 9. thread-based DataParallel (lesson 02) against process-based DDP, timed

# %%
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %% [markdown] lang="ja"
# 次のセルで 2 つのランクの起動を始めます。起動には数秒かかりますが、裏で進むので、その間に先を読めます。

# %% [markdown] lang="en"
# The next cell starts two ranks. They take a few seconds to boot, in the background, so
# you can read on meanwhile.

# %%
import time

from labkit import cluster

t0 = time.perf_counter()
ranks = cluster.start(2, background=True)  # returns at once; the ranks boot meanwhile

# %% [markdown] lang="ja"
# ## ランクを起動する
#
# `cluster.start(2)` は 2 つのエンジン (Python プロセス) を 127.0.0.1 で起動し、エンジン i をランク i
# にして、gloo のプロセスグループに参加させます。GPU のあるマシンでも gloo です。このレッスンのセルは
# モデルもテンソルも CPU に作り、nccl は CUDA のテンソルしか扱えないからです (GPU で DDP を動かすのは
# コマンドラインです。レッスン 00)。
# `background=True` なら、起動を待たずにすぐ戻ります。最初に使うとき (`%%px` のセルや `ranks.wait()`)
# に、起動が終わるのを待ちます。
#
# - ランクが互いを見つけるための待ち合わせ場所 (TCPStore) は、OS が選んだ空きポートに、
#   127.0.0.1 だけで開きます。
# - 2 コアを 2 ランクで取り合わないよう、各ランクは `torch.set_num_threads(1)` で動きます。
# - 集団通信のタイムアウトは 20 秒です。gloo の既定 (30 分) のままだと、1 つのランクが来ないだけで
#   30 分止まったままになります。
#
# 起動したあとは、`%%px` で始まるセルが**全ランクで**実行されます。各エンジンには `rank`、
# `world_size`、`device` という変数が用意されています。最初の `%%px` セルは、ランクごとに別の
# プロセスであること (1 ランク 1 プロセス。`torchrun` が GPU 1 台に 1 プロセスを起動するのと同じ) を
# 確かめます。

# %% [markdown] lang="en"
# ## Start the ranks
#
# `cluster.start(2)` starts two engines (Python processes) on 127.0.0.1, makes engine i
# rank i, and joins them in a gloo process group, also on a machine with GPUs: this
# lesson's cells build models and tensors on the CPU, and nccl takes CUDA tensors only
# (DDP on GPUs is the command line's, lesson 00). With
# `background=True` it returns at once; the first use (a `%%px` cell, or `ranks.wait()`)
# waits for the start to finish.
#
# - The meeting point where ranks find each other (a TCPStore) listens on 127.0.0.1 only,
#   on a free port the OS picks.
# - Each rank runs with `torch.set_num_threads(1)`, so two ranks do not fight over two
#   cores.
# - Collectives time out after 20 s. With gloo's default (30 minutes) a bug becomes a long
#   hang.
#
# From now on, a cell that starts with `%%px` runs **on every rank**. Each engine has the
# variables `rank`, `world_size` and `device`. The first `%%px` cell checks that each
# rank is a process of its own (one process per rank, as `torchrun` starts one per GPU).

# %%
import torch

from labkit import checks, exercises, plots

ranks.wait()
print(f"{ranks.world_size} ranks ready {time.perf_counter() - t0:.1f} s after the start")

# %%
# %%px
import os

import torch
import torch.distributed as dist

pids = [None] * world_size
dist.all_gather_object(pids, os.getpid())  # every rank's process id
print(f"rank {rank} of {world_size}, backend {dist.get_backend()}, "
      f"device {device}, threads {torch.get_num_threads()}, processes {pids}")
assert (dist.get_backend(), device) == ("gloo", "cpu")  # on any machine
assert len(set(pids)) == world_size  # one process per rank

# %% [markdown] lang="ja"
# ## 各ランクはモデル全体を持つ
#
# わざとランクごとに違うシードでモデルを作り、DDP で包む前と後でランク間のパラメータの差を比べます。
# DDP は作るときにランク 0 のパラメータを全ランクへ送る (broadcast) ので、包んだ後の差は 0 です。
# そして各ランクが持つパラメータ数は、モデル全体の数 (記事 004 のモデルで 2110) です。

# %% [markdown] lang="en"
# ## Every rank holds the whole model
#
# Build the model with a different seed on each rank on purpose, and compare the ranks'
# parameters before and after wrapping it in DDP. DDP sends rank 0's parameters to every
# rank (a broadcast) when it is built, so afterwards the difference is 0. And each rank
# holds as many parameters as the whole model (2110 for doc 004's model).

# %%
# %%px
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import checks, comm_counting, compare, data, models

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

# %% [markdown] lang="ja"
# ## `DistributedSampler` と `set_epoch`
#
# `DistributedSampler` はデータセットの添字をランクの数に分け、各ランクに重ならない部分を渡します。
# `shuffle=True` の並びはシードと**エポック番号**で決まるので、毎エポック `sampler.set_epoch(epoch)`
# を呼びます。呼び忘れると、毎エポック同じ順番になります。

# %% [markdown] lang="en"
# ## `DistributedSampler` and `set_epoch`
#
# `DistributedSampler` splits a data set's indices among the ranks, giving each rank a
# part that overlaps no other. With `shuffle=True` the order depends on the seed and on
# the **epoch number**, so call `sampler.set_epoch(epoch)` every epoch. Forget it and every
# epoch repeats the same order.

# %%
# %%px
from torch.utils.data import DistributedSampler

from labkit import data

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
print(f"rank {rank} with set_epoch:    {with_set_epoch}")
print(f"rank {rank} without set_epoch: {without_set_epoch}")

# %% [markdown] lang="ja"
# カーネル側で全ランクの添字を集めて確かめます: 各エポックでランクの添字は重ならず、
# 合わせると全 16 サンプルになります。`set_epoch` ありではエポックごとに順番が変わり、
# なしでは毎回同じです。

# %% [markdown] lang="en"
# Collect every rank's indices in the kernel and check: in each epoch the ranks' indices
# do not overlap and together cover all 16 samples. With `set_epoch` the order changes
# from epoch to epoch; without it, it is always the same.

# %%
per_rank = ranks.pull("with_set_epoch")
for epoch in range(3):
    parts = [set(indices[epoch]) for indices in per_rank]
    assert parts[0].isdisjoint(parts[1])
    assert parts[0] | parts[1] == set(range(16))
assert per_rank[0][0] != per_rank[0][1]  # a new order each epoch
forgetful = ranks.pull("without_set_epoch")
assert all(order == forgetful[0][0] for order in forgetful[0])  # the same every epoch
print("disjoint, complete; set_epoch changes the order; forgetting it repeats it")

# %% [markdown] lang="ja"
# ## 演習: `set_epoch` を足す
#
# `epoch_orders` は、このランクが各エポックで受け持つ添字のリストを返す関数です。ところが、並びが
# 毎エポック同じになってしまいます。直してください。
#
# 確認のセルは、この関数を両方のランクで実行し (`rank` と `world_size` は引数で渡されます)、各エポックで
# ランクの添字が重ならずに全 16 サンプルを覆っているか、並びがエポックごとに変わるかを確かめます。
# 関数はランクのエンジンで実行されるので、中で使う名前はエンジンにあるもの (前の `%%px` セルで
# import した `DistributedSampler` や `dist` など) です。
#
# 演習のセルを書き換えて実行してから、確認のセルを実行します。正しければ「正解です」と表示され、
# 違っていれば、どこが違うかがヒントとともに表示されます。完全版のノートブックでは演習のすぐあとに解答のセルが
# ありますが、まず自分で解いてみてください。

# %% [markdown] lang="en"
# ## Exercise: add `set_epoch`
#
# `epoch_orders` returns the indices this rank gets in each epoch. But the order is the
# same every epoch: fix it.
#
# The check runs the function on both ranks (`rank` and `world_size` come as arguments)
# and checks that in every epoch the ranks' indices cover all 16 samples without overlap,
# and that the order changes from epoch to epoch. The function runs on the ranks'
# engines, so the names it uses are the engines' (such as `DistributedSampler` and
# `dist`, imported there by the `%%px` cells above).
#
# Edit and run the exercise cell, then run the check cell. It says "Correct" when the
# answer is right, and otherwise what is wrong, with a hint. In the full notebooks a
# solution cell follows each exercise: try on your own first.

# %% tags=["exercise"]
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

# %% [markdown] lang="ja"
# ## DDP の勾配 = 全バッチの勾配
#
# どのランクも同じシードで同じ「全体バッチ」(64 サンプル) を作り、自分の分 (32 サンプル) だけを
# DDP モデルに通します。DDP は各ランクの勾配を all-reduce で**平均**します。損失がバッチ平均なら、
# 等しい大きさに分けたバッチの勾配の平均は、全体バッチの勾配そのものです。
# DDP で包まない 1 プロセスのモデルに全体バッチを通した勾配と比べます (float32 で 1e-6 以下)。

# %% [markdown] lang="en"
# ## DDP's gradient = the whole batch's gradient
#
# Every rank builds the same "global batch" (64 samples) from the same seed and passes
# only its own share (32 samples) through the DDP model. DDP **averages** the ranks'
# gradients with an all-reduce. With a loss that is a batch mean, the average of the
# gradients of equal shares is exactly the whole batch's gradient. Compare with one
# process, no DDP, on the whole batch (float32, at most 1e-6).

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

# %% [markdown] lang="ja"
# ## 演習: 勾配の平均を手で書く
#
# DDP が逆伝播の中でしていることを、自分で書いてみます。`dist.all_reduce(t)` は全ランクの `t` を
# 足し合わせ、その和を各ランクの `t` に書き込みます。`average_gradients(model, world_size)` を完成させ、
# 各パラメータの `.grad` を全ランクの平均にしてください。
#
# 確認のセルは、DDP で包まないモデルで、各ランクが自分の分 (32 サンプル) の勾配を求めたあとにこの関数を
# 呼び、全体バッチ (64 サンプル) の勾配と比べます。確認は 2 ランクでしか実行しないので、`world_size`
# の代わりに 2 と書いても区別できません。ランク数が変わっても正しいように、引数の `world_size` で割ります。

# %% [markdown] lang="en"
# ## Exercise: average the gradients by hand
#
# Write what DDP does during the backward pass yourself. `dist.all_reduce(t)` adds up
# every rank's `t` and writes the sum into `t` on every rank. Complete
# `average_gradients(model, world_size)` so that every parameter's `.grad` becomes the
# mean over the ranks.
#
# The check uses a model without DDP: each rank computes the gradient of its own share
# (32 samples), calls this function, and compares with the whole batch's (64 samples)
# gradient. The check runs on 2 ranks only, so it cannot tell a 2 written in place of
# `world_size` from the argument: divide by `world_size`, which stays right on any
# number of ranks.

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

# %% [markdown] lang="ja"
# ## 何が、いつ通信されるか
#
# DDP は勾配を**バケット**にまとめ、逆伝播でバケットの勾配がそろうたびに all-reduce を 1 回実行します。
# `DDP(model)` のバケットは次のとおりです (torch 2.13。MB は torch の中では MiB = 2^20 バイト)。
#
# - 1 ステップ目: 勾配がどの順にそろうかをまだ知らないので、全勾配で 1 つのバケット
# - 2 ステップ目の前: 1 ステップ目で勾配がそろった順にバケットを作り直す。最初のバケットは 1 MiB、
#   残りは 25 MiB に達した時点で閉じる (`bucket_cap_mb` を渡すと、最初のバケットもその値)
#
# 通信フック (`comm_counting.CommCounter`) で、ステップごとに送られたバケットのバイト数を
# 記録します。1 ステップで送るのは全パラメータの勾配 1 回分 (float32 で 2110 × 4 = 8440
# バイト) で、1 MiB よりずっと小さいので、`DDP(model)` では毎ステップ 1 つのバケットです。
# `bucket_cap_mb` を約 2 KB にすると、2 ステップ目からバケットが増えます。回数が増えても、
# バイト数の合計は同じです。大きなモデルでの様子はレッスン 05 で見ます。

# %% [markdown] lang="en"
# ## What is communicated, and when
#
# DDP groups gradients into **buckets** and runs one all-reduce per bucket as soon as the
# backward pass has filled it. The buckets of `DDP(model)` are (torch 2.13; inside torch,
# "MB" means MiB, 2^20 bytes):
#
# - step 1: one bucket with every gradient, since DDP does not know yet in which order
#   the gradients become ready
# - before step 2: buckets rebuilt in the order the gradients arrived in step 1; the
#   first closes once it reaches 1 MiB, the others at 25 MiB (passing `bucket_cap_mb`
#   sets the first one's limit too)
#
# A communication hook (`comm_counting.CommCounter`) records the bytes of the buckets
# sent in each step. One step sends every parameter's gradient once (float32: 2110 × 4 =
# 8440 bytes), far below 1 MiB, so `DDP(model)` sends one bucket every step. With
# `bucket_cap_mb` at about 2 KB, there are more buckets from step 2 on: more calls, the
# same bytes. Lesson 05 shows a larger model.

# %%
# %%px
seen = {}
ways = {"DDP(model)": {}, "bucket_cap_mb=0.002": {"bucket_cap_mb": 0.002}}
for name, kwargs in ways.items():
    torch.manual_seed(0)
    model = DDP(models.MLP(), **kwargs)
    log = comm_counting.CommCounter(per_step=True).attach(model)
    for step in range(3):
        log.step()
        criterion(model(data.shard(X, rank, world_size)),
                  data.shard(y, rank, world_size)).backward()
    seen[name] = log.steps
    print(f"rank {rank}, {name}: " + "; ".join(
        f"step {i}: {len(sizes)} all-reduce(s), {sum(sizes)} bytes"
        for i, sizes in enumerate(log.steps, start=1)))
assert seen["DDP(model)"] == [[2110 * 4]] * 3  # under the 1 MiB first bucket
tiny = seen["bucket_cap_mb=0.002"]
assert all(sum(sizes) == 2110 * 4 for sizes in tiny)  # the same bytes every step
assert len(tiny[0]) == 1 and len(tiny[1]) > 1  # one bucket, then the rebuilt ones

# %% [markdown] lang="ja"
# ## 学習してもレプリカは一致したまま
#
# `DistributedSampler` と `DataLoader` で教師ネットワークの課題を 3 エポック学習し、
# 最後に全ランクのパラメータを集めて比べます。全ランクが同じ平均勾配で同じ更新をするので、
# 差はちょうど 0 です。

# %% [markdown] lang="en"
# ## Replicas stay identical through training
#
# Train on the teacher task for 3 epochs with `DistributedSampler` and `DataLoader`,
# then gather every rank's parameters and compare. Every rank applies the same update
# from the same averaged gradient, so the difference is exactly 0.

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
# 各ランクの損失は自分のデータの分だけなので、ランクごとに少し違います。学習曲線で見ます。

# %% [markdown] lang="en"
# Each rank's loss covers only its own data, so the ranks' curves differ a little.

# %%
fig = plots.loss_curves({f"rank {r}": h for r, h in enumerate(ranks.pull("losses"))})

# %% [markdown] lang="ja"
# ## ランクでエラーが起きたら
#
# `%%px` のセルでランクが例外を出すと、そのランクの番号とトレースバックがセルに表示されます
# (`[1:execute] ValueError …`)。次のセルはランク 1 だけでわざと失敗します。

# %% [markdown] lang="en"
# ## When a rank fails
#
# When a rank raises in a `%%px` cell, the cell shows that rank's number and traceback
# (`[1:execute] ValueError …`). The next cell fails on rank 1 only, on purpose.

# %% tags=["raises-exception"]
# %%px
if rank == 1:
    raise ValueError(f"rank {rank} got a batch of the wrong shape")
print(f"rank {rank} is fine")

# %% [markdown] lang="ja"
# Python から実行すると、同じ失敗は `cluster.RankError` になり、失敗したランクを名指しします。
# 失敗したのは例外を出したランクだけで、エンジンはそのまま使えます。

# %% [markdown] lang="en"
# Run from Python, the same failure is a `cluster.RankError` naming the failed rank. Only
# that rank raised; the engines remain usable.

# %%
code = 'if rank == 1:\n    raise ValueError(f"rank {rank} got a batch of the wrong shape")'
with checks.expect_error(cluster.RankError, match="rank 1 raised") as caught:
    ranks.run(lambda: None)  # engines answer
    ranks.execute(code)
assert list(caught.exception.failures) == [1]
assert "ValueError" in caught.exception.failures[1]
assert ranks.run(lambda: 42) == [42, 42]  # still usable

# %% [markdown] lang="ja"
# ## ノートブックから `mp.spawn` を使わない理由
#
# よく見る `torch.multiprocessing.spawn(train, nprocs=2)` は、新しい Python プロセスを起動し、
# `train` を名前で探します。ノートブックのセルで定義した関数はカーネルの `__main__` にしかないので、
# 子プロセスは見つけられず (`Can't get attribute 'train' on <module '__main__'>`) 終了します。
# しかもそのトレースバックはカーネルの標準エラー (ノートブックには出ない) に書かれ、セルに出るのは
# `ProcessExitedException: process 0 terminated with exit code 1` だけです。
# 次のセルでは、失われるはずの標準エラーを取り出して見せます。

# %% [markdown] lang="en"
# ## Why not `mp.spawn` from a notebook
#
# The common `torch.multiprocessing.spawn(train, nprocs=2)` starts new Python processes
# that look `train` up by name. A function defined in a notebook cell exists only in the
# kernel's `__main__`, so the children cannot find it (`Can't get attribute 'train' on
# <module '__main__'>`) and exit. Worse, that traceback goes to the kernel's stderr, which
# the notebook never shows; the cell only gets
# `ProcessExitedException: process 0 terminated with exit code 1`.
# The next cell captures the stderr that would have been lost.

# %%
import torch.multiprocessing as mp


def train(rank):  # defined in a cell: it lives in the kernel's __main__
    print(f"rank {rank} training")


with checks.captured_stderr() as lost:
    with checks.expect_error(mp.ProcessExitedException, match="exit code 1"):
        mp.spawn(train, nprocs=2)
print("--- what the children wrote to the kernel's stderr ---")
print("\n".join(line for line in lost.text.splitlines() if "Error" in line))
assert "Can't get attribute 'train'" in lost.text

# %% [markdown] lang="ja"
# エンジンは一度起動したら残り続けるふつうの Python プロセスで、`%%px` のコードはそこで実行されます。
# 関数をピクル化して送る必要がなく、各ランクの出力とトレースバックはセルに表示されます。
# スクリプトとして実行するときは `torchrun` を使います (レッスン 04 と 09)。

# %% [markdown] lang="en"
# Engines are ordinary Python processes that stay up once started, and `%%px` code runs
# in them: nothing has to be pickled, and each rank's output and traceback appear in the
# cell. As a script, use `torchrun` (lessons 04 and 09).

# %% [markdown] lang="ja"
# ## world size 1 と 2 の 1 ステップの時間
#
# 全体バッチ (1024 サンプル) を固定し、1 ランクだけのグループと 2 ランクのグループで 1 ステップの
# 時間を比べます。まず、それぞれが 1 ステップで何をするかを数えます。1 ランクでは 1024 サンプルを
# すべて計算します。2 ランクでは、各ランクが計算するのは半分の 512 サンプルで、その代わりに勾配を
# 全部 (全パラメータ × 4 バイト) もう 1 つのプロセスと all-reduce します。

# %% [markdown] lang="en"
# ## Time per step with world size 1 and 2
#
# Fix the global batch (1024 samples) and compare a step in a group of one rank and in a
# group of two. First count what each does in a step. One rank computes all 1024
# samples. With two ranks, each computes 512, half the batch, and in exchange all-reduces
# every gradient (all parameters × 4 bytes) with the other process.

# %%
# %%px
from labkit import dp_experiments

solo = dist.new_group([0])  # a group of rank 0 alone: world size 1
sizes = [("doc 004 MLP", 100, 1), ("MLP 1024x2", 1024, 2)]
steppers = {}  # (model, world size): one timed DDP step per call
counters = {}  # world size 2 only: CommCounter all-reduces over the default group
for name, hidden, depth in sizes:
    steppers[name, 2] = dp_experiments.ddp_stepper(hidden, depth, 1024)
    if rank == 0:
        steppers[name, 1] = dp_experiments.ddp_stepper(hidden, depth, 1024, group=solo)
    counters[name] = comm_counting.CommCounter().attach(steppers[name, 2].model)
work = {}  # samples this rank computes, and bytes it all-reduces, in one step
samples = []  # the batch sizes the model saw
for (name, world), step in steppers.items():
    hook = step.model.module.register_forward_hook(
        lambda module, args, out: samples.append(len(args[0])))
    step()  # DDP sizes its buckets during the first step
    samples.clear()
    if world == 2:
        counters[name].reset()
    step()
    hook.remove()
    work[name, world] = (sum(samples), counters[name].bytes if world == 2 else 0)
    print(f"rank {rank}, {name}, world size {world}: {work[name, world][0]} samples, "
          f"{work[name, world][1]:,} bytes all-reduced with the other rank")
for (name, world), (n_samples, nbytes) in work.items():
    n_params = models.count_params(steppers[name, world].model.module)
    assert n_samples == 1024 // world
    assert nbytes == (n_params * 4 if world == 2 else 0)

# %% [markdown] lang="ja"
# 2 ランクで速くなるかは、半分になった計算で浮く時間が、プロセスの間の通信とランクどうしの同期待ちに
# かかる時間より大きいかで決まります。記事 004 の小さなモデル (2110 パラメータ) は計算がごくわずかで、
# 幅 1024 の 2 層 MLP (約 110 万パラメータ) は計算が大きいモデルです。
#
# 次のセルは、1 ランクの 1 ステップと 2 ランクの 1 ステップを交互に繰り返して測り、それぞれの中央値を
# 比べます。交互に測るのは、共有されたマシンの遅い時間帯が両方に同じように当たるようにするためです。
# それでも、このマシン (CPU 2 コアを共有) ではどちらが速いかが実行ごとに入れ替わることがあるので、
# 順番を確かめるセルはありません。表示されるのは「この実行では」の結果です。
# ほかの仕事のないマシンで計算の多いモデルを 2 ランクにしたときの効率は、`bench/` の
# `scaling_efficiency_2proc` が測っています。

# %% [markdown] lang="en"
# Whether two ranks are faster depends on whether the time saved by computing half is
# more than the time the communication between processes and the ranks' waiting for
# each other cost. Doc 004's small model (2110 parameters) computes almost nothing; the
# 2-layer MLP of width 1024 (about 1.1 million parameters) computes a lot.
#
# The next cell times a step with one rank and a step with two in turns, over and over,
# and compares the medians: taking turns makes the slow moments of a shared machine fall
# on both alike. Even so, on this machine (two shared CPU cores) which is faster can
# change from run to run, so no cell asserts an order: what it prints is "on this run".
# `bench/` measures the efficiency of two ranks on a model that computes a lot, on a
# machine with nothing else to do (`scaling_efficiency_2proc`).

# %%
# %%px
import statistics

from labkit import timing

rounds = 6  # medians to show, not to assert (see above)
# In turns (world size 2, then 1 on rank 0) after two rounds of warm-up; each
# stepper waits for its group's ranks, then returns its own step's seconds.
times = timing.interleaved(steppers, rounds=rounds, warmup=2, clock=False)
step_ms = {name: {f"world size {world}": statistics.median(times[name, world]) * 1e3
                  for world in (1, 2) if (name, world) in times}
           for name, *_ in sizes}
print(f"rank {rank}:", step_ms)

# %%
from labkit import dp_experiments  # registers the chart's title

step_ms = ranks.pull("step_ms")[0]  # rank 0 timed both world sizes
for name, ms in step_ms.items():
    ratio = ms["world size 2"] / ms["world size 1"]
    print(f"{name}: on this run, 2 ranks took {ratio:.2f}x the time of 1 rank "
          f"({'faster' if ratio < 1 else 'slower'})")
fig = plots.bar_chart(step_ms, ylabel="step_time_ms", title="step_time_vs_world",
                      fmt="{:.1f} ms")

# %% [markdown] lang="ja"
# ## スレッドの DataParallel とプロセスの DDP
#
# レッスン 02 の DataParallel と DDP を、同じ仕事 (全体バッチ 1024 の 1 ステップ) で比べます。
# 1 つの模擬デバイスは CPU コア 1 つに当たります (torch のスレッド 1 本)。
#
# - 1 デバイス: モデルをそのまま、このカーネルでコア 1 つで
# - DP ×2: DataParallel を 2 台の模擬デバイスで。このカーネルの中で、レプリカごとにスレッド 1 本
# - DDP ×2: 上の 2 ランクの DDP。別々のプロセスで、ランクごとにスレッド 1 本
#
# まず、1 ステップごとに何をするかを数えます。3 ステップで、DataParallel は毎ステップ複製を作り、
# 動いたモジュールは 6 つ (ステップごとにレプリカ 2 つ) です。DDP の各ランクで動くのは、作ったときの
# モジュール 1 つだけで、代わりに毎ステップ勾配を all-reduce します。

# %% [markdown] lang="en"
# ## Thread-based DataParallel against process-based DDP
#
# Compare lesson 02's DataParallel with DDP on the same work (one step with a global batch
# of 1024). One simulated device stands for one CPU core (one torch thread).
#
# - 1 device: the plain model, in this kernel, on one core
# - DP ×2: DataParallel on 2 simulated devices, in this kernel, one thread per replica
# - DDP ×2: DDP on the two ranks above, separate processes, one thread per rank
#
# First count what each does per step. In 3 steps DataParallel builds replicas at every
# step: 6 modules run (2 replicas a step). On each DDP rank only one module runs, the one
# DDP was built with; instead, every step all-reduces the gradients.

# %%
from unittest import mock

from labkit import data_parallel as dp
from labkit import dp_experiments

dp_step = dp_experiments.dp_stepper(100, 1, 1024, devices=2)  # doc 004's MLP
dp_ran = []  # the modules that ran, kept alive so that their ids stay unique
hook = dp_step.model.register_forward_hook(  # replicas share the original's hooks
    lambda module, args, out: dp_ran.append(module))
with mock.patch.object(dp, "replicate", wraps=dp.replicate) as replicate:
    for _ in range(3):
        dp_step()
hook.remove()
print(f"DataParallel, 3 steps: {replicate.call_count} replications, "
      f"{len({id(m) for m in dp_ran})} modules ran")
assert replicate.call_count == 3 and len({id(m) for m in dp_ran}) == 6

# %%
# %%px
ddp_step, counter = steppers["doc 004 MLP", 2], counters["doc 004 MLP"]
ddp_ran = []
hook = ddp_step.model.module.register_forward_hook(
    lambda module, args, out: ddp_ran.append(module))
counter.reset()
for _ in range(3):
    ddp_step()
hook.remove()
print(f"rank {rank}, DDP, 3 steps: {len({id(m) for m in ddp_ran})} module ran, "
      f"{counter.calls} all-reduces of {counter.bytes // counter.calls:,} bytes")
assert len({id(m) for m in ddp_ran}) == 1 and ddp_ran[0] is ddp_step.model.module
assert counter.calls == 3 and counter.bytes == 3 * 2110 * 4  # one bucket per step

# %% [markdown] lang="ja"
# 次のセルは、3 通りの 1 ステップを交互に繰り返して測り、中央値を比べます (上と同じ理由です)。
# DDP の 1 ステップの時間は、遅いほうのランクの時間です。

# %% [markdown] lang="en"
# The next cell times a step of each of the three in turns, over and over, and compares
# the medians (for the reason above). A DDP step takes as long as its slower rank.

# %%
import statistics

from labkit import timing

sizes = [("doc 004 MLP", 100, 1), ("MLP 1024x2", 1024, 2)]  # as on the ranks
rounds = 6  # medians to show, not to assert (see above)
ways = [labkit.t("one_device"), labkit.t("dp_threads"), labkit.t("ddp_processes")]


def ddp_step(name):
    """A DDP step on both ranks, timed there: it lasts as long as the slower rank's."""
    ranks.execute(f"t = steppers[{name!r}, 2]()")
    return max(ranks.pull("t"))


steps = {}  # (model, way): one step per call, returning its seconds
for name, hidden, depth in sizes:
    steps[name, ways[0]] = dp_experiments.dp_stepper(hidden, depth, 1024, devices=1)
    steps[name, ways[1]] = dp_experiments.dp_stepper(hidden, depth, 1024, devices=2)
    steps[name, ways[2]] = lambda name=name: ddp_step(name)
times = timing.interleaved(steps, rounds=rounds, warmup=2, clock=False)
step_ms = {name: {way: statistics.median(times[name, way]) * 1e3 for way in ways}
           for name, *_ in sizes}
for name, ms in step_ms.items():
    order = sorted(ms, key=ms.get)
    print(f"{name}, on this run, fastest first:",
          ", ".join(f"{way.replace(chr(10), ' ')} {ms[way]:.1f} ms" for way in order))
fig = plots.bar_chart(step_ms, ylabel="step_time_ms", title="dp_vs_ddp_title",
                      fmt="{:.1f} ms")

# %% [markdown] lang="ja"
# どの方式が速いかは、モデルとマシンで変わります。このマシンでは実行ごとに入れ替わることもあるので、
# 順番を確かめるセルはなく、上に表示されたのは「この実行では」の順番です。確かめたのは、それぞれが
# 払う手間のほうです。
#
# - DataParallel (スレッド) は、毎ステップモデルを複製し (上で 3 ステップに 3 回)、入力を分けて
#   出力をデバイス 0 に集め、レプリカのスレッドが 1 つの GIL を取り合います (レッスン 02)。
# - DDP (プロセス) は、毎ステップ勾配を all-reduce し (上で 1 ステップに 1 回、8,440 バイト)、
#   ランクどうしが互いを待ちます。記事 004 の小さなモデルでは計算がごくわずかなので、この手間が目立ちます。
#   その代わり、各ランクは別々のプロセスで自分の GIL を持ち、モデルを複製し直すことも、出力を 1 か所に
#   集めることもありません。
#
# PyTorch の文書は、DataParallel は「1 台のマシンでも DDP より遅いのが普通」と書いています
# (レッスン 02)。このマシンではその順番は決まっていないので、この講座はそれを確かめてはいません。

# %% [markdown] lang="en"
# Which way is fastest depends on the model and the machine. On this machine the order
# can change from run to run, so no cell asserts it: what the cell above printed is the
# order on this run. What the cells do check is what each way pays.
#
# - DataParallel (threads) replicates the model at every step (3 times in the 3 steps
#   above), scatters the inputs and gathers the outputs on device 0, and its replicas'
#   threads share one GIL (lesson 02).
# - DDP (processes) all-reduces the gradients at every step (once a step above, 8,440
#   bytes) and its ranks wait for each other. Doc 004's small model computes almost
#   nothing, so these costs show. In exchange, each rank is a separate process with its
#   own GIL; the model is not copied again, and no output is gathered in one place.
#
# PyTorch's documentation says DataParallel "is usually slower than
# DistributedDataParallel even on a single machine" (lesson 02). On this machine that
# order is not fixed, so the course does not claim to have checked it.

# %% [markdown] lang="ja"
# ## 後片付け
#
# エンジンはカーネルの終了とともに止まりますが、明示的に止めることもできます。

# %% [markdown] lang="en"
# ## Clean up
#
# The engines stop with the kernel, but they can also be stopped explicitly.

# %%
ranks.stop()
assert cluster.current() is None
