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
# GPU がなければ PyTorch のこれらの関数は動かないので、`labkit.data_parallel` が同じ 4 段階を CPU で再現します。
# `device_ids=[0, 1]` は 2 台の**模擬デバイス**で、分割、複製、スレッド、勾配の流れ方は PyTorch と同じです
# (CUDA があり、モデルが GPU にあれば PyTorch 自身の `data_parallel` を呼びます)。
#
# 記事 004 はこの 2 つの使い方を誤っていて、PyTorch 自身は 1 台のマシンでも DDP (レッスン 03) を勧めています。
# このレッスンでは、記事を直しながらその理由を確かめます。
#
# このレッスンを終えると、次のことができます。
#
# - DataParallel の 4 段階を、模擬デバイスで 1 つずつ実行できる。
# - 出力と勾配が 1 デバイスと一致することを確かめ、レプリカの勾配がどこへ行くかを説明できる。
# - クラス版か関数版の一方にバッチ全体を渡す使い方で、記事 004 の手順を直せる。
# - DataParallel が毎ステップ払うものを挙げ、PyTorch が DDP を勧める理由を説明できる。

# %% [markdown] lang="en" tags=["outcomes"]
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
# Without a GPU PyTorch's versions do not run, so `labkit.data_parallel` runs the same
# four steps on the CPU: `device_ids=[0, 1]` names two **simulated devices**, with
# PyTorch's splitting, copying, threads and gradient flow (with CUDA and a model on a
# GPU it calls PyTorch's own `data_parallel`).
#
# Doc 004 gets their use wrong, and PyTorch recommends DDP (lesson 03) even on one
# machine. This lesson corrects the article and checks why.
#
# After this lesson you can:
#
# - run DataParallel's four steps one by one on simulated devices;
# - check that outputs and gradients equal one device's, and say where the replicas'
#   gradients go;
# - fix doc 004's recipe: the class or the function, with the whole batch;
# - name what DataParallel pays at every step, and why PyTorch recommends DDP.

# %%
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %%
import copy
import inspect
import os
import threading

import torch
from torch import nn

from labkit import checks, compare, diagrams, exercises, models, plots
from labkit import data_parallel as dp

torch.manual_seed(0)
X, y = torch.randn(100, 10), torch.randn(100, 10)  # doc 004's batch of 100
model = models.MLP()  # doc 004's model, corrected (lesson 01)
reference = copy.deepcopy(model)  # the same weights, run on one device
criterion = models.MyLoss()

# %% tags=["hide-input"]
print("CUDA:", torch.cuda.is_available(), "| torch's own data_parallel:", dp.uses_cuda(model))
assert not dp.uses_cuda(model)  # the model is on the CPU: the simulation runs
if torch.cuda.is_available():
    assert dp.uses_cuda(copy.deepcopy(model).cuda())  # on a GPU: torch's own

# %% [markdown] lang="ja"
# ## CPU では `nn.DataParallel` は何もしない
#
# GPU がないと `nn.DataParallel` の `device_ids` は空で、分割も複製もせずにモデルを 1 回呼ぶだけです。
# エラーも警告も出ません。

# %% [markdown] lang="en"
# ## On a CPU, `nn.DataParallel` does nothing
#
# Without a GPU, `nn.DataParallel` has an empty `device_ids` and just calls the model
# once: no split, no copy, no error, no warning.

# %%
wrapped = nn.DataParallel(model)
wrapped.device_ids

# %% tags=["hide-input"]
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

# %% tags=["hide-input"]
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
# `scatter` はバッチを `dim` (既定は 0) に沿ってデバイスの数に分け、各デバイスへコピーします。
# 100 サンプルを 2 台に分けると 50 ずつです。

# %% [markdown] lang="en"
# ## 1. `scatter`: split the batch
#
# `scatter` splits the batch along `dim` (0 by default) into one chunk per device and
# copies each chunk to its device: 100 samples on 2 devices are 50 each.

# %%
device_ids = [0, 1]
chunks = dp.scatter(X, device_ids)
[tuple(chunk.shape) for chunk in chunks]

# %% tags=["hide-input"]
assert [len(c) for c in chunks] == [50, 50]
assert torch.equal(torch.cat(chunks), X)
assert chunks[0].data_ptr() != X.data_ptr()  # each device gets its own copy

# %% [markdown] lang="ja"
# 割り切れないときは `Tensor.chunk` と同じ分け方です。チャンクの大きさは「バッチ ÷ デバイス数」の切り上げで、
# 最後だけ小さくなり、チャンクがデバイスより**少なくなる**こともあります (5 サンプルを 4 台なら 2, 2, 1)。
#
# **予想してから実行:** 100 サンプルを 3 台に、10 サンプルを 4 台に分けると、チャンクの大きさはどうなるでしょうか?

# %% [markdown] lang="en"
# An uneven batch splits as `Tensor.chunk` does: each chunk holds the batch divided by
# the devices, rounded up, so only the last is smaller, and there can be **fewer** chunks
# than devices (5 samples on 4 devices: 2, 2, 1).
#
# **Predict, then run:** what chunk sizes do 100 samples on 3 devices make, and 10 on 4?

# %%
splits = {}
for batch, n in [(100, 3), (10, 4), (5, 4), (3, 4)]:
    sizes = [len(c) for c in dp.scatter(torch.randn(batch, 10), list(range(n)))]
    splits[batch, n] = sizes
    print(f"batch {batch:3d} on {n} devices -> {sizes}")
    assert sizes == [len(c) for c in torch.randn(batch, 10).chunk(n)]
assert splits[100, 3] == [34, 34, 32] and splits[10, 4] == [3, 3, 3, 1]
assert splits[5, 4] == [2, 2, 1] and splits[3, 4] == [1, 1, 1]
fig = diagrams.collectives({labkit.t("split_row", b=b, n=n): [[s] for s in sizes]
                           for (b, n), sizes in splits.items()},
                          column="device_n", title="splits_title", fmt="{:.0f}")

# %% [markdown] lang="ja"
# ## 演習 (任意): 分け方を予想する
#
# 上の規則の練習です。飛ばしても先に進めます。3 つのバッチの分け方を、チャンクの大きさのリストで
# 書いてください (バッチ 5 を 4 台なら `[2, 2, 1]`)。

# %% [markdown] lang="en"
# ## Exercise (optional): predict the split
#
# Practice for the rule above; you can skip it. Write how `scatter` splits the three
# batches below as lists of chunk sizes (batch 5 on 4 devices: `[2, 2, 1]`).

# %% tags=["exercise", "optional"]
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
exercises.grade_chunk_sizes(predicted)

# %% [markdown] lang="ja"
# 引数、キーワード引数、タプルや辞書の中のテンソルは、すべて同じように分けられます。テンソルでないもの
# (文字列や数) は、同じものが全デバイスに渡されます。

# %% [markdown] lang="en"
# Every tensor among the arguments, keyword arguments, tuples and dicts is split the same
# way; anything else (a string, a number) goes to every device as it is.

# %%
args, kwargs = dp.scatter_kwargs((X, "mean"), {"target": y, "scale": 0.5}, device_ids)

# %% tags=["hide-input"]
for d, a, k in zip(device_ids, args, kwargs, strict=True):
    print(f"device {d}: args ({tuple(a[0].shape)}, {a[1]!r}), "
          f"kwargs {{target: {tuple(k['target'].shape)}, scale: {k['scale']}}}")
assert [len(a[0]) for a in args] == [len(k["target"]) for k in kwargs] == [50, 50]
assert args[0][1] is args[1][1] == "mean" and kwargs[1]["scale"] == 0.5

# %% [markdown] lang="ja"
# ## 2. `replicate`: モデルを複製する
#
# `replicate` はモデル**全体**をデバイスごとに複製します。記事 004 の手動の手順は「モデルを複数の GPU に
# 分割します」と書いていますが、データ並列で分けるのはデータです (モデルを分けるのはモデル並列や FSDP)。
#
# - レプリカ 0 は、もとのパラメータと**同じメモリ**を使います。ほかのレプリカはコピーです。
# - レプリカの重みは葉テンソルではなく、もとのパラメータから計算されたテンソルです。そのため逆伝播で、
#   各レプリカの勾配はもとのモデルの `.grad` に流れ込みます。

# %% [markdown] lang="en"
# ## 2. `replicate`: copy the model
#
# `replicate` copies the **whole** model once per device. Doc 004's manual recipe says
# "split the model across the GPUs", but data parallelism splits the data (splitting the
# model is model parallelism, or FSDP).
#
# - Replica 0 uses the **same memory** as the original parameters; the others are copies.
# - A replica's weights are not leaf tensors but tensors computed from the original
#   parameters, so backward flows every replica's gradient into the original's `.grad`.

# %%
def weights(m):
    """The four weight tensors of doc 004's MLP (replicas hold them as attributes)."""
    return [m.fc1.weight, m.fc1.bias, m.fc2.weight, m.fc2.bias]


replicas = dp.replicate(model, device_ids)

# %% tags=["hide-input"]
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
# `parallel_apply` はレプリカ i にチャンク i を入力し、レプリカごとにスレッドを 1 つ立てます。フックの記録では、
# 2 つの順伝播は**同じプロセス**の**別々のスレッド**で動きます。

# %% [markdown] lang="en"
# ## 3. `parallel_apply`: run the replicas in threads
#
# `parallel_apply` feeds chunk i to replica i, one thread each. A hook records where each
# forward pass ran: in **separate threads** of the **same process**.

# %%
seen = []
hook = model.register_forward_hook(  # replicas share the original's hooks
    lambda module, args, out: seen.append((threading.current_thread().name, os.getpid())))
outputs = dp.parallel_apply(replicas, chunks, devices=device_ids)
hook.remove()

# %% tags=["hide-input"]
for d, o in zip(device_ids, outputs, strict=True):
    print(f"device {d}: output {tuple(o.shape)}")
print("ran in:", sorted(seen))
assert [o.shape for o in outputs] == [(50, 10), (50, 10)]
assert sorted(name for name, _ in seen) == ["replica 0", "replica 1"]
assert {pid for _, pid in seen} == {os.getpid()}  # one process: this kernel

# %% [markdown] lang="ja"
# ## 4. `gather`: 出力を集める
#
# `gather` は出力を出力デバイス (既定はデバイス 0) に集めて `dim` に沿ってつなぎます。バッチ全体の `(100, 10)` で、
# 1 デバイスの出力と一致します。

# %% [markdown] lang="en"
# ## 4. `gather`: collect the outputs
#
# `gather` joins the outputs along `dim` on the output device (device 0 by default): the
# whole batch's `(100, 10)`, equal to one device's output.

# %%
Y_hat = dp.gather(outputs, output_device=0)
Y_hat.shape

# %% tags=["hide-input"]
out_diff = compare.max_abs_diff(Y_hat, reference(X))
print(f"max |output - one device| = {out_diff:.1e}")
assert Y_hat.shape == (100, 10) and out_diff <= 1e-6

# %% [markdown] lang="ja"
# 4 つの段階を 1 枚にまとめます。モデルは全体が各デバイスへ複製され、バッチは分けられ、出力はデバイス 0 に集まります。

# %% [markdown] lang="en"
# The four steps in one picture: the whole model copied to each device, the batch split,
# the outputs on device 0.

# %% tags=["hide-input"]
steps = {
    labkit.t("dp_scatter"): [[len(c)] for c in chunks],
    labkit.t("dp_replicate"): [[sum(w.numel() for w in weights(r))] for r in replicas],
    labkit.t("dp_apply"): [[len(o)] for o in outputs],
    labkit.t("dp_gather"): [[len(Y_hat)], []],
}
assert [v for v, *_ in steps.values()] == [[50], [2110], [50], [100]]
fig = diagrams.collectives(steps, column="device_n", title="dp_steps_title",
                          fmt="{:.0f}")

# %% [markdown] lang="ja"
# ## 勾配は 1 デバイスと同じ
#
# 損失は出力デバイスで計算し、逆伝播は `gather` と `replicate` をさかのぼります。
#
# **予想してから実行:** 2 つのレプリカの勾配はどこへ行くでしょうか。各レプリカに残る、もとのモデルの
# `.grad` で平均される、足し合わされる、のどれでしょうか?

# %% [markdown] lang="en"
# ## Gradients equal one device's
#
# The loss is computed on the output device, and backward runs back through `gather` and
# `replicate`.
#
# **Predict, then run:** where do the two replicas' gradients go? Does each replica keep
# its own, or are they averaged, or summed, into the original model's `.grad`?

# %%
replica_grads, backward_threads = [], set()


def keep(grad):
    replica_grads.append(grad)
    backward_threads.add(threading.current_thread().name)


for r in replicas:
    r.fc1.weight.register_hook(keep)
criterion(Y_hat, y).backward()

# %% tags=["hide-input"]
criterion(reference(X), y).backward()
grad_diff = compare.max_abs_diff([p.grad for p in model.parameters()],
                                [p.grad for p in reference.parameters()])
print(f"max |gradient - one device's| = {grad_diff:.1e}")
assert grad_diff <= 1e-6
summed = replica_grads[0] + replica_grads[1]
print("original fc1.weight.grad equals the replicas' sum:",
      torch.allclose(model.fc1.weight.grad, summed),
      "| their mean:", torch.allclose(model.fc1.weight.grad, summed / 2))
torch.testing.assert_close(model.fc1.weight.grad, summed)
assert not torch.allclose(model.fc1.weight.grad, summed / 2)  # summed, not averaged

# %% [markdown] lang="ja"
# 各レプリカの勾配は、もとのモデルの `.grad` で**足し合わされます**。損失はバッチ全体の平均なので、その和は
# ちょうど 1 デバイスの勾配です。チャンクがそろっていなくても同じです (DDP のように平均しないからです)。

# %% [markdown] lang="en"
# Every replica's gradient is **summed** into the original model's `.grad`. The loss is
# the whole batch's mean, so the sum is exactly one device's gradient, even for uneven
# chunks (nothing is averaged, unlike in DDP).

# %% [markdown] lang="ja"
# ここが CPU での再現の限界です。GPU では各レプリカの逆伝播がそれぞれのデバイスで並んで進みますが、CPU では
# `backward()` を呼んだスレッド 1 本で順に実行されます。

# %% [markdown] lang="en"
# Here the CPU simulation reaches its limit: on GPUs each replica's backward runs on its
# own device, side by side; on the CPU all run in the one thread that called `backward()`.

# %% tags=["hide-input"]
print("backward ran in:", backward_threads)
assert backward_threads == {threading.current_thread().name}

# %% [markdown] lang="ja"
# ## 演習: 4 段階をつなぐ
#
# `my_data_parallel(module, X, device_ids)` は、1 段階目しか正しくありません。`TODO` の 3 行を
# `dp.replicate`、`dp.parallel_apply`、`dp.gather` で直してください (出力デバイスは 0)。確認のセルは、
# いくつかのバッチとデバイス数 (チャンクがデバイスより少ない場合も) で、出力と勾配を 1 デバイスと比べ、
# レプリカがそれぞれのスレッドで動いたかも確かめます。

# %% [markdown] lang="en"
# ## Exercise: put the four steps together
#
# `my_data_parallel(module, X, device_ids)` gets only the first step right. Fix the three
# `TODO` lines with `dp.replicate`, `dp.parallel_apply` and `dp.gather` (output device 0).
# The check tries several batches and device counts (fewer chunks than devices among
# them), compares outputs and gradients with one device's, and checks that the replicas
# ran, each in a thread of its own.

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
    used = device_ids[: len(chunks)]  # fewer chunks than devices: fewer replicas
    replicas = dp.replicate(module, used)  # 2. copy the whole model
    outputs = dp.parallel_apply(replicas, chunks, devices=used)  # 3. run
    return dp.gather(outputs, output_device=0)  # 4. join on device 0

# %%
exercises.grade_manual_data_parallel(my_data_parallel)

# %% [markdown] lang="ja"
# ## 4 段階を 1 回で: `data_parallel()`
#
# `dp.data_parallel(model, X, device_ids)` は PyTorch の `data_parallel()` と同じ引数で 4 段階を実行します。
# 3 台に 34, 34, 32 と不ぞろいに分けても、出力と勾配は一致します。

# %% [markdown] lang="en"
# ## The four steps in one call: `data_parallel()`
#
# `dp.data_parallel(model, X, device_ids)` takes the arguments of PyTorch's
# `data_parallel()` and runs the four steps; split unevenly over 3 devices (34, 34, 32),
# outputs and gradients still match.

# %%
for n in (2, 3):
    model.zero_grad()
    reference.zero_grad()
    out = dp.data_parallel(model, X, device_ids=list(range(n)))
    criterion(out, y).backward()
    criterion(reference(X), y).backward()
    out_diff = compare.max_abs_diff(out, reference(X))
    grad_diff = compare.max_abs_diff([p.grad for p in model.parameters()],
                                    [p.grad for p in reference.parameters()])
    print(f"{n} devices: output diff {out_diff:.1e}, gradient diff {grad_diff:.1e}")
    assert out_diff <= 1e-6 and grad_diff <= 1e-6

# %% [markdown] lang="ja"
# 同じ比較は `dp_experiments.dp_experiment()` でも実行でき、結果を辞書で返します (ターミナルからは
# `python -m labkit dp --devices 2 --json dp.json`)。GPU が 2 台以上あれば、PyTorch 自身の `data_parallel` を使います。
#
# <details><summary>測り方</summary>
#
# GPU が 2 台以上あるマシンでは、モデルとバッチを `cuda:0` に置いて実際の GPU で実行します (`"simulated": False`)。
# なければ CPU での再現です。この GPU の経路は、まだ実際の GPU の上で実行されたことがありません
# (README の「どこで何を確かめたか」)。
#
# </details>

# %% [markdown] lang="en"
# `dp_experiments.dp_experiment()` runs the same comparison and returns a dict (in a
# terminal: `python -m labkit dp --devices 2 --json dp.json`). With two or more GPUs it
# uses PyTorch's own `data_parallel`.
#
# <details><summary>How this was measured</summary>
#
# On a machine with two or more GPUs, the function puts the model and the batch on
# `cuda:0` and runs on the real GPUs (`"simulated": False`); otherwise it is the CPU
# simulation. That GPU path has not run on real GPUs yet (the README's "What is checked
# where").
#
# </details>

# %%
from labkit import dp_experiments

result = dp_experiments.dp_experiment(devices=2, batch=100)
print(result)
assert result["simulated"] == (torch.cuda.device_count() < 2)  # real GPUs where present
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
assert compare.max_abs_diff(out, layer(sequence)) <= 1e-6

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
# `nn.DataParallel` と `data_parallel()` は、同じ 4 段階のクラス版と関数版です (PyTorch のソースで確かめます)。
# 使うのはどちらか一方です。

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
# `nn.DataParallel` and `data_parallel()` are a class and a function doing the same four
# steps, as PyTorch's source shows: use one of them.

# %% tags=["hide-input"]
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
# 正しい使い方は次のどちらかで、どちらも**バッチ全体**を渡します。分けるのはクラスや関数の仕事です。
#
# ```python
# model = nn.DataParallel(model)            # クラス版: 包んで
# output = model(input_data)                # 普通に呼ぶ
#
# output = data_parallel(model, input_data) # 関数版: 包まずに呼ぶ
# ```
#
# 両方を重ねると (記事の手順 1 と 3)、CPU では PyTorch の `data_parallel()` がエラーになります。

# %% [markdown] lang="en"
# The correct use is one of these, each given the **whole batch**: splitting it is the
# function's (or the class's) job.
#
# ```python
# model = nn.DataParallel(model)            # the class: wrap,
# output = model(input_data)                # then call as usual
#
# output = data_parallel(model, input_data) # the function: no wrapper
# ```
#
# Doing both (the document's steps 1 and 3) makes PyTorch's `data_parallel()` fail on a
# CPU.

# %%
if not torch.cuda.is_available():
    with checks.expect_error(RuntimeError, match="device type could not be determined"):
        torch.nn.parallel.data_parallel(nn.DataParallel(model), X)

# %% [markdown] lang="ja"
# 手順 2 のように自分で分けてから渡すと、チャンクは別々の**引数**になり、それぞれがさらに分けられます。
# レプリカ 0 は 2 つの引数を受け取り、1 つしか取らないモデルは失敗します。エラーはレプリカとデバイスを示します。

# %% [markdown] lang="en"
# Split by hand first (step 2), and the chunks become separate **arguments**, each split
# again: replica 0 receives two, and a model that takes one fails. The error names the
# replica and the device.

# %%
pre_split = tuple(X.chunk(2))  # the document's step 2
with checks.expect_error(TypeError, match="replica 0 on simulated device 0"):
    dp.data_parallel(model, pre_split, device_ids)

# %% [markdown] lang="ja"
# 記事の `.cuda()` は GPU がなければ止まり、`x.view(-1)` のままのモデルはレプリカの中で失敗します (レッスン 01)。

# %% [markdown] lang="en"
# The document's `.cuda()` stops without a GPU, and the model with `x.view(-1)` fails
# inside the replicas (lesson 01).

# %%
if not torch.cuda.is_available():
    # A CPU-only build raises AssertionError; a CUDA build without a GPU, RuntimeError.
    with checks.expect_error((AssertionError, RuntimeError)):
        torch.randn(100, 10).cuda()
with checks.expect_error(RuntimeError, match="(?s)replica 0 .*shapes cannot be"):
    dp.data_parallel(models.MLPAsWritten(), X, device_ids)

# %% [markdown] lang="ja"
# 記事は「モデルのパラメータは、すべての GPU に同期されている必要があります」と注意していますが、
# そろえるものはありません。DataParallel は**呼び出しのたびに**もとのモデルからレプリカを作り直します。

# %% [markdown] lang="en"
# The document warns that "the model's parameters must be synchronized on all GPUs".
# There is nothing to synchronize: DataParallel builds the replicas from the original
# model **at every call**.

# %%
ran = []  # the modules that ran, kept alive so that their ids stay unique
hook = model.register_forward_hook(lambda module, args, out: ran.append(module))
with torch.no_grad():
    model.fc2.bias += 1.0  # change the original only
    out = dp.data_parallel(model, X, device_ids)
    dp.data_parallel(model, X, device_ids)
    model.fc2.bias -= 1.0
    assert compare.max_abs_diff(out, reference(X) + 1.0) <= 1e-6  # the change arrived
hook.remove()
print("modules that ran in two calls:", len({id(m) for m in ran}))
assert len({id(m) for m in ran}) == 4 and model not in ran  # new replicas each call

# %% [markdown] lang="ja"
# 記事の補足は、`replicate` や `scatter_gather` を「異なる並列処理パターンに対応」する関数としています。
# 実際には `scatter_gather` はモジュール (中に `scatter`、`scatter_kwargs`、`gather`) で、どれも
# `data_parallel` 自身の部品です。

# %% [markdown] lang="en"
# The document's notes call `replicate` and `scatter_gather` functions for "different
# parallel-processing patterns". In fact `scatter_gather` is a module (holding `scatter`,
# `scatter_kwargs` and `gather`), and they are all parts of `data_parallel` itself.

# %% tags=["hide-input"]
import torch.nn.parallel.scatter_gather as scatter_gather

print("replicate:", type(torch.nn.parallel.replicate).__name__,
      "| scatter_gather:", type(scatter_gather).__name__, scatter_gather.__all__)
assert inspect.isfunction(torch.nn.parallel.replicate)
assert inspect.ismodule(scatter_gather)
assert scatter_gather.__all__ == ["scatter", "scatter_kwargs", "gather"]

# %% [markdown] lang="ja"
# ## DataParallel が毎ステップ払うもの
#
# DataParallel の学習の 1 ステップは、4 段階をすべて繰り返します。`dp.scatter_kwargs`、`dp.replicate`、
# `dp.gather` をコピーした値を数える版に差し替えて、2 台の模擬デバイスで 3 ステップ学習します。グラフは
# ステップごとのコピーの数です。
#
# **予想してから実行:** 3 ステップで、モデルは何回複製され、1 回ごとに何個の値がコピーされるでしょうか
# (モデルのパラメータは 2110 個です)?

# %% [markdown] lang="en"
# ## What DataParallel pays at every step
#
# A training step with DataParallel repeats all four steps. Versions of
# `dp.scatter_kwargs`, `dp.replicate` and `dp.gather` that count the values they copy
# train 3 steps on 2 simulated devices; the chart shows each step's copies.
#
# **Predict, then run:** in 3 steps, how many times is the model replicated, and how many
# values does each replication copy (the model has 2110 parameters)?

# %%
from unittest import mock

trained = copy.deepcopy(model)  # leave `model` as the cells above left it
optimizer = torch.optim.SGD(trained.parameters(), lr=0.01)
copied = []  # (which step of the four, values it copied), in the order they ran
real = {name: getattr(dp, name) for name in ("scatter_kwargs", "replicate", "gather")}


def scatter_and_count(inputs, *args, **kwargs):
    per_device, kw = real["scatter_kwargs"](inputs, *args, **kwargs)
    copied.append(("scatter", sum(x.numel() for chunk in per_device for x in chunk)))
    return per_device, kw


def replicate_and_count(module, *args, **kwargs):
    replicas = real["replicate"](module, *args, **kwargs)
    # every replica but device 0's, which shares the original's memory
    copies = replicas[1:]
    copied.append(("replicate", sum(w.numel() for r in copies for w in weights(r))))
    return replicas


def gather_and_count(outputs, *args, **kwargs):
    copied.append(("gather", sum(o.numel() for o in outputs)))
    return real["gather"](outputs, *args, **kwargs)


with mock.patch.multiple(dp, scatter_kwargs=scatter_and_count,
                         replicate=replicate_and_count, gather=gather_and_count):
    for _ in range(3):
        optimizer.zero_grad()
        criterion(dp.data_parallel(trained, X, device_ids), y).backward()
        optimizer.step()
per_step = {labkit.t("train_step_n", i=i + 1): dict(copied[3 * i : 3 * i + 3])
            for i in range(len(copied) // 3)}
assert [name for name, _ in copied] == ["scatter", "replicate", "gather"] * 3
assert [s["replicate"] for s in per_step.values()] == [2110] * 3  # the whole model
assert [s["scatter"] for s in per_step.values()] == [1000] * 3  # X: 100 samples x 10
assert [s["gather"] for s in per_step.values()] == [1000] * 3  # 100 outputs x 10
fig = plots.bar_chart(per_step, ylabel="values_copied", title="dp_pays_title",
                      fmt="{:.0f}")

# %% [markdown] lang="ja"
# DataParallel が 1 デバイスに加えて払うものは、どれも上のセルで確かめました。
#
# - **1 つのプロセスの中のスレッド** (3.): Python を実行できるのは GIL を持つ 1 本のスレッドだけなので、
#   小さな演算が多いモデルでは、スレッドが待ち合います。
# - **毎ステップの複製**: モデル全体 (2110 個の値) を、デバイス 0 以外のレプリカへコピーします。
# - **分割と集約** (1. と 4.)。
# - **デバイス 0 の負担**: 出力全体、損失、勾配の合計、オプティマイザの更新がすべてデバイス 0 に集まります。
#
# DDP (レッスン 03) はランクごとに別のプロセスを使い、モデルの複製は作るときの 1 回だけです。その代わり、毎ステップ
# 勾配を all-reduce します。どちらが速いかは、レッスン 03 で測ります。

# %% [markdown] lang="en"
# What DataParallel pays on top of one device, all shown above:
#
# - **Threads in one process** (step 3): only the thread holding the one GIL runs Python
#   code, so with many small operations the threads wait for each other.
# - **Replication at every step**: the whole model (2110 values) to every replica but
#   device 0's.
# - **Scattering and gathering** (steps 1 and 4).
# - **Device 0's load**: the whole output, the loss, the summed gradients and the
#   optimizer's update all land there.
#
# DDP (lesson 03) runs each rank in its own process and copies the model once, when it is
# built; in exchange it all-reduces the gradients at every step. Lesson 03 times both.

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
# PyTorch のドキュメント (CUDA semantics と DDP のチュートリアル) の挙げる理由は 3 つで、どれもこのレッスンで
# 確かめました: スレッドが取り合う GIL、呼び出しのたびのモデルの複製、入力の scatter と出力の gather です。
# ドキュメントは、DataParallel は「1 台のマシンでも DDP より遅いのがふつう」とも書いています。2 つの時間は
# レッスン 03 で比べます。

# %% [markdown] lang="en"
# PyTorch's documentation (CUDA semantics, the DDP tutorial) gives three reasons, all
# shown above: the GIL the threads share, a copy of the model at every call, and
# scattering and gathering. It adds that DataParallel "is usually slower than
# DistributedDataParallel even on a single machine"; lesson 03 times the two.

# %% [markdown] lang="ja"
# <details><summary>ドキュメントの原文</summary>
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
#   出力の gather の余分な手間のため、DataParallel は 1 台のマシンでも DDP より遅いのがふつう)
#
# </details>

# %% [markdown] lang="en"
# <details><summary>The documentation's words</summary>
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
# </details>

# %% [markdown] lang="ja" tags=["summary"]
# ## 覚えておくこと
#
# - **DataParallel は 1 つのプロセスの中の 4 段階です**: `scatter`、`replicate`、`parallel_apply`、`gather`。
# - **分けるのはデータで、モデルは分けません**。どのレプリカもモデル全体を持ちます。
# - **レプリカの勾配は、もとのモデルの `.grad` で足し合わされ**、1 デバイスの勾配と一致します。
# - **使うのはクラス版か関数版の一方で、渡すのはバッチ全体です**。CPU では `nn.DataParallel` はモデルを 1 回呼ぶだけです。
# - **DataParallel は毎ステップ、複製、分割、集約をし、1 つの GIL を取り合います**。そのため PyTorch は DDP を勧めます。
#
# 記事 004 の主張ごとの判定は、最後のレッスンの正誤表にあります。

# %% [markdown] lang="en" tags=["summary"]
# ## What to remember
#
# - **DataParallel is four steps inside one process**: `scatter`, `replicate`,
#   `parallel_apply`, `gather`.
# - **The data is split, never the model**: every replica holds the whole model.
# - **The replicas' gradients are summed into the original model's `.grad`**, equal to
#   one device's.
# - **Use the class or the function, not both, and hand it the whole batch**; on a CPU
#   `nn.DataParallel` just calls the model once.
# - **Every step, DataParallel copies the model, scatters, gathers, and shares one
#   GIL**: that is why PyTorch recommends DDP.
#
# Each of doc 004's claims, with its verdict, is in the errata, the course's last lesson.

# %% [markdown] lang="ja" tags=["self-check"]
# ## 確認問題
#
# 答えを決めてから、折りたたみを開いてください。

# %% [markdown] lang="en" tags=["self-check"]
# ## Self-check
#
# Choose your answers before opening their folds.

# %% tags=["self-check"]
from labkit import selfcheck

selfcheck.show("02_data_parallel")

# %% tags=["self-check"]
# Your answers, "a", "b", "c" or "d" for each question; then run this cell.
my_answers = {1: None, 2: None, 3: None}
selfcheck.check("02_data_parallel", my_answers)
