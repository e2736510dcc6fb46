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
# # 11 シャードするデータ並列: ZeRO を手で書き、FSDP2 と比べる
#
# DDP はどのランクにもモデルのパラメータ、勾配、オプティマイザの状態を丸ごと持たせます。ZeRO と FSDP は、
# それらをランクの間で分けて (シャードして) 持ちます。レッスン 06 では `ZeroRedundancyOptimizer`
# (ステージ 1) を使いました。このレッスンでは、ステージ 1〜3 を自分で書き、1 プロセスの学習と
# 比べます。
#
# このレッスンで見ること:
# 1. メモリはどこに使われるか: Adam で学習するときの 1 ランクあたりのバイト数。式と、ランクで測った値
# 2. ZeRO のステージ 1、2、3 を手で書く。数ステップのあとのパラメータが 1 プロセスと等しいこと
# 3. 1 ステップで送るバイト数: all-reduce = reduce-scatter + all-gather、ステージ 3 は DDP の 1.5 倍
# 4. PyTorch の FSDP2 (`fully_shard`)
# 5. いつシャードするか
#
# コードのセルが表示する出力は英語のままです (確認のメッセージは日本語です)。

# %% [markdown] lang="en"
# # 11 Sharded data parallelism: ZeRO by hand, then FSDP2
#
# DDP gives every rank a whole copy of the model's parameters, gradients and optimizer
# state. ZeRO and FSDP share them out: each rank holds a shard. Lesson 06 used
# `ZeroRedundancyOptimizer` (stage 1); this lesson writes stages 1 to 3 by hand and
# checks them against one process.
#
# In this lesson:
# 1. where the memory goes: bytes per rank when training with Adam, as a formula and
#    measured on the ranks
# 2. ZeRO stages 1, 2 and 3 written by hand; after several steps their parameters equal
#    one process's
# 3. bytes sent per step: all-reduce = reduce-scatter + all-gather, and stage 3 sends
#    1.5 times DDP's bytes
# 4. PyTorch's FSDP2 (`fully_shard`)
# 5. when to shard
#
# The code cells print in English in both editions; checks follow the notebook's
# language.

# %%
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %%
from labkit import cluster, exercises

ranks = cluster.start(2, background=True)  # the ranks boot while you read

# %% [markdown] lang="ja"
# ## メモリはどこに使われるか
#
# (準備中) Adam で学習するとき、パラメータ、勾配、オプティマイザの状態がそれぞれ何バイトになるかを見ます。

# %% [markdown] lang="en"
# ## Where the memory goes
#
# (In preparation.) How many bytes the parameters, gradients and optimizer state take
# when training with Adam.

# %% [markdown] lang="ja"
# ## 演習: 1 ランクあたりのバイト数を予測する
#
# パラメータが Ψ 個のモデルを fp32 の Adam で学習するとき、1 つのランクが持つモデルの状態
# (パラメータ、勾配、オプティマイザの状態) は何バイトでしょうか。`bytes_per_rank(params, world_size, stage)`
# を書いてください。`params` は Ψ、`world_size` はランクの数 N、`stage` は `"DDP"`、`"ZeRO-1"`、
# `"ZeRO-2"`、`"ZeRO-3"` のどれかです。
#
# - fp32 の値は 1 つ 4 バイトです。Adam が 1 パラメータあたりに何を持つかは、1 ステップのあとの
#   `optimizer.state[p]` を見るとわかります。
# - ZeRO-1 はオプティマイザの状態を、ZeRO-2 はさらに勾配を、ZeRO-3 はさらにパラメータを、N 個のランクで
#   分けて持ちます (シャードします)。
# - 活性値は数えません。Adam がパラメータのテンソルごとに持つ `step` (要素が 1 つのテンソル) も数えません。
# - Ψ が N で割り切れないときも、Ψ ÷ N は小数のままにします (パディングは数えません)。
#
# 確認のセルは、Ψ = 10〜75 億、N = 1〜64 (Ψ を割り切れない N も含みます) で、答えを labkit の式
# (`sharding.memory_per_rank`) と比べます。この関数はカーネルで実行されます。
#
# 演習のセルを書き換えて実行してから、確認のセルを実行します。正しければ「正解です」と表示され、
# 違っていれば、どこが違うかがヒントとともに表示されます。完全版のノートブックでは演習のすぐあとに解答のセルが
# ありますが、まず自分で解いてみてください。

# %% [markdown] lang="en"
# ## Exercise: predict the bytes per rank
#
# Training a model of Ψ parameters in fp32 with Adam, how many bytes of model state
# (parameters, gradients, optimizer state) does one rank hold? Write
# `bytes_per_rank(params, world_size, stage)`: `params` is Ψ, `world_size` the number
# of ranks N, and `stage` one of `"DDP"`, `"ZeRO-1"`, `"ZeRO-2"`, `"ZeRO-3"`.
#
# - An fp32 value takes 4 bytes. What Adam keeps per parameter, `optimizer.state[p]`
#   shows after one step.
# - ZeRO-1 shards the optimizer state over the N ranks, ZeRO-2 the gradients too, and
#   ZeRO-3 the parameters too.
# - Activations are not counted, nor is the `step` that Adam keeps per parameter tensor
#   (a tensor of one value).
# - When N does not divide Ψ, keep Ψ ÷ N a fraction (padding is not counted).
#
# The check compares your answer with labkit's formula (`sharding.memory_per_rank`)
# for Ψ from 10 to 7.5 billion and N from 1 to 64, including N that do not divide Ψ.
# The function runs in the kernel.
#
# Edit and run the exercise cell, then run the check cell. It says "Correct" when the
# answer is right, and otherwise what is wrong, with a hint. In the full notebooks a
# solution cell follows each exercise: try on your own first.

# %% tags=["exercise"]
def bytes_per_rank(params, world_size, stage):
    """Model-state bytes one rank holds under `stage`, training in fp32 with Adam."""
    return None  # TODO: parameters + gradients + Adam's state, each whole or / world_size

# %% tags=["solution"]
def bytes_per_rank(params, world_size, stage):
    """Model-state bytes one rank holds under `stage`, training in fp32 with Adam."""
    parameters = gradients = 4 * params  # float32
    optimizer = 2 * 4 * params  # Adam: exp_avg and exp_avg_sq, a float32 each
    n = world_size
    return {"DDP": parameters + gradients + optimizer,  # everything on every rank
            "ZeRO-1": parameters + gradients + optimizer / n,
            "ZeRO-2": parameters + (gradients + optimizer) / n,
            "ZeRO-3": (parameters + gradients + optimizer) / n}[stage]

# %%
exercises.grade_bytes_per_rank(bytes_per_rank)

# %% [markdown] lang="ja"
# ## ZeRO ステージ 1 を手で書く
#
# (準備中) 各ランクが、オプティマイザの状態とパラメータの自分のシャードだけを更新します。

# %% [markdown] lang="en"
# ## ZeRO stage 1 by hand
#
# (In preparation.) Each rank updates only its shard of the optimizer state and the
# parameters.

# %% [markdown] lang="ja"
# ## 演習: ステージ 2 の勾配の reduce-scatter
#
# all-reduce のあとは、どのランクも平均した勾配の全体を持ちます。ステージ 2 の各ランクが持つのは、
# 自分のシャードの分の勾配だけです。それを直接受け取るのが reduce-scatter です。各ランクが平坦化した
# 勾配の全体を出し、ランク r は、全ランクの勾配の r 番目の部分を足し合わせたものだけを受け取ります。
# all-reduce は、reduce-scatter のあとに all-gather (各ランクの部分を全ランクに配る) を続けたものと
# 同じ結果になります。ステージ 2 に要るのは、その前半だけです。
#
# `shard_of_mean_gradient(flat_grad, rank, world_size)` を書いてください。`flat_grad` はこのランクの
# 平坦化した勾配で、要素の数は world_size で割り切れます。全ランクで平均した勾配のうち、このランクの
# シャード (`rank * k` 番目から k 個、k = 要素の数 ÷ world_size) を新しいテンソルとして返します。
# `dist.reduce_scatter_single(output, input)` を 1 回だけ使います (以前の torch では
# `reduce_scatter_tensor` という名前でした。今も使えますが、非推奨の警告が出ます)。reduce-scatter は
# ランクの番号から受け取る部分を決めるので、`rank` は使わなくても書けます。
# `flat_grad` の一部 (ビュー) を返すと、勾配全体のメモリが残ったままになるので、返すのは新しい
# テンソルにします。
#
# 確認のセルは、ランクごとに別の乱数で作った 4 つの長さの勾配でこの関数を呼び、カーネルで別に計算した
# 平均のシャードと比べます。`comm_counting.CollectiveLog` で集団通信も記録し、送ったのが
# reduce-scatter 1 回だけかを確かめます。和を求めてから world_size で割っても、`op=dist.ReduceOp.AVG`
# で平均しても構いません (gloo は reduce-scatter の AVG に対応しています)。確認はこのレッスンの
# 2 ランクで行うので、world_size の代わりに 2 と書いても見分けられません。
# 関数は各ランクで定義し、下の `Zero2` がそれを呼ぶので、セルは `%%px` です。

# %% [markdown] lang="en"
# ## Exercise: stage 2's gradient reduce-scatter
#
# After an all-reduce every rank holds the whole averaged gradient. Under stage 2 a
# rank holds only its shard's part of the gradient, and a reduce-scatter hands it just
# that: every rank puts in its whole flat gradient, and rank r receives only the sum
# over the ranks of their r-th pieces. An all-reduce gives the same result as a
# reduce-scatter followed by an all-gather (which hands every rank's piece to all
# ranks); stage 2 needs only the first half.
#
# Write `shard_of_mean_gradient(flat_grad, rank, world_size)`. `flat_grad` is this
# rank's flat gradient; world_size divides its number of values. Return, as a new
# tensor, this rank's shard of the gradient averaged over the ranks: k values from
# value `rank * k` on, k = number of values ÷ world_size. Use one
# `dist.reduce_scatter_single(output, input)` (older torch calls it
# `reduce_scatter_tensor`; that name still works, with a deprecation warning). The
# reduce-scatter picks each rank's piece from its rank, so you can do without `rank`.
# Return a new tensor: a view of `flat_grad` would keep the whole gradient's memory
# alive.
#
# The check calls your function with gradients of four lengths, seeded differently on
# each rank, and compares with the shard of the mean computed separately in the
# kernel. It records the collectives with `comm_counting.CollectiveLog` and checks
# that one reduce-scatter is all you send. Summing then dividing by world_size and
# averaging with `op=dist.ReduceOp.AVG` are both fine (gloo supports AVG for a
# reduce-scatter). The check runs on this lesson's 2 ranks, so it cannot tell
# world_size from a 2 written in its place. The function is defined on the ranks,
# where `Zero2` below calls it, so the cell is a `%%px` cell.

# %% tags=["exercise"]
# %%px
def shard_of_mean_gradient(flat_grad, rank, world_size):
    """This rank's shard of the gradient averaged over the ranks, by a reduce-scatter."""
    # TODO: reduce-scatter flat_grad into a new tensor of k values, k = numel //
    # world_size, and average
    return None

# %% tags=["solution"]
# %%px
def shard_of_mean_gradient(flat_grad, rank, world_size):
    """This rank's shard of the gradient averaged over the ranks, by a reduce-scatter."""
    k = flat_grad.numel() // world_size  # values in a shard
    shard = torch.empty(k, dtype=flat_grad.dtype, device=flat_grad.device)
    # Rank r receives the ranks' sum of values r * k to (r + 1) * k - 1: its own shard.
    dist.reduce_scatter_single(shard, flat_grad)
    return shard / world_size  # the sum -> the mean

# %%
exercises.grade_gradient_shard(ranks)

# %% [markdown] lang="ja"
# ## ZeRO ステージ 2 を手で書く
#
# (準備中) 各ランクは勾配も自分のシャードだけを持ちます。

# %% [markdown] lang="en"
# ## ZeRO stage 2 by hand
#
# (In preparation.) Each rank keeps only its shard of the gradients too.

# %% [markdown] lang="ja"
# ## ZeRO ステージ 3 を手で書く
#
# (準備中) パラメータもシャードだけを持ち、各層の順伝播と逆伝播の直前に集めます。

# %% [markdown] lang="en"
# ## ZeRO stage 3 by hand
#
# (In preparation.) The parameters are held as shards too, gathered just before each
# layer's forward and backward pass.

# %% [markdown] lang="ja"
# ## 演習: ZeRO-3 の層が逆伝播のあとで解放する
#
# (準備中) 集めたパラメータを、順伝播と逆伝播のあとで解放します。

# %% [markdown] lang="en"
# ## Exercise: a ZeRO-3 layer frees after backward
#
# (In preparation.) Free the gathered parameters after the forward and the backward
# pass.

# %% [markdown] lang="ja"
# ## 1 ステップで送るバイト数
#
# (準備中) DDP と各ステージが 1 ステップで送るバイト数を数えます。

# %% [markdown] lang="en"
# ## Bytes sent per step
#
# (In preparation.) Count the bytes DDP and each stage send in a step.

# %% [markdown] lang="ja"
# ## FSDP2: fully_shard
#
# (準備中) 同じ学習を PyTorch の `fully_shard` で行います。

# %% [markdown] lang="en"
# ## FSDP2: fully_shard
#
# (In preparation.) The same training with PyTorch's `fully_shard`.

# %% [markdown] lang="ja"
# ## いつシャードするか
#
# (準備中) ランクの数に対する 1 ランクあたりのメモリと、シャードが得になる境目を見ます。

# %% [markdown] lang="en"
# ## When to shard
#
# (In preparation.) Memory per rank against the number of ranks, and where sharding
# starts to pay.

# %% [markdown] lang="ja"
# ## まとめ
#
# (準備中)

# %% [markdown] lang="en"
# ## Summary
#
# (In preparation.)

# %%
ranks.stop()
