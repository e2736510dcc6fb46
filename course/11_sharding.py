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
# # 11 シャーディングによるデータ並列: ZeRO を手で書き、FSDP2 と比べる
#
# DDP はどのランクにもモデルのパラメータ、勾配、オプティマイザの状態を丸ごと持たせます。ZeRO と FSDP は、
# それらをランクの間で分割して (シャードして) 持ちます。レッスン 06 では `ZeroRedundancyOptimizer`
# (ステージ 1) を使いました。このレッスンでは、ステージ 1〜3 を自分で書き、1 プロセスの学習と
# 比べます。
#
# このレッスンで見ること:
# 1. メモリは何に使われるか: Adam で学習するときの 1 ランクあたりのバイト数。式と、ランクで測った値
# 2. ZeRO のステージ 1、2、3 を手で書く。数ステップのあとのパラメータが 1 プロセスと等しいこと
# 3. 1 ステップで送るバイト数: all-reduce = reduce-scatter + all-gather、リングではステージ 3 が DDP の
#    1.5 倍。gloo が実際に送るバイト数
# 4. PyTorch の FSDP2 (`fully_shard`)
# 5. いつシャードするか
#
# コードのセルが表示する出力は英語のままです (図と確認のメッセージは日本語です)。

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
# 3. bytes sent per step: all-reduce = reduce-scatter + all-gather, and in a ring stage 3
#    sends 1.5 times DDP's bytes; what gloo really sends
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
import torch

from labkit import cluster, exercises, fsdp, models, plots, sharding

ranks = cluster.start(2, background=True)  # the ranks boot while you read

# %% [markdown] lang="ja"
# ## メモリは何に使われるか
#
# Ψ 個のパラメータのモデルを float32 の Adam で学習するとき、各ランクが持つ「モデルの状態」は次の
# 3 つです (活性値は含みません)。
#
# - パラメータ: 1 つ 4 バイトで 4Ψ
# - 勾配: パラメータと同じ形で 4Ψ
# - Adam の状態: `exp_avg` (勾配の移動平均) と `exp_avg_sq` (勾配の二乗の移動平均)。どちらも
#   パラメータと同じ形で、合わせて 8Ψ。3 つ目の `step` (何ステップ目か) は、パラメータのテンソル
#   1 つにつき 0 次元のテンソル 1 つ (float32 で 4 バイト) です (`torch/optim/adam.py` の初期化。
#   `capturable` も `fused` も使わなければ CPU に置かれます)。要素の数ではなくテンソルの数で決まるので、
#   式には入れず、測った値との差として数えます。
#
# DDP では、どのランクもこの 16Ψ を丸ごと持ちます。ZeRO (Rajbhandari ほか、2020) は、ステージ 1 で
# オプティマイザの状態を、ステージ 2 でさらに勾配を、ステージ 3 でさらにパラメータを、N 個のランクで
# 分割して持ちます。分割した部分は 1 ランクあたり 1/N になります。
#
# | | パラメータ | 勾配 | Adam の状態 | 合計 |
# |---|---|---|---|---|
# | DDP | 4Ψ | 4Ψ | 8Ψ | 16Ψ |
# | ZeRO-1 | 4Ψ | 4Ψ | 8Ψ/N | 8Ψ + 8Ψ/N |
# | ZeRO-2 | 4Ψ | 4Ψ/N | 8Ψ/N | 4Ψ + 12Ψ/N |
# | ZeRO-3 | 4Ψ/N | 4Ψ/N | 8Ψ/N | 16Ψ/N |
#
# `sharding.memory_parts(Ψ, N, **sharding.FP32_ADAM)` がこの表を計算します (レッスン 09 の
# `sharding.memory_per_rank` はその合計です。`memory_per_rank` の引数の既定値は、ZeRO の論文の
# 混合精度の場合の値です)。
# 次のセルは、Adam が本当にこの 3 つを持つことを確かめ、このレッスンでメモリを測る MLP
# (幅 63、隠れ層 2 つ) について式の値を出します。

# %% [markdown] lang="en"
# ## Where the memory goes
#
# Training a model of Ψ parameters with Adam in float32, each rank holds three kinds of
# "model states" (activations not included):
#
# - parameters: 4 bytes each, 4Ψ
# - gradients: shaped like the parameters, 4Ψ
# - Adam's state: `exp_avg` (the moving average of the gradient) and `exp_avg_sq` (of
#   its square), both shaped like the parameters, 8Ψ together. The third, `step` (the
#   step count), is one 0-dimensional tensor per parameter tensor (float32, 4 bytes;
#   see the initialization in `torch/optim/adam.py`: on the CPU unless `capturable` or
#   `fused`). It grows with the number of tensors, not of elements, so the formula
#   leaves it out and the measurement counts it as a difference.
#
# Under DDP every rank holds all 16Ψ. ZeRO (Rajbhandari et al., 2020) shares out over
# the N ranks the optimizer state in stage 1, the gradients too in stage 2, and the
# parameters too in stage 3; each rank holds 1/N of what is shared out.
#
# | | parameters | gradients | Adam's state | total |
# |---|---|---|---|---|
# | DDP | 4Ψ | 4Ψ | 8Ψ | 16Ψ |
# | ZeRO-1 | 4Ψ | 4Ψ | 8Ψ/N | 8Ψ + 8Ψ/N |
# | ZeRO-2 | 4Ψ | 4Ψ/N | 8Ψ/N | 4Ψ + 12Ψ/N |
# | ZeRO-3 | 4Ψ/N | 4Ψ/N | 8Ψ/N | 16Ψ/N |
#
# `sharding.memory_parts(Ψ, N, **sharding.FP32_ADAM)` computes the table (lesson 09's
# `sharding.memory_per_rank` is its sum; its defaults are the ZeRO paper's mixed
# precision). The next cell checks that Adam holds exactly these three, and gives the
# formula's values for the MLP whose memory this lesson measures (width 63, two hidden
# layers).

# %%
model = models.WideMLP(10, 63, 2, 10)
psi = models.count_params(model)
adam = torch.optim.Adam(model.parameters(), lr=1e-3)
model(torch.randn(4, 10)).sum().backward()
adam.step()
state = adam.state[model.net[0].weight]
print({name: (tuple(v.shape), str(v.dtype)) for name, v in state.items()})
assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
assert state["exp_avg"].shape == state["exp_avg_sq"].shape == model.net[0].weight.shape
assert state["step"].shape == () and state["step"].dtype == torch.float32
assert state["step"].device.type == "cpu"  # neither capturable nor fused
assert len(adam.state) == len(list(model.parameters()))  # one step tensor per tensor

formula = sharding.memory_parts(psi, 2, **sharding.FP32_ADAM)
print(f"psi = {psi} parameters, 2 ranks: bytes per rank")
for stage, parts in formula.items():
    print(f"{stage:7s}", {k: int(v) for k, v in parts.items()}, int(sum(parts.values())))
assert sum(formula["DDP"].values()) == 16 * psi
assert sum(formula["ZeRO-1"].values()) == 8 * psi + 8 * psi / 2
assert sum(formula["ZeRO-2"].values()) == 4 * psi + 12 * psi / 2
assert sum(formula["ZeRO-3"].values()) == 16 * psi / 2

# %% [markdown] lang="ja"
# 次に、各ランクで実際に測ります。`sharding.held_bytes` は、テンソルが持つメモリ (ストレージ) を数えます。
# ビューや共有された重みのように同じストレージを共有するテンソルは 1 回だけ、大きさを 0 にした
# (解放した) ストレージは 0 と数えます。
#
# このレッスンの学習クラスは、どれも同じように使います。`T(model, lr=...)` で作り (ランク 0 の重みを全ランクに
# 配ります)、`T.step(X, y, loss_fn)` で、このランクのぶんのバッチで 1 ステップ進めます。`T.held` には、
# Adam が動く直前に持っていたパラメータ、勾配、Adam の状態のバイト数が残ります
# (`sharding.held_by_part`)。まず、比べる基準の `DDPAdam` (torch の DDP と Adam) です。
# `gradient_as_bucket_view=True` にすると、勾配は DDP のバケット (all-reduce に使うバッファ) の
# ビューになり、別のコピーを持ちません。

# %% [markdown] lang="en"
# Now measured on the ranks. `sharding.held_bytes` counts the memory (storage) the
# tensors hold: tensors that share a storage, like views or a tied weight, once; a
# storage resized to 0 (freed) as 0.
#
# Every trainer in this lesson is used the same way: `T(model, lr=...)` builds it (and
# hands rank 0's weights to every rank), and `T.step(X, y, loss_fn)` takes one step on
# this rank's part of the batch. `T.held` keeps the bytes of parameters, gradients and
# Adam's state the rank held just before Adam's step (`sharding.held_by_part`). First
# the baseline, `DDPAdam`: torch's DDP and Adam. With `gradient_as_bucket_view=True`
# the gradients are views of DDP's buckets (the buffers it all-reduces): no second
# copy.

# %%
# %%px
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import comm_counting, models, sharding


# %%
# %%px
class DDPAdam:
    """The baseline: torch's DDP, and a whole Adam on every rank."""

    def __init__(self, model, lr=1e-3):
        self.model = model
        # The gradients become views of DDP's buckets, so they are held once.
        self.ddp = DDP(model, gradient_as_bucket_view=True)  # broadcasts rank 0's weights
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    def step(self, X, y, loss_fn):
        loss = loss_fn(self.ddp(X), y)
        loss.backward()  # DDP all-reduces the gradients bucket by bucket, and averages
        self.held = self.memory()  # what this rank holds when Adam runs
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.detach()

    def memory(self):
        params = list(self.model.parameters())
        return sharding.held_by_part(params, [p.grad for p in params], self.optimizer)

    def full_parameters(self):
        return [p.detach().clone() for p in self.model.parameters()]

# %%
# %%px
def memory_run(make, steps=2):
    """Train the MLP for `steps` steps with trainer `make`; return the trainer."""
    torch.manual_seed(rank)  # each rank starts different: the trainer must broadcast
    trainer = make(models.WideMLP(10, 63, 2, 10))
    g = torch.Generator().manual_seed(0)  # the same batches on every rank
    per = 16 // world_size
    for _ in range(steps):
        X, y = torch.randn(16, 10, generator=g), torch.randn(16, 10, generator=g)
        trainer.step(X[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per],
                     models.MyLoss())
    return trainer


ddp = memory_run(DDPAdam)
params = list(ddp.model.parameters())
psi = sum(p.numel() for p in params)
formula = sharding.memory_parts(psi, world_size, **sharding.FP32_ADAM)["DDP"]
print(f"rank {rank}: measured {ddp.held}, formula {formula}")
ddp.ddp(torch.randn(8, 10)).sum().backward()  # one more backward, to look at .grad
assert len({p.grad.untyped_storage().data_ptr() for p in params}) == 1  # one bucket
ddp.optimizer.zero_grad()
assert ddp.held["parameters"] == formula["parameters"]
assert ddp.held["gradients"] == formula["gradients"]
# Adam's state: exp_avg and exp_avg_sq, plus one 4-byte step per parameter tensor
assert ddp.held["optimizer"] == formula["optimizer"] + 4 * len(params)

# %% [markdown] lang="ja"
# DDP では、測った値が式と一致します。Adam の状態だけは、`step` のぶん (4 バイト × パラメータの
# テンソルの数) だけ多くなります。

# %% [markdown] lang="en"
# Under DDP the measurement equals the formula, except Adam's state, which holds
# 4 bytes more per parameter tensor: the `step` counters.

# %% [markdown] lang="ja"
# ## 演習: 1 ランクあたりのバイト数を予測する
#
# パラメータが Ψ 個のモデルを float32 の Adam で学習するとき、1 つのランクが持つモデルの状態
# (パラメータ、勾配、オプティマイザの状態) は何バイトでしょうか。`bytes_per_rank(params, world_size, stage)`
# を書いてください。`params` は Ψ、`world_size` はランクの数 N、`stage` は `"DDP"`、`"ZeRO-1"`、
# `"ZeRO-2"`、`"ZeRO-3"` のどれかです。
#
# - float32 の値は 1 つ 4 バイトです。Adam が 1 パラメータあたりに何を持つかは、1 ステップのあとの
#   `optimizer.state[p]` を見るとわかります。
# - ZeRO-1 はオプティマイザの状態を、ZeRO-2 はさらに勾配を、ZeRO-3 はさらにパラメータを、N 個のランクで
#   分割して持ちます (シャードします)。
# - 活性値は数えません。Adam がパラメータのテンソルごとに持つ `step` (要素が 1 つのテンソル) も数えません。
# - Ψ が N で割り切れないときも、Ψ ÷ N は小数のままにします (パディングは数えません)。
#
# 確認のセルは、Ψ = 10 から 75 億まで、N = 1〜64 (Ψ を割り切れない N も含みます) で、答えを labkit の式
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
# ステージ 1 では、各ランクが Adam の状態を自分のシャードのぶんだけ持ちます。1 ステップは次のとおりです。
#
# 1. 各ランクが自分のバッチで順伝播と逆伝播をします (DDP と同じです)。
# 2. 勾配を平均します。ただし、各ランクが更新するのは自分のシャードだけなので、要るのは平均のうち
#    自分のシャードの部分だけです。そこで all-reduce ではなく **reduce-scatter** を使います
#    (ZeRO の論文もそうします)。reduce-scatter は全ランクのテンソルを足し、結果を N 個に分けて、
#    ランク r には r 番目だけを渡します。リングの all-reduce は reduce-scatter と all-gather を続けた
#    ものなので、all-reduce を使うと、使わない部分まで受け取ることになります。
# 3. 自分のシャードを Adam で更新します。
# 4. **all-gather** で、各ランクが更新したシャードを全ランクに配ります。全ランクが新しいパラメータの
#    全体を持ちます。
#
# reduce-scatter と all-gather を 1 回ずつで、DDP の all-reduce 1 回と同じ量を送ります
# (「1 ステップで送るバイト数」で数えます)。
#
# 集団通信は平坦化した 1 本のテンソルで呼ぶので、`sharding.FlatParameters` が下準備をします。学習する
# パラメータを 1 本のバッファ `full` に並べ、各パラメータをそのビューにし、長さが N の倍数になるよう
# 末尾を 0 で埋めます (パディング)。`shard(r)` はランク r の部分 (ビュー) です。`flat_grad()` は勾配を
# 同じ並びの 1 本にまとめ、各 `.grad` をそのビューにします。どの集団通信を、どの部分に、いつ呼ぶかは、
# 下のセルに書いてあります。
#
# この環境の torch 2.13 では、1 本のテンソルへの all-gather と reduce-scatter は
# `dist.all_gather_single` と `dist.reduce_scatter_single` です。以前の名前
# `all_gather_into_tensor` と `reduce_scatter_tensor` も動きますが、非推奨の警告
# (`FutureWarning`) が出ます (次のセルの終わりで確かめます)。

# %% [markdown] lang="en"
# ## ZeRO stage 1 by hand
#
# In stage 1 each rank holds Adam's state for its own shard only. A step:
#
# 1. Each rank runs the forward and backward pass on its batch (as in DDP).
# 2. The gradients are averaged. But each rank updates only its shard, so it needs only
#    its shard of the mean: a **reduce-scatter**, not an all-reduce (as the ZeRO paper
#    does). A reduce-scatter sums the ranks' tensors, cuts the sum into N pieces and
#    gives rank r the r-th. A ring all-reduce is a reduce-scatter followed by an
#    all-gather, so an all-reduce would also bring the pieces this rank never uses.
# 3. Each rank updates its shard with Adam.
# 4. An **all-gather** hands every rank the shards the others updated: everyone holds
#    the whole new parameters.
#
# One reduce-scatter and one all-gather send what DDP's one all-reduce sends (counted in
# "Bytes sent per step").
#
# Collectives work on one flat tensor, so `sharding.FlatParameters` prepares one: it
# lays the trained parameters out in one buffer `full`, makes each parameter a view of
# it, and pads the end with zeros to a multiple of N. `shard(r)` is rank r's piece (a
# view); `flat_grad()` lays the gradients out the same way, in one buffer, and makes
# each `.grad` a view of it. Which collective, on which piece, when: that is in the cell
# below.
#
# In torch 2.13, installed here, the all-gather and reduce-scatter into one tensor are
# `dist.all_gather_single` and `dist.reduce_scatter_single`. The older names,
# `all_gather_into_tensor` and `reduce_scatter_tensor`, still work but warn
# (`FutureWarning`; checked at the end of the next cell).

# %%
# %%px
class Zero1:
    """ZeRO stage 1: each rank keeps Adam's state for its shard of the parameters."""

    def __init__(self, model, lr=1e-3):
        self.model, self.rank = model, dist.get_rank()
        self.world_size = dist.get_world_size()
        for p in model.parameters():  # every rank starts from rank 0's weights
            dist.broadcast(p.detach(), src=0)
        trained = [p for p in model.parameters() if p.requires_grad]  # not the frozen
        self.flat = sharding.FlatParameters(trained, self.world_size)
        # This rank's shard is a view of the flat buffer: Adam updates it in place.
        self.shard = nn.Parameter(self.flat.shard(self.rank))
        self.optimizer = torch.optim.Adam([self.shard], lr=lr)  # the shard's state only

    def step(self, X, y, loss_fn):
        loss = loss_fn(self.model(X), y)
        loss.backward()
        self.reduce_gradients()  # this rank's shard of the mean gradient -> shard.grad
        self.held = self.memory()  # what this rank holds when Adam runs
        self.optimizer.step()  # updates this rank's shard of the parameters
        # Each rank updated its own shard: the all-gather brings it the others'.
        dist.all_gather_single(self.flat.full, self.shard.detach())
        self.model.zero_grad()
        self.shard.grad = None
        return loss.detach()

    def reduce_gradients(self):
        grads = self.flat.flat_grad()  # the whole local gradient; p.grad are views of it
        s = self.flat.shard_numel
        mine = grads[self.rank * s:(self.rank + 1) * s]
        # The sum over the ranks of this rank's piece only (written in place).
        dist.reduce_scatter_single(mine, grads)
        self.shard.grad = mine.div_(self.world_size)  # the sum -> the mean

    def memory(self):
        params = [*self.model.parameters(), self.shard]
        return sharding.held_by_part(params, [p.grad for p in params], self.optimizer)

    def full_parameters(self):
        return [p.detach().clone() for p in self.model.parameters()]

# %% [markdown] lang="ja"
# 確かめ方です。モデルは `models.TiedMLP` で、出力の層が埋め込みの重みを共有し (共有された重み)、
# 学習しない (凍結した) 層を 1 つ持ちます。学習するパラメータは 833 個で、2 で割り切れないので、
# 平坦化したバッファには 1 つパディングが入ります。
#
# 各ランクは、わざと違う乱数のシードでモデルを作ります (`torch.manual_seed(rank)`)。最初にランク 0 の
# 重みを配る (`broadcast`) のを忘れると、ランクごとに違うモデルを学習することになり、下の確認が
# 失敗します。比べる相手は 2 つです。1 プロセスが全体のバッチで学習したもの (ランク 0 と同じ初期値)
# と、2 ランクの torch の DDP (`DDPAdam`) です。3 ステップのあとで比べます。

# %% [markdown] lang="en"
# How it is checked. The model is `models.TiedMLP`: its output layer shares the
# embedding's weight (a tied weight), and one layer is frozen (not trained). It trains
# 833 parameters, an odd number, so the flat buffer holds one padding value.
#
# Each rank deliberately builds its model from a different seed
# (`torch.manual_seed(rank)`). A trainer that forgets to hand out rank 0's weights
# first (`broadcast`) trains a different model on each rank, and the check below fails.
# It compares with two references: one process training on the whole batch (from rank
# 0's starting weights), and torch's DDP on 2 ranks (`DDPAdam`), after 3 steps.

# %%
# %%px
STEPS, BATCH = 3, 16
loss_fn = nn.CrossEntropyLoss()


def batch(step):
    """The whole batch of a step: the same on every rank."""
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, 33, (BATCH,), generator=g),
            torch.randint(0, 33, (BATCH,), generator=g))


def train(make, steps=STEPS):
    """Train TiedMLP with trainer `make` on this rank's part of each batch."""
    torch.manual_seed(rank)  # each rank starts different: the trainer must broadcast
    trainer = make(models.TiedMLP())
    mine = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    for step in range(steps):
        X, y = batch(step)
        trainer.step(X[mine], y[mine], loss_fn)
    return trainer


torch.manual_seed(0)  # rank 0's starting weights
one = models.TiedMLP()
adam = torch.optim.Adam(one.parameters(), lr=1e-3)
for step in range(STEPS):  # one process, the whole batch
    X, y = batch(step)
    loss_fn(one(X), y).backward()
    adam.step()
    adam.zero_grad()
one_process = [p.detach() for p in one.parameters()]
ddp_params = train(DDPAdam).full_parameters()


def compare(trainer):
    """(largest difference from one process, bit for bit equal to DDP's?)"""
    full = trainer.full_parameters()
    diff = max((a - b).abs().max().item() for a, b in zip(full, one_process, strict=True))
    return diff, all(torch.equal(a, b) for a, b in zip(full, ddp_params, strict=True))

# %%
# %%px
import warnings

zero1 = train(Zero1)
diff, bitwise = compare(zero1)
print(f"rank {rank}, ZeRO-1: {diff:.1e} from one process; bit for bit DDP's: {bitwise}")
assert bitwise  # the same bits as torch's DDP on 2 ranks
assert diff <= 1e-6  # one process sums the whole batch in another order
assert zero1.model.head.weight is zero1.model.embed.weight  # still tied
assert len(zero1.optimizer.state[zero1.shard]["exp_avg"]) == zero1.flat.shard_numel
assert zero1.flat.shard_numel * world_size == 834  # 833 parameters and 1 padding

with warnings.catch_warnings(record=True) as caught:  # the older names
    warnings.simplefilter("always")
    dist.all_gather_into_tensor(torch.empty(world_size), torch.ones(1))
    dist.reduce_scatter_tensor(torch.empty(1), torch.ones(world_size))
assert [w.category for w in caught] == [FutureWarning, FutureWarning]

# %% [markdown] lang="ja"
# DDP とはビット単位で一致します。理由は 3 つです。順伝播と各ランクの勾配は同じ計算です。2 ランクでは、
# 足してから 2 で割っても、2 で割ってから足しても (torch の DDP) 誤差なく同じ値になります。Adam は
# 要素ごとの計算なので、シャードごとに更新しても全体を一度に更新しても同じ値になります。1 プロセスとの
# 差は 1e-6 以内です。全体のバッチの勾配を一度に足すのと、半分ずつ足してから平均するのとでは、足す
# 順番が違うので、ビット単位で一致するとは限りません。
#
# 各ランクの Adam の状態は、自分のシャードの 417 個ぶんだけです。
#
# このレッスンのステージ 1〜3 のように、平坦化した 1 本のバッファを同じ長さに切ってシャードにする
# やり方が使えるのは、要素ごとに計算するオプティマイザ (SGD、Adam、AdamW) です。テンソル全体のノルムや
# 形を使うオプティマイザは、切れ目がテンソルの途中にあると、全体を更新したときとは違う更新をします。
# torch の `Adafactor` はパラメータ全体の二乗平均平方根 (RMS) と行・列ごとの統計を、`Muon` は 2 次元の
# 行列全体を使います。次のセルで確かめます。

# %% [markdown] lang="en"
# Bit for bit DDP's: the forward pass and each rank's gradients are the same
# computation; on 2 ranks, summing then halving and halving then summing (torch's DDP)
# give the same value exactly; and Adam works element by element, so updating shards
# gives what updating the whole gives. From one process the difference is within 1e-6:
# summing the whole batch's gradient at once and averaging two halves add in a
# different order, so the bits may differ.
#
# Each rank's Adam state covers its own shard only: 417 values.
#
# Cutting one flat buffer into equal pieces (stages 1 to 3 here) works for optimizers
# that compute element by element (SGD, Adam, AdamW). One that uses a whole tensor's
# norm or shape computes another update where a cut falls inside a tensor: torch's
# `Adafactor` uses the whole parameter's root mean square (RMS) and row and column
# statistics, `Muon` the whole 2-D matrix. The next cell checks it.

# %%
# One step on a 6x4 weight, whole, and as the two halves of its flat buffer that
# stages 1 to 3 would give 2 ranks.
def one_step(optimizer, tensors, grads):
    """The values after one step of `optimizer` on copies of `tensors`, flattened."""
    params = [torch.nn.Parameter(t.clone()) for t in tensors]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    optimizer(params, lr=0.01).step()
    return torch.cat([p.detach().flatten() for p in params])


g = torch.Generator().manual_seed(0)
weight, grad = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
halves = [t.flatten().chunk(2) for t in (weight, grad)]  # the two shards
same = {optimizer.__name__: torch.equal(one_step(optimizer, [weight], [grad]),
                                        one_step(optimizer, *halves))
        for optimizer in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW,
                          torch.optim.Adafactor)}
print(f"the same step on the two shards as on the whole: {same}")
assert same == {"SGD": True, "Adam": True, "AdamW": True, "Adafactor": False}
try:
    torch.optim.Muon(halves[0])
    raise AssertionError("Muon accepted a 1-D shard")
except ValueError as err:  # it orthogonalizes whole matrices only
    print(f"Muon: {err}")

# %% [markdown] lang="ja"
# ## 演習: ステージ 2 の勾配の reduce-scatter
#
# 上の `Zero1.reduce_gradients` は、reduce-scatter の結果を、平坦化した勾配のうち自分の部分
# (ビュー) に書きます。これでは、勾配の全体 (パディングを入れて 4Ψ バイトあまり) が残ったままです。
# ステージ 2 では、自分のシャードの平均を新しいテンソルに受け取り、勾配の全体は解放します。
#
# `shard_of_mean_gradient(flat_grad, rank, world_size)` を書いてください。`flat_grad` はこのランクの
# 平坦化した勾配で、要素の数は world_size で割り切れます。全ランクで平均した勾配のうち、このランクの
# シャード (`rank * k` 番目から k 個、k = 要素の数 ÷ world_size) を、新しいテンソルとして返します。
# `dist.reduce_scatter_single(output, input)` を 1 回だけ使います。reduce-scatter はランクの番号から
# 受け取る部分を決めるので、`rank` は使わなくても書けます。`flat_grad` の一部 (ビュー) を返すと、
# 勾配全体のメモリが残ったままになります。
#
# 確認のセルは、ランクごとに別の乱数で作った、長さの違う 4 つの勾配でこの関数を呼び、カーネルで別に計算した
# 平均のシャードと比べます。`comm_counting.CollectiveLog` で集団通信も記録し、送ったのが
# reduce-scatter 1 回だけかを確かめます。和を求めてから world_size で割っても、`op=dist.ReduceOp.AVG`
# で平均しても構いません (gloo は reduce-scatter の AVG に対応しています。確認のセルの次のセルで、
# ビューが持つメモリとあわせて確かめます)。確認はこのレッスンの
# 2 ランクで行うので、world_size の代わりに 2 と書いても見分けられません。
# 関数は各ランクで定義し、下の `Zero2` がそれを呼ぶので、セルは `%%px` です。

# %% [markdown] lang="en"
# ## Exercise: stage 2's gradient reduce-scatter
#
# `Zero1.reduce_gradients` above writes the reduce-scatter's result into this rank's
# piece (a view) of the flat gradient, so the whole gradient (4Ψ bytes and the
# padding) stays. Stage 2 receives its shard of the mean in a new tensor and lets the
# whole gradient go.
#
# Write `shard_of_mean_gradient(flat_grad, rank, world_size)`. `flat_grad` is this
# rank's flat gradient; world_size divides its number of values. Return, as a new
# tensor, this rank's shard of the gradient averaged over the ranks: k values from
# value `rank * k` on, k = number of values ÷ world_size. Use one
# `dist.reduce_scatter_single(output, input)`. The reduce-scatter picks each rank's
# piece from its rank, so you can do without `rank`. A view of `flat_grad` returned
# would keep the whole gradient's memory alive.
#
# The check calls your function with gradients of four lengths, seeded differently on
# each rank, and compares with the shard of the mean computed separately in the
# kernel. It records the collectives with `comm_counting.CollectiveLog` and checks
# that one reduce-scatter is all you send. Summing then dividing by world_size and
# averaging with `op=dist.ReduceOp.AVG` are both fine (gloo supports AVG for a
# reduce-scatter; the cell after the check shows it, and what a view holds). The
# check runs on this lesson's 2 ranks, so it cannot tell world_size from a 2 written
# in its place. The function is defined on the ranks, where `Zero2` below calls it,
# so the cell is a `%%px` cell.

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

# %%
# %%px
# Two facts the exercise states: gloo's reduce-scatter averages with ReduceOp.AVG
# (the same bits as the sum halved, on 2 ranks), and a view of the flat gradient
# holds the whole buffer's memory, where a copy holds only its own values.
flat = torch.randn(8, generator=torch.Generator().manual_seed(rank))
by_avg, by_sum = torch.empty(4), torch.empty(4)
dist.reduce_scatter_single(by_avg, flat, op=dist.ReduceOp.AVG)
dist.reduce_scatter_single(by_sum, flat)
assert torch.equal(by_avg, by_sum / world_size)
view = flat.chunk(world_size)[rank]
assert sharding.held_bytes([view]) == sharding.held_bytes([flat]) == 4 * 8
assert sharding.held_bytes([view.clone()]) == 4 * 8 // world_size

# %% [markdown] lang="ja"
# ## ZeRO ステージ 2 を手で書く
#
# ステージ 1 では、reduce-scatter のあとも、各ランクが勾配の全体 (4Ψ) を持ち続けます。使うのは
# 自分のシャードだけです。ステージ 2 は勾配も分割して持ちます。reduce-scatter で自分のシャードの平均を
# 受け取ったら、勾配の全体を解放します。`Zero2` は、ステージ 1 と違う `reduce_gradients` だけを書き換え、
# 上の演習の `shard_of_mean_gradient` を呼びます。
#
# この `Zero2` は逆伝播が終わってから勾配をまとめて送るので、送る前の一瞬は勾配の全体があります。
# Adam が動くあいだ持っているのがシャードだけ、という点がステージ 2 です。逆伝播の途中で、
# 層ごとに送って解放するのが、次のステージ 3 の `Zero3` です。

# %% [markdown] lang="en"
# ## ZeRO stage 2 by hand
#
# In stage 1 each rank keeps the whole gradient (4Ψ) after the reduce-scatter, though
# it uses only its shard. Stage 2 shares the gradients out too: once the reduce-scatter
# has brought this rank its shard of the mean, the whole gradient goes. `Zero2` changes
# only what differs from stage 1, `reduce_gradients`, and calls the exercise's
# `shard_of_mean_gradient`.
#
# This `Zero2` sends the gradients after the backward pass, so for a moment before
# sending it holds the whole gradient; what makes it stage 2 is that only the shard is
# held while Adam runs. Sending each layer's gradient during the backward pass, and
# dropping it, is what stage 3's `Zero3` below does.

# %%
# %%px
class Zero2(Zero1):
    """ZeRO stage 2: each rank keeps only its shard of the mean gradient."""

    def reduce_gradients(self):
        grads = self.flat.flat_grad()  # the whole local gradient, padded
        self.model.zero_grad()  # drop the parameters' views of it ...
        self.shard.grad = shard_of_mean_gradient(grads, self.rank, self.world_size)
        del grads  # ... and the whole gradient with them: only the shard stays

# %%
# %%px
zero2 = train(Zero2)
diff, bitwise = compare(zero2)
print(f"rank {rank}, ZeRO-2: {diff:.1e} from one process; bit for bit DDP's: {bitwise}")
print(f"rank {rank}, gradient bytes held when Adam runs: ZeRO-1 "
      f"{zero1.held['gradients']}, ZeRO-2 {zero2.held['gradients']}")
assert bitwise and diff <= 1e-6
assert zero1.held["gradients"] == 4 * zero1.flat.full.numel()  # the whole, padded
assert zero2.held["gradients"] == 4 * zero2.flat.shard_numel  # the shard only

# %% [markdown] lang="ja"
# ## ZeRO ステージ 3 を手で書く
#
# ステージ 3 では、パラメータもシャードだけを持ちます。計算には全体が要るので、層ごとに、使う直前に
# all-gather で集め、使い終わったら解放します。
#
# 1. 層の順伝播の直前 (`register_forward_pre_hook`): 集める
# 2. 層の順伝播のあと (`register_forward_hook`): 解放する
# 3. 層の逆伝播の直前 (層の出力の勾配ができたとき。出力の `register_hook`): もう一度集める (autograd は
#    逆伝播のために重みを保存しているので、それを使う前に戻す)
# 4. 層のパラメータの勾配がそろったとき (`register_post_accumulate_grad_hook`): 勾配を reduce-scatter
#    して、自分のシャードの平均をシャードの勾配に足し込み、集めたパラメータを解放する
#
# 4 で代入せずに足し込むのは、autograd が `.grad` に足し込むのと同じ理由です。ステップの前に逆伝播を
# 2 回すると、2 回ぶんの勾配が累積されます (レッスン 04 の勾配累積)。代入すると、最後の逆伝播の勾配しか
# 残りません。ステージ 1 と 2 は、`step` の中で逆伝播が終わってから勾配を送るので、`.grad` に累積された
# 勾配をそのまま使います。ステージ 3 のあとのセルで、3 つのステージを勾配累積で確かめます。
#
# 層の分け方は `sharding.shard_units(model)` が決めます。学習するパラメータを直接持つモジュールごとに
# 1 つです。共有された重み (`TiedMLP` の `embed.weight` と `head.weight`) は 2 つのモジュールが使うので、
# モデル全体 (ルート) の単位に入り、順伝播のあいだずっと集めたままになります。凍結したパラメータは
# 学習しないので、このクラスはシャードせず、全ランクがそのまま持ちます。
#
# 解放とは、ストレージの大きさを 0 にすること (`untyped_storage().resize_(0)`) です。パラメータは
# `full` のビューのままなので、集めるとき (`gather`) は同じストレージを元の大きさに戻し、そこに
# all-gather します。autograd が保存したテンソルも同じストレージを見ているので、逆伝播の前に集め直せば
# 正しい値で計算します。
#
# 下の `Zero3Base` には、解放するところ (2 と 4) がありません。それが次の演習です。

# %% [markdown] lang="en"
# ## ZeRO stage 3 by hand
#
# In stage 3 the parameters are held as shards too. Computing needs them whole, so each
# layer's parameters are all-gathered just before they are used and freed after:
#
# 1. just before the layer's forward pass (`register_forward_pre_hook`): gather
# 2. after the layer's forward pass (`register_forward_hook`): free. But autograd saved
#    the weights for the backward pass, so
# 3. just before the layer's backward pass (when the gradient of its output is ready:
#    `register_hook` on the output): gather again
# 4. once the gradients of all the layer's parameters are there
#    (`register_post_accumulate_grad_hook`): reduce-scatter them, add this rank's shard
#    of the mean to the shard's gradient, and free the gathered parameters
#
# Step 4 adds rather than assigns, as autograd adds into `.grad`: two backward passes
# before a step accumulate both gradients (lesson 04's gradient accumulation), where
# assigning would keep the last one's only. Stages 1 and 2 send the gradients inside
# `step`, once the backward pass is over, so they use whatever `.grad` accumulated. A
# cell after stage 3 checks all three stages with gradient accumulation.
#
# `sharding.shard_units(model)` decides the layers: one per module that holds trained
# parameters of its own. A tied weight (`TiedMLP`'s `embed.weight` and `head.weight`)
# is used by two modules, so it goes to the unit of the whole model (the root), gathered
# through the whole forward pass. Frozen parameters are never trained: this class leaves
# them whole on every rank.
#
# Freeing is resizing the storage to 0 (`untyped_storage().resize_(0)`). The parameters
# stay views of `full`, so gathering (`gather`) resizes the same storage back and
# all-gathers into it. The tensors autograd saved look at the same storage too: gathered
# again before the backward pass, they compute with the right values.
#
# `Zero3Base` below leaves out the freeing (2 and 4): that is the next exercise.

# %%
# %%px
class Zero3Base:
    """ZeRO stage 3 without the freeing: parameters held as shards, gathered per layer."""

    def __init__(self, model, lr=1e-3):
        self.model, self.rank = model, dist.get_rank()
        self.world_size = dist.get_world_size()
        for p in model.parameters():  # every rank starts from rank 0's weights
            dist.broadcast(p.detach(), src=0)
        self.units, self.shards, self.pending = [], [], {}
        for module, params in sharding.shard_units(model):
            flat = sharding.FlatParameters(params, self.world_size)
            shard = nn.Parameter(flat.shard(self.rank).clone())  # memory of its own
            flat.full.untyped_storage().resize_(0)  # whole only while gathered
            self.units.append(flat)
            self.shards.append(shard)
            module.register_forward_pre_hook(lambda m, args, flat=flat: self.gather(flat))
            module.register_forward_hook(
                lambda m, args, out, flat=flat: self.after_forward(flat, out))
            for p in params:
                p.register_post_accumulate_grad_hook(
                    lambda p, flat=flat, shard=shard: self._grad_ready(flat, shard))
        self.optimizer = torch.optim.Adam(self.shards, lr=lr)  # the shards' state only

    def gather(self, flat):
        """The layer's whole parameters, from every rank's shard, into `flat.full`."""
        full = flat.full
        full.untyped_storage().resize_(full.numel() * full.element_size())
        dist.all_gather_single(full, self.shards[self.units.index(flat)].detach())

    def _grad_ready(self, flat, shard):
        self.pending[id(flat)] = self.pending.get(id(flat), 0) + 1
        if self.pending[id(flat)] == len(flat.params):  # the layer's last gradient
            self.pending[id(flat)] = 0
            grads = flat.flat_grad()
            for p in flat.params:
                p.grad = None  # the whole gradient goes ...
            mean = shard_of_mean_gradient(grads, self.rank, self.world_size)
            # Added, as autograd adds into .grad: two backward passes before a step
            # accumulate (lesson 04); the optimizer's zero_grad starts again.
            shard.grad = mean if shard.grad is None else shard.grad.add_(mean)
            self.after_backward(flat)  # ... and so may the gathered parameters

    def after_forward(self, flat, output):
        pass  # the exercise

    def after_backward(self, flat):
        pass  # the exercise

    def step(self, X, y, loss_fn):
        loss = loss_fn(self.model(X), y)
        loss.backward()  # the hooks gather, reduce-scatter and free, layer by layer
        self.held = self.memory()  # what this rank holds when Adam runs
        self.optimizer.step()  # each rank updates its shards; nothing to gather now
        self.optimizer.zero_grad()
        return loss.detach()

    def memory(self):
        params = [*self.model.parameters(), *self.shards]
        return sharding.held_by_part(params, [p.grad for p in params], self.optimizer)

    def full_parameters(self):
        for flat in self.units:
            self.gather(flat)
        full = [p.detach().clone() for p in self.model.parameters()]
        for flat in self.units:
            flat.full.untyped_storage().resize_(0)
        return full

# %% [markdown] lang="ja"
# ## 演習: ZeRO-3 で、集めたパラメータを層ごとに解放する
#
# `Zero3Base` を継承した `Zero3` の 2 つのメソッドを書いてください。どちらも、引数の `flat` が
# 1 つの層の `sharding.FlatParameters` で、`flat.full` がその層の集めたパラメータです。
#
# - `after_forward(flat, output)`: 層の順伝播のあとに呼ばれます。`flat.full` のメモリを解放し、
#   逆伝播の前にもう一度集める (`self.gather(flat)`) ように、層の出力 `output` にフックを付けます
#   (`output.register_hook(...)`。フックは出力の勾配を受け取り、None を返します)。
# - `after_backward(flat)`: 層の勾配を reduce-scatter したあとに呼ばれます。`flat.full` のメモリを
#   解放します。
#
# 自分のシャード (`self.shards`) は解放しないでください。Adam が更新するのはそれです。あとで
# まとめて解放するのではなく、層ごとに、使い終えた直後に解放します。確認のセルは、各層の順伝播と
# 逆伝播の直後と、順伝播と逆伝播の全体のあとに各ランクが持つバイト数を `sharding.held_bytes` で
# 測り、3 ステップのあとのパラメータを torch の DDP と比べます。

# %% [markdown] lang="en"
# ## Exercise: a ZeRO-3 layer frees after backward
#
# Write the two methods of `Zero3`, which builds on `Zero3Base`. In both, `flat` is one
# layer's `sharding.FlatParameters`, and `flat.full` holds that layer's gathered
# parameters.
#
# - `after_forward(flat, output)`: called after the layer's forward pass. Free the
#   memory of `flat.full`, and put a hook on the layer's output `output` that gathers
#   again (`self.gather(flat)`) before the backward pass (`output.register_hook(...)`;
#   the hook receives the output's gradient and returns None).
# - `after_backward(flat)`: called once the layer's gradients are reduce-scattered.
#   Free the memory of `flat.full`.
#
# Do not free this rank's shards (`self.shards`): they are what Adam updates. Free each
# layer as soon as it is used, not all at once later. The check measures with
# `sharding.held_bytes` what each rank holds right after each layer's forward and
# backward pass and after the whole passes, and compares the parameters after 3 steps
# with torch's DDP.

# %% tags=["exercise"]
# %%px
class Zero3(Zero3Base):
    """ZeRO stage 3: the gathered parameters freed after each use."""

    def after_forward(self, flat, output):
        pass  # TODO: free flat.full's memory; gather again before the backward pass

    def after_backward(self, flat):
        pass  # TODO: free flat.full's memory

# %% tags=["solution"]
# %%px
class Zero3(Zero3Base):
    """ZeRO stage 3: the gathered parameters freed after each use."""

    def after_forward(self, flat, output):
        flat.full.untyped_storage().resize_(0)  # free: the shard stays
        output.register_hook(lambda grad: self.gather(flat))  # back before backward

    def after_backward(self, flat):
        flat.full.untyped_storage().resize_(0)

# %%
exercises.grade_zero3_frees(ranks)

# %%
# %%px
zero3 = train(Zero3)
diff, bitwise = compare(zero3)
print(f"rank {rank}, ZeRO-3: {diff:.1e} from one process; bit for bit DDP's: {bitwise}")
frozen = [zero3.model.frozen.weight, zero3.model.frozen.bias]  # whole on every rank
print(f"rank {rank}, parameter bytes held when Adam runs: {zero3.held['parameters']} "
      f"(shards {sharding.held_bytes(zero3.shards)}, frozen {sharding.held_bytes(frozen)})")
assert bitwise and diff <= 1e-6
assert zero3.held["parameters"] == (sharding.held_bytes(zero3.shards)
                                    + sharding.held_bytes(frozen))
assert zero3.held["gradients"] == 4 * sum(s.numel() for s in zero3.shards)
zero3.model(batch(0)[0][:4])  # a forward pass: each layer gathered, then freed
assert sharding.held_bytes(flat.full for flat in zero3.units) == 0

# %% [markdown] lang="ja"
# ステージ 3 も、DDP とビット単位で一致します。Adam が動くときに各ランクが持つパラメータは、自分の
# シャード (1668 バイト) と凍結した層 (1088 バイト) だけです。順伝播のあとにも、集めたパラメータは
# 何も残っていません (0 バイト)。

# %% [markdown] lang="en"
# Stage 3 too equals DDP bit for bit. When Adam runs, the parameters a rank holds are
# its shards (1668 bytes) and the frozen layer (1088 bytes), nothing more; after a
# forward pass nothing gathered is left (0 bytes).

# %% [markdown] lang="ja"
# 勾配累積です。各ステップで、まずマイクロバッチ 1 つぶんの逆伝播をしてから `step` を呼びます
# (`step` の中の逆伝播が 2 つ目のマイクロバッチです)。DDP では 1 つ目を `no_sync` の中で行います
# (レッスン 04)。比べる相手は、1 プロセスが 2 つのマイクロバッチの全体で逆伝播してから更新したものと、
# 同じように累積した torch の DDP です。ステージ 1 と 2 は DDP とビット単位で一致します。ステージ 3 は
# 2 回の平均を足し、DDP は 2 回ぶんの和を平均するので、足す順番が違い、1e-6 以内で等しくなります。
# 最後のマイクロバッチの勾配だけを残すと、差は 5e-3 ほどになり、確認は失敗します。

# %% [markdown] lang="en"
# Gradient accumulation: each step first runs one micro-batch's backward pass, then
# calls `step`, whose own backward pass is the second micro-batch. DDP runs the first
# inside `no_sync` (lesson 04). The references: one process running both whole
# micro-batches' backward passes before its update, and torch's DDP accumulating the
# same way. Stages 1 and 2 equal DDP bit for bit. Stage 3 adds two means where DDP
# averages the sum of two, in another order, so it equals DDP within 1e-6. Keeping only
# the last micro-batch's gradient would miss by about 5e-3 and fail the check.

# %%
# %%px
import contextlib


def train_accumulating(make, steps=STEPS):
    """`train` with two micro-batches a step: one backward pass before `step`'s own."""
    torch.manual_seed(rank)
    trainer = make(models.TiedMLP())
    is_ddp = isinstance(trainer, DDPAdam)
    mine = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    for step in range(steps):
        X, y = batch(STEPS + step)  # the step's first micro-batch
        with trainer.ddp.no_sync() if is_ddp else contextlib.nullcontext():
            model = trainer.ddp if is_ddp else trainer.model
            loss_fn(model(X[mine]), y[mine]).backward()  # DDP: no all-reduce yet
        X, y = batch(step)
        trainer.step(X[mine], y[mine], loss_fn)  # the second, then the update
    return trainer


torch.manual_seed(0)  # rank 0's starting weights
one_accumulating = models.TiedMLP()
adam = torch.optim.Adam(one_accumulating.parameters(), lr=1e-3)
for step in range(STEPS):  # one process: both micro-batches whole, then the update
    for X, y in (batch(STEPS + step), batch(step)):
        loss_fn(one_accumulating(X), y).backward()
    adam.step()
    adam.zero_grad()
accumulated = {make.__name__: train_accumulating(make).full_parameters()
               for make in (DDPAdam, Zero1, Zero2, Zero3)}
for name, full in accumulated.items():
    diff = max((a - b).abs().max().item()
               for a, b in zip(full, one_accumulating.parameters(), strict=True))
    bitwise = all(torch.equal(a, b)
                  for a, b in zip(full, accumulated["DDPAdam"], strict=True))
    print(f"rank {rank}, {name}, 2 micro-batches a step: {diff:.1e} from one "
          f"process; bit for bit DDP's: {bitwise}")
    assert diff <= 1e-6  # the last micro-batch's gradient alone: about 5e-3
    assert bitwise or name == "Zero3"  # Zero3 adds the two means: another order

# %% [markdown] lang="ja"
# ## 各ステージが持つメモリ
#
# 「メモリは何に使われるか」の MLP (Ψ = 5365) を、4 つのやり方で 2 ステップずつ学習し、Adam が動く
# 直前に各ランクが持っていたバイト数を、式と並べます。式との差の原因は 2 つです。
#
# - パディング: 平坦化したバッファは N の倍数に埋めるので、1 本につき最大 N − 1 個の要素が多くなります。
#   パラメータ、勾配、Adam の 2 つの状態で、1 要素あたり最大 16 バイトです。バッファは
#   `Zero1`、`Zero2` では 1 本、`Zero3` では層ごとに 1 本 (この MLP では 3 本) です。
# - Adam の `step`: パラメータのテンソル 1 つ (`Zero1`、`Zero2` ではシャード 1 つ) につき 4 バイト。
#
# 確認のセルは、差が 0 以上で、この 2 つの上限の和 (許容差) 以下であることを確かめます。

# %% [markdown] lang="en"
# ## Memory each stage holds
#
# The MLP of "Where the memory goes" (Ψ = 5365), trained for 2 steps each way; the
# bytes each rank held just before Adam's step, beside the formula. The differences
# come from two things:
#
# - padding: a flat buffer is padded to a multiple of N, so each buffer holds at most
#   N - 1 elements more; for parameters, gradients and Adam's two states, at most 16
#   bytes an element. `Zero1` and `Zero2` have one buffer, `Zero3` one per layer (3 in
#   this MLP).
# - Adam's `step`: 4 bytes per parameter tensor (per shard for `Zero1` and `Zero2`).
#
# The check asserts that each difference is at least 0 and at most these two bounds
# together (the tolerance).

# %%
# %%px
trainers = {"DDP": DDPAdam, "ZeRO-1": Zero1, "ZeRO-2": Zero2, "ZeRO-3": Zero3}
memory_table = {}
for stage, make in trainers.items():
    trainer = memory_run(make)
    flats = getattr(trainer, "units", [getattr(trainer, "flat", None)])
    buffers = sum(f is not None for f in flats)  # padded flat buffers: none in DDP
    memory_table[stage] = {
        "measured": sum(trainer.held.values()),
        "formula": sum(sharding.memory_parts(psi, world_size,
                                             **sharding.FP32_ADAM)[stage].values()),
        "tolerance": 16 * (world_size - 1) * buffers + 4 * len(trainer.optimizer.state),
        "parts": trainer.held}

# %%
memory_table = ranks.pull("memory_table")[0]  # rank 0's; rank 1's is the same
measured = {stage: row["measured"] for stage, row in memory_table.items()}
print(f"psi = {psi}, 2 ranks: bytes per rank when Adam runs")
print(f"{'':7s} {'formula':>8s} {'measured':>9s} {'diff':>5s} {'tol':>4s}  measured parts")
for stage, row in memory_table.items():
    print(f"{stage:7s} {row['formula']:8.0f} {row['measured']:9d} "
          f"{row['measured'] - row['formula']:5.0f} {row['tolerance']:4d}  {row['parts']}")
for stage, row in memory_table.items():
    assert 0 <= row["measured"] - row["formula"] <= row["tolerance"], stage
assert measured["ZeRO-3"] < measured["ZeRO-2"] < measured["ZeRO-1"] < measured["DDP"]

# %% [markdown] lang="ja"
# どのステージでも、測った値は式より少しだけ多く、その差はパディングと Adam の `step` の許容差に
# 収まります。メモリは DDP、ZeRO-1、ZeRO-2、ZeRO-3 の順に少なくなります。

# %% [markdown] lang="en"
# In every stage the measurement is a little above the formula, within the tolerance of
# padding and Adam's `step` counters; the memory shrinks from DDP to ZeRO-1, ZeRO-2 and
# ZeRO-3.

# %% [markdown] lang="ja"
# ## 演習: 1 ステップで送るバイト数を予測する
#
# シャードはメモリを減らしますが、そのぶん通信が増えるのでしょうか。
# `bytes_sent_per_rank(params, world_size, stage)` を書いてください。Ψ 個のパラメータのモデルを float32 で
# 学習するとき、1 ステップの集団通信で 1 つのランクが送るバイト数を返します (受け取るバイト数は数えません)。
#
# - 集団通信はリングで行うとします (レッスン 05)。S バイトの reduce-scatter でも all-gather でも、各ランクは
#   (N − 1)/N × S を送ります (自分の部分は送りません)。
# - 各ステージがどの集団通信を呼ぶかは、上の `DDPAdam`、`Zero1`、`Zero2`、`Zero3` に書いてあります。
# - パディングは数えません。
#
# 確認のセルは、Ψ = 10 から 75 億まで、N = 1〜64 で、答えをリングの式と比べます。答えはリングのアルゴリズム
# (NCCL) のものです。次の節では、各ステージの集団通信を実際に記録して数え、このレッスンで使っている gloo が
# 実際に送るバイト数も測ります。この関数はカーネルで実行されます。

# %% [markdown] lang="en"
# ## Exercise: predict the bytes sent per step
#
# Sharding saves memory: does it cost more communication? Write
# `bytes_sent_per_rank(params, world_size, stage)`: training a model of Ψ parameters in
# fp32, the bytes one rank sends in a step's collectives (the bytes it receives are not
# counted).
#
# - The collectives run as rings (lesson 05): in a reduce-scatter or an all-gather of S
#   bytes each rank sends (N − 1)/N × S (everything but its own piece).
# - Which collectives each stage calls, `DDPAdam`, `Zero1`, `Zero2` and `Zero3` above
#   show.
# - Padding is not counted.
#
# The check compares your answer with the ring's formula for Ψ from 10 to 7.5 billion
# and N from 1 to 64: the answer is the ring algorithm's (NCCL's). The next section
# records each stage's collectives and counts them, and measures what gloo, the
# backend this lesson runs on, really sends. The function runs in the kernel.

# %% tags=["exercise"]
def bytes_sent_per_rank(params, world_size, stage):
    """Bytes one rank sends in the ring collectives of a training step, in fp32."""
    return None  # TODO: the stage's collectives, and what each makes one rank send

# %% tags=["solution"]
def bytes_sent_per_rank(params, world_size, stage):
    """Bytes one rank sends in the ring collectives of a training step, in fp32."""
    whole = 4 * params  # the whole fp32 gradient, or the whole parameters
    half = (world_size - 1) / world_size * whole  # a reduce-scatter or an all-gather
    return {"DDP": 2 * half,  # an all-reduce: a reduce-scatter, then an all-gather
            "ZeRO-1": 2 * half,  # gradients reduce-scattered, parameters all-gathered
            "ZeRO-2": 2 * half,  # the same two collectives
            "ZeRO-3": 3 * half}[stage]  # the parameters gathered again for backward

# %%
exercises.grade_bytes_sent(bytes_sent_per_rank)

# %% [markdown] lang="ja"
# ## 1 ステップで送るバイト数
#
# 各ステージが 1 ステップで呼ぶ集団通信を、`comm_counting.CollectiveLog` で記録します。記録する
# バイト数は、集団通信が扱うバッファ全体の大きさです (reduce-scatter は入力、all-gather は出力)。
# torch の DDP の all-reduce は C++ から呼ばれて記録に入らないので、DDP は通信フック
# `comm_counting.CommCounter` で数えます。S = 4Ψ を勾配 (パラメータ) 全体のバイト数とします。
#
# - DDP: all-reduce 1 回ぶん、S
# - ステージ 1、2: reduce-scatter (勾配) と all-gather (パラメータ) が S ずつ
# - ステージ 3: 順伝播の前と逆伝播の前に all-gather が S ずつ、reduce-scatter が S
#
# リングでは、S の all-reduce で各ランクが送るのは 2(N − 1)/N × S、reduce-scatter と all-gather は
# その半分ずつ、(N − 1)/N × S です (all-reduce = reduce-scatter + all-gather)。リングのアルゴリズムでは、
# ステージ 1 と 2 は DDP と同じだけ送り、ステージ 3 は逆伝播の前の all-gather のぶん、DDP の 1.5 倍を
# 送ります。gloo では違います (下の「gloo が実際に送るバイト数」)。
#
# 時間はレッスン 05 の α–β モデルで予測します。all-reduce の時間を測って α と β を当てはめ
# (`comm.fit_alpha_beta`)、reduce-scatter と all-gather はリングの前半と後半なので、それぞれ同じ
# 大きさの all-reduce の半分の時間とします (`AlphaBeta.reduce_scatter_time`、`all_gather_time`)。

# %% [markdown] lang="en"
# ## Bytes sent per step
#
# `comm_counting.CollectiveLog` records the collectives each stage calls in a step. The
# bytes it records are the size of the whole buffer a collective works on (a
# reduce-scatter's input, an all-gather's output). Torch's DDP calls its all-reduces
# from C++, past the log, so DDP is counted with a comm hook,
# `comm_counting.CommCounter`. Let S = 4Ψ, the bytes of the whole gradient (or of the
# parameters):
#
# - DDP: one all-reduce's worth, S
# - stages 1 and 2: a reduce-scatter (gradients) and an all-gather (parameters), S each
# - stage 3: an all-gather before the forward pass and another before the backward
#   pass, S each, and a reduce-scatter, S
#
# In a ring each rank sends 2(N - 1)/N × S in an all-reduce of S, and half that,
# (N - 1)/N × S, in a reduce-scatter or an all-gather (all-reduce = reduce-scatter +
# all-gather). In the ring algorithm stages 1 and 2 send what DDP sends, and stage 3
# 1.5 times as much: the all-gather before the backward pass. Gloo differs (below,
# "What gloo really sends").
#
# Time is predicted by lesson 05's α–β model: α and β fitted to measured all-reduces
# (`comm.fit_alpha_beta`); a reduce-scatter and an all-gather are the ring's first and
# second half, so each takes half the time of an all-reduce of the same size
# (`AlphaBeta.reduce_scatter_time`, `all_gather_time`).

# %%
# %%px
from labkit import comm


def traffic(make, steps=4):
    """Per step: bytes per collective (the last step) and seconds in collectives."""
    torch.manual_seed(rank)
    trainer = make(models.WideMLP(10, 63, 2, 10))
    hook = (comm_counting.CommCounter(per_step=True).attach(trainer.ddp)
            if isinstance(trainer, DDPAdam) else None)
    X, y = torch.randn(8, 10), torch.randn(8, 10)
    per_step = []
    for _ in range(steps):
        if hook:
            hook.step()
        with comm_counting.CollectiveLog(("all_reduce", "reduce_scatter", "all_gather")) as log:
            trainer.step(X, y, models.MyLoss())
        per_step.append(log.calls)
    calls = [{"op": "all_reduce", "bytes": b} for b in hook.steps[-1]] if hook else log.calls
    flats = getattr(trainer, "units", [getattr(trainer, "flat", None)])
    return {"calls": calls, "seconds": [sum(c["end"] - c["start"] for c in s)
                                        for s in per_step],
            "padded": 4 * sum(f.full.numel() for f in flats if f is not None)}


traffic_table = {stage: traffic(make) for stage, make in trainers.items()}
S = 4 * psi
for stage, row in traffic_table.items():
    ops = [c["op"] for c in row["calls"]]
    print(f"rank {rank}, {stage}: " + ", ".join(
        f"{op} {sum(c['bytes'] for c in row['calls'] if c['op'] == op)} B "
        f"x{ops.count(op)}" for op in dict.fromkeys(ops)))

# %%
# %%px
def sent(calls):
    """Bytes each rank sends in a ring: 2(N-1)/N of an all-reduce, half that of the others."""
    return sum(c["bytes"] * comm.sent_share(c["op"], world_size) for c in calls)


def total(stage, op):
    return sum(c["bytes"] for c in traffic_table[stage]["calls"] if c["op"] == op)


ddp_sent = sent(traffic_table["DDP"]["calls"])
for stage, row in traffic_table.items():
    print(f"rank {rank}, {stage}: each rank sends {sent(row['calls']):.0f} B, "
          f"{sent(row['calls']) / ddp_sent:.4f} x DDP")
assert total("DDP", "all_reduce") == S  # one all-reduce's worth of gradients
for stage in ("ZeRO-1", "ZeRO-2"):  # S (padded) each way: what DDP sends
    padded = traffic_table[stage]["padded"]
    assert total(stage, "reduce_scatter") == total(stage, "all_gather") == padded
    assert total(stage, "all_reduce") == 0 and S <= padded <= S + 4 * (world_size - 1)
padded = traffic_table["ZeRO-3"]["padded"]  # 3 layers, each padded
assert total("ZeRO-3", "reduce_scatter") == padded  # once, in backward
assert total("ZeRO-3", "all_gather") == 2 * padded  # before forward, again before backward
assert 1.5 <= sent(traffic_table["ZeRO-3"]["calls"]) / ddp_sent <= 1.5 * padded / S

# %% [markdown] lang="ja"
# ### gloo が実際に送るバイト数
#
# 上の数はリングのアルゴリズムのものです (NCCL のリング)。このレッスンで使っている gloo は、reduce-scatter を
# リングの前半としては行いません。torch の `ProcessGroupGloo::reduce_scatter_tensor_coalesced`
# (`dist.reduce_scatter_single` は最終的にこれを呼びます) は、入力全体のコピーを **all-reduce** して、終わると自分の
# チャンク (`chunk(world_size)[rank]`) を出力にコピーします。下のセルでは、torch のプロファイラが、
# reduce-scatter が実行した gloo の処理を `gloo:all_reduce` と記録します。つまり、gloo の reduce-scatter は
# all-reduce と同じバイト数を送り、all-reduce と同じ処理をします。all-gather は gloo 自身の all-gather で、
# リングと同じく (N − 1)/N × S を送ります。NCCL には reduce-scatter そのものの集団通信
# (`ncclReduceScatter`) があり、上のリングの数はそのリングのアルゴリズムが送るバイト数です。このコースは
# GPU で動かしたことがないので、NCCL で送るバイト数は測っていません。
#
# 各ランクがソケットに書き込んだバイト数を、Linux の /proc/self/io で数えます (レッスン 05)。
# まず S = 数 MB の集団通信 1 回ずつ、次に各ステージの 1 ステップです (パラメータ約 100 万個の
# WideMLP、S = 4.3 MB)。

# %% [markdown] lang="en"
# ### What gloo really sends
#
# The counts above are the ring algorithm's (NCCL's ring). The gloo backend this lesson
# runs on does not run a reduce-scatter as the ring's first half: torch's
# `ProcessGroupGloo::reduce_scatter_tensor_coalesced` (where `dist.reduce_scatter_single`
# lands) **all-reduces** a copy of the whole input and, when done, copies its own chunk
# (`chunk(world_size)[rank]`) into the output; in the cell below torch's profiler
# records the gloo work a reduce-scatter runs as `gloo:all_reduce`. So on gloo a
# reduce-scatter sends an all-reduce's bytes and does an all-reduce's work. The
# all-gather is gloo's own, sending the ring's (N - 1)/N × S. NCCL has a reduce-scatter
# collective of its own (`ncclReduceScatter`), and the ring counts above are what its
# ring algorithm sends; this course has never run on a GPU, so the bytes NCCL sends are
# not measured here.
#
# Each rank counts the bytes it writes to its sockets with Linux's /proc/self/io
# (lesson 05): first one collective of a few megabytes each, then one step of each
# stage (a WideMLP of about a million parameters, S = 4.3 MB).

# %%
# %%px
import labkit

counted = comm.can_count_bytes_written()  # Linux's /proc/self/io
S_wire = 4 * 2**20 * world_size  # megabytes: the process's few other writes are lost in it
whole, piece = torch.ones(S_wire // 4), torch.empty(S_wire // 4 // world_size)
collectives = {"all_reduce": lambda: dist.all_reduce(whole),
               "reduce_scatter": lambda: dist.reduce_scatter_single(piece, whole),
               "all_gather": lambda: dist.all_gather_single(whole, piece)}
with torch.profiler.profile() as profiled:  # what gloo runs for a reduce-scatter
    collectives["reduce_scatter"]()
ran = sorted({e.name for e in profiled.events() if e.name.startswith("gloo:")})
print(f"rank {rank}, the reduce-scatter ran: {ran}")
assert ran == ["gloo:all_reduce"]  # an all-reduce, on every system
if counted:
    wire = {op: comm.bytes_written_per_call(run) / S_wire
            for op, run in collectives.items()}
    for op, share in wire.items():
        print(f"rank {rank}, {op}: wrote {share:.4f} x S (ring "
              f"{comm.sent_share(op, world_size):.3f}, gloo "
              f"{comm.sent_share(op, world_size, 'gloo'):.3f})")
        assert abs(share / comm.sent_share(op, world_size, "gloo") - 1) < 0.01, op
    # Not the ring's half: the whole all-reduce.
    assert wire["reduce_scatter"] > 1.9 * comm.sent_share("reduce_scatter", world_size)
else:  # macOS, Windows
    print(labkit.t("bytes_written_not_counted"))

# %%
# %%px
def wire_per_step(make, repeat=2):
    """Bytes this rank writes to its sockets in one step of `make`'s trainer."""
    torch.manual_seed(rank)
    trainer = make(models.WideMLP(10, 724, 3, 10))
    X, y = torch.randn(8, 10), torch.randn(8, 10)
    return comm.bytes_written_per_call(lambda: trainer.step(X, y, models.MyLoss()),
                                       repeat)


def shares(stage, implementation):
    """What the stage's collectives send, over what DDP's send, in `implementation`."""
    def sends(name):
        return sum(c["bytes"] * comm.sent_share(c["op"], world_size, implementation)
                   for c in traffic_table[name]["calls"])
    return sends(stage) / sends("DDP")


if counted:
    S_step = 4 * models.count_params(models.WideMLP(10, 724, 3, 10))
    wire_step = {stage: wire_per_step(make) for stage, make in trainers.items()}
    for stage, written in wire_step.items():
        print(f"rank {rank}, {stage}: wrote {written / S_step:.3f} x S, "
              f"{written / wire_step['DDP']:.3f} x DDP (ring {shares(stage, 'ring'):.2f}, "
              f"gloo {shares(stage, 'gloo'):.2f})")
        assert abs(written / wire_step["DDP"] / shares(stage, "gloo") - 1) < 0.02, stage
    assert abs(wire_step["DDP"] / S_step / comm.sent_share("all_reduce", world_size)
               - 1) < 0.02  # DDP's all-reduce: the ring's 2(N-1)/N
else:  # macOS, Windows
    print(labkit.t("bytes_written_not_counted"))

# %%
# %%px
import functools
import statistics

from labkit import timing


def replay(calls):
    """A function that runs these collectives back to back, on buffers made once."""
    buffers = [(c["op"], torch.zeros(c["bytes"] // 4),
                torch.zeros(c["bytes"] // 4 // world_size)) for c in calls]

    def run():
        for op, whole, piece in buffers:
            if op == "all_gather":
                dist.all_gather_single(whole, piece)
            else:
                dist.reduce_scatter_single(piece, whole)
    return run


sizes = [2**k for k in range(10, 23, 2)]  # 1 KiB to 4 MiB
ab = comm.fit_alpha_beta(sizes, comm.allreduce_sweep(sizes, repeat=7), world_size)
price = {implementation: {
    "reduce_scatter": functools.partial(ab.reduce_scatter_time,
                                        implementation=implementation),
    "all_gather": ab.all_gather_time} for implementation in comm.IMPLEMENTATIONS}
stages = ("ZeRO-1", "ZeRO-2", "ZeRO-3")
# The stages take turns, the ranks lined up before each: load falls on all alike.
alone = timing.interleaved({stage: replay(traffic_table[stage]["calls"])
                            for stage in stages}, rounds=9, warmup=1,
                           before=lambda _: dist.barrier())
comm_time = {}
for stage in stages:
    calls = traffic_table[stage]["calls"]
    ring, gloo = (sum(price[i][c["op"]](c["bytes"], world_size) for c in calls)
                  for i in comm.IMPLEMENTATIONS)
    in_step = statistics.median(traffic_table[stage]["seconds"][1:])  # after warm-up
    comm_time[stage] = (statistics.median(alone[stage]), ring, gloo, in_step)
    print(f"rank {rank}, {stage}: collectives alone {comm_time[stage][0] * 1e6:.0f} us; "
          f"model, ring {ring * 1e6:.0f} us ({comm_time[stage][0] / ring - 1:+.0%}), "
          f"gloo {gloo * 1e6:.0f} us ({comm_time[stage][0] / gloo - 1:+.0%}); "
          f"inside the step {in_step * 1e6:.0f} us")

# %% [markdown] lang="ja"
# バイト数は式のとおりで、上のセルが確かめています。時間はそうはいきません。ここでの集団通信は数 KB
# から数十 KB と短く、時間はほぼ固定の遅延 (α) で決まります。モデルは、2 ランクのリングの
# reduce-scatter と all-gather を、それぞれ all-reduce の半分 (リングの 1 段ぶんの α) とします。このマシン
# (gloo、CPU、ほかのノートブックと同時) で何度か測ると、集団通信だけを続けて呼んだ時間 (collectives
# alone) はモデルの 1.2 倍から 10 倍でした。同じ集団通信を呼ぶ ZeRO-1 と ZeRO-2 でも、実行によって
# 7 倍違うことがありました。
#
# gloo の reduce-scatter を中で実際に行う all-reduce として見積もっても (`implementation="gloo"`、上の
# 「gloo」の列)、ステージを交互に 9 回ずつ測って中央値をとっても、誤差の上限は決められませんでした。
# マシンの負荷が高いときは、リングとしての見積もりで +126%〜+1100%、gloo の動作に合わせた見積もりで
# +51%〜+700% 外れ、負荷が低いときはそれぞれ +22%〜+36%、−12%〜−8% でした。gloo に合わせた見積もりの
# ほうが近くなりますが、当てはめに使った all-reduce そのものも、負荷のあるこのマシンでは 64 KiB〜4 MiB で
# −37%〜+665% 外れました (3 回の実行)。
#
# そのため、このセルは時間とモデルの誤差を表示するだけで、確かめるのはバイト数です (時間はベンチマークで、
# 交互に測ります)。ステップの中で測った時間 (inside the step) には、もう一方のランクが来るのを待つ時間も
# 入ります。

# %% [markdown] lang="en"
# The bytes follow the formula, and the cell above asserts them. Time does not: these
# collectives are short (kilobytes to tens of kilobytes), so their time is almost all
# latency (α). The model prices a 2-rank ring reduce-scatter or all-gather at half an
# all-reduce (one step's α). Measured several times on this machine (gloo, CPU, with
# other notebooks running), the collectives alone took 1.2 to 10 times the model's
# time, and ZeRO-1 and ZeRO-2, which call the same collectives, differed up to 7-fold
# between runs.
#
# Pricing gloo's reduce-scatter as the all-reduce it runs (`implementation="gloo"`, the
# "gloo" column above) and taking medians of 9 interleaved rounds did not make the
# error boundable: in a loaded run the ring's pricing was off by +126% to +1100%, gloo's
# by +51% to +700%; in a quiet one the ring's by +22% to +36%, gloo's by -12% to -8%.
# Gloo's pricing comes closer, but on this loaded machine even the all-reduces the
# model is fitted on missed by -37% to +665% at 64 KiB to 4 MiB (three runs).
#
# So this cell prints the time and the model's error, and asserts the bytes (the
# benchmark measures time, interleaved). Timed inside the step, a collective also
# includes waiting for the other rank to arrive.

# %% [markdown] lang="ja"
# ## FSDP2: fully_shard
#
# ステージ 3 を PyTorch が実装したものが FSDP2 (`torch.distributed.fsdp.fully_shard`) です。
# `fully_shard(module)` は `module` を 1 つの**ユニット**にします。ユニットの各パラメータは `DTensor` になり、
# 各ランクは 0 番目の次元で切った自分のシャードだけを持ちます。ユニットの順伝播の直前にフックがそのパラメータを
# all-gather し、順伝播のあとで解放し、逆伝播の直前にもう一度 all-gather して、勾配を reduce-scatter します。
# `Zero3` がしていることと同じです。レッスン 09 と同じく、層ごとに 1 ユニット、最後にモデル全体 (ルート) に呼びます。
#
# `Zero3` と同じ `models.TiedMLP` で、気をつけることが 2 つあります (torch 2.13 のソースと、下のセルで
# 確かめます)。
#
# - `fully_shard` は値を配りません。各ランクは、自分が持っている値から自分のシャードを切り出すだけです。
#   ランクごとに初期値が違えば、ランク 0 の前半とランク 1 の後半をつないだモデルになります。そこで
#   `fully_shard` の前にランク 0 の重みを配ります (`Zero3` は自分で配っていました)。
# - 重みを共有する 2 つのモジュールは、1 つのユニットに入れます: `fully_shard([model.embed, model.head])`。
#   別々のユニットにすると、最初の順伝播で FSDP2 は `ValueError` を出して止まります。`fsdp.layer_units(model)` は、
#   パラメータを持つモジュールを順に並べ、重みを共有するものを 1 つのリストにまとめます。凍結した
#   パラメータ (`requires_grad=False`) は、そのままで扱えます。集めはしますが、勾配がないので
#   reduce-scatter しません。
#
# 下のクラスは、ほかの学習クラスと同じ使い方 (`FSDP2Adam(model, lr)`、`.step(X, y, loss_fn)`) です。

# %% [markdown] lang="en"
# ## FSDP2: fully_shard
#
# FSDP2 (`torch.distributed.fsdp.fully_shard`) is stage 3 as PyTorch implements it.
# `fully_shard(module)` makes `module` one **unit**: each of its parameters becomes a
# `DTensor`, and each rank holds only its shard, cut along dimension 0. Just before the
# unit's forward, a hook all-gathers its parameters; after the forward they are freed;
# just before its backward they are all-gathered again, and the gradients are
# reduce-scattered. That is `Zero3`'s work. As in lesson 09, call it on each layer, one
# unit each, then on the whole model (the root).
#
# On `Zero3`'s model, `models.TiedMLP`, two things need care (checked in torch 2.13's
# source and in the cell below):
#
# - `fully_shard` sends nothing: each rank cuts its shard out of the values it holds.
#   Ranks initialized differently would give a model made of rank 0's first half and
#   rank 1's second half. So rank 0's weights are broadcast before `fully_shard`
#   (`Zero3` broadcast them itself).
# - Two modules sharing a weight go in one unit: `fully_shard([model.embed,
#   model.head])`. In two units, FSDP2 stops with a `ValueError` at the first forward.
#   `fsdp.layer_units(model)` lists the modules that hold parameters, in order, and puts
#   those sharing a weight in one list. Frozen parameters (`requires_grad=False`) need
#   nothing: they are gathered, but have no gradient, so nothing is reduce-scattered
#   for them.
#
# The class below is used like the other trainers (`FSDP2Adam(model, lr)`,
# `.step(X, y, loss_fn)`).

# %%
# %%px
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from labkit import fsdp


class FSDP2Adam:
    """Adam on a model sharded by fully_shard: one unit per layer, then the root."""

    def __init__(self, model, lr=1e-3):
        for p in model.parameters():  # fully_shard sends nothing: start alike
            dist.broadcast(p.data, src=0)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for unit in fsdp.layer_units(model):  # a layer, or the modules tied together
            fully_shard(unit, mesh=mesh)
        self.model = fully_shard(model, mesh=mesh)  # the root: what is left
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)

    def step(self, X, y, loss_fn):
        loss = loss_fn(self.model(X), y)  # each unit gathered, used, freed
        loss.backward()  # gathered again; each unit's gradients reduce-scattered
        self.optimizer.step()  # Adam on this rank's shards only
        self.optimizer.zero_grad()
        return loss

    def full_parameters(self):
        return [p.full_tensor() for p in self.model.parameters()]

# %%
# %%px
import copy

torch.manual_seed(rank)  # ranks start apart: only a broadcast makes them alike
tied = models.TiedMLP()
mine = {name: p.detach().clone() for name, p in tied.named_parameters()}

# What fully_shard keeps, without the broadcast: this rank's chunk of its own values.
alone = copy.deepcopy(tied)
fully_shard(alone, mesh=init_device_mesh("cpu", (world_size,)))
weight = alone.embed.weight  # a DTensor now: 33 rows, 17 on rank 0, 16 on rank 1
assert torch.equal(weight.to_local(), mine["embed.weight"].chunk(world_size)[rank])
whole = weight.full_tensor()  # rows 0-16 from rank 0's values, 17-32 from rank 1's
from_rank0 = mine["embed.weight"].clone()
dist.broadcast(from_rank0, src=0)
assert not torch.equal(whole, from_rank0), "each rank cuts its own values"

mesh = init_device_mesh("cpu", (world_size,))
try:  # tied modules in two units
    twice = models.TiedMLP()
    for unit in (twice.embed, twice.head, twice):
        fully_shard(unit, mesh=mesh)
    twice(torch.tensor([0]))  # FSDP2 checks its units at the first forward
    raise AssertionError("fully_shard accepted a tied weight in two units")
except ValueError as err:
    assert "shared" in str(err)
    print(f"rank {rank}: {err}")

compared = {"FSDP2": FSDP2Adam(copy.deepcopy(tied)),
            "Zero3": Zero3(copy.deepcopy(tied))}
reference = copy.deepcopy(tied)  # one process on the whole batch, from rank 0's start
for p in reference.parameters():
    dist.broadcast(p.data, src=0)
frozen_start = reference.frozen.weight.detach().clone()
ref_optimizer = torch.optim.Adam([p for p in reference.parameters() if p.requires_grad],
                                 lr=1e-3)
loss_fn = nn.functional.cross_entropy
per = 8  # samples per rank
for step in range(5):
    torch.manual_seed(100 + step)  # the same batch on every rank
    X, y = (torch.randint(0, 33, (per * world_size,)) for _ in range(2))
    mine_part = slice(rank * per, (rank + 1) * per)
    for trainer in compared.values():
        trainer.step(X[mine_part], y[mine_part], loss_fn)
    loss_fn(reference(X), y).backward()
    ref_optimizer.step()
    ref_optimizer.zero_grad()

full = {name: t.full_parameters() for name, t in compared.items()}
one = [p.detach() for p in reference.parameters()]
vs_one = max((a - b).abs().max().item()
             for a, b in zip(full["FSDP2"], one, strict=True))
vs_zero3 = max((a - b).abs().max().item()
               for a, b in zip(full["FSDP2"], full["Zero3"], strict=True))
print(f"rank {rank}: FSDP2 - one process {vs_one:.1e}, FSDP2 - Zero3 {vs_zero3:.1e}")
sharded = compared["FSDP2"].model
assert sharded.head.weight is sharded.embed.weight  # still one tensor
assert torch.equal(sharded.frozen.weight.full_tensor(), frozen_start)  # never updated
assert vs_one <= 1e-6
assert vs_zero3 == 0  # bit for bit: the same mean gradients, Adam element by element

# %% [markdown] lang="ja"
# 5 ステップのあと、FSDP2 のパラメータは 1 プロセスの学習と `1e-6` 以内で等しく (差は上に表示して
# います)、`Zero3` とはビット単位で一致します。どちらも同じ勾配を reduce-scatter で平均し、Adam は要素ごとに
# 同じ計算をするからです。共有された重みは 1 つのテンソルのままで、凍結したパラメータは変わりません。
#
# ### reshard_after_forward: メモリと通信のトレードオフ
#
# `reshard_after_forward=True` (層のユニットの既定) は、順伝播のあとで集めたパラメータを解放し、逆伝播の前に
# もう一度集めます。`False` は集めたまま逆伝播まで持ち、2 度目の all-gather を省きます。両方を 1 ステップずつ
# 測ります。順伝播と逆伝播のあいだに 1 ランクが持つパラメータのバイト数 (`sharding.held_bytes`) と、
# 順伝播と逆伝播それぞれの all-gather の回数とバイト数 (`CollectiveLog`) です。FSDP2 は集めたパラメータを
# `FSDPParam.all_gather_outputs` に置き (モジュールが計算に使うパラメータはそのビューです)、解放するときは
# そのストレージの大きさを 0 にします (`free_unsharded_param`)。`fsdp.held_param_bytes` は、そこと
# シャード (`sharded_param`) の両方を数えます。ルートにも同じ値を渡します (指定しなければ、FSDP2 は
# ルートのパラメータを逆伝播まで持ちます。逆伝播がすぐに使うからです)。

# %% [markdown] lang="en"
# After 5 steps, FSDP2's parameters equal one process's within `1e-6` (the difference
# is printed above), and `Zero3`'s bit for bit: both average the same gradients with a
# reduce-scatter, and Adam does the same arithmetic element by element. The tied
# weight is still one tensor, and the frozen parameter has not changed.
#
# ### reshard_after_forward: memory traded for communication
#
# `reshard_after_forward=True` (the default for the layers' units) frees the gathered
# parameters after the forward and gathers them again before the backward; `False`
# keeps them until the backward and skips the second all-gather. One step of each,
# measured: the parameter bytes a rank holds between the forward and the backward
# (`sharding.held_bytes`), and the all-gathers of the forward and of the backward, their
# number and bytes (`CollectiveLog`). FSDP2 puts gathered parameters in
# `FSDPParam.all_gather_outputs` (the parameter a module computes with is a view of it)
# and frees them by resizing that storage to 0 (`free_unsharded_param`);
# `fsdp.held_param_bytes` counts there and the shards (`sharded_param`). The root is
# given the same value (left unset, FSDP2 keeps the root's parameters until the
# backward, which needs them first).

# %%
# %%px
torch.manual_seed(7)
batch = (torch.randint(0, 33, (8,)), torch.randint(0, 33, (8,)))
runs = {after: fsdp.reshard_experiment(models.TiedMLP, batch, loss_fn, after)
        for after in (True, False)}
for after, r in runs.items():
    gathers = [r[phase].get("all_gather", {"calls": 0, "bytes": 0})
               for phase in ("forward", "backward")]
    print(f"rank {rank}, reshard_after_forward={after}: between forward and backward "
          f"{r['held_between']['sharded']:,} B of shards + "
          f"{r['held_between']['gathered']:,} B gathered; all-gathers forward "
          f"{gathers[0]['calls']} ({gathers[0]['bytes']:,} B), backward "
          f"{gathers[1]['calls']} ({gathers[1]['bytes']:,} B)")
freed, kept = runs[True], runs[False]
whole = freed["forward"]["all_gather"]  # every unit gathered once: the whole model
assert freed["held_between"]["gathered"] == 0  # only the shards are held
assert freed["backward"]["all_gather"] == whole  # so the backward gathers it all again
assert kept["held_between"]["gathered"] == whole["bytes"]  # held whole instead
assert "all_gather" not in kept["backward"]  # and not gathered again
assert kept["held_between"]["sharded"] == freed["held_between"]["sharded"]
assert kept["backward"]["reduce_scatter"] == freed["backward"]["reduce_scatter"]
assert kept["held_after"]["gathered"] == freed["held_after"]["gathered"] == 0

# %% [markdown] lang="ja"
# `True` では、順伝播と逆伝播のあいだに持つのはシャードだけで、逆伝播でモデル全体をもう一度 all-gather
# します (1 ステップで 2 回)。`False` では、集めたモデル全体 (パディングを含むバイト数) をシャードに加えて
# 持ち、all-gather は順伝播の 1 回だけです。持ち続けたバイト数は、省いた all-gather のバイト数と
# ちょうど同じです。`False` のステージ 3 は、送るバイト数がリングのアルゴリズムでは DDP と同じになり、そのかわりパラメータの
# メモリは逆伝播までシャードしないのと同じになります。逆伝播のあとでは、どちらも集めたパラメータを
# 解放します。
#
# ### MixedPrecisionPolicy
#
# `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)` では、シャードは
# float32 のまま (Adam は float32 を更新します)、all-gather は bfloat16 で送り (半分のバイト数)、
# 順伝播と逆伝播は bfloat16 で計算し、勾配は float32 で reduce-scatter します。torch 2.13 では gloo と
# CPU でも動きます。同じモデル、同じバッチで、float32 の 1 ステップと比べます。

# %% [markdown] lang="en"
# With `True`, only the shards are held between the forward and the backward, and the
# backward all-gathers the whole model again (twice a step). With `False`, the whole
# gathered model (in bytes, padding included) is held on top of the shards, and the only
# all-gather is the forward's: the bytes held are exactly the bytes of the all-gather
# saved. Stage 3 with `False` sends DDP's bytes (in the ring algorithm), and in exchange holds its parameters
# as unsharded until the backward. After the backward, both free what they gathered.
#
# ### MixedPrecisionPolicy
#
# With `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`
# the shards stay float32 (Adam updates float32), the all-gather sends bfloat16 (half
# the bytes), the forward and backward compute in bfloat16, and the gradients are
# reduce-scattered in float32. With torch 2.13 it runs on gloo on the CPU too.
# Compared with a float32 step, same model, same batch:

# %%
# %%px
mixed = fsdp.mixed_precision_experiment(models.TiedMLP, batch, loss_fn)
fp32, bf16 = mixed["float32"], mixed["bfloat16"]
gathered = {name: run["forward"]["all_gather"]["bytes"] for name, run in mixed.items()}
print(f"rank {rank}: all-gathered in forward {gathered['float32']:,} B "
      f"(float32) vs {gathered['bfloat16']:,} B (bfloat16); "
      f"reduce-scattered {bf16['backward']['reduce_scatter']['bytes']:,} B; "
      f"loss {fp32['loss']:.5f} vs {bf16['loss']:.5f}; {bf16['dtypes']}")
assert gathered["bfloat16"] * 2 == gathered["float32"]
assert bf16["backward"]["reduce_scatter"] == fp32["backward"]["reduce_scatter"]
assert bf16["dtypes"] == {"output": "torch.bfloat16", "grads": ["torch.float32"],
                          "shards": ["torch.float32"]}
assert bf16["loss"] != fp32["loss"]  # computed in bfloat16 indeed
assert abs(bf16["loss"] - fp32["loss"]) <= 0.01 * fp32["loss"]

# %% [markdown] lang="ja"
# all-gather のバイト数はちょうど半分、reduce-scatter は float32 のままで同じバイト数です。出力は
# bfloat16、勾配とシャードは float32 です。損失は float32 の計算と違いますが、差は 1% 以内です。
#
# ### state dict の 2 つの形と、分散チェックポイント
#
# シャードしたモデルの `model.state_dict()` は `DTensor` を持ちます。各ランクの値は自分のシャード
# です。`torch.distributed.checkpoint.state_dict.get_model_state_dict(model,
# options=StateDictOptions(full_state_dict=True))` は全体を集めて、ふつうの `torch.Tensor` を返します。
# `torch.distributed.checkpoint` (DCP) はシャードの形のまま保存します。各ランクが自分のシャードを
# 自分のファイルに書き、どのテンソルのどの部分がどこにあるかを `.metadata` に書きます。読み込む側は
# 必要な部分だけを読むので、2 ランクで保存したものを 1 プロセスで読めます。これが
# 再シャーディング (resharding) です。学習した FSDP2 のモデルを、2 ランクで一時ディレクトリに保存します。

# %% [markdown] lang="en"
# The all-gather sends exactly half the bytes; the reduce-scatter stays float32, the same
# bytes. The output is bfloat16, the gradients and shards float32. The loss differs from
# the float32 computation, by less than 1%.
#
# ### The two forms of a state dict, and a distributed checkpoint
#
# The `model.state_dict()` of a sharded model holds `DTensor`s: each rank's value is its
# shard. `torch.distributed.checkpoint.state_dict.get_model_state_dict(model,
# options=StateDictOptions(full_state_dict=True))` gathers them into whole, plain
# `torch.Tensor`s. `torch.distributed.checkpoint` (DCP) saves the sharded form: each
# rank writes its shards to its own file, and `.metadata` says which part of which
# tensor is where. A reader reads the parts it needs, so what 2 ranks saved loads in
# one process: resharding. The 2 ranks save the trained FSDP2 model
# into a temporary directory:

# %%
# %%px
import os
import tempfile

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.tensor import DTensor

sharded_state = sharded.state_dict()
entry = sharded_state["embed.weight"]
print(f"rank {rank}: state_dict()['embed.weight'] is a {type(entry).__name__} of shape "
      f"{tuple(entry.shape)}; this rank holds {tuple(entry.to_local().shape)}")
assert all(isinstance(v, DTensor) for v in sharded_state.values())
assert entry.to_local().shape == mine["embed.weight"].chunk(world_size)[rank].shape
full_state = get_model_state_dict(sharded,
                                  options=StateDictOptions(full_state_dict=True))
assert all(type(v) is torch.Tensor for v in full_state.values())
assert all(full_state[k].shape == v.shape for k, v in sharded_state.items())

checkpoint_dir = [tempfile.mkdtemp(prefix="labkit-dcp-") if rank == 0 else None]
dist.broadcast_object_list(checkpoint_dir, src=0)  # one directory: rank 0's
checkpoint_dir = checkpoint_dir[0]
dcp.save(sharded_state, checkpoint_id=checkpoint_dir)  # each rank writes its shards
if rank == 0:
    print(sorted(os.listdir(checkpoint_dir)))

# %% [markdown] lang="ja"
# カーネル (プロセスグループのない 1 プロセス) で、ふつうの `models.TiedMLP` に読み込みます。
# `fsdp.load_checkpoint` は、チェックポイントの `.metadata` とモデルのキーと形を比べ (合わなければ、
# 合わないキーをすべて挙げた `ValueError` を出します)、`dcp.load` で 2 つのシャードから全体を埋め、
# `load_state_dict` します。ランクが集めた全体の state dict と等しいことを確かめ、ディレクトリを消します。

# %% [markdown] lang="en"
# In the kernel (one process, no process group), it is loaded into a plain
# `models.TiedMLP`: `fsdp.load_checkpoint` compares the checkpoint's `.metadata` with the
# model's keys and shapes (a `ValueError` names each that does not fit), fills the
# whole tensors from the 2 shards with `dcp.load`, and calls `load_state_dict`. It must
# equal the full state dict the ranks gathered; then the directory is removed.

# %%
import shutil
from pathlib import Path

checkpoint_dir = Path(ranks.pull("checkpoint_dir")[0])
full_state = ranks.pull("full_state")[0]  # gathered on the ranks, to compare with
assert not torch.distributed.is_initialized()  # this process has no process group
try:
    loaded = fsdp.load_checkpoint(models.TiedMLP(), checkpoint_dir)  # 2 shards -> 1
finally:
    shutil.rmtree(checkpoint_dir)
assert not checkpoint_dir.exists()
for name, value in loaded.state_dict().items():
    assert torch.equal(value, full_state[name]), name
assert loaded.head.weight is loaded.embed.weight  # tied again, as built
print(f"loaded {len(full_state)} tensors from 2 shards; equal to the ranks' full state")

# %% [markdown] lang="ja"
# ## いつシャードするか
#
# シャードで減るのはメモリで、通信は減りません (各ランクが更新するのは自分のシャードだけなので、
# オプティマイザの計算は 1/N になります)。リングのアルゴリズムでは、ステージ 1 と 2 が送るバイト数は
# DDP と同じで (reduce-scatter + all-gather = all-reduce)、ステージ 3 と FSDP2 は逆伝播の前の all-gather の
# ぶん、DDP の 1.5 倍を送ります (「1 ステップで送るバイト数」。FSDP2 は既定ではルートのパラメータを
# 逆伝播まで集めたまま持つので、ルート自身がパラメータを持つモデルでは 1.5 倍より少し少なくなります)。
# gloo では、ステージ 1 と 2 が DDP の 1.5 倍、ステージ 3 が 2 倍でした (「gloo が実際に送るバイト数」)。
# メモリと時間は単位が違うので、そのままでは比べられません。このレッスンでは、「シャードが割に合わない」を
# 次の意味で使います: **シャードする範囲の小さいステージ (ステージ 1 や 2) でもメモリの予算に収まるのに、
# ステージ 3 を選んで、余分な all-gather の時間を払うこと**。どのステージが収まるかはメモリだけで決まり、
# 余分な all-gather の時間は α–β モデルで見積もれます。
#
# 下の図は、Adam (float32) で学習するときのモデル状態 (パラメータ、勾配、Adam の状態) の 1 ランク
# あたりのメモリを、DDP のメモリに対する割合として、横軸をランクの数にして描きます。この割合はパラメータの数に
# よりません。線は式 (`sharding.memory_per_rank`) で、丸印は 2 ランクで測った値 (「各ステージが持つ
# メモリ」の表) です。2 ランク以外は測っていません。式だけです。
#
# 破線は予算の一例です。130 億 (13B) パラメータのモデルは、DDP では 1 ランクに 208 GB が要ります。
# これを 1 ランク 80 GB で学習します (活性値などは別に要るので、モデル状態だけの予算です)。

# %% [markdown] lang="en"
# ## When to shard
#
# Sharding saves memory, not communication (it even divides the optimizer's compute by
# N: each rank updates only its shard). In the ring algorithm stages 1 and 2 send DDP's
# bytes (reduce-scatter + all-gather = all-reduce); stage 3 and FSDP2 send 1.5 times as
# much, the all-gather before the backward ("Bytes sent per step"; by default FSDP2
# keeps the root's own parameters gathered until the backward, so a little less where
# the root holds parameters of its own). On gloo stages 1 and 2 sent 1.5 times DDP's
# bytes and stage 3 twice ("What gloo really sends"). Memory and seconds are different
# units, so here "sharding costs more than it saves" means: **choosing stage 3, and
# paying for its extra all-gather, where a stage that shards less would fit the memory
# budget too**. Which stages fit depends on memory alone; the extra all-gather's time
# comes from the α–β model.
#
# The plot shows the model states' memory per rank (parameters, gradients, Adam's
# state, training with Adam in float32) as a share of DDP's, against the number of
# ranks; the share does not depend on the number of parameters. The lines are the
# formula (`sharding.memory_per_rank`); the circles are what 2 ranks measured (the
# table of "Memory each stage holds"). Nothing was measured on other numbers of ranks:
# there, only the formula.
#
# The dashed line is an example budget: a 13-billion (13B) parameter model, which needs
# 208 GB per rank under DDP, trained with 80 GB per rank (for the model states only:
# activations and buffers need room besides).

# %%
world_sizes = range(1, 65)
per_rank = {n: sharding.memory_per_rank(psi, n, **sharding.FP32_ADAM)
            for n in world_sizes}
formula = {stage: (world_sizes, [m[stage] / m["DDP"] for m in per_rank.values()])
           for stage in sharding.STAGES}
# The circles: the memory table's measurements, checked against the formula there.
on_ranks = {stage: (2, measured[stage] / measured["DDP"]) for stage in sharding.STAGES}

big, budget = 13e9, 80e9  # parameters, and bytes per rank for the model states
fig = plots.memory_vs_world_size(
    formula, on_ranks, ylabel="memory_share", title="when_to_shard_title",
    budget=(budget / (16 * big), labkit.t("budget_line", gb=80, billions=big / 1e9,
                                             oku=big / 1e8)))

# %% [markdown] lang="ja"
# 予算の線より下にあるステージが収まります。
#
# - DDP とステージ 1 は、何ランクにしても収まりません。シャードしないパラメータと勾配だけで 104 GB です。
# - ステージ 3 は 3 ランクから収まります (1 ランク 69.3 GB)。
# - ステージ 2 は 6 ランクから収まります (78 GB。5 ランクでは 83.2 GB)。
#
# つまり 3〜5 ランクでは、ステージ 3 しか選べません。余分な all-gather は、そもそも学習するために払う
# 代償です。
#
# 6 ランクからはステージ 2 がメモリに収まり、送るバイト数も (リングでは) DDP と同じです。そこでの
# ステージ 3 の余分な all-gather (パラメータ全体をもう一度集める 52 GB の all-gather で、各ランクはその
# 5/6 を送ります) は、予算が必要としないメモリのための余分な通信です。1 ステップあたりの時間は、多くても
# 下のセルが表示する秒数です。FSDP2 は逆伝播のあいだにこの all-gather を先読み (prefetch) し、GPU では
# 計算と重ねて実行できるので、時間が増えるのは通信がボトルネックのときです。秒数は、「1 ステップで送る
# バイト数」でこのマシンに当てはめた α と β で見積もります (当てはめに使った all-reduce は 1 KiB〜4 MiB
# なので、52 GB の秒数は外挿で、桁の目安です)。GPU のクラスタでは α と β が違うので秒数は変わりますが、
# 境目の 6 ランクはメモリだけで決まるので変わりません。
#
# ここでの秒数はリングのアルゴリズムのものです。gloo では reduce-scatter が all-reduce 1 回ぶんかかるので、
# ステージ 2 は all-reduce の 1.5 倍、ステージ 3 は 2 倍になります。余分な all-gather の秒数は同じで、
# 境目も変わりません (ステージ 3 はステージ 2 の 1.5 倍ではなく 4/3 倍)。予算から見ると、1 ランク 80 GB で
# 学習できる最大のモデルは、DDP ではランクの数によらず 50 億パラメータ、ステージ 3 ではその N 倍です。

# %% [markdown] lang="en"
# A stage fits where its line is below the budget's:
#
# - DDP and stage 1 never fit, on any number of ranks: their unsharded parameters and
#   gradients alone are 104 GB.
# - Stage 3 fits from 3 ranks on (69.3 GB a rank).
# - Stage 2 fits from 6 ranks on (78 GB; 83.2 GB on 5).
#
# So on 3 to 5 ranks stage 3 is the only choice: its extra all-gather is the price of
# training at all.
#
# From 6 ranks on, stage 2 fits, and sends DDP's bytes (in a ring). Stage 3's extra
# all-gather (all the parameters once more: an all-gather of 52 GB, of which each rank
# sends 5/6) is communication added for memory the budget does not need. It costs at
# most the seconds the cell below prints, a step: FSDP2 prefetches it during the
# backward, and on a GPU it can run alongside the compute, so it adds time where
# communication is the bottleneck. The seconds come from the α–β model, with the α and
# β fitted on this machine in "Bytes sent per step" (on all-reduces of 1 KiB to 4 MiB:
# for 52 GB the seconds are an extrapolation, an order of magnitude). On a GPU cluster
# α and β differ, and so do the seconds, but not the crossover at 6 ranks, which memory
# alone decides.
#
# These seconds are the ring algorithm's: on gloo a reduce-scatter costs a whole
# all-reduce, so stage 2 takes 1.5 all-reduces and stage 3 two; the extra all-gather
# costs the same seconds, and the crossover does not move (stage 3 is 4/3 of stage 2
# there, not 1.5). Seen from the budget: the largest model 80 GB per rank can train is
# 5 billion parameters under DDP, on any number of ranks, and N times that under
# stage 3.

# %%
fits = {stage: fsdp.smallest_world_size(big, budget, stage, **sharding.FP32_ADAM)
        for stage in sharding.STAGES}
gb = {n: {stage: round(b / 1e9, 1) for stage, b in
          sharding.memory_per_rank(big, n, **sharding.FP32_ADAM).items()}
      for n in (1, 3, 5, 6)}
print(f"fewest ranks on which each stage fits {budget / 1e9:g} GB: {fits}")
assert fits == {"DDP": None, "ZeRO-1": None, "ZeRO-2": 6, "ZeRO-3": 3}
assert (8 * big, gb[1]["DDP"], gb[3]["ZeRO-3"]) == (104e9, 208, 69.3)
assert (gb[5]["ZeRO-2"], gb[6]["ZeRO-2"]) == (83.2, 78)

largest = {n: {stage: budget / per_param[stage] for stage in sharding.STAGES}
           for n in (2, 8, 64)
           for per_param in [sharding.memory_per_rank(1, n, **sharding.FP32_ADAM)]}
for n, row in largest.items():
    print(f"{n:2d} ranks, largest model in {budget / 1e9:g} GB a rank: "
          + ", ".join(f"{stage} {p / 1e9:.1f}B" for stage, p in row.items()))
assert all(row["DDP"] == 5e9 and row["ZeRO-3"] == n * 5e9 for n, row in largest.items())

ab = ranks.pull("ab")[0]  # the alpha-beta model fitted in "Bytes sent per step"
n = fits["ZeRO-2"]  # from here on stage 2 fits: stage 3's extra all-gather buys nothing
allreduce_s = ab.time(4 * big, n)  # DDP's, and stage 2's reduce-scatter + all-gather
extra_s = ab.all_gather_time(4 * big, n)  # the parameters gathered again for backward
print(f"on {n} ranks, with this machine's alpha {ab.alpha * 1e6:.0f} us and beta "
      f"{ab.beta / 1e9:.2f} GB/s: stage 2 communicates {allreduce_s:.1f} s a step, "
      f"stage 3 {allreduce_s + extra_s:.1f} s: up to {extra_s:.1f} s more a step (where "
      f"it is not hidden behind compute), to hold "
      f"{gb[6]['ZeRO-2'] - gb[6]['ZeRO-3']:.1f} GB a rank less, which the budget "
      "does not need")
# On gloo the reduce-scatter is an all-reduce: the same extra all-gather.
stage2_gloo = ab.reduce_scatter_time(4 * big, n, "gloo") + ab.all_gather_time(4 * big, n)
print(f"priced for gloo: stage 2 {stage2_gloo:.1f} s, stage 3 {stage2_gloo + extra_s:.1f} s")
# The ratios the text quotes, as labkit's α–β model gives them (arithmetic of the
# model, not a measurement): an all-gather priced at half an all-reduce, and gloo's
# reduce-scatter at a whole one.
assert abs((allreduce_s + extra_s) / allreduce_s - 1.5) < 1e-12
assert abs(stage2_gloo / allreduce_s - 1.5) < 1e-12
assert abs((stage2_gloo + extra_s) / stage2_gloo - 4 / 3) < 1e-12

# %% [markdown] lang="ja"
# ## まとめ
#
# Ψ 個のパラメータを float32 の Adam で、N ランクで学習するとき (S = 4Ψ バイト):
#
# | | 1 ランクが持つもの | 勾配の同期 | パラメータ | 1 ランクが送るバイト数 (リング) |
# |---|---|---|---|---|
# | DDP | 16Ψ | all-reduce | 全ランクが同じ更新 | 2(N − 1)/N × S |
# | ZeRO-1 | 8Ψ + 8Ψ/N | reduce-scatter (勾配の全体は残す) | シャードを更新し all-gather | 2(N − 1)/N × S |
# | ZeRO-2 | 4Ψ + 12Ψ/N | reduce-scatter (シャードだけ残す) | シャードを更新し all-gather | 2(N − 1)/N × S |
# | ZeRO-3 | 16Ψ/N | 層ごとに reduce-scatter | 層ごとに順伝播と逆伝播の前に all-gather、使ったら解放 | 3(N − 1)/N × S |
#
# - 手で書いた 3 つのステージは、2 ランクでは torch の DDP とビット単位で一致し、1 プロセスとは 1e-6 以内
#   です (共有された重みと凍結した層のあるモデルで、ランクごとに違う初期値から)。
# - 勾配累積 (ステップの前に逆伝播を 2 回) も、3 つのステージすべてで DDP と 1e-6 以内で等しくなります。
#   ステージ 3 は、逆伝播のたびにシャードの勾配へ平均を足し込みます。平坦化したバッファを同じ長さに
#   切るやり方は、要素ごとに計算するオプティマイザ (SGD、Adam、AdamW) に向いています。
# - 測ったメモリは、式にパディングと Adam の `step` (テンソル 1 つにつき 4 バイト) を足したものです。
# - リングのアルゴリズム (NCCL) では、ステージ 1 と 2 は DDP と同じバイト数を送り、ステージ 3 は 1.5 倍を
#   送ります。gloo の reduce-scatter は all-reduce を行うので、gloo でソケットに書き込んだバイト数は、
#   ステージ 1 と 2 が DDP の 1.5 倍、ステージ 3 が 2 倍でした。この短い集団通信の時間は固定の遅延で決まり、
#   gloo の実際の動作に合わせて見積もっても α–β モデルの誤差が大きいので、確かめるのはバイト数です。
# - FSDP2 (`fully_shard`) はステージ 3 を PyTorch が実装したもので、`Zero3` とビット単位で一致します。

# %% [markdown] lang="en"
# ## Summary
#
# Training Ψ parameters with Adam in float32 on N ranks (S = 4Ψ bytes):
#
# | | a rank holds | gradients synced by | parameters | a rank sends (ring) |
# |---|---|---|---|---|
# | DDP | 16Ψ | all-reduce | the same update on every rank | 2(N - 1)/N × S |
# | ZeRO-1 | 8Ψ + 8Ψ/N | reduce-scatter (the whole gradient kept) | shard updated, all-gathered | 2(N - 1)/N × S |
# | ZeRO-2 | 4Ψ + 12Ψ/N | reduce-scatter (the shard kept) | shard updated, all-gathered | 2(N - 1)/N × S |
# | ZeRO-3 | 16Ψ/N | reduce-scatter, layer by layer | all-gathered per layer before forward and backward, freed after | 3(N - 1)/N × S |
#
# - The three stages written by hand equal torch's DDP bit for bit on 2 ranks, and one
#   process within 1e-6 (on a model with a tied weight and a frozen layer, from
#   differently seeded ranks).
# - Gradient accumulation (two backward passes before a step) equals DDP's within 1e-6
#   in all three stages: stage 3 adds each backward pass's shard of the mean to the
#   shard's gradient. Cutting a flat buffer into equal pieces suits optimizers that
#   compute element by element (SGD, Adam, AdamW).
# - The memory measured is the formula plus padding and Adam's `step` counters (4 bytes
#   a tensor).
# - In the ring algorithm (NCCL's), stages 1 and 2 send what DDP sends, stage 3 1.5
#   times as much. Gloo's reduce-scatter runs an all-reduce: on gloo the bytes written to
#   the sockets were 1.5 times DDP's for stages 1 and 2 and twice for stage 3. These
#   short collectives take latency-bound times the α–β model misses by far, priced for
#   gloo too, so the bytes are what is asserted.
# - FSDP2 (`fully_shard`) is stage 3 as PyTorch implements it, bit for bit `Zero3`'s.

# %%
ranks.stop()
