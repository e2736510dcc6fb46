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
# 記事 000 が最後に並べる「訓練速度を向上させる他の方法」には、1 ステップを速くするもの、メモリを減らす
# 代わりに計算を増やすもの、GPU がないと何もしないもの、古いものが混ざっています。ここでは時間とメモリを
# 変えるものを、セルで一つずつ確かめます (学習の進み方はレッスン 08、Horovod はレッスン 09)。時間の差が
# ばらつきで見えないところでは、セルは計算の量を確かめます。
#
# このレッスンを終えると、次のことができます。
#
# - DataLoader のワーカー数、`persistent_workers`、`pin_memory` がどんなときに効くかを判断できる。
# - 記事の Apex の代わりに `torch.autocast` と `torch.amp.GradScaler` を使える。
# - 活性化チェックポイントで減るメモリと増える計算を数えられる。
# - 活性値を保存せず、BatchNorm の統計も変えない評価を書ける。
# - DDP のコードを GPU や TPU に移すときに何が変わるかを説明できる。

# %% [markdown] lang="en" tags=["outcomes"]
# # 07 Other speed-ups: loading, precision, memory
#
# Doc 000's closing list of "other ways to speed up training" mixes things that make a
# step faster, one that trades compute for memory, one that does nothing without a
# GPU, and one that is outdated. This lesson checks, a cell at a time, those that
# change time or memory (how training progresses is lesson 08, Horovod lesson 09).
# Where the scatter of times hides a difference, the cells assert the compute instead.
#
# After this lesson you can:
#
# - tell when more DataLoader workers, `persistent_workers` or `pin_memory` help;
# - use `torch.autocast` and `torch.amp.GradScaler` where the document says Apex;
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
# `num_workers=0` では、メインプロセスがバッチを読み込んでから学習し、これを交互に繰り返します。
# `num_workers=k` では k 個のワーカープロセスが次のバッチを用意し、その間にメインプロセスが学習します。
# 効くのは、1 サンプルを作るのに時間がかかる (ディスク、画像のデコード、データ拡張) 場合です。
#
# `loading.SlowDataset` は、ディスクを待つように 1 サンプルに 2 ミリ秒かかります (1 エポックで 0.5 秒)。
# ワーカー 0 と 2 で、軽い MLP の 1 エポックの時間を比べます。

# %% [markdown] lang="en"
# ## DataLoader workers
#
# With `num_workers=0` the main process loads a batch, then trains on it, then loads
# the next. With `num_workers=k`, k worker processes prepare the next batches while the
# main process trains. That helps when a sample is slow to produce (disk, decoding,
# augmentation).
#
# `loading.SlowDataset` takes 2 ms per sample, waiting as for a disk (0.5 s an epoch).
# Compare an epoch of a light MLP with 0 and 2 workers.

# %% [markdown] lang="ja"
# <details><summary>測り方</summary>
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

# %% tags=["hide-input"]
median_s = {k: statistics.median(v) for k, v in epoch_s.items()}
for k, v in epoch_s.items():
    print(f"num_workers={k}: median {median_s[k]:.2f} s per epoch "
          f"(each round: {', '.join(f'{t:.2f}' for t in v)})")
fig = plots.bar_chart({labkit.t("num_workers"): {str(k): v for k, v in median_s.items()}},
                      ylabel="epoch_time_s", title="epoch_time_by_workers",
                      fmt="{:.2f} s")
ratio = median_s[2] / median_s[0]
print(f"on this run, 2 workers took {ratio:.2f} of the time per epoch of 0 workers")
assert ratio < 0.9

# %% [markdown] lang="ja"
# 1 エポックは短くなりますが、「読み込みと学習の遅いほう」より短くはなりません。CPU で重いデータ拡張なら、
# ワーカーは学習とコアを取り合うので、コア数より多くしても速くなりません。ワーカーの数が変えるのは速さ
# だけで、同じバッチが同じ順序で届きます。

# %% [markdown] lang="en"
# An epoch gets shorter, but never shorter than whichever of loading and training is
# slower. For CPU-heavy augmentation the workers compete with training for cores, and
# more workers than cores do not help. The number of workers changes the speed, not the
# data: the same batches arrive in the same order.

# %% tags=["hide-input"]
from torch.utils.data import DataLoader

fast = loading.SlowDataset(n=64, cost_s=0)
batches = {k: [X for X, _ in DataLoader(fast, batch_size=16, num_workers=k)]
           for k in (0, 2)}
assert all(torch.equal(a, b) for a, b in zip(batches[0], batches[2], strict=True))
print("num_workers=0 and 2 give identical batches")

# %% [markdown] lang="ja"
# ## `persistent_workers`
#
# ふつうはエポックごとにワーカーを起動し直します。`persistent_workers=True` では同じワーカーが次の
# エポックでも使われ、起動が重い場合 (macOS や Windows の `spawn`、大きなデータセットのコピー) に効きます。
# 各バッチを作ったプロセスの ID で確かめます。

# %% [markdown] lang="en"
# ## `persistent_workers`
#
# Normally the workers start again at every epoch. With `persistent_workers=True` the
# same workers serve the next epoch too, which matters when starting one is expensive
# (`spawn` on macOS and Windows, copying a large data set). Check with the process ids
# that made each batch.

# %% tags=["hide-input"]
kept = loading.worker_pids(num_workers=2, persistent_workers=True, epochs=3)
fresh = loading.worker_pids(num_workers=2, persistent_workers=False, epochs=3)
print("persistent_workers=True: ", kept)
print("persistent_workers=False:", fresh)
assert kept[0] == kept[1] == kept[2] and len(kept[0]) == 2  # the same two workers
assert fresh[0].isdisjoint(fresh[1]) and fresh[1].isdisjoint(fresh[2])  # new ones

# %% [markdown] lang="ja"
# 各エポックの最初のバッチが届くまでの時間です。使い回すと、2 エポック目からは起動の分だけ早く届きます
# (Linux の `fork` では差は小さめです)。

# %% [markdown] lang="en"
# The time until each epoch's first batch arrives: with workers kept, from the second
# epoch on it comes sooner by the start-up time (small on Linux, where `fork` is cheap).

# %% tags=["hide-input"]
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
# `pin_memory=True` にすると、DataLoader はバッチを**ページ固定メモリ** (OS がスワップしないメモリ) に
# 置きます。そこからの GPU への転送は DMA で直接行え、`X.to("cuda", non_blocking=True)` で計算と重ねられます。
# 効くのは **CPU から GPU へ送るときだけ**で、GPU がなければ torch は警告を出し、何もしません。

# %% [markdown] lang="en"
# ## `pin_memory`
#
# With `pin_memory=True` the DataLoader puts batches in **page-locked (pinned) memory**,
# which the OS never swaps out. Copies from it to a GPU go straight by DMA, and
# `X.to("cuda", non_blocking=True)` overlaps them with computation. So it helps **only
# when data goes from the CPU to a GPU**; without one torch warns and does nothing.

# %% tags=["hide-input"]
report = loading.pin_memory_report(fast)
print(report)
if not report["accelerator"]:
    print(labkit.t("pin_memory_cpu_note", pinned=report["pinned"]))
    assert report["pinned"] is False
    assert any("no accelerator" in w for w in report["warnings"])

# %% [markdown] lang="ja"
# GPU があれば、固定メモリとふつうのメモリからの転送を比べます。

# %% [markdown] lang="en"
# With a GPU, compare a copy from pinned memory with one from ordinary memory.

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
# バッチを大きくすると、1 ステップの固定のコスト (Python、カーネルの起動、オプティマイザ) を多くの
# サンプルで分け合うので、1 秒あたりのサンプル数は増えます (頭打ちになり、メモリにも上限があります)。
# 大きなバッチで学習も速く進むかどうかは、レッスン 08 の問いです。

# %% [markdown] lang="en"
# ## Batch size and throughput
#
# A larger batch shares the fixed cost of a step (Python, kernel launches, the optimizer)
# among more samples, so more samples are processed per second, up to a plateau and the
# memory limit. Whether it also learns faster is lesson 08's question.

# %%
from labkit import throughput, training

per_s = throughput.samples_per_s([8, 32, 128, 512, 2048])  # doc 004's model

# %% tags=["hide-input"]
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
# float32 のまま保ちます。GPU の Tensor Core で速くなり、活性値のメモリも半分になります。記事の「Apex」の
# `amp` は、PyTorch 本体の `torch.autocast` と `torch.amp.GradScaler` に置き換わりました。CPU では
# bfloat16 を使い、`autocast` の中の `Linear` の出力は bfloat16、重みと勾配は float32 です。

# %% [markdown] lang="en"
# ## Mixed precision (`torch.autocast`)
#
# Mixed precision runs only some operations, such as matrix products, in a lower
# precision (float16 or bfloat16) and keeps the weights and the optimizer in float32. On
# GPUs it is faster thanks to Tensor Cores, and activations take half the memory. The
# document's "Apex" `amp` was replaced by PyTorch's own `torch.autocast` and
# `torch.amp.GradScaler`. On a CPU, use bfloat16: inside `autocast` a `Linear` outputs
# bfloat16, while the weights and gradients stay float32.

# %% tags=["hide-input"]
dtypes = precision.autocast_dtypes(models.MLP(), torch.randn(8, 10))
print(dtypes)
assert dtypes == {"output": torch.bfloat16, "weight": torch.float32,
                  "grad": torch.float32}

# %% [markdown] lang="ja"
# 同じ初期値から、float32 と bfloat16 autocast で 60 ステップ学習させます。学習曲線はほぼ重なります。
# 速さは CPU しだいで、bfloat16 の行列演算命令 (AMX など) がなければ、かえって遅くなることもあります。

# %% [markdown] lang="en"
# Train 60 steps from the same initial weights in float32 and with bfloat16 autocast. The
# loss curves nearly coincide. Speed depends on the CPU: without bfloat16 matrix
# instructions (AMX and the like) the conversions can even make it slower.

# %%
from dataclasses import replace

run = training.TrainConfig(steps=60, hidden=512, depth=2, batch_size=256, n=4096, optimizer="momentum")
prec = {p: training.fit(replace(run, precision=p)) for p in training.PRECISIONS}

# %% tags=["hide-input"]
for p, r in prec.items():
    print(f"{p}: final loss {r['losses'][-1]:.4f}, median step {r['median_step_s'] * 1e3:.1f} ms")
fig = plots.loss_curves({p: r["losses"] for p, r in prec.items()},
                        title="precision_title", logy=True)
fig = plots.bar_chart({"MLP 512x2": {p: r["median_step_s"] * 1e3 for p, r in prec.items()}},
                      ylabel="step_time_ms", title="precision_time_title", fmt="{:.1f} ms")
f32, bf16 = prec["float32"]["losses"], prec["bfloat16"]["losses"]
assert abs(bf16[-1] - f32[-1]) < 0.05 * f32[-1]  # the same training, within 5 %
assert f32[-1] < 0.2 * f32[0]  # and it learns

# %% [markdown] lang="ja"
# GPU では float16 を使い、`torch.amp.GradScaler("cuda")` で損失をスケールします。float16 は範囲が狭く、
# 小さな勾配が 0 に丸められるからです。スケーラーは逆伝播の前に損失を大きくし、`step` の前に勾配を戻し、
# オーバーフローしたステップは飛ばします。CUDA がなければ、このセルは何もしません。

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
# 古い書き方 `torch.cuda.amp.autocast()` と `torch.cuda.amp.GradScaler()` は非推奨で、torch 自身が
# `FutureWarning` で `torch.amp` を案内します。

# %% [markdown] lang="en"
# The older `torch.cuda.amp.autocast()` and `torch.cuda.amp.GradScaler()` are
# deprecated: torch's own `FutureWarning` points to `torch.amp`.

# %% tags=["hide-input"]
amp_warnings = precision.cuda_amp_warnings()
print(*amp_warnings, sep="\n")
assert any(w.startswith("FutureWarning") and "torch.amp.GradScaler('cuda'" in w
           for w in amp_warnings)
assert any(w.startswith("FutureWarning") and "torch.amp.autocast('cuda'" in w
           for w in amp_warnings)

# %% [markdown] lang="ja"
# ## 軽いモデル
#
# パラメータが少ないモデルは 1 ステップの計算が少なく、時間も短くなりますが、精度が下がることがあります
# (記事の「精度と速度のバランス」)。幅を変えた 1 層の MLP で、計算量 (FLOP)、時間、検証損失を並べます。
#
# **予想してから実行:** 幅 1024 の重みは幅 16 の 64 倍です。1 ステップの計算は何倍になり、時間も同じだけ
# 長くなるでしょうか?

# %% [markdown] lang="en"
# ## A lighter model
#
# A model with fewer parameters computes less and takes less time per step, but may be
# less accurate (the document's "balance accuracy and speed"). For one-layer MLPs of
# several widths, compare the work per step (FLOPs), the time and the held-out loss.
#
# **Predict, then run:** width 1024 has 64 times the weights of width 16. How many
# times the FLOPs does its step compute, and does it take that many times as long?

# %% [markdown] lang="ja"
# <details><summary>測り方</summary>
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

# %% tags=["hide-input"]
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
assert [s["params"] for s in sizes.values()] == [models.count_params(
    models.WideMLP(hidden=w)) for w in sizes]
flops = [s["flops"] for s in sizes.values()]
assert flops == sorted(flops) and flops[-1] == 64 * flops[0]  # 64 times the width
assert sizes[16]["loss"] > sizes[1024]["loss"]  # the smallest model fits worse
# Fixed costs: 64 times the compute takes far less than 64 times the time.
assert sizes[1024]["step_s"] < 64 * sizes[16]["step_s"]

# %% [markdown] lang="ja"
# 幅 1024 は幅 16 の 64 倍の計算をしますが、時間は 64 倍よりずっと短く済みます。小さなモデルの
# 1 ステップは、計算よりも固定のコスト (Python やカーネルの起動) で決まるからです。

# %% [markdown] lang="en"
# Width 1024 computes 64 times as much as width 16, yet takes far less than 64 times
# as long: a small model's step is set by fixed costs (Python, kernel launches) more
# than by its arithmetic.

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
# 関数 `evaluate(model, X, y)` を書いてください。`model` の `(X, y)` での損失 (`models.MyLoss()`) を
# Python の float で返し、学習に影響を与えてはいけません。
#
# - 逆伝播のための活性値を保存しません (上の `torch.no_grad()`)。
# - BatchNorm の統計 (`running_mean` など) を変えず、Dropout も働かせません (この 2 つの層は、学習モードと
#   評価モードで動きが違います)。
#
# 演習のセルの 1 行は、どちらも守っていません。確認のセルは、BatchNorm と Dropout を含むモデルで確かめます。

# %% [markdown] lang="en"
# ## Exercise: an evaluation that changes nothing and keeps nothing
#
# Write `evaluate(model, X, y)`, which returns the loss of `model` on `(X, y)`
# (`models.MyLoss()`) as a Python float, without getting in training's way:
#
# - it keeps no activations for a backward pass (`torch.no_grad()` above);
# - it changes no BatchNorm statistics (`running_mean` and so on) and turns Dropout off
#   (those two layers behave differently in training and in evaluation mode).
#
# The exercise cell's one line does neither. The check tries a model with BatchNorm and
# Dropout.

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
# 記事の「チェックポイントを活用する」のうち、学習状態の保存はレッスン 08 で扱います。ここで扱うのは
# `torch.utils.checkpoint` の**活性化チェックポイント**です。逆伝播用の活性値の代わりに区間 (セグメント) の
# 入力だけを残し、逆伝播のときにその区間の順伝播をもう一度計算します。**メモリを減らす代わりに計算が
# 増えます** (大きなモデルやバッチをメモリに収めるためで、速くはなりません)。
#
# 12 層の MLP (幅 256) を 4 区間に分け、チェックポイントなしの同じモデルと比べます。
#
# **予想してから実行:** チェックポイントを使うと、1 ステップで `Linear` の順伝播は何回実行されるでしょうか
# (12 回、16 回、24 回のどれ?)。予想を `guess` に書いてから実行してください。

# %% [markdown] lang="en"
# ## Activation checkpointing
#
# Of the document's "use checkpoints", saving the training state is lesson 08's. This
# section is about **activation checkpointing** with `torch.utils.checkpoint`: instead
# of the activations for backward it keeps only each segment's input, and runs that
# segment's forward again during backward: **less memory for more compute** (to fit
# larger models and batches, not to go faster).
#
# Compare a 12-layer MLP (width 256) split into 4 checkpointed segments with the same
# model without checkpointing.
#
# **Predict, then run:** with checkpointing, how many `Linear` forwards does one step
# run: 12, 16 or 24? Write your guess in `guess`, then run the cell.

# %% [markdown] lang="ja"
# <details><summary>測り方</summary>
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

# %% tags=["hide-input"]
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

# %% tags=["hide-input"]
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
# 保存される活性値は 13 個 (各 `Linear` の入力と最後の出力) から 4 個 (各区間の入力) に減り、勾配は
# 1 ビットも変わりません。代わりに各 `Linear` の順伝播が 2 回実行され、1 ステップの計算は順伝播 1 回分
# ちょうど増えます (9.4 から 12.6 GFLOP へ)。

# %% [markdown] lang="en"
# The saved activations drop from 13 tensors (every `Linear`'s input and the last
# output) to 4 (each segment's input), and the gradients do not change by a single
# bit. In exchange every `Linear`'s forward runs twice: a step computes exactly one
# forward pass more (12.6 GFLOP instead of 9.4).

# %% [markdown] lang="ja"
# ## 演習: 保存される活性値を数える
#
# 上の `DeepMLP` が逆伝播のために保存する活性値のバイト数を返す関数
# `saved_bytes(batch, width, depth, segments, checkpointed)` を書いてください (`depth` は `Linear` と
# `ReLU` の組の数、`segments` は区間の数)。
#
# - `Linear` は重みの勾配のために入力を保存し、`ReLU` はどこが正だったかを知るために出力を保存します。
# - 2 つの層が同じテンソルを保存しても、メモリは 1 つ分です。
# - 活性値の形は (batch, width) で、float32 (値 1 つが 4 バイト) です。パラメータは数えません。
#
# 確認のセルは、いくつかの形の `DeepMLP` で測った値と比べます。

# %% [markdown] lang="en"
# ## Exercise: count the activations kept
#
# Write `saved_bytes(batch, width, depth, segments, checkpointed)`, which returns the
# bytes of activations `DeepMLP` above keeps for the backward pass (`depth` is the
# number of `Linear` + `ReLU` pairs, `segments` the number of segments).
#
# - A `Linear` keeps its input, for the weight's gradient; a `ReLU` keeps its output, to
#   know where it was positive.
# - A tensor that two layers keep takes memory once.
# - Activations have the shape (batch, width) and are float32 (4 bytes a value).
#   Parameters do not count.
#
# The check compares with the bytes measured on `DeepMLP`s of several shapes.

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
# - **GPU** は予算とデバイスの指定の話です。バックエンドを `nccl` (NVIDIA の GPU のための通信ライブラリ)
#   にし、各ランクが自分の GPU を選び (`torch.cuda.set_device(local_rank)`)、モデルとバッチをそこへ送れば
#   (`.to(device)`、`DDP(model, device_ids=[local_rank])`)、DDP のコードは GPU で動きます
#   (labkit のコマンドラインの `--backend nccl`、レッスン 00)。
# - **TPU** では、別のパッケージ **PyTorch/XLA** (`torch_xla`) を使い、**コードを書き換えます**。
#   テンソルとモデルを XLA デバイスに置き、演算はグラフとして記録されて、ステップの区切りで XLA が
#   コンパイルして実行します。データは `torch_xla` のローダー (`MpDeviceLoader`) で送り、複数の TPU の
#   DDP は `torch_xla` が登録する `"xla"` バックエンドを使います。
#
# 下のセルは、torch 本体が `xla` というデバイスの種類を知っているだけで、その上で動く演算も `"xla"`
# バックエンドも持たない (どちらも `torch_xla` が加える) ことを確かめます。
#
# <details><summary>測り方</summary>
#
# 名前は `torch_xla` の版で変わります。XLA デバイスは `torch_xla.core.xla_model.xla_device()` (新しい版では
# `torch_xla.device()`)、ステップの区切りは `xm.mark_step()` (新しい版では `torch_xla.sync()`)、ローダーは
# `torch_xla.distributed.parallel_loader` の `MpDeviceLoader` (区切りの呼び出しもします)、バックエンドは
# `dist.init_process_group("xla", init_method="xla://")` で、プロセスは `torch_xla` のランチャーで起動します。
# 使う版のドキュメント ([PyTorch/XLA](https://docs.pytorch.org/xla/)) で確かめてください。
#
# </details>

# %% [markdown] lang="en"
# ## Hardware
#
# "A faster GPU" and "a TPU" are not the same kind of change.
#
# - **A GPU** is a matter of budget and of naming the device. DDP code runs on GPUs
#   once the backend is `nccl` (NVIDIA's communication library), each rank picks its
#   GPU (`torch.cuda.set_device(local_rank)`), and the model and batches go there
#   (`.to(device)`, `DDP(model, device_ids=[local_rank])`), as labkit's command line
#   does with `--backend nccl` (lesson 00).
# - **A TPU** needs another package, **PyTorch/XLA** (`torch_xla`), and **a change of
#   code**: tensors and the model go to an XLA device; operations are recorded as a
#   graph that XLA compiles and runs at the end of each step; data goes through
#   `torch_xla`'s loader (`MpDeviceLoader`); DDP over several TPUs uses the `"xla"`
#   backend that `torch_xla` registers.
#
# The cell below shows that torch itself only knows the device type `xla`: no operators
# run on it and there is no `"xla"` backend (both come with `torch_xla`).
#
# <details><summary>How this was measured</summary>
#
# The names change between `torch_xla` versions: the XLA device is
# `torch_xla.core.xla_model.xla_device()` (recently `torch_xla.device()`), the end of a
# step `xm.mark_step()` (recently `torch_xla.sync()`), the loader `MpDeviceLoader` from
# `torch_xla.distributed.parallel_loader` (it also makes that end-of-step call), the
# backend `dist.init_process_group("xla", init_method="xla://")`, and processes start
# with `torch_xla`'s launcher. Check the documentation of the version you use
# ([PyTorch/XLA](https://docs.pytorch.org/xla/)).
#
# </details>

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

# %% tags=["hide-input"]
from labkit import doctor

machine = doctor.collect()
print(doctor.format_report(machine))
assert machine.cpu_cores >= 1

# %% [markdown] lang="ja"
# ## 記事 000 の一覧を確かめた結果
#
# | 記事 000 の方法 | セルで確かめたこと |
# |---|---|
# | ワーカー数を増やす | 読み込みが重いときに、1 エポックが短くなる。データは変わらない |
# | (`persistent_workers`) | ワーカーを使い回す。起動が重い環境で効く |
# | ピンメモリーを使う | CPU→GPU の転送だけに効く |
# | バッチサイズを増やす | 1 秒あたりのサンプル数が増える (収束はレッスン 08) |
# | 軽量なモデル | 計算は減るが、時間は計算ほど減らない。小さすぎると精度が落ちる |
# | 不要な計算を削減する | 評価は `model.eval()` と `torch.no_grad()` で |
# | チェックポイント (活性化) | メモリが減り、計算が順伝播 1 回分増える |
# | より高速な GPU、TPU | GPU はデバイスの指定。TPU は `torch_xla` への書き換え |
# | Apex | 古い。`torch.autocast` と `torch.amp.GradScaler` を使う |

# %% [markdown] lang="en"
# ## Doc 000's list, checked
#
# | doc 000's method | what the cells showed |
# |---|---|
# | more workers | an epoch gets shorter when loading is slow; the data does not change |
# | (`persistent_workers`) | keeps workers; helps where starting them is slow |
# | pinned memory | helps only CPU→GPU copies |
# | larger batches | more samples per second (convergence: lesson 08) |
# | lighter model | less compute, but the time falls less; too small and accuracy suffers |
# | remove unneeded computation | evaluate in `model.eval()` under `torch.no_grad()` |
# | checkpoints (activation) | less memory, one more forward per step |
# | a faster GPU, a TPU | a GPU is naming the device; a TPU is a change of code, to `torch_xla` |
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
