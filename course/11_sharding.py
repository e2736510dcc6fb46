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
import torch

from labkit import cluster, exercises, models, sharding

ranks = cluster.start(2, background=True)  # the ranks boot while you read

# %% [markdown] lang="ja"
# ## メモリはどこに使われるか
#
# Ψ 個のパラメータのモデルを float32 の Adam で学習するとき、各ランクが持つ「モデルの状態」は次の
# 3 つです (活性値は含みません)。
#
# - パラメータ: 1 つ 4 バイトで 4Ψ
# - 勾配: パラメータと同じ形で 4Ψ
# - Adam の状態: `exp_avg` (勾配の移動平均) と `exp_avg_sq` (勾配の 2 乗の移動平均)。どちらも
#   パラメータと同じ形で、合わせて 8Ψ。3 つ目の `step` (何ステップ目か) は、パラメータのテンソル
#   1 つにつき 0 次元のテンソル 1 つ (float32 で 4 バイト) です (`torch/optim/adam.py` の初期化。
#   `capturable` も `fused` も使わなければ CPU に置かれます)。要素の数ではなくテンソルの数で決まるので、
#   式には入れず、測った値との差として数えます。
#
# DDP では、どのランクもこの 16Ψ を丸ごと持ちます。ZeRO (Rajbhandari ほか、2020) は、ステージ 1 で
# オプティマイザの状態を、ステージ 2 でさらに勾配を、ステージ 3 でさらにパラメータを、N 個のランクで
# 分けて持ちます。分けた部分は 1 ランクあたり 1/N になります。
#
# | | パラメータ | 勾配 | Adam の状態 | 合計 |
# |---|---|---|---|---|
# | DDP | 4Ψ | 4Ψ | 8Ψ | 16Ψ |
# | ZeRO-1 | 4Ψ | 4Ψ | 8Ψ/N | 8Ψ + 8Ψ/N |
# | ZeRO-2 | 4Ψ | 4Ψ/N | 8Ψ/N | 4Ψ + 12Ψ/N |
# | ZeRO-3 | 4Ψ/N | 4Ψ/N | 8Ψ/N | 16Ψ/N |
#
# `sharding.memory_parts(Ψ, N, **sharding.FP32_ADAM)` がこの表を計算します (レッスン 09 の
# `sharding.memory_per_rank` はその合計です。既定の値は、ZeRO の論文の混合精度の場合です)。
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
# 次に、ランクの上で測ります。`sharding.held_bytes` は、テンソルが持つメモリ (ストレージ) を数えます。
# ビューや結ばれた重みのように同じストレージを共有するテンソルは 1 回だけ、大きさを 0 にした
# (解放した) ストレージは 0 と数えます。
#
# このレッスンのどの学習も、使い方は同じです。`T(model, lr=...)` で作り (ランク 0 の重みを全ランクに
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
# ステージ 1 では、各ランクが Adam の状態を自分のシャードのぶんだけ持ちます。1 ステップは次のとおりです。
#
# 1. 各ランクが自分のバッチで順伝播と逆伝播をします (DDP と同じです)。
# 2. 勾配を平均します。ただし、各ランクが更新するのは自分のシャードだけなので、要るのは平均のうち
#    自分のシャードの部分だけです。そこで all-reduce ではなく **reduce-scatter** を使います
#    (ZeRO の論文もそうします)。reduce-scatter は全ランクのテンソルを足し、結果を N 個に分けて、
#    ランク r には r 番目だけを渡します。リングの all-reduce は reduce-scatter と all-gather を続けた
#    ものなので、all-reduce を使うと、使わない部分まで受け取ることになります。
# 3. 自分のシャードを Adam で更新します。
# 4. **all-gather** で、各ランクが更新したシャードを全ランクに配ります。全員が新しいパラメータの
#    全体を持ちます。
#
# reduce-scatter と all-gather を 1 回ずつで、DDP の all-reduce 1 回と同じ量を送ります
# (「1 ステップで送るバイト数」で数えます)。
#
# 集団通信は 1 本の平らなテンソルで呼ぶので、`sharding.FlatParameters` が下準備をします。学習する
# パラメータを 1 本のバッファ `full` に並べ、各パラメータをそのビューにし、長さが N の倍数になるよう
# 末尾を 0 で埋めます (パディング)。`shard(r)` はランク r の部分 (ビュー) です。`flat_grad()` は勾配を
# 同じ並びの 1 本にまとめ、各 `.grad` をそのビューにします。どの集団通信を、どの部分に、いつ呼ぶかは、
# 下のセルに書いてあります。
#
# ここに入っている torch 2.13 では、1 本のテンソルへの all-gather と reduce-scatter は
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
# 確かめ方です。モデルは `models.TiedMLP` で、出力の層が埋め込みの重みを共有し (結ばれた重み)、
# 学習しない (凍結した) 層を 1 つ持ちます。学習するパラメータは 833 個で、2 で割り切れないので、
# 平らなバッファには 1 つパディングが入ります。
#
# 各ランクは、わざと違う乱数の種でモデルを作ります (`torch.manual_seed(rank)`)。最初にランク 0 の
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

with warnings.catch_warnings(record=True) as caught:  # the names before torch 2.13
    warnings.simplefilter("always")
    dist.all_gather_into_tensor(torch.empty(world_size), torch.ones(1))
    dist.reduce_scatter_tensor(torch.empty(1), torch.ones(world_size))
assert [w.category for w in caught] == [FutureWarning, FutureWarning]

# %% [markdown] lang="ja"
# DDP とはビットまで同じです。順伝播も各ランクの勾配も同じ計算で、2 ランクでは、足してから 2 で割る
# ことと 2 で割ってから足すこと (torch の DDP) は誤差なく同じ値になり、Adam は要素ごとの計算なので、
# シャードに分けて更新しても全体を更新しても同じ値になるからです。1 プロセスとの差は 1e-6 以内です。
# 全体のバッチの勾配を一度に足すのと、半分ずつ足してから平均するのとでは、足す順番が違うので、
# ビットまで同じになるとは限りません。
#
# 各ランクの Adam の状態は、自分のシャードの 417 個ぶんだけです。

# %% [markdown] lang="en"
# Bit for bit DDP's: the forward pass and each rank's gradients are the same
# computation; on 2 ranks, summing then halving and halving then summing (torch's DDP)
# give the same value exactly; and Adam works element by element, so updating shards
# gives what updating the whole gives. From one process the difference is within 1e-6:
# summing the whole batch's gradient at once and averaging two halves add in a
# different order, so the bits may differ.
#
# Each rank's Adam state covers its own shard only: 417 values.

# %% [markdown] lang="ja"
# ## 演習: ステージ 2 の勾配の reduce-scatter
#
# 上の `Zero1.reduce_gradients` は、reduce-scatter の結果を、平坦化した勾配のうち自分の部分
# (ビュー) に書きます。これでは、勾配の全体 (パディングを入れて 4Ψ バイトあまり) が残ったままです。
# ステージ 2 では、自分のシャードの平均を新しいテンソルに受け取り、勾配の全体は捨てます。
#
# `shard_of_mean_gradient(flat_grad, rank, world_size)` を書いてください。`flat_grad` はこのランクの
# 平坦化した勾配で、要素の数は world_size で割り切れます。全ランクで平均した勾配のうち、このランクの
# シャード (`rank * k` 番目から k 個、k = 要素の数 ÷ world_size) を、新しいテンソルとして返します。
# `dist.reduce_scatter_single(output, input)` を 1 回だけ使います。reduce-scatter はランクの番号から
# 受け取る部分を決めるので、`rank` は使わなくても書けます。`flat_grad` の一部 (ビュー) を返すと、
# 勾配全体のメモリが残ったままになります。
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
# ステージ 1 では、reduce-scatter のあとも、各ランクが勾配の全体 (4Ψ) を持ち続けます。使うのは
# 自分のシャードだけです。ステージ 2 は勾配も分けます。reduce-scatter で自分のシャードの平均を
# 受け取ったら、勾配の全体を捨てます。`Zero2` は、ステージ 1 と違う `reduce_gradients` だけを書き換え、
# 上の演習の `shard_of_mean_gradient` を呼びます。
#
# この `Zero2` は逆伝播が終わってから勾配をまとめて送るので、送る前の一瞬は勾配の全体があります。
# Adam が動くあいだ持っているのがシャードだけ、という点がステージ 2 です。逆伝播の途中で、
# 層ごとに送って捨てるのが、次のステージ 3 の `Zero3` です。

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
# 2. 層の順伝播のあと (`register_forward_hook`): 解放する。ただし autograd は逆伝播のために重みを
#    保存しているので、
# 3. 層の逆伝播の直前 (層の出力の勾配ができたとき。出力の `register_hook`): もう一度集める
# 4. 層のパラメータの勾配がそろったとき (`register_post_accumulate_grad_hook`): 勾配を reduce-scatter
#    して自分のシャードの平均だけを残し、集めたパラメータを解放する
#
# 層の分け方は `sharding.shard_units(model)` が決めます。学習するパラメータを直接持つモジュールごとに
# 1 つです。結ばれた重み (`TiedMLP` の `embed.weight` と `head.weight`) は 2 つのモジュールが使うので、
# モデル全体 (ルート) の単位に入り、順伝播のあいだずっと集めたままになります。凍結したパラメータは
# 学習しないので、このクラスは分けずに、全ランクがそのまま持ちます。
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
#    (`register_post_accumulate_grad_hook`): reduce-scatter them, keep only this rank's
#    shard of the mean, and free the gathered parameters
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
            shard.grad = shard_of_mean_gradient(grads, self.rank, self.world_size)
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
# ## 演習: ZeRO-3 の層が逆伝播のあとで解放する
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
# 自分のシャード (`self.shards`) は解放しないでください。Adam が更新するのはそれです。確認のセルは、
# 順伝播のあとと逆伝播のあとに各ランクが持つバイト数を `sharding.held_bytes` で測り、3 ステップの
# あとのパラメータを torch の DDP と比べます。

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
# Do not free this rank's shards (`self.shards`): they are what Adam updates. The check
# measures with `sharding.held_bytes` what each rank holds after the forward pass and
# after the backward pass, and compares the parameters after 3 steps with torch's DDP.

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

# %% [markdown] lang="ja"
# ## 各ステージが持つメモリ
#
# 「メモリはどこに使われるか」の MLP (Ψ = 5365) を、4 つのやり方で 2 ステップずつ学習し、Adam が動く
# 直前に各ランクが持っていたバイト数を、式と並べます。式との差は 2 つから来ます。
#
# - パディング: 平らなバッファは N の倍数に埋めるので、1 本につき最大 N − 1 個の要素が多くなります。
#   パラメータ、勾配、Adam の 2 つの状態で、1 要素あたり最大 16 バイトです。バッファは
#   `Zero1`、`Zero2` では 1 本、`Zero3` では層ごとに 1 本 (この MLP では 3 本) です。
# - Adam の `step`: パラメータのテンソル 1 つ (`Zero1`、`Zero2` ではシャード 1 つ) につき 4 バイト。
#
# 確認のセルは、差が 0 以上で、この 2 つの上限 (許容差) 以下であることを確かめます。

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
tolerance_bytes = {stage: row["tolerance"] for stage, row in memory_table.items()}
print(f"psi = {psi}, 2 ranks: bytes per rank when Adam runs")
print(f"{'':7s} {'formula':>8s} {'measured':>9s} {'diff':>5s} {'tol':>4s}  measured parts")
for stage, row in memory_table.items():
    print(f"{stage:7s} {row['formula']:8.0f} {row['measured']:9d} "
          f"{row['measured'] - row['formula']:5.0f} {row['tolerance']:4d}  {row['parts']}")
for stage, row in memory_table.items():
    assert 0 <= row["measured"] - row["formula"] <= row["tolerance"], stage
assert measured["ZeRO-3"] < measured["ZeRO-2"] < measured["ZeRO-1"] < measured["DDP"]

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
# その半分ずつ、(N − 1)/N × S です (all-reduce = reduce-scatter + all-gather)。ステージ 1 と 2 は
# DDP と同じだけ送り、ステージ 3 は逆伝播の前の all-gather のぶん、DDP の 1.5 倍を送ります。
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
# all-gather). Stages 1 and 2 send what DDP sends; stage 3 sends 1.5 times as much: the
# all-gather before the backward pass.
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
        with comm_counting.CollectiveLog(("reduce_scatter", "all_gather")) as log:
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
    return sum(c["bytes"] * comm.ring_factor(world_size) / (1 if c["op"] == "all_reduce"
                                                            else 2) for c in calls)


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
