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
# # 05 通信のコスト
#
# DDP が 1 回の同期で送るのは全パラメータの勾配です (レッスン 03)。その時間を測り、予測できる
# モデルにします。
#
# 1. all-reduce の時間をメッセージの大きさ 1 KiB〜64 MiB で測り、nccl-tests と同じ定義の
#    **アルゴリズム帯域** (algbw) と**バス帯域** (busbw) を出す
# 2. **α–β モデル** (時間 = α + 送る量 / β) を当てはめ、実測と比べる
# 3. DDP の**バケット**と、逆伝播と通信の**重なり**を見る
# 4. 1 回の更新の時間を K と `no_sync` から予測し、実測で確かめる
# 5. スライダーで、GPU やランク数を変えたら何が起きるかをモデルで探る

# %% [markdown] lang="en"
# # 05 Communication cost
#
# One DDP synchronization sends the gradients of every parameter (lesson 03). Here we
# time it and turn the times into a model that predicts.
#
# 1. time all-reduce for messages from 1 KiB to 64 MiB and report **algorithm bandwidth**
#    (algbw) and **bus bandwidth** (busbw) as nccl-tests defines them
# 2. fit the **alpha-beta model** (time = alpha + data sent / beta) and compare
# 3. look at DDP's **buckets** and the **overlap** of communication with backward
# 4. predict the time of an update from K and `no_sync`, and check it against measurements
# 5. explore with sliders what the model says for GPUs and more ranks

# %% lang="ja"
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %% lang="en"
import labkit

labkit.require("0.1.0")
labkit.set_lang("en")

# %%
from labkit import cluster, comm, exercises, plots

ranks = cluster.start(2, background=True)  # the ranks boot while you read

# %% [markdown] lang="ja"
# ## all-reduce を測る
#
# 2 つのランクで、大きさを 4 倍ずつ変えながら all-reduce の時間 (中央値) を測ります。
# nccl-tests の定義では、大きさ S、時間 t、ランク数 n のとき
#
# - アルゴリズム帯域 algbw = S / t
# - バス帯域 busbw = algbw × 2(n−1)/n
#
# です。リング型の all-reduce では、各ランクが S の 2(n−1)/n 倍を送り、同じだけ受け取ります。
# busbw はその量で割った帯域なので、ランク数によらず、回線の速さと比べられます。

# %% [markdown] lang="en"
# ## Timing all-reduce
#
# On two ranks, time an all-reduce (median) for sizes growing four-fold at each step.
# nccl-tests defines, for size S, time t and n ranks,
#
# - algorithm bandwidth algbw = S / t
# - bus bandwidth busbw = algbw × 2(n−1)/n
#
# In a ring all-reduce each rank sends 2(n−1)/n times S, and receives as much. busbw
# divides by that amount, so it does not depend on the number of ranks and compares
# with a link's speed.

# %% tags=["nbval-ignore-output"]
# %%px
from labkit import comm

sizes = [4**k * 1024 for k in range(9)]  # 1 KiB .. 64 MiB
seconds = comm.allreduce_sweep(sizes, repeat=7)

# %% tags=["nbval-ignore-output"]
sizes, seconds = ranks.pull("sizes")[0], ranks.pull("seconds")[0]
ab = comm.fit_alpha_beta(sizes, seconds, world_size=2)
print(f"{'size':>10} {'time':>10} {'algbw':>11} {'busbw':>11} {'model':>10}")
for size, t in zip(sizes, seconds, strict=True):
    algbw, busbw = comm.bandwidths(size, t, 2)
    print(f"{size:>10} {t * 1e3:>8.3f}ms {algbw / 1e9:>7.3f}GB/s {busbw / 1e9:>7.3f}GB/s "
          f"{ab.time(size, 2) * 1e3:>8.3f}ms")
print(f"alpha = {ab.alpha * 1e6:.0f} µs, beta = {ab.beta / 1e9:.2f} GB/s")
fig = plots.line_chart(
    {"measured": (sizes, [t * 1e3 for t in seconds]),
     "alpha-beta": (sizes, [ab.time(s, 2) * 1e3 for s in sizes])},
    xlabel="message_bytes", ylabel="allreduce_ms", title="allreduce_title",
    logx=True, logy=True, x_bytes=True)

# %%
assert ab.alpha >= 0 and ab.beta > 0
assert len(sizes) == 9 and sizes[0] == 1024 and sizes[-1] == 64 * 1024 * 1024

# %% [markdown] lang="ja"
# 小さなメッセージでは時間がほぼ一定です。これが α (1 回のメッセージの固定費用) です。
# 大きなメッセージでは時間が大きさに比例し、傾きが 1/β です。ここでの「回線」は同じマシンの
# 2 つのプロセスをつなぐループバックの TCP なので、β は GPU の回線よりずっと小さな値です。

# %% [markdown] lang="en"
# For small messages the time hardly changes: that is alpha, the fixed cost of a message.
# For large ones the time grows in proportion to the size, with slope 1/beta. The "link"
# here is loopback TCP between two processes on one machine, so beta is far below a GPU
# link's.

# %% [markdown] lang="ja"
# ## 演習: all-reduce の時間を予測する
#
# 上で当てはめた α (`ab.alpha`、秒) と β (`ab.beta`、バイト/秒) を使い、約 210 万パラメータ
# (`2_120_714` 個、float32) の勾配を **8 ランク**で all-reduce する時間をモデルの式で計算してください。
# 答えは秒で `allreduce_s` に入れます。`ab.time` は使わずに、式を書きます。
#
# 演習のセルを書き換えて実行してから、確認のセルを実行します。正しければ「正解です」と表示され、
# 違っていれば、何が違うかとヒントが表示されます。完全版のノートブックでは演習のすぐあとに解答のセルが
# ありますが、まず自分で解いてみてください。

# %% [markdown] lang="en"
# ## Exercise: predict an all-reduce
#
# With alpha (`ab.alpha`, seconds) and beta (`ab.beta`, bytes per second) fitted above,
# compute by the model how long an all-reduce of the gradients of about 2.1 million
# parameters (`2_120_714` float32 values) takes on **8 ranks**. Put the answer, in
# seconds, in `allreduce_s`. Write the formula rather than calling `ab.time`.
#
# Edit and run the exercise cell, then run the check cell. It says "Correct" when the
# answer is right, and otherwise what is wrong, with a hint. In the full notebooks a
# solution cell follows each exercise: try on your own first.

# %% tags=["exercise"]
n_params = 2_120_714  # the MLP 1024x3 below; one float32 gradient per parameter
allreduce_s = None  # TODO: seconds of one all-reduce over 8 ranks, by the model

# %% tags=["solution"]
nbytes = 4 * n_params  # float32: 4 bytes each
allreduce_s = ab.alpha + 2 * (8 - 1) / 8 * nbytes / ab.beta

# %%
exercises.check_allreduce_prediction(ab, n_params, 8, allreduce_s)

# %% [markdown] lang="ja"
# ## バケット
#
# DDP は勾配を 1 つずつ送らず、後ろの層から順に**バケット**に詰め、バケットがいっぱいになるたびに
# all-reduce を 1 回実行します。上限は `bucket_cap_mb` (既定 25 MB) です。
# 約 210 万パラメータ (約 8.5 MB) のモデルで、上限ごとのバケットの数を計算し、
# 通信フックで数えた 1 回の同期の all-reduce の回数と比べます。

# %% [markdown] lang="en"
# ## Buckets
#
# DDP does not send gradients one by one: it packs them into **buckets**, from the last
# layer backwards, and runs one all-reduce each time a bucket is full. The limit is
# `bucket_cap_mb` (25 MB by default). For a model of about 2.1 million parameters (about
# 8.5 MB), compute the number of buckets for several limits and compare with the
# all-reduce calls of one synchronization, counted by a communication hook.

# %%
# %%px
from labkit import models, nosync

buckets = {}
for cap_mb in (25, 4, 1):
    cfg = nosync.NoSyncConfig(hidden=1024, depth=3, bucket_cap_mb=cap_mb, accum_steps=1)
    model, counter = nosync.wrap(cfg)
    batches = nosync.micro_batches(nosync.make_dataset(cfg), cfg, 0, rank, world_size)
    for _ in range(2):  # DDP settles its buckets after the first step
        counter.reset()
        nosync.accumulate_no_sync(model, models.MyLoss(), batches)
    planned = comm.bucket_sizes(model.module, cap_mb)
    buckets[cap_mb] = (planned, counter.calls)
    print(f"bucket_cap_mb={cap_mb}: {len(planned)} bucket(s) "
          f"{[round(b / 2**20, 2) for b in planned]} MB, {counter.calls} all-reduce(s)")
    assert len(planned) == counter.calls

# %% [markdown] lang="ja"
# ## 逆伝播と通信の重なり
#
# バケットがそろった時点で all-reduce が始まるので、通信は逆伝播の**途中で**始まり、残りの計算と
# 重なります。1 MB の重みが 7 つある MLP (幅 512、8 層) を上限 1 MB で包んで (バケットがいくつもできます)、
# 各バケットの all-reduce の始まりと終わりを、逆伝播の始まりからの時間で記録します。

# %% [markdown] lang="en"
# ## Communication overlaps backward
#
# A bucket's all-reduce starts as soon as the bucket is complete, so communication starts
# **during** the backward pass and overlaps the computation that remains. Wrap an MLP
# with seven 1 MB weights (width 512, 8 layers) with a 1 MB limit (several buckets), and
# record when each bucket's all-reduce starts and ends, counted from the start of
# backward.

# %%
# %%px
cfg = nosync.NoSyncConfig(hidden=512, depth=8, bucket_cap_mb=1, accum_steps=1)
timeline = comm.bucket_timeline(rank, world_size, cfg)
assert len(timeline["events"]) > 3  # several buckets
first_start = timeline["events"][0][0]
print(f"rank {rank}: first all-reduce starts at {first_start * 1e3:.1f} ms, backward "
      f"ends at {timeline['backward_end'] * 1e3:.1f} ms")
assert first_start < timeline["backward_end"]  # communication began during backward

# %%
timeline = ranks.pull("timeline")[0]
fig = plots.timeline([(s * 1e3, e * 1e3) for s, e in timeline["events"]],
                     timeline["backward_end"] * 1e3, span_label="bucket_allreduce",
                     end_label="backward_end", title="overlap_title")

# %% [markdown] lang="ja"
# ## 1 回の更新の時間を予測する
#
# K 個のマイクロバッチで 1 回更新するとき、時間は次の 3 つでほぼ決まります。
#
# - c: マイクロバッチ 1 つの順伝播と逆伝播 (通信なし)
# - s: 同期 1 回の費用 (all-reduce と DDP 自身の仕事)
# - o: オプティマイザのステップなど、更新ごとの残り
#
# 全マイクロバッチで同期すると K·c + K·s + o、`no_sync` なら K·c + s + o です。
# K = 1, 2, 4 の実測から c, s, o を求め、見ていない K = 8 を予測して、実測と比べます。
# 2 つのモデル (記事 004 の小さなモデルと、約 210 万パラメータの MLP) で行います。

# %% [markdown] lang="en"
# ## Predicting the time of an update
#
# An update of K micro-batches costs, to a good approximation,
#
# - c: forward and backward of one micro-batch (no communication)
# - s: the cost of one synchronization (the all-reduce and DDP's own work)
# - o: the optimizer step and the rest of an update
#
# Synchronizing every micro-batch gives K·c + K·s + o; `no_sync` gives K·c + s + o.
# Fit c, s and o on the measurements for K = 1, 2, 4, predict the unseen K = 8, and
# compare, for two models (doc 004's small one and an MLP of about 2.1 million
# parameters).

# %% tags=["nbval-ignore-output"]
# %%px
# The small model's steps last milliseconds, where timing jitter is largest:
# it gets more rounds (and costs little).
step_times = {name: comm.step_times_by_k(rank, world_size, hidden, depth, repeat=repeat)
              for name, (hidden, depth, repeat) in {"doc 004 MLP": (100, 1, 15),
                                                    "MLP 1024x3": (1024, 3, 5)}.items()}

# %% tags=["nbval-ignore-output"]
step_times = ranks.pull("step_times")[0]
measured, predicted, errors, fitted = {}, {}, {}, {}
for name, times in step_times.items():
    model = comm.fit_step_model(times, fit_on=(1, 2, 4))
    fitted[name], errors[name] = model, comm.max_rel_error(model, times)
    ks = sorted(times)
    for mode, no_sync in (("sync", False), ("no_sync", True)):
        measured[f"{name}, {mode}"] = (ks, [times[k][no_sync] * 1e3 for k in ks])
        predicted[f"{name}, {mode}"] = (ks, [model.predict(k, no_sync) * 1e3
                                             for k in ks])
    print(f"{name}: c = {model.compute_s * 1e3:.2f} ms, s = {model.sync_s * 1e3:.2f} ms, "
          f"o = {model.optimizer_s * 1e3:.2f} ms; worst error {errors[name]:.0%}")
    for k in ks:
        print(f"  K={k}: sync {times[k][0] * 1e3:6.1f} ms (model "
              f"{model.predict(k, False) * 1e3:6.1f}), no_sync {times[k][1] * 1e3:6.1f} ms"
              f" (model {model.predict(k, True) * 1e3:6.1f})")
fig = plots.measured_vs_model(measured, predicted, xlabel="accum_k",
                              ylabel="step_time_ms", title="model_vs_measured")

# %% [markdown] lang="ja"
# c、s、o は時間なので、負にならないように求めます (非負の最小二乗法)。それでも o が 0 になることが
# あります。更新の最初のマイクロバッチは、ほかのマイクロバッチより安いからです。`zero_grad()` のあとの
# 最初の逆伝播は勾配を書き込むだけですが、2 回目からは前の勾配に足し込みます。この差が o
# (最適化ステップの時間) を打ち消します。大きなモデルで、1 プロセスで確かめます。

# %% [markdown] lang="en"
# c, s and o are times, so the fit keeps them non-negative (non-negative least squares).
# Even so, o can come out 0: the first micro-batch of an update costs less than the
# others. After `zero_grad()` the first backward only writes the gradients; from the
# second on, each adds to them. That difference cancels o (the optimizer step's time).
# Check it in one process with the large model:

# %% tags=["nbval-ignore-output"]
import statistics
import time

import torch

from labkit import models, nosync

net = nosync.make_model(nosync.NoSyncConfig(hidden=1024, depth=3))
criterion = models.MyLoss()
X, y = torch.randn(16, 10), torch.randn(16, 10)
first, later = [], []
for _ in range(20):
    net.zero_grad()  # the gradients are gone (None)
    t0 = time.perf_counter()
    criterion(net(X), y).backward()  # writes the gradients
    t1 = time.perf_counter()
    criterion(net(X), y).backward()  # adds to them
    first.append(t1 - t0)
    later.append(time.perf_counter() - t1)
print(f"forward + backward, first micro-batch {statistics.median(first) * 1e3:.2f} ms, "
      f"second {statistics.median(later) * 1e3:.2f} ms; fitted o: "
      + ", ".join(f"{name} {m.optimizer_s * 1e3:.2f} ms" for name, m in fitted.items()))

# %% [markdown] lang="ja"
# 同期 1 回の費用 s のうち、all-reduce そのものはどれだけでしょうか。バケットの大きさと α–β モデルで
# all-reduce の時間を計算し、s と比べます。all-reduce が説明するのは s の一部だけで、残りは DDP 自身の仕事
# (勾配をバケットに集めて戻す処理など) とランクどうしの待ち合わせです。その割合を表示します。

# %% [markdown] lang="en"
# How much of one synchronization's cost s is the all-reduce itself? Compute the
# all-reduce time from the bucket sizes with the alpha-beta model and compare with s.
# The all-reduce explains only part of s; the rest is DDP's own work (gathering gradients
# into buckets and back, and the like) and the ranks waiting for each other. The cell
# prints the share.

# %% tags=["nbval-ignore-output"]
params = {"doc 004 MLP": 2110, "MLP 1024x3": 2120714}
for name, n in params.items():
    allreduce_s = ab.time(4 * n, 2)
    share = allreduce_s / fitted[name].sync_s if fitted[name].sync_s else float("nan")
    print(f"{name}: s = {fitted[name].sync_s * 1e3:.2f} ms, of which the alpha-beta "
          f"all-reduce of {4 * n / 2**20:.2f} MB is {allreduce_s * 1e3:.2f} ms "
          f"({share:.0%})")

# %% [markdown] lang="ja"
# ## 演習: K = 16 の更新を予測する
#
# 大きなモデル (MLP 1024x3) の c、s、o から、K = 16 のときの 1 回の更新の時間を、全マイクロバッチで
# 同期する場合 (`sync_s`) と `no_sync` の場合 (`no_sync_s`) について、秒で計算してください。
# `predict` は使わずに、式を書きます。

# %% [markdown] lang="en"
# ## Exercise: predict an update with K = 16
#
# From c, s and o of the large model (MLP 1024x3), compute the time of one update with
# K = 16, in seconds, when every micro-batch synchronizes (`sync_s`) and with `no_sync`
# (`no_sync_s`). Write the formulas rather than calling `predict`.

# %% tags=["exercise"]
fit = fitted["MLP 1024x3"]
c, s, o = fit.compute_s, fit.sync_s, fit.optimizer_s
K = 16
sync_s = None  # TODO: seconds per update, every micro-batch synchronized
no_sync_s = None  # TODO: seconds per update with no_sync

# %% tags=["solution"]
sync_s = K * c + K * s + o  # K computations, K synchronizations, one optimizer step
no_sync_s = K * c + s + o  # no_sync: one synchronization per update

# %%
exercises.check_step_prediction(fit, K, sync_s, no_sync_s)

# %% [markdown] lang="ja"
# ## モデルで探る: GPU とランク数
#
# スライダーで条件を変えると、モデルが予測する「1 ランクに対する速さ」(1 秒あたりのサンプル数の比) を
# ランク数ごとに描きます。最初の値は、このマシンで測った α、β と、大きなモデルの c です。
# 回線を選ぶと β がその回線の公称帯域 (メーカーの公表値、片方向) になります。
# **これはモデルによる予測で、測定ではありません**。GPU では計算も速くなるので、c も小さくしてみてください。

# %% [markdown] lang="en"
# ## Exploring with the model: GPUs and more ranks
#
# Move the sliders and the model plots the speed-up over one rank (the ratio of samples per
# second) for each number of ranks. The starting values are alpha and beta measured here
# and c of the large model. Choosing a link sets beta to its nominal bandwidth (the
# vendor's published figure, one direction). **This is a prediction by the model, not a
# measurement.** GPUs also compute faster, so try a smaller c as well.

# %% tags=["nbval-ignore-output"]
import ipywidgets as widgets
import matplotlib.pyplot as plt

links = {"this machine (measured)": ab.beta, **comm.LINKS}
c_measured = fitted["MLP 1024x3"].compute_s
overhead = max(fitted["MLP 1024x3"].sync_s - ab.time(4 * params["MLP 1024x3"], 2), 0.0)


def explore(link="this machine (measured)", latency_us=ab.alpha * 1e6, params_m=2.1,
            compute_ms=c_measured * 1e3, K=4):
    model = comm.AlphaBeta(latency_us * 1e-6, links[link])
    ns = [1, 2, 4, 8, 16, 32, 64]
    series = {
        f"{mode}, K={K}": (ns, [comm.predicted_speedup(n, K, mode == "no_sync",
                                                       int(params_m * 1e6),
                                                       compute_ms * 1e-3, model,
                                                       overhead) for n in ns])
        for mode in ("sync", "no_sync")}
    series["ideal"] = (ns, ns)
    plots.line_chart(series, xlabel="world_size_n", ylabel="speedup",
                     title="explorer_title", logx=True, logy=True)
    plt.show()


explorer = widgets.interactive(
    explore, link=list(links),
    latency_us=widgets.FloatLogSlider(value=ab.alpha * 1e6, base=10, min=0, max=4),
    params_m=widgets.FloatLogSlider(value=2.1, base=10, min=-2, max=4),
    compute_ms=widgets.FloatLogSlider(value=c_measured * 1e3, base=10, min=-2, max=3),
    K=widgets.IntSlider(value=4, min=1, max=16))
explorer

# %% [markdown] lang="ja"
# モデルの言っていることを 1 つ確かめます。同期の回数が少ないほど、ランクを増やしたときの速さは
# 理想 (ランク数倍) に近づきます。K が同じなら、`no_sync` の予測は同期ありの予測より必ず速いか同じです。

# %% [markdown] lang="en"
# One thing the model says, checked: the fewer synchronizations, the closer the speed-up
# gets to the ideal (the number of ranks). For the same K, `no_sync` is never predicted
# slower than synchronizing every micro-batch.

# %%
for link, beta in links.items():
    model = comm.AlphaBeta(ab.alpha, beta)
    for n in (2, 8, 64):
        for K in (1, 4, 8):
            args = (n, K)
            fast = comm.predicted_speedup(*args, True, 2_100_000, c_measured, model)
            slow = comm.predicted_speedup(*args, False, 2_100_000, c_measured, model)
            assert fast >= slow and fast <= n
print("no_sync >= sync, and never above the ideal, for every link, n and K tried")

# %%
ranks.stop()
