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
# - FSDP2 の `fully_shard` でモデルを層ごとのユニットに分けてシャードし、1 プロセスの学習と DDP に
#   一致することを確かめる
# - `reshard_after_forward` と `MixedPrecisionPolicy` が、メモリと送るバイト数をどう変えるかを数える
# - `ZeroRedundancyOptimizer` でオプティマイザの状態を分けて持ち、保存の前に集める
# - state dict の 2 つの形を使い分け、分散チェックポイントを別のランクの数で読み込む
# - 1 ランクのメモリの予算から、どのステージが収まるかを決める

# %% [markdown] lang="en" tags=["outcomes"]
# # 13 FSDP2 and when to shard
#
# After this lesson you can:
#
# - shard a model with FSDP2's `fully_shard`, one unit per layer, and check it against
#   one process and DDP;
# - count what `reshard_after_forward` and `MixedPrecisionPolicy` change in memory and
#   bytes sent;
# - share out the optimizer's state with `ZeroRedundancyOptimizer`, and gather it to
#   save;
# - use the two forms of a state dict, and load a distributed checkpoint on another
#   number of ranks;
# - decide from a per-rank memory budget which ZeRO stage fits.

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
# FSDP2 (`torch.distributed.fsdp.fully_shard`) は、PyTorch が実装したステージ 3 です。`fully_shard(module)`
# は `module` を 1 つの**ユニット**にし、その各パラメータを、0 番目の次元で切ったシャードを持つ `DTensor` に
# します。ユニットの前後のフックが、レッスン 12 の `Zero3` と同じく集めて、解放して、勾配を reduce-scatter
# します ([12: ZeRO ステージ 3 を手で書く](12_zero_by_hand.ipynb#cell-id=12-zero-stage-3-by-hand))。
# 層ごとに 1 ユニット、最後にモデル全体 (ルート) に呼びます。
#
# `models.TiedMLP` では、気をつけることが 2 つあります (下で確かめます)。
#
# - `fully_shard` は値を配りません。各ランクは自分の値から自分のシャードを切り出すので、先にランク 0 の
#   重みを配ります。
# - 重みを共有するモジュールは 1 つのユニットに入れます (`fully_shard([model.embed, model.head])`)。
#   別々にすると、最初の順伝播で `ValueError` になります。`fsdp.layer_units(model)` がそのように並べます。
#   凍結したパラメータは、集めますが reduce-scatter しません。
#
# `FSDP2Adam` はレッスン 12 の学習クラスと同じように使い、DDP (`DDPAdam`) と 1 プロセスの学習と比べます。

# %% [markdown] lang="en"
# ## FSDP2: fully_shard
#
# FSDP2 (`torch.distributed.fsdp.fully_shard`) is stage 3 as PyTorch implements it.
# `fully_shard(module)` makes `module` one **unit**, each of its parameters a `DTensor`
# holding this rank's shard, cut along dimension 0. Hooks around the unit gather, free
# and reduce-scatter as lesson 12's `Zero3` does ([12: ZeRO stage 3 by hand](12_zero_by_hand.ipynb#cell-id=12-zero-stage-3-by-hand)).
# Call it on each layer, then on the whole model (the root).
#
# On `models.TiedMLP`, two things need care (checked below):
#
# - `fully_shard` sends nothing: each rank cuts its shard out of its own values, so
#   rank 0's weights are broadcast first.
# - Modules sharing a weight go in one unit (`fully_shard([model.embed, model.head])`);
#   in two, the first forward raises a `ValueError`. `fsdp.layer_units(model)` groups
#   them so. Frozen parameters are gathered, never reduce-scattered.
#
# `FSDP2Adam` is used like lesson 12's trainers and compared with DDP (`DDPAdam`) and
# one process.

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
# まず、`fully_shard` が各ランクに残すものです。図は、各パラメータの 0 番目の次元のうち各ランクが持つ
# 行です。`torch.chunk` と同じ切り方なので、33 行はランク 0 が 17 行、ランク 1 が 16 行で、1 行しかない
# パラメータではランク 1 のシャードは空です。

# %% [markdown] lang="en"
# First, what `fully_shard` leaves on each rank: each parameter's rows of dimension 0
# per rank. Cut as `torch.chunk` cuts, 33 rows split into 17 and 16; a single row
# leaves rank 1 an empty shard.

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

# %% tags=["hide-input"]
# %%px
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

# %% tags=["hide-input"]
# %%px
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
# 5 ステップのあと、FSDP2 は 1 プロセスの学習と `1e-6` 以内で等しく、DDP とはビット単位で一致します
# (同じ平均の勾配に、Adam が要素ごとに同じ計算をします)。共有された重みは 1 つのテンソルのままです。
#
# ### reshard_after_forward: メモリと通信のトレードオフ
#
# `reshard_after_forward=True` (層のユニットの既定) は、順伝播のあとで集めたパラメータを解放し、逆伝播の前に
# もう一度集めます。`False` は集めたまま逆伝播まで持ち、2 度目の all-gather を省きます。両方を 1 ステップずつ
# 測ります。
#
# **予想してから実行:** `False` では、逆伝播の all-gather は何回になるでしょうか?
#
# <details><summary>測り方</summary>
#
# FSDP2 は集めたパラメータを `FSDPParam.all_gather_outputs` に置き (モジュールが計算に使うパラメータは
# そのビューです)、解放するときはそのストレージの大きさを 0 にします (`free_unsharded_param`)。
# `fsdp.held_param_bytes` は、そことシャード (`sharded_param`) の両方を数えます。バイト数は
# `sharding.held_bytes`、集団通信は `CollectiveLog` で数え、ルートにも同じ値を渡します。
#
# ルートに値を指定しなければ、FSDP2 はルートのパラメータを逆伝播まで持ちます。逆伝播がすぐに使うからです。
# そのため、ルート自身がパラメータを持つモデルでは、FSDP2 が送るのは DDP の 1.5 倍より少し少なくなります。
#
# </details>

# %% [markdown] lang="en"
# After 5 steps FSDP2 equals one process within `1e-6` and DDP bit for bit (the same
# mean gradients, Adam element by element); the tied weight is still one tensor.
#
# ### reshard_after_forward: memory traded for communication
#
# `reshard_after_forward=True` (the default for the layers' units) frees the gathered
# parameters after the forward and gathers them again before the backward; `False`
# keeps them until the backward and skips the second all-gather. One step of each is measured.
#
# **Predict, then run:** with `False`, how many all-gathers does the backward make?
#
# <details><summary>How this was measured</summary>
#
# FSDP2 puts gathered parameters in `FSDPParam.all_gather_outputs` (the parameter a
# module computes with is a view of it) and frees them by resizing that storage to 0
# (`free_unsharded_param`); `fsdp.held_param_bytes` counts there and the shards
# (`sharded_param`). Bytes held come from `sharding.held_bytes`, collectives from
# `CollectiveLog`; the root is given the same value.
#
# Left unset for the root, FSDP2 keeps the root's parameters until the backward,
# which needs them first; so where the root holds parameters of its own, FSDP2 sends
# a little less than 1.5 times DDP's bytes.
#
# </details>

# %% tags=["hide-input"]
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
# `True` では、順伝播と逆伝播のあいだに持つのはシャードだけで、逆伝播でモデル全体をもう一度 all-gather します。`False`
# では、集めたモデル全体を持ち、all-gather は順伝播の 1 回だけです。持ち続けたバイト数は、省いた
# all-gather のバイト数とちょうど同じです。
#
# ### MixedPrecisionPolicy
#
# `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)` では、シャードは float32 の
# まま (Adam は float32 を更新します)、all-gather と計算は bfloat16、勾配の reduce-scatter は float32 です。
#
# **予想してから実行:** bfloat16 の all-gather は、float32 の何倍のバイト数を送るでしょうか?

# %% [markdown] lang="en"
# With `True`, only the shards are held between forward and backward, and the
# backward all-gathers the whole model again. With `False`, the gathered model is held
# and the forward's is the only all-gather: the bytes held are exactly the bytes of the
# all-gather saved.
#
# ### MixedPrecisionPolicy
#
# With `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`
# the shards stay float32 (Adam updates float32), the all-gather and the compute are
# bfloat16, and the gradients are reduce-scattered in float32.
#
# **Predict, then run:** what share of float32's bytes does the bfloat16 all-gather send?

# %% tags=["hide-input"]
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
# all-gather のバイト数はちょうど半分、reduce-scatter は float32 のままで同じです。損失は float32 と
# 違いますが、差は 1% 以内です。
#
# ### state dict の 2 つの形と、分散チェックポイント
#
# シャードしたモデルの `model.state_dict()` は、各ランクのシャードを `DTensor` で持ちます。
# `get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))` は全体を集めて、ふつうの
# `torch.Tensor` を返します。`torch.distributed.checkpoint` (DCP) はシャードの形のまま、各ランクが自分の
# ファイルに書き、`.metadata` に目次を書きます。読む側は必要な部分だけを読むので、2 ランクで保存したものを
# 1 プロセスで読めます (再シャーディング)。

# %% [markdown] lang="en"
# The all-gather sends exactly half the bytes; the reduce-scatter stays float32, the
# same bytes. The loss differs from float32's by less than 1%.
#
# ### The two forms of a state dict, and a distributed checkpoint
#
# A sharded model's `model.state_dict()` holds each rank's shards as `DTensor`s;
# `get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))` gathers
# them into whole, plain `torch.Tensor`s. `torch.distributed.checkpoint` (DCP) saves
# the sharded form, each rank its own file, with a `.metadata` index; a reader reads
# the parts it needs, so what 2 ranks saved loads in one process: resharding.

# %%
# %%px
import os
import tempfile

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)

sharded_state = sharded.state_dict()  # DTensors: this rank's shards
full_state = get_model_state_dict(sharded,  # gathered: whole, plain tensors
                                  options=StateDictOptions(full_state_dict=True))
checkpoint_dir = [tempfile.mkdtemp(prefix="labkit-dcp-") if rank == 0 else None]
dist.broadcast_object_list(checkpoint_dir, src=0)  # one directory: rank 0's
checkpoint_dir = checkpoint_dir[0]
dcp.save(sharded_state, checkpoint_id=checkpoint_dir)  # each rank writes its shards

# %% tags=["hide-input"]
# %%px
from torch.distributed.tensor import DTensor

entry = sharded_state["embed.weight"]
print(f"rank {rank}: state_dict()['embed.weight'] is a {type(entry).__name__} of shape "
      f"{tuple(entry.shape)}; this rank holds {tuple(entry.to_local().shape)}")
assert all(isinstance(v, DTensor) for v in sharded_state.values())
assert entry.to_local().shape == mine["embed.weight"].chunk(world_size)[rank].shape
assert all(type(v) is torch.Tensor for v in full_state.values())
assert all(full_state[k].shape == v.shape for k, v in sharded_state.items())
if rank == 0:
    print(sorted(os.listdir(checkpoint_dir)))

# %% [markdown] lang="ja"
# カーネル (プロセスグループのない 1 プロセス) で、ふつうの `models.TiedMLP` に読み込みます
# (`fsdp.load_checkpoint`。キーや形が合わなければ `ValueError` です)。ランクが集めた全体と等しいはずです。

# %% [markdown] lang="en"
# In the kernel (one process, no process group), `fsdp.load_checkpoint` loads it into
# a plain `models.TiedMLP` (a `ValueError` where keys or shapes differ). It must equal
# the full state dict the ranks gathered.

# %% tags=["hide-input"]
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
# `ZeroRedundancyOptimizer` (ZeRO-1 の考え方) では、各ランクがパラメータの一部だけを更新し、その部分の
# Adam の状態だけを持ちます (メモリは [12: メモリは何に使われるか](12_zero_by_hand.ipynb#cell-id=12-where-the-memory-goes) の表のとおりです)。
# 更新したパラメータは、ステップの終わりに `broadcast` で配ります。集団通信に渡すバイト数は 2 倍ですが、
# broadcast で送るのは送り元だけなので、各ランクが書き込むのは 2 ランクで 1.5 倍です (下で数えます)。
# 論文のステージ 1 は代わりに reduce-scatter と all-gather を使うので、DDP と同じです。

# %% [markdown] lang="en"
# ### ZeroRedundancyOptimizer: sharing out the optimizer state
#
# With `ZeroRedundancyOptimizer` (the idea of ZeRO-1) each rank updates a share of the
# parameters and holds only that share's Adam state (the table of
# [12: Where the memory goes](12_zero_by_hand.ipynb#cell-id=12-where-the-memory-goes)); at the end of the step it
# broadcasts the parameters it updated. The bytes handed to collectives double, but
# only a broadcast's source sends: each rank writes 1.5× on 2 ranks (counted below).
# The paper's stage 1 reduce-scatters and all-gathers instead: DDP's volume.

# %%
# %%px
from labkit import send_less

zero_runs = send_less.compare_methods(["DDP + Adam", "ZeRO + Adam"], steps=12)

# %% tags=["hide-input"]
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
# 状態が分かれているので、保存の前に 1 つのランクに集めます。全ランクで `consolidate_state_dict(to=0)` を
# 呼ぶと、ランク 0 が `state_dict()` を返せます。呼ばずに `state_dict()` を呼ぶとエラーです。

# %% [markdown] lang="en"
# The state being shared out, it is gathered on one rank before saving: after every
# rank calls `consolidate_state_dict(to=0)`, rank 0 can return `state_dict()`; without
# it, `state_dict()` raises.

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
# シャードは通信をどう変えるでしょうか。`bytes_sent_per_rank(params, world_size, stage)` を書いてください。
# Ψ 個のパラメータを float32 で学習するとき、1 ステップの集団通信で 1 ランクが**送る**バイト数です。
# 集団通信はリング (レッスン 05) で、S バイトの reduce-scatter でも all-gather でも各ランクは
# (N − 1)/N × S を送ります。各ステージの集団通信はレッスン 12 のクラスのとおりで、パディングは数えません。

# %% [markdown] lang="en"
# ## Exercise: predict the bytes sent per step
#
# What does sharding do to the traffic? Write `bytes_sent_per_rank(params, world_size,
# stage)`: training Ψ parameters in float32, the bytes one rank **sends** in a step's
# collectives. They are rings (lesson 05): in a reduce-scatter or an all-gather of S
# bytes each rank sends (N − 1)/N × S. Lesson 12's classes show each stage's
# collectives; padding is not counted.

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
# シャードで減るのはメモリで、通信は減りません。リングでは、ステージ 1 と 2 は DDP と同じバイト数を送り、
# ステージ 3 と FSDP2 は 1.5 倍を送ります ([12: 1 ステップで送るバイト数](12_zero_by_hand.ipynb#cell-id=12-bytes-sent-per-step))。
# シャードが割に合わないのは、**シャードの少ないステージでも予算に収まるのに、ステージ 3 を選んで余分な
# all-gather を払うとき**です。
#
# 図は、1 ランクあたりのメモリ (float32 の Adam) の DDP に対する割合を、ランクの数に対して描きます。線は式
# (`sharding.memory_per_rank`)、印は上の FSDP2 のモデルです。破線の予算は、130 億 (13B) パラメータの
# モデル (DDP では 1 ランク 208 GB) を 1 ランク 80 GB で学習する例です (モデル状態だけ)。

# %% [markdown] lang="en"
# ## When to shard
#
# Sharding saves memory, not communication: in a ring, stages 1 and 2 send DDP's bytes,
# stage 3 and FSDP2 1.5 times as much ([12: Bytes sent per step](12_zero_by_hand.ipynb#cell-id=12-bytes-sent-per-step)).
# So sharding costs more than it saves when **stage 3, and its extra all-gather, is
# chosen where a stage that shards less would fit the memory budget too**.
#
# The plot: memory per rank (Adam in float32) as a share of DDP's, against the number
# of ranks; lines from the formula (`sharding.memory_per_rank`), the marker from the
# FSDP2 model above. The dashed budget: a 13-billion (13B) parameter model, 208 GB a
# rank under DDP, trained with 80 GB a rank (model states only).

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
# - DDP とステージ 1 は、何ランクでも収まりません。シャードしないパラメータと勾配だけで 104 GB です。
# - ステージ 3 は 3 ランクから収まります (1 ランク 69.3 GB)。
# - ステージ 2 は 6 ランクから収まります (78 GB。5 ランクでは 83.2 GB)。
#
# 3〜5 ランクではステージ 3 しか選べません。6 ランクからはステージ 2 が収まり、ステージ 3 の余分な
# all-gather (パラメータ 52 GB をもう一度集めます) は、予算が必要としないメモリのための通信です。下のセルが
# その秒数を α–β モデル (レッスン 05) で見積もります。FSDP2 はこれを先読みし、GPU では計算と重ねます。
#
# <details><summary>測り方</summary>
#
# 秒数は、下のセルが all-reduce を測って当てはめる α と β からの外挿で、桁の目安です。GPU のクラスタでは
# α と β が違うので秒数は変わりますが、境目の 6 ランクはメモリだけで決まるので変わりません。gloo では
# reduce-scatter が all-reduce 1 回ぶんかかり、ステージ 2 は all-reduce の 1.5 倍、ステージ 3 は 2 倍に
# なりますが (ステージ 3 はステージ 2 の 1.5 倍ではなく 4/3 倍)、余分な all-gather の秒数も境目も同じです。
# 予算から見ると、1 ランク 80 GB で学習できる最大のモデルは、DDP ではランクの数によらず 50 億パラメータ、
# ステージ 3 ではその N 倍です。
#
# </details>

# %% [markdown] lang="en"
# A stage fits where its line is below the budget's:
#
# - DDP and stage 1 never fit, on any number of ranks: their unsharded parameters and
#   gradients alone are 104 GB.
# - Stage 3 fits from 3 ranks on (69.3 GB a rank).
# - Stage 2 fits from 6 ranks on (78 GB; 83.2 GB on 5).
#
# On 3 to 5 ranks stage 3 is the only choice. From 6 ranks on stage 2 fits, and stage
# 3's extra all-gather (52 GB of parameters once more) buys memory the budget does not
# need; the cell below prices it with the α–β model (lesson 05). FSDP2 prefetches it,
# overlapping the compute on a GPU.
#
# <details><summary>How this was measured</summary>
#
# The seconds are extrapolated, to an order of magnitude, from the α and β the next
# cell fits to measured all-reduces. On a GPU cluster α and β differ, and so do the
# seconds, but not the crossover at 6 ranks, which memory alone decides. On gloo, where
# a reduce-scatter costs a whole all-reduce, stage 2 takes 1.5 all-reduces and stage 3
# two (4/3 of stage 2, not 1.5): the same extra seconds, the same crossover. Seen from
# the budget, the largest model 80 GB a rank can train is 5 billion parameters under
# DDP, on any number of ranks, and N times that under stage 3.
#
# </details>

# %%
# %%px
from labkit import comm

sizes = [2**k for k in range(10, 23, 2)]  # 1 KiB to 4 MiB
ab = comm.fit_alpha_beta(sizes, comm.allreduce_sweep(sizes, repeat=7), world_size)

# %% [markdown] lang="ja"
# gloo の reduce-scatter は中で all-reduce を実行します (レッスン 12)。そこで gloo の見積もりでは、
# all-reduce 1 回ぶんとします。次のセルは、集団通信 1 回ずつで各ランクが書き込むバイト数を数えます。
#
# **予想してから実行:** gloo の reduce-scatter は、S バイトのうち何倍を書き込むでしょうか (リングでは
# 0.5 倍)?

# %% [markdown] lang="en"
# On gloo a reduce-scatter runs an all-reduce underneath (lesson 12), so the gloo
# pricing charges it a whole all-reduce. The next cell counts what one collective makes
# each rank write.
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


# %% tags=["hide-input"]
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
# 最後に、シャードの切り方です。平坦化したバッファを同じ長さに切るやり方 (レッスン 12) が使えるのは、
# 要素ごとに計算するオプティマイザ (SGD、Adam、AdamW) です。テンソル全体を使う `Adafactor` や `Muon`
# は、切れ目がテンソルの途中にあると別の更新をします。

# %% [markdown] lang="en"
# Last, how the shards are cut. Cutting one flat buffer into equal pieces (lesson 12)
# works for optimizers that compute element by element (SGD, Adam, AdamW).
# `Adafactor` and `Muon` use whole tensors, and compute another update where a cut
# falls inside one.

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
# - **FSDP2 の `fully_shard` は PyTorch のステージ 3** です。先にランク 0 の重みを配り、重みを共有する
#   モジュールは 1 つのユニットに入れます。DDP とビット単位で一致します。
# - **`reshard_after_forward=False` はメモリを通信と交換します**。逆伝播の all-gather を省き、そのぶんを
#   持ちます。bfloat16 のパラメータは all-gather を半分にします。
# - **`ZeroRedundancyOptimizer` はステージ 1 の考え方**で、Adam の状態を分けて持ち、更新したパラメータを
#   broadcast します。保存の前に `consolidate_state_dict` で集めます。
# - **state dict には 2 つの形があります** (シャードの `DTensor` と、集めた全体)。分散チェックポイントは
#   シャードの形で保存し、別のランクの数で読み込めます。
# - **どのステージが収まるかはメモリの予算だけで決まります**。小さいステージが収まるのにステージ 3 を選ぶと、
#   余分な all-gather を払うだけです。

# %% [markdown] lang="en" tags=["summary"]
# ## What to remember
#
# - **FSDP2's `fully_shard` is PyTorch's stage 3**: broadcast rank 0's weights first,
#   put modules sharing a weight in one unit; it equals DDP bit for bit.
# - **`reshard_after_forward=False` trades memory for communication**: no backward
#   all-gather, its bytes held instead; bfloat16 parameters halve the all-gather.
# - **`ZeroRedundancyOptimizer` is stage 1's idea**: Adam's state shared out, the
#   updated parameters broadcast; `consolidate_state_dict` gathers it to save.
# - **A state dict comes in two forms**, the shards' `DTensor`s and the gathered whole;
#   a distributed checkpoint saves the shards and loads on another number of ranks.
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
