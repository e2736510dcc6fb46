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
# # 10 DDP がうまくいかないとき: 集団通信の約束
#
# このレッスンを終えると、次のことができます。
#
# - 集団通信の約束 (全ランクが同じ集団通信を、同じ順に、同じ形で呼ぶ) を説明し、それを破ったランクを
#   `monitored_barrier`、スタック、Flight Recorder で突き止める
# - 食い違う集団通信を `TORCH_DISTRIBUTED_DEBUG=DETAIL` で見つけ、それでも見つからない食い違いを知る
# - 順伝播で使われないパラメータを見つけ、`find_unused_parameters=True` と `static_graph=True` を使い分ける
#
# 失敗は 2 つのランクでわざと起こします (タグ `raises-exception` のセル)。集団通信は 3 秒で時間切れに
# します (gloo の既定は 30 分)。

# %% [markdown] lang="en" tags=["outcomes"]
# # 10 When DDP goes wrong: the collective contract
#
# After this lesson you can:
#
# - state the collective contract (every rank calls the same collectives, in the same
#   order, on the same shapes) and find the rank that breaks it, with
#   `monitored_barrier`, a stack dump and the Flight Recorder;
# - find collectives that differ with `TORCH_DISTRIBUTED_DEBUG=DETAIL`, and know the
#   mismatch it misses;
# - find the parameters the forward pass does not use, and choose between
#   `find_unused_parameters=True` and `static_graph=True`.
#
# Failures are caused on purpose on two ranks (cells tagged `raises-exception`);
# collectives time out after 3 s (gloo's default is 30 minutes).

# %%
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %%
from labkit import cluster

ranks = cluster.start(2, timeout_s=3)  # a collective waits 3 s at most

# %% [markdown] lang="ja"
# ## 一部のランクだけが呼ぶ集団通信
#
# `all_reduce` や `barrier` のような集団通信は、**すべてのランクが同じ順に呼ぶ**約束です。よくある間違いは、
# 「表示はランク 0 だけで」のつもりで、集団通信まで `if rank == 0:` の中に入れることです。
#
# **予想してから実行:** 次のセルでは、どのランクが、どうなるでしょうか?

# %% [markdown] lang="en"
# ## A collective that only some ranks call
#
# Collectives such as `all_reduce` and `barrier` come with a contract: **every rank calls
# them, in the same order**. A common mistake is to mean "print on rank 0 only" and put
# the collective under `if rank == 0:` as well.
#
# **Predict, then run:** which rank fails in the next cell, and how?

# %% tags=["raises-exception"]
# %%px
import torch
import torch.distributed as dist

from labkit import compare

loss = torch.tensor([1.0 + rank])  # this rank's loss
if rank == 0:  # "print the mean loss once", but the all_reduce went in too
    dist.all_reduce(loss)
    print(f"mean loss {loss.item() / world_size:.2f}")

# %% tags=["hide-input"]
failed = ranks.last_failure
print("failed on ranks:", sorted(failed))
assert sorted(failed) == [0]  # rank 1 skipped the call and finished
assert "Timed out waiting 3000ms" in failed[0]  # rank 0 waited for it, 3 s

# %% [markdown] lang="ja"
# 直し方は、集団通信を全ランクで呼び、表示だけをランク 0 に残すことです。

# %% [markdown] lang="en"
# The fix: every rank calls the collective; only the printing stays on rank 0.

# %%
# %%px
loss = torch.tensor([1.0 + rank])
dist.all_reduce(loss)  # every rank
if rank == 0:
    print(f"mean loss {loss.item() / world_size:.2f}")

# %% tags=["hide-input"]
# %%px
assert loss.item() == 3.0

# %% [markdown] lang="ja"
# ### どのランクが来ていないかを知る
#
# 時間切れのメッセージからは、どのランクが来なかったかはわかりません。疑わしい場所の前に
# `dist.monitored_barrier` を置くと、ランク 0 が来なかったランクの番号を示します (gloo だけで使えます)。

# %% [markdown] lang="en"
# ### Which rank is missing
#
# The timeout message does not say which rank is missing. Put `dist.monitored_barrier`
# before the suspect: rank 0 names the ranks that do not arrive (gloo only).

# %% tags=["raises-exception"]
# %%px
from datetime import timedelta

if rank == 0:
    dist.monitored_barrier(timeout=timedelta(seconds=2))  # debugging: who got here?
    dist.all_reduce(loss)

# %% tags=["hide-input"]
print(next(line for line in ranks.last_failure[0].splitlines() if "monitoredBarrier" in line))
assert sorted(ranks.last_failure) == [0]
assert "Rank 1 failed to pass monitoredBarrier in 2000 ms" in ranks.last_failure[0]

# %% [markdown] lang="ja"
# ### 各ランクがどこで待っているかを見る
#
# 止まったプロセスがどこで待っているかは、ターミナルから `py-spy dump --pid PID`
# ([py-spy](https://github.com/benfred/py-spy)) で Python のスタックを表示すればわかります。ここでは
# ランク 1 がランク 0 に向けて実行します。
#
# <details><summary>測り方の詳細</summary>
#
# py-spy はほかのプロセスのメモリを読むので、macOS と、Yama の ptrace 制限を有効にした Linux
# (多くのディストリビューションの既定) では `sudo` が必要です
# ([Python の説明](https://docs.python.org/ja/3/howto/remote_debugging.html#permission-requirements))。
# 実行できなかったときは、labkit がランク 0 に書き出させたスタック (`stalls.process_stacks`) を代わりに
# 表示します (SIGUSR1 のない Windows では、表示できないことだけを示します)。
#
# </details>

# %% [markdown] lang="en"
# ### Where each rank waits
#
# `py-spy dump --pid PID` ([py-spy](https://github.com/benfred/py-spy)), run from a
# terminal, prints the Python stack where a stuck process waits. Here rank 1 runs it on
# rank 0.
#
# <details><summary>How this was measured</summary>
#
# py-spy reads another process's memory: on macOS, and on Linux with Yama's ptrace
# restrictions (the default of many distributions), that needs `sudo`
# ([Python's guide](https://docs.python.org/3/howto/remote_debugging.html#permission-requirements)).
# Where it is refused, the cell shows instead the stack labkit asks rank 0 to write out
# (`stalls.process_stacks`; Windows has no SIGUSR1 to ask with, and the cell says so).
#
# </details>

# %% tags=["raises-exception"]
# %%px
import os
import time

import labkit
from labkit.cluster import stalls

pids = [None] * world_size
dist.all_gather_object(pids, os.getpid())  # every rank's process id
if rank == 0:
    dist.all_reduce(loss)  # waits for rank 1, which never calls it
else:
    for _ in range(20):  # look until rank 0 is inside the all_reduce
        time.sleep(0.1)
        spy = stalls.py_spy_dump(pids[0])  # runs py-spy dump --pid PID
        if spy.returncode != 0 or "all_reduce" in spy.stdout:
            break
    if spy.returncode == 0:
        stack = spy.stdout  # the main thread comes first
    elif stalls.can_dump_stacks():  # py-spy refused or missing: labkit's dump
        print(spy.stderr.strip(), "\n-> labkit's own stack dump instead:\n")
        stack = stalls.process_stacks(pids[0], wait_s=1.0) or ""
        stack = stack[stack.index("Current thread"):]  # the main thread
    else:  # and no SIGUSR1 to ask rank 0 with (Windows)
        print(spy.stderr.strip(), "\n->", labkit.t("no_stack_dumps", pid=pids[0]))
        stack = None
    if stack is not None:
        print(stack[:stack.index("\n", stack.index("<module>"))])  # down to the cell's line
        assert "all_reduce" in stack.split("<module>")[0]

# %% tags=["hide-input"]
print(sorted(ranks.last_failure))
assert sorted(ranks.last_failure) == [0]  # rank 0 timed out; rank 1 saw it in all_reduce

# %% [markdown] lang="ja"
# ランク 1 の出力では、ランク 0 のメインスレッドの一番上が `all_reduce` で、その下がセルの行です。

# %% [markdown] lang="en"
# In rank 1's output, rank 0's main thread has `all_reduce` on top, the cell's line below.

# %% [markdown] lang="ja"
# ### Flight Recorder: 各ランクが入った集団通信の記録
#
# torch は各ランクが呼んだ集団通信を記録しています (Flight Recorder。gloo でも、設定なしで直近 2,000 件)。
# 上でハングしたあとの記録の最後を並べると、どのランクがどこまで来たかがわかります。

# %% [markdown] lang="en"
# ### Flight Recorder: the collectives each rank entered
#
# torch records the collectives each rank calls (the Flight Recorder, also with gloo:
# the last 2,000 without any setting). The ends of the ranks' records after the hang
# above show how far each rank got.

# %%
# %%px
import json


def fr_entries(after=-1):
    """This rank's Flight Recorder entries after record `after` (a private API)."""
    entries = json.loads(torch._C._distributed_c10d._dump_fr_trace_json())["entries"]
    return [e for e in entries if e["record_id"] > after]


last = fr_entries()[-1]  # the last collective this rank entered
recent = [(e["collective_seq_id"], e["profiling_name"]) for e in fr_entries()
          if e["pg_id"] == last["pg_id"]][-5:]  # numbered per process group
print(f"rank {rank}: #{last['collective_seq_id']} {last['profiling_name']} "
      f"{last['input_sizes']}")

# %% tags=["hide-input"]
# %%px
assert "TORCH_FR_BUFFER_SIZE" not in os.environ  # on by default
if rank == 0:
    assert last["profiling_name"] == "gloo:all_reduce"

# %% [markdown] lang="ja"
# 2 つのランクの記録の終わりです。枠の番号で、ランク 0 だけが `gloo:all_reduce` に入っています。ランク 1 は
# そこに来なかったのです。

# %% [markdown] lang="en"
# The ends of the two ranks' records: at the framed number only rank 0 entered a
# collective, the `gloo:all_reduce` rank 1 never came to.

# %% tags=["hide-input"]
from labkit import diagrams

seqs = [entry["collective_seq_id"] for entry in ranks.pull("last")]
assert seqs[0] == seqs[1] + 1  # rank 0 entered one collective more: the all_reduce
recent = ranks.pull("recent")  # each rank's last 5 (number, name)
start = min(entries[-1][0] for entries in recent) - 2
window = [[e for e in entries if e[0] >= start] for entries in recent]
assert window[1] == window[0][:-1]  # the same up to rank 0's last: the all_reduce
assert window[0][-1][1] == "gloo:all_reduce"
fig = diagrams.sequences(window)

# %% [markdown] lang="ja"
# <details><summary>測り方の詳細</summary>
#
# torch 2.13 で gloo の記録を取り出す関数 (`torch._C._distributed_c10d._dump_fr_trace_json`) は非公開なので、
# 名前や形式は今後変わるかもしれません。torch の解析ツール (`torchfrtrace`、
# `torch.distributed.flight_recorder`) はこの判定を自動で行いますが、torch 2.13 の gloo の記録は読めません
# (グループ名が空のため。tests/test_troubleshooting.py が確かめます)。
#
# </details>

# %% [markdown] lang="en"
# <details><summary>How this was measured</summary>
#
# In torch 2.13 the function that reads gloo's record
# (`torch._C._distributed_c10d._dump_fr_trace_json`) is private: its name and format may
# change. torch's analyzer (`torchfrtrace`, in `torch.distributed.flight_recorder`) makes
# this judgement by itself, but cannot read torch 2.13's gloo records (their group name
# is empty; tests/test_troubleshooting.py checks both).
#
# </details>

# %% [markdown] lang="ja"
# ## ランクごとに食い違う集団通信
#
# 全ランクが呼んでいても、**同じ**集団通信かどうかを gloo は確かめません。ランク 0 が `all_reduce`、
# ランク 1 が `broadcast` を呼ぶと、時間切れまで両方が待ちます。

# %% [markdown] lang="en"
# ## Collectives that differ between ranks
#
# Even when every rank calls a collective, gloo does not check that it is **the same**
# one. With `all_reduce` on rank 0 and `broadcast` on rank 1, both wait until one times
# out.

# %% tags=["raises-exception"]
# %%px
def different_types():
    t = torch.ones(4)
    if rank == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=0)


different_types()

# %% tags=["hide-input"]
print(sorted(ranks.last_failure))
assert sorted(ranks.last_failure) == [0, 1]  # both waited
# The first to time out closes its connections: the other may then fail at once.
assert any("Timed out" in message for message in ranks.last_failure.values())

# %% [markdown] lang="ja"
# もっと悪いのは、エラーにならない食い違いです。ランク 0 が和 (`SUM`)、ランク 1 が最大値 (`MAX`) で
# `all_reduce` すると、どちらも正しく終わったように見えますが、gloo はテンソルを分けて別々のランクで集約
# するので、半分は和、半分は最大値になります。

# %% [markdown] lang="en"
# Worse are the mismatches that raise nothing. With `SUM` on rank 0 and `MAX` on rank 1,
# both ranks seem to finish fine, but gloo reduces each part of the tensor on another
# rank, so half of it is summed and half maxed.

# %%
# %%px
def sum_against_max():
    t = torch.tensor([1.0, 2.0, 3.0, 4.0]) * (1 + 9 * rank)  # rank 1: [10, 20, 30, 40]
    dist.all_reduce(t, op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)
    print(f"rank {rank}: {t.tolist()}")
    return t


t = sum_against_max()

# %% tags=["hide-input"]
# %%px
assert t.tolist() == [11.0, 22.0, 30.0, 40.0]  # first half summed, second half maxed
assert compare.rank_max_diff(t) == 0  # and both ranks agree on it: nothing looks wrong

# %% tags=["hide-input"]
after = [x.tolist() for x in ranks.pull("t")]
assert after == [[11.0, 22.0, 30.0, 40.0]] * 2
fig = diagrams.collectives({labkit.t("values_before"): [[1, 2, 3, 4], [10, 20, 30, 40]],
                            "SUM (rank 0) / MAX (rank 1)": after},
                           fmt="{:.0f}")

# %% [markdown] lang="ja"
# ### `TORCH_DISTRIBUTED_DEBUG=DETAIL`
#
# `TORCH_DISTRIBUTED_DEBUG=DETAIL` では、torch が集団通信のたびに全ランクのフィンガープリント (何番目の
# 呼び出しか、種類、テンソルの形と型) を比べ、食い違えば両方の呼び出しを示してエラーにします。動いている
# ランクには環境変数を読み直させ、プロセスグループを作り直します。

# %% [markdown] lang="en"
# ### `TORCH_DISTRIBUTED_DEBUG=DETAIL`
#
# Under `TORCH_DISTRIBUTED_DEBUG=DETAIL`, torch compares a fingerprint of every
# collective across ranks (sequence number, type, tensor shapes and dtypes) and raises
# on a mismatch, naming both calls. Running ranks re-read the variable, and the process
# group is made again.

# %%
# %%px
os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
dist.set_debug_level_from_env()  # torch read the variable at import: read it again

# %%
ranks.reset_process_group()  # a new group, wrapped by torch's debug checks

# %% tags=["raises-exception"]
# %%px
t = torch.ones(4 + rank)  # rank 0: 4 values, rank 1: 5
dist.all_reduce(t)

# %% tags=["hide-input"]
# Whichever rank's check sees it first reports it.
message = next(m for m in ranks.last_failure.values() if "Detected mismatch" in m)
print(message[message.index("Detected mismatch"):][:400])
assert "Detected mismatch between collectives on ranks" in message
assert "TensorShape=[4]" in message and "TensorShape=[5]" in message

# %% [markdown] lang="ja"
# 形が違うと、素の gloo ではプロセス自体が異常終了します (`gloo::EnforceNotMet`)。`DETAIL` では、
# 食い違いを示すエラーで止まり、プロセスは生き残ります。種類の食い違いも同じです。

# %% [markdown] lang="en"
# With different shapes, plain gloo ends the process itself (`gloo::EnforceNotMet`).
# Under `DETAIL` the ranks raise an error naming both calls, and live on; so for a
# mismatch of types.

# %% tags=["raises-exception"]
# %%px
different_types()

# %% tags=["hide-input"]
message = next(m for m in ranks.last_failure.values() if "Detected mismatch" in m)
print(message[message.index("Detected mismatch"):][:300])
assert "OpType=ALLREDUCE" in message and "BROADCAST" in message

# %% [markdown] lang="ja"
# それでも、和と最大値の食い違いは `DETAIL` でも見つかりません。フィンガープリントに演算の種類 (`op`) が
# 入っていないからです。調べ終わったら `DETAIL` を外します (CPU では、`DETAIL` のまま DDP のモデルを作ると
# プロセスが落ちます)。

# %% [markdown] lang="en"
# Yet even `DETAIL` does not catch the sum-against-maximum mix: the fingerprint has no
# reduce op. Turn `DETAIL` off when done (on the CPU, building a DDP model under `DETAIL`
# crashes the process).

# %% tags=["hide-input"]
# %%px
assert sum_against_max().tolist() == [11.0, 22.0, 30.0, 40.0]  # no error under DETAIL

# %%
# %%px
os.environ.pop("TORCH_DISTRIBUTED_DEBUG")
dist.set_debug_level_from_env()

# %%
ranks.reset_process_group()  # a plain group again

# %% [markdown] lang="ja"
# ## 順伝播で使われないパラメータ
#
# DDP は、勾配がそろったバケットから all-reduce します (レッスン 05)。順伝播で使われないパラメータには
# 勾配ができないので、そのバケットはいつまでもそろいません。次のモデルの `aux` がそれです (途中で切り替える
# 補助の出力などで起きます)。`TORCH_DISTRIBUTED_DEBUG=INFO` なら、DDP のエラーにパラメータの名前が入ります。

# %% [markdown] lang="en"
# ## Parameters the forward pass does not use
#
# DDP all-reduces a bucket once all its gradients are ready (lesson 05). A parameter the
# forward pass does not use gets no gradient, so its bucket is never ready. Below, `aux`
# is such a head (common with auxiliary outputs switched on and off). With
# `TORCH_DISTRIBUTED_DEBUG=INFO`, DDP's errors name the parameters.

# %%
# %%px
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class TwoHeads(nn.Module):
    """A body and a head, and an auxiliary head this forward pass never uses."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(10, 16)
        self.head = nn.Linear(16, 10)
        self.aux = nn.Linear(16, 10)
        self.use_aux = False  # switched on later in training, say

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.head(h) + (self.aux(h) if self.use_aux else 0)  # aux: unused


os.environ["TORCH_DISTRIBUTED_DEBUG"] = "INFO"  # parameter names in DDP's errors
dist.set_debug_level_from_env()
torch.manual_seed(0)  # the same weights on both ranks
model = DDP(TwoHeads())
X, y = torch.randn(8, 10) + rank, torch.randn(8, 10)  # each rank its own batch
nn.functional.mse_loss(model(X), y).backward()  # the first step: no error...

# %% tags=["hide-input"]
# %%px
got_grad = [(name, p.grad is not None) for name, p in model.module.named_parameters()]
spread = compare.rank_max_diff(model.module.head.weight.grad)
print(f"rank {rank}: head.weight.grad differs between the ranks by {spread:.3f}")
assert spread > 0.01  # ...but the gradients were never averaged

# %% [markdown] lang="ja"
# 1 回目はエラーになりませんが、勾配は平均されずランクごとに違ったままで、このまま `step` すればレプリカが
# ずれます。エラーは次の順伝播で出ます。

# %% [markdown] lang="en"
# The first step raises nothing, yet the gradients were never averaged: a `step` now
# would make the replicas drift apart. The error comes with the next forward pass.

# %% tags=["raises-exception"]
# %%px
nn.functional.mse_loss(model(X), y).backward()

# %% tags=["hide-input"]
message = ranks.last_failure[0]
print(message[message.index("Expected to have finished"):][:160], "...")
print(*(line for line in message.splitlines() if line.startswith("Parameter")), sep="\n")
assert sorted(ranks.last_failure) == [0, 1]
assert "Expected to have finished reduction in the prior iteration" in message
assert "Parameters which did not receive grad for rank 0: aux.bias, aux.weight" in message
assert "Parameter indices which did not receive grad for rank 0: 4 5" in message

# %% [markdown] lang="ja"
# 4 と 5 は `model.parameters()` の中の番号です。下の図は、1 回目の逆伝播のあと各ランクが自分の `.grad` を
# 調べた結果で、枠の行が DDP のエラーが挙げたパラメータです。

# %% [markdown] lang="en"
# 4 and 5 are positions in `model.parameters()`. Below, what each rank found in its own
# `.grad` after the first backward: the framed rows are the parameters DDP's error names.

# %% tags=["hide-input"]
from labkit import diagrams

got_grad = ranks.pull("got_grad")  # each rank's (name, got a gradient), in order
for r, pairs in enumerate(got_grad):
    missing = [i for i, (_, got) in enumerate(pairs) if not got]
    names = ", ".join(sorted(pairs[i][0] for i in missing))
    # what this rank's own .grad says is what DDP's error on this rank names
    lines = ranks.last_failure[r].splitlines()
    assert f"Parameters which did not receive grad for rank {r}: {names}" in lines
    assert (f"Parameter indices which did not receive grad for rank {r}: "
            f"{' '.join(map(str, missing))}") in lines
assert got_grad[0] == got_grad[1] and names == "aux.bias, aux.weight"
fig = diagrams.gradients(got_grad)

# %% [markdown] lang="ja"
# ### 演習: 使われないパラメータを見つける
#
# DDP に包む前に使う関数 `unused_parameters(model, X)` を書いてください。`model` を入力 `X` で 1 回順伝播・逆伝播し (損失は出力の和で十分です)、勾配が
# できなかったパラメータの名前 (`model.named_parameters()` の名前) を並べ替えたリストで返します。確認の
# セルはいくつかのモデルで試します。モデルには、前の学習の勾配が残っていることがあります。

# %% [markdown] lang="en"
# ### Exercise: find the unused parameters
#
# Write `unused_parameters(model, X)`, to use before wrapping a model in DDP: run `model` once, forward and backward, on `X` (the sum
# of the output will do as a loss) and return the sorted names (as in
# `model.named_parameters()`) of the parameters that got no gradient. The check tries
# several models; a model may still hold gradients from earlier training.

# %% tags=["exercise"]
import torch


def unused_parameters(model, X):
    """Sorted names of the parameters that get no gradient from one step on X."""
    return None  # TODO: one forward and backward, then look at each parameter's .grad

# %% tags=["solution"]
def unused_parameters(model, X):
    """Sorted names of the parameters that get no gradient from one step on X."""
    model.zero_grad(set_to_none=True)  # gradients left from earlier would hide them
    model(X).sum().backward()
    return sorted(name for name, p in model.named_parameters() if p.grad is None)

# %%
from labkit import exercises

exercises.grade_unused_parameters(unused_parameters)

# %% [markdown] lang="ja"
# ### 直し方: `find_unused_parameters=True` と `static_graph=True`
#
# `find_unused_parameters=True` では、DDP は順伝播のたびに計算グラフをたどり、使われなかったパラメータを
# 「勾配がそろった」ことにします。勾配は全体のバッチで 1 プロセスが計算したものと一致し、使われない
# パラメータの勾配は `None` のままです。ただし、それも 0 として all-reduce されます。

# %% [markdown] lang="en"
# ### Fixes: `find_unused_parameters=True` and `static_graph=True`
#
# With `find_unused_parameters=True`, DDP walks the autograd graph after every forward
# pass and marks the unused parameters as ready. The gradients equal those of one
# process on the whole batch, and the unused ones stay `None`; they are still
# all-reduced, as zeros.

# %%
# %%px
from labkit import comm_counting

os.environ.pop("TORCH_DISTRIBUTED_DEBUG")
dist.set_debug_level_from_env()
torch.manual_seed(0)
model = DDP(TwoHeads(), find_unused_parameters=True)
counter = comm_counting.CommCounter().attach(model)
for _ in range(2):  # the second step is where it failed before
    model.zero_grad()
    counter.reset()
    nn.functional.mse_loss(model(X), y).backward()

every = [None] * world_size
dist.all_gather_object(every, (X, y))  # every rank's batch, for the check below

# %% tags=["hide-input"]
# %%px
torch.manual_seed(0)
alone = TwoHeads()  # the same weights, one process, the whole batch
nn.functional.mse_loss(alone(torch.cat([b[0] for b in every])),
                       torch.cat([b[1] for b in every])).backward()
used = ["body.weight", "body.bias", "head.weight", "head.bias"]
grads, reference = dict(model.module.named_parameters()), dict(alone.named_parameters())
diff = compare.max_abs_diff([grads[n].grad for n in used], [reference[n].grad for n in used])
print(f"rank {rank}: |DDP - one process| {diff:.1e}; aux.weight.grad {grads['aux.weight'].grad}; "
      f"{counter.bytes} bytes all-reduced per step")
assert diff < 1e-6 and grads["aux.weight"].grad is None
assert counter.bytes == 4 * sum(p.numel() for p in model.parameters())  # aux's zeros too

# %% [markdown] lang="ja"
# その代わり、`find_unused_parameters=True` は毎ステップ、どのパラメータが使われたかの表 (パラメータ 1 つに
# 整数 1 つ) も all-reduce します。使われないパラメータが毎回同じなら、
# `static_graph=True` で「グラフは毎回同じ」と約束すると、DDP は最初のステップで調べたことを使い回します。
#
# **予想してから実行:** 最初の数ステップのあと、1 ステップの all-reduce はそれぞれ何回でしょうか?

# %% [markdown] lang="en"
# In return, `find_unused_parameters=True` also all-reduces, every step, the map of
# which parameters were used (one integer per parameter). When the unused parameters
# are always the same, `static_graph=True` promises DDP that the graph never changes,
# and DDP reuses what it found at the first step.
#
# **Predict, then run:** after the first few steps, how many all-reduces does one step
# make under each?

# %%
# %%px
def train_step(m):
    m.zero_grad()
    nn.functional.mse_loss(m(X), y).backward()


calls = {}
for flag in ("find_unused_parameters", "static_graph"):
    torch.manual_seed(0)
    model = DDP(TwoHeads(), **{flag: True})
    for _ in range(4):  # the last step is past the first steps' extra work
        start = fr_entries()[-1]["record_id"]
        train_step(model)
    calls[flag] = [(e["profiling_name"], e["input_dtypes"][0]) for e in fr_entries(start)]
    assert model.module.aux.weight.grad is None
    assert compare.rank_max_diff(model.module.head.weight.grad) == 0

# %% tags=["hide-input"]
# %%px
if rank == 0:
    print(calls)
assert calls["find_unused_parameters"] == [("gloo:all_reduce", "Float"),  # gradients
                                           ("gloo:all_reduce", "Int")]  # the map
assert calls["static_graph"] == [("gloo:all_reduce", "Float")]

# %% [markdown] lang="ja"
# `static_graph=True` は、使われるパラメータが途中で変わるモデルには使えません。torch がエラーにします。

# %% [markdown] lang="en"
# `static_graph=True` does not suit a model whose used parameters change during
# training: torch raises.

# %% tags=["raises-exception"]
# %%px
model.module.use_aux = True  # the graph changes: aux is used from now on
train_step(model)

# %% tags=["hide-input"]
message = ranks.last_failure[0]
print(message[message.index("Your training graph"):][:160], "...")
assert "Your training graph has changed in this iteration" in message

# %%
ranks.stop()
assert cluster.current() is None

# %% [markdown] lang="ja"
# ## 症状、原因、直し方
#
# | 症状 | 原因 | 調べ方 | 直し方 |
# |---|---|---|---|
# | 止まる (時間切れ) | 一部のランクだけが集団通信を呼ぶ | `dist.monitored_barrier`、スタック、Flight Recorder | 集団通信は全ランクで呼び、表示だけをランク 0 に |
# | 止まる、落ちる、黙って値が違う | ランクごとに違う集団通信 | `TORCH_DISTRIBUTED_DEBUG=DETAIL` (演算の種類は見ない) | 全ランクで同じ順に同じ集団通信を |
# | 2 回目の順伝播でエラー | 順伝播で使われないパラメータ | エラーの番号 (`INFO` なら名前)、1 プロセスで `.grad` が `None` のもの | `find_unused_parameters=True`、いつも同じなら `static_graph=True` |

# %% [markdown] lang="en"
# ## Symptom, cause, fix
#
# | symptom | cause | how to find it | fix |
# |---|---|---|---|
# | a hang (then a timeout) | a collective that only some ranks call | `dist.monitored_barrier`, the stacks, the Flight Recorder | call collectives on every rank, print on rank 0 only |
# | a hang, a dead process, or silently wrong values | collectives that differ between ranks | `TORCH_DISTRIBUTED_DEBUG=DETAIL` (not the reduce op) | the same collectives, in the same order, on every rank |
# | an error at the second forward | parameters the forward pass does not use | the error's indices (names with `INFO`); in one process, `.grad` left `None` | `find_unused_parameters=True`; `static_graph=True` when always the same |

# %% [markdown] lang="ja" tags=["summary"]
# ## 覚えておくこと
#
# - **全ランクが同じ集団通信を同じ順に呼ぶ**約束で、`if rank == 0:` の中の集団通信はランク 0 を止め、
#   ランクごとに違う演算はどの確認にもかからない間違った値を出すことがあります。
# - **約束を破ったランクと呼び出しは道具で突き止めます**。来ないランクは `dist.monitored_barrier`、待つ場所は
#   スタック、どこまで来たかは Flight Recorder、形や種類の食い違いは `TORCH_DISTRIBUTED_DEBUG=DETAIL` です。
# - **順伝播で使われないパラメータがあると**、1 回目の勾配は平均されずに 2 回目でエラーになり、
#   `find_unused_parameters=True` は毎ステップ費用を払って、グラフが変わらないなら `static_graph=True` は
#   最初の 1 回で、これを直します。

# %% [markdown] lang="en" tags=["summary"]
# ## What to remember
#
# - **Every rank calls the same collectives in the same order**: a collective under
#   `if rank == 0:` hangs rank 0, and a different reduce op on each rank can give wrong
#   values that no check catches.
# - **Tools find the rank and the call that broke the contract**: `dist.monitored_barrier`
#   (who is missing), a stack dump (where each waits), the Flight Recorder (how far each
#   got), `TORCH_DISTRIBUTED_DEBUG=DETAIL` (calls that differ in shape or type).
# - **A parameter the forward pass does not use** leaves the first step's gradients
#   unaveraged and raises at the second; `find_unused_parameters=True` fixes it at a cost
#   every step, `static_graph=True` once, when the graph never changes.

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

selfcheck.show("10_troubleshooting")

# %% tags=["self-check"]
# Your answers, "a", "b", "c" or "d" for each question; then run this cell.
my_answers = {1: None, 2: None, 3: None}
selfcheck.check("10_troubleshooting", my_answers)
