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
# # 02 DataParallel とその仲間
#
# `nn.DataParallel` (クラス) と `torch.nn.parallel.data_parallel()` (関数) は、**1 つのプロセス**の中で
# バッチを複数の GPU に分け、モデルのレプリカをスレッドで同時に動かします。中身はどちらも同じ 4 段階です。
#
# 1. `scatter`: バッチをデバイスの数に分ける
# 2. `replicate`: モデルをデバイスごとに複製する (レプリカ)
# 3. `parallel_apply`: 各レプリカを自分の分のデータでスレッドごとに実行する
# 4. `gather`: 出力を 1 つのデバイス (出力デバイス) に集めてつなぐ
#
# GPU のないマシンでは、PyTorch のこれらの関数は動きません。そこで `labkit.data_parallel` が同じ 4 段階を
# CPU で忠実に再現します。`device_ids=[0, 1]` は 2 台の**模擬デバイス**を表し、テンソルはすべて CPU に
# ありますが、分割、複製、スレッド、勾配の流れ方は PyTorch の実装と同じです。CUDA があり、モデルが GPU に
# あるときは、PyTorch 自身の `data_parallel` をそのまま呼びます。
#
# このレッスンで見ること:
# 1. CPU では `nn.DataParallel` は何もしないこと
# 2. 4 段階を 1 つずつ、各段階のテンソルの形を見ながら
# 3. 出力と勾配が 1 デバイスのモデルと一致すること
# 4. 記事 004 の使い方の誤りと、その直し方
# 5. スレッドの DataParallel とプロセスの DDP の時間、PyTorch が DDP を勧める理由

# %% [markdown] lang="en"
# # 02 The DataParallel family
#
# `nn.DataParallel` (a class) and `torch.nn.parallel.data_parallel()` (a function) split a
# batch over several GPUs **inside one process** and run replicas of the model at the
# same time in threads. Both do the same four steps:
#
# 1. `scatter`: split the batch into one chunk per device
# 2. `replicate`: copy the model once per device (the replicas)
# 3. `parallel_apply`: run each replica on its chunk, one thread each
# 4. `gather`: bring the outputs to one device (the output device) and join them
#
# On a machine without a GPU, PyTorch's versions of these functions do not run. So
# `labkit.data_parallel` runs the same four steps faithfully on the CPU: `device_ids=[0, 1]`
# names two **simulated devices**. Every tensor stays on the CPU, but the splitting, the
# copying, the threads and the way gradients flow are those of PyTorch's implementation.
# With CUDA and a model on a GPU it calls PyTorch's own `data_parallel`.
#
# In this lesson:
# 1. on a CPU, `nn.DataParallel` does nothing
# 2. the four steps one by one, with the tensors' shapes at each
# 3. outputs and gradients equal those of the model on one device
# 4. what doc 004 gets wrong about using them, and the fix
# 5. thread-based DataParallel against process-based DDP, and why PyTorch recommends DDP

# %% lang="ja"
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %% lang="en"
import labkit

labkit.require("0.1.0")
labkit.set_lang("en")

# %%
from labkit import cluster

ranks = cluster.start(2, background=True)  # needed at the end; boots meanwhile

# %%
import copy
import inspect
import os
import threading

import torch
from torch import nn

from labkit import checks, exercises, models, plots
from labkit import data_parallel as dp

torch.manual_seed(0)
X, y = torch.randn(100, 10), torch.randn(100, 10)  # doc 004's batch of 100
model = models.MLP()  # doc 004's model, corrected (lesson 01)
reference = copy.deepcopy(model)  # the same weights, run on one device
criterion = models.MyLoss()
print("CUDA:", torch.cuda.is_available(), "| torch's own data_parallel:", dp.uses_cuda(model))
assert not dp.uses_cuda(model)  # the model is on the CPU: the simulation runs
if torch.cuda.is_available():
    assert dp.uses_cuda(copy.deepcopy(model).cuda())  # on a GPU: torch's own

# %% [markdown] lang="ja"
# ## CPU では `nn.DataParallel` は何もしない
#
# GPU がないと、`nn.DataParallel` は使えるデバイスを見つけられず、`device_ids` が空のまま作られます。
# 呼び出すと、分割も複製もせずにモデルを 1 回呼ぶだけです。エラーも警告も出ません。
# 順伝播フックで、モデルが何回呼ばれたかを数えます。

# %% [markdown] lang="en"
# ## On a CPU, `nn.DataParallel` does nothing
#
# Without a GPU, `nn.DataParallel` finds no device and is built with an empty
# `device_ids`. Called, it splits nothing and copies nothing: it calls the model once.
# No error, no warning. A forward hook counts how often the model runs.

# %%
wrapped = nn.DataParallel(model)
print("device_ids:", wrapped.device_ids)
if not torch.cuda.is_available():  # with GPUs it needs the model on cuda:0 first
    calls = []
    hook = model.register_forward_hook(
        lambda module, args, out: calls.append(len(args[0])))
    out = wrapped(X)
    hook.remove()
    print("model calls (batch size):", calls)
    assert wrapped.device_ids == [] and wrapped.module is model
    assert calls == [100] and torch.equal(out, model(X))  # one plain call

# %% [markdown] lang="ja"
# PyTorch の関数版 `data_parallel()` も、その部品の 4 つの関数も、CPU では動きません。

# %% [markdown] lang="en"
# PyTorch's function `data_parallel()` and its four parts do not run on a CPU either.

# %%
if not torch.cuda.is_available():
    with checks.expect_error(RuntimeError, match="device type could not be determined"):
        torch.nn.parallel.data_parallel(model, X, device_ids=[0, 1])
    with checks.expect_error(AssertionError, match="not implemented for CPU tensors"):
        torch.nn.parallel.replicate(model, [0, 1])
    with checks.expect_error(AssertionError, match="not implemented for CPU tensors"):
        torch.nn.parallel.gather([X, X], 0)
    # The other two fail too; how depends on the build (CPU only, or CUDA).
    with checks.expect_error((AttributeError, RuntimeError, ValueError)):
        torch.nn.parallel.scatter(X, [0, 1])
    with checks.expect_error((AssertionError, RuntimeError)):
        torch.nn.parallel.parallel_apply([model, model], [X, X])

# %% [markdown] lang="ja"
# ## 1. `scatter`: バッチを分ける
#
# `scatter` はバッチを `dim` (既定は 0、バッチの次元) に沿ってデバイスの数に分け、各デバイスへコピーします。
# 100 サンプルを 2 台に分けると 50 ずつです。つなぎ直すと元のバッチに戻ります。

# %% [markdown] lang="en"
# ## 1. `scatter`: split the batch
#
# `scatter` splits the batch along `dim` (0 by default, the batch dimension) into one
# chunk per device and copies each chunk to its device. 100 samples on 2 devices are 50
# each; joined again they are the original batch.

# %%
device_ids = [0, 1]
chunks = dp.scatter(X, device_ids)
print("X:", tuple(X.shape))
for d, chunk in zip(device_ids, chunks, strict=True):
    print(f"  device {d}: {tuple(chunk.shape)}")
assert [len(c) for c in chunks] == [50, 50]
assert torch.equal(torch.cat(chunks), X)
assert chunks[0].data_ptr() != X.data_ptr()  # each device gets its own copy

# %% [markdown] lang="ja"
# 割り切れないときは `Tensor.chunk` と同じ分け方になります (PyTorch の `scatter` も `chunk` を使います)。
# 1 つの塊の大きさは「バッチ ÷ デバイス数」の切り上げなので、最後の塊だけ小さくなり、
# 塊の数がデバイスより**少なくなる**こともあります。5 サンプルを 4 台に分けると 2, 2, 1 の 3 つで、
# 4 台目は使われません。バッチがデバイス数より小さければ、使うデバイスはバッチの大きさだけです。

# %% [markdown] lang="en"
# When the batch does not divide evenly, the split is that of `Tensor.chunk` (PyTorch's
# `scatter` uses `chunk` too). Each chunk holds the batch divided by the number of
# devices, rounded up, so only the last one is smaller, and there can be **fewer** chunks
# than devices: 5 samples on 4 devices give 2, 2, 1, three chunks, and the fourth
# device gets nothing. A batch smaller than the number of devices uses only as many
# devices as it has samples.

# %%
splits = {}
for batch, n in [(100, 3), (10, 4), (5, 4), (3, 4)]:
    sizes = [len(c) for c in dp.scatter(torch.randn(batch, 10), list(range(n)))]
    splits[batch, n] = sizes
    print(f"batch {batch:3d} on {n} devices -> {sizes}")
    assert sizes == [len(c) for c in torch.randn(batch, 10).chunk(n)]
assert splits[100, 3] == [34, 34, 32] and splits[10, 4] == [3, 3, 3, 1]
assert splits[5, 4] == [2, 2, 1] and splits[3, 4] == [1, 1, 1]

# %% [markdown] lang="ja"
# ## 演習: 分け方を予想する
#
# 上の規則を使って、次の 3 つのバッチを `scatter` がどう分けるかを予想し、塊の大きさのリストで書いて
# ください。たとえばバッチ 5 を 4 台なら `[2, 2, 1]` です。確かめるために実行する前に、まず予想します。
#
# 演習のセルを書き換えて実行してから、確認のセルを実行します。正しければ「正解です」と表示され、
# 違っていれば、何が違うかとヒントが表示されます。完全版のノートブックでは演習のすぐあとに解答のセルが
# ありますが、まず自分で解いてみてください。

# %% [markdown] lang="en"
# ## Exercise: predict the split
#
# Using the rule above, predict how `scatter` splits the three batches below, and write
# each as the list of chunk sizes: batch 5 on 4 devices, for instance, is `[2, 2, 1]`.
# Predict first, before running anything to find out.
#
# Edit and run the exercise cell, then run the check cell. It says "Correct" when the
# answer is right, and otherwise what is wrong, with a hint. In the full notebooks a
# solution cell follows each exercise: try on your own first.

# %% tags=["exercise"]
predicted = {  # (batch, devices): chunk sizes
    (7, 3): None,
    (6, 4): None,
    (2, 4): None,
}

# %% tags=["solution"]
predicted = {
    (7, 3): [3, 3, 1],  # ceil(7 / 3) = 3 per chunk
    (6, 4): [2, 2, 2],  # ceil(6 / 4) = 2: three chunks, the fourth device idles
    (2, 4): [1, 1],  # fewer samples than devices
}

# %%
exercises.check_chunk_sizes(predicted)

# %% [markdown] lang="ja"
# 引数が複数あっても、キーワード引数でも、タプルや辞書の中でも、テンソルはすべて同じように分けられます。
# テンソルでないもの (文字列や数) は分けられず、同じものが全デバイスに渡されます。

# %% [markdown] lang="en"
# Several arguments, keyword arguments, tensors inside tuples or dicts: every tensor is
# split the same way. Anything that is not a tensor (a string, a number) cannot be split,
# and every device gets the same object.

# %%
args, kwargs = dp.scatter_kwargs((X, "mean"), {"target": y, "scale": 0.5}, device_ids)
for d, a, k in zip(device_ids, args, kwargs, strict=True):
    print(f"device {d}: args ({tuple(a[0].shape)}, {a[1]!r}), "
          f"kwargs {{target: {tuple(k['target'].shape)}, scale: {k['scale']}}}")
assert [len(a[0]) for a in args] == [len(k["target"]) for k in kwargs] == [50, 50]
assert args[0][1] is args[1][1] == "mean" and kwargs[1]["scale"] == 0.5

# %% [markdown] lang="ja"
# ## 2. `replicate`: モデルを複製する
#
# `replicate` はモデル**全体**をデバイスごとに複製します。記事 004 は手動の手順で「モデルを複数の GPU に
# 分割します」と書いていますが、データ並列で分けるのはデータで、モデルは丸ごと複製します
# (モデルそのものを分けるのはモデル並列や FSDP です)。
#
# - デバイス 0 にはもとのモデルがあるので、レプリカ 0 はもとのパラメータと**同じメモリ**を使います。
# - ほかのレプリカはコピーです (GPU なら、デバイス 0 からの転送です)。
# - レプリカの重みは葉テンソルではなく、もとのパラメータから計算されたテンソルです。このため、逆伝播で
#   各レプリカの勾配はもとのモデルの `.grad` に流れ込みます。

# %% [markdown] lang="en"
# ## 2. `replicate`: copy the model
#
# `replicate` copies the **whole** model once per device. Doc 004's manual recipe says
# "split the model across the GPUs", but data parallelism splits the data and copies the
# whole model (splitting the model itself is model parallelism, or FSDP).
#
# - Device 0 already holds the model, so replica 0 uses the **same memory** as the
#   original parameters.
# - The other replicas are copies (on GPUs, transfers from device 0).
# - A replica's weights are not leaf tensors but tensors computed from the original
#   parameters, so in the backward pass every replica's gradient flows into the original
#   model's `.grad`.

# %%
def weights(m):
    """The four weight tensors of doc 004's MLP (replicas hold them as attributes)."""
    return [m.fc1.weight, m.fc1.bias, m.fc2.weight, m.fc2.bias]


replicas = dp.replicate(model, device_ids)
for d, r in zip(device_ids, replicas, strict=True):
    shares = r.fc1.weight.data_ptr() == model.fc1.weight.data_ptr()
    print(f"device {d}: fc1.weight {tuple(r.fc1.weight.shape)}, "
          f"{sum(w.numel() for w in weights(r))} values, shares memory: {shares}")
assert all(sum(w.numel() for w in weights(r)) == 2110 for r in replicas)  # the whole model
assert replicas[0].fc1.weight.data_ptr() == model.fc1.weight.data_ptr()
assert replicas[1].fc1.weight.data_ptr() != model.fc1.weight.data_ptr()
for r in replicas:  # the same values everywhere
    assert all(map(torch.equal, weights(r), weights(model)))
assert not replicas[1].fc1.weight.is_leaf and replicas[1].fc1.weight.requires_grad

# %% [markdown] lang="ja"
# ## 3. `parallel_apply`: レプリカをスレッドで動かす
#
# `parallel_apply` はレプリカごとにスレッドを 1 つ立て、レプリカ i に塊 i を入力します。
# フックで、順伝播がどのスレッドとプロセスで実行されたかを記録します:
# 2 つの順伝播は**同じプロセス**の**別々のスレッド**で動きます。

# %% [markdown] lang="en"
# ## 3. `parallel_apply`: run the replicas in threads
#
# `parallel_apply` starts one thread per replica and feeds chunk i to replica i. A hook
# records the thread and the process of each forward pass: the two forward passes run in
# **separate threads** of the **same process**.

# %%
seen = []
hook = model.register_forward_hook(  # replicas share the original's hooks
    lambda module, args, out: seen.append((threading.current_thread().name, os.getpid())))
outputs = dp.parallel_apply(replicas, chunks, devices=device_ids)
hook.remove()
for d, o in zip(device_ids, outputs, strict=True):
    print(f"device {d}: output {tuple(o.shape)}")
print("ran in:", sorted(seen))
assert [o.shape for o in outputs] == [(50, 10), (50, 10)]
assert sorted(name for name, _ in seen) == ["replica 0", "replica 1"]
assert {pid for _, pid in seen} == {os.getpid()}  # one process: this kernel

# %% [markdown] lang="ja"
# ## 4. `gather`: 出力を集める
#
# `gather` は各レプリカの出力を出力デバイス (既定はデバイス 0) へ集め、`dim` に沿ってつなぎます。
# できあがる出力はバッチ全体の `(100, 10)` で、1 デバイスのモデルの出力と一致します。

# %% [markdown] lang="en"
# ## 4. `gather`: collect the outputs
#
# `gather` brings every replica's output to the output device (device 0 by default) and
# joins them along `dim`. The result is the whole batch's `(100, 10)`, equal to the
# output of the model on one device.

# %%
Y_hat = dp.gather(outputs, output_device=0)
print("gathered:", tuple(Y_hat.shape))
out_diff = checks.max_abs_diff(Y_hat, reference(X))
print(f"max |output - one device| = {out_diff:.1e}")
assert Y_hat.shape == (100, 10) and out_diff <= 1e-6

# %% [markdown] lang="ja"
# ## 勾配は 1 デバイスと同じ
#
# 損失は集めた出力から出力デバイスで計算します。逆伝播は `gather` と `replicate` をさかのぼり、
# 各レプリカの勾配はもとのモデル (デバイス 0) の `.grad` で**足し合わされます**。
# 損失はバッチ全体の平均なので、その和はちょうど 1 デバイスで全バッチを使った勾配です。
# 塊の大きさがそろっていなくても同じです (DDP のように平均するわけではないからです)。
#
# フックでレプリカの重みの勾配を取り出し、もとのモデルの勾配がその和であることも確かめます。

# %% [markdown] lang="en"
# ## Gradients equal one device's
#
# The loss is computed from the gathered output, on the output device. The backward pass
# runs back through `gather` and `replicate`, and every replica's gradient is **summed**
# into the `.grad` of the original model (on device 0). The loss is a mean over the
# whole batch, so that sum is exactly one device's gradient on the whole batch. That holds
# even for chunks of different sizes (nothing is averaged, unlike in DDP).
#
# Hooks take out the gradients of the replicas' weights, to check that the original
# model's gradient is their sum.

# %%
replica_grads, backward_threads = [], set()


def keep(grad):
    replica_grads.append(grad)
    backward_threads.add(threading.current_thread().name)


for r in replicas:
    r.fc1.weight.register_hook(keep)
criterion(Y_hat, y).backward()
criterion(reference(X), y).backward()
grad_diff = checks.max_abs_diff([p.grad for p in model.parameters()],
                                [p.grad for p in reference.parameters()])
print(f"max |gradient - one device's| = {grad_diff:.1e}")
assert grad_diff <= 1e-6
torch.testing.assert_close(model.fc1.weight.grad, replica_grads[0] + replica_grads[1])

# %% [markdown] lang="ja"
# ここが CPU での再現の限界です。GPU では、PyTorch の autograd はデバイスごとに専用のスレッドを持ち、
# 各レプリカの逆伝播はそれぞれのデバイスで並んで進みます。CPU は 1 つのデバイスなので、
# 全レプリカの逆伝播は、`backward()` を呼んだスレッド 1 本で順に実行されます。

# %% [markdown] lang="en"
# Here the CPU simulation reaches its limit. On GPUs, PyTorch's autograd has a thread per
# device, and each replica's backward pass runs on its own device, side by side. The CPU
# is one device, so the backward passes of all replicas run one after another in the one
# thread that called `backward()`.

# %%
print("backward ran in:", backward_threads)
assert backward_threads == {threading.current_thread().name}

# %% [markdown] lang="ja"
# ## 演習: 4 段階をつなぐ
#
# `my_data_parallel(module, X, device_ids)` は、4 段階のうち 1 段階目しか正しくありません。
# `TODO` の 3 行を、上の関数 `dp.replicate`、`dp.parallel_apply`、`dp.gather` を使って直してください。
# 出力デバイスは 0 です。確認のセルは、バッチ 100 を 2 台に、バッチ 10 を 3 台に分けて、出力と
# もとのモデルの勾配を 1 デバイスと比べ、レプリカが実際に動いたかも確かめます。

# %% [markdown] lang="en"
# ## Exercise: put the four steps together
#
# `my_data_parallel(module, X, device_ids)` gets only the first of the four steps right.
# Fix the three `TODO` lines with the functions above, `dp.replicate`,
# `dp.parallel_apply` and `dp.gather`; the output device is 0. The check splits a batch
# of 100 over 2 devices and a batch of 10 over 3, compares the output and the original
# model's gradients with one device's, and checks that the replicas did run.

# %% tags=["exercise"]
def my_data_parallel(module, X, device_ids):
    """module(X), split over the simulated devices `device_ids`, in four steps."""
    chunks = dp.scatter(X, device_ids)  # 1. split the batch
    replicas = [module for _ in chunks]  # 2. TODO: replicas, not the model itself
    outputs = [r(c) for r, c in zip(replicas, chunks, strict=True)]  # 3. TODO: threads
    return outputs  # 4. TODO: one tensor, on device 0

# %% tags=["solution"]
def my_data_parallel(module, X, device_ids):
    """module(X), split over the simulated devices `device_ids`, in four steps."""
    chunks = dp.scatter(X, device_ids)  # 1. split the batch
    replicas = dp.replicate(module, device_ids)  # 2. copy the whole model
    outputs = dp.parallel_apply(replicas, chunks, devices=device_ids)  # 3. run
    return dp.gather(outputs, output_device=0)  # 4. join on device 0

# %%
exercises.check_manual_data_parallel(my_data_parallel)

# %% [markdown] lang="ja"
# ## 4 段階を 1 回で: `data_parallel()`
#
# `dp.data_parallel(model, X, device_ids)` は PyTorch の `data_parallel()` と同じ引数を取り、
# 上の 4 段階をまとめて実行します。3 台に 34, 34, 32 と不ぞろいに分けても、出力と勾配は一致します。

# %% [markdown] lang="en"
# ## The four steps in one call: `data_parallel()`
#
# `dp.data_parallel(model, X, device_ids)` takes the arguments of PyTorch's
# `data_parallel()` and runs the four steps above. Split unevenly over 3 devices (34, 34,
# 32), outputs and gradients still match.

# %%
for n in (2, 3):
    model.zero_grad()
    reference.zero_grad()
    out = dp.data_parallel(model, X, device_ids=list(range(n)))
    criterion(out, y).backward()
    criterion(reference(X), y).backward()
    out_diff = checks.max_abs_diff(out, reference(X))
    grad_diff = checks.max_abs_diff([p.grad for p in model.parameters()],
                                    [p.grad for p in reference.parameters()])
    print(f"{n} devices: output diff {out_diff:.1e}, gradient diff {grad_diff:.1e}")
    assert out_diff <= 1e-6 and grad_diff <= 1e-6

# %% [markdown] lang="ja"
# 同じ比較は `dp_compare.dp_experiment()` でも実行でき、結果を辞書で返します。
# ターミナルからは `python -m labkit dp --devices 2 --json dp.json` で、同じ結果を JSON に書けます。

# %% [markdown] lang="en"
# `dp_compare.dp_experiment()` runs the same comparison and returns the results as a dict.
# In a terminal, `python -m labkit dp --devices 2 --json dp.json` writes them as JSON.

# %%
from labkit import dp_compare

result = dp_compare.dp_experiment(devices=3, batch=100)
print(result)
assert result["output_max_abs_diff"] <= 1e-6 and result["grad_max_abs_diff"] <= 1e-6

# %% [markdown] lang="ja"
# バッチの次元が先頭でない入力には `dim` を指定します。たとえば `(時刻, バッチ, 特徴)` の系列なら `dim=1` です。
# 分けるのも集めるのも、その次元に沿って行われます。

# %% [markdown] lang="en"
# For inputs whose batch dimension is not the first, give `dim`: for a sequence shaped
# `(time, batch, features)`, `dim=1`. Splitting and gathering both follow that dimension.

# %%
sequence = torch.randn(7, 100, 10)  # (time, batch, features)
layer = nn.Linear(10, 4)
print("chunks:", [tuple(c.shape) for c in dp.scatter(sequence, device_ids, dim=1)])
out = dp.data_parallel(layer, sequence, device_ids, dim=1)
print("output:", tuple(out.shape))
assert out.shape == (7, 100, 4)
assert checks.max_abs_diff(out, layer(sequence)) <= 1e-6

# %% [markdown] lang="ja"
# ## 記事 004 の使い方を直す
#
# 記事 004 の「使い方」は次の 4 段階です。
#
# 1. モデルを `nn.DataParallel` モジュールでラップします。
# 2. 入力データを複数の GPU に分散させます。
# 3. `data_parallel` 関数にラップしたモデルと分散させた入力データを渡します。
# 4. 関数は、モデルを各 GPU で実行し、結果を集約して返します。
#
# `nn.DataParallel` と `data_parallel()` は同じもの (クラス版と関数版) で、どちらか一方を使います。
# どちらの中身も、上で見た 4 段階です。PyTorch のソースで確かめます。

# %% [markdown] lang="en"
# ## Fixing doc 004's recipe
#
# Doc 004's "how to use" has four steps:
#
# 1. Wrap the model in an `nn.DataParallel` module.
# 2. Distribute the input data over the GPUs.
# 3. Pass the wrapped model and the distributed input to the `data_parallel` function.
# 4. The function runs the model on each GPU and returns the collected result.
#
# `nn.DataParallel` and `data_parallel()` are the same thing, a class and a function: use
# one of them. Both are the four steps above inside, as PyTorch's source shows.

# %%
import re

step = re.compile(r"\b(scatter|replicate|parallel_apply|gather)\w*\(")
for name, fn in [("data_parallel()", torch.nn.parallel.data_parallel),
                 ("DataParallel.forward", nn.DataParallel.forward)]:
    calls = [line.strip() for line in inspect.getsource(fn).splitlines()
             if step.search(line) and "def " not in line]
    print(f"{name}:", *calls, sep="\n    ")
    found = [step.search(line).group(1) for line in calls]
    assert found == ["scatter", "replicate", "parallel_apply", "gather"]

# %% [markdown] lang="ja"
# 正しい使い方は次のどちらかです。どちらも**バッチ全体**をそのまま渡し、分けるのは関数やクラスの仕事です。
#
# ```python
# model = nn.DataParallel(model)            # クラス版: 包んで
# output = model(input_data)                # 普通に呼ぶ
#
# output = data_parallel(model, input_data) # 関数版: 包まずに呼ぶ
# ```
#
# CPU で両方を重ねると (記事の手順 1 と 3)、PyTorch の `data_parallel()` はエラーになります。

# %% [markdown] lang="en"
# The correct use is one of these. Both take the **whole batch** as it is: splitting it is
# the function's (or the class's) job.
#
# ```python
# model = nn.DataParallel(model)            # the class: wrap,
# output = model(input_data)                # then call as usual
#
# output = data_parallel(model, input_data) # the function: no wrapper
# ```
#
# Doing both on a CPU (the document's steps 1 and 3) makes PyTorch's `data_parallel()`
# fail.

# %%
if not torch.cuda.is_available():
    with checks.expect_error(RuntimeError, match="device type could not be determined"):
        torch.nn.parallel.data_parallel(nn.DataParallel(model), X)

# %% [markdown] lang="ja"
# 手順 2 のように自分で分けてから渡すと、塊は別々の**引数**として扱われ、それぞれがさらに分けられます。
# レプリカ 0 は 2 つの引数を受け取り、1 つしか取らないモデルはそこで失敗します。
# エラーは、どのレプリカのどのデバイスで起きたかを示して、呼び出し元で再び送出されます。

# %% [markdown] lang="en"
# Split by hand first, as in step 2, and the chunks become separate **arguments**, each
# split again. Replica 0 receives two arguments, and a model that takes one fails there.
# The error is raised again in the caller, naming the replica and the device it failed on.

# %%
pre_split = tuple(X.chunk(2))  # the document's step 2
with checks.expect_error(TypeError, match="replica 0 on simulated device 0"):
    dp.data_parallel(model, pre_split, device_ids)

# %% [markdown] lang="ja"
# 記事のコード例にある `.cuda()` は、GPU のないマシンでは止まります (レッスン 01 と同じ)。
# `x.view(-1)` のままのモデルはレプリカの中で失敗します。直し方 `x.flatten(1)` はレッスン 01 で扱いました。

# %% [markdown] lang="en"
# The `.cuda()` in the document's examples stops on a machine without a GPU (as in lesson
# 01). The model with `x.view(-1)` fails inside the replicas; the fix, `x.flatten(1)`, is
# in lesson 01.

# %%
if not torch.cuda.is_available():
    # A CPU-only build raises AssertionError; a CUDA build without a GPU, RuntimeError.
    with checks.expect_error((AssertionError, RuntimeError)):
        torch.randn(100, 10).cuda()
with checks.expect_error(RuntimeError, match="(?s)replica 0 .*shapes cannot be"):
    dp.data_parallel(models.MLPAsWritten(), X, device_ids)

# %% [markdown] lang="ja"
# 記事は「モデルのパラメータは、すべての GPU に同期されている必要があります」と注意していますが、
# 利用者がそろえる必要はありません。DataParallel は**呼び出しのたびに**もとのモデルからレプリカを作り直すので、
# もとのモデルを変えれば、次の呼び出しの全レプリカに反映されます。

# %% [markdown] lang="en"
# The document warns that "the model's parameters must be synchronized on all GPUs". The
# user has nothing to synchronize: DataParallel builds the replicas from the original
# model **at every call**, so a change to the original reaches every replica of the next
# call.

# %%
ran = []  # the modules that ran, kept alive so that their ids stay unique
hook = model.register_forward_hook(lambda module, args, out: ran.append(module))
with torch.no_grad():
    model.fc2.bias += 1.0  # change the original only
    out = dp.data_parallel(model, X, device_ids)
    dp.data_parallel(model, X, device_ids)
    model.fc2.bias -= 1.0
    assert checks.max_abs_diff(out, reference(X) + 1.0) <= 1e-6  # the change arrived
hook.remove()
print("modules that ran in two calls:", len({id(m) for m in ran}))
assert len({id(m) for m in ran}) == 4 and model not in ran  # new replicas each call

# %% [markdown] lang="ja"
# 記事の補足には「`torch.nn.parallel` モジュールには、`data_parallel` 以外にも、`replicate` や
# `scatter_gather` などの並列処理用の関数があります。これらの関数は、異なる並列処理パターンに対応しています」
# とあります。実際には、`replicate` は関数ですが `scatter_gather` はモジュールで、中に `scatter`、
# `scatter_kwargs`、`gather` があります。そしてこれらは別のパターンのためのものではなく、
# 上で見たとおり `data_parallel` 自身の部品です。

# %% [markdown] lang="en"
# The document's notes say that `torch.nn.parallel` has, besides `data_parallel`,
# "functions for parallel processing such as `replicate` and `scatter_gather`", and that
# "they correspond to different parallel-processing patterns". In fact `replicate` is a
# function but `scatter_gather` is a module, holding `scatter`, `scatter_kwargs` and
# `gather`. And they are not for other patterns: as shown above, they are the parts of
# `data_parallel` itself.

# %%
import torch.nn.parallel.scatter_gather as scatter_gather

print("replicate:", type(torch.nn.parallel.replicate).__name__,
      "| scatter_gather:", type(scatter_gather).__name__, scatter_gather.__all__)
assert inspect.isfunction(torch.nn.parallel.replicate)
assert inspect.ismodule(scatter_gather)
assert scatter_gather.__all__ == ["scatter", "scatter_kwargs", "gather"]

# %% [markdown] lang="ja"
# ## スレッドの DataParallel とプロセスの DDP
#
# 同じ仕事 (全体バッチ 1024 の 1 ステップ) を 3 通りで測ります。1 つの模擬デバイスは CPU コア 1 つに
# 当たります (torch のスレッド 1 本)。
#
# - 1 デバイス: モデルをそのまま、コア 1 つで
# - DP ×2: DataParallel を 2 台の模擬デバイスで。このカーネルの中で、レプリカごとにスレッド 1 本
# - DDP ×2: 2 ランクの DDP。レッスン 03 と同じエンジン (別々のプロセス) で、ランクごとにスレッド 1 本
#
# 2 つのランクは、レッスンの最初に裏で起動しておきました。

# %% [markdown] lang="en"
# ## Thread-based DataParallel against process-based DDP
#
# Time the same work (one step with a global batch of 1024) three ways. One simulated
# device stands for one CPU core (one torch thread).
#
# - 1 device: the plain model, on one core
# - DP ×2: DataParallel on 2 simulated devices, in this kernel, one thread per replica
# - DDP ×2: DDP with 2 ranks, on engines as in lesson 03 (separate processes), one thread
#   per rank
#
# The two ranks were started in the background at the top of the lesson.

# %% tags=["nbval-ignore-output"]
ranks.wait()  # started in the background at the top of the lesson
pids = ranks.run(os.getpid)
print("rank processes:", pids, "| this kernel:", os.getpid())
assert len(set(pids)) == 2 and os.getpid() not in pids  # one process per rank

# %% tags=["nbval-ignore-output"]
# %%px
from labkit import ddp

sizes = [("doc 004 MLP", 100, 1), ("MLP 1024x2", 1024, 2)]
ddp_s = {name: ddp.step_time(hidden, depth, 1024) for name, hidden, depth in sizes}
print(f"rank {rank}:", {k: f"{v * 1e3:.1f} ms" for k, v in ddp_s.items()})

# %% tags=["nbval-ignore-output"]
sizes = [("doc 004 MLP", 100, 1), ("MLP 1024x2", 1024, 2)]
ddp_s = ranks.pull("ddp_s")[0]
step_ms = {}
for name, hidden, depth in sizes:
    step_ms[name] = {
        labkit.t("one_device"): dp_compare.step_time(hidden, depth, 1024, devices=1) * 1e3,
        labkit.t("dp_threads"): dp_compare.step_time(hidden, depth, 1024, devices=2) * 1e3,
        labkit.t("ddp_processes"): ddp_s[name] * 1e3,
    }
    print(name, {k.replace("\n", " "): f"{v:.1f} ms" for k, v in step_ms[name].items()})
fig = plots.bar_chart(step_ms, ylabel="step_time_ms", title="dp_vs_ddp_title",
                      fmt="{:.1f} ms")

# %% [markdown] lang="ja"
# 時間は実行のたびに変わります。このマシンはほかの処理と共有されていて、コアも 2 つしかないので、
# どれが速いかが実行ごとに入れ替わることもあります。数字の大小よりも、それぞれの方式が何に時間を
# 使っているかを見てください。どの方式も、このレッスンで確かめた手間を払っています。
#
# DataParallel (DP、スレッド) が 1 デバイスに加えて払うもの:
# - **1 つのプロセスの中のスレッド**: 順伝播は同じプロセスの別々のスレッドで動きました (3.)。
#   Python のコードを実行できるのは、プロセスに 1 つしかない GIL を持つスレッドだけなので、
#   小さな演算が多いモデルでは、スレッドが GIL を待ち合います。
# - **毎ステップの複製**: 呼び出しのたびにレプリカが作り直され、デバイス 0 以外へパラメータがコピーされます。
# - **分割と集約**: 入力は各デバイスへコピーされ (1.)、出力はデバイス 0 に集められます (4.)。
# - **出力デバイスの負担**: バッチ全体の出力、損失の計算、全レプリカの勾配の合計、オプティマイザの更新は、
#   すべてデバイス 0 に集まります。
# - **CPU での再現に特有の点**: 逆伝播はスレッド 1 本で順に実行されました。GPU では、逆伝播もデバイスごとに
#   並んで進みます。
#
# DDP (プロセス) が払うもの:
# - 勾配の all-reduce (レッスン 03 で回数とバイト数を数えました) と、ランクどうしの待ち合わせです。
#   記事 004 の小さなモデルでは計算がごくわずかなので、この手間が目立ちます。
#   その代わり、各ランクは別々のプロセスで、それぞれが自分の GIL を持ちます。モデルを毎ステップ複製することも、
#   出力を 1 か所に集めることもありません。

# %% [markdown] lang="en"
# Times change from run to run. This machine is shared with other work and has only two
# cores, so which way is fastest can change from one run to the next. Rather than the
# numbers, look at what each way spends its time on: each pays the costs this lesson has
# checked.
#
# What DataParallel (DP, threads) pays on top of one device:
# - **Threads in one process**: the forward passes ran in separate threads of one process
#   (step 3). Only the thread holding the process's one GIL can run Python code, so with
#   many small operations the threads wait for each other.
# - **Replication at every step**: every call builds the replicas again and copies the
#   parameters to every device but device 0.
# - **Scattering and gathering**: the inputs are copied to each device (step 1) and the
#   outputs collected on device 0 (step 4).
# - **The output device's load**: the whole batch's output, the loss, the sum of every
#   replica's gradients and the optimizer's update all land on device 0.
# - **Peculiar to the CPU simulation**: the backward passes ran one after another in one
#   thread. On GPUs, the backward passes also run side by side, one per device.
#
# What DDP (processes) pays:
# - The all-reduce of the gradients (lesson 03 counted its calls and bytes) and the ranks
#   waiting for each other. Doc 004's small model computes almost nothing, so these costs
#   show. In exchange, each rank is a separate process with its own GIL; the model is
#   not copied at every step, and no output is gathered in one place.

# %% [markdown] lang="ja"
# ## PyTorch が DDP を勧める理由
#
# `nn.DataParallel` の説明文 (docstring) 自体に、1 台のマシンでも DDP を使うよう書かれています。
# インストールされている PyTorch から取り出します。

# %% [markdown] lang="en"
# ## Why PyTorch recommends DDP
#
# The docstring of `nn.DataParallel` itself says to use DDP, even on a single machine.
# Take it from the installed PyTorch:

# %%
doc = " ".join(inspect.getdoc(nn.DataParallel).split())
start = doc.index("It is recommended")
print(doc[start : doc.index(".", doc.index("single node")) + 1])
assert "instead of this class, to do multi-GPU training, even if there is only a " \
       "single node" in doc

# %% [markdown] lang="ja"
# PyTorch の文書は、理由も説明しています。
#
# - CUDA semantics の「Use nn.parallel.DistributedDataParallel instead of multiprocessing or
#   nn.DataParallel」([リンク](https://pytorch.org/docs/stable/notes/cuda.html#cuda-nn-ddp-instead)):
#   "The difference between DistributedDataParallel and DataParallel is: DistributedDataParallel uses
#   multiprocessing where a process is created for each GPU, while DataParallel uses multithreading.
#   By using multiprocessing, each GPU has its dedicated process, this avoids the performance overhead
#   caused by GIL of Python interpreter."
#   (DDP は GPU ごとにプロセスを作り、DataParallel はスレッドを使う。プロセスなら GIL による遅れを避けられる)
# - DDP のチュートリアル ([リンク](https://docs.pytorch.org/tutorials/intermediate/ddp_tutorial.html)):
#   "DataParallel is single-process, multi-threaded, but it only works on a single machine. In
#   contrast, DistributedDataParallel is multi-process and supports both single- and multi- machine
#   training. Due to GIL contention across threads, per-iteration replicated model, and additional
#   overhead introduced by scattering inputs and gathering outputs, DataParallel is usually slower
#   than DistributedDataParallel even on a single machine."
#   (DataParallel は 1 プロセス・マルチスレッドで、1 台のマシンの中でしか使えない。DDP はマルチプロセスで、
#   複数のマシンにまたがる学習もできる。スレッド間の GIL の取り合い、毎回のモデルの複製、入力の scatter と
#   出力の gather の余分な手間のため、DataParallel は 1 台のマシンでも DDP より遅いのが普通)
#
# DDP の使い方はレッスン 03 で扱いました。

# %% [markdown] lang="en"
# PyTorch's documentation also gives the reasons.
#
# - CUDA semantics, "Use nn.parallel.DistributedDataParallel instead of multiprocessing or
#   nn.DataParallel" ([link](https://pytorch.org/docs/stable/notes/cuda.html#cuda-nn-ddp-instead)):
#   "The difference between DistributedDataParallel and DataParallel is: DistributedDataParallel uses
#   multiprocessing where a process is created for each GPU, while DataParallel uses multithreading.
#   By using multiprocessing, each GPU has its dedicated process, this avoids the performance overhead
#   caused by GIL of Python interpreter."
# - The DDP tutorial ([link](https://docs.pytorch.org/tutorials/intermediate/ddp_tutorial.html)):
#   "DataParallel is single-process, multi-threaded, but it only works on a single machine. In
#   contrast, DistributedDataParallel is multi-process and supports both single- and multi- machine
#   training. Due to GIL contention across threads, per-iteration replicated model, and additional
#   overhead introduced by scattering inputs and gathering outputs, DataParallel is usually slower
#   than DistributedDataParallel even on a single machine."
#
# Lesson 03 shows how to use DDP.

# %% [markdown] lang="ja"
# ## 後片付け

# %% [markdown] lang="en"
# ## Clean up

# %%
ranks.stop()
assert cluster.current() is None

# %% [markdown] lang="ja"
# ## まとめ
#
# | 記事 004 | 実際 | 確かめたセル |
# |---|---|---|
# | `nn.DataParallel` で包み、さらに `data_parallel` に渡す | 同じもののクラス版と関数版。どちらか一方を使う | 記事 004 の使い方を直す |
# | 入力を自分で GPU に分けてから渡す | バッチ全体を渡す。分けると別々の引数になり失敗する | 同上 |
# | `.cuda()`、`x.view(-1)` | GPU がなければ止まる / バッチが壊れる (レッスン 01) | 同上 |
# | 「モデルを複数の GPU に分割」 | モデルは丸ごと複製し、分けるのはデータ | 2. `replicate` |
# | 「パラメータはすべての GPU に同期されている必要がある」 | 呼び出しのたびに複製し直すので不要 | 記事 004 の使い方を直す |
# | 「`replicate` や `scatter_gather` は異なる並列処理パターンに対応」 | `data_parallel` 自身の部品 (`scatter_gather` はモジュール) | 同上 |
# | (書かれていない) CPU では `nn.DataParallel` は何もしない | `device_ids == []` で、モデルを 1 回呼ぶだけ | CPU では `nn.DataParallel` は何もしない |
# | (書かれていない) どちらを使うべきか | 1 台のマシンでも DDP (PyTorch の推奨) | PyTorch が DDP を勧める理由 |

# %% [markdown] lang="en"
# ## Summary
#
# | doc 004 | in fact | the cell that shows it |
# |---|---|---|
# | wrap in `nn.DataParallel`, then pass to `data_parallel` | the class and the function are the same thing: use one | Fixing doc 004's recipe |
# | split the input over the GPUs yourself, then pass it | pass the whole batch; pre-split chunks become separate arguments and fail | same |
# | `.cuda()`, `x.view(-1)` | stops without a GPU / breaks the batch (lesson 01) | same |
# | "split the model across the GPUs" | the whole model is copied; the data is split | 2. `replicate` |
# | "parameters must be synchronized on all GPUs" | nothing to do: replicas are rebuilt at every call | Fixing doc 004's recipe |
# | "`replicate` and `scatter_gather` serve different patterns" | they are the parts of `data_parallel` (`scatter_gather` is a module) | same |
# | (not said) on a CPU, `nn.DataParallel` does nothing | `device_ids == []`, one plain call | On a CPU, `nn.DataParallel` does nothing |
# | (not said) which one to use | DDP, even on one machine (PyTorch's recommendation) | Why PyTorch recommends DDP |
