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
# - 1 ランクが持つメモリを、DDP と ZeRO のステージ 1〜3 について Ψ と k で数える
# - reduce-scatter と all-gather で ZeRO のステージ 1〜3 を書き、DDP とビット単位で一致させる
# - 各ステージのメモリを測り、式と比べる
# - シャードで減るのはメモリで、通信ではないことを示す

# %% [markdown] lang="en" tags=["outcomes"]
# # 12 ZeRO by hand
#
# After this lesson you can:
#
# - count, in Ψ and k, what a rank holds under DDP and each ZeRO stage;
# - write ZeRO stages 1 to 3 from reduce-scatters and all-gathers, bit for bit DDP's;
# - measure each stage's memory against the formula;
# - show that sharding saves memory, not traffic.

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
# Adam で Ψ 個のパラメータを学習するとき、1 ランクはパラメータ (P バイト)、勾配 (G)、Adam の状態 (kΨ)
# を持ちます (ZeRO の論文の混合精度では、Adam が float32 のコピーも持ちます)。ZeRO はこれを N 個の
# ランクで分けて持ちます。
#
# | | 1 ランクあたり | float32 の Adam (4 + 4 + 8) | 混合精度 (2 + 2 + 12) |
# |---|---|---|---|
# | DDP | P + G + kΨ | 16Ψ | 16Ψ |
# | ZeRO-1 | P + G + kΨ/N | 8Ψ + 8Ψ/N | 4Ψ + 12Ψ/N |
# | ZeRO-2 | P + (G + kΨ)/N | 4Ψ + 12Ψ/N | 2Ψ + 14Ψ/N |
# | ZeRO-3 | (P + G + kΨ)/N | 16Ψ/N | 16Ψ/N |
#
# Adam の `step` (テンソル 1 つにつき 4 バイト) は入れていません。

# %% [markdown] lang="en" tags=["core"]
# ## Where the memory goes
#
# With Adam, a rank holds Ψ parameters (P bytes), their gradients (G) and Adam's state
# (kΨ; in the ZeRO paper's mixed precision, with a float32 copy). ZeRO shares them out
# over N ranks:
#
# | | per rank | float32 Adam (4 + 4 + 8) | mixed precision (2 + 2 + 12) |
# |---|---|---|---|
# | DDP | P + G + kΨ | 16Ψ | 16Ψ |
# | ZeRO-1 | P + G + kΨ/N | 8Ψ + 8Ψ/N | 4Ψ + 12Ψ/N |
# | ZeRO-2 | P + (G + kΨ)/N | 4Ψ + 12Ψ/N | 2Ψ + 14Ψ/N |
# | ZeRO-3 | (P + G + kΨ)/N | 16Ψ/N | 16Ψ/N |
#
# Adam's 4-byte `step` per tensor is left out.

# %%
model = models.WideMLP(10, 63, 2, 10)
adam = torch.optim.Adam(model.parameters(), lr=1e-3)
model(torch.randn(4, 10)).sum().backward()
adam.step()

# %% tags=["hide-input"]
state = adam.state[model.net[0].weight]
assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
assert state["exp_avg"].shape == state["exp_avg_sq"].shape == model.net[0].weight.shape
assert state["step"].shape == () and state["step"].dtype == torch.float32
assert state["step"].device.type == "cpu"
assert len(adam.state) == len(list(model.parameters()))  # one step tensor per tensor

psi = models.count_params(model)
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
# 各ランクでは、学習クラス `T(model)` が `T.step(X, y, loss_fn)` で 1 ステップ進み、Adam が動く直前の
# バイト数を `T.held` に残します。
#
# **予想してから実行:** DDP で測った Adam の状態は、式の 8Ψ より何バイト多いでしょうか?

# %% [markdown] lang="en"
# On the ranks, a trainer `T(model)` steps with `T.step(X, y, loss_fn)` and keeps in
# `T.held` what it holds when Adam runs.
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
        self.model = model  # DDP broadcasts rank 0's weights; grads view its buckets
        self.ddp = DDP(model, gradient_as_bucket_view=True)
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    def step(self, X, y, loss_fn):
        loss = loss_fn(self.ddp(X), y)
        loss.backward()  # DDP all-reduces the gradients bucket by bucket, and averages
        self.held = held(self)  # what this rank holds when Adam runs
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.detach()

# %% tags=["hide-input"]
# %%px
def held(trainer):
    """Bytes a trainer holds: its model's and its optimizer's parameters, their grads.

    `sharding.held_bytes` counts a storage shared once, a freed one (resized to 0) as 0.
    """
    params = [*trainer.model.parameters(), *trainer.optimizer.param_groups[0]["params"]]
    return sharding.held_by_part(params, [p.grad for p in params], trainer.optimizer)


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
# ステージ 1 では、各ランクが自分のシャードの Adam の状態だけを持ちます
# ([13: ZeroRedundancyOptimizer: オプティマイザの状態を分割して持つ (シャード)](13_fsdp2.ipynb#cell-id=13-zeroredundancyoptimizer-sharing-out-the-optimizer-state))。
# 1 ステップは次のとおりです。
#
# 1. 自分のバッチで順伝播と逆伝播をします。
# 2. **reduce-scatter** で、全ランクの勾配の和を N 個に分けた r 番目をランク r が受け取り、N で割ります。
# 3. そのシャードを Adam で更新します。
# 4. **all-gather** で、更新したシャードを全ランクに配ります。
#
# `sharding.FlatParameters` はパラメータを 0 で埋めた 1 本のバッファ `full` に置きます。

# %% [markdown] lang="en" tags=["core"]
# ## ZeRO stage 1 by hand
#
# In stage 1 each rank holds Adam's state for its shard only
# ([13: ZeroRedundancyOptimizer: sharing out the optimizer state](13_fsdp2.ipynb#cell-id=13-zeroredundancyoptimizer-sharing-out-the-optimizer-state)).
# A step:
#
# 1. Forward and backward on its batch.
# 2. A **reduce-scatter** gives rank r the r-th of N pieces of the ranks' summed
#    gradient; it divides by N.
# 3. Adam updates that shard.
# 4. An **all-gather** hands every rank the updated shards.
#
# `sharding.FlatParameters` holds them in one zero-padded buffer, `full`.

# %% [markdown] lang="ja"
# まず 4 つの値で確かめます。reduce-scatter のあと all-gather をすると、all-reduce と同じ結果になります。
#
# **予想してから実行:** reduce-scatter のあと、ランク 1 はいくつの値を持っているでしょうか?

# %% [markdown] lang="en"
# On four values: a reduce-scatter, then an all-gather, make an all-reduce.
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
steps_shown = [("before", g), ("dist.reduce_scatter_single", piece),
               ("dist.all_gather_single", whole), ("dist.all_reduce", summed)]

# %% tags=["hide-input"]
# %%px
assert torch.equal(whole, summed)  # reduce-scatter + all-gather = all-reduce

# %% tags=["hide-input"]
from labkit import diagrams

shown = ranks.pull("steps_shown")  # per rank: (what ran, values after it), in order
rows = {labkit.t("values_before") if op == "before" else op:
        [dict(r)[op].tolist() for r in shown] for op, _ in shown[0]}
assert [len(v) for v in list(rows.values())[1]] == [2, 2]  # after the reduce-scatter
fig = diagrams.collectives(rows, fmt="{:.0f}")

# %%
# %%px
class Zero1:
    """ZeRO stage 1: each rank keeps Adam's state for its shard of the parameters."""

    def __init__(self, model, lr=1e-3):
        self.model, self.rank, self.world_size = model, dist.get_rank(), dist.get_world_size()
        for p in model.parameters():  # every rank starts from rank 0's weights
            dist.broadcast(p.detach(), src=0)
        trained = [p for p in model.parameters() if p.requires_grad]  # not the frozen
        self.flat = sharding.FlatParameters(trained, self.world_size)  # padded to N
        # The r-th piece, a view of the flat buffer: Adam updates it in place.
        self.shard = nn.Parameter(self.flat.shard(self.rank))
        self.optimizer = torch.optim.Adam([self.shard], lr=lr)  # the shard's state only

    def step(self, X, y, loss_fn):
        loss = loss_fn(self.model(X), y)
        loss.backward()
        self.reduce_gradients()  # this rank's shard of the mean gradient -> shard.grad
        self.held = held(self)  # what this rank holds when Adam runs
        self.optimizer.step()  # updates this rank's shard of the parameters
        dist.all_gather_single(self.flat.full, self.shard.detach())  # and the others'
        self.model.zero_grad()
        self.shard.grad = None
        return loss.detach()

    def reduce_gradients(self):
        grads = self.flat.flat_grad()  # the whole local gradient; p.grad are views of it
        mine = grads.chunk(self.world_size)[self.rank]  # a view of the r-th piece
        dist.reduce_scatter_single(mine, grads)  # the ranks' sum of this piece, in place
        self.shard.grad = mine.div_(self.world_size)  # the sum -> the mean

# %% [markdown] lang="ja"
# `models.TiedMLP` (共有する重みと凍結した層を持ち、ランクごとにシードが違います) を 3 ステップ学習し、
# 1 プロセスの学習と `DDPAdam` と比べます。

# %% [markdown] lang="en"
# We train `models.TiedMLP` (tied weight, frozen layer, seed per rank) for 3 steps,
# against one process and `DDPAdam`.

# %%
# %%px
STEPS, BATCH = 3, 16
loss_fn = nn.CrossEntropyLoss()
# This rank's part of each batch.
mine = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)


def batch(step):
    """The whole batch of a step: the same on every rank."""
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, 33, (BATCH,), generator=g),
            torch.randint(0, 33, (BATCH,), generator=g))


def train(make, steps=STEPS):
    """Train TiedMLP with trainer `make` on this rank's part of each batch."""
    torch.manual_seed(rank)  # each rank starts different: the trainer must broadcast
    trainer = make(models.TiedMLP())
    for step in range(steps):
        X, y = batch(step)
        trainer.step(X[mine], y[mine], loss_fn)
    return trainer

# %%
# %%px
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


# %% tags=["hide-input"]
# %%px
def params_of(trainer):
    """The trainer's whole parameters, copied (stage 3 gathers them first)."""
    if hasattr(trainer, "full_parameters"):
        return trainer.full_parameters()
    return [p.detach().clone() for p in trainer.model.parameters()]


def compare(full, one_process, ddp):
    """(largest difference from one process, bit for bit equal to DDP's?)"""
    diff = max((a - b).abs().max().item() for a, b in zip(full, one_process, strict=True))
    return diff, all(torch.equal(a, b) for a, b in zip(full, ddp, strict=True))


one_process = alone(lambda step: [batch(step)])  # the whole batch, one process
ddp_params = params_of(train(DDPAdam))
assert compare(ddp_params, one_process, ddp_params)[0] <= 1e-6  # DDP: one process

# %% tags=["hide-input"]
# %%px
zero1 = train(Zero1)
diff, bitwise = compare(params_of(zero1), one_process, ddp_params)
print(f"rank {rank}, ZeRO-1: {diff:.1e} from one process; bit for bit DDP's: {bitwise}")
assert bitwise  # the same bits as torch's DDP on 2 ranks
assert diff <= 1e-6  # one process sums the whole batch in another order
assert zero1.model.head.weight is zero1.model.embed.weight  # still tied
assert len(zero1.optimizer.state[zero1.shard]["exp_avg"]) == zero1.flat.shard_numel
assert zero1.flat.shard_numel * world_size == 834  # 833 parameters and 1 padding

# %% [markdown] lang="ja"
# DDP とビット単位で一致するのは、2 ランクでは「足してから 2 で割る」と「2 で割ってから足す」(DDP) が
# 同じ値で、Adam が要素ごとの計算だからです。

# %% [markdown] lang="en"
# Bit for bit DDP's: on 2 ranks, halving then summing (DDP) equals summing then
# halving, and Adam is element-wise.

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## 演習: ステージ 2 の勾配の reduce-scatter
#
# `Zero1` は勾配のビューに reduce-scatter するので、勾配の全体が残ります。ステージ 2 はシャードの平均を
# **新しいテンソル**に受け取ります。
#
# `shard_of_mean_gradient(flat_grad, rank, world_size)` を書いてください。`flat_grad` の全ランクの平均の
# うち、このランクのシャード (`rank * k` 番目から k 個、k = 要素の数 ÷ world_size) を返します。
# `dist.reduce_scatter_single` は 1 回だけ使います。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## Exercise: stage 2's gradient reduce-scatter
#
# `Zero1` reduce-scatters into a view, so the whole gradient stays; stage 2 receives
# its shard of the mean in a **new tensor**.
#
# Write `shard_of_mean_gradient(flat_grad, rank, world_size)`: this rank's shard
# (k = numel ÷ world_size values from `rank * k` on) of the ranks' mean `flat_grad`,
# by one `dist.reduce_scatter_single`.

# %% tags=["exercise"]
# %%px
def shard_of_mean_gradient(flat_grad, rank, world_size):
    """This rank's shard of the gradient averaged over the ranks, by a reduce-scatter."""
    # TODO: reduce-scatter into a new tensor of numel // world_size values; average
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
flat = torch.randn(8, generator=torch.Generator().manual_seed(rank))  # AVG = sum / N
by_avg, by_sum = torch.empty(4), torch.empty(4)
dist.reduce_scatter_single(by_avg, flat, op=dist.ReduceOp.AVG)
dist.reduce_scatter_single(by_sum, flat)

# %% tags=["hide-input"]
# %%px
assert torch.equal(by_avg, by_sum / world_size)
view = flat.chunk(world_size)[rank]  # a view holds its whole buffer, a copy its own
assert sharding.held_bytes([view]) == sharding.held_bytes([flat]) == 4 * 8
assert sharding.held_bytes([view.clone()]) == 4 * 8 // world_size

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## ZeRO ステージ 2 を手で書く
#
# `Zero2` は `Zero1` の `reduce_gradients` だけを書き換えます。演習の関数でシャードの平均を受け取り、
# 勾配の全体を解放します。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## ZeRO stage 2 by hand
#
# `Zero2` changes only `Zero1`'s `reduce_gradients`: the exercise's function gives it
# the mean's shard; the whole gradient goes.

# %%
# %%px
class Zero2(Zero1):
    """ZeRO stage 2: each rank keeps only its shard of the mean gradient."""

    def reduce_gradients(self):
        grads = self.flat.flat_grad()  # the whole local gradient, padded
        self.model.zero_grad()  # no view of it left: it goes when this returns
        self.shard.grad = shard_of_mean_gradient(grads, self.rank, self.world_size)

# %% [markdown] lang="ja"
# **予想してから実行:** Adam が動くとき、ステージ 1 とステージ 2 は勾配を何バイト持つでしょうか?

# %% [markdown] lang="en"
# **Predict, then run:** how many bytes of gradients do stages 1 and 2 hold when Adam
# runs?

# %% tags=["hide-input"]
# %%px
zero2 = train(Zero2)
diff, bitwise = compare(params_of(zero2), one_process, ddp_params)
print(f"rank {rank}, ZeRO-2: {diff:.1e} from one process; bit for bit DDP's: {bitwise};"
      f" gradient bytes {zero1.held['gradients']} (ZeRO-1), {zero2.held['gradients']}")
assert bitwise and diff <= 1e-6
assert zero1.held["gradients"] == 4 * zero1.flat.full.numel()  # the whole, padded
assert zero2.held["gradients"] == 4 * zero2.flat.shard_numel  # the shard only

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## ZeRO ステージ 3 を手で書く
#
# ステージ 3 では、パラメータもシャードだけを持ちます。層ごとに、使う直前に all-gather で集め、使ったら
# 解放します。
#
# 1. 層の順伝播の直前 (`register_forward_pre_hook`): 集める
# 2. 順伝播のあと (`register_forward_hook`): 解放し、出力にフックを付ける
# 3. 層の逆伝播の直前 (出力の `register_hook`): autograd が保存した重みのために、もう一度集める
# 4. 層の勾配がそろったとき (`register_post_accumulate_grad_hook`): reduce-scatter し、平均のシャードを
#    シャードの勾配に**足し込み**、解放する
#
# `Zero3Base` が集めて送り、`Zero3` が解放します (`untyped_storage().resize_(0)`)。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## ZeRO stage 3 by hand
#
# In stage 3 the parameters too are sharded; each layer's are gathered just before
# use and freed after:
#
# 1. before its forward (`register_forward_pre_hook`): gather;
# 2. after it (`register_forward_hook`): free, and hook the output;
# 3. before its backward (the output's `register_hook`): gather again, for the
#    weights autograd saved;
# 4. once its gradients are in (`register_post_accumulate_grad_hook`): reduce-scatter,
#    **add** the mean's shard to its gradient, free.
#
# `Zero3Base` gathers and sends; `Zero3` frees (`untyped_storage().resize_(0)`).

# %%
# %%px
class Zero3Base:
    """ZeRO stage 3 less the freeing: Zero3 adds after_forward and after_backward."""

    def __init__(self, model, lr=1e-3):
        self.model, self.rank, self.world_size = model, dist.get_rank(), dist.get_world_size()
        for p in model.parameters():  # every rank starts from rank 0's weights
            dist.broadcast(p.detach(), src=0)
        self.units, self.shards, self.pending = [], [], {}
        for module, params in sharding.shard_units(model):  # tied weights: one unit
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
        flat.full.untyped_storage().resize_(flat.full.nbytes)
        dist.all_gather_single(flat.full, self.shards[self.units.index(flat)].detach())

    def _grad_ready(self, flat, shard):
        self.pending[id(flat)] = self.pending.get(id(flat), 0) + 1
        if self.pending[id(flat)] == len(flat.params):  # the layer's last gradient
            self.pending[id(flat)] = 0
            grads = flat.flat_grad()
            for p in flat.params:
                p.grad = None  # the whole gradient goes ...
            mean = shard_of_mean_gradient(grads, self.rank, self.world_size)
            # Added, as autograd adds, so backward passes accumulate (lesson 04).
            shard.grad = mean if shard.grad is None else shard.grad.add_(mean)
            self.after_backward(flat)  # ... and so may the gathered parameters

    def step(self, X, y, loss_fn):
        loss = loss_fn(self.model(X), y)
        loss.backward()  # the hooks gather, reduce-scatter and free, layer by layer
        self.held = held(self)
        self.optimizer.step()  # each rank updates its shards; nothing to gather now
        self.optimizer.zero_grad()
        return loss.detach()

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
# `Zero3` の 2 つのメソッドを書いてください。`flat.full` は 1 つの層の集めたパラメータです。
#
# - `after_forward(flat, output)`: `flat.full` のメモリを解放し、`output.register_hook(...)` で逆伝播の前に
#   もう一度集める (`self.gather(flat)`) ようにします。
# - `after_backward(flat)` (層の勾配を reduce-scatter したあと): `flat.full` を解放します。
#
# `self.shards` は Adam が更新するので、解放しないでください。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## Exercise: a ZeRO-3 layer frees after backward
#
# Write `Zero3`'s two methods; `flat.full` holds one layer's gathered parameters.
#
# - `after_forward(flat, output)`: free `flat.full`, and with
#   `output.register_hook(...)` gather it again (`self.gather(flat)`) before backward.
# - `after_backward(flat)`, once its gradients are reduce-scattered: free it.
#
# Do not free `self.shards`: Adam updates them.

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
# 図は、3 層の MLP で `Zero3` が 1 ステップ進むあいだに、1 ランクが集めて持つバイト数です。
#
# **予想してから実行:** 順伝播を 1 回したあと、集めたパラメータは何バイト残っているでしょうか?

# %% [markdown] lang="en"
# The figure: what a rank holds gathered in one `Zero3` step of a 3-layer MLP.
#
# **Predict, then run:** after a forward pass, how many bytes of gathered parameters
# are left?

# %% tags=["hide-input"]
# %%px
traced = memory_run(lambda model: sharding.trace_gathers(Zero3(model)), steps=1)
gathered = (traced.trace, [4 * flat.full.numel() for flat in traced.units])
assert len(traced.units) == 3  # the 3-layer MLP: one unit a layer

# %% tags=["hide-input"]
trace, layer_bytes = ranks.pull("gathered")[0]  # rank 0's: (event, layer, bytes held)
layers = [*range(len(layer_bytes)), *reversed(range(len(layer_bytes)))]  # fwd, bwd
assert trace == [(e, i, layer_bytes[i] * (e == "gather"))  # one layer whole, then none
                 for i in layers for e in ("gather", "free")]
fig = diagrams.gathered(trace, whole=sum(layer_bytes))

# %% tags=["hide-input"]
# %%px
zero3 = train(Zero3)
diff, bitwise = compare(params_of(zero3), one_process, ddp_params)
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
# 次は勾配累積です。各ステップで、マイクロバッチ 1 つの逆伝播をしてから `step` を呼びます (DDP では
# `no_sync` の中で。レッスン 04)。

# %% [markdown] lang="en"
# Now gradient accumulation: a micro-batch's backward pass before each `step` (DDP's
# in `no_sync`, lesson 04).

# %%
# %%px
import contextlib


def train_accumulating(make, steps=STEPS):
    """`train` with two micro-batches a step: one backward pass before `step`'s own."""
    torch.manual_seed(rank)
    trainer = make(models.TiedMLP())
    is_ddp = isinstance(trainer, DDPAdam)
    model = trainer.ddp if is_ddp else trainer.model
    for step in range(steps):
        X, y = batch(STEPS + step)  # the step's first micro-batch
        with model.no_sync() if is_ddp else contextlib.nullcontext():
            loss_fn(model(X[mine]), y[mine]).backward()  # DDP: no all-reduce yet
        X, y = batch(step)
        trainer.step(X[mine], y[mine], loss_fn)  # the second, then the update
    return trainer

# %% tags=["hide-input"]
# %%px
one_accumulating = alone(lambda step: [batch(STEPS + step), batch(step)])
accumulated = {make.__name__: params_of(train_accumulating(make))
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
# 上の MLP (Ψ = 5365) を 4 つのやり方で学習し、Adam が動く直前のバイト数を式 (図の印) と比べます。
# どの部分が N で割られるかを見てください。
#
# **予想してから実行:** 2 ランクの ZeRO-3 は、DDP の何分の 1 を持つでしょうか?

# %% [markdown] lang="en" tags=["core"]
# ## Memory each stage holds
#
# The MLP above (Ψ = 5365), trained each way: bytes held when Adam runs, against
# the formula (marked). Which part is divided by N?
#
# **Predict, then run:** what fraction of DDP's memory does ZeRO-3 hold on 2 ranks?

# %% tags=["hide-input"]
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
    row = memory_table[stage]  # padding and Adam's `step` above the formula, no more:
    assert 0 <= row["measured"] - row["formula"] <= row["tolerance"], stage

# %% tags=["hide-input"]
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
# S = 4Ψ とすると、1 ステップに DDP は S を all-reduce し、ステージ 1 と 2 は S を reduce-scatter と
# all-gather で送ります。
#
# **予想してから実行:** ステージ 3 は 1 ステップに all-gather を何回呼び、リングでは DDP の何倍を
# 送るでしょうか?

# %% [markdown] lang="en" tags=["deep-dive"]
# ## Bytes sent per step
#
# With S = 4Ψ, a step of DDP all-reduces S; stages 1 and 2 reduce-scatter and
# all-gather S each.
#
# **Predict, then run:** how many all-gathers does stage 3 call in a step, and how
# many times DDP's bytes does it send in a ring?

# %% tags=["hide-input"]
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
assert sum(c["bytes"] for c in traffic_table["DDP"]["calls"]) == S  # one all-reduce

# %% tags=["hide-input"]
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
for stage in ("ZeRO-1", "ZeRO-2"):  # S (padded) each way: what DDP sends
    padded = traffic_table[stage]["padded"]
    assert total(stage, "reduce_scatter") == total(stage, "all_gather") == padded
    assert total(stage, "all_reduce") == 0 and S <= padded <= S + 4 * (world_size - 1)
padded = traffic_table["ZeRO-3"]["padded"]  # 3 layers, each padded
assert total("ZeRO-3", "reduce_scatter") == padded  # once, in backward
assert total("ZeRO-3", "all_gather") == 2 * padded  # before forward, again before backward
assert 1.5 <= sent(traffic_table["ZeRO-3"]["calls"]) / ddp_sent <= 1.5 * padded / S

# %% [markdown] lang="ja"
# gloo の reduce-scatter は、中身が all-reduce です (次のセル)。
#
# **予想してから実行:** gloo で、ステージ 3 は 1 ステップに DDP の何倍を書き込むでしょうか?
#
# <details><summary>測り方</summary>
#
# 集団通信は `comm_counting.CollectiveLog` で記録します。記録するバイト数は集団通信のバッファ全体です (reduce-scatter は入力、all-gather は出力)。DDP の all-reduce
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
# Gloo's reduce-scatter is an all-reduce underneath (next cell).
#
# **Predict, then run:** on gloo, how many times DDP's bytes does stage 3 write in a
# step?
#
# <details><summary>How this was measured</summary>
#
# `comm_counting.CollectiveLog` records the collectives. The bytes logged are a collective's whole buffer (a reduce-scatter's input, an
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
with torch.profiler.profile() as profiled:  # what gloo runs for a reduce-scatter
    dist.reduce_scatter_single(torch.empty(4), torch.ones(4 * world_size))

# %% tags=["hide-input"]
# %%px
assert {e.name for e in profiled.events() if e.name.startswith("gloo:")} == {
    "gloo:all_reduce"}  # an all-reduce, on every system

# %% tags=["hide-input"]
# %%px
import labkit

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
# - **1 ランクが持つのは P + G + kΨ** で、DDP では 16Ψ です。ZeRO はステージ 1 で kΨ、ステージ 2 で
#   さらに G、ステージ 3 でさらに P を N で割ります。
# - **reduce-scatter + all-gather = all-reduce**。ステージ 1 と 2 は勾配を reduce-scatter し、シャードを
#   更新して all-gather します。
# - **ステージ 3 は各層を使う直前に集め、使ったら解放します** (1 ステップに 2 回)。どのステージも、
#   勾配累積でも DDP と一致します。
# - **シャードで減るのはメモリで、通信ではありません**。リングではステージ 3 だけが DDP の 1.5 倍を
#   送ります。

# %% [markdown] lang="en" tags=["summary"]
# ## What to remember
#
# - **A rank holds P + G + kΨ**, 16Ψ under DDP; ZeRO stages 1, 2, 3 divide kΨ, then
#   G, then P by N.
# - **Reduce-scatter + all-gather = all-reduce**: stages 1 and 2 reduce-scatter the
#   gradients, update a shard, all-gather it.
# - **Stage 3 gathers each layer just before use and frees it after**, twice a step.
#   All match DDP, accumulating too.
# - **Sharding saves memory, not traffic**: in a ring only stage 3 sends more, 1.5×
#   DDP's.

# %% [markdown] lang="ja" tags=["self-check"]
# ## 確認問題
#
# 3 問に答えてから、答えの折りたたみを開いてください。

# %% [markdown] lang="en" tags=["self-check"]
# ## Self-check
#
# Answer the three questions before opening their folds.

# %% tags=["self-check"]
from labkit import selfcheck

selfcheck.show("12_zero_by_hand")

# %% tags=["self-check"]
# Your answers, "a", "b", "c" or "d" for each question; then run this cell.
my_answers = {1: None, 2: None, 3: None}
selfcheck.check("12_zero_by_hand", my_answers)
