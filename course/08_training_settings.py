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
# # 08 学習の設定: 大きなバッチ、スケジューラ、DDP
#
# 記事 000 の「訓練速度を向上させる他の方法」のうち、**学習の進み方**を変えるもの (バッチサイズ、シャッフル、
# 学習率、オプティマイザー、スケジューラー、チェックポイント) を扱います。どれも 1 ステップを速くはしません。
# 後半は 2 つのランクで DDP と組み合わせます。
#
# このレッスンを終えると、次のことができます。
#
# - 学習率をバッチサイズに比例させ、ウォームアップを加え、それぞれがなぜ要るかを説明できる。
# - シャッフルが速さではなく収束のためのものだと示せる。
# - 学習状態を保存して再開し、1 ビットも違わない結果を得られる。
# - DDP の各ランクの BatchNorm がどの統計で学習し評価するかを説明し、SyncBatchNorm の全体の統計を
#   all-reduce で計算できる。

# %% [markdown] lang="en" tags=["outcomes"]
# # 08 Training settings: large batches, schedules, and DDP
#
# Of doc 000's "other ways to speed up training", this lesson takes those that change
# **how training progresses** (batch size, shuffling, learning rate, optimizer,
# scheduler, checkpoints). None makes a step faster. The second half combines them with
# DDP on two ranks.
#
# After this lesson you can:
#
# - scale the learning rate with the batch size, add a warm-up, and say why each is
#   needed;
# - show that shuffling serves convergence, not speed;
# - save and resume the training state with bit-identical results;
# - say whose statistics each DDP rank's BatchNorm trains and evaluates with, and
#   compute SyncBatchNorm's global statistics with all-reduce.

# %%
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %%
import torch

from labkit import plots, training

torch.manual_seed(0)

# %% [markdown] lang="ja"
# ## 大きなバッチと学習率
#
# 大きなバッチは 1 秒あたりのサンプル数を増やしますが (レッスン 07)、速く処理できても速く学習するとは
# 限りません。同じサンプル数なら、バッチ 512 の更新回数はバッチ 32 の 16 分の 1 です。対策は**学習率を
# バッチサイズに比例させる**こと (linear scaling rule) です。検証データ (学習に使わない 1024 サンプル) の
# 損失で比べます。
#
# **予想してから実行:** 10 エポックでバッチ 32 は 640 回更新します。バッチ 512 は何回でしょうか。
# 3 つの実行のうち、検証損失がいちばん高く終わるのはどれでしょうか?

# %% [markdown] lang="en"
# ## Large batches and the learning rate
#
# A larger batch processes more samples per second (lesson 07), but processing faster
# is not learning faster: for the same samples, batch 512 makes 16 times fewer updates
# than batch 32. The remedy is to **scale the learning rate with the batch size** (the
# linear scaling rule). Compare the loss on held-out data (1024 samples never trained
# on).
#
# **Predict, then run:** in 10 epochs batch 32 makes 640 updates. How many does batch
# 512 make, and which of the three runs ends with the highest held-out loss?

# %%
from dataclasses import replace

base = training.TrainConfig(batch_size=32, lr=0.05)
runs = {
    "batch 32, lr 0.05": training.scaled(base, 32, epochs=10),
    "batch 512, lr 0.05": replace(training.scaled(base, 512, epochs=10), lr=0.05),
    "batch 512, lr 0.8": training.scaled(base, 512, epochs=10),
}
results = {}
for name, cfg in runs.items():
    cfg.eval_every = max(1, cfg.steps // 20)
    results[name] = training.fit(cfg)
    print(f"{name}: {cfg.steps} steps, held-out loss {results[name]['heldout_loss'][-1]:.3f}")

# %% tags=["hide-input"]
fig = plots.line_chart({k: (r["samples"], r["heldout_loss"]) for k, r in results.items()},
                       xlabel="samples_seen", ylabel="heldout_loss",
                       title="batch_lr_title", logy=True)
final = {k: r["heldout_loss"][-1] for k, r in results.items()}
assert final["batch 512, lr 0.05"] > 1.5 * final["batch 32, lr 0.05"]  # too few updates
assert final["batch 512, lr 0.8"] < 0.5 * final["batch 512, lr 0.05"]  # scaling helps
assert [cfg.steps for cfg in runs.values()] == [640, 40, 40]  # 16 times fewer updates

# %% [markdown] lang="ja"
# ## ウォームアップ
#
# 学習率を大きくしすぎると、最初に重みが大きく跳ねて学習が立ち直りません。そこで最初の数十ステップだけ
# 学習率を小さな値から上げる**ウォームアップ**を組み合わせます (Goyal ら 2017)。バッチ 32 でよく学習する
# 0.2 を 16 倍した 3.2 で、バッチ 512 を学習させます。ウォームアップは `torch.optim.lr_scheduler.LinearLR`
# で、20 ステップで 3.2 まで上げます。

# %% [markdown] lang="en"
# ## Warm-up
#
# Scaled too far, the rate makes the weights jump at the start and training never
# recovers. So it is raised from a small value over the first tens of steps: **warm-up**
# (Goyal et al. 2017). Train batch 512 at 3.2, the rate 0.2 of batch 32 scaled 16
# times; the warm-up is `torch.optim.lr_scheduler.LinearLR`, reaching 3.2 in 20 steps.

# %%
big = training.scaled(replace(base, lr=0.2), 512)
big.steps, big.eval_every = 100, 5
warm = {"lr 3.2": training.fit(big),
        "lr 3.2 + warm-up 20": training.fit(replace(big, schedule="warmup",
                                                   warmup_steps=20))}
for name, r in warm.items():
    print(f"{name}: lr of the first steps {[round(x, 2) for x in r['lr'][:3]]}, "
          f"held-out loss {r['heldout_loss'][-1]:.3f}")

# %% tags=["hide-input"]
fig = plots.line_chart({k: (r["steps"], r["heldout_loss"]) for k, r in warm.items()},
                       xlabel="optimizer_step", ylabel="heldout_loss",
                       title="loss_curve_title", logy=True)
assert warm["lr 3.2 + warm-up 20"]["heldout_loss"][-1] < 0.7 * warm["lr 3.2"]["heldout_loss"][-1]
assert [round(x, 2) for x in warm["lr 3.2 + warm-up 20"]["lr"][:3]] == [0.16, 0.31, 0.46]

# %% [markdown] lang="ja"
# 大きなバッチは、数学的には `no_sync` による勾配累積 (レッスン 04) と同じです。勾配累積で実効バッチを
# 大きくするときにも、この学習率の調整が必要になります。

# %% [markdown] lang="en"
# A large batch is the same mathematics as gradient accumulation with `no_sync` (lesson
# 04): growing the effective batch by accumulation needs the same learning-rate care.

# %% [markdown] lang="ja"
# ## 演習 (任意): 大きなバッチの学習率
#
# 上のウォームアップの実行と同じ学習率を返す関数 `lr_at(step, batch_size)` を書いてください。`step` は
# オプティマイザのステップ (0, 1, 2, …) です。
#
# - 最大の学習率は、バッチ 32 での 0.2 を、バッチサイズに比例させた値です。
# - ウォームアップは `LinearLR(start_factor=1/20, total_iters=20)` です。最大の学習率に掛ける倍率が、
#   ステップ 0 の 1/20 からステップ 20 の 1 まで直線で上がり、そのあとは 1 のままです。
#
# 確認のセルは、バッチ 128、512、2048、80 で、ステップ 0〜59 の学習率を torch の `LinearLR` と比べます。

# %% [markdown] lang="en"
# ## Exercise (optional): the learning rate of a large batch
#
# Write `lr_at(step, batch_size)`: the learning rate of the warm-up run above at
# optimizer step `step` (0, 1, 2, ...):
#
# - the peak rate is 0.2 at batch 32, scaled with the batch size;
# - the warm-up is `LinearLR(start_factor=1/20, total_iters=20)`: the factor that
#   multiplies the peak rises in a straight line from 1/20 at step 0 to 1 at step 20,
#   and stays 1 after that.
#
# The check compares your rates at steps 0 to 59 with torch's `LinearLR`, for batches
# of 128, 512, 2048 and 80.

# %% tags=["exercise", "optional"]
base_lr, base_batch, warmup_steps = 0.2, 32, 20  # the warm-up run above


def lr_at(step, batch_size):
    """The learning rate at optimizer step `step` (0, 1, ...) for a batch of `batch_size`."""
    return None  # TODO: the scaled peak rate, times LinearLR's factor at this step

# %% tags=["solution"]
def lr_at(step, batch_size):
    """The learning rate at optimizer step `step` (0, 1, ...) for a batch of `batch_size`."""
    peak = base_lr * batch_size / base_batch  # the linear scaling rule
    start = 1 / warmup_steps  # LinearLR's start_factor
    return peak * (start + (1 - start) * min(step, warmup_steps) / warmup_steps)

# %%
from labkit import exercises

exercises.grade_warmup_schedule(lr_at)

# %% [markdown] lang="ja"
# ## シャッフルは速さではなく収束のため
#
# 記事は「データシャッフルを有効にする」を高速化に挙げていますが、シャッフルはどのステップも速くしません。
# 目的は各バッチを**データ全体から偏りなく取り出した標本**にすることで、これは SGD の前提です。目標値の
# 1 番目の成分で並べ替えたままのデータと、エポックごとにシャッフルしたデータで、同じモデルを 10 エポック
# 学習させます (モーメンタム付き SGD)。

# %% [markdown] lang="en"
# ## Shuffling is for convergence, not speed
#
# The document lists "enable data shuffling" as a speed-up, but shuffling makes no step
# faster. It makes every batch an **unbiased sample of the whole data**, which SGD
# assumes. Train the same model for 10 epochs (SGD with momentum) on data left sorted by
# its first target value and on data shuffled every epoch.

# %%
order = {o: training.fit(training.TrainConfig(steps=640, optimizer="momentum", order=o,
                                            eval_every=16)) for o in training.ORDERS}
for o, r in order.items():
    print(f"{o:8s}: held-out loss {r['heldout_loss'][-1]:.3f}, "
          f"median epoch {sorted(r['epoch_s'])[len(r['epoch_s']) // 2] * 1e3:.0f} ms")

# %% tags=["hide-input"]
fig = plots.line_chart({o: (r["steps"], r["heldout_loss"]) for o, r in order.items()},
                       xlabel="optimizer_step", ylabel="heldout_loss",
                       title="order_title", logy=True)
assert order["shuffled"]["heldout_loss"][-1] < 0.85 * order["sorted"]["heldout_loss"][-1]

# %% [markdown] lang="ja"
# 1 エポックの時間はほぼ同じで、違うのは収束です。並べ替えたままでは続くバッチが似たサンプルばかりで、
# モデルはいま見ている部分に引っ張られます。複数のランクでは `DistributedSampler(shuffle=True)` と
# `set_epoch` が同じことをします。

# %% [markdown] lang="en"
# An epoch takes about as long either way; what differs is convergence. Left sorted,
# consecutive batches hold similar samples and pull the model towards whatever part it
# sees. With several ranks, `DistributedSampler(shuffle=True)` and `set_epoch` do this.

# %% [markdown] lang="ja"
# ## 学習率、オプティマイザ、スケジューラ
#
# これらは**少ないステップで**目標の損失に届くようにするものです。同じ初期値から比べます。まず SGD の
# 学習率です。小さすぎると進まず、大きすぎると発散します (発散した損失 `inf` は、図では 10 の位置に描きます)。

# %% [markdown] lang="en"
# ## Learning rate, optimizer and scheduler
#
# These reach a target loss in **fewer steps**. Compare from the same initial weights.
# First SGD's learning rate: too small and nothing happens, too large and it diverges
# (a diverged loss, `inf`, is drawn at 10).

# %%
lr_runs = {lr: training.fit(training.TrainConfig(steps=320, lr=lr, eval_every=320))["heldout_loss"][-1]
           for lr in (0.003, 0.03, 0.3, 3.0)}
print({lr: round(v, 3) for lr, v in lr_runs.items()})

# %% tags=["hide-input"]
fig = plots.line_chart({"SGD": (list(lr_runs), [min(v, 10.0) for v in lr_runs.values()])},
                       xlabel="learning_rate", ylabel="heldout_loss",
                       title="lr_title", logx=True, logy=True)
assert lr_runs[0.3] < lr_runs[0.003] and lr_runs[0.3] < lr_runs[3.0]

# %% [markdown] lang="ja"
# 次にオプティマイザです (学習率はそれぞれのよく使われる値)。モーメンタム付き SGD と Adam は、素の SGD より
# 少ないステップで下がります。

# %% [markdown] lang="en"
# Then the optimizer (each at a common learning rate): SGD with momentum and Adam get
# lower in fewer steps than plain SGD.

# %%
opt_runs = {name: training.fit(training.TrainConfig(steps=320, optimizer=name, lr=lr, eval_every=16))
            for name, lr in (("sgd", 0.05), ("momentum", 0.05), ("adam", 0.003),
                             ("adamw", 0.003))}

# %% tags=["hide-input"]
fig = plots.line_chart({f"{k} (lr {r['config']['lr']})": (r["steps"], r["heldout_loss"])
                        for k, r in opt_runs.items()},
                       xlabel="optimizer_step", ylabel="heldout_loss",
                       title="optimizer_title", logy=True)
last = {k: r["heldout_loss"][-1] for k, r in opt_runs.items()}
print({k: round(v, 3) for k, v in last.items()})
assert last["momentum"] < last["sgd"] and last["adam"] < last["sgd"]

# %% [markdown] lang="ja"
# スケジューラは学習中に学習率を変えます。torch のスケジューラ (`StepLR`、`CosineAnnealingLR`、
# ウォームアップの `LinearLR`、つなぐ `SequentialLR`) を Adam (学習率 0.01、600 ステップ) で比べます。
# 一般的な正解はなく、学習率とスケジューラは一緒に調整します。

# %% [markdown] lang="en"
# A scheduler changes the learning rate during training. Compare torch's schedulers
# (`StepLR`, `CosineAnnealingLR`, `LinearLR` for warm-up, `SequentialLR` to chain them)
# with Adam (learning rate 0.01, 600 steps). There is no general winner: tune the rate
# and the schedule together.

# %%
sched_runs = {name: training.fit(training.TrainConfig(steps=600, optimizer="adam", lr=0.01,
                                          schedule=name, warmup_steps=60, eval_every=30))
              for name in training.SCHEDULES}

# %% tags=["hide-input"]
fig = plots.line_chart({k: (r["steps"], r["heldout_loss"]) for k, r in sched_runs.items()},
                       xlabel="optimizer_step", ylabel="heldout_loss",
                       title="schedule_title", logy=True)
print({k: round(r["heldout_loss"][-1], 3) for k, r in sched_runs.items()})
assert all(r["heldout_loss"][-1] < 0.2 for r in sched_runs.values())  # all learn
assert sched_runs["cosine"]["lr"][-1] < 1e-4  # cosine ends near zero
assert abs(sched_runs["warmup"]["lr"][0] - 0.01 / 60) < 1e-9  # warm-up starts small

# %% [markdown] lang="ja"
# ## チェックポイント: 学習状態を保存して再開する
#
# ここでのチェックポイントは、学習状態 (重み、オプティマイザ、乱数の状態、ステップ数) の保存です
# (活性化チェックポイントはレッスン 07)。学習は速くなりませんが、止まっても最初からやり直さずに済みます。
#
# 40 ステップを一気に学習した場合と、20 ステップで止めて再開した場合を比べます。重みのハッシュ
# (`param_sha256`) が一致すれば、1 ビットも違いません。

# %% [markdown] lang="en"
# ## Checkpoints: save and resume the training state
#
# Here a checkpoint saves the training state (weights, optimizer, random-number state,
# step; activation checkpointing is in lesson 07). It does not make training faster; it
# saves starting over after a stop.
#
# Compare 40 steps in one go with 20 steps, a stop, and a resume. Equal weight hashes
# (`param_sha256`) mean bit-identical results.

# %%
import tempfile
from pathlib import Path

cfg = training.TrainConfig(steps=40, batch_size=64, optimizer="momentum")
with tempfile.TemporaryDirectory() as tmp:
    ckpt = Path(tmp) / "state.pt"
    straight = training.fit(cfg)
    training.fit(replace(cfg, steps=20), ckpt)  # stops after 20 steps
    resumed = training.fit(cfg, ckpt, resume=True)

# %% tags=["hide-input"]
assert resumed["resumed_from"] == 20
assert resumed["param_sha256"] == straight["param_sha256"]
assert resumed["losses"] == straight["losses"]  # drawn: steps 21-40 after the restart
fig = plots.line_chart({labkit.t("run_uninterrupted"): (range(1, 41), straight["losses"]),
                        labkit.t("run_resumed"): (range(21, 41), resumed["losses"][20:])},
                       xlabel="step", ylabel="loss", title="resume_fit_title",
                       marks={labkit.t("restart_mark", s=20): 20})

# %% [markdown] lang="ja"
# ## DDP と組み合わせる: シャッフルと `set_epoch`
#
# ここからはランク 2 つです。DDP ではシャッフルを `DistributedSampler` に任せます
# (`DataLoader(shuffle=True, sampler=...)` はエラーです)。毎エポック `sampler.set_epoch(epoch)` を呼ばないと、
# 毎回同じ順序になります (レッスン 03)。

# %% [markdown] lang="en"
# ## With DDP: shuffling and `set_epoch`
#
# From here on, two ranks. Under DDP the `DistributedSampler` shuffles
# (`DataLoader(shuffle=True, sampler=...)` is an error). Without
# `sampler.set_epoch(epoch)` every epoch has the same order (lesson 03).

# %%
from labkit import cluster

ranks = cluster.start(2)

# %%
# %%px
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from labkit import checks, data

dataset = data.MyDataset(n=16)
sampler = DistributedSampler(dataset, shuffle=True, seed=0)
with checks.expect_error(ValueError, match="mutually exclusive with shuffle"):
    DataLoader(dataset, batch_size=4, shuffle=True, sampler=sampler)
loader = DataLoader(dataset, batch_size=4, sampler=sampler)  # the sampler shuffles
orders = []
for epoch in range(2):
    sampler.set_epoch(epoch)  # a new order each epoch, the same on every rank
    orders.append(list(sampler))
print(f"rank {rank}: {orders}")
assert orders[0] != orders[1]
assert sum(len(X) for X, _ in loader) == len(dataset) // world_size

# %% [markdown] lang="ja"
# ## BatchNorm の統計はレプリカごと
#
# `BatchNorm` は学習中、**いまのバッチ**の平均と分散で正規化します。DDP では各ランクが自分のバッチしか
# 見ないので、全体のバッチで正規化する 1 プロセスとは一致しません。
#
# 評価で使う `running_mean` (バッファ) は、DDP の既定 (`forward_sync_buffers=True`) では**順伝播の前に**
# ランク 0 の値が全ランクにコピー (broadcast) され、そのあと各ランクが自分のバッチで更新します。
# ランクごとにデータの平均をずらして確かめます。
#
# 図では、各ランクが正規化に使う特徴ごとの平均と分散 (`x`) と、全体のバッチのもの (`whole`、1 プロセスや
# SyncBatchNorm が使う値) を比べてください。

# %% [markdown] lang="en"
# ## BatchNorm statistics are per replica
#
# During training `BatchNorm` normalizes with the mean and variance of **the current
# batch**. Under DDP each rank sees only its own batch, unlike one process normalizing
# the whole batch.
#
# The `running_mean` (a buffer) used for evaluation: by default
# (`forward_sync_buffers=True`) DDP copies (broadcasts) rank 0's buffers to all ranks
# **before every forward**, then each rank updates them with its own batch. Give each
# rank data with another mean and see.
#
# In the figure, compare the mean and variance per feature each rank normalizes with
# (`x`) with the whole batch's (`whole`, what one process or SyncBatchNorm uses).

# %%
# %%px
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import batchnorm, compare

x = batchnorm.local_batch(rank)  # 8 samples x 4 features, mean about 3 * rank
every = [torch.empty_like(x) for _ in range(world_size)]
dist.all_gather(every, x)
whole = torch.cat(every)  # the whole batch, as one process would see it
mine = slice(rank * len(x), (rank + 1) * len(x))  # this rank's rows of it

model = DDP(nn.BatchNorm1d(4))  # DDP's default: rank 0's buffers before each forward
one_process = nn.BatchNorm1d(4)  # the reference: one process, the whole batch
for _ in range(2):  # two training steps (forwards are enough for BatchNorm)
    out = model(x)  # normalized with the mean and variance of this rank's batch
    out_whole = one_process(whole)[mine]
print(f"rank {rank}: local mean {x.mean():+.2f}, "
      f"|output - whole-batch output| {compare.max_abs_diff(out, out_whole):.2f}")

# %% tags=["hide-input"]
# %%px
assert compare.max_abs_diff(out, out_whole) > 0.1  # each replica, its own statistics
stats = [(label, v.tolist()) for label, v in (  # one value per feature
    ("x.mean(0)", x.mean(0)), ("x.var(0, unbiased=False)", x.var(0, unbiased=False)),
    ("whole.mean(0)", whole.mean(0)),
    ("whole.var(0, unbiased=False)", whole.var(0, unbiased=False)))]  # BatchNorm's

# %% tags=["hide-input"]
from labkit import diagrams

per_rank = ranks.pull("stats")  # each rank's (what, one value per feature), in order
rows = {what: [dict(s)[what] for s in per_rank] for what, _ in per_rank[0]}
assert rows["whole.mean(0)"][0] == rows["whole.mean(0)"][1]  # one batch, every rank
assert all(abs(a - b) > 1 for mean in rows["x.mean(0)"]  # each rank's own, far off
           for a, b in zip(mean, rows["whole.mean(0)"][0], strict=True))
fig = diagrams.collectives(rows, title="bn_stats_title", fmt="{:.1f}")

# %% [markdown] lang="ja"
# 次に `running_mean` を、学習のあとと評価の順伝播のあとで、1 プロセスの BatchNorm に決まったバッチを
# 順に見せた場合 (`batchnorm.after_forwards`) と比べます。
#
# **予想してから実行:** 評価の順伝播のあと、ランク 1 の `running_mean` は、どのランクのデータの統計に
# なっているでしょうか?

# %% [markdown] lang="en"
# Now `running_mean`, after training and after an evaluation forward, compared with
# one-process BatchNorms shown given batches in turn (`batchnorm.after_forwards`).
#
# **Predict, then run:** after the evaluation forward, whose data do the statistics
# in rank 1's `running_mean` describe?

# %%
# %%px
trained = model.module.running_mean.clone()
model.eval()
with torch.no_grad():
    model(x)  # evaluation: DDP first copies rank 0's buffers again
evaluated = model.module.running_mean.clone()

own = batchnorm.after_forwards(x, x)  # this rank's data alone
rank0 = batchnorm.after_forwards(every[0], every[0])  # rank 0's data alone
rank0_then_own = batchnorm.after_forwards(every[0], x)  # rank 0's, then this rank's once
print(f"rank {rank}: running_mean[0] after training {trained[0]:+.3f}, after an "
      f"evaluation forward {evaluated[0]:+.3f}\n"
      f"  BatchNorm on rank 0's data alone {rank0[0]:+.3f}, "
      f"on this rank's data alone {own[0]:+.3f}")

# %% tags=["hide-input"]
# %%px
# On every rank: rank 0's statistics, updated once with this rank's batch,
assert torch.equal(trained, rank0_then_own)
# and after one more forward through DDP, rank 0's data only (not the whole batch's).
assert torch.equal(evaluated, rank0)
assert compare.max_abs_diff(evaluated, one_process.running_mean) > 0.1
if rank == 0:
    assert torch.equal(trained, own)  # rank 0: its own data only
else:
    assert compare.max_abs_diff(trained, own) > 0.1  # the others: not their own data

# %% [markdown] lang="ja"
# 学習のあと、
# - ランク 0 の `running_mean` は、ランク 0 のデータだけの統計です。
# - ほかのランクの `running_mean` は、1 つ前の順伝播までのランク 0 の統計を、自分の最後のバッチで 1 回
#   更新したものです。
# - 次の順伝播 (評価など) の前にまたランク 0 の値がコピーされるので、**どのランクもランク 0 のデータだけの
#   統計で評価します**。
#
# `forward_sync_buffers=False` ではコピーがなく、どのランクも自分のデータだけの統計を持ちます。

# %% [markdown] lang="en"
# So after training
# - rank 0's `running_mean` holds statistics of rank 0's data only;
# - every other rank's holds rank 0's statistics up to the previous forward, updated
#   once with its own last batch;
# - the next forward (evaluation, say) first copies rank 0's again, so **every rank
#   evaluates with statistics of rank 0's data only**.
#
# With `forward_sync_buffers=False` there is no copy: every rank holds statistics of its
# own data only.

# %%
# %%px
unsynced = DDP(nn.BatchNorm1d(4), forward_sync_buffers=False)
for _ in range(2):
    unsynced(x)
kept = unsynced.module.running_mean
print(f"rank {rank}: running_mean[0] without the copy {kept[0]:+.3f}")

# %% tags=["hide-input"]
# %%px
assert torch.equal(kept, own)  # its own data only
assert compare.rank_max_diff(kept) > 0.1  # so the ranks differ

# %% [markdown] lang="ja"
# torch 2.13 は引数 `broadcast_buffers` を非推奨にして `forward_sync_buffers` を加えましたが、名前を
# 変えただけではありません。DDP は作られるときにもランク 0 のバッファを全ランクにコピーします
# (`init_sync=True`)。古い `broadcast_buffers=False` はこのコピーも止め、新しい `forward_sync_buffers=False`
# は順伝播の前のコピーだけを止めます。ランク r のバッファを r で埋めて DDP を作り、直後の値を見ます。

# %% [markdown] lang="en"
# torch 2.13 deprecates the argument `broadcast_buffers` for `forward_sync_buffers`, but
# not as a plain rename. DDP also copies rank 0's buffers to all ranks when it is built
# (`init_sync=True`). The old `broadcast_buffers=False` stops that copy too; the new
# `forward_sync_buffers=False` stops only the copy before each forward. Fill rank r's
# buffer with r, build DDP, and look right after.

# %%
# %%px
built = batchnorm.buffers_after_construction(rank)
for name, b in built.items():
    print(f"rank {rank}: DDP(..., {name}) -> running_mean[0] = {b['running_mean0']:.0f}")
if rank == 0:
    print(*built["broadcast_buffers=False"]["warnings"], sep="\n")

# %% tags=["hide-input"]
# %%px
assert built["broadcast_buffers=False"]["running_mean0"] == rank  # its own: no copy
if "forward_sync_buffers=False" in built:  # torch 2.13 and later
    assert built["forward_sync_buffers=False"]["running_mean0"] == 0  # rank 0's
    assert any("still syncs buffers at init" in w
               for w in built["broadcast_buffers=False"]["warnings"])

# %% [markdown] lang="ja"
# 全ランクのバッチで正規化するのが `nn.SyncBatchNorm` です (`convert_sync_batchnorm` で置き換えます)。
# ただし CPU では動きません。DDP は「SyncBatchNorm layers only work with GPU modules」というエラーを出します。

# %% [markdown] lang="en"
# Normalizing with all ranks' batches is what `nn.SyncBatchNorm` does (swap it in with
# `convert_sync_batchnorm`). But it does not run on the CPU: DDP refuses with
# "SyncBatchNorm layers only work with GPU modules".

# %%
# %%px
error = batchnorm.syncbn_error()
print(f"rank {rank}: {error}")
if not torch.cuda.is_available():
    assert "only work with GPU modules" in error

# %% [markdown] lang="ja"
# ## 演習: SyncBatchNorm の統計を手で計算する
#
# そこで、SyncBatchNorm が学習中に計算するものを集団通信で書きます。`global_mean_var(x)` は、このランクの
# バッチ `x` (行がサンプル、列が特徴) を受け取り、**全ランク**のサンプルを合わせた特徴ごとの平均と分散を
# 返します。分散は BatchNorm と同じく、サンプル数で割ったもの (サンプル数 − 1 ではなく) です。サンプル数は
# ランクごとに違ってかまいません。全ランクが同時に呼ぶので、`dist.all_reduce` が使えます。
#
# 確認のセルは、ランク 0 に 3 サンプル、ランク 1 に平均の離れた 9 サンプルを渡して、1 プロセスで全 12
# サンプルから計算した値と比べ、大きさを変えて (5 と 2 サンプル、特徴 3 個) もう一度呼びます。関数は
# ランクのエンジンで実行されます (使える名前は、上の `%%px` セルで import した `torch` と `dist`)。

# %% [markdown] lang="en"
# ## Exercise: SyncBatchNorm's statistics by hand
#
# So write out with collectives what SyncBatchNorm computes in training.
# `global_mean_var(x)` gets this rank's batch `x` (one row per sample, one column per
# feature) and returns each feature's mean and variance over the samples of **all**
# ranks, the variance divided by the number of samples (not that number minus 1), as
# BatchNorm's. The ranks may hold different numbers of samples. Every rank calls it at
# once, so it can use `dist.all_reduce`.
#
# The check gives rank 0 3 samples and rank 1 9 with a mean far away, compares with one
# process over all 12, then calls again with other sizes (5 and 2 samples of 3
# features). It runs on the ranks' engines (`torch` and `dist` are imported there).

# %% tags=["exercise"]
def global_mean_var(x):
    """Each feature's mean and variance over the samples of ALL ranks (every rank calls it)."""
    mean = x.mean(0)  # TODO: these use this rank's samples only
    var = x.var(0, unbiased=False)
    return mean, var

# %% tags=["solution"]
def global_mean_var(x):
    """Each feature's mean and variance over the samples of ALL ranks (every rank calls it)."""
    count = torch.tensor(float(len(x)))
    total = x.sum(0)
    dist.all_reduce(count)  # the number of samples on all ranks
    dist.all_reduce(total)  # and their sum, feature by feature
    mean = total / count
    squares = ((x - mean) ** 2).sum(0)  # distances from the global mean, not the local
    dist.all_reduce(squares)
    return mean, squares / count  # divided by the count: the variance BatchNorm uses

# %%
exercises.grade_global_statistics(ranks, global_mean_var)

# %% [markdown] lang="ja"
# labkit の `batchnorm.global_batch_norm` は、サンプル数、和、二乗和の 1 回の all-reduce で同じ統計を求めて
# 正規化します。結果は上の `out_whole` (全体のバッチを 1 プロセスで正規化した、このランクの行) と一致します。
# GPU では `nn.SyncBatchNorm` がこれを行います。

# %% [markdown] lang="en"
# labkit's `batchnorm.global_batch_norm` gets the same statistics with one all-reduce
# of the count, the sum and the sum of squares, and normalizes with them; it agrees with
# `out_whole` above (this rank's rows of the whole batch, normalized in one process). On
# GPUs `nn.SyncBatchNorm` does this.

# %%
# %%px
synced = batchnorm.global_batch_norm(x)
print(f"rank {rank}: |synchronized - whole batch| = {compare.max_abs_diff(synced, out_whole):.1e}")
assert compare.max_abs_diff(synced, out_whole) < 1e-5

# %% [markdown] lang="ja"
# ## 記事の `DistributedDataParallel(model, dim=1)`
#
# 記事 000 の「より複雑な例」は `dim=1` を渡しています。`dim` は 1 つのプロセスが複数の GPU に入力を
# 分けていた古い使い方の引数です。1 プロセス 1 デバイスの DDP は入力を分けないので、`dim` は何も変えません。

# %% [markdown] lang="en"
# ## The document's `DistributedDataParallel(model, dim=1)`
#
# Doc 000's "more complex example" passes `dim=1`. `dim` belongs to the old use where one
# process split its input over several GPUs. With one device per process DDP does not
# split inputs, so `dim` changes nothing.

# %%
# %%px
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import models

torch.manual_seed(0)
plain = DDP(models.TwoLinear())
torch.manual_seed(0)
with_dim = DDP(models.TwoLinear(), dim=1)
X_rank = torch.randn(6, 10)
out_plain, out_dim = plain(X_rank), with_dim(X_rank)
print(f"rank {rank}: input {tuple(X_rank.shape)} -> output {tuple(out_dim.shape)}")
assert torch.equal(out_plain, out_dim) and out_dim.shape == (6, 10)

# %%
ranks.stop()

# %% [markdown] lang="ja" tags=["summary"]
# ## 覚えておくこと
#
# - **速く処理できても、速く学習するとは限りません**。同じサンプル数なら大きなバッチは更新が少ないので、
#   学習率をバッチサイズに比例させます。
# - **大きくした学習率にはウォームアップを組み合わせます**。最初の数十ステップで小さな値から上げないと、
#   最初の更新で学習が崩れます。
# - **シャッフルは速さではなく収束のためのもの**で、DDP では `DistributedSampler` と `set_epoch` が行います。
# - **学習状態 (重み、オプティマイザ、乱数の状態、ステップ数) を保存すれば**、止まっても 1 ビットも違わずに
#   再開できます。
# - **DDP の BatchNorm はレプリカごと**で、各ランクは自分のバッチで正規化し、既定ではランク 0 の統計で評価します。
#   全体の統計には all-reduce が要ります (GPU では SyncBatchNorm)。

# %% [markdown] lang="en" tags=["summary"]
# ## What to remember
#
# - **Processing faster is not learning faster**: for the same samples a larger batch
#   makes fewer updates, so scale the learning rate with the batch size.
# - **A scaled-up rate needs a warm-up**: raise it from a small value over the first
#   tens of steps, or the first updates throw training off.
# - **Shuffling is for convergence, not speed**; under DDP `DistributedSampler` with
#   `set_epoch` does it.
# - **Saving the whole training state** (weights, optimizer, random state, step) lets
#   a stopped run resume bit for bit.
# - **BatchNorm under DDP is per replica**: each rank normalizes with its own batch and
#   by default evaluates with rank 0's statistics; global statistics take an
#   all-reduce (SyncBatchNorm on GPUs).

# %% [markdown] lang="ja" tags=["self-check"]
# ## 確認問題
#
# 先へ進む前に、次の 3 問に答えてください。答えの折りたたみは、自分の答えを決めてから開きます。

# %% [markdown] lang="en" tags=["self-check"]
# ## Self-check
#
# Answer the three questions below before reading on; open an answer's fold only
# after you have chosen.

# %% tags=["self-check"]
from labkit import selfcheck

selfcheck.show("08_training_settings")

# %% tags=["self-check"]
# Your answers, "a", "b", "c" or "d" for each question; then run this cell.
my_answers = {1: None, 2: None, 3: None}
selfcheck.check("08_training_settings", my_answers)
