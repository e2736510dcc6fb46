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
# # 06 その他の高速化
#
# 記事 000 は最後に「訓練速度を向上させる他の方法」を並べています。
#
# - データローダー: ワーカー数を増やす、バッチサイズを増やす、データシャッフルを有効にする、ピンメモリーを使う
# - モデル: 軽量なモデル、精度と速度のバランス、不要な計算の削減
# - 訓練設定: 学習率の調整、オプティマイザーの変更、スケジューラー、チェックポイントの活用
# - ハードウェア: より速い GPU、TPU
# - ライブラリ: Apex、Horovod (Horovod はレッスン 07)
#
# このレッスンでは、それぞれをこのマシンで測るか、動かして確かめます。速くなるもの、速さとは関係ないもの
# (シャッフル)、メモリを減らす代わりに計算を増やすもの (活性化チェックポイント)、GPU がないと何もしないもの
# (`pin_memory`)、コードの書き換えが要るもの (TPU) があります。このマシンは共有されているので、時間は実行の
# たびに変わります。そこで時間を比べるセルは、候補を交互に何回か測って中央値を比べ、ばらつきより大きな差だけを
# 確かめます。差がばらつきに埋もれるものは計算の量 (呼び出しの回数や FLOP) を確かめ、時間は「この実行では」の
# 値として示します。

# %% [markdown] lang="en"
# # 06 Other speed-ups
#
# Doc 000 ends with a list of "other ways to speed up training":
#
# - data loader: more workers, larger batches, shuffling enabled, pinned memory
# - model: a lighter architecture, balancing accuracy and speed, removing unneeded
#   computation
# - training settings: tune the learning rate, change the optimizer, use a scheduler, use
#   checkpoints
# - hardware: a faster GPU, a TPU
# - libraries: Apex, Horovod (Horovod is in lesson 07)
#
# This lesson measures or demonstrates each on this machine. Some make training faster,
# one has nothing to do with speed (shuffling), one trades more compute for less memory
# (activation checkpointing), one does nothing without a GPU (`pin_memory`), and one
# needs a change of code (a TPU). This machine is shared, so times change from run to
# run. Cells that compare times therefore measure the candidates in turns, several
# times, compare medians, and assert only differences larger than the spread. Where the
# spread hides the difference, they assert the compute (calls, FLOPs) and show the time
# as "on this run".

# %%
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %%
import torch

from labkit import activations, checks, data, loading, models, plots, precision

torch.manual_seed(0)

# %% [markdown] lang="ja"
# ## DataLoader のワーカー数
#
# `num_workers=0` では、メインプロセスがバッチを読み込んでから学習ステップを実行し、これを交互に繰り返します。
# `num_workers=k` では k 個のワーカープロセスが次のバッチを用意し、その間にメインプロセスは学習を進めます。
# 効果があるのは、1 サンプルを作るのに時間がかかる (ディスクから読む、画像をデコードする、データ拡張をする)
# 場合です。
#
# `loading.SlowDataset` は 1 サンプルに 2 ミリ秒かかるデータセットです (ディスク待ちのように `sleep` で待つので、
# CPU を取り合いません)。1 エポックは 256 サンプル (バッチ 32 が 8 個) で、読み込みだけで 1 プロセスなら
# 0.5 秒かかります。学習ステップは軽い MLP (幅 512) なので、時間の大半は読み込みです。
# ワーカー 0 と 2 のローダーで 1 エポックずつ交互に、5 回ずつ回し、1 エポックの時間の中央値を比べます
# (交互に回すのは、マシンの負荷の変化が両方に同じようにかかるようにするためです。ワーカーは最初の
# 慣らしのエポックで起動し、そのあとは使い続けます)。

# %% [markdown] lang="en"
# ## DataLoader workers
#
# With `num_workers=0` the main process loads a batch, then runs the training step, then
# loads the next: the two take turns. With `num_workers=k`, k worker processes prepare the
# next batches while the main process trains. That helps when a sample takes time to
# produce (reading from disk, decoding an image, augmentation).
#
# `loading.SlowDataset` takes 2 ms per sample (a `sleep`, like waiting for a disk, so it
# does not compete for the CPU). An epoch is 256 samples (8 batches of 32): loading alone
# takes 0.5 s in one process. The training step is a light MLP (width 512), so loading
# is most of the time. Loaders with 0 and 2 workers take turns, one epoch each, 5 times
# over, and the median epoch times are compared (taking turns puts the machine's changing
# load on both alike; the workers start in a warm-up epoch and are kept after that).

# %% tags=["nbval-ignore-output"]
import statistics

slow = loading.SlowDataset(n=256, cost_s=0.002)
net = models.WideMLP(hidden=512, depth=2)
opt = torch.optim.SGD(net.parameters(), lr=0.01)


def train_step(X, y):
    opt.zero_grad()
    models.MyLoss()(net(X), y).backward()
    opt.step()


epoch_s = loading.epoch_times(slow, (0, 2), step=train_step, rounds=5)
median_s = {k: statistics.median(v) for k, v in epoch_s.items()}
for k, v in epoch_s.items():
    print(f"num_workers={k}: median {median_s[k]:.2f} s per epoch "
          f"(each round: {', '.join(f'{t:.2f}' for t in v)})")
fig = plots.bar_chart({labkit.t("num_workers"): {str(k): v for k, v in median_s.items()}},
                      ylabel="epoch_time_s", title="epoch_time_by_workers",
                      fmt="{:.2f} s")

# %%
ratio = median_s[2] / median_s[0]
print(f"2 workers / 0 workers: {ratio:.2f} of the time per epoch")
# Measured here (2 shared cores, load 3 to 8): 0.20 to 0.79.
assert ratio < 0.9

# %% [markdown] lang="ja"
# 2 つのワーカーが 2 つのバッチを同時に読み込み、その間にメインプロセスが学習するので、1 エポックは
# 短くなります。ただし「読み込みと学習の遅いほう」より短くはなりません。CPU で重い計算をするデータ拡張なら、
# ワーカーは学習と CPU コアを取り合うので、コア数より多くしても速くなりません。
#
# ワーカーの数が変えるのは速さだけで、データは変わりません。同じ順序で同じバッチが届くことを確かめます。

# %% [markdown] lang="en"
# Two workers load two batches at once while the main process trains, so an epoch gets
# shorter, but never shorter than whichever of loading and training is slower. For
# CPU-heavy augmentation the workers compete with training for cores, and more workers
# than cores do not help.
#
# The number of workers changes the speed, not the data: check that the same batches
# arrive in the same order.

# %%
from torch.utils.data import DataLoader

fast = loading.SlowDataset(n=64, cost_s=0)
batches = {k: [X for X, _ in DataLoader(fast, batch_size=16, num_workers=k)]
           for k in (0, 2)}
assert all(torch.equal(a, b) for a, b in zip(batches[0], batches[2], strict=True))
print("num_workers=0 and 2 give identical batches")

# %% [markdown] lang="ja"
# ## `persistent_workers`
#
# ふつうはエポックごとに (`for` でローダーを回し始めるたびに) ワーカーを起動し直し、エポックの終わりに
# 止めます。`persistent_workers=True` にすると、同じワーカーが次のエポックでも使われます。
# ワーカーの起動が重い場合 (macOS や Windows の `spawn`、大きなデータセットのコピーなど) に効きます。
# 各バッチを作ったプロセスの ID で確かめます。

# %% [markdown] lang="en"
# ## `persistent_workers`
#
# Normally the workers start again at every epoch (each time a `for` loop starts over the
# loader) and stop at its end. With `persistent_workers=True` the same workers serve the
# next epoch too. That matters when starting a worker is expensive (`spawn` on macOS and
# Windows, copying a large data set, and so on). Check with the process ids that made
# each batch.

# %%
kept = loading.worker_pids(num_workers=2, persistent_workers=True, epochs=3)
fresh = loading.worker_pids(num_workers=2, persistent_workers=False, epochs=3)
print("persistent_workers=True: ", kept)
print("persistent_workers=False:", fresh)
assert kept[0] == kept[1] == kept[2] and len(kept[0]) == 2  # the same two workers
assert fresh[0].isdisjoint(fresh[1]) and fresh[1].isdisjoint(fresh[2])  # new ones

# %% [markdown] lang="ja"
# 各エポックの最初のバッチが届くまでの時間を比べます。ワーカーを使い回すと、2 エポック目からは起動の分だけ
# 早く届きます (Linux の `fork` では起動が軽いので、差は小さめです)。

# %% [markdown] lang="en"
# Compare the time until each epoch's first batch arrives. With workers kept alive, from
# the second epoch on it comes sooner by the start-up time (small on Linux, where `fork`
# starts workers cheaply).

# %% tags=["nbval-ignore-output"]
first_ms = {}
for persistent in (False, True):
    times = loading.loader_times(slow, 2, epochs=4, persistent_workers=persistent)
    first_ms[f"persistent_workers={persistent}"] = (
        range(1, 5), [s * 1e3 for s in times.first_batch_s])
fig = plots.line_chart(first_ms, xlabel="epoch", ylabel="first_batch_ms",
                       title="first_batch_by_epoch", from_zero=True)
fig.axes[0].set_xticks(range(1, 5))  # whole epochs

# %% [markdown] lang="ja"
# ## `pin_memory`
#
# `pin_memory=True` にすると、DataLoader はバッチを**ページ固定メモリ** (pinned memory、OS がスワップしない
# メモリ) に置きます。GPU への転送は固定メモリからなら DMA で直接行え、`X.to("cuda", non_blocking=True)`
# とすれば転送と計算を重ねられます。つまり効果があるのは **CPU から GPU へデータを送るときだけ**です。
#
# GPU のないこのマシンでは、何もしません。torch は警告を出し、バッチは固定されていません。

# %% [markdown] lang="en"
# ## `pin_memory`
#
# With `pin_memory=True` the DataLoader puts batches in **page-locked (pinned) memory**,
# which the OS never swaps out. Copies to a GPU from pinned memory go straight by DMA,
# and `X.to("cuda", non_blocking=True)` lets the copy overlap with computation. So it
# helps **only when data goes from the CPU to a GPU**.
#
# On this machine, without a GPU, it does nothing: torch warns, and the batch is not
# pinned.

# %%
report = loading.pin_memory_report(fast)
print(report)
if not report["accelerator"]:
    print(labkit.t("pin_memory_cpu_note", pinned=report["pinned"]))
    assert report["pinned"] is False
    assert any("no accelerator" in w for w in report["warnings"])

# %% [markdown] lang="ja"
# GPU があれば、固定メモリからの転送と普通のメモリからの転送を比べます (GPU がなければ何もしません)。

# %% [markdown] lang="en"
# With a GPU, compare a copy from pinned memory with one from ordinary memory (without a
# GPU this cell does nothing).

# %% tags=["nbval-ignore-output"]
from labkit import timing

if torch.cuda.is_available():
    X_cpu = torch.randn(64, 3, 224, 224)
    X_pinned = X_cpu.pin_memory()
    for name, X in [("pageable", X_cpu), ("pinned", X_pinned)]:
        s = timing.median_time(lambda X=X: X.to("cuda", non_blocking=True), repeat=10,
                               device="cuda")
        print(f"{name}: {X.numel() * 4 / s / 1e9:.1f} GB/s")
else:
    print(labkit.t("no_cuda_skip", what="pin_memory"))

# %% [markdown] lang="ja"
# ## バッチサイズと処理速度
#
# バッチを大きくすると、1 ステップの固定のコスト (Python、カーネルの起動、オプティマイザ) を多くのサンプルで
# 分け合えるので、1 秒あたりに処理できるサンプル数は増えます。ただし頭打ちになり、メモリにも上限があります。
# 記事 004 のモデルで測ります。

# %% [markdown] lang="en"
# ## Batch size and throughput
#
# A larger batch shares the fixed cost of a step (Python, kernel launches, the optimizer)
# among more samples, so more samples are processed per second, up to a plateau and the
# memory limit. Measure it with doc 004's model.

# %% tags=["nbval-ignore-output"]
from labkit import training

per_s = training.throughput([8, 32, 128, 512, 2048])
for b, v in per_s.items():
    print(f"batch {b:5d}: {v:10.0f} samples/s")
fig = plots.line_chart({"doc 004 MLP": (list(per_s), list(per_s.values()))},
                       xlabel="batch_size", ylabel="samples_per_s",
                       title="throughput_by_batch", logx=True, logy=True)

# %% [markdown] lang="ja"
# ## 大きなバッチと学習率
#
# 速く処理できても、学習が早く進むとは限りません。同じサンプル数 (10 エポック) を学習させると、
# バッチ 512 の更新回数はバッチ 32 の 16 分の 1 です。学習率が同じなら、損失の下がり方は遅くなります。
# よく使われる対策は**学習率をバッチサイズに比例させる** (linear scaling rule: バッチが 16 倍なら学習率も 16 倍)
# ことです。検証データ (学習に使わない 1024 サンプル) の損失で比べます。

# %% [markdown] lang="en"
# ## Large batches and the learning rate
#
# Processing faster is not learning faster. For the same number of samples (10 epochs),
# batch 512 makes 16 times fewer updates than batch 32; with the same learning rate the
# loss falls more slowly. The usual remedy is to **scale the learning rate with the batch
# size** (the linear scaling rule: 16 times the batch, 16 times the rate). Compare the
# loss on held-out data (1024 samples never trained on).

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
fig = plots.line_chart({k: (r["samples"], r["heldout_loss"]) for k, r in results.items()},
                       xlabel="samples_seen", ylabel="heldout_loss",
                       title="batch_lr_title", logy=True)

# %%
final = {k: r["heldout_loss"][-1] for k, r in results.items()}
assert final["batch 512, lr 0.05"] > 1.5 * final["batch 32, lr 0.05"]  # too few updates
assert final["batch 512, lr 0.8"] < 0.5 * final["batch 512, lr 0.05"]  # scaling helps

# %% [markdown] lang="ja"
# ## ウォームアップ
#
# 比例させすぎると学習率が大きくなりすぎ、学習の最初で重みが大きく跳ねて、その後うまく学習できなくなります。
# そこで最初の数十ステップだけ学習率を小さな値から徐々に上げる**ウォームアップ**を組み合わせます
# (Goyal ら 2017、「Accurate, Large Minibatch SGD」)。バッチ 32 で安定して学習できる学習率 0.2 を、
# バッチ 512 に合わせて 16 倍の 3.2 にした場合で比べます。ウォームアップは
# `torch.optim.lr_scheduler.LinearLR` で、最初の 20 ステップで学習率を 3.2 まで上げます。

# %% [markdown] lang="en"
# ## Warm-up
#
# Scaled too far, the learning rate becomes so large that the weights jump at the start
# and training never recovers well. So the rate is raised gradually from a small value
# over the first tens of steps: **warm-up** (Goyal et al. 2017, "Accurate, Large Minibatch
# SGD"). Compare at batch 512 with the rate 0.2, which trains well at batch 32, scaled
# 16 times to 3.2. The warm-up is `torch.optim.lr_scheduler.LinearLR`, raising the rate
# to 3.2 over the first 20 steps.

# %%
big = training.scaled(replace(base, lr=0.2), 512)
big.steps, big.eval_every = 100, 5
warm = {"lr 3.2": training.fit(big),
        "lr 3.2 + warm-up 20": training.fit(replace(big, schedule="warmup",
                                                   warmup_steps=20))}
for name, r in warm.items():
    print(f"{name}: lr of the first steps {[round(x, 2) for x in r['lr'][:3]]}, "
          f"held-out loss {r['heldout_loss'][-1]:.3f}")
fig = plots.line_chart({k: (r["steps"], r["heldout_loss"]) for k, r in warm.items()},
                       xlabel="optimizer_step", ylabel="heldout_loss",
                       title="loss_curve_title", logy=True)
assert warm["lr 3.2 + warm-up 20"]["heldout_loss"][-1] < 0.7 * warm["lr 3.2"]["heldout_loss"][-1]

# %% [markdown] lang="ja"
# 大きなバッチそのものは `no_sync` による勾配累積 (レッスン 04) と同じ数学です。勾配累積で実効バッチを
# 大きくするときにも、この学習率の調整が必要になります。

# %% [markdown] lang="en"
# A large batch is the same mathematics as gradient accumulation with `no_sync` (lesson
# 04): growing the effective batch by accumulation needs the same learning-rate care.

# %% [markdown] lang="ja"
# ## 演習: 大きなバッチの学習率
#
# 上のウォームアップの実行と同じ学習率を返す関数 `lr_at(step, batch_size)` を書いてください。`step` は
# オプティマイザのステップ (0, 1, 2, …)、`batch_size` はバッチサイズです。
#
# - 最大の学習率は、バッチ 32 での 0.2 を、バッチサイズに比例させた値です。
# - ウォームアップは `LinearLR(start_factor=1/20, total_iters=20)` です。最大の学習率に掛ける倍率が、
#   ステップ 0 の 1/20 からステップ 20 の 1 まで直線で上がり、そのあとは 1 のままです。
#
# 上の実行では、バッチ 512 の最初の 3 ステップの学習率は 0.16、0.31、0.46 でした。確認のセルは、
# バッチ 128、512、2048 のそれぞれについて、ステップ 0〜59 の学習率を torch の `LinearLR` と比べます。
#
# 演習のセルを書き換えて実行してから、確認のセルを実行します。正しければ「正解です」と表示され、
# 違っていれば、何が違うかとヒントが表示されます。完全版のノートブックでは演習のすぐあとに解答のセルが
# ありますが、まず自分で解いてみてください。

# %% [markdown] lang="en"
# ## Exercise: the learning rate of a large batch
#
# Write `lr_at(step, batch_size)`, which returns the learning rate of the warm-up run
# above at optimizer step `step` (0, 1, 2, ...) for a batch of `batch_size`:
#
# - the peak rate is 0.2 at batch 32, scaled with the batch size;
# - the warm-up is `LinearLR(start_factor=1/20, total_iters=20)`: the factor that
#   multiplies the peak rises in a straight line from 1/20 at step 0 to 1 at step 20,
#   and stays 1 after that.
#
# In the run above, the first three steps of batch 512 had the rates 0.16, 0.31 and
# 0.46. The check compares your rates at steps 0 to 59 with torch's `LinearLR`, for
# batches of 128, 512 and 2048.
#
# Edit and run the exercise cell, then run the check cell. It says "Correct" when the
# answer is right, and otherwise what is wrong, with a hint. In the full notebooks a
# solution cell follows each exercise: try on your own first.

# %% tags=["exercise"]
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
# 記事は「データシャッフルを有効にする」を高速化の方法に挙げていますが、シャッフルは 1 ステップも 1 エポックも
# 速くしません。シャッフルの目的は、各バッチを**データ全体から偏りなく取り出した標本**にすることで、これは SGD の
# 前提です。目標の 1 番目の値で並べ替えたままのデータ (ファイルが何かの順に書かれていると、こうなります) と、
# エポックごとにシャッフルしたデータで、同じモデルを 10 エポック学習させます (モーメンタム付き SGD)。

# %% [markdown] lang="en"
# ## Shuffling is for convergence, not speed
#
# The document lists "enable data shuffling" as a way to speed up training, but shuffling
# makes neither a step nor an epoch faster. Its purpose is to make every batch an
# **unbiased sample of the whole data**, which SGD assumes. Train the same model for 10
# epochs (SGD with momentum) on data left sorted by its first target value (what a file
# written in some order gives) and on data shuffled every epoch.

# %%
order = {o: training.fit(training.TrainConfig(steps=640, optimizer="momentum", order=o,
                                            eval_every=16)) for o in training.ORDERS}
for o, r in order.items():
    print(f"{o:8s}: held-out loss {r['heldout_loss'][-1]:.3f}, "
          f"median epoch {sorted(r['epoch_s'])[len(r['epoch_s']) // 2] * 1e3:.0f} ms")
fig = plots.line_chart({o: (r["steps"], r["heldout_loss"]) for o, r in order.items()},
                       xlabel="optimizer_step", ylabel="heldout_loss",
                       title="order_title", logy=True)
assert order["shuffled"]["heldout_loss"][-1] < 0.85 * order["sorted"]["heldout_loss"][-1]

# %% [markdown] lang="ja"
# 1 エポックの時間はほぼ同じで、違うのは収束です。並べ替えたままでは、続くバッチが似たサンプルばかりになり、
# モデルはいま見ている部分に引っ張られて損失が上下し、下がりきりません。複数のランクでは
# `DistributedSampler(shuffle=True)` と `set_epoch` で同じことをします (このレッスンの後半)。

# %% [markdown] lang="en"
# An epoch takes about as long either way; what differs is convergence. Left sorted,
# consecutive batches hold similar samples, the model is pulled towards whatever part it
# is seeing, and the loss swings and stays higher. With several ranks,
# `DistributedSampler(shuffle=True)` and `set_epoch` do the same job (later in this
# lesson).

# %% [markdown] lang="ja"
# ## 混合精度 (`torch.autocast`)
#
# 混合精度では、行列積のような演算だけを低い精度 (float16 か bfloat16) で計算し、重みとオプティマイザは
# float32 のまま保ちます。GPU の Tensor Core で速くなり、活性値のメモリも半分になります。
#
# - 記事の「Apex」は NVIDIA の拡張ライブラリで、その `amp` は PyTorch 本体の `torch.autocast` と
#   `torch.amp.GradScaler` に置き換わりました。いまは Apex を入れる必要はありません。
# - CPU では bfloat16 を使います。`autocast` の中の `Linear` の出力は bfloat16 になり、重みと勾配は
#   float32 のままです。

# %% [markdown] lang="en"
# ## Mixed precision (`torch.autocast`)
#
# Mixed precision runs only some operations, such as matrix products, in a lower
# precision (float16 or bfloat16) and keeps the weights and the optimizer in float32. On
# GPUs it is faster thanks to Tensor Cores, and activations take half the memory.
#
# - The document's "Apex" is an NVIDIA extension library; its `amp` was replaced by
#   PyTorch's own `torch.autocast` and `torch.amp.GradScaler`. There is no need to
#   install Apex now.
# - On a CPU, use bfloat16. Inside `autocast` a `Linear` outputs bfloat16, while the
#   weights and gradients stay float32.

# %%
dtypes = precision.autocast_dtypes(models.MLP(), torch.randn(8, 10))
print(dtypes)
assert dtypes == {"output": torch.bfloat16, "weight": torch.float32,
                  "grad": torch.float32}

# %% [markdown] lang="ja"
# 同じ初期値から、float32 と bfloat16 autocast で 60 ステップ学習させます。学習曲線はほぼ重なります。
# 速さは CPU しだいです。bfloat16 の行列演算命令 (AMX や AVX512-BF16) がない CPU では、変換の手間の分
# かえって遅くなることもあります。

# %% [markdown] lang="en"
# Train 60 steps from the same initial weights in float32 and with bfloat16 autocast. The
# loss curves nearly coincide. Speed depends on the CPU: without bfloat16 matrix
# instructions (AMX, AVX512-BF16) the conversions can even make it slower.

# %% tags=["nbval-ignore-output"]
run = training.TrainConfig(steps=60, hidden=512, depth=2, batch_size=256, n=4096, optimizer="momentum")
prec = {p: training.fit(replace(run, precision=p)) for p in training.PRECISIONS}
for p, r in prec.items():
    print(f"{p}: final loss {r['losses'][-1]:.4f}, median step {r['median_step_s'] * 1e3:.1f} ms")
fig = plots.loss_curves({p: r["losses"] for p, r in prec.items()},
                        title="precision_title", logy=True)
fig = plots.bar_chart({"MLP 512x2": {p: r["median_step_s"] * 1e3 for p, r in prec.items()}},
                      ylabel="step_time_ms", title="precision_time_title", fmt="{:.1f} ms")

# %%
f32, bf16 = prec["float32"]["losses"], prec["bfloat16"]["losses"]
assert abs(bf16[-1] - f32[-1]) < 0.05 * f32[-1]  # the same training, within 5 %
assert f32[-1] < 0.2 * f32[0]  # and it learns

# %% [markdown] lang="ja"
# GPU では float16 を使い、`torch.amp.GradScaler("cuda")` で損失をスケールします。float16 は表せる範囲が狭く、
# 小さな勾配が 0 に丸められてしまうからです。スケーラーは逆伝播の前に損失を大きくし、`step` の前に
# 勾配を元に戻し、オーバーフローしたステップは飛ばします。CUDA がなければ、このセルは何もしません。

# %% [markdown] lang="en"
# On GPUs, use float16 and scale the loss with `torch.amp.GradScaler("cuda")`: float16
# has a narrow range, and small gradients would round to zero. The scaler enlarges the
# loss before backward, restores the gradients before `step`, and skips steps whose
# gradients overflowed. Without CUDA this cell does nothing.

# %%
if torch.cuda.is_available():
    torch.manual_seed(0)
    gpu_model = models.WideMLP(hidden=512, depth=2).cuda()
    gpu_opt = torch.optim.SGD(gpu_model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cuda")
    X_gpu, y_gpu = torch.randn(256, 10, device="cuda"), torch.randn(256, 10, device="cuda")
    losses16 = []
    for _ in range(20):
        gpu_opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            out = gpu_model(X_gpu)
        loss = models.MyLoss()(out.float(), y_gpu)  # the loss in float32
        scaler.scale(loss).backward()  # backward of the loss times the scale
        scaler.step(gpu_opt)  # unscales the gradients; skips the step on inf or NaN
        scaler.update()  # a smaller scale after an overflow, a larger one after a while
        losses16.append(loss.item())
    print(f"float16 + GradScaler: loss {losses16[0]:.3f} -> {losses16[-1]:.3f}, "
          f"scale {scaler.get_scale():g}")
    assert losses16[-1] < losses16[0]
else:
    print(labkit.t("no_cuda_skip", what="float16 + torch.amp.GradScaler('cuda')"))

# %% [markdown] lang="ja"
# 古い書き方 `torch.cuda.amp.autocast()` と `torch.cuda.amp.GradScaler()` も、いまは非推奨です。
# 使うと torch 自身が `FutureWarning` で `torch.amp` の書き方を案内します。

# %% [markdown] lang="en"
# The older `torch.cuda.amp.autocast()` and `torch.cuda.amp.GradScaler()` are deprecated
# too: torch itself says so with a `FutureWarning` that points to `torch.amp`.

# %%
amp_warnings = precision.cuda_amp_warnings()
print(*amp_warnings, sep="\n")
assert any(w.startswith("FutureWarning") and "torch.amp.GradScaler('cuda'" in w
           for w in amp_warnings)
assert any(w.startswith("FutureWarning") and "torch.amp.autocast('cuda'" in w
           for w in amp_warnings)

# %% [markdown] lang="ja"
# ## 軽いモデル
#
# パラメータが少ないモデルは、1 ステップの計算量が少なく、1 ステップが短くなります。その代わり、表せる関数が
# 限られ、精度が下がることがあります (記事の「精度と速度のバランス」)。幅を変えた 1 層の MLP で、
# パラメータ数、1 ステップの計算量 (torch の `FlopCounterMode` で数えた浮動小数点演算の回数、FLOP)、
# 1 ステップの時間 (バッチ 1024)、300 ステップ後の検証損失 (Adam) を並べます。時間は、幅ごとに 5 ステップずつ
# 交互に 5 回測った中央値です。

# %% [markdown] lang="en"
# ## A lighter model
#
# A model with fewer parameters computes less per step and takes less time per step. In
# exchange it can represent fewer functions and may be less accurate (the document's
# "balance accuracy and speed"). For one-layer MLPs of several widths, list the
# parameter count, the work per step (floating-point operations, FLOPs, counted by
# torch's `FlopCounterMode`), the time per step (batch 1024) and the held-out loss after
# 300 steps (Adam). The time is the median of 5 rounds in which the widths take turns,
# 5 steps each.

# %% tags=["nbval-ignore-output"]
sizes = {}
for width in (16, 64, 256, 1024):
    run = training.fit(training.TrainConfig(steps=300, hidden=width, optimizer="adam", lr=0.003,
                                eval_every=100))
    work = activations.step_work(models.WideMLP(hidden=width), torch.randn(1024, 10))
    sizes[width] = {"params": run["params"], "flops": work["flops"],
                    "loss": run["heldout_loss"][-1]}
step_s = training.step_times(list(sizes), batch_size=1024, rounds=5, steps=5)
for width, s in sizes.items():
    s["step_s"] = statistics.median(step_s[width])
    print(f"width {width:5d}: {s['params']:6d} parameters, {s['flops'] / 1e6:5.1f} MFLOP "
          f"and {s['step_s'] * 1e3:.2f} ms per step, held-out loss {s['loss']:.3f}")
print(f"on this run: width 1024 took {sizes[1024]['step_s'] / sizes[16]['step_s']:.1f} "
      "times as long per step as width 16")
fig = plots.line_chart({"MLP": ([s["params"] for s in sizes.values()],
                                [s["step_s"] * 1e3 for s in sizes.values()])},
                       xlabel="params", ylabel="step_time_ms",
                       title="model_size_title", logx=True, logy=True)

# %%
assert [s["params"] for s in sizes.values()] == [models.count_params(
    models.WideMLP(hidden=w)) for w in sizes]
flops = [s["flops"] for s in sizes.values()]
assert flops == sorted(flops) and flops[-1] == 64 * flops[0]  # 64 times the width
assert sizes[16]["loss"] > sizes[1024]["loss"]  # the smallest model fits worse

# %% [markdown] lang="ja"
# 幅 1024 の 1 ステップは、幅 16 の 64 倍の計算をします。それでも時間が 64 倍になるわけではありません。
# 小さなモデルの 1 ステップは、計算よりも Python やカーネルの起動などの固定のコストで決まるからです。
# このセルが確かめるのは計算の量で、時間は「この実行では」の値です。共有されたこのマシンでは、時間の比の
# ばらつきが大きく (幅 1024 と 16 の比は 1.2 倍から 18 倍、ほとんど同じ幅 16 と 17 でも 1.6 倍になった
# ことがあります)、確かめられるだけの差の目安が立たないからです。

# %% [markdown] lang="en"
# A step of width 1024 computes 64 times as much as one of width 16, yet it does not
# take 64 times as long: a small model's step is set by fixed costs (Python, kernel
# launches) more than by its arithmetic. The cell asserts the compute; the time is "on
# this run". On this shared machine the ratio of times spreads too widely for any
# margin to hold (1.2 to 18 times between widths 1024 and 16, and once 1.6 times
# between widths 16 and 17, which are nearly the same).

# %% [markdown] lang="ja"
# 「不要な計算の削減」の代表は、評価のときに勾配を計算しないことです。`torch.no_grad()` の中では、
# 逆伝播のための活性値が 1 バイトも保存されません。

# %% [markdown] lang="en"
# The classic "unneeded computation" is gradients during evaluation. Inside
# `torch.no_grad()` not a byte of activations is kept for a backward pass.

# %%
wide = models.WideMLP(hidden=1024, depth=2)
X_eval = torch.randn(512, 10)
kept_bytes = activations.saved_activation_bytes(wide, X_eval)
with torch.no_grad():
    kept_no_grad = activations.saved_activation_bytes(wide, X_eval)
print(f"training forward keeps {kept_bytes / 1e6:.1f} MB; under no_grad {kept_no_grad} B")
assert kept_bytes > 0 and kept_no_grad == 0

# %% [markdown] lang="ja"
# ## 学習率、オプティマイザ、スケジューラ
#
# これらは 1 ステップを速くするのではなく、**少ないステップで**目標の損失に届くようにするものです。
# 教師ネットワークの課題で、同じ初期値から比べます。まず SGD の学習率を変えます。小さすぎると進まず、
# 大きすぎると発散します (発散した損失 `inf` は、図では 10 の位置に描きます)。

# %% [markdown] lang="en"
# ## Learning rate, optimizer and scheduler
#
# These do not make a step faster; they reach a target loss in **fewer steps**. Compare
# on the teacher task from the same initial weights. First the learning rate of SGD:
# too small and nothing happens, too large and it diverges (a diverged loss, `inf`, is
# drawn at 10).

# %%
lr_runs = {lr: training.fit(training.TrainConfig(steps=320, lr=lr, eval_every=320))["heldout_loss"][-1]
           for lr in (0.003, 0.03, 0.3, 3.0)}
print({lr: round(v, 3) for lr, v in lr_runs.items()})
fig = plots.line_chart({"SGD": (list(lr_runs), [min(v, 10.0) for v in lr_runs.values()])},
                       xlabel="learning_rate", ylabel="heldout_loss",
                       title="lr_title", logx=True, logy=True)
assert lr_runs[0.3] < lr_runs[0.003] and lr_runs[0.3] < lr_runs[3.0]

# %% [markdown] lang="ja"
# 次にオプティマイザです (学習率はそれぞれのよく使われる値)。この課題では、モーメンタム付き SGD と Adam が
# 素の SGD より少ないステップで下がります。

# %% [markdown] lang="en"
# Then the optimizer (each at a common learning rate). On this task SGD with momentum and
# Adam get lower in fewer steps than plain SGD.

# %%
opt_runs = {name: training.fit(training.TrainConfig(steps=320, optimizer=name, lr=lr, eval_every=16))
            for name, lr in (("sgd", 0.05), ("momentum", 0.05), ("adam", 0.003),
                             ("adamw", 0.003))}
fig = plots.line_chart({f"{k} (lr {r['config']['lr']})": (r["steps"], r["heldout_loss"])
                        for k, r in opt_runs.items()},
                       xlabel="optimizer_step", ylabel="heldout_loss",
                       title="optimizer_title", logy=True)
last = {k: r["heldout_loss"][-1] for k, r in opt_runs.items()}
print({k: round(v, 3) for k, v in last.items()})
assert last["momentum"] < last["sgd"] and last["adam"] < last["sgd"]

# %% [markdown] lang="ja"
# スケジューラは学習中に学習率を変えます。torch のスケジューラ (`StepLR`、`CosineAnnealingLR`、
# ウォームアップの `LinearLR`、つなぐ `SequentialLR`) を、Adam (学習率 0.01、600 ステップ) で比べます。
# どれが最良かは課題、学習率、ステップ数の組み合わせで決まり、一般的な正解はありません。
# 学習率とスケジューラは一緒に調整します。

# %% [markdown] lang="en"
# A scheduler changes the learning rate during training. Compare torch's schedulers
# (`StepLR`, `CosineAnnealingLR`, `LinearLR` for warm-up, `SequentialLR` to chain them)
# with Adam (learning rate 0.01, 600 steps). Which is best depends on the task, the rate
# and the number of steps together; there is no general winner. Tune the learning rate
# and the schedule together.

# %%
sched_runs = {name: training.fit(training.TrainConfig(steps=600, optimizer="adam", lr=0.01,
                                          schedule=name, warmup_steps=60, eval_every=30))
              for name in training.SCHEDULES}
fig = plots.line_chart({k: (r["steps"], r["heldout_loss"]) for k, r in sched_runs.items()},
                       xlabel="optimizer_step", ylabel="heldout_loss",
                       title="schedule_title", logy=True)
print({k: round(r["heldout_loss"][-1], 3) for k, r in sched_runs.items()})
assert all(r["heldout_loss"][-1] < 0.2 for r in sched_runs.values())  # all learn
assert sched_runs["cosine"]["lr"][-1] < 1e-4  # cosine ends near zero
assert abs(sched_runs["warmup"]["lr"][0] - 0.01 / 60) < 1e-9  # warm-up starts small

# %% [markdown] lang="ja"
# ## チェックポイント (1): 学習状態を保存して再開する
#
# 記事の「チェックポイントを活用する」は 2 通りに読めます。1 つ目は学習状態 (重み、オプティマイザ、
# 乱数の状態、ステップ数) をファイルに保存することです。これは学習を速くしません。止まっても
# 最初からやり直さずに済む、という意味で時間を節約します。
#
# `labkit.training` で 40 ステップを一気に学習した場合と、20 ステップで止めてチェックポイントから再開した場合を
# 比べます。重みのハッシュ (`param_sha256`) が一致すれば、1 ビットも違わない同じ結果です。

# %% [markdown] lang="en"
# ## Checkpoints (1): save and resume the training state
#
# The document's "use checkpoints" can mean two things. The first is saving the training
# state (weights, optimizer, random-number state, step) to a file. That does not make
# training faster; it saves time by not starting over after a stop.
#
# With `labkit.training`, compare 40 steps in one go with 20 steps, a stop, and a resume
# from the checkpoint. Equal weight hashes (`param_sha256`) mean bit-identical results.

# %%
import tempfile
from pathlib import Path

cfg = training.TrainConfig(steps=40, batch_size=64, optimizer="momentum")
with tempfile.TemporaryDirectory() as tmp:
    ckpt = Path(tmp) / "state.pt"
    straight = training.fit(cfg)
    training.fit(replace(cfg, steps=20), ckpt)  # stops after 20 steps
    resumed = training.fit(cfg, ckpt, resume=True)
print("uninterrupted:", straight["param_sha256"][:16])
print("resumed:      ", resumed["param_sha256"][:16], "from step", resumed["resumed_from"])
assert resumed["resumed_from"] == 20
assert resumed["param_sha256"] == straight["param_sha256"]
assert resumed["losses"] == straight["losses"]

# %% [markdown] lang="ja"
# ## チェックポイント (2): 活性化チェックポイント
#
# 2 つ目は `torch.utils.checkpoint` の**活性化チェックポイント**です。順伝播で逆伝播用の活性値を保存する代わりに、
# 区間 (セグメント) の入力だけを残し、逆伝播のときにその区間の順伝播をもう一度計算します。
# **メモリを減らす代わりに計算が増えます**。大きなモデルやバッチをメモリに収めるための技術で、
# 速くするためのものではありません。
#
# 12 層の MLP (幅 256、バッチ 2048) を 4 区間に分けて比べます。メモリは 2 通りで測ります。
# - 保存された活性値: `torch.autograd.graph.saved_tensors_hooks` で逆伝播のために保存されたテンソルを
#   集め、そのバイト数を足したもの (パラメータは除く)
# - ピークメモリ: CPU では `torch.profiler` の `profile_memory=True` で、各演算の確保と解放を時間順に
#   足し合わせた最大値 (GPU では `torch.cuda.max_memory_allocated`)
#
# 計算の量は、1 ステップで `Linear` の順伝播が何回実行されたか (フォワードフック) と、FLOP
# (`FlopCounterMode`) で数えます。時間は、2 つのモデルで 1 ステップずつ交互に 5 回測った中央値です。

# %% [markdown] lang="en"
# ## Checkpoints (2): activation checkpointing
#
# The second is **activation checkpointing** with `torch.utils.checkpoint`. Instead of
# keeping activations for the backward pass, it keeps only each segment's input and runs
# that segment's forward again during backward: **less memory for more compute**. It
# fits larger models and batches in memory; it does not speed anything up.
#
# Compare a 12-layer MLP (width 256, batch 2048) split into 4 segments. Memory is
# measured two ways:
# - saved activations: `torch.autograd.graph.saved_tensors_hooks` collects the tensors
#   saved for backward, and their bytes are added up (parameters excluded);
# - peak memory: on the CPU, `torch.profiler` with `profile_memory=True`, every
#   operator's allocations and frees summed in time order, and the maximum kept
#   (on a GPU, `torch.cuda.max_memory_allocated`).
#
# The compute is counted as the `Linear` forwards run in one step (forward hooks) and
# as FLOPs (`FlopCounterMode`). The time is the median of 5 rounds in which the two
# models take turns, one step each.

# %% tags=["nbval-ignore-output"]
X_deep = torch.randn(2048, 256)
deep, cost, work = {}, {}, {}
for checkpointed in (False, True):
    torch.manual_seed(0)  # the same weights in both models
    deep[checkpointed] = activations.DeepMLP(checkpointed=checkpointed)
    cost[checkpointed] = activations.step_cost(deep[checkpointed], X_deep)
    work[checkpointed] = activations.step_work(deep[checkpointed], X_deep)
step_s = activations.step_times(deep, X_deep, rounds=5)
grads = {k: [p.grad for p in m.parameters()] for k, m in deep.items()}  # the last step's
labels = {False: labkit.t("ckpt_off"), True: labkit.t("ckpt_on")}
for k, c in cost.items():
    c["step_s"] = statistics.median(step_s[k])
    print(f"{labels[k]}: saved {c['saved_bytes'] / 1e6:.1f} MB, peak "
          f"{c['peak_bytes'] / 1e6:.1f} MB, {work[k]['linear_forwards']} Linear forwards, "
          f"{work[k]['flops'] / 1e9:.2f} GFLOP, {c['step_s'] * 1e3:.1f} ms per step")
print(f"on this run: {cost[True]['step_s'] / cost[False]['step_s']:.2f} times the time")
fig = plots.bar_chart(
    {labkit.t("saved_mb"): {labels[k]: c["saved_bytes"] / 1e6 for k, c in cost.items()},
     labkit.t("peak_mb"): {labels[k]: c["peak_bytes"] / 1e6 for k, c in cost.items()},
     labkit.t("step_time_ms"): {labels[k]: c["step_s"] * 1e3 for k, c in cost.items()}},
    ylabel="saved_mb", title="ckpt_title", fmt="{:.1f}")

# %%
assert cost[True]["saved_bytes"] < 0.5 * cost[False]["saved_bytes"]
assert cost[True]["peak_bytes"] < cost[False]["peak_bytes"]
checks.grads_match(grads[True], grads[False], tol=0.0)  # the same gradients, exactly
# Every Linear's forward runs twice: once in the forward, once again in backward.
assert (work[False]["linear_forwards"], work[True]["linear_forwards"]) == (12, 24)
one_forward = 2 * len(X_deep) * sum(  # a Linear's forward: 2 FLOPs per weight and sample
    m.weight.numel() for m in deep[False].modules() if isinstance(m, torch.nn.Linear))
assert work[True]["flops"] - work[False]["flops"] == one_forward

# %% [markdown] lang="ja"
# 保存される活性値は 13 個 (各 `Linear` の入力と最後の出力) から 4 個 (各区間の入力) に減ります。勾配は
# 1 ビットも変わりません。代わりに各 `Linear` の順伝播が 2 回実行され、1 ステップの計算は順伝播 1 回分
# ちょうど増えます (ここでは 9.4 から 12.6 GFLOP へ、約 3 割増し)。計算が増えた分、1 ステップは長くなるはずです。
# ただ、このマシンのように共有された CPU では、測った時間の比は実行のたびに大きく変わります (中央値で 1.1 倍から
# 1.6 倍、1 回ずつでは 0.5 倍から 1.3 倍) ので、このセルは時間ではなく計算の量を確かめます。上の時間は
# 「この実行では」の値です。

# %% [markdown] lang="en"
# The saved activations drop from 13 tensors (every `Linear`'s input and the last
# output) to 4 (each segment's input). The gradients do not change by a single bit.
# In exchange every `Linear`'s forward runs twice, and a step computes exactly one
# forward pass more (here 12.6 GFLOP instead of 9.4, about a third more). More compute
# should make a step longer, but on a shared CPU like this one the measured ratio changes
# a lot from run to run (medians from 1.1 to 1.6 times, single rounds from 0.5 to 1.3
# times), so the cell asserts the compute, not the time: the time above is "on this
# run".

# %% [markdown] lang="ja"
# ## DDP と組み合わせる: シャッフルと `set_epoch`
#
# ここからはランク 2 つで確かめます。DDP では `DataLoader` に `DistributedSampler` を渡し、シャッフルは
# サンプラーに任せます。`DataLoader(shuffle=True, sampler=...)` と両方指定するとエラーになります。
# 毎エポック `sampler.set_epoch(epoch)` を呼ばないと、毎回同じ順序になります (レッスン 03)。

# %% [markdown] lang="en"
# ## With DDP: shuffling and `set_epoch`
#
# From here on, two ranks. Under DDP the `DataLoader` gets a `DistributedSampler` and the
# sampler does the shuffling: `DataLoader(shuffle=True, sampler=...)` with both is an
# error. Without `sampler.set_epoch(epoch)` every epoch, every epoch has the same order
# (lesson 03).

# %% tags=["nbval-ignore-output"]
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
# 見ないので、ランクごとに違う統計で正規化します。全体のバッチで正規化した 1 プロセスの結果とは
# 一致しません。
#
# 評価で使う `running_mean` (バッファ) はどうなるでしょうか。DDP の既定 (`forward_sync_buffers=True`) では、
# **順伝播を始める前に**ランク 0 のバッファを全ランクにコピー (broadcast) し、そのあと各ランクが自分の
# バッチで更新します。そのため学習のあと、
# - ランク 0 の `running_mean` は、ランク 0 のデータだけの統計です。
# - ほかのランクの `running_mean` は、1 つ前の順伝播までのランク 0 の統計を、自分の最後のバッチで 1 回
#   更新したものです。
# - 次に DDP を通して順伝播すると (評価のときなど)、その前にまたランク 0 の値がコピーされるので、
#   **どのランクもランク 0 のデータだけの統計で評価します**。
#
# `forward_sync_buffers=False` にすると、このコピーはなくなり、各ランクの `running_mean` は自分のデータだけの
# 統計になります。ランクごとにデータの平均をずらして (並べ替えたデータを分けたときのように)、各ランクの
# `running_mean` の 1 つ目の値を並べます。

# %% [markdown] lang="en"
# ## BatchNorm statistics are per replica
#
# During training `BatchNorm` normalizes with the mean and variance of **the current
# batch**. Under DDP each rank sees only its own batch, so each normalizes with its own
# statistics, unlike one process normalizing the whole batch.
#
# What about the `running_mean` (a buffer) used for evaluation? By default
# (`forward_sync_buffers=True`) DDP copies (broadcasts) rank 0's buffers to all ranks
# **before every forward**, and then each rank updates them with its own batch. So after
# training
# - rank 0's `running_mean` holds statistics of rank 0's data only;
# - every other rank's holds rank 0's statistics up to the previous forward, updated
#   once with its own last batch;
# - the next forward through DDP (evaluation, for instance) first copies rank 0's again,
#   so **every rank evaluates with statistics of rank 0's data only**.
#
# With `forward_sync_buffers=False` there is no such copy, and every rank's
# `running_mean` holds statistics of its own data. Give each rank data with another mean
# (as when sorted data is split) and list the first value of each rank's `running_mean`.

# %%
# %%px
from labkit import batchnorm

bn = batchnorm.bn_experiment(rank, world_size)
seen = bn["running_mean0"]
print(f"rank {rank}: local mean {bn['local_mean']:+.2f}, "
      f"|output - whole-batch output| {bn['per_replica_vs_whole']:.2f}\n"
      f"  running_mean[0] with sync: after training {seen['trained']:+.3f}, "
      f"after an evaluation forward {seen['evaluated']:+.3f}; "
      f"without sync {seen['no_sync']:+.3f}\n"
      f"  BatchNorm on rank 0's data alone {bn['rank0_data_mean0']:+.3f}, "
      f"on this rank's data alone {bn['own_data_mean0']:+.3f}")
assert bn["per_replica_vs_whole"] > 0.1
# With sync, on every rank: rank 0's statistics, updated once with this rank's batch,
assert bn["trained_vs_rank0_then_own"] == 0.0
# and after one more forward through DDP, rank 0's data only (not the whole batch's).
assert bn["evaluated_vs_rank0_data"] == 0.0 and bn["evaluated_vs_whole"] > 0.1
if rank == 0:
    assert bn["trained_vs_own_data"] == 0.0  # rank 0: its own data only
else:
    assert bn["trained_vs_own_data"] > 0.1  # the others: not their own data
# Without sync, on every rank: its own data only, so the ranks differ.
assert bn["no_sync_vs_own_data"] == 0.0 and bn["running_spread_no_sync"] > 0.1

# %% [markdown] lang="ja"
# torch 2.13 は、それまでの引数 `broadcast_buffers` を非推奨にして `forward_sync_buffers` を加えました。
# ただし名前を変えただけではありません。DDP は作られるときにも、ランク 0 のパラメータとバッファを全ランクに
# コピーします (`init_sync=True`)。古い `broadcast_buffers=False` は、このときのバッファのコピーも止めます。
# 新しい `forward_sync_buffers=False` が止めるのは順伝播の前のコピーだけで、作るときのコピーは残ります。
# torch 自身も `broadcast_buffers` を渡すと `FutureWarning` でそう警告します。ランク r のバッファを r で
# 埋めてから DDP を作り、作った直後の値を見ます。(`labkit.batchnorm` のほかの関数は、インストールされた
# torch にある方の名前を使います。そこではどのランクも同じバッファから始めるので、この違いは結果を
# 変えません。)

# %% [markdown] lang="en"
# torch 2.13 deprecates the argument `broadcast_buffers` and adds `forward_sync_buffers`,
# but it is not a plain rename. DDP also copies rank 0's parameters and buffers to all
# ranks when it is built (`init_sync=True`). The old `broadcast_buffers=False` leaves the
# buffers out of that copy too; the new `forward_sync_buffers=False` stops only the copy
# before each forward, and buffers are still copied when DDP is built. torch itself says
# so in the `FutureWarning` it gives for `broadcast_buffers`. Fill rank r's buffer with
# r, build DDP, and look at the value right after. (`labkit.batchnorm`'s other functions
# use whichever name the installed torch has; there every rank starts from the same
# buffers, so the difference does not change their results.)

# %%
# %%px
built = batchnorm.buffers_after_construction(rank)
for name, b in built.items():
    print(f"rank {rank}: DDP(..., {name}) -> running_mean[0] = {b['running_mean0']:.0f}")
if rank == 0:
    print(*built["broadcast_buffers=False"]["warnings"], sep="\n")
assert built["broadcast_buffers=False"]["running_mean0"] == rank  # its own: no copy
if "forward_sync_buffers=False" in built:  # torch 2.13 and later
    assert built["forward_sync_buffers=False"]["running_mean0"] == 0  # rank 0's
    assert any("still syncs buffers at init" in w
               for w in built["broadcast_buffers=False"]["warnings"])

# %% [markdown] lang="ja"
# 全ランクのバッチで正規化するのが `nn.SyncBatchNorm` です (`convert_sync_batchnorm` で置き換えます)。
# ところが torch 2.13 の CPU では動きません。DDP は「SyncBatchNorm layers only work with GPU modules」
# と断り、層自身も GPU (または XPU など) の入力を求めます。

# %% [markdown] lang="en"
# Normalizing with all ranks' batches is what `nn.SyncBatchNorm` does (swap it in with
# `convert_sync_batchnorm`). But on the CPU in torch 2.13 it does not run: DDP refuses
# with "SyncBatchNorm layers only work with GPU modules", and the layer itself wants a
# GPU (or XPU, and so on) input.

# %%
# %%px
error = batchnorm.syncbn_error()
print(f"rank {rank}: {error}")
if not torch.cuda.is_available():
    assert "only work with GPU modules" in error

# %% [markdown] lang="ja"
# ## 演習: SyncBatchNorm の統計を手で計算する
#
# そこで、SyncBatchNorm が学習中に計算するものを、集団通信で直接書きます。`global_mean_var(x)` は、
# このランクのバッチ `x` (行がサンプル、列が特徴) を受け取り、**全ランク**のサンプルを合わせた、特徴ごとの
# 平均と分散を返す関数です。分散は、BatchNorm が正規化に使うのと同じく、サンプル数で割ったもの
# (サンプル数 − 1 ではなく) です。サンプル数はランクごとに違ってかまいません。全ランクが同時にこの関数を
# 呼ぶので、`dist.all_reduce` が使えます。
#
# 確認のセルは、この関数を両方のランクで実行します。ランク 0 には 3 サンプル、ランク 1 には平均の大きく
# 離れた 9 サンプルを渡し、1 プロセスで全 12 サンプルから計算した値と比べます。関数はランクのエンジンで
# 実行されるので、中で使う名前はエンジンにあるもの (上の `%%px` セルで import した `torch` と `dist`) です。

# %% [markdown] lang="en"
# ## Exercise: SyncBatchNorm's statistics by hand
#
# So write out with collectives what SyncBatchNorm computes in training.
# `global_mean_var(x)` gets this rank's batch `x` (one row per sample, one column per
# feature) and returns each feature's mean and variance over the samples of **all**
# ranks. The variance is the one BatchNorm normalizes with: divided by the number of
# samples (not that number minus 1). The ranks may hold different numbers of samples.
# Every rank calls the function at the same time, so it can use `dist.all_reduce`.
#
# The check runs the function on both ranks, with 3 samples on rank 0 and 9 samples with
# a mean far away on rank 1, and compares with one process computing over all 12. The
# function runs on the ranks' engines, so the names it uses are the engines' (`torch`
# and `dist`, imported there by a `%%px` cell above).

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
# labkit の `batchnorm.global_batch_norm` も同じ計算をします。こちらはサンプル数、和、二乗和を 1 つの
# テンソルにまとめて 1 回の all-reduce で足し合わせ (分散は「二乗の平均 − 平均の二乗」で求めます)、
# 全体の平均と分散で自分のバッチを正規化します。上の `bn_experiment` は、その結果を 1 プロセスで全体の
# バッチを正規化したものと比べていました。両者は一致します。GPU では `nn.SyncBatchNorm` がこの正規化を
# 行います。

# %% [markdown] lang="en"
# labkit's `batchnorm.global_batch_norm` computes the same with a single all-reduce: it
# stacks the count, the sum and the sum of squares into one tensor (the variance is then
# the mean of the squares minus the square of the mean), and normalizes the local batch
# with the global mean and variance. `bn_experiment` above compared its result with one
# process normalizing the whole batch: the two agree. On GPUs `nn.SyncBatchNorm` does
# this normalization.

# %%
# %%px
print(f"rank {rank}: |synchronized - whole batch| = {bn['synced_vs_whole']:.1e}")
assert bn["synced_vs_whole"] < 1e-5

# %% [markdown] lang="ja"
# ## 記事の `DistributedDataParallel(model, dim=1)`
#
# 記事 000 の「より複雑な例」は `dim=1` を渡しています。`dim` は、1 つのプロセスが複数の GPU に入力を
# 分けていた古い使い方のための引数です。1 プロセス 1 デバイスの DDP (いまの唯一の使い方) では、
# DDP は入力を分けません。各ランクは自分で用意したバッチをそのまま使うので、`dim` は何も変えません。

# %% [markdown] lang="en"
# ## The document's `DistributedDataParallel(model, dim=1)`
#
# Doc 000's "more complex example" passes `dim=1`. `dim` belongs to the old use where one
# process split its input over several GPUs. With one device per process (the only way
# DDP is used now) DDP does not split inputs: each rank uses the batch it prepared, so
# `dim` changes nothing.

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

# %% [markdown] lang="ja"
# ## ハードウェア
#
# 「より高速な GPU」と「TPU」は、同じ話ではありません。
#
# - **GPU** は予算と、デバイスの指定の話です。DDP のコードは、通信のバックエンドを `nccl` にし、各ランクが
#   自分の GPU を選び (`torch.cuda.set_device(local_rank)`)、モデルとバッチをそこへ送れば (`.to(device)`、
#   `DDP(model, device_ids=[local_rank])`) GPU で動きます。labkit のコマンドラインの実験
#   (`--backend nccl`、レッスン 00) がこれを行います。ノートブックのエンジンは、どのマシンでも gloo と
#   CPU のままです。`nccl` は NVIDIA の GPU のための通信ライブラリで、CUDA のテンソルだけを扱います。
# - **TPU** では `nccl` は使えません。PyTorch から TPU を使うには、別のパッケージ **PyTorch/XLA**
#   (`torch_xla`) が必要で、**コードを書き換えます**。
#   - テンソルとモデルは XLA デバイスに置きます (`torch_xla.core.xla_model.xla_device()`、新しい版では
#     `torch_xla.device()`)。
#   - 演算はその場では実行されず、グラフとして記録されます。ステップの区切りで
#     `xm.mark_step()` (新しい版では `torch_xla.sync()`) を呼ぶと、グラフが XLA でコンパイルされて
#     TPU で実行されます。
#   - データは `torch_xla.distributed.parallel_loader` のローダー (`MpDeviceLoader`) で TPU に送ります。
#     このローダーがバッチごとに区切りの呼び出しもします。
#   - 複数の TPU での DDP は、`torch_xla` が登録する `"xla"` バックエンドを使います
#     (`dist.init_process_group("xla", init_method="xla://")`)。プロセスの起動も `torch_xla` の
#     ランチャーで行います。
#
# 細かい名前は `torch_xla` の版で変わるので、使う版の文書 ([PyTorch/XLA](https://docs.pytorch.org/xla/)) で確かめてください。このマシンの torch で
# 確かめられるのは、torch 本体が `xla` というデバイスの種類を知っているだけで、その上で動く演算も
# `"xla"` バックエンドも持っていない (どちらも `torch_xla` が加える) ことです。このマシンで何が使えるかは
# `labkit doctor` が示します (レッスン 00)。

# %% [markdown] lang="en"
# ## Hardware
#
# "A faster GPU" and "a TPU" are not the same kind of change.
#
# - **A GPU** is a matter of budget and of naming the device. DDP code runs on GPUs
#   once the backend is `nccl`, each rank picks its GPU
#   (`torch.cuda.set_device(local_rank)`), and the model and batches go there
#   (`.to(device)`, `DDP(model, device_ids=[local_rank])`). labkit's command-line
#   experiments do this (`--backend nccl`, lesson 00); the notebooks' engines stay on
#   gloo and the CPU on every machine. `nccl` is NVIDIA's communication library for
#   GPUs; it takes CUDA tensors only.
# - **A TPU** does not use `nccl`. PyTorch on a TPU needs another package,
#   **PyTorch/XLA** (`torch_xla`), and **a change of code**:
#   - tensors and the model go to an XLA device (`torch_xla.core.xla_model.xla_device()`,
#     in recent versions `torch_xla.device()`);
#   - operations are not run at once but recorded as a graph; at the end of each step
#     `xm.mark_step()` (in recent versions `torch_xla.sync()`) has XLA compile the graph
#     and run it on the TPU;
#   - data goes to the TPU through `torch_xla.distributed.parallel_loader`'s loader
#     (`MpDeviceLoader`), which also makes that end-of-step call for every batch;
#   - DDP over several TPUs uses the `"xla"` backend that `torch_xla` registers
#     (`dist.init_process_group("xla", init_method="xla://")`), and processes are
#     started by `torch_xla`'s launcher.
#
# The exact names change between `torch_xla` versions: check the documentation of the
# one you use ([PyTorch/XLA](https://docs.pytorch.org/xla/)). What this machine's torch shows is that torch itself only knows the
# device type `xla`: it has no operators that run on it and no `"xla"` backend (both
# come with `torch_xla`). `labkit doctor` shows what this machine has (lesson 00).

# %%
import importlib.util

import torch.distributed as dist

print("torch.device('xla'):", torch.device("xla"))  # a device type torch knows
print("backend names torch knows:", dist.Backend.backend_list)
if importlib.util.find_spec("torch_xla") is None:
    assert "xla" not in dist.Backend.backend_list  # torch_xla registers it
    with checks.expect_error(NotImplementedError, match="'XLA' backend"):
        torch.zeros(1, device="xla")  # no operator runs on it without torch_xla
    print(labkit.t("no_torch_xla"))
else:
    print("torch_xla is installed")

# %% tags=["nbval-ignore-output"]
from labkit import doctor

machine = doctor.collect()
print(doctor.format_report(machine))
assert machine.cpu_cores >= 1

# %% [markdown] lang="ja"
# ## まとめ
#
# | 記事 000 の方法 | このマシンで確かめたこと |
# |---|---|
# | ワーカー数を増やす | 読み込みが重いときに効く。読み込みどうし、読み込みと学習が重なり、1 エポックが短くなる。データは変わらない |
# | (`persistent_workers`) | ワーカーをエポックをまたいで使い回す。起動が重い環境で効く |
# | ピンメモリーを使う | CPU→GPU の転送を速く、非同期にする。GPU がなければ何もしない |
# | バッチサイズを増やす | 1 秒あたりのサンプル数は増える。収束には学習率の調整 (比例させる) とウォームアップが必要 |
# | データシャッフルを有効にする | 速さは変わらない。収束のために必要 (並べ替えたままだと悪くなる) |
# | 軽量なモデル、精度と速度のバランス | パラメータが少ないほど 1 ステップの計算 (FLOP) が少ない (時間はこの実行で短くなった)。小さすぎると精度が落ちる |
# | 不要な計算を削減する | 評価は `torch.no_grad()` で。活性値を保存しない |
# | 学習率、オプティマイザ、スケジューラ | 1 ステップは速くならない。少ないステップで収束させる。課題ごとに調整する |
# | チェックポイントを活用する | 状態の保存は再開のため (再開しても結果は 1 ビットも同じ)。活性化チェックポイントはメモリを減らし、1 ステップの計算が順伝播 1 回分増える |
# | より高速な GPU、TPU | GPU は予算とデバイスの指定 (`nccl`、`.to(device)`)。TPU は `torch_xla` を使うコードの書き換え |
# | Apex | 古い。`torch.autocast` と `torch.amp.GradScaler` を使う |
# | DDP と一緒に | `DistributedSampler` と `set_epoch`。BatchNorm はレプリカごと。SyncBatchNorm は GPU のみ |

# %% [markdown] lang="en"
# ## Summary
#
# | doc 000's method | what this machine showed |
# |---|---|
# | more workers | helps when loading is slow: batches load side by side and beside training, and an epoch gets shorter; the data does not change |
# | (`persistent_workers`) | keeps workers across epochs; helps where starting them is slow |
# | pinned memory | makes CPU→GPU copies faster and asynchronous; without a GPU it does nothing |
# | larger batches | more samples per second; convergence needs the learning rate scaled, and warm-up |
# | enable shuffling | no change in speed; needed for convergence (sorted data converges worse) |
# | lighter model, accuracy vs speed | fewer parameters, less compute per step (FLOPs; and less time on this run); too small and accuracy suffers |
# | remove unneeded computation | evaluate under `torch.no_grad()`: no activations kept |
# | learning rate, optimizer, scheduler | a step is no faster; converge in fewer steps; tune per task |
# | use checkpoints | saving state is for resuming (bit-identical results); activation checkpointing saves memory and computes one more forward per step |
# | a faster GPU, a TPU | a GPU is budget and naming the device (`nccl`, `.to(device)`); a TPU is a change of code, to `torch_xla` |
# | Apex | outdated: use `torch.autocast` and `torch.amp.GradScaler` |
# | with DDP | `DistributedSampler` and `set_epoch`; BatchNorm is per replica; SyncBatchNorm needs GPUs |
