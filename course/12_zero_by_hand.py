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
# # 12 ZeRO を手で書く
#
# このレッスンを終えると、次のことができます。
#
# - 1 ランクが持つモデルの状態のメモリを、DDP と ZeRO のステージ 1〜3 について Ψ と k で数える
# - reduce-scatter と all-gather で ZeRO のステージ 1、2、3 を書き、torch の DDP とビット単位で
#   一致することを確かめる
# - 各ステージが持つメモリを測り、式との差を説明する
# - 各ステージが 1 ステップに送るバイト数を数え、シャードで減るのはメモリで、通信ではないことを説明する

# %% [markdown] lang="en" tags=["outcomes"]
# # 12 ZeRO by hand
#
# After this lesson you can:
#
# - count a rank's model-state memory under DDP and ZeRO stages 1 to 3, in Ψ and k;
# - write ZeRO stages 1, 2 and 3 with reduce-scatters and all-gathers, and check them
#   against torch's DDP bit for bit;
# - measure what each stage holds, and explain how it differs from the formula;
# - count the bytes each stage sends per step, and say why sharding saves memory, not
#   traffic.

# %%
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %%
import torch

from labkit import cluster, exercises, models, sharding

ranks = cluster.start(2, background=True)  # the ranks boot while you read

# %% [markdown] lang="ja" tags=["core"]
# ## メモリは何に使われるか
#
# Ψ 個のパラメータを Adam で学習するとき、各ランクが持つ「モデルの状態」は、パラメータ (P バイト)、
# 勾配 (G バイト)、Adam の状態 (1 パラメータあたり k バイト) です (活性値は含みません)。このレッスンの
# float32 では P = G = 4Ψ、`exp_avg` と `exp_avg_sq` で k = 8 です。
# ZeRO の論文 (Rajbhandari ほか、2020) の混合精度では P = G = 2Ψ、Adam の状態が float32 のパラメータのコピーも持って k = 12 です。
# ZeRO は、ステージ 1 で Adam の状態を、ステージ 2 でさらに勾配を、ステージ 3 でさらにパラメータを
# N 個のランクで分割して持ちます。
#
# | | 1 ランクあたり | float32 の Adam (4 + 4 + 8) | 混合精度 (2 + 2 + 12) |
# |---|---|---|---|
# | DDP | P + G + kΨ | 16Ψ | 16Ψ |
# | ZeRO-1 | P + G + kΨ/N | 8Ψ + 8Ψ/N | 4Ψ + 12Ψ/N |
# | ZeRO-2 | P + (G + kΨ)/N | 4Ψ + 12Ψ/N | 2Ψ + 14Ψ/N |
# | ZeRO-3 | (P + G + kΨ)/N | 16Ψ/N | 16Ψ/N |
#
# DDP ではどちらも 16Ψ で、内訳が違います。表は `sharding.memory_parts(Ψ, N)` が計算します。Adam の 3 つ目の状態 `step` はテンソル 1 つにつき
# 4 バイトなので、式には入れません。次のセルはそれを確かめ、メモリを測る MLP の
# 表の値を出します。

# %% [markdown] lang="en" tags=["core"]
# ## Where the memory goes
#
# Training Ψ parameters with Adam, each rank holds three "model states" (activations
# not included): the parameters (P bytes), the gradients (G bytes) and Adam's state (k
# bytes a parameter). In this lesson's float32, P = G = 4Ψ, and `exp_avg` and
# `exp_avg_sq` make k = 8; in the ZeRO paper's mixed precision (Rajbhandari et al.,
# 2020), P = G = 2Ψ, and Adam's state holds a float32 copy of the parameters too,
# k = 12. ZeRO shares out over the N ranks Adam's state in stage 1, the gradients too
# in stage 2, and the parameters too in stage 3:
#
# | | per rank | float32 Adam (4 + 4 + 8) | mixed precision (2 + 2 + 12) |
# |---|---|---|---|
# | DDP | P + G + kΨ | 16Ψ | 16Ψ |
# | ZeRO-1 | P + G + kΨ/N | 8Ψ + 8Ψ/N | 4Ψ + 12Ψ/N |
# | ZeRO-2 | P + (G + kΨ)/N | 4Ψ + 12Ψ/N | 2Ψ + 14Ψ/N |
# | ZeRO-3 | (P + G + kΨ)/N | 16Ψ/N | 16Ψ/N |
#
# Under DDP both make 16Ψ, split differently; `sharding.memory_parts(Ψ, N)` computes
# the table. Adam's third state, `step`, 4 bytes a tensor, is left out; the next cell
# checks that and gives the table for the MLP measured below.

# %%
model = models.WideMLP(10, 63, 2, 10)
psi = models.count_params(model)
adam = torch.optim.Adam(model.parameters(), lr=1e-3)
model(torch.randn(4, 10)).sum().backward()
adam.step()
state = adam.state[model.net[0].weight]
assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
assert state["exp_avg"].shape == state["exp_avg_sq"].shape == model.net[0].weight.shape
assert state["step"].shape == () and state["step"].dtype == torch.float32
assert state["step"].device.type == "cpu"
assert len(adam.state) == len(list(model.parameters()))  # one step tensor per tensor

fp32 = sharding.memory_parts(psi, 2, **sharding.FP32_ADAM)
mixed = sharding.memory_parts(psi, 2)  # the ZeRO paper's mixed precision
totals = {stage: (sum(fp32[stage].values()), sum(mixed[stage].values()))
          for stage in sharding.STAGES}
print(f"psi = {psi}, 2 ranks, bytes per rank (float32, mixed precision): {totals}")
assert totals["DDP"] == (16 * psi, 16 * psi)
assert totals["ZeRO-1"] == (8 * psi + 8 * psi / 2, 4 * psi + 12 * psi / 2)
assert totals["ZeRO-2"] == (4 * psi + 12 * psi / 2, 2 * psi + 14 * psi / 2)
assert totals["ZeRO-3"] == (16 * psi / 2, 16 * psi / 2)

# %% [markdown] lang="ja"
# 次に、各ランクで測ります。`sharding.held_bytes` はテンソルが持つストレージを、共有されたものは 1 回、
# 解放した (大きさ 0 の) ものは 0 と数えます。このレッスンの学習クラスは、どれも `T(model)` で作り
# (ランク 0 の重みを配ります)、`T.step(X, y, loss_fn)` で 1 ステップ進め、Adam が動く直前のバイト数を
# `T.held` に残します。基準は `DDPAdam` (torch の DDP と Adam。勾配はバケットのビュー) です。
#
# **予想してから実行:** DDP で測った Adam の状態は、式の 8Ψ より何バイト多いでしょうか?

# %% [markdown] lang="en"
# Now on the ranks. `sharding.held_bytes` counts the storage tensors hold: a shared
# one once, a freed one (resized to 0) as 0. Each trainer here is built as `T(model)`
# (handing out rank 0's weights), steps with `T.step(X, y, loss_fn)` and keeps in
# `T.held` the bytes held when Adam runs. The baseline, `DDPAdam`, is torch's DDP
# (gradients as views of its buckets) and Adam.
#
# **Predict, then run:** how many bytes above the formula's 8Ψ does Adam's state
# measure under DDP?

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

# %% [markdown] lang="ja" tags=["core"]
# ## ZeRO ステージ 1 を手で書く
#
# ステージ 1 では、各ランクが Adam の状態を自分のシャードのぶんだけ持ちます (torch では
# `ZeroRedundancyOptimizer` です:
# [13: ZeroRedundancyOptimizer: オプティマイザの状態を分割して持つ (シャード)](13_fsdp2.ipynb#cell-id=13-zeroredundancyoptimizer-sharing-out-the-optimizer-state))。
# 1 ステップは次のとおりです。
#
# 1. 各ランクが自分のバッチで順伝播と逆伝播をします。
# 2. 各ランクは自分のシャードだけを更新するので、平均の勾配のうち自分の部分を **reduce-scatter** で
#    受け取ります。全ランクのテンソルを足し、結果を N 個に分けてランク r に r 番目を渡す集団通信です。
# 3. 自分のシャードを Adam で更新します。
# 4. **all-gather** で、各ランクが更新したシャードを全ランクに配ります。
#
# `sharding.FlatParameters` は、学習するパラメータを 1 本のバッファ `full` のビューにし、N の倍数まで
# 0 で埋めます (パディング)。`shard(r)` はランク r の部分、`flat_grad()` は同じ並びの勾配です。集団通信は
# `dist.reduce_scatter_single` と `dist.all_gather_single` です。

# %% [markdown] lang="en" tags=["core"]
# ## ZeRO stage 1 by hand
#
# In stage 1 each rank holds Adam's state for its own shard only (in torch,
# `ZeroRedundancyOptimizer`:
# [13: ZeroRedundancyOptimizer: sharing out the optimizer state](13_fsdp2.ipynb#cell-id=13-zeroredundancyoptimizer-sharing-out-the-optimizer-state)).
# A step:
#
# 1. Each rank runs the forward and backward pass on its batch.
# 2. Updating only its shard, each rank receives only its shard of the mean gradient,
#    by a **reduce-scatter**: it sums the ranks' tensors, cuts the sum into N pieces
#    and gives rank r the r-th.
# 3. Each rank updates its shard with Adam.
# 4. An **all-gather** hands every rank the shards the others updated.
#
# `sharding.FlatParameters` makes the trained parameters views of one buffer `full`,
# padded with zeros to a multiple of N; `shard(r)` is rank r's piece, `flat_grad()` the
# gradients laid out alike. The collectives are `dist.reduce_scatter_single` and
# `dist.all_gather_single`.

# %% [markdown] lang="ja"
# まず 4 つの値で確かめます。reduce-scatter で各ランクが和の自分の分を受け取り、all-gather でそれを
# 全ランクに配ると、all-reduce と同じ結果になります。
#
# **予想してから実行:** reduce-scatter のあと、ランク 1 はいくつの値を持っているでしょうか?

# %% [markdown] lang="en"
# First on four values: a reduce-scatter hands each rank its piece of the sum, an
# all-gather hands every rank all the pieces; together, an all-reduce.
#
# **Predict, then run:** after the reduce-scatter, how many values does rank 1 hold?

# %%
# %%px
g = torch.arange(4.0) + 10 * rank  # a gradient of 4 values, different on each rank
piece = torch.empty(4 // world_size)
dist.reduce_scatter_single(piece, g)  # rank r: the r-th piece of the sum
whole = torch.empty(4)
dist.all_gather_single(whole, piece)  # every rank: all the pieces
summed = g.clone()
dist.all_reduce(summed)
assert torch.equal(whole, summed)  # reduce-scatter + all-gather = all-reduce
steps_shown = [("before", g.tolist()), ("reduce_scatter_single", piece.tolist()),
               ("all_gather_single", whole.tolist()), ("all_reduce", summed.tolist())]

# %%
from labkit import diagrams

shown = ranks.pull("steps_shown")  # per rank: (what ran, values after it), in order
rows = {labkit.t("values_before") if op == "before" else f"dist.{op}":
        [dict(r)[op] for r in shown] for op, _ in shown[0]}
assert [len(v) for v in rows["dist.reduce_scatter_single"]] == [2, 2]
fig = diagrams.collectives(rows, fmt="{:.0f}")

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
# 確かめるモデル `models.TiedMLP` は、重みを共有する層と凍結した層を持ち、833 個のパラメータを学習します
# (パディング 1 つ)。各ランクはわざと違うシードで作るので、ランク 0 の重みを配り忘れると失敗します。
# 3 ステップのあと、1 プロセスの学習と `DDPAdam` と比べます。

# %% [markdown] lang="en"
# The model checked, `models.TiedMLP`, has a tied weight and a frozen layer (833
# trained parameters, one padding value). Each rank builds it from another seed, so a
# trainer that forgets to hand out rank 0's weights fails. After 3 steps it is compared
# with one process and with `DDPAdam`.

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


def alone(micro_batches):
    """TiedMLP in one process from rank 0's start: micro_batches(step), then Adam."""
    torch.manual_seed(0)  # rank 0's starting weights
    one = models.TiedMLP()
    adam = torch.optim.Adam(one.parameters(), lr=1e-3)
    for step in range(STEPS):
        for X, y in micro_batches(step):
            loss_fn(one(X), y).backward()
        adam.step()
        adam.zero_grad()
    return [p.detach() for p in one.parameters()]


def compare(full, one_process, ddp):
    """(largest difference from one process, bit for bit equal to DDP's?)"""
    diff = max((a - b).abs().max().item() for a, b in zip(full, one_process, strict=True))
    return diff, all(torch.equal(a, b) for a, b in zip(full, ddp, strict=True))


one_process = alone(lambda step: [batch(step)])  # the whole batch, one process
ddp_params = train(DDPAdam).full_parameters()

# %%
# %%px
zero1 = train(Zero1)
diff, bitwise = compare(zero1.full_parameters(), one_process, ddp_params)
print(f"rank {rank}, ZeRO-1: {diff:.1e} from one process; bit for bit DDP's: {bitwise}")
assert bitwise  # the same bits as torch's DDP on 2 ranks
assert diff <= 1e-6  # one process sums the whole batch in another order
assert zero1.model.head.weight is zero1.model.embed.weight  # still tied
assert len(zero1.optimizer.state[zero1.shard]["exp_avg"]) == zero1.flat.shard_numel
assert zero1.flat.shard_numel * world_size == 834  # 833 parameters and 1 padding

# %% [markdown] lang="ja"
# DDP とはビット単位で一致します。各ランクの勾配は同じ計算で、2 ランクでは「足してから 2 で割る」と
# 「2 で割ってから足す」(DDP) が同じ値になり、Adam は要素ごとの計算だからです。1 プロセスとは足す順番が
# 違い、差は 1e-6 以内です。

# %% [markdown] lang="en"
# Bit for bit DDP's: the ranks' gradients are the same computation; on 2 ranks,
# summing then halving equals halving then summing (DDP) exactly; Adam works element
# by element. From one process, adding in another order: within 1e-6.

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## 演習: ステージ 2 の勾配の reduce-scatter
#
# `Zero1` は reduce-scatter の結果を平坦化した勾配のビューに書くので、勾配の全体 (4Ψ バイトとパディング)
# が残ります。ステージ 2 は、自分のシャードの平均を**新しいテンソル**に受け取ります。
#
# `shard_of_mean_gradient(flat_grad, rank, world_size)` を書いてください。`flat_grad` はこのランクの
# 平坦化した勾配で、要素の数は world_size で割り切れます。全ランクで平均した勾配のうち、このランクの
# シャード (`rank * k` 番目から k 個、k = 要素の数 ÷ world_size) を新しいテンソルとして返します。
# `dist.reduce_scatter_single(output, input)` を 1 回だけ使います (受け取る部分はランクの番号で決まります)。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## Exercise: stage 2's gradient reduce-scatter
#
# `Zero1` writes the reduce-scatter's result into a view of the flat gradient, so the
# whole gradient (4Ψ bytes and the padding) stays. Stage 2 receives its shard of the
# mean in a **new tensor**.
#
# Write `shard_of_mean_gradient(flat_grad, rank, world_size)`. `flat_grad` is this
# rank's flat gradient; world_size divides its number of values. Return, as a new
# tensor, this rank's shard of the mean over the ranks, the k = numel ÷ world_size
# values from `rank * k` on, with one `dist.reduce_scatter_single(output, input)` (each
# rank's piece follows from its rank).

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
# ReduceOp.AVG on gloo: the sum halved; a view holds its whole buffer, a copy its own.
flat = torch.randn(8, generator=torch.Generator().manual_seed(rank))
by_avg, by_sum = torch.empty(4), torch.empty(4)
dist.reduce_scatter_single(by_avg, flat, op=dist.ReduceOp.AVG)
dist.reduce_scatter_single(by_sum, flat)
assert torch.equal(by_avg, by_sum / world_size)
view = flat.chunk(world_size)[rank]
assert sharding.held_bytes([view]) == sharding.held_bytes([flat]) == 4 * 8
assert sharding.held_bytes([view.clone()]) == 4 * 8 // world_size

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## ZeRO ステージ 2 を手で書く
#
# `Zero2` は `Zero1` の `reduce_gradients` だけを書き換え、演習の関数でシャードの平均を受け取り、勾配の
# 全体を解放します。Adam が動くあいだ勾配のシャードだけを持つ点がステージ 2 です。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## ZeRO stage 2 by hand
#
# `Zero2` changes only `Zero1`'s `reduce_gradients`: it receives its shard of the mean
# with the exercise's function and lets the whole gradient go: holding only the
# gradient's shard while Adam runs is stage 2.

# %%
# %%px
class Zero2(Zero1):
    """ZeRO stage 2: each rank keeps only its shard of the mean gradient."""

    def reduce_gradients(self):
        grads = self.flat.flat_grad()  # the whole local gradient, padded
        self.model.zero_grad()  # drop the parameters' views of it ...
        self.shard.grad = shard_of_mean_gradient(grads, self.rank, self.world_size)
        del grads  # ... and the whole gradient with them: only the shard stays

# %% [markdown] lang="ja"
# **予想してから実行:** Adam が動くとき、ステージ 1 とステージ 2 は勾配を何バイト持つでしょうか?

# %% [markdown] lang="en"
# **Predict, then run:** how many bytes of gradients do stages 1 and 2 hold when Adam
# runs?

# %%
# %%px
zero2 = train(Zero2)
diff, bitwise = compare(zero2.full_parameters(), one_process, ddp_params)
print(f"rank {rank}, ZeRO-2: {diff:.1e} from one process; bit for bit DDP's: {bitwise};"
      f" gradient bytes {zero1.held['gradients']} (ZeRO-1), {zero2.held['gradients']}")
assert bitwise and diff <= 1e-6
assert zero1.held["gradients"] == 4 * zero1.flat.full.numel()  # the whole, padded
assert zero2.held["gradients"] == 4 * zero2.flat.shard_numel  # the shard only

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## ZeRO ステージ 3 を手で書く
#
# ステージ 3 では、パラメータもシャードだけを持ちます。計算には全体が要るので、層ごとに、使う直前に
# all-gather で集め、使い終わったら解放します。
#
# 1. 層の順伝播の直前 (`register_forward_pre_hook`): 集める
# 2. 層の順伝播のあと (`register_forward_hook`): 解放し、層の出力にフックを付ける
# 3. 層の逆伝播の直前 (出力の `register_hook`): もう一度集める (autograd が保存した重みを使う前に戻す)
# 4. 層の勾配がそろったとき (`register_post_accumulate_grad_hook`): 勾配を reduce-scatter して平均の
#    シャードをシャードの勾配に**足し込み** (逆伝播 2 回で勾配累積になるように)、集めたパラメータを解放する
#
# 層は `sharding.shard_units(model)` が決めます (共有された重みはモデル全体の単位、凍結したパラメータは
# 全ランクがそのまま持ちます)。解放はストレージの大きさを 0 にすること (`untyped_storage().resize_(0)`)
# で、集めるときは同じストレージ (autograd が保存したテンソルも見ているもの) に戻します。`Zero3Base` が
# 集めて送り、`Zero3` が解放します。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## ZeRO stage 3 by hand
#
# In stage 3 the parameters too are held as shards. Computing needs them whole, so
# each layer's are all-gathered just before use and freed after:
#
# 1. just before the layer's forward pass (`register_forward_pre_hook`): gather;
# 2. after it (`register_forward_hook`): free, and put a hook on the layer's output;
# 3. just before the layer's backward pass (that output's `register_hook`): gather
#    again, for the weights autograd saved;
# 4. once the layer's gradients are there (`register_post_accumulate_grad_hook`):
#    reduce-scatter them, **add** the shard of the mean to the shard's gradient (so
#    two backward passes accumulate), and free the gathered parameters.
#
# `sharding.shard_units(model)` picks the layers (a tied weight goes to the whole
# model's unit; frozen parameters stay whole on every rank). Freeing resizes the
# storage to 0 (`untyped_storage().resize_(0)`); gathering restores that storage,
# which autograd's saved tensors look at too. `Zero3Base` gathers and sends; `Zero3`
# frees.

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
            # Added, as autograd adds: two backward passes accumulate (lesson 04).
            shard.grad = mean if shard.grad is None else shard.grad.add_(mean)
            self.after_backward(flat)  # ... and so may the gathered parameters

    def after_forward(self, flat, output):
        pass  # Zero3 frees here

    def after_backward(self, flat):
        pass  # Zero3 frees here

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

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## 演習: ZeRO-3 で、集めたパラメータを層ごとに解放する
#
# `Zero3` の 2 つのメソッドを書いてください。`flat` は 1 つの層の `sharding.FlatParameters` で、
# `flat.full` がその層の集めたパラメータです。
#
# - `after_forward(flat, output)` (層の順伝播のあと): `flat.full` のメモリを解放し、逆伝播の前にもう一度
#   集める (`self.gather(flat)`) フックを `output.register_hook(...)` で付けます。
# - `after_backward(flat)` (層の勾配を reduce-scatter したあと): `flat.full` のメモリを解放します。
#
# 自分のシャード (`self.shards`) は解放しないでください。Adam が更新するのはそれです。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## Exercise: a ZeRO-3 layer frees after backward
#
# Write the two methods of `Zero3`. `flat` is one layer's `sharding.FlatParameters`;
# `flat.full` holds its gathered parameters.
#
# - `after_forward(flat, output)`, after the layer's forward pass: free the memory of
#   `flat.full`, and with `output.register_hook(...)` gather again
#   (`self.gather(flat)`) before the backward pass.
# - `after_backward(flat)`, once the layer's gradients are reduce-scattered: free the
#   memory of `flat.full`.
#
# Do not free this rank's shards (`self.shards`): they are what Adam updates.

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

# %% [markdown] lang="ja"
# 図は、3 層の MLP で `Zero3` が 1 ステップ進むあいだ、all-gather と解放のたびに 1 ランクが集めて持つ
# バイト数です。山の高さを見てください。いつも 1 層ぶんで、モデル全体ではありません。
#
# **予想してから実行:** 順伝播を 1 回したあと、集めたパラメータは何バイト残っているでしょうか?

# %% [markdown] lang="en"
# The figure follows one step of `Zero3` on a 3-layer MLP: the bytes a rank holds
# gathered after each all-gather and each free. Look at the peaks: one layer, never
# the whole model.
#
# **Predict, then run:** after a forward pass, how many bytes of gathered parameters
# are left?

# %%
# %%px
traced = memory_run(lambda model: sharding.trace_gathers(Zero3(model)), steps=1)
gathered = (traced.trace, [4 * flat.full.numel() for flat in traced.units])

# %% tags=["hide-input"]
trace, layer_bytes = ranks.pull("gathered")[0]  # rank 0's: (event, layer, bytes held)
layers = [*range(len(layer_bytes)), *reversed(range(len(layer_bytes)))]  # fwd, bwd
assert trace == [(e, i, layer_bytes[i] * (e == "gather"))  # one layer whole, then none
                 for i in layers for e in ("gather", "free")]
fig = diagrams.gathered(trace, whole=sum(layer_bytes))

# %%
# %%px
zero3 = train(Zero3)
diff, bitwise = compare(zero3.full_parameters(), one_process, ddp_params)
frozen = [zero3.model.frozen.weight, zero3.model.frozen.bias]  # whole on every rank
print(f"rank {rank}, ZeRO-3: {diff:.1e} from one process; bit for bit DDP's: {bitwise};"
      f" parameter bytes {zero3.held['parameters']}")
assert bitwise and diff <= 1e-6
assert zero3.held["parameters"] == (sharding.held_bytes(zero3.shards)
                                    + sharding.held_bytes(frozen))
assert zero3.held["gradients"] == 4 * sum(s.numel() for s in zero3.shards)
zero3.model(batch(0)[0][:4])  # a forward pass: each layer gathered, then freed
assert sharding.held_bytes(flat.full for flat in zero3.units) == 0

# %% [markdown] lang="ja"
# 次は勾配累積です。各ステップで、まずマイクロバッチ 1 つの逆伝播をしてから `step` を呼びます (DDP では
# 1 つ目を `no_sync` の中で。レッスン 04)。ステージ 1 と 2 は DDP とビット単位で一致し、2 回の平均を足す
# ステージ 3 は足す順番が違うので 1e-6 以内です。

# %% [markdown] lang="en"
# Now gradient accumulation: each step runs one micro-batch's backward pass before
# calling `step` (DDP inside `no_sync`, lesson 04). Stages 1 and 2 equal DDP bit for
# bit; stage 3 adds two means in another order: within 1e-6.

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


one_accumulating = alone(lambda step: [batch(STEPS + step), batch(step)])
accumulated = {make.__name__: train_accumulating(make).full_parameters()
               for make in (DDPAdam, Zero1, Zero2, Zero3)}
for name, full in accumulated.items():
    diff, bitwise = compare(full, one_accumulating, accumulated["DDPAdam"])
    print(f"rank {rank}, {name}, 2 micro-batches a step: {diff:.1e} from one "
          f"process; bit for bit DDP's: {bitwise}")
    assert diff <= 1e-6  # the last micro-batch's gradient alone: about 5e-3
    assert bitwise or name == "Zero3"  # Zero3 adds the two means: another order

# %% [markdown] lang="ja" tags=["core"]
# ## 各ステージが持つメモリ
#
# 「メモリは何に使われるか」の MLP (Ψ = 5365) を 4 つのやり方で 2 ステップずつ学習し、Adam が動く直前に
# 持っていたバイト数を式と並べます。差の原因はパディングと Adam の `step` で、確認のセルは、差が 0 以上、
# この 2 つの上限の和 (`tolerance`) 以下であることを確かめます。
#
# 図は、各ステージで 1 ランクが持つパラメータ、勾配、Adam の状態を積み上げ、式による合計を印で示します。
# どの部分が N で割られるかを見てください。
#
# **予想してから実行:** 2 ランクの ZeRO-3 は、DDP の何分の 1 を持つでしょうか?

# %% [markdown] lang="en" tags=["core"]
# ## Memory each stage holds
#
# The MLP of "Where the memory goes" (Ψ = 5365), 2 steps each way: the bytes held
# when Adam runs, beside the formula. Padding and Adam's `step` make the difference;
# the check asserts it is between 0 and their bounds (`tolerance`).
#
# The figure stacks what one rank holds in each stage and marks the formula's total:
# look at which part is divided by N.
#
# **Predict, then run:** what fraction of DDP's memory does ZeRO-3 hold on 2 ranks?

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
for stage, row in memory_table.items():  # bytes per rank when Adam runs
    print(f"{stage:7s} formula {row['formula']:6.0f}, measured {row['measured']:6d} "
          f"(tolerance {row['tolerance']}): {row['parts']}")
    assert 0 <= row["measured"] - row["formula"] <= row["tolerance"], stage
assert measured["ZeRO-3"] < measured["ZeRO-2"] < measured["ZeRO-1"] < measured["DDP"]

# %% tags=["hide-input"]
fig = diagrams.zero_memory({stage: row["parts"] for stage, row in memory_table.items()},
                           ylabel="bytes_held",
                           formula={stage: row["formula"] for stage, row in memory_table.items()})
share = measured["ZeRO-3"] / measured["DDP"]
print(f"ZeRO-3 holds {share:.4f} of DDP's memory on 2 ranks")
assert 0.49 < share < 0.51  # 16Ψ/N over 16Ψ, N = 2: half, plus padding and `step`

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## 1 ステップで送るバイト数
#
# 各ステージが 1 ステップで呼ぶ集団通信を `comm_counting.CollectiveLog` で記録します (DDP は通信フックで
# 数えます。下の「測り方の詳細」を見てください)。S = 4Ψ とすると、DDP は all-reduce 1 回 (S)、ステージ 1 と
# 2 は reduce-scatter と all-gather が S ずつです。
#
# **予想してから実行:** ステージ 3 は 1 ステップに all-gather を何回呼び、リングでは DDP の何倍を
# 送るでしょうか?

# %% [markdown] lang="en" tags=["deep-dive"]
# ## Bytes sent per step
#
# `comm_counting.CollectiveLog` records the collectives each stage calls in a step
# (DDP's through a comm hook; see below). With S = 4Ψ, DDP makes one all-reduce of S,
# stages 1 and 2 a reduce-scatter and an all-gather of S each.
#
# **Predict, then run:** how many all-gathers does stage 3 call in a step, and how
# many times DDP's bytes does it send in a ring?

# %%
# %%px
from labkit import comm


def traffic(make, steps=4):
    """Bytes per collective in the last of `steps` steps of trainer `make`."""
    torch.manual_seed(rank)
    trainer = make(models.WideMLP(10, 63, 2, 10))
    hook = (comm_counting.CommCounter(per_step=True).attach(trainer.ddp)
            if isinstance(trainer, DDPAdam) else None)
    X, y = torch.randn(8, 10), torch.randn(8, 10)
    for _ in range(steps):
        if hook:
            hook.step()
        with comm_counting.CollectiveLog(("all_reduce", "reduce_scatter", "all_gather")) as log:
            trainer.step(X, y, models.MyLoss())
    calls = [{"op": "all_reduce", "bytes": b} for b in hook.steps[-1]] if hook else log.calls
    flats = getattr(trainer, "units", [getattr(trainer, "flat", None)])
    return {"calls": calls,
            "padded": 4 * sum(f.full.numel() for f in flats if f is not None)}


traffic_table = {stage: traffic(make) for stage, make in trainers.items()}
S = 4 * psi

# %%
# %%px
def sent(calls):
    """Bytes each rank sends in a ring: 2(N-1)/N of an all-reduce, half that of the others."""
    return sum(c["bytes"] * comm.sent_share(c["op"], world_size) for c in calls)


def total(stage, op):
    return sum(c["bytes"] for c in traffic_table[stage]["calls"] if c["op"] == op)


ddp_sent = sent(traffic_table["DDP"]["calls"])
for stage, row in traffic_table.items():
    ops = [c["op"] for c in row["calls"]]
    print(f"rank {rank}, {stage}: calls {({op: ops.count(op) for op in ops})}, "
          f"each rank sends {sent(row['calls']):.0f} B, {sent(row['calls']) / ddp_sent:.4f} x DDP")
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
# リングのアルゴリズム (NCCL のリング) では、ステージ 1 と 2 は DDP と同じだけ送り、ステージ 3 は逆伝播の前の
# all-gather のぶん 1.5 倍を送ります。このレッスンで使う gloo の reduce-scatter は中で all-reduce を
# 実行します。それで送るバイト数がどう変わるかを、次のセルで、各ランクがソケットに書いたバイト数から
# 確かめます。
#
# **予想してから実行:** gloo で、ステージ 3 は 1 ステップに DDP の何倍を書き込むでしょうか?
#
# <details><summary>測り方の詳細</summary>
#
# 記録するバイト数は集団通信のバッファ全体です (reduce-scatter は入力、all-gather は出力)。DDP の all-reduce
# は C++ から呼ばれて `CollectiveLog` に入らないので、DDP は通信フック `comm_counting.CommCounter` で
# 数えます。ソケットに書いたバイト数は Linux の /proc/self/io で数えます (レッスン 05)。gloo の
# reduce-scatter が all-reduce であることは、プロファイラが `gloo:all_reduce` と記録することで確かめます
# (集団通信 1 回ずつのバイト数はレッスン 13 で数えます)。
#
# torch の `ProcessGroupGloo::reduce_scatter_tensor_coalesced` (`dist.reduce_scatter_single` は最終的に
# これを呼びます) は、入力全体のコピーを all-reduce し、終わると自分のチャンクを出力にコピーします。
# all-gather は gloo 自身のもので、リングと同じ (N − 1)/N × S を送ります。NCCL には reduce-scatter
# そのものの集団通信 (`ncclReduceScatter`) があり、リングの数はそのアルゴリズムが送るバイト数です。
# このコースは GPU で動かしたことがないので、NCCL で送るバイト数は測っていません。時間は α–β モデルで
# 予測できませんでした。これらの集団通信は数 KB と短く、時間はほぼ固定の遅延で決まり、このマシンでは
# 実行ごとに何倍も変わります。そのため時間はベンチマーク (`bench/run.py --only sharding`) が交互に測り、
# このレッスンはバイト数を確かめます。
#
# </details>

# %% [markdown] lang="en"
# So in a ring (NCCL's) stages 1 and 2 send DDP's bytes, stage 3 1.5 times (the
# backward's all-gather). On gloo, this lesson's backend, a reduce-scatter is an
# all-reduce underneath; the next cell counts what that costs in bytes written to the
# sockets.
#
# **Predict, then run:** on gloo, how many times DDP's bytes does stage 3 write in a
# step?
#
# <details><summary>How this was measured</summary>
#
# The bytes logged are a collective's whole buffer (a reduce-scatter's input, an
# all-gather's output). DDP calls its all-reduces from C++, past `CollectiveLog`, so
# DDP is counted with a comm hook, `comm_counting.CommCounter`. The bytes written to
# the sockets come from Linux's /proc/self/io (lesson 05); that gloo's reduce-scatter
# is an all-reduce, from the profiler, which records `gloo:all_reduce` (lesson 13
# counts each collective alone).
#
# Torch's `ProcessGroupGloo::reduce_scatter_tensor_coalesced` (where
# `dist.reduce_scatter_single` lands) all-reduces a copy of the whole input and then
# copies its own chunk into the output. The all-gather is gloo's own and sends the
# ring's (N − 1)/N × S. NCCL has a reduce-scatter collective of its own
# (`ncclReduceScatter`), and the ring counts are what its ring algorithm sends; this
# course has never run on a GPU, so the bytes NCCL sends are not measured here. The
# α–β model did not predict the times: these collectives are a few kilobytes, so their
# time is almost all latency, which varies several-fold from run to run on this
# machine. So the benchmark (`bench/run.py --only sharding`) measures time,
# interleaved, and the lesson asserts the bytes.
#
# </details>

# %%
# %%px
import labkit

with torch.profiler.profile() as profiled:  # what gloo runs for a reduce-scatter
    dist.reduce_scatter_single(torch.empty(4), torch.ones(4 * world_size))
assert {e.name for e in profiled.events() if e.name.startswith("gloo:")} == {
    "gloo:all_reduce"}  # an all-reduce, on every system
counted = comm.can_count_bytes_written()  # Linux's /proc/self/io


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
ranks.stop()

# %% [markdown] lang="ja" tags=["summary"]
# ## 覚えておくこと
#
# - **1 ランクのモデルの状態は P + G + kΨ** で、DDP では float32 でも混合精度でも 16Ψ です。ZeRO は
#   ステージ 1 で kΨ、ステージ 2 でさらに G、ステージ 3 でさらに P を N で割ります (測った値は、これに
#   パディングと Adam の `step` を足したものです)。
# - **reduce-scatter + all-gather = all-reduce**。ステージ 1 と 2 は勾配を reduce-scatter し、シャードを
#   更新して all-gather します。ステージ 2 は勾配の全体を解放します。
# - **ステージ 3 は各層のパラメータを使う直前に集め、使い終わったら解放します** (順伝播と逆伝播の前に 1 回
#   ずつ)。3 つのステージは、勾配累積でも torch の DDP と一致します。
# - **シャードで減るのはメモリで、通信ではありません**。リングではステージ 3 だけが DDP の 1.5 倍を送ります
#   (gloo では 1.5 倍と 2 倍)。

# %% [markdown] lang="en" tags=["summary"]
# ## What to remember
#
# - **A rank's model states are P + G + kΨ**, 16Ψ under DDP in float32 and in mixed
#   precision alike; ZeRO divides by N the kΨ in stage 1, G too in stage 2, P too in
#   stage 3 (the measured bytes add padding and `step`).
# - **Reduce-scatter + all-gather = all-reduce**: stages 1 and 2 reduce-scatter the
#   gradients, update their shard and all-gather it; stage 2 drops the whole gradient.
# - **Stage 3 gathers each layer's parameters just before use and frees them after**,
#   before the forward and before the backward; all three stages equal torch's DDP,
#   with gradient accumulation too.
# - **Sharding saves memory, not traffic**: in a ring only stage 3 sends more, 1.5
#   times DDP's (1.5 and 2 times on gloo).

# %% [markdown] lang="ja" tags=["self-check"]
# ## 確認問題
#
# 次の 3 問に答えてから先へ進んでください。答えの折りたたみは、自分で答えを決めてから開きます。

# %% [markdown] lang="en" tags=["self-check"]
# ## Self-check
#
# Answer the three questions before reading on; open an answer's fold only after
# answering.

# %% tags=["self-check"]
from labkit import selfcheck

selfcheck.show("12_zero_by_hand")

# %% tags=["self-check"]
# Your answers, "a", "b", "c" or "d" for each question; then run this cell.
my_answers = {1: None, 2: None, 3: None}
selfcheck.check("12_zero_by_hand", my_answers)
