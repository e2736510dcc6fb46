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
# # 13 FSDP2 と、いつシャードするか
#
# このレッスンを終えると、次のことができます。
#
# - FSDP2 の `fully_shard` でモデルを層ごとのユニットに分けてシャードし、1 プロセスの学習と torch の DDP
#   に一致することを確かめる
# - `reshard_after_forward` と `MixedPrecisionPolicy` で、メモリと送るバイト数がどう変わるかを数える
# - torch の `ZeroRedundancyOptimizer` でオプティマイザの状態を分けて持ち、保存の前に集める
# - シャードしたモデルの state dict の 2 つの形を使い分け、分散チェックポイントを別のランクの数で読み込む
# - 1 ランクのメモリの予算から、どのステージが収まるかを決め、ステージ 3 の余分な all-gather の代償を見積もる

# %% [markdown] lang="en" tags=["outcomes"]
# # 13 FSDP2 and when to shard
#
# After this lesson you can:
#
# - shard a model with FSDP2's `fully_shard`, one unit per layer, and check it against
#   one process and torch's DDP;
# - count what `reshard_after_forward` and `MixedPrecisionPolicy` change in memory and
#   in bytes sent;
# - share out the optimizer's state with torch's `ZeroRedundancyOptimizer`, and gather
#   it to save;
# - use the two forms of a sharded model's state dict, and load a distributed
#   checkpoint on another number of ranks;
# - decide from a per-rank memory budget which ZeRO stage fits, and price stage 3's
#   extra all-gather.

# %%
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %%
import torch

from labkit import cluster, diagrams, exercises, fsdp, models, plots, sharding

ranks = cluster.start(2, background=True)  # the ranks boot while you read

# %% [markdown] lang="ja"
# ## FSDP2: fully_shard
#
# ステージ 3 を PyTorch が実装したものが FSDP2 (`torch.distributed.fsdp.fully_shard`) です。
# `fully_shard(module)` は `module` を 1 つの**ユニット**にします。ユニットの各パラメータは `DTensor` になり、
# 各ランクは 0 番目の次元で切った自分のシャードだけを持ちます。ユニットの順伝播の直前にフックがそのパラメータを
# all-gather し、順伝播のあとで解放し、逆伝播の直前にもう一度 all-gather して、勾配を reduce-scatter します。
# レッスン 12 の `Zero3` がしていることと同じです ([12: ZeRO ステージ 3 を手で書く](12_zero_by_hand.ipynb#cell-id=12-zero-stage-3-by-hand))。レッスン 09 と同じく、層ごとに 1 ユニット、最後にモデル全体 (ルート) に呼びます。
#
# 重みを共有する層と凍結した層を持つ `models.TiedMLP` (学習するパラメータ 833 個) で、気をつけることが 2 つ
# あります (下で確かめます)。
#
# - `fully_shard` は値を配りません。各ランクは、自分が持っている値から自分のシャードを切り出すだけです。
#   ランクごとに初期値が違えば、ランク 0 の前半とランク 1 の後半をつないだモデルになります。そこで
#   `fully_shard` の前にランク 0 の重みを配ります。
# - 重みを共有する 2 つのモジュールは、1 つのユニットに入れます: `fully_shard([model.embed, model.head])`。
#   別々のユニットにすると、最初の順伝播で FSDP2 は `ValueError` を出して止まります。`fsdp.layer_units(model)` は、
#   パラメータを持つモジュールを順に並べ、重みを共有するものを 1 つのリストにまとめます。凍結した
#   パラメータ (`requires_grad=False`) は、そのままで扱えます。集めはしますが、勾配がないので
#   reduce-scatter しません。
#
# 下のクラスは、レッスン 12 の学習クラスと同じ使い方 (`FSDP2Adam(model, lr)`、`.step(X, y, loss_fn)`) です。
# 比べる相手は、torch の DDP と Adam (`DDPAdam`) と、1 プロセスの学習です。

# %% [markdown] lang="en"
# ## FSDP2: fully_shard
#
# FSDP2 (`torch.distributed.fsdp.fully_shard`) is stage 3 as PyTorch implements it.
# `fully_shard(module)` makes `module` one **unit**: each of its parameters becomes a
# `DTensor`, and each rank holds only its shard, cut along dimension 0. Just before the
# unit's forward, a hook all-gathers its parameters; after the forward they are freed;
# just before its backward they are all-gathered again, and the gradients are
# reduce-scattered. That is the work of lesson 12's `Zero3` ([12: ZeRO stage 3 by hand](12_zero_by_hand.ipynb#cell-id=12-zero-stage-3-by-hand)). As in lesson 09, call it on each layer, one
# unit each, then on the whole model (the root).
#
# On `models.TiedMLP`, a model with a tied weight and a frozen layer (833 trained
# parameters), two things need care (checked below):
#
# - `fully_shard` sends nothing: each rank cuts its shard out of the values it holds.
#   Ranks initialized differently would give a model made of rank 0's first half and
#   rank 1's second half. So rank 0's weights are broadcast before `fully_shard`.
# - Two modules sharing a weight go in one unit: `fully_shard([model.embed,
#   model.head])`. In two units, FSDP2 stops with a `ValueError` at the first forward.
#   `fsdp.layer_units(model)` lists the modules that hold parameters, in order, and puts
#   those sharing a weight in one list. Frozen parameters (`requires_grad=False`) need
#   nothing: gathered, but with no gradient, they are never reduce-scattered.
#
# The class below is used like lesson 12's trainers (`FSDP2Adam(model, lr)`,
# `.step(X, y, loss_fn)`) and compared with torch's DDP (`DDPAdam`) and one process.

# %%
# %%px
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import fsdp, models


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


class DDPAdam:
    """The reference: torch's DDP, and a whole Adam on every rank."""

    def __init__(self, model, lr=1e-3):
        self.ddp = DDP(model)  # broadcasts rank 0's weights
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    def step(self, X, y, loss_fn):
        loss = loss_fn(self.ddp(X), y)
        loss.backward()  # all-reduced and averaged, bucket by bucket
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss

    def full_parameters(self):
        return [p.detach() for p in self.ddp.module.parameters()]

# %% [markdown] lang="ja"
# まず、`fully_shard` が各ランクに残すものです。図は、各パラメータの 0 番目の次元の行のうち、各ランクが
# 持つ範囲です。`torch.chunk` と同じ切り方なので、33 行はランク 0 が 17 行、ランク 1 が 16 行を持ち、
# 1 行しかないパラメータではランク 1 のシャードは空です。

# %% [markdown] lang="en"
# First, what `fully_shard` leaves on each rank: the figure shows each parameter's rows
# of dimension 0 per rank. Cut as `torch.chunk` cuts, 33 rows split into 17 (rank 0)
# and 16 (rank 1); a single row leaves rank 1 an empty shard.

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

# Every parameter: rank r keeps piece r of torch.chunk on dim 0 (none if rows run out).
one_row = nn.Linear(16, 1)  # 1 row for 2 ranks
mine |= {f"one_row.{n}": p.detach().clone() for n, p in one_row.named_parameters()}
fully_shard(one_row, mesh=init_device_mesh("cpu", (world_size,)))
shard_rows = []  # (parameter, whole shape, first row, the row after its last)
for name, p in [*alone.named_parameters(), *one_row.named_parameters("one_row")]:
    pieces = mine[name].chunk(world_size)  # fewer pieces than ranks if rows run out
    piece = pieces[rank] if rank < len(pieces) else mine[name][:0]
    assert torch.equal(p.to_local(), piece), name
    start = sum(len(x) for x in pieces[:rank])
    shard_rows.append((name, tuple(p.shape), start, start + len(piece)))

# %% tags=["hide-input"]
shards = ranks.pull("shard_rows")  # per rank: (parameter, shape, first row, row after)
for spans in zip(*shards, strict=True):  # one parameter: every rank's rows, in turn
    starts, stops = [s[2] for s in spans], [s[3] for s in spans]
    assert starts == [0, *stops[:-1]] and stops[-1] == spans[0][1][0]  # dim 0, once
fig = diagrams.dim0_shards(shards)

# %%
# %%px
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
            "DDP": DDPAdam(copy.deepcopy(tied))}
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
vs_ddp = max((a - b).abs().max().item()
             for a, b in zip(full["FSDP2"], full["DDP"], strict=True))
print(f"rank {rank}: FSDP2 - one process {vs_one:.1e}, FSDP2 - DDP {vs_ddp:.1e}")
sharded = compared["FSDP2"].model
assert sharded.head.weight is sharded.embed.weight  # still one tensor
assert torch.equal(sharded.frozen.weight.full_tensor(), frozen_start)  # never updated
assert vs_one <= 1e-6
assert vs_ddp == 0  # bit for bit: the same mean gradients, Adam element by element
fsdp_held = fsdp.held_param_bytes(sharded)  # this rank's shards: for the plot below

# %% [markdown] lang="ja"
# 5 ステップのあと、FSDP2 のパラメータは 1 プロセスの学習と `1e-6` 以内で等しく、torch の DDP とは
# ビット単位で一致します (レッスン 12 の `Zero3` も同じです)。どちらも同じ平均の勾配を使い、Adam は要素ごとに
# 同じ計算をするからです。共有された重みは 1 つのテンソルのままで、凍結したパラメータは変わりません。
#
# ### reshard_after_forward: メモリと通信のトレードオフ
#
# `reshard_after_forward=True` (層のユニットの既定) は、順伝播のあとで集めたパラメータを解放し、逆伝播の前に
# もう一度集めます。`False` は集めたまま逆伝播まで持ち、2 度目の all-gather を省きます。両方を 1 ステップずつ
# 測ります。順伝播と逆伝播のあいだに 1 ランクが持つパラメータのバイト数 (`sharding.held_bytes`) と、
# 順伝播と逆伝播それぞれの all-gather の回数とバイト数 (`CollectiveLog`) です。ルートにも同じ値を渡します。
#
# **予想してから実行:** `False` では、逆伝播の all-gather は何回になるでしょうか?
#
# <details><summary>測り方の詳細</summary>
#
# FSDP2 は集めたパラメータを `FSDPParam.all_gather_outputs` に置き (モジュールが計算に使うパラメータは
# そのビューです)、解放するときはそのストレージの大きさを 0 にします (`free_unsharded_param`)。
# `fsdp.held_param_bytes` は、そことシャード (`sharded_param`) の両方を数えます。
#
# ルートに値を指定しなければ、FSDP2 はルートのパラメータを逆伝播まで持ちます。逆伝播がすぐに使うからです。
# そのため、ルート自身がパラメータを持つモデルでは、FSDP2 が送るのは DDP の 1.5 倍より少し少なくなります。
#
# </details>

# %% [markdown] lang="en"
# After 5 steps, FSDP2's parameters equal one process's within `1e-6`, and torch's
# DDP's bit for bit (as lesson 12's `Zero3` does): both use the same mean
# gradients, and Adam does the same arithmetic element by element. The tied
# weight is still one tensor, and the frozen parameter has not changed.
#
# ### reshard_after_forward: memory traded for communication
#
# `reshard_after_forward=True` (the default for the layers' units) frees the gathered
# parameters after the forward and gathers them again before the backward; `False`
# keeps them until the backward and skips the second all-gather. One step of each,
# measured: the parameter bytes a rank holds between the forward and the backward
# (`sharding.held_bytes`), and the all-gathers of the forward and of the backward, their
# number and bytes (`CollectiveLog`). The root is given the same value.
#
# **Predict, then run:** with `False`, how many all-gathers does the backward make?
#
# <details><summary>How this was measured</summary>
#
# FSDP2 puts gathered parameters in `FSDPParam.all_gather_outputs` (the parameter a
# module computes with is a view of it) and frees them by resizing that storage to 0
# (`free_unsharded_param`); `fsdp.held_param_bytes` counts there and the shards
# (`sharded_param`).
#
# Left unset for the root, FSDP2 keeps the root's parameters until the backward,
# which needs them first; so where the root holds parameters of its own, FSDP2 sends
# a little less than 1.5 times DDP's bytes.
#
# </details>

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

# %% tags=["hide-input"]
from labkit import plots

runs0 = ranks.pull("runs")[0]  # rank 0's; rank 1's holds and sends as much
held = {str(a): sum(runs0[a]["held_between"].values()) for a in (True, False)}
gathered = {str(a): runs0[a]["backward"].get("all_gather", {"bytes": 0})["bytes"]
            for a in (True, False)}
assert held["False"] > held["True"] and gathered["True"] > gathered["False"] == 0
fig = plots.bar_chart({labkit.t("held_between"): held,
                       labkit.t("gathered_in_backward"): gathered},
                      ylabel="bytes", title="reshard_title", fmt="{:,.0f}")

# %% [markdown] lang="ja"
# `True` では、順伝播と逆伝播のあいだに持つのはシャードだけで、逆伝播でモデル全体をもう一度 all-gather
# します (1 ステップで 2 回)。`False` では、集めたモデル全体をシャードに加えて
# 持ち、all-gather は順伝播の 1 回だけです。持ち続けたバイト数は、省いた all-gather のバイト数と
# ちょうど同じです。`False` のステージ 3 は、送るバイト数がリングのアルゴリズムでは DDP と同じになり、そのかわりパラメータの
# メモリは逆伝播までシャードしないのと同じになります。逆伝播のあとでは、どちらも集めたパラメータを
# 解放します。
#
# ### MixedPrecisionPolicy
#
# `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)` では、シャードは
# float32 のまま (Adam は float32 を更新します)、all-gather は bfloat16 で送り (半分のバイト数)、
# 順伝播と逆伝播は bfloat16 で計算し、勾配は float32 で reduce-scatter します。gloo と CPU でも動きます。同じモデル、同じバッチで、float32 の 1 ステップと比べます。
#
# **予想してから実行:** bfloat16 の all-gather は、float32 の何倍のバイト数を送るでしょうか?

# %% [markdown] lang="en"
# With `True`, only the shards are held between the forward and the backward, and the
# backward all-gathers the whole model again (twice a step). With `False`, the whole
# gathered model is held on top of the shards, and the only
# all-gather is the forward's: the bytes held are exactly the bytes of the all-gather
# saved. Stage 3 with `False` sends DDP's bytes (in the ring algorithm), and in exchange holds its parameters
# as unsharded until the backward. After the backward, both free what they gathered.
#
# ### MixedPrecisionPolicy
#
# With `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`
# the shards stay float32 (Adam updates float32), the all-gather sends bfloat16 (half
# the bytes), the forward and backward compute in bfloat16, and the gradients are
# reduce-scattered in float32. It runs on gloo on the CPU too; compared here with a
# float32 step on the same batch.
#
# **Predict, then run:** what share of float32's bytes does the bfloat16 all-gather send?

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
# `ValueError` を出します)、`dcp.load` で 2 つのシャードから全体を埋め、
# `load_state_dict` します。ランクが集めた全体の state dict と等しいことを確かめ、ディレクトリを消します。

# %% [markdown] lang="en"
# In the kernel (one process, no process group), it is loaded into a plain
# `models.TiedMLP`: `fsdp.load_checkpoint` compares the checkpoint's `.metadata` with the
# model's keys and shapes (a `ValueError` where they differ), fills the
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
# ### ZeroRedundancyOptimizer: オプティマイザの状態を分割して持つ (シャード)
#
# Adam は、パラメータ 1 つにつき 2 つの値 (勾配の移動平均と二乗の移動平均) を持つので、状態は
# パラメータの 2 倍の大きさです (ほかにテンソルごとのステップ数)。DDP では、その全部を全ランクが持ちます。
# `ZeroRedundancyOptimizer` (ZeRO-1 の考え方) では、各ランクがパラメータの一部だけを更新し、その部分の
# 状態だけを持ちます。更新したパラメータは、ステップの終わりに `broadcast` で全ランクに配ります。
# そのため集団通信に渡すバイト数は、勾配の all-reduce にパラメータの broadcast が加わって
# 2 倍になります。ただし broadcast で送るのは送り元のランクだけで、各ランクが送り元になるのは自分の
# 担当分だけです。各ランクがソケットに書き込むバイト数は、2 ランクでは 1.5 倍です (下のセルで数えます)。
# この増え方は torch の `ZeroRedundancyOptimizer` の作り (勾配は DDP の
# all-reduce で全部そろえ、更新したパラメータを broadcast する) によるものです。ZeRO の論文の
# ステージ 1 は、勾配を reduce-scatter し、パラメータを all-gather するので、通信量は DDP と同じです
# (論文の 7 節)。勾配とパラメータは全ランクが全部持ったままです。それも分割して持つのが ZeRO-2、ZeRO-3 と FSDP
# です (レッスン 12 のステージ 1〜3)。

# %% [markdown] lang="en"
# ### ZeroRedundancyOptimizer: sharing out the optimizer state
#
# Adam keeps two values per parameter (moving averages of the gradient and of its
# square): its state is twice the parameters (and a step count per tensor). Under DDP every rank holds all of it.
# With `ZeroRedundancyOptimizer` (the idea of ZeRO-1) each rank updates only a share of
# the parameters and holds only that share's state; at the end of the step it hands the
# parameters it updated to every rank with `broadcast`. So the bytes handed to
# collectives double: the gradients' all-reduce plus the
# parameters' broadcast. But in a broadcast only the source sends, and each rank is the
# source of its own share only: the bytes each rank writes to its sockets grow 1.5× on 2
# ranks (counted below). That growth comes from the
# design of torch's `ZeroRedundancyOptimizer` (the gradients all-reduced whole by DDP,
# then the updated parameters broadcast); stage 1 as the ZeRO paper describes it
# reduce-scatters the gradients and all-gathers the parameters, the same volume as DDP
# (the paper's section 7). Every rank still holds all the gradients and parameters;
# sharing those out too is ZeRO-2, ZeRO-3 and FSDP (lesson 12's stages 1 to 3).

# %%
# %%px
from labkit import send_less

zero_runs = send_less.compare_methods(["DDP + Adam", "ZeRO + Adam"], steps=12)

# %%
runs = ranks.pull("zero_runs")
adam, zero = runs[0]["DDP + Adam"], runs[0]["ZeRO + Adam"]
grad_bytes = adam["bytes"][-1]  # DDP's all-reduce: every gradient once
per_rank = [r["ZeRO + Adam"]["state_bytes"] for r in runs]
print(f"Adam's state on each rank: {adam['state_bytes']:,} bytes; with ZeRO: "
      f"{per_rank} (together {sum(per_rank):,})")
print(f"bytes per step: DDP + Adam {adam['bytes'][-1]:,}, ZeRO + Adam {zero['bytes'][-1]:,}")
assert 2 * grad_bytes <= adam["state_bytes"] < 2 * grad_bytes + 1024
assert sum(per_rank) == adam["state_bytes"]  # the same state, shared out
assert max(per_rank) < 0.51 * adam["state_bytes"]
assert zero["bytes"][-1] == 2 * adam["bytes"][-1]  # + the parameters' broadcast
assert zero["sent"][-1].broadcast_bytes == adam["bytes"][-1]  # every parameter, once
# On the wire: what each rank wrote to its sockets in the last step, both ranks summed.
if all(r["DDP + Adam"]["wire"][-1] is not None for r in runs):
    wire = {m: sum(r[m]["wire"][-1] for r in runs) for m in ("DDP + Adam", "ZeRO + Adam")}
    print(f"written to sockets, both ranks: DDP + Adam {wire['DDP + Adam']:,}, "
          f"ZeRO + Adam {wire['ZeRO + Adam']:,} "
          f"({wire['ZeRO + Adam'] / wire['DDP + Adam']:.2f}x)")
    assert 1.4 < wire["ZeRO + Adam"] / wire["DDP + Adam"] < 1.6  # not 2x: one source
else:  # macOS, Windows: no /proc/self/io
    print(labkit.t("bytes_written_not_counted"))
assert zero["loss"] == adam["loss"]  # the same training, bit for bit


# %% [markdown] lang="ja"
# 状態が分かれているので、チェックポイントを保存する前に、1 つのランクに集める必要があります。
# `consolidate_state_dict(to=0)` を全ランクで呼ぶと、ランク 0 だけが `state_dict()` を返せます。
# `consolidate_state_dict` を呼ばずに `state_dict()` を呼ぶとエラーになります。

# %% [markdown] lang="en"
# Since the state is shared out, it must be gathered on one rank before writing a
# checkpoint: after every rank calls `consolidate_state_dict(to=0)`, rank 0 alone can
# return `state_dict()`. Calling `state_dict()` without it raises.

# %%
# %%px
from torch.distributed.optim import ZeroRedundancyOptimizer

model = DDP(nn.Linear(4, 4))
optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam)
model(torch.randn(8, 4)).sum().backward()
optimizer.step()
try:
    optimizer.state_dict()
    message = None
except RuntimeError as err:
    message = str(err)
print(f"rank {rank}: {message}")
optimizer.consolidate_state_dict(to=0)
if rank == 0:
    assert len(optimizer.state_dict()["state"]) == 2  # weight and bias, gathered
assert message is not None and "consolidate_state_dict" in message

# %% [markdown] lang="ja"
# ## 演習: 1 ランクあたりのバイト数を予測する
#
# `bytes_per_rank(params, world_size, stage)` を書いてください。Ψ 個のパラメータを float32 の Adam で
# N ランクで学習するとき、`stage` (`"DDP"`、`"ZeRO-1"`、`"ZeRO-2"`、`"ZeRO-3"`) で 1 ランクが持つモデルの
# 状態のバイト数 (レッスン 12 の表の float32 の列: [12: メモリは何に使われるか](12_zero_by_hand.ipynb#cell-id=12-where-the-memory-goes)) です。`step` とパディングは数えず、Ψ ÷ N は小数のままにします。

# %% [markdown] lang="en"
# ## Exercise: predict the bytes per rank
#
# Write `bytes_per_rank(params, world_size, stage)`: training Ψ parameters with Adam
# in float32 on N ranks, the bytes of model state one rank holds under `stage`
# (`"DDP"`, `"ZeRO-1"`, `"ZeRO-2"` or `"ZeRO-3"`), the float32 column of lesson 12's table ([12: Where the memory goes](12_zero_by_hand.ipynb#cell-id=12-where-the-memory-goes)). Leave
# out `step` and padding, and keep Ψ ÷ N a fraction.

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
# ## 演習: 1 ステップで送るバイト数を予測する
#
# シャードはメモリを減らしますが、通信はどうでしょうか。`bytes_sent_per_rank(params, world_size, stage)`
# を書いてください。Ψ 個のパラメータを float32 で学習するとき、1 ステップの集団通信で 1 ランクが
# **送る**バイト数です。集団通信はリング (レッスン 05) で、S バイトの reduce-scatter でも all-gather でも
# 各ランクは (N − 1)/N × S を送ります。各ステージが呼ぶ集団通信はレッスン 12 のクラスのとおりで、パディングは
# 数えません。

# %% [markdown] lang="en"
# ## Exercise: predict the bytes sent per step
#
# Sharding saves memory: what does it do to the traffic? Write
# `bytes_sent_per_rank(params, world_size, stage)`: training Ψ parameters in float32,
# the bytes one rank **sends** in a step's collectives. They are rings (lesson 05): in
# a reduce-scatter or an all-gather of S bytes each rank sends (N − 1)/N × S. Lesson
# 12's classes show which collectives each stage calls; padding is not counted.

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
# ## いつシャードするか
#
# シャードで減るのはメモリで、通信は減りません (各ランクが更新するのは自分のシャードだけなので、
# オプティマイザの計算は 1/N になります)。リングのアルゴリズムでは、ステージ 1 と 2 が送るバイト数は
# DDP と同じで (reduce-scatter + all-gather = all-reduce)、ステージ 3 と FSDP2 は逆伝播の前の all-gather の
# ぶん、DDP の 1.5 倍を送ります ([12: 1 ステップで送るバイト数](12_zero_by_hand.ipynb#cell-id=12-bytes-sent-per-step))。
# メモリと時間は単位が違うので、そのままでは比べられません。このレッスンでは、「シャードが割に合わない」を
# 次の意味で使います: **シャードする範囲の小さいステージ (ステージ 1 や 2) でもメモリの予算に収まるのに、
# ステージ 3 を選んで、余分な all-gather の時間を払うこと**。どのステージが収まるかはメモリだけで決まり、
# 余分な all-gather の時間は α–β モデルで見積もれます。
#
# 下の図は、Adam (float32) で学習するときのモデル状態 (パラメータ、勾配、Adam の状態) の 1 ランク
# あたりのメモリを、DDP のメモリに対する割合として、横軸をランクの数にして描きます。この割合はパラメータの数に
# よりません。線は式 (`sharding.memory_per_rank`) で、印は上の FSDP2 のモデルで 2 ランクが持つパラメータの
# シャードのバイト数を、パラメータ全体に対する割合にしたものです (ステージ 3 では 3 つの部分がどれも
# N で割られるので、割合は同じです)。ほかのランクの数は式だけです。
#
# 破線は予算の一例です。130 億 (13B) パラメータのモデルは、DDP では 1 ランクに 208 GB が要ります。
# これを 1 ランク 80 GB で学習します (活性値などは別に要るので、モデル状態だけの予算です)。

# %% [markdown] lang="en"
# ## When to shard
#
# Sharding saves memory, not communication (it even divides the optimizer's compute by
# N: each rank updates only its shard). In the ring algorithm stages 1 and 2 send DDP's
# bytes (reduce-scatter + all-gather = all-reduce); stage 3 and FSDP2 send 1.5 times as
# much, the all-gather before the backward ([12: Bytes sent per step](12_zero_by_hand.ipynb#cell-id=12-bytes-sent-per-step)). Memory and seconds are different
# units, so here "sharding costs more than it saves" means: **choosing stage 3, and
# paying for its extra all-gather, where a stage that shards less would fit the memory
# budget too**. Which stages fit depends on memory alone; the extra all-gather's time
# comes from the α–β model.
#
# The plot shows the model states' memory per rank (parameters, gradients, Adam's
# state, training with Adam in float32) as a share of DDP's, against the number of
# ranks; the share does not depend on the number of parameters. The lines are the
# formula (`sharding.memory_per_rank`); the marker is the FSDP2 model above on 2
# ranks, the bytes of its parameters' shards over the whole parameters' (in stage 3
# all three parts are divided by N alike). Other numbers of ranks: only the formula.
#
# The dashed line is an example budget: a 13-billion (13B) parameter model, which needs
# 208 GB per rank under DDP, trained with 80 GB per rank (for the model states only:
# activations and buffers need room besides).

# %% tags=["hide-input"]
world_sizes = range(1, 65)
per_rank = {n: sharding.memory_per_rank(1, n, **sharding.FP32_ADAM) for n in world_sizes}
formula = {stage: (world_sizes, [m[stage] / m["DDP"] for m in per_rank.values()])
           for stage in sharding.STAGES}
# The marker: what FSDP2's shards hold on rank 0, over the whole parameters' bytes.
held = ranks.pull("fsdp_held")[0]
whole = 4 * sum(p.numel() for p in models.TiedMLP().parameters())
share = held["sharded"] / whole
print(f"FSDP2 on 2 ranks: rank 0 holds {held['sharded']:,} of {whole:,} parameter bytes")
assert held["gathered"] == 0 and 0.5 <= share < 0.52  # half, plus dim-0 padding
on_ranks = {"ZeRO-3": (2, share)}

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
# 計算と重ねて実行できるので、時間が増えるのは通信がボトルネックのときです。秒数は、下のセルが all-reduce を測って
# 当てはめる α と β からの外挿で、桁の目安です (レッスン 05)。GPU のクラスタでは α と β が違うので秒数は変わりますが、
# 境目の 6 ランクはメモリだけで決まるので変わりません。
#
# gloo では reduce-scatter が all-reduce 1 回ぶんかかり、ステージ 2 は all-reduce の 1.5 倍、ステージ 3 は
# 2 倍になりますが (ステージ 3 はステージ 2 の 1.5 倍ではなく 4/3 倍)、余分な all-gather の秒数も境目も
# 同じです。予算から見ると、1 ランク 80 GB で
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
# communication is the bottleneck. The seconds, extrapolated to an order of magnitude,
# come from the α–β model (lesson 05) with the α and β the next cell fits to measured
# all-reduces.
# On a GPU cluster
# α and β differ, and so do the seconds, but not the crossover at 6 ranks, which memory
# alone decides.
#
# On gloo, where a reduce-scatter costs a whole all-reduce, stage 2 takes 1.5
# all-reduces and stage 3 two (4/3 of stage 2, not 1.5): the same extra seconds, the
# same crossover. Seen from
# the budget: the largest model 80 GB per rank can train is
# 5 billion parameters under DDP, on any number of ranks, and N times that under
# stage 3.

# %%
# %%px
from labkit import comm

sizes = [2**k for k in range(10, 23, 2)]  # 1 KiB to 4 MiB
ab = comm.fit_alpha_beta(sizes, comm.allreduce_sweep(sizes, repeat=7), world_size)

# %% [markdown] lang="ja"
# gloo の reduce-scatter は中で all-reduce を実行します (レッスン 12)。そのため、下の gloo の見積もりでは
# reduce-scatter を all-reduce 1 回ぶんとします。次のセルは、数 MB の集団通信 1 回ずつで、各ランクが
# ソケットに書き込むバイト数を数えます (Linux の /proc/self/io)。
#
# **予想してから実行:** gloo の reduce-scatter は、S バイトのうち何倍を書き込むでしょうか (リングでは
# 0.5 倍)?

# %% [markdown] lang="en"
# On gloo a reduce-scatter runs an all-reduce underneath (lesson 12), so the gloo
# pricing below charges it a whole all-reduce. The next cell counts what one
# collective of a few megabytes each makes each rank write to its sockets (Linux's
# /proc/self/io).
#
# **Predict, then run:** what share of S does gloo's reduce-scatter write (the ring's
# is 0.5)?

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

ab = ranks.pull("ab")[0]  # the alpha-beta model fitted on the ranks
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
# 最後に、シャードの切り方です。レッスン 12 のステージ 1〜3 のように平坦化したバッファを同じ長さに切るやり方が使えるのは、要素ごとに計算するオプティマイザ (SGD、Adam、
# AdamW) です。テンソル全体を使う `Adafactor` (行・列ごとの統計) や `Muon` (2 次元の行列全体) は、
# 切れ目がテンソルの途中にあると別の更新をします。次のセルで確かめます。

# %% [markdown] lang="en"
# Last, how the shards are cut. Cutting one flat buffer, as lesson 12's stages 1 to 3 do, into equal pieces works for optimizers that compute element
# by element (SGD, Adam, AdamW). `Adafactor` (row and column statistics) and `Muon`
# (the whole 2-D matrix) use whole tensors, and compute another update where a cut
# falls inside one. The next cell checks it.

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

# %%
ranks.stop()

# %% [markdown] lang="ja" tags=["summary"]
# ## 覚えておくこと
#
# - **FSDP2 の `fully_shard` はステージ 3 を PyTorch が実装したもの**で、層ごとのユニットの前にランク 0 の
#   重みを配り、重みを共有するモジュールは 1 つのユニットに入れます。torch の DDP とビット単位で一致します。
# - **`reshard_after_forward=False` はメモリを通信と交換します**。逆伝播の all-gather を省き、そのぶんの
#   バイト数を逆伝播まで持ちます。`MixedPrecisionPolicy` の bfloat16 は all-gather のバイト数を半分にします。
# - **torch の `ZeroRedundancyOptimizer` はステージ 1 の考え方**で、Adam の状態を分けて持ち、更新した
#   パラメータを broadcast します。保存の前には `consolidate_state_dict` で 1 つのランクに集めます。
# - **state dict には 2 つの形があります**。シャードの `DTensor` と、集めた全体です。分散チェックポイントは
#   シャードの形で保存し、別のランクの数 (1 プロセスでも) で読み込めます。
# - **どのステージが収まるかはメモリの予算だけで決まります**。小さいステージが収まるのにステージ 3 を選ぶと、
#   余分な all-gather を払うだけです。

# %% [markdown] lang="en" tags=["summary"]
# ## What to remember
#
# - **FSDP2's `fully_shard` is stage 3 as PyTorch implements it**: broadcast rank 0's
#   weights first, put modules sharing a weight in one unit; it equals torch's DDP bit
#   for bit.
# - **`reshard_after_forward=False` trades memory for communication**: the backward's
#   all-gather is saved, its bytes held until the backward; `MixedPrecisionPolicy`'s
#   bfloat16 halves the all-gather's bytes.
# - **Torch's `ZeroRedundancyOptimizer` is stage 1's idea**: Adam's state shared out,
#   the updated parameters broadcast; `consolidate_state_dict` gathers it on one rank
#   to save.
# - **A state dict comes in two forms**, the shards' `DTensor`s and the gathered whole; a
#   distributed checkpoint saves the shards and loads on another number of ranks, one
#   process too.
# - **Which stage fits depends on the memory budget alone**: choosing stage 3 where a
#   smaller stage fits only pays for an extra all-gather.

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

selfcheck.show("13_fsdp2")

# %% tags=["self-check"]
# Your answers, "a", "b", "c" or "d" for each question; then run this cell.
my_answers = {1: None, 2: None, 3: None}
selfcheck.check("13_fsdp2", my_answers)
