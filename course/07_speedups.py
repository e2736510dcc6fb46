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
# # 07 その他の高速化: 読み込み、精度、メモリ
#
# 記事 000 は最後に「訓練速度を向上させる他の方法」を並べています。ワーカー数を増やす、バッチサイズを増やす、
# データシャッフル、ピンメモリー、軽量なモデル、不要な計算の削減、学習率やオプティマイザやスケジューラ、
# チェックポイント、より速い GPU や TPU、Apex と Horovod です。この一覧には、1 ステップを速くするもの、
# メモリを減らす代わりに計算を増やすもの、GPU がないと何もしないもの、すでに古いものが混ざっています。
# このレッスンでは、1 ステップや 1 エポックの時間とメモリを変えるものを、セルで一つずつ確かめます。
# 学習の進み方を変えるものはレッスン 08、Horovod はレッスン 09 で扱います。
# 時間はこの実行での値です。共有された CPU のばらつきで差が見えないところでは、セルは計算の量
# (呼び出しの回数や FLOP) を確かめます。
#
# このレッスンを終えると、次のことができます。
#
# - DataLoader のワーカー数、`persistent_workers`、`pin_memory` がどんなときに効くかを判断し、
#   ワーカーを増やしてもバッチの中身が変わらないことを確かめられる。
# - 記事の Apex の代わりに `torch.autocast` と `torch.amp.GradScaler` を使い、出力、重み、勾配の型を確かめられる。
# - 活性化チェックポイントで減るメモリと増える計算を数えられる。
# - 活性値を保存せず、BatchNorm の統計も変えない評価を書ける。
# - DDP のコードを GPU や TPU に移すときに何が変わるかを説明できる。

# %% [markdown] lang="en" tags=["outcomes"]
# # 07 Other speed-ups: loading, precision, memory
#
# Doc 000 ends with a list of "other ways to speed up training": more loader
# workers, larger batches, shuffling, pinned memory, a lighter model, less
# computation, the learning rate, optimizer and scheduler, checkpoints, a faster GPU
# or a TPU, Apex and Horovod. The list mixes things that make a step faster, one that
# trades compute for memory, one that does nothing without a GPU, and one that is
# outdated. This lesson checks, a cell at a time, those that change the time or the
# memory of a step or an epoch; those that change how training progresses are lesson
# 08, and Horovod is lesson 09. Times are this run's; where a shared CPU's scatter
# hides a difference, the cells assert the compute (calls, FLOPs) instead.
#
# After this lesson you can:
#
# - tell when more DataLoader workers, `persistent_workers` or `pin_memory` help,
#   and check that more workers leave the batches unchanged;
# - use `torch.autocast` and `torch.amp.GradScaler` where the document says Apex, and
#   check the dtypes of outputs, weights and gradients;
# - count what activation checkpointing saves in memory and costs in compute;
# - write an evaluation that keeps no activations and changes no BatchNorm
#   statistics;
# - say what moving DDP code to a GPU or to a TPU changes.

# %%
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %%
import torch

from labkit import activations, checks, loading, models, plots, precision, selfcheck

torch.manual_seed(0)

# %% [markdown] lang="ja"
# ## DataLoader のワーカー数
#
# `num_workers=0` では、メインプロセスがバッチを読み込んでから学習ステップを実行し、これを交互に繰り返します。
# `num_workers=k` では k 個のワーカープロセスが次のバッチを用意し、その間にメインプロセスは学習を進めます。
# 効果があるのは、1 サンプルを作るのに時間がかかる (ディスクから読む、画像をデコードする、データ拡張をする)
# 場合です。
#
# `loading.SlowDataset` は 1 サンプルに 2 ミリ秒かかるデータセットです (ディスクを待つときのように、CPU を使わずに待ちます)。
# 1 エポックは 256 サンプル (バッチ 32 が 8 個) で、読み込みだけで 1 プロセスなら 0.5 秒かかります。
# 学習ステップは軽い MLP (幅 512) なので、時間の大半は読み込みです。ワーカー 0 と 2 のローダーで、
# 1 エポックの時間を比べます。

# %% [markdown] lang="en"
# ## DataLoader workers
#
# With `num_workers=0` the main process loads a batch, then runs the training step, then
# loads the next: the two take turns. With `num_workers=k`, k worker processes prepare the
# next batches while the main process trains. That helps when a sample takes time to
# produce (reading from disk, decoding an image, augmentation).
#
# `loading.SlowDataset` takes 2 ms per sample, waiting as for a disk, without using
# the CPU. An epoch is 256 samples (8 batches of 32): loading alone takes 0.5 s in one process. The training
# step is a light MLP (width 512), so loading is most of the time. Compare the time
# of an epoch with loaders of 0 and 2 workers.

# %% [markdown] lang="ja"
# <details><summary>測り方の詳細</summary>
#
# 2 つのローダーで 1 エポックずつ交互に、5 回ずつ回し、1 エポックの時間の中央値を比べます。交互に回すのは、
# 共有されたマシンの負荷の変化が両方に同じようにかかるようにするためです。ワーカーは最初の慣らしのエポックで
# 起動し、そのあとは使い続けるので (`persistent_workers`)、測るのは起動ではなく読み込みと学習の時間です。
# `SlowDataset` は `sleep` で待つので、ワーカーが学習と CPU を取り合うことはありません。確認のセルは、
# 比が 0.9 より小さいことだけを確かめます。負荷の高いときにもこの余裕は保たれました。
#
# </details>

# %% [markdown] lang="en"
# <details><summary>How this was measured</summary>
#
# The two loaders take turns, one epoch each, 5 rounds, and their median epoch times
# are compared: taking turns puts the shared machine's changing load on both alike.
# The workers start in a warm-up epoch and are kept after that
# (`persistent_workers`), so the times are of loading and training, not of starting
# processes. `SlowDataset` waits with `sleep`, so its workers do not compete with
# training for the CPU. The check asserts only a ratio below 0.9, a margin that held
# under load.
#
# </details>

# %%
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
print(f"on this run, 2 workers took {ratio:.2f} of the time per epoch of 0 workers")
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

# %%
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
# GPU がなければ、何もしません。torch は警告を出し、バッチは固定メモリに置かれません。

# %% [markdown] lang="en"
# ## `pin_memory`
#
# With `pin_memory=True` the DataLoader puts batches in **page-locked (pinned) memory**,
# which the OS never swaps out. Copies to a GPU from pinned memory go straight by DMA,
# and `X.to("cuda", non_blocking=True)` lets the copy overlap with computation. So it
# helps **only when data goes from the CPU to a GPU**.
#
# Without a GPU it does nothing: torch warns, and the batch is not pinned.

# %%
report = loading.pin_memory_report(fast)
print(report)
if not report["accelerator"]:
    print(labkit.t("pin_memory_cpu_note", pinned=report["pinned"]))
    assert report["pinned"] is False
    assert any("no accelerator" in w for w in report["warnings"])

# %% [markdown] lang="ja"
# GPU があれば、固定メモリからの転送とふつうのメモリからの転送を比べます (GPU がなければ何もしません)。

# %% [markdown] lang="en"
# With a GPU, compare a copy from pinned memory with one from ordinary memory (without a
# GPU this cell does nothing).

# %%
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
# 記事 004 のモデルで測ります (値はこの実行のものです)。大きなバッチで学習も速く進むかどうかは、
# レッスン 08 の最初の問いです。

# %% [markdown] lang="en"
# ## Batch size and throughput
#
# A larger batch shares the fixed cost of a step (Python, kernel launches, the optimizer)
# among more samples, so more samples are processed per second, up to a plateau and the
# memory limit. Measure it with doc 004's model (the values are this run's). Whether
# a larger batch also learns faster is the first question of lesson 08.

# %%
from labkit import throughput, training

per_s = throughput.samples_per_s([8, 32, 128, 512, 2048])
for b, v in per_s.items():
    print(f"batch {b:5d}: {v:10.0f} samples/s")
fig = plots.line_chart({"doc 004 MLP": (list(per_s), list(per_s.values()))},
                       xlabel="batch_size", ylabel="samples_per_s",
                       title="throughput_by_batch", logx=True, logy=True)
assert per_s[512] > 4 * per_s[8]  # 64 times the batch: far more samples per second

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
# かえって遅くなることもあります。1 ステップの時間はこの実行での値です。

# %% [markdown] lang="en"
# Train 60 steps from the same initial weights in float32 and with bfloat16 autocast. The
# loss curves nearly coincide. Speed depends on the CPU: without bfloat16 matrix
# instructions (AMX, AVX512-BF16) the conversions can even make it slower. The step
# times are this run's.

# %%
from dataclasses import replace

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
# パラメータが少ないモデルは、1 ステップの計算量が少なく、そのぶん時間も短くなります。その代わり、表せる関数が
# 限られ、精度が下がることがあります (記事の「精度と速度のバランス」)。幅を変えた 1 層の MLP で、
# パラメータ数、1 ステップの計算量 (浮動小数点演算の回数、FLOP)、1 ステップの時間 (バッチ 1024)、
# 300 ステップ後の検証損失 (Adam) を並べます。
#
# **予想してから実行:** 幅 1024 の重みは幅 16 の 64 倍です。1 ステップの計算は何倍になり、時間も同じだけ
# 長くなるでしょうか?

# %% [markdown] lang="en"
# ## A lighter model
#
# A model with fewer parameters computes less per step and takes less time per step. In
# exchange it can represent fewer functions and may be less accurate (the document's
# "balance accuracy and speed"). For one-layer MLPs of several widths, list the
# parameter count, the work per step (floating-point operations, FLOPs), the time per
# step (batch 1024) and the held-out loss after 300 steps (Adam).
#
# **Predict, then run:** width 1024 has 64 times the weights of width 16. How many
# times the FLOPs does its step compute, and does it take that many times as long?

# %% [markdown] lang="ja"
# <details><summary>測り方の詳細</summary>
#
# FLOP は torch の `FlopCounterMode` が数えた、1 回の順伝播と逆伝播の行列積の演算数です。時間は、幅ごとに
# 5 ステップずつ交互に 5 回測った中央値です。時間の比は共有された CPU では実行ごとに大きく変わるので、
# 確認のセルは時間の比を計算の比 (64 倍) とだけ比べます。
#
# </details>

# %% [markdown] lang="en"
# <details><summary>How this was measured</summary>
#
# The FLOPs are torch's `FlopCounterMode` count of the matrix products of one
# forward and backward. The time is the median of 5 rounds in which the widths take
# turns, 5 steps each. On a shared CPU the ratio of times changes a lot from run to
# run, so the cell compares it only with the ratio of the compute (64 times).
#
# </details>

# %%
sizes = {}
for width in (16, 64, 256, 1024):
    run = training.fit(training.TrainConfig(steps=300, hidden=width, optimizer="adam", lr=0.003,
                                eval_every=100))
    work = activations.step_work(models.WideMLP(hidden=width), torch.randn(1024, 10))
    sizes[width] = {"params": run["params"], "flops": work["flops"],
                    "loss": run["heldout_loss"][-1]}
step_s = throughput.step_times(list(sizes), batch_size=1024, rounds=5, steps=5)
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
# Fixed costs: 64 times the compute takes far less than 64 times the time.
assert sizes[1024]["step_s"] < 64 * sizes[16]["step_s"]

# %% [markdown] lang="ja"
# 幅 1024 の 1 ステップは、幅 16 の 64 倍の計算をします。それでも時間は 64 倍よりずっと短く済みます
# (この実行での比は上の出力のとおりです)。小さなモデルの 1 ステップは、計算よりも Python やカーネルの起動
# などの固定のコストで決まるからです。

# %% [markdown] lang="en"
# A step of width 1024 computes 64 times as much as one of width 16, yet it takes far
# less than 64 times as long (this run's ratio is printed above): a small model's step
# is set by fixed costs (Python, kernel launches) more than by its arithmetic.

# %% [markdown] lang="ja"
# 「不要な計算の削減」の代表は、評価のときに勾配を計算しないことです。
#
# **予想してから実行:** 同じ順伝播を `torch.no_grad()` の中で実行すると、逆伝播のための活性値は何バイト
# 保存されるでしょうか?

# %% [markdown] lang="en"
# The classic "unneeded computation" is gradients during evaluation.
#
# **Predict, then run:** how many bytes of activations does the same forward keep for
# a backward pass inside `torch.no_grad()`?

# %%
wide = models.WideMLP(hidden=1024, depth=2)
X_eval = torch.randn(512, 10)
kept_bytes = activations.saved_activation_bytes(wide, X_eval)
with torch.no_grad():
    kept_no_grad = activations.saved_activation_bytes(wide, X_eval)
print(f"training forward keeps {kept_bytes / 1e6:.1f} MB; under no_grad {kept_no_grad} B")
assert kept_bytes > 0 and kept_no_grad == 0

# %% [markdown] lang="ja"
# ## 演習: 何も変えず、何も保存しない評価
#
# 関数 `evaluate(model, X, y)` を書いてください。`model` の `(X, y)` での損失 (`models.MyLoss()`、
# 平均二乗誤差) を Python の float で返します。評価が学習に影響を与えてはいけません。
#
# - 逆伝播のための活性値を保存しません (上の `torch.no_grad()`)。
# - BatchNorm の統計 (`running_mean` など) を変えず、Dropout も働かせません。この 2 つの層は、学習モードと
#   評価モードで動きが違います。
#
# 演習のセルの 1 行は、どちらも守っていません。確認のセルは、BatchNorm と Dropout を含むモデルで関数を呼び、
# 保存された活性値、BatchNorm の `running_mean`、損失の値を確かめます。

# %% [markdown] lang="en"
# ## Exercise: an evaluation that changes nothing and keeps nothing
#
# Write `evaluate(model, X, y)`, which returns the loss of `model` on `(X, y)`
# (`models.MyLoss()`, the mean squared error) as a Python float. An evaluation must not
# get in training's way:
#
# - it keeps no activations for a backward pass (`torch.no_grad()` above);
# - it changes no BatchNorm statistics (`running_mean` and so on) and turns Dropout off:
#   those two layers behave differently in training and in evaluation mode.
#
# The exercise cell's one line does neither. The check calls your function on a model
# with BatchNorm and Dropout and checks the activations saved, BatchNorm's
# `running_mean`, and the loss.

# %% tags=["exercise"]
def evaluate(model, X, y):
    """The loss of `model` on (X, y), as a float: nothing kept, nothing changed."""
    return models.MyLoss()(model(X), y).item()  # TODO: keeps activations, trains BatchNorm

# %% tags=["solution"]
def evaluate(model, X, y):
    """The loss of `model` on (X, y), as a float: nothing kept, nothing changed."""
    model.eval()  # BatchNorm uses its running statistics, Dropout does nothing
    with torch.no_grad():  # no activations kept for a backward pass
        return models.MyLoss()(model(X), y).item()

# %%
from labkit import exercises

exercises.grade_evaluation(evaluate)

# %% [markdown] lang="ja"
# ## 活性化チェックポイント
#
# 記事の「チェックポイントを活用する」は 2 通りに読めます。学習状態をファイルに保存して再開することは
# レッスン 08 で扱います。ここで扱うのは、`torch.utils.checkpoint` の**活性化チェックポイント**です。
# 順伝播で逆伝播用の活性値を保存する代わりに、区間 (セグメント) の入力だけを残し、逆伝播のときにその区間の
# 順伝播をもう一度計算します。
# **メモリを減らす代わりに計算が増えます**。大きなモデルやバッチをメモリに収めるための技術で、
# 速くするためのものではありません。
#
# 12 層の MLP (幅 256、バッチ 2048) を 4 区間に分けて、チェックポイントなしの同じモデルと比べます。
# 保存された活性値とピークメモリ、1 ステップで実行された `Linear` の順伝播の回数と FLOP、1 ステップの時間を
# 並べます。
#
# **予想してから実行:** チェックポイントを使うと、1 ステップで `Linear` の順伝播は何回実行されるでしょうか
# (12 回、16 回、24 回のどれ?)。予想を `guess` に書いてから実行してください。

# %% [markdown] lang="en"
# ## Activation checkpointing
#
# The document's "use checkpoints" can mean two things. Saving the training state to a
# file and resuming from it is in lesson 08. This section is about **activation
# checkpointing** with `torch.utils.checkpoint`. Instead of keeping activations for the
# backward pass, it keeps only each segment's input and runs that segment's forward
# again during backward: **less memory for more compute**. It fits larger models and
# batches in memory; it does not speed anything up.
#
# Compare a 12-layer MLP (width 256, batch 2048) split into 4 checkpointed segments
# with the same model without checkpointing: the activations kept and the peak memory, the
# `Linear` forwards run and the FLOPs of one step, and the time of a step.
#
# **Predict, then run:** with checkpointing, how many `Linear` forwards does one step
# run: 12, 16 or 24? Write your guess in `guess`, then run the cell.

# %% [markdown] lang="ja"
# <details><summary>測り方の詳細</summary>
#
# - 保存された活性値: `torch.autograd.graph.saved_tensors_hooks` で逆伝播のために保存されたテンソルを
#   集め、そのバイト数を足したもの (パラメータは除く)。
# - ピークメモリ: CPU では `torch.profiler` の `profile_memory=True` で、各演算の確保と解放を時間順に
#   足し合わせた最大値 (GPU では `torch.cuda.max_memory_allocated`)。
# - `Linear` の順伝播の回数はフォワードフックで、FLOP は `FlopCounterMode` で数えます。
# - 時間は、2 つのモデルで 1 ステップずつ交互に 5 回測った中央値です。時間の比は共有された CPU では
#   実行ごとに大きく変わるので、確認のセルは時間ではなく計算の量を確かめます。
#
# </details>

# %% [markdown] lang="en"
# <details><summary>How this was measured</summary>
#
# - Saved activations: `torch.autograd.graph.saved_tensors_hooks` collects the
#   tensors saved for backward, and their bytes are added up (parameters excluded).
# - Peak memory: on the CPU, `torch.profiler` with `profile_memory=True`, every
#   operator's allocations and frees summed in time order, and the maximum kept (on a
#   GPU, `torch.cuda.max_memory_allocated`).
# - The `Linear` forwards are counted by forward hooks, the FLOPs by
#   `FlopCounterMode`.
# - The time is the median of 5 rounds in which the two models take turns, one step
#   each. On a shared CPU the ratio of times changes a lot from run to run, so the
#   cell asserts the compute, not the time.
#
# </details>

# %%
guess = None  # your prediction: Linear forwards in one checkpointed step
X_deep = torch.randn(2048, 256)
deep, cost, work = {}, {}, {}
for checkpointed in (False, True):
    torch.manual_seed(0)  # the same weights in both models
    deep[checkpointed] = activations.DeepMLP(segments=4, checkpointed=checkpointed)
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
fig = plots.bar_chart(
    {labkit.t("saved_mb"): {labels[k]: c["saved_bytes"] / 1e6 for k, c in cost.items()},
     labkit.t("peak_mb"): {labels[k]: c["peak_bytes"] / 1e6 for k, c in cost.items()}},
    ylabel="saved_mb", title="ckpt_title", fmt="{:.1f}")
assert [len(step_s[k]) for k in (False, True)] == [5, 5]  # every round timed, drawn
fig = plots.rounds({labkit.t("measured"): (list(labels.values()),
                                           [[t * 1e3 for t in step_s[k]] for k in labels])},
                   xlabel="", ylabel="step_time_ms", title="ckpt_time_title")
selfcheck.predicted(guess, work[True]["linear_forwards"])

# %%
assert cost[True]["saved_bytes"] < 0.5 * cost[False]["saved_bytes"]
assert cost[True]["peak_bytes"] < cost[False]["peak_bytes"]
checks.grads_match(grads[True], grads[False], tol=0.0)  # the same gradients, exactly
# Every Linear's forward runs twice: once in the forward, once again in backward.
assert (work[False]["linear_forwards"], work[True]["linear_forwards"]) == (12, 24)
one_forward = 2 * len(X_deep) * sum(  # a Linear's forward: 2 FLOPs per weight and sample
    m.weight.numel() for m in deep[False].modules() if isinstance(m, torch.nn.Linear))
assert work[True]["flops"] - work[False]["flops"] == one_forward
X_small = torch.randn(64, 256)
for segments in (2, 6):  # however the layers are grouped: twice, one input a segment
    other = activations.DeepMLP(segments=segments, checkpointed=True)
    assert activations.step_work(other, X_small)["linear_forwards"] == 24
    assert activations.saved_activation_bytes(other, X_small) == segments * X_small.nbytes

# %% [markdown] lang="ja"
# 保存される活性値は 13 個 (各 `Linear` の入力と最後の出力) から 4 個 (各区間の入力) に減ります。勾配は
# 1 ビットも変わりません。代わりに各 `Linear` の順伝播が 2 回実行され、1 ステップの計算は順伝播 1 回分
# ちょうど増えます (ここでは 9.4 から 12.6 GFLOP へ、約 3 割増し)。確認のセルが確かめるのはこの計算の量です。
# 時間の図には、測った 5 回すべてと中央値を描いています。

# %% [markdown] lang="en"
# The saved activations drop from 13 tensors (every `Linear`'s input and the last
# output) to 4 (each segment's input). The gradients do not change by a single bit.
# In exchange every `Linear`'s forward runs twice, and a step computes exactly one
# forward pass more (here 12.6 GFLOP instead of 9.4, about a third more). The cell
# asserts this compute; the time figure shows all 5 timed rounds and their median.

# %% [markdown] lang="ja"
# ## 演習: 保存される活性値を数える
#
# 上の `DeepMLP` が逆伝播のために保存する活性値のバイト数を返す関数
# `saved_bytes(batch, width, depth, segments, checkpointed)` を書いてください。`batch` はバッチサイズ、
# `width` は幅、`depth` は `Linear` と `ReLU` の組の数、`segments` は区間の数、`checkpointed` は
# チェックポイントを使うかどうかです。
#
# - `Linear` は重みの勾配のために入力を保存し、`ReLU` はどこが正だったかを知るために出力を保存します。
# - 2 つの層が同じテンソルを保存しても、メモリは 1 つ分です。
# - 活性値の形は (batch, width) で、float32 (値 1 つが 4 バイト) です。パラメータは数えません。
#
# 確認のセルは、いくつかの形の `DeepMLP` を作り、`activations.saved_activation_bytes` で測った値と比べます。

# %% [markdown] lang="en"
# ## Exercise: count the activations kept
#
# Write `saved_bytes(batch, width, depth, segments, checkpointed)`, which returns the
# bytes of activations `DeepMLP` above keeps for the backward pass. `batch` is the batch
# size, `width` the width, `depth` the number of `Linear` + `ReLU` pairs, `segments` the
# number of segments, and `checkpointed` whether checkpointing is on.
#
# - A `Linear` keeps its input, for the weight's gradient; a `ReLU` keeps its output, to
#   know where it was positive.
# - A tensor that two layers keep takes memory once.
# - Activations have the shape (batch, width) and are float32 (4 bytes a value).
#   Parameters do not count.
#
# The check builds `DeepMLP`s of several shapes and compares with the bytes
# `activations.saved_activation_bytes` measures.

# %% tags=["exercise"]
def saved_bytes(batch, width, depth, segments, checkpointed):
    """Bytes of activations DeepMLP keeps for backward (float32, no parameters)."""
    return None  # TODO: how many (batch, width) tensors are kept, times their bytes

# %% tags=["solution"]
def saved_bytes(batch, width, depth, segments, checkpointed):
    """Bytes of activations DeepMLP keeps for backward (float32, no parameters)."""
    one = batch * width * 4  # one (batch, width) activation in float32
    if checkpointed:
        return segments * one  # each segment's input, nothing inside a segment
    return (depth + 1) * one  # X, then each ReLU's output (the next Linear's input)

# %%
exercises.grade_saved_activations(saved_bytes)

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
# 細かい名前は `torch_xla` の版で変わるので、使う版のドキュメント ([PyTorch/XLA](https://docs.pytorch.org/xla/)) で確かめてください。インストールされている torch で
# 確かめられるのは、torch 本体が `xla` というデバイスの種類を知っているだけで、その上で動く演算も
# `"xla"` バックエンドも持っていない (どちらも `torch_xla` が加える) ことです。マシンで使えるものの一覧は
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
# one you use ([PyTorch/XLA](https://docs.pytorch.org/xla/)). What the installed torch shows is that torch itself only knows the
# device type `xla`: it has no operators that run on it and no `"xla"` backend (both
# come with `torch_xla`). `labkit doctor` lists what a machine has (lesson 00).

# %%
import importlib.util

import torch.distributed as dist

from labkit import doctor  # registers the message below

print("torch.device('xla'):", torch.device("xla"))  # a device type torch knows
print("backend names torch knows:", dist.Backend.backend_list)
if importlib.util.find_spec("torch_xla") is None:
    assert "xla" not in dist.Backend.backend_list  # torch_xla registers it
    with checks.expect_error(NotImplementedError, match="'XLA' backend"):
        torch.zeros(1, device="xla")  # no operator runs on it without torch_xla
    print(labkit.t("no_torch_xla"))
else:
    print("torch_xla is installed")

# %%
from labkit import doctor

machine = doctor.collect()
print(doctor.format_report(machine))
assert machine.cpu_cores >= 1

# %% [markdown] lang="ja"
# ## 記事 000 の一覧を確かめた結果
#
# | 記事 000 の方法 | セルで確かめたこと |
# |---|---|
# | ワーカー数を増やす | 読み込みが重いときに効く。読み込みどうし、読み込みと学習が重なり、1 エポックが短くなる。データは変わらない |
# | (`persistent_workers`) | ワーカーをエポックをまたいで使い回す。起動が重い環境で効く |
# | ピンメモリーを使う | CPU→GPU の転送を速く、非同期にする。GPU がなければ何もしない |
# | バッチサイズを増やす | 1 秒あたりのサンプル数は増える (収束のために何が必要かはレッスン 08) |
# | 軽量なモデル、精度と速度のバランス | パラメータが少ないほど 1 ステップの計算 (FLOP) が少なく、時間は計算ほどには減らない。小さすぎると精度が落ちる |
# | 不要な計算を削減する | 評価は `model.eval()` と `torch.no_grad()` で。活性値を保存しない |
# | チェックポイントを活用する (活性化チェックポイント) | メモリを減らし、1 ステップの計算が順伝播 1 回分増える。学習状態の保存はレッスン 08 |
# | より高速な GPU、TPU | GPU は予算とデバイスの指定 (`nccl`、`.to(device)`)。TPU は `torch_xla` を使うようにコードの書き換えが必要 |
# | Apex | 古い。`torch.autocast` と `torch.amp.GradScaler` を使う |

# %% [markdown] lang="en"
# ## Doc 000's list, checked
#
# | doc 000's method | what the cells showed |
# |---|---|
# | more workers | helps when loading is slow: batches load side by side and beside training, and an epoch gets shorter; the data does not change |
# | (`persistent_workers`) | keeps workers across epochs; helps where starting them is slow |
# | pinned memory | makes CPU→GPU copies faster and asynchronous; without a GPU it does nothing |
# | larger batches | more samples per second (what convergence then needs: lesson 08) |
# | lighter model, accuracy vs speed | fewer parameters, less compute per step (FLOPs), and the time falls less than the compute; too small and accuracy suffers |
# | remove unneeded computation | evaluate in `model.eval()` under `torch.no_grad()`: no activations kept |
# | use checkpoints (activation checkpointing) | saves memory and computes one more forward per step; saving the training state is in lesson 08 |
# | a faster GPU, a TPU | a GPU is budget and naming the device (`nccl`, `.to(device)`); a TPU is a change of code, to `torch_xla` |
# | Apex | outdated: use `torch.autocast` and `torch.amp.GradScaler` |

# %% [markdown] lang="ja" tags=["summary"]
# ## 覚えておくこと
#
# - **DataLoader のワーカーは読み込みを学習と重ねます**。1 サンプルを作るのが遅いときに 1 エポックが短くなり、
#   届くバッチは変わりません。
# - **`pin_memory` が効くのは GPU へ送るときだけ**で、GPU がなければ何もしません。
# - **Apex の代わりは `torch.autocast` (float16 なら `GradScaler` も)** で、行列積を低い精度で計算し、重みと
#   勾配は float32 のまま保ちます。
# - **活性化チェックポイントはメモリと計算の交換です**。区間の入力だけを残し、どの順伝播ももう 1 回実行し、
#   勾配は 1 ビットも変わりません。
# - **評価は `model.eval()` と `torch.no_grad()` の中で**行い、活性値を保存せず、BatchNorm の統計も変えません。

# %% [markdown] lang="en" tags=["summary"]
# ## What to remember
#
# - **DataLoader workers overlap loading with training**: when a sample is slow to
#   produce, an epoch gets shorter, and the batches stay the same.
# - **`pin_memory` matters only for copies to a GPU**; without one it does nothing.
# - **Apex's successor is `torch.autocast` (with `GradScaler` for float16)**: matrix
#   products run in low precision while the weights and gradients stay float32.
# - **Activation checkpointing trades compute for memory**: it keeps only each
#   segment's input, runs every forward once more, and leaves the gradients bit for
#   bit the same.
# - **Evaluate in `model.eval()` under `torch.no_grad()`**: nothing kept for
#   backward, no BatchNorm statistics changed.

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

selfcheck.show("07_speedups")

# %% tags=["self-check"]
# Your answers, "a", "b", "c" or "d" for each question; then run this cell.
my_answers = {1: None, 2: None, 3: None}
selfcheck.check("07_speedups", my_answers)
