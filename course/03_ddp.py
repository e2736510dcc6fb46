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

# %% lang="ja"
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %% lang="en"
import labkit

labkit.require("0.1.0")
labkit.set_lang("en")

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
# にして、gloo のプロセスグループに参加させます (GPU があれば nccl)。
# `background=True` なら、起動を待たずにすぐ戻ります。最初に使うとき (`%%px` のセルや `ranks.wait()`)
# に、起動が終わるのを待ちます。
#
# - ランクが互いを見つけるための待ち合わせ場所 (TCPStore) は、OS が選んだ空きポートに、
#   127.0.0.1 だけで開きます。
# - 2 コアを 2 ランクで取り合わないよう、各ランクは `torch.set_num_threads(1)` で動きます。
# - 集団通信のタイムアウトは 20 秒です。gloo の既定 (30 分) のままだと、バグが長いハングになります。
#
# 起動したあとは、`%%px` で始まるセルが**全ランクで**実行されます。各エンジンには `rank`、
# `world_size`、`device` という変数が用意されています。

# %% [markdown] lang="en"
# ## Start the ranks
#
# `cluster.start(2)` starts two engines (Python processes) on 127.0.0.1, makes engine i
# rank i, and joins them in a gloo process group (nccl where there are GPUs). With
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
# variables `rank`, `world_size` and `device`.

# %% tags=["nbval-ignore-output"]
import torch

from labkit import checks, exercises, plots

ranks.wait()
print(f"{ranks.world_size} ranks ready {time.perf_counter() - t0:.1f} s after the start")

# %%
# %%px
import torch
import torch.distributed as dist

print(f"rank {rank} of {world_size}, backend {dist.get_backend()}, "
      f"device {device}, threads {torch.get_num_threads()}")

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

from labkit import checks, ddp, models

torch.manual_seed(rank)  # different initial weights on each rank, on purpose
model = models.MLP()
before = ddp.replica_max_diff(model)
model = DDP(model)  # broadcasts rank 0's parameters and buffers
after = ddp.replica_max_diff(model)
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
# 違っていれば、何が違うかとヒントが表示されます。完全版のノートブックでは演習のすぐあとに解答のセルが
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
exercises.check_set_epoch(ranks, epoch_orders)

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
criterion(model(ddp.shard(X, rank, world_size)), ddp.shard(y, rank, world_size)).backward()
criterion(local(X), y).backward()
grad_diff = checks.max_abs_diff([p.grad for p in model.parameters()],
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
# 呼び、全体バッチ (64 サンプル) の勾配と比べます。

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
# gradient.

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
exercises.check_average_gradients(ranks, average_gradients)

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
# 通信フック (`comm.BucketLog`) で、ステップごとに送られたバケットのバイト数を記録します。
# 1 ステップで送るのは全パラメータの勾配 1 回分 (float32 で 2110 × 4 = 8440 バイト) で、1 MiB より
# ずっと小さいので、`DDP(model)` では毎ステップ 1 つのバケットです。`bucket_cap_mb` を約 2 KB に
# すると、2 ステップ目からバケットが増えます。回数が増えても、バイト数の合計は同じです。
# 大きなモデルでの様子はレッスン 05 で見ます。

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
# A communication hook (`comm.BucketLog`) records the bytes of the buckets sent in each
# step. One step sends every parameter's gradient once (float32: 2110 × 4 = 8440 bytes),
# far below 1 MiB, so `DDP(model)` sends one bucket every step. With `bucket_cap_mb` at
# about 2 KB, there are more buckets from step 2 on: more calls, the same bytes. Lesson
# 05 shows a larger model.

# %%
# %%px
from labkit import comm

seen = {}
ways = {"DDP(model)": {}, "bucket_cap_mb=0.002": {"bucket_cap_mb": 0.002}}
for name, kwargs in ways.items():
    torch.manual_seed(0)
    model = DDP(models.MLP(), **kwargs)
    log = comm.BucketLog().attach(model)
    for step in range(3):
        log.step()
        criterion(model(ddp.shard(X, rank, world_size)),
                  ddp.shard(y, rank, world_size)).backward()
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
# `DistributedSampler` と `DataLoader` で先生ネットワークの課題を 3 エポック学習し、
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
replica_diff = ddp.replica_max_diff(model)
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

# %% tags=["raises-exception", "nbval-ignore-output"]
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
# エンジンは一度起動したら残り続ける普通の Python プロセスで、`%%px` のコードはそこで実行されます。
# 関数をピクル化して送る必要がなく、各ランクの出力とトレースバックはセルに表示されます。
# スクリプトとして実行するときは `torchrun` を使います (レッスン 04 と 07)。

# %% [markdown] lang="en"
# Engines are ordinary Python processes that stay up once started, and `%%px` code runs
# in them: nothing has to be pickled, and each rank's output and traceback appear in the
# cell. As a script, use `torchrun` (lessons 04 and 07).

# %% [markdown] lang="ja"
# ## world size 1 と 2 の 1 ステップの時間
#
# 全体バッチ (1024 サンプル) を固定し、1 ランクだけのグループと 2 ランクのグループで 1 ステップの
# 時間を測ります。2 ランクでは各ランクの計算が半分になる代わりに all-reduce が加わります。
#
# - 記事 004 の小さなモデル (2110 パラメータ) では計算がごくわずかで、通信と同期の分だけ
#   2 ランクのほうが遅くなりがちです。
# - 幅 1024 の 2 層 MLP (約 110 万パラメータ) では計算が大きく、2 ランクで速くなります。
#
# 時間は実行のたびに変わります (このマシンは共有されています)。傾向を見てください。

# %% [markdown] lang="en"
# ## Time per step with world size 1 and 2
#
# Fix the global batch (1024 samples) and time one step in a group of one rank and in a
# group of two. With two ranks each computes half as much, but an all-reduce is added.
#
# - Doc 004's small model (2110 parameters) computes almost nothing, so two ranks tend to
#   be slower by the cost of communication and synchronization.
# - A 2-layer MLP of width 1024 (about 1.1 million parameters) computes a lot, and two
#   ranks are faster.
#
# Times change from run to run (this machine is shared); look at the trend.

# %% tags=["nbval-ignore-output"]
# %%px
solo = dist.new_group([0])  # a group of rank 0 alone: world size 1
step_s = {}
for name, hidden, depth in [("doc 004 MLP", 100, 1), ("MLP 1024x2", 1024, 2)]:
    step_s[name] = {}
    if rank == 0:
        step_s[name]["world size 1"] = ddp.step_time(hidden, depth, 1024, group=solo)
    step_s[name]["world size 2"] = ddp.step_time(hidden, depth, 1024)
    print(name, {k: f"{v * 1e3:.1f} ms" for k, v in step_s[name].items()})

# %%
step_s = ranks.pull("step_s")[0]  # rank 0 timed both world sizes
fig = plots.bar_chart({name: {k: v * 1e3 for k, v in times.items()}
                       for name, times in step_s.items()},
                      ylabel="step_time_ms", title="step_time_vs_world", fmt="{:.1f} ms")

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
