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
# # 04 `no_sync` と勾配累積
#
# 記事 000 は `no_sync()` について次のように書いています。
#
# - 「勾配同期を無効にするオプション」で、「各 GPU はパラメータ更新後にすぐ次の更新を開始できる」
# - デメリットは「訓練の不安定化」「収束が遅くなる可能性」
# - 使い方は `ddp_model.no_sync()` と 1 行書くだけ
#
# どれも正しくありません。`no_sync()` は**コンテキストマネージャ**で、`with` の中の順伝播と逆伝播では
# 勾配の all-reduce を**先送り**します。勾配は各ランクの `.grad` にたまり、`with` の外の最初の逆伝播で
# たまった分がまとめて平均されます。これは**勾配累積** (K 個のマイクロバッチで 1 回更新) を通信 1 回で
# 行う方法で、正しく使えば K 倍のバッチで 1 回更新するのと**数学的に同じ**です。不安定にはなりません。
#
# このレッスンでは、正しい使い方、大きなバッチとの一致、記事の 3 つの誤用、K ごとの時間、
# 収束の比較を、数字で確かめます。

# %% [markdown] lang="en"
# # 04 `no_sync` and gradient accumulation
#
# Doc 000 says of `no_sync()`:
#
# - it is "an option that disables gradient synchronization", so "each GPU can start the
#   next update right after updating its parameters";
# - its drawbacks are "unstable training" and "possibly slower convergence";
# - you use it by writing one line, `ddp_model.no_sync()`.
#
# None of this is right. `no_sync()` is a **context manager**: for forward and backward
# passes inside the `with` block, DDP **postpones** the gradient all-reduce. Gradients
# accumulate in each rank's `.grad`, and the first backward pass outside the block
# averages all of it at once. It is how to do **gradient accumulation** (one update per K
# micro-batches) with one round of communication; used correctly it is **mathematically
# the same** as one update on a K-times larger batch. Nothing becomes unstable.
#
# This lesson checks with numbers: correct use, equality with the large batch, the
# document's three misuses, time per step for each K, and convergence.

# %% lang="ja"
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %% lang="en"
import labkit

labkit.require("0.1.0")
labkit.set_lang("en")

# %%
import torch

from labkit import checks, cluster, exercises, nosync, plots

ranks = cluster.start(2, background=True)  # the ranks boot while you read

# %% [markdown] lang="ja"
# ## 正しい使い方
#
# K = 4 個のマイクロバッチで 1 回更新します。各ランクは毎回 16 サンプルを受け持つので、
# 1 回の更新に使うのは 4 × 2 ランク × 16 = 128 サンプルです。
#
# 1. `optimizer.zero_grad()`
# 2. 最初の K−1 個: `with model.no_sync():` の中で**順伝播と逆伝播の両方**を行う
# 3. 最後の 1 個: `with` の外で順伝播と逆伝播 (ここで all-reduce が走る)
# 4. `optimizer.step()`
#
# 各損失は K で割ります。`.grad` には K 個の勾配の**和**がたまるので、割っておくと
# 大きなバッチの平均損失の勾配になります。
# 通信フック (`ddp.CommCounter`) で、1 回の更新で何回 all-reduce したかを数えます。

# %% [markdown] lang="en"
# ## Correct use
#
# One update per K = 4 micro-batches. Each rank takes 16 samples per micro-batch, so one
# update uses 4 × 2 ranks × 16 = 128 samples.
#
# 1. `optimizer.zero_grad()`
# 2. the first K−1 micro-batches: **forward and backward** inside `with model.no_sync():`
# 3. the last one: forward and backward outside the block (the all-reduce runs here)
# 4. `optimizer.step()`
#
# Divide each loss by K: `.grad` accumulates the **sum** of K gradients, and dividing
# makes it the gradient of the large batch's mean loss. A communication hook
# (`ddp.CommCounter`) counts the all-reduce calls of one update.

# %%
# %%px
import copy

import torch

from labkit import checks, comm, ddp, models, nosync

K = 4
cfg = nosync.NoSyncConfig(accum_steps=K, batch_per_rank=16)
dataset = nosync.make_dataset(cfg)  # the teacher task
criterion = models.MyLoss()
model, counter = nosync.wrap(cfg)  # DDP, same weights on every rank, counting hook
reference = copy.deepcopy(model.module)  # one process, no DDP, same weights
optimizer = nosync.make_optimizer(model, cfg)
batches = nosync.micro_batches(dataset, cfg, 0, rank, world_size)  # this rank's K

optimizer.zero_grad()
counter.reset()
for i, (X, y) in enumerate(batches):
    if i < K - 1:
        with model.no_sync():  # forward AND backward inside: no all-reduce
            loss = criterion(model(X), y) / K
            loss.backward()
    else:
        grads_before_sync = [p.grad.clone() for p in model.parameters()]
        loss = criterion(model(X), y) / K  # the last micro-batch synchronizes
        loss.backward()
print(f"rank {rank}: {counter.calls} all-reduce call(s) for {K} micro-batches")

# %% [markdown] lang="ja"
# ## 大きなバッチと同じ勾配になる
#
# 同じ重みの 1 プロセスのモデルに、K 個 × 2 ランク分の全サンプル (128) を 1 バッチで通します。
#
# - `no_sync` の中だけを通った時点の勾配は、各ランクが自分のデータだけで作ったものなので、
#   全体の勾配とも、もう一方のランクの勾配とも違います。
# - 最後の同期つきマイクロバッチのあとは、全体の勾配と一致します (float32 で 1e-6 以下)。

# %% [markdown] lang="en"
# ## The same gradient as the large batch
#
# Pass all the samples of the K micro-batches of both ranks (128) through the
# single-process model with the same weights, in one batch.
#
# - After the micro-batches inside `no_sync`, each rank's gradient comes from its own
#   data only: it differs from the whole batch's and from the other rank's.
# - After the last, synchronized micro-batch it equals the whole batch's gradient
#   (float32, at most 1e-6).

# %%
# %%px
(X_all, y_all), = nosync.micro_batches(dataset, cfg, 0, rank, world_size, whole=True)
criterion(reference(X_all), y_all).backward()
ref_grads = [p.grad for p in reference.parameters()]
diff_inside = checks.max_abs_diff(grads_before_sync, ref_grads)
diff_after = checks.max_abs_diff([p.grad for p in model.parameters()], ref_grads)
print(f"rank {rank}: |grad - large-batch grad| inside no_sync {diff_inside:.2e}, "
      f"after the synchronized micro-batch {diff_after:.2e}")
assert diff_inside > 1e-3 and diff_after <= 1e-6
assert counter.calls == 1

# %% [markdown] lang="ja"
# `no_sync` の中の勾配がランクごとに違うことも、カーネル側で確かめます。同期のあとは同じです。

# %% [markdown] lang="en"
# Check in the kernel that the ranks' gradients differ inside `no_sync`, and agree after
# the synchronization.

# %%
inside = ranks.pull("grads_before_sync")
assert checks.max_abs_diff(inside[0], inside[1]) > 1e-3
after = ranks.run(lambda: [p.grad for p in model.parameters()])
assert checks.max_abs_diff(after[0], after[1]) == 0.0
print("inside no_sync the ranks differ; after the last micro-batch they agree")

# %% [markdown] lang="ja"
# ## 損失を K で割らないと
#
# 割らずに逆伝播すると、`.grad` は平均ではなく K 個の和になり、大きなバッチの勾配のちょうど K 倍です。
# 学習率を K 倍にしたのと同じで、安定性を損ないます (記事の「不安定化」の正体は、たとえばこれです)。

# %% [markdown] lang="en"
# ## Without dividing the loss by K
#
# Backward without the division and `.grad` holds the sum of K gradients instead of
# their mean: exactly K times the large batch's gradient. That is like multiplying the
# learning rate by K, which does harm stability (one real source of the document's
# "instability").

# %%
# %%px
optimizer.zero_grad()
nosync.accumulate_no_sync(model, criterion, batches, scale=False)
ratio = [(p.grad / r).mean().item() for p, r in zip(model.parameters(), ref_grads, strict=True)]
print(f"rank {rank}: unscaled / large-batch gradient = {min(ratio):.3f} .. {max(ratio):.3f}")
torch.testing.assert_close(
    [p.grad for p in model.parameters()], [K * g for g in ref_grads])

# %% [markdown] lang="ja"
# ## 誤用 1: `ddp_model.no_sync()` と 1 行書く
#
# `no_sync()` はコンテキストマネージャを**返すだけ**の関数です。`with` なしで呼ぶと、作られた
# コンテキストマネージャは使われずに捨てられ、何も変わりません。all-reduce の回数は同期ありと
# 同じ K 回です。

# %% [markdown] lang="en"
# ## Misuse 1: writing `ddp_model.no_sync()` on its own line
#
# `no_sync()` only **returns** a context manager. Called without `with`, the context
# manager is created, never entered, and thrown away: nothing changes. The all-reduce
# count is K, as with full synchronization.

# %%
# %%px
optimizer.zero_grad()
counter.reset()
model.no_sync()  # as in doc 000: a context manager, created and dropped
for X, y in batches:
    (criterion(model(X), y) / K).backward()
print(f"rank {rank}: {counter.calls} all-reduce calls after the bare call")
assert counter.calls == K

# %% [markdown] lang="ja"
# ## 誤用 2: 順伝播を `with` の外で行う
#
# DDP は**順伝播の時点で**、次の逆伝播で同期するかを決めます。順伝播を `with model.no_sync():` の外で
# 行い、逆伝播だけを中に入れると、同期は止まりません。勾配は正しいままなので、結果だけを見ても
# 気づけません。通信の回数を数えて初めて分かる誤りです。

# %% [markdown] lang="en"
# ## Misuse 2: the forward pass outside the block
#
# DDP decides **in the forward pass** whether the next backward pass synchronizes. Run the
# forward outside `with model.no_sync():` and only the backward inside, and nothing is
# postponed. The gradients stay right, so the results alone cannot reveal it: only
# counting the communication does.

# %%
# %%px
from contextlib import nullcontext

optimizer.zero_grad()
counter.reset()
for i, (X, y) in enumerate(batches):
    loss = criterion(model(X), y) / K  # forward outside: DDP has already decided
    with model.no_sync() if i < K - 1 else nullcontext():
        loss.backward()
grad_diff = checks.max_abs_diff([p.grad for p in model.parameters()], ref_grads)
print(f"rank {rank}: {counter.calls} all-reduce calls, gradient still right "
      f"(diff {grad_diff:.1e})")
assert counter.calls == K and grad_diff <= 1e-6

# %% [markdown] lang="ja"
# ## 誤用 3: `no_sync` の中で `optimizer.step()` する
#
# 記事の「各 GPU はパラメータ更新後にすぐ次の更新を開始できる」を文字どおりに行うと、各ランクが
# 自分の勾配だけで更新し、レプリカがずれていきます。DDP がパラメータを送り直すのは作ったときだけ
# なので、そのあと同期つきの学習に戻しても、**ずれたまま**です (同じ平均勾配で同じ量だけ動くので、
# 差は縮みません)。ステップごとのランク間の最大差を記録します。

# %% [markdown] lang="en"
# ## Misuse 3: `optimizer.step()` inside `no_sync`
#
# Doing literally what the document says ("each GPU can start the next update right after
# updating its parameters") makes each rank update with its own gradient, and the
# replicas drift apart. DDP sends parameters only when it is built, so going back to
# synchronized training afterwards leaves them **apart** (both move by the same averaged
# update, so the gap does not close). Record the largest difference between ranks after
# every step.

# %%
# %%px
model, counter = nosync.wrap(cfg)
optimizer = nosync.make_optimizer(model, cfg)
param_diff = [ddp.replica_max_diff(model)]  # 0.0: DDP starts from equal replicas
for step in range(15):  # the misuse: every rank steps on its own gradient
    for X, y in nosync.micro_batches(dataset, cfg, step, rank, world_size):
        with model.no_sync():
            optimizer.zero_grad()
            criterion(model(X), y).backward()
            optimizer.step()
    param_diff.append(ddp.replica_max_diff(model))
for step in range(15, 30):  # back to correct, synchronized accumulation
    optimizer.zero_grad()
    nosync.accumulate_no_sync(
        model, criterion, nosync.micro_batches(dataset, cfg, step, rank, world_size))
    optimizer.step()
    param_diff.append(ddp.replica_max_diff(model))
print(f"rank {rank}: max difference after 15 misused steps {param_diff[15]:.4f}, "
      f"after 15 more synchronized steps {param_diff[-1]:.4f}")
assert param_diff[0] == 0.0
assert param_diff[15] > 1e-3 and param_diff[-1] > 0.5 * param_diff[15]

# %%
param_diff = ranks.pull("param_diff")[0]
fig = plots.line_chart({labkit.t("misuse_then_sync"): (range(31), param_diff)},
                       xlabel="optimizer_step", ylabel="param_diff",
                       title="divergence_title", from_zero=True)

# %% [markdown] lang="ja"
# ## 演習: 勾配累積の 1 回の更新を書く
#
# `accumulation_step(model, optimizer, criterion, batches)` は、K = `len(batches)` 個のマイクロバッチで
# 1 回更新する関数です。今のままでも更新は正しいのですが、マイクロバッチごとに all-reduce が走ります。
# `no_sync` を使って、通信を更新 1 回につき 1 回にしてください。
#
# 確認のセルは、この関数を両方のランクで 3 回続けて呼び (K = 4)、そのたびに all-reduce の回数、
# `optimizer.step()` の回数、ランク間のパラメータの差、K 倍のバッチで 1 回更新した 1 プロセスのモデルとの
# 差を調べます。関数はランクのエンジンで実行されます。
#
# 演習のセルを書き換えて実行してから、確認のセルを実行します。正しければ「正解です」と表示され、
# 違っていれば、何が違うかとヒントが表示されます。完全版のノートブックでは演習のすぐあとに解答のセルが
# ありますが、まず自分で解いてみてください。

# %% [markdown] lang="en"
# ## Exercise: write one update of gradient accumulation
#
# `accumulation_step(model, optimizer, criterion, batches)` makes one update from
# K = `len(batches)` micro-batches. As it stands the update is right, but every
# micro-batch runs an all-reduce. Use `no_sync` so that an update communicates once.
#
# The check calls the function three times in a row on both ranks (K = 4) and, after
# each call, looks at the number of all-reduces, the number of `optimizer.step()` calls,
# the difference between the ranks' parameters, and the difference from one process
# that makes one update on the K-times batch. The function runs on the ranks' engines.
#
# Edit and run the exercise cell, then run the check cell. It says "Correct" when the
# answer is right, and otherwise what is wrong, with a hint. In the full notebooks a
# solution cell follows each exercise: try on your own first.

# %% tags=["exercise"]
def accumulation_step(model, optimizer, criterion, batches):
    """One optimizer update of K = len(batches) micro-batches, with one all-reduce."""
    K = len(batches)
    optimizer.zero_grad()
    for X, y in batches:
        loss = criterion(model(X), y) / K
        loss.backward()  # TODO: this all-reduces every time; only the last should
    optimizer.step()

# %% tags=["solution"]
def accumulation_step(model, optimizer, criterion, batches):
    """One optimizer update of K = len(batches) micro-batches, with one all-reduce."""
    K = len(batches)
    optimizer.zero_grad()
    for i, (X, y) in enumerate(batches):
        if i < K - 1:
            with model.no_sync():  # forward AND backward inside: no all-reduce
                loss = criterion(model(X), y) / K
                loss.backward()
        else:  # the last micro-batch: its backward averages everything accumulated
            loss = criterion(model(X), y) / K
            loss.backward()
    optimizer.step()  # once, with the same averaged gradient on every rank

# %%
exercises.check_accumulation(ranks, accumulation_step)

# %% [markdown] lang="ja"
# ## 演習: レプリカがずれる原因を探す
#
# 次の `train` は、2 回の更新ごとに学習率を半分にするスケジューラ (`StepLR`) を使い、勾配累積で学習
# します。`no_sync` は正しく使っています (`nosync.accumulate_no_sync`)。それなのに、学習が進むと
# ランクのパラメータがずれていきます。原因の行を見つけて直してください。
#
# 確認のセルは、両方のランクでこの関数に 6 回更新させ、ランクの学習率とパラメータを比べ、1 プロセスで
# 同じ学習をした結果とも比べます。

# %% [markdown] lang="en"
# ## Exercise: find why the replicas drift apart
#
# `train` below accumulates gradients with a scheduler (`StepLR`) that halves the
# learning rate every 2 updates. It uses `no_sync` correctly
# (`nosync.accumulate_no_sync`), and yet the ranks' parameters drift apart as training
# goes on. Find the line responsible and fix it.
#
# The check has the function make 6 updates on both ranks, compares the ranks' learning
# rates and parameters, and compares with one process trained the same way.

# %% tags=["exercise"]
def train(model, optimizer, scheduler, criterion, updates, rank):
    """One update per entry of `updates` (K micro-batches each); rank 0's losses."""
    losses = []
    for batches in updates:
        optimizer.zero_grad()
        loss = nosync.accumulate_no_sync(model, criterion, batches)
        optimizer.step()
        if rank == 0:  # report from one rank only
            losses.append(loss)
            scheduler.step()
    return losses

# %% tags=["solution"]
def train(model, optimizer, scheduler, criterion, updates, rank):
    """One update per entry of `updates` (K micro-batches each); rank 0's losses."""
    losses = []
    for batches in updates:
        optimizer.zero_grad()
        loss = nosync.accumulate_no_sync(model, criterion, batches)
        optimizer.step()
        scheduler.step()  # on every rank: the learning rate is part of the update
        if rank == 0:  # only what changes no parameter: logs, checkpoints
            losses.append(loss)
    return losses

# %%
exercises.check_replicas_agree(ranks, train)

# %% [markdown] lang="ja"
# ## 1 ステップの時間: K と no_sync
#
# K = 1, 2, 4, 8 について、1 回の更新 (K 個のマイクロバッチ) にかかる時間を、全マイクロバッチで
# 同期する場合と `no_sync` で最後だけ同期する場合で測ります。2 つのモデルで比べます。
#
# - 記事 004 のモデル (2110 パラメータ、送るのは 8 KB)
# - 幅 1024 の 3 層 MLP (約 220 万パラメータ、送るのは約 9 MB): 通信が効いてくる大きさ
#
# 2 つの方式と 4 つの K を、数ステップずつ順番に測る 1 巡を 5 回繰り返し、中央値をとります
# (共有マシンの揺れを、どれもが同じように受けるため)。

# %% [markdown] lang="en"
# ## Time per step: K and no_sync
#
# For K = 1, 2, 4, 8, time one update (K micro-batches) when every micro-batch
# synchronizes and when `no_sync` leaves only the last one to synchronize, for two models:
#
# - doc 004's model (2110 parameters, 8 KB to send)
# - a 3-layer MLP of width 1024 (about 2.2 million parameters, about 9 MB to send): large
#   enough for communication to matter
#
# Both modes and all four K are timed a few steps each, in turn, five rounds over, and
# the median kept, so each sees the same noise of a shared machine.

# %% tags=["nbval-ignore-output"]
# %%px
sizes = {"doc 004 MLP": (100, 1), "MLP 1024x3": (1024, 3)}
times = {}  # model -> {"K": {k: (sync s, no_sync s)}, "allreduce": s, "params": n}
for name, (hidden, depth) in sizes.items():
    times[name] = {"K": comm.step_times_by_k(rank, world_size, hidden, depth, repeat=5)}
    c = nosync.NoSyncConfig(hidden=hidden, depth=depth)
    times[name]["params"] = models.count_params(nosync.make_model(c))
    times[name]["allreduce"] = ddp.allreduce_time(times[name]["params"])
    print(name, {k: f"sync {a * 1e3:.1f} ms, no_sync {b * 1e3:.1f} ms"
                 for k, (a, b) in times[name]["K"].items()})

# %% [markdown] lang="ja"
# 同期ありでは all-reduce を K 回、`no_sync` では 1 回行うので、差は (K−1) 回分の all-reduce の時間の
# はずです。all-reduce 1 回の時間を別に測り、予想と実測を並べます。

# %% [markdown] lang="en"
# Synchronizing every micro-batch runs K all-reduces, `no_sync` runs one, so the
# difference should be the time of (K−1) all-reduces. Time one all-reduce on its own and
# compare that prediction with the measurement.

# %% tags=["nbval-ignore-output"]
times = ranks.pull("times")[0]
series = {}
for name, t in times.items():
    ks = sorted(t["K"])
    series[f"{name}, sync"] = (ks, [t["K"][k][0] * 1e3 for k in ks])
    series[f"{name}, no_sync"] = (ks, [t["K"][k][1] * 1e3 for k in ks])
    t_ar = t["allreduce"]
    print(f"{name}: {t['params']} parameters, one all-reduce {t_ar * 1e3:.2f} ms")
    for k in ks:
        saved = (t["K"][k][0] - t["K"][k][1]) * 1e3
        print(f"  K={k}: saved {saved:6.2f} ms, predicted (K-1) x all-reduce "
              f"{(k - 1) * t_ar * 1e3:6.2f} ms")
fig = plots.line_chart(series, xlabel="accum_k", ylabel="step_time_ms",
                       title="step_time_vs_k", logx=True, logy=True)

# %% [markdown] lang="ja"
# どちらのモデルでも、同期ありの時間は K にほぼ比例して増え、`no_sync` の節約は K−1 とともに
# 大きくなります。計算の量は同じで、減るのは同期の回数だけです。
#
# 実測の節約は、単独で測った all-reduce の (K−1) 回分より大きくなりがちです。DDP の同期 1 回には
# all-reduce のほかにも費用 (勾配をバケットに集めて戻す処理、遅いランクを待つ時間など) が含まれる
# からです。小さなモデルでは 8 KB の all-reduce 自体は一瞬でも、同期 1 回ごとの固定の費用が残ります。
# 同期 1 回の費用を分解して予測するモデルはレッスン 05 で作ります。

# %% [markdown] lang="en"
# For both models the synchronized step grows roughly in proportion to K, and what
# `no_sync` saves grows with K−1. The computation is the same; only the number of
# synchronizations drops.
#
# The measured saving tends to exceed (K−1) all-reduces timed on their own: one DDP
# synchronization costs more than a bare all-reduce (gathering gradients into buckets and
# back, waiting for the slower rank, and so on). For the small model the 8 KB all-reduce
# itself is instant, but each synchronization still has a fixed cost. Lesson 05 builds a
# model that breaks one synchronization down and predicts it.

# %% [markdown] lang="ja"
# ## 収束: 記事の「同期あり vs no_sync」をやり直す
#
# 記事は同期ありと `no_sync` の学習を比べると言いながら、コードは「# 訓練コード」のままです。
# 同じ重み、同じデータ、K = 4 で、大きなモデルを 30 回更新して比べます。
#
# - 更新回数に対する損失: 同じ数学なので**曲線は重なります** (違いは浮動小数点の足し算の順序だけ)。
# - 経過時間に対する損失: `no_sync` のほうが早く同じ損失に届きます。

# %% [markdown] lang="en"
# ## Convergence: the document's "sync vs no_sync", done properly
#
# The document promises to compare training with and without `no_sync`, but its code
# stops at "# training code". Same weights, same data, K = 4, 30 updates of the large
# model:
#
# - loss against updates: the **curves coincide**, the same mathematics (they differ only
#   by the order of floating-point additions);
# - loss against wall-clock time: `no_sync` reaches the same loss sooner.

# %% tags=["nbval-ignore-output"]
# %%px
c = nosync.NoSyncConfig(accum_steps=4, hidden=1024, depth=3, steps=30, lr=0.05,
                        momentum=0.9)
runs = {mode: nosync.convergence(rank, world_size, c, use_no_sync=mode == "no_sync")
        for mode in ("sync", "no_sync")}
print(f"rank {rank}: final loss sync {runs['sync']['losses'][-1]:.4f}, "
      f"no_sync {runs['no_sync']['losses'][-1]:.4f}; time sync "
      f"{runs['sync']['elapsed_s'][-1]:.2f} s, "
      f"no_sync {runs['no_sync']['elapsed_s'][-1]:.2f} s")

# %%
runs = ranks.pull("runs")[0]
sync, nos = runs["sync"], runs["no_sync"]
torch.testing.assert_close(torch.tensor(nos["losses"]), torch.tensor(sync["losses"]),
                           rtol=1e-4, atol=1e-6)  # the same training, step for step
assert sync["replica_max_param_diff"] == nos["replica_max_param_diff"] == 0.0
assert nos["losses"][-1] < 0.5 * nos["losses"][0]  # it learns
fig = plots.convergence(
    {"sync": sync["losses"], "no_sync": nos["losses"]},
    {"sync": (sync["elapsed_s"], sync["losses"]),
     "no_sync": (nos["elapsed_s"], nos["losses"])})

# %% [markdown] lang="ja"
# ## いつ使うか (記事のリストの書き直し)
#
# **使うとよい場合**
# - 勾配累積をするとき (GPU メモリに収まらない大きなバッチを K 個のマイクロバッチに分けるとき)。
#   DDP では必ず `no_sync` と組み合わせます。通信が K 回から 1 回に減り、結果は同じです。
# - モデルが大きく (勾配が多く)、ノード間の帯域が狭いなど、all-reduce が重いとき。
#
# **使わなくてよい場合**
# - 勾配累積をしないとき (K = 1)。毎回同期するのが正しい DDP です。
# - モデルが小さく通信が安いとき。害はありませんが、得もわずかです。
#
# **使ってはいけない使い方**
# - `with` なしの `model.no_sync()` (何も起きない)
# - 順伝播を `with` の外に出す (同期が止まらない)
# - `with` の中で `optimizer.step()` (レプリカがずれ、戻らない)
#
# 「訓練が不安定になる」「収束が遅くなる」は誤りです。正しく使えば大きなバッチと同じ学習で、
# 変わるのは 1 回の更新にかかる時間だけです。大きなバッチそのものが収束に与える影響
# (学習率の調整など) は、`no_sync` とは別の話です (レッスン 06)。

# %% [markdown] lang="en"
# ## When to use it (the document's lists, rewritten)
#
# **Use it**
# - whenever you accumulate gradients (a batch too large for GPU memory split into K
#   micro-batches). Under DDP always pair accumulation with `no_sync`: communication
#   drops from K rounds to one, with the same result.
# - when the all-reduce is expensive: large models (many gradients), slow links between
#   nodes.
#
# **No need for it**
# - without gradient accumulation (K = 1): synchronizing every step is what DDP is.
# - for small models with cheap communication: harmless, but little gain.
#
# **Never use it like this**
# - `model.no_sync()` without `with` (nothing happens)
# - the forward pass outside the block (synchronization is not postponed)
# - `optimizer.step()` inside the block (replicas drift apart and stay apart)
#
# "Unstable training" and "slower convergence" are wrong: used correctly it trains
# exactly as the large batch does; only the time per update changes. What a large batch
# itself does to convergence (learning-rate scaling and the like) is a separate matter
# (lesson 06).

# %% [markdown] lang="ja"
# ## コマンドラインと torchrun から
#
# 同じ実験は、ノートブックなしでも実行できます。`--world-size` のランクを torch の elastic launcher
# (torchrun の中身) が起動し、結果を JSON に書きます。
#
# ```
# python -m labkit nosync --world-size 2 --accum 4 --json nosync.json
# python -m labkit misuse --json misuse.json
# torchrun --nproc-per-node 2 -m labkit nosync --accum 4 --json nosync.json
# ```

# %% [markdown] lang="en"
# ## From the command line and torchrun
#
# The same experiments run without a notebook. torch's elastic launcher (what torchrun is
# built on) starts `--world-size` ranks, and the results go to JSON.
#
# ```
# python -m labkit nosync --world-size 2 --accum 4 --json nosync.json
# python -m labkit misuse --json misuse.json
# torchrun --nproc-per-node 2 -m labkit nosync --accum 4 --json nosync.json
# ```

# %% tags=["nbval-ignore-output"]
import json
import subprocess
import sys
import tempfile
from pathlib import Path

with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "misuse.json"
    subprocess.run([sys.executable, "-m", "labkit", "misuse", "--steps", "5",
                    "--json", str(out)], check=True)
    misuse = json.loads(out.read_text())
assert misuse["bare_call_allreduce_calls"] == misuse["sync_allreduce_calls"] == 4
assert misuse["correct_allreduce_calls"] == 1
assert misuse["diverged_max_param_diff"] > 1e-3

# %%
ranks.stop()
