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
from labkit import cluster

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
# (準備中) パラメータの数、ランクの数、ステージから、1 ランクあたりのバイト数を予測します。

# %% [markdown] lang="en"
# ## Exercise: predict the bytes per rank
#
# (In preparation.) Predict the bytes per rank from the number of parameters, the
# number of ranks and the stage.

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
# (準備中) 勾配の平均のうち、自分のシャードだけを reduce-scatter で受け取る関数を書きます。

# %% [markdown] lang="en"
# ## Exercise: stage 2's gradient reduce-scatter
#
# (In preparation.) Write the function that receives only this rank's shard of the
# mean gradient, with a reduce-scatter.

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
