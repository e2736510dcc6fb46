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
# # 10 DDP がうまくいかないとき: ハング、食い違い、使われないパラメータ、不揃いな入力、チェックポイント
#
# このレッスンを終えると、次のことができます。
#
# - 集団通信の約束 (全ランクが同じ集団通信を同じ順に呼ぶ) を説明し、それを破ったランクや呼び出しを
#   `monitored_barrier`、スタックの表示、Flight Recorder、`TORCH_DISTRIBUTED_DEBUG` で突き止める
# - 順伝播で使われないパラメータを見つけ、`find_unused_parameters=True` と `static_graph=True` を使い分ける
# - ランクごとにバッチの数が違うエポックを `Join` で最後まで回し、`DistributedSampler` の水増しがあっても
#   正確な検証の指標を計算する
# - DDP でチェックポイントを保存して読み、torchrun が起動し直した学習をそこから続ける
#
# どの失敗も 2 つのランクでわざと起こし、エラーを読み、原因を突き止め、直し、直ったことを確かめます。
# 集団通信は 3 秒で時間切れにします (gloo の既定は 30 分)。失敗させるセルには `raises-exception` のタグが
# 付いているので、「すべてのセルを実行」はそこで止まりません。次のセルが、どのランクが何で失敗したか
# (`ranks.last_failure`) を確かめ、その次のセルはまた両方のランクで動きます。

# %% [markdown] lang="en" tags=["outcomes"]
# # 10 When DDP goes wrong: hangs, mismatches, unused parameters, uneven inputs, checkpoints
#
# After this lesson you can:
#
# - state the collective contract (every rank calls the same collectives in the same
#   order) and find the rank or the call that breaks it, with `monitored_barrier`, a
#   stack dump, the Flight Recorder and `TORCH_DISTRIBUTED_DEBUG`;
# - find the parameters a forward pass does not use, and choose between
#   `find_unused_parameters=True` and `static_graph=True`;
# - end an epoch whose ranks hold different numbers of batches with `Join`, and compute
#   a validation metric that is exact despite `DistributedSampler`'s padding;
# - save and load a checkpoint under DDP, and go on from it after torchrun restarts a
#   run.
#
# Each failure is caused on purpose on two ranks: break it, read the error, find the
# cause, fix it, check the fix. Collectives time out after 3 s here (gloo's default is
# 30 minutes). The cells that fail on purpose are tagged `raises-exception`, so "Run All
# Cells" does not stop at them; the cell after each checks which rank failed and how
# (`ranks.last_failure`), and the next one runs on both ranks again.

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
# 「表示はランク 0 だけで」のつもりで、集団通信まで `if rank == 0:` の中に入れることです (バッファを持つ
# DDP のモデルの順伝播も集団通信です。レッスン 08)。ランク 1 は呼ばずに先へ進み、ランク 0 は来ない
# 相手を待ち続けます。
#
# **予想してから実行:** 次のセルでは、どのランクが、どうなるでしょうか?

# %% [markdown] lang="en"
# ## A collective that only some ranks call
#
# Collectives such as `all_reduce` and `barrier` come with a contract: **every rank calls
# them, in the same order**. A common mistake is to mean "print on rank 0 only" and put
# the collective under `if rank == 0:` as well (the forward pass of a DDP model with
# buffers is a collective too: lesson 08). Rank 1 skips the call and moves on; rank 0
# waits for a partner that never comes.
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

# %%
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
assert loss.item() == 3.0

# %% [markdown] lang="ja"
# ### どのランクが来ていないかを知る
#
# 時間切れのメッセージからは、どの集団通信にどのランクが来なかったのかはわかりません。疑わしい場所の前に
# `dist.monitored_barrier` を置くと、ランク 0 が全ランクの到着を確かめ、来なかったランクの番号を示します
# (gloo だけで使えます)。

# %% [markdown] lang="en"
# ### Which rank is missing
#
# The timeout message does not say which collective lacked which rank. Put
# `dist.monitored_barrier` before the suspect: rank 0 checks that every rank arrives
# and names those that do not (gloo only).

# %% tags=["raises-exception"]
# %%px
from datetime import timedelta

if rank == 0:
    dist.monitored_barrier(timeout=timedelta(seconds=2))  # debugging: who got here?
    dist.all_reduce(loss)

# %%
print(next(line for line in ranks.last_failure[0].splitlines() if "monitoredBarrier" in line))
assert sorted(ranks.last_failure) == [0]
assert "Rank 1 failed to pass monitoredBarrier in 2000 ms" in ranks.last_failure[0]

# %% [markdown] lang="ja"
# ### 各ランクがどこで待っているかを見る
#
# 止まったプロセスがどこで待っているかは、その Python のスタックでわかります。ターミナルから
# [`py-spy`](https://github.com/benfred/py-spy) の `py-spy dump --pid PID` を実行すれば表示されます。
# ここでは、呼ばなかったランク 1 が、待っているランク 0 に向けて実行します。
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
# Where a stuck process waits is in its Python stack:
# [`py-spy`](https://github.com/benfred/py-spy)'s `py-spy dump --pid PID`, run from a
# terminal, prints it. Here rank 1, which skipped the call, runs it on rank 0 while rank
# 0 waits.
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

# %%
print(sorted(ranks.last_failure))
assert sorted(ranks.last_failure) == [0]  # rank 0 timed out; rank 1 saw it in all_reduce

# %% [markdown] lang="ja"
# ランク 1 の出力では、ランク 0 のメインスレッドの一番上が `all_reduce` で、その下がセルの行です。
# これが「どの集団通信で待っているか」の答えです。

# %% [markdown] lang="en"
# In rank 1's output, rank 0's main thread has `all_reduce` on top and the cell's line
# below it: the collective it waits in.

# %% [markdown] lang="ja"
# ### Flight Recorder: 各ランクが入った集団通信の記録
#
# torch は、各ランクが呼んだ集団通信を記録しています (Flight Recorder。torch 2.13 では gloo でも、
# 設定しなくても直近 2,000 件を保持します)。各ランクの記録の最後を並べると、どのランクがどの集団通信まで
# 来たかがわかります。下のセルは、上でハングしたあとの記録を各ランクで読みます。

# %% [markdown] lang="en"
# ### Flight Recorder: the collectives each rank entered
#
# torch records the collectives each rank calls (the Flight Recorder; in torch 2.13 also
# with gloo, keeping the last 2,000 without any setting). Put the end of each rank's
# record side by side and you see how far each rank got. The cell below reads each
# rank's record after the hang above.

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
seqs = [None] * world_size
dist.all_gather_object(seqs, last["collective_seq_id"])
assert "TORCH_FR_BUFFER_SIZE" not in os.environ  # on by default
assert seqs[0] == seqs[1] + 1  # rank 0 entered one collective more: the all_reduce
if rank == 0:
    assert last["profiling_name"] == "gloo:all_reduce"

# %% [markdown] lang="ja"
# 2 つのランクの記録の終わりを並べます。枠の番号で、ランク 0 だけが集団通信に入っています。

# %% [markdown] lang="en"
# The ends of the two ranks' records side by side: at the framed number only rank 0
# entered a collective.

# %%
from labkit import diagrams

recent = ranks.pull("recent")  # each rank's last 5 (number, name)
start = min(entries[-1][0] for entries in recent) - 2
window = [[e for e in entries if e[0] >= start] for entries in recent]
assert window[1] == window[0][:-1]  # the same up to rank 0's last: the all_reduce
assert window[0][-1][1] == "gloo:all_reduce"
fig = diagrams.sequences(window)

# %% [markdown] lang="ja"
# ランク 0 の最後はランク 1 より 1 つ先の `gloo:all_reduce` です。ランク 1 はその集団通信に来なかった、
# ということです。
#
# <details><summary>測り方の詳細</summary>
#
# torch 2.13 で gloo の記録を取り出す関数 (`torch._C._distributed_c10d._dump_fr_trace_json`) は非公開なので、
# 名前や形式は今後変わるかもしれません。torch の解析ツール (`torchfrtrace`、
# `torch.distributed.flight_recorder`) はこの判定を自動で行いますが、torch 2.13 の gloo の記録は読めません
# (グループ名が空のため。tests/test_troubleshooting.py が確かめます)。
#
# </details>

# %% [markdown] lang="en"
# Rank 0's last entry is a `gloo:all_reduce` one ahead of rank 1's: rank 1 never came
# to that collective.
#
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
# 全ランクが呼んでいても、ランクごとに**違う**集団通信を呼ぶと、gloo はそれを確かめません。
# ランク 0 が `all_reduce`、ランク 1 が `broadcast` を呼ぶと、どちらかが時間切れになるまで両方が待ちます。

# %% [markdown] lang="en"
# ## Collectives that differ between ranks
#
# Even when every rank calls a collective, gloo does not check that they call **the
# same** one. With `all_reduce` on rank 0 and `broadcast` on rank 1, both wait until
# one times out.

# %% tags=["raises-exception"]
# %%px
def different_types():
    t = torch.ones(4)
    if rank == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=0)


different_types()

# %%
print(sorted(ranks.last_failure))
assert sorted(ranks.last_failure) == [0, 1]  # both waited
# The first to time out closes its connections: the other may then fail at once.
assert any("Timed out" in message for message in ranks.last_failure.values())

# %% [markdown] lang="ja"
# もっと悪いのは、エラーにならない食い違いです。ランク 0 が和 (`SUM`)、ランク 1 が最大値 (`MAX`) で
# `all_reduce` すると、どちらも正しく終わったように見えますが、結果は和でも最大値でもありません。
# gloo はテンソルを分けて別々のランクで集約 (リダクション) するので、半分は和、半分は最大値になります。

# %% [markdown] lang="en"
# Worse are the mismatches that raise nothing. With `SUM` on rank 0 and `MAX` on rank 1,
# both ranks seem to finish fine, but the result is neither the sum nor the maximum:
# gloo splits the tensor and reduces each part on another rank, so half of it is
# summed and half maxed.

# %%
# %%px
def sum_against_max():
    t = torch.tensor([1.0, 2.0, 3.0, 4.0]) * (1 + 9 * rank)  # rank 1: [10, 20, 30, 40]
    dist.all_reduce(t, op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)
    print(f"rank {rank}: {t.tolist()}")
    return t


t = sum_against_max()
assert t.tolist() == [11.0, 22.0, 30.0, 40.0]  # first half summed, second half maxed
assert compare.rank_max_diff(t) == 0  # and both ranks agree on it: nothing looks wrong

# %%
after = [x.tolist() for x in ranks.pull("t")]
assert after == [[11.0, 22.0, 30.0, 40.0]] * 2
fig = diagrams.collectives({"before": [[1, 2, 3, 4], [10, 20, 30, 40]],
                            "SUM (rank 0) / MAX (rank 1)": after}, fmt="{:.0f}")

# %% [markdown] lang="ja"
# ### `TORCH_DISTRIBUTED_DEBUG=DETAIL`
#
# デバッグ用の設定 `TORCH_DISTRIBUTED_DEBUG=DETAIL` では、torch がプロセスグループを包み、集団通信の
# たびに全ランクのフィンガープリント (何番目の呼び出しか、種類、テンソルの形と型) を比べ、食い違えば
# 両方の呼び出しを示してエラーにします。torch はこの環境変数を import したときに読むので、動いている
# ランクでは `dist.set_debug_level_from_env()` で読み直させ、プロセスグループを作り直します
# (包むのはグループを作るときです)。

# %% [markdown] lang="en"
# ### `TORCH_DISTRIBUTED_DEBUG=DETAIL`
#
# With the debugging setting `TORCH_DISTRIBUTED_DEBUG=DETAIL`, torch wraps the process
# group and, before every collective, compares a fingerprint of it across ranks (its
# sequence number, type, tensor shapes and dtypes); on a mismatch it raises, naming both
# calls. torch reads the variable when it is imported, so running ranks re-read it with
# `dist.set_debug_level_from_env()`, and the group is made again (the wrapping happens
# then).

# %%
# %%px
os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
dist.set_debug_level_from_env()
print(f"rank {rank}: {dist.get_debug_level()}")

# %%
ranks.reset_process_group()  # a new group, wrapped by torch's debug checks

# %% tags=["raises-exception"]
# %%px
t = torch.ones(4 + rank)  # rank 0: 4 values, rank 1: 5
dist.all_reduce(t)

# %%
# Whichever rank's check sees it first reports it.
message = next(m for m in ranks.last_failure.values() if "Detected mismatch" in m)
print(message[message.index("Detected mismatch"):][:400])
assert "Detected mismatch between collectives on ranks" in message
assert "TensorShape=[4]" in message and "TensorShape=[5]" in message

# %% [markdown] lang="ja"
# 形が違うと、素の gloo ではプロセス自体が異常終了します (`gloo::EnforceNotMet`。ノートブックなら
# エンジンが死にます。tests/test_troubleshooting.py が確かめます)。`DETAIL` では、どちらのランクも
# 食い違いを示すエラーで止まり、プロセスは生き残ります。種類の食い違いも同じです。

# %% [markdown] lang="en"
# With different shapes, plain gloo ends the process itself (`gloo::EnforceNotMet`; in
# a notebook the engine dies: tests/test_troubleshooting.py shows it). Under `DETAIL`
# the ranks raise an error that names both calls, and the processes live on. A
# mismatch of types is caught the same way.

# %% tags=["raises-exception"]
# %%px
different_types()

# %%
message = next(m for m in ranks.last_failure.values() if "Detected mismatch" in m)
print(message[message.index("Detected mismatch"):][:300])
assert "OpType=ALLREDUCE" in message and "BROADCAST" in message

# %% [markdown] lang="ja"
# それでも、和と最大値の食い違いは `DETAIL` でも見つかりません。フィンガープリントに演算の種類 (`op`) が
# 入っていないからです。調べ終わったら `DETAIL` を外します。torch 2.13 の CPU では、`DETAIL` のまま DDP の
# モデルを作るとプロセスが落ちます (セグメンテーション違反。テストで確かめています)。

# %% [markdown] lang="en"
# Yet even `DETAIL` does not catch the sum-against-maximum mix: the fingerprint has no
# reduce op. Turn `DETAIL` off when done: in torch 2.13 on the CPU, building a DDP model
# under `DETAIL` crashes the process (a segmentation fault; a test checks it).

# %%
# %%px
assert sum_against_max().tolist() == [11.0, 22.0, 30.0, 40.0]  # no error under DETAIL
os.environ.pop("TORCH_DISTRIBUTED_DEBUG")
dist.set_debug_level_from_env()
print(f"rank {rank}: {dist.get_debug_level()}")

# %%
ranks.reset_process_group()  # a plain group again

# %% [markdown] lang="ja"
# ## 順伝播で使われないパラメータ
#
# DDP は、勾配がそろったバケットから all-reduce します (レッスン 05)。順伝播で使われないパラメータには
# 勾配ができないので、そのパラメータを含むバケットはいつまでもそろいません。次のモデルの `aux` は、
# 作ってあるのに順伝播で使われない出力ヘッドです (学習の途中で切り替える補助の出力などでよく起きます)。
# DDP を作る前に `TORCH_DISTRIBUTED_DEBUG=INFO` にしておくと、DDP のエラーにパラメータの名前が入ります
# (`DETAIL` と違い、`INFO` では DDP を作れます)。

# %% [markdown] lang="en"
# ## Parameters the forward pass does not use
#
# DDP all-reduces a bucket once all its gradients are ready (lesson 05). A parameter the
# forward pass does not use gets no gradient, so its bucket is never ready. In the model
# below, `aux` is a head that is built but not used by the forward pass (common with
# auxiliary outputs switched on and off during training). With
# `TORCH_DISTRIBUTED_DEBUG=INFO` set before DDP is built, DDP's errors name the
# parameters (unlike `DETAIL`, `INFO` lets DDP be built).

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
spread = compare.rank_max_diff(model.module.head.weight.grad)
print(f"rank {rank}: head.weight.grad differs between the ranks by {spread:.3f}")
assert spread > 0.01  # ...but the gradients were never averaged

# %% [markdown] lang="ja"
# 1 回目はエラーになりません。ところが勾配はランクごとに違ったままです。平均されていないので、このまま
# `step` すればレプリカがずれます。エラーは次の順伝播で出ます。

# %% [markdown] lang="en"
# The first step raises nothing, yet the gradients still differ between ranks: they were
# never averaged, and a `step` now would make the replicas drift apart. The error comes
# with the next forward pass.

# %% tags=["raises-exception"]
# %%px
nn.functional.mse_loss(model(X), y).backward()

# %%
message = ranks.last_failure[0]
print(message[message.index("Expected to have finished"):][:160], "...")
print(*(line for line in message.splitlines() if line.startswith("Parameter")), sep="\n")
assert sorted(ranks.last_failure) == [0, 1]
assert "Expected to have finished reduction in the prior iteration" in message
assert "Parameters which did not receive grad for rank 0: aux.bias, aux.weight" in message
assert "Parameter indices which did not receive grad for rank 0: 4 5" in message

# %% [markdown] lang="ja"
# 4 と 5 は `model.parameters()` の中の番号です (`body` の重みとバイアスが 0 と 1、`head` が 2 と 3)。
# 名前が表示されるのは `INFO` のときだけです。

# %% [markdown] lang="en"
# 4 and 5 are positions in `model.parameters()` (`body`'s weight and bias are 0 and 1,
# `head`'s 2 and 3); the names come only with `INFO`.

# %% [markdown] lang="ja"
# ### 演習: 使われないパラメータを見つける
#
# DDP に包む前に、使われないパラメータを自分で探せます。1 プロセスでモデルを 1 回順伝播・逆伝播し、
# 勾配ができなかったパラメータを挙げればよいのです。関数 `unused_parameters(model, X)` を書いてください。
# `model` を入力 `X` で 1 回動かし (損失は出力の和で十分です)、勾配ができなかったパラメータの名前
# (`model.named_parameters()` の名前) を並べ替えたリストで返します。確認のセルは、いくつかのモデルで
# 試します。モデルには、前の学習の勾配が残っていることがあります。

# %% [markdown] lang="en"
# ### Exercise: find the unused parameters
#
# You can look for unused parameters yourself before wrapping a model in DDP: run it
# once, forward and backward, in one process, and list the parameters that got no
# gradient. Write `unused_parameters(model, X)`: run `model` once on `X` (the sum of the
# output will do as a loss) and return the sorted names (as in
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
# `find_unused_parameters=True` を渡すと、DDP は順伝播のたびに出力から計算グラフをたどり、使われなかった
# パラメータを「勾配がそろった」ことにします。勾配は、全体のバッチで 1 プロセスが計算したものと一致し、
# 使われないパラメータの勾配は `None` のままです。ただし、使われないパラメータも 0 として all-reduce
# されます (送るバイト数に入ります)。

# %% [markdown] lang="en"
# ### Fixes: `find_unused_parameters=True` and `static_graph=True`
#
# With `find_unused_parameters=True`, DDP walks the autograd graph from the output after
# every forward pass and marks the unused parameters as ready. The gradients equal those
# of one process on the whole batch, and the unused parameters' gradients stay `None`;
# the unused parameters are still all-reduced, as zeros (they count in the bytes sent).

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

torch.manual_seed(0)
alone = TwoHeads()  # the same weights, one process, the whole batch
every = [None] * world_size
dist.all_gather_object(every, (X, y))  # every rank's batch
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
# その代わり、`find_unused_parameters=True` は毎ステップ、グラフをたどり、どのパラメータが使われたかの表
# (パラメータ 1 つにつき整数 1 つ) も all-reduce します。この all-reduce は通信フック (`CommCounter`)
# には見えませんが、Flight Recorder には記録されます。使われないパラメータが毎回同じなら、
# `static_graph=True` で DDP に「グラフは毎回同じ」と約束すると、DDP は最初のステップで調べたことを
# 使い回します。
#
# **予想してから実行:** 最初の数ステップのあと、1 ステップの all-reduce はそれぞれ何回でしょうか?

# %% [markdown] lang="en"
# In return, `find_unused_parameters=True` walks the graph at every step and also
# all-reduces the map of which parameters were used (one integer per parameter): the
# comm hook (`CommCounter`) does not see that all-reduce, the Flight Recorder does. When
# the unused parameters are the same every time, `static_graph=True` promises DDP that
# the graph never changes, and DDP reuses what it found at the first step.
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

# %%
message = ranks.last_failure[0]
print(message[message.index("Your training graph"):][:160], "...")
assert "Your training graph has changed in this iteration" in message

# %% [markdown] lang="ja"
# ## ランクごとに数の違う入力
#
# ランクごとにバッチの数が違うと (データを手で分けた、ランクごとに長さの違う系列がある、など)、最後の
# バッチで困ります。ランク 0 が 5 個、ランク 1 が 4 個のバッチで学習すると、ランク 0 の 5 個目の
# 逆伝播は、もう来ないランク 1 の all-reduce を待ち、ランク 1 はエポックの終わりの `barrier` で
# 待ちます。両方とも時間切れになります。

# %% [markdown] lang="en"
# ## Ranks with different numbers of batches
#
# When ranks hold different numbers of batches (data split by hand, sequences of
# different lengths per rank, ...), the last batch is the trouble. With 5 batches on
# rank 0 and 4 on rank 1, rank 0's fifth backward pass waits for an all-reduce from
# rank 1 that never comes, while rank 1 waits in the `barrier` at the end of the epoch.
# Both time out.

# %% tags=["raises-exception"]
# %%px
from torch.distributed.algorithms.join import Join  # the fix, below

g = torch.Generator().manual_seed(rank)
batches = [(torch.randn(4, 10, generator=g), torch.randn(4, 10, generator=g))
           for _ in range(5 - rank)]  # rank 0: 5 batches, rank 1: 4
torch.manual_seed(0)
model = DDP(nn.Linear(10, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for X, y in batches:
    optimizer.zero_grad()
    nn.functional.mse_loss(model(X), y).backward()
    optimizer.step()
dist.barrier()  # the end of the epoch

# %%
failed = ranks.last_failure
print(sorted(failed))
assert sorted(failed) == [0, 1]
assert "backward" in failed[0] and "barrier" in failed[1]  # where each one waited

# %% [markdown] lang="ja"
# 直し方は、`Join` コンテキストマネージャです (`from torch.distributed.algorithms.join import Join`)。
# 入力を使い切ったランクは `Join` の中で待ち、まだ学習しているランクの all-reduce に 0 の勾配で加わります。

# %% [markdown] lang="en"
# The fix is the `Join` context manager (`from torch.distributed.algorithms.join import
# Join`). A rank that has run out of inputs waits inside `Join` and joins the others'
# all-reduces with zero gradients.

# %% [markdown] lang="ja"
# ### 演習: 不揃いなエポックを最後まで回す
#
# 関数 `train_epoch(model, optimizer, batches)` を書いてください。DDP のモデル `model` を、このランクの
# バッチ `batches` (入力と目標値の組のリスト) で 1 バッチ 1 ステップずつ学習させます (損失は
# `nn.functional.mse_loss`)。ランクごとにバッチの数が違っても、全ランクで最後まで終わるようにします。
# 確認のセルは、ランク 0 に 5 個、ランク 1 に 4 個のバッチを渡して両方のランクで実行し、終わったあとの重みを
# `Join` を使った正しい学習の重みと比べます。関数はランクのエンジンで実行されるので、中で使える名前は
# エンジンにあるもの (上の `%%px` セルで import した `torch`、`nn`、`Join` など) です。

# %% [markdown] lang="en"
# ### Exercise: an uneven epoch that ends
#
# Write `train_epoch(model, optimizer, batches)`: train the DDP model `model` on this
# rank's `batches` (a list of input and target pairs), one step per batch (the loss is
# `nn.functional.mse_loss`), so that the epoch ends on every rank even when the ranks
# hold different numbers of batches. The check runs it on both ranks, with 5 batches on
# rank 0 and 4 on rank 1, and compares the weights after it with those of a correct run
# with `Join`. The function runs on the ranks' engines, so the names it uses are the
# engines' (`torch`, `nn`, `Join`, imported there by the `%%px` cells above).

# %% tags=["exercise"]
def train_epoch(model, optimizer, batches):
    """One step per batch of this rank; must end on every rank, whatever the count."""
    for X, y in batches:  # TODO: the rank with fewer batches leaves the others waiting
        optimizer.zero_grad()
        nn.functional.mse_loss(model(X), y).backward()
        optimizer.step()

# %% tags=["solution"]
def train_epoch(model, optimizer, batches):
    """One step per batch of this rank; must end on every rank, whatever the count."""
    with Join([model]):  # a rank out of batches shadows the others' all-reduces
        for X, y in batches:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(X), y).backward()
            optimizer.step()

# %%
exercises.grade_uneven_epoch(ranks, train_epoch)

# %% [markdown] lang="ja"
# ### `Join` が計算するもの
#
# `Join` の中では、各ステップの勾配は、そのステップのバッチを持つランクの勾配の和を world size で割った
# ものです。ランク 1 が抜けたランク 0 の 5 ステップ目では、ランク 0 の勾配の半分です。下のセルはこれを、
# 1 プロセスで手で計算したものと比べます。`Join` の中では `no_sync` による勾配累積も使えます。2 バッチで
# 1 回の更新 (K = 2) にし、ランク 0 に 6 個のバッチを渡すと、ランク 0 の 3 回目の更新はランク 1 が抜けた
# あとで、`no_sync` の中の逆伝播と同期する逆伝播が続きます。これも手で計算したものと比べます。

# %% [markdown] lang="en"
# ### What `Join` computes
#
# Inside `Join`, each step's gradient is the sum of the gradients of the ranks that have
# a batch for it, divided by the world size: at rank 0's fifth step, without rank 1,
# half of rank 0's own. The cell below compares that with one process computing it by
# hand. Gradient accumulation with `no_sync` works inside `Join` too: with one update
# per 2 batches (K = 2) and 6 batches on rank 0, rank 0's third update comes after rank
# 1 has left, and runs a backward pass inside `no_sync`, then a synchronized one. That
# too is compared with the computation by hand.

# %%
# %%px
from contextlib import nullcontext


def joined(batches, K):
    """A fresh DDP model trained under Join, one update per K batches (no_sync)."""
    torch.manual_seed(0)
    model = DDP(nn.Linear(10, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([model]):
        for i in range(0, len(batches), K):
            optimizer.zero_grad()
            group = batches[i:i + K]
            for j, (X, y) in enumerate(group):
                with model.no_sync() if j < len(group) - 1 else nullcontext():
                    (nn.functional.mse_loss(model(X), y) / len(group)).backward()
            optimizer.step()
    return model


def by_hand(batches, K):
    """The same in one process: every rank's batches, a rank without any adds zeros."""
    every = [None] * world_size
    dist.all_gather_object(every, batches)
    torch.manual_seed(0)
    alone = nn.Linear(10, 10)
    optimizer = torch.optim.SGD(alone.parameters(), lr=0.1)
    for i in range(0, max(len(b) for b in every), K):
        optimizer.zero_grad()
        for group in (b[i:i + K] for b in every):
            for X, y in group:
                (nn.functional.mse_loss(alone(X), y) / len(group) / world_size).backward()
        optimizer.step()
    return alone


longer = batches + batches[:1] if rank == 0 else batches  # 6 and 4 batches
for K, mine in ((1, batches), (2, longer)):
    model = joined(mine, K)
    diff = compare.max_abs_diff(list(model.module.parameters()),
                                list(by_hand(mine, K).parameters()))
    print(f"rank {rank}, K = {K}: |Join - by hand| {diff:.1e}")
    assert diff < 1e-6 and compare.replica_max_diff(model) == 0

# %% [markdown] lang="ja"
# ### `DistributedSampler` の水増し
#
# `DistributedSampler` は、データセットの大きさがランクの数で割り切れないとき、**先頭のサンプルを
# 繰り返して**全ランクのサンプル数をそろえます。検証の指標を各ランクで平均し、さらにランク間で平均すると、
# その分だけ正しい値からずれます。
#
# **予想してから実行:** 9 サンプルを 2 ランクに分けると (`shuffle=False`)、ランク 1 はどのサンプルを
# 受け取るでしょうか?

# %% [markdown] lang="en"
# ### `DistributedSampler`'s padding
#
# When the data set's size does not divide by the number of ranks, `DistributedSampler`
# **repeats samples from the start** so that every rank gets as many. A validation
# metric averaged on each rank and then over the ranks is off by that much.
#
# **Predict, then run:** with 9 samples on 2 ranks (`shuffle=False`), which samples
# does rank 1 get?

# %%
# %%px
from torch.utils.data import DistributedSampler

scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])  # per sample: correct?
sampler = DistributedSampler(range(len(scores)), shuffle=False)
mine = scores[list(sampler)]  # this rank's samples, padding included
means = [torch.empty(1) for _ in range(world_size)]
dist.all_gather(means, mine.mean().reshape(1))
averaged = torch.cat(means).mean().item()
print(f"rank {rank}: samples {list(sampler)}")
if rank == 0:
    print(f"mean of the ranks' means {averaged:.4f}, exact {scores.mean().item():.4f}")
order = list(sampler)
assert order == ([0, 2, 4, 6, 8] if rank == 0 else [1, 3, 5, 7, 0])  # 0 twice
assert abs(averaged - scores.mean().item()) > 0.05

dropped = DistributedSampler(range(len(scores)), shuffle=False, drop_last=True)
order_dropped = list(dropped)
assert order_dropped == ([0, 2, 4, 6] if rank == 0 else [1, 3, 5, 7])  # 8: never
shuffled = DistributedSampler(range(len(scores)), shuffle=True, seed=1)
positions = [None] * world_size
dist.all_gather_object(positions, list(shuffled))
real = [i for r, mine in enumerate(positions) for k, i in enumerate(mine)
        if r + k * world_size < len(scores)]  # the padding rule below
assert sorted(real) == list(range(len(scores)))  # shuffled too: each sample once

# %% [markdown] lang="ja"
# 直し方は 2 つあります。`DistributedSampler(..., drop_last=True)` で余りを捨てる (捨てたサンプルは
# 評価されません) か、水増しのサンプルを除いて、和と個数を all-reduce することです。ランク r の k 番目
# (0 から数える) のサンプルは、`r + k × world_size` がデータセットの大きさ以上なら水増しです
# (シャッフルしても同じです)。

# %% [markdown] lang="en"
# There are two fixes: `DistributedSampler(..., drop_last=True)` drops the remainder (the
# dropped samples are never evaluated), or all-reduce sums and counts without the padding.
# The k-th sample (from 0) of rank r is padding when `r + k × world_size` is at least the
# data set's size (shuffled or not).

# %%
rows = {"DistributedSampler(9)": ranks.pull("order"),
        "drop_last=True": ranks.pull("order_dropped")}
padding = [("DistributedSampler(9)", r, k) for r, mine in enumerate(rows[
    "DistributedSampler(9)"]) for k in range(len(mine)) if r + k * 2 >= 9]
assert padding == [("DistributedSampler(9)", 1, 4)]  # rank 1's last: sample 0 again
fig = diagrams.collectives(rows, fmt="{:.0f}", shade=False, framed=padding,
                           title="sampler_title")

# %% [markdown] lang="ja"
# ### 演習: 正確な検証の指標
#
# 関数 `exact_mean(values, total)` を書いてください。`values` はこのランクの `DistributedSampler`
# の順のサンプルごとの値 (水増しを含む)、`total` はデータセットの大きさです。データセットの各サンプルを
# ちょうど 1 回ずつ数えた平均を、全ランクで同じ値として返します。全ランクが同時に呼ぶので、
# `dist.all_reduce` が使えます。確認のセルは、いくつかの大きさのデータセットで、1 プロセスで計算した平均と
# 比べます。確認は 2 ランクで行うので、水増しはいつもランク 1 の最後のサンプルです。場所ではなく、上の規則で
# 見分けてください (「最後のランクの最後のサンプルを除く」は、3 ランク以上では間違いですが、確認のセルは
# 正解とします)。

# %% [markdown] lang="en"
# ### Exercise: an exact validation metric
#
# Write `exact_mean(values, total)`. `values` holds this rank's per-sample values in
# `DistributedSampler`'s order (padding included); `total` is the data set's size.
# Return the mean over the data set, each sample counted exactly once, the same on every
# rank. Every rank calls it at the same time, so it can use `dist.all_reduce`. The check
# compares with the mean one process computes, for data sets of several sizes. It runs
# on 2 ranks, where the padding is always rank 1's last sample: tell it by the rule
# above, not by its place ("drop the last rank's last sample" is wrong on 3 ranks or
# more, yet passes the check).

# %% tags=["exercise"]
def exact_mean(values, total):
    """The mean over the whole data set, each sample once (every rank calls it)."""
    return values.mean()  # TODO: this rank's samples only, padding included

# %% tags=["solution"]
def exact_mean(values, total):
    """The mean over the whole data set, each sample once (every rank calls it)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    k = torch.arange(len(values))
    real = (rank + k * world_size) < total  # False for the padding
    sums = torch.stack([values[real].sum(), real.sum().to(values.dtype)])
    dist.all_reduce(sums)  # the sum and the count over all ranks
    return sums[0] / sums[1]

# %%
exercises.grade_exact_mean(ranks, exact_mean)

# %% [markdown] lang="ja"
# ## DDP でのチェックポイント
#
# DDP では全ランクが同じ重みを持つので、保存するのは 1 つのランク (ランク 0) だけで十分です。保存するのは
# `model.module.state_dict()` です。DDP そのものの `model.state_dict()` ではキーの先頭に `module.` が付き、
# DDP に包んでいないモデルには読み込めません。ほかのランクは `dist.barrier()` で保存の終わりを待ってから、
# `map_location` (テンソルを置くデバイス。ここでは CPU) を付けて読みます。フォルダはランク 0 が作り、
# その名前を全ランクに配ります。

# %% [markdown] lang="en"
# ## Checkpoints under DDP
#
# Under DDP every rank holds the same weights, so one rank (rank 0) writing is enough.
# Write `model.module.state_dict()`: the DDP wrapper's own `model.state_dict()` puts
# `module.` in front of every name and does not load into a model outside DDP. The other
# ranks wait at `dist.barrier()` until rank 0 is done, then read with `map_location`
# (the device the tensors go to: the CPU here). Rank 0 makes the folder and hands its
# name to every rank.

# %%
# %%px
import tempfile
from pathlib import Path

from labkit import checks

folder = [tempfile.mkdtemp(prefix="labkit-10-") if rank == 0 else None]
dist.broadcast_object_list(folder, src=0)  # one folder, the same on every rank
path = Path(folder[0]) / "checkpoint.pt"
torch.manual_seed(0)
model = DDP(TwoHeads(), find_unused_parameters=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def train(steps):
    for _ in range(steps):
        train_step(model)  # zero_grad, forward, backward
        optimizer.step()


def save(step):
    if rank == 0:  # one writer: every rank holds the same weights
        torch.save({"model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(), "step": step}, path)


train(10)
save(10)
dist.barrier()  # nobody reads before rank 0 has written
state = torch.load(path, map_location="cpu")
print(f"rank {rank}: step {state['step']}, keys {list(state['model'])[:2]} ...")
assert state["step"] == 10 and torch.equal(state["model"]["body.weight"],
                                           model.module.body.weight)
assert list(model.state_dict())[0] == "module.body.weight"  # the wrapper's names
with checks.expect_error(RuntimeError, match="Missing key"):
    TwoHeads().load_state_dict(model.state_dict())

# %% [markdown] lang="ja"
# `barrier` がないと、ランク 1 がランク 0 より先に読むことがあります。前のチェックポイントがあれば、
# ランク 1 は**エラーなしに古いほうを**読み、ほかのランクと違う重みから続けます。実際の学習では偶然起きる
# この順序を、ここでは `barrier` で作ります。

# %% [markdown] lang="en"
# Without the `barrier`, rank 1 may read before rank 0 has written. With an earlier
# checkpoint in place, rank 1 reads **the old one, without an error**, and goes on from
# other weights than the rest. Here a `barrier` forces the order that chance gives a real
# run.

# %%
# %%px
train(5)  # now at step 15
if rank == 1:
    early = torch.load(path, map_location="cpu")["step"]  # before rank 0 writes
dist.barrier()  # only to force that order here
save(15)
dist.barrier()  # the fix: every rank waits for the writer
late = torch.load(path, map_location="cpu")["step"]
if rank == 1:
    print(f"rank 1 read step {early} too early (no error), step {late} after the barrier")
    assert (early, late) == (10, 15)

# %% [markdown] lang="ja"
# ## 学習の途中で死ぬランク
#
# ランクのプロセスが途中で終わると (メモリ不足、ノードの故障)、ほかのランクは次の集団通信でエラーになります。
# labkit はどのランクのプロセスが死んだかを示し、次のセルの前にランクを起動し直します。新しいプロセス
# には、前に作ったものは何も残っていません。続きから学習するには、チェックポイントが要ります。

# %% [markdown] lang="en"
# ## A rank that dies mid-step
#
# When a rank's process ends mid-training (out of memory, a failed node), the other
# ranks fail in their next collective. labkit names the rank whose process died and
# starts the ranks again before the next cell. Nothing made before is left in the new
# processes: going on from where training was needs a checkpoint.

# %% tags=["raises-exception"]
# %%px
from labkit.cluster import launch

if rank == 1:
    launch.crash()  # SIGKILL to itself (os._exit where the system has no SIGKILL)
dist.all_reduce(torch.ones(1))

# %%
failed = ranks.last_failure
print({r: message.strip().splitlines()[-1][:120] for r, message in failed.items()})
assert "process died" in failed[1]

# %%
# %%px
print(f"rank {rank}: a new process, 'model' defined here: {'model' in globals()}")
assert "model" not in globals()

# %% [markdown] lang="ja"
# ノートブックを使わない学習 (クラスタのジョブなど) では、torchrun が起動し直します。`--max-restarts N` を
# 付けると、ランクのどれかが失敗したとき、全ランクを止めて N 回まで起動し直します。起動し直したランクは
# 最初から始まるので、チェックポイントから続けるのはスクリプトの仕事です。`python -m labkit resume` は、
# 上と同じやり方 (ランク 0 が一時ファイルに書いて名前を変え、全ランクが `barrier` で待つ) で 5 ステップ
# ごとに保存し、起動したときにチェックポイントがあれば読みます。`--die-at 12` では、最初の起動でランク 1 が
# ステップ 12 の前に自分を強制終了します。次のセルは torchrun でこれを 2 回、死なずに、そして死なせて
# 実行し、最後の重みのハッシュを比べます。
#
# **予想してから実行:** 起動し直した学習は、どのステップから続けるでしょうか?

# %% [markdown] lang="en"
# A run without a notebook (a job on a cluster) is restarted by torchrun. With
# `--max-restarts N`, when any rank fails, torchrun stops them all and starts them again,
# up to N times. Restarted ranks begin from the start, so going on from a checkpoint is
# the script's job. `python -m labkit resume` saves every 5 steps the way shown above
# (rank 0 writes a temporary file and renames it, every rank waits at a `barrier`), and
# loads the checkpoint if there is one when it starts. With `--die-at 12`, rank 1 kills
# itself before step 12 on the first attempt. The next cell runs it twice under
# torchrun, once without dying and once dying, and compares the final weights' hashes.
#
# **Predict, then run:** from which step does the restarted run go on?

# %%
import json
import tempfile
from pathlib import Path

from labkit.cluster import torchrun

ranks.stop()  # the CPUs go to torchrun's workers
resume = ["-m", "labkit", "resume", "--steps", "20", "--accum", "1",
          "--checkpoint-every", "5"]
runs = {}
with tempfile.TemporaryDirectory() as tmp:
    for name, dies in (("uninterrupted", []), ("restarted", ["--die-at", "12"])):
        nodes = torchrun.run_nodes(resume + dies + [
            "--checkpoint", f"{tmp}/{name}.pt", "--json", f"{tmp}/{name}.json"],
            nnodes=1, nproc_per_node=2, max_restarts=1)
        assert [n.returncode for n in nodes] == [0], nodes[0].output[-3000:]
        runs[name] = json.loads(Path(tmp, f"{name}.json").read_text())
a, b = runs["uninterrupted"], runs["restarted"]
# torchrun's agent reports the first failure it saw: rank 1, killed (-9), or rank 0,
# aborted by the broken connection (-6) or stopped by the agent (-15)
failures = [line for line in nodes[0].output.splitlines() if "failed (exitcode" in line]
print(failures[0][failures[0].index("failed"):])
for name, run in runs.items():
    print(f"{name:13s} {run['param_sha256'][:16]} (attempt {run['attempt']}, "
          f"from step {run['resumed_from']})")
assert a["config"] == b["config"] and (a["attempt"], a["resumed_from"]) == (0, 0)
assert (b["attempt"], b["resumed_from"]) == (1, 10)  # the checkpoint of step 10
assert b["param_sha256"] == a["param_sha256"]  # bit for bit the same weights

# %% [markdown] lang="ja"
# ## 症状、原因、直し方
#
# | 症状 | 原因 | 調べ方 | 直し方 |
# |---|---|---|---|
# | 止まる (時間切れ) | 一部のランクだけが集団通信を呼ぶ | `dist.monitored_barrier`、スタック、Flight Recorder | 集団通信は全ランクで呼び、表示だけをランク 0 に |
# | 止まる、プロセスが落ちる、黙って値が違う | ランクごとに違う集団通信 | `TORCH_DISTRIBUTED_DEBUG=DETAIL` (演算の種類は見ない) | 全ランクで同じ順に同じ集団通信を |
# | 2 回目の順伝播でエラー (1 回目の勾配は平均されない) | 順伝播で使われないパラメータ | エラーの番号、`INFO` なら名前。1 プロセスで勾配が `None` のもの | `find_unused_parameters=True`、いつも同じなら `static_graph=True` |
# | エポックの終わりで止まる | ランクごとにバッチの数が違う | 待っている場所 (逆伝播と `barrier`) | `Join` |
# | 検証の指標がずれる | `DistributedSampler` の水増し | ランクごとのサンプルの番号 | 水増しを除いて和と個数を all-reduce、または `drop_last=True` |
# | あるランクだけが古いチェックポイントから続ける (エラーなし) | ランク 0 が保存し終える前に読む | 読んだチェックポイントのステップ | ランク 0 だけが保存し、`barrier` のあとで全ランクが読む |
# | ランクのプロセスが死ぬ | メモリ不足、ノードの故障 | labkit が示すランク、torchrun の終了コード | torchrun の `--max-restarts` とチェックポイント |

# %% [markdown] lang="en"
# ## Symptom, cause, fix
#
# | symptom | cause | how to find it | fix |
# |---|---|---|---|
# | a hang (then a timeout) | a collective that only some ranks call | `dist.monitored_barrier`, the stacks, the Flight Recorder | call collectives on every rank, print on rank 0 only |
# | a hang, a dead process, or silently wrong values | collectives that differ between ranks | `TORCH_DISTRIBUTED_DEBUG=DETAIL` (not the reduce op) | the same collectives, in the same order, on every rank |
# | an error at the second forward (the first step's gradients not averaged) | parameters the forward pass does not use | the indices in the error, the names with `INFO`; in one process, the gradients that stay `None` | `find_unused_parameters=True`; `static_graph=True` when always the same |
# | a hang at the end of an epoch | ranks with different numbers of batches | where each rank waits (backward, `barrier`) | `Join` |
# | a validation metric that is off | `DistributedSampler`'s padding | each rank's sample indices | all-reduce sums and counts without the padding, or `drop_last=True` |
# | one rank goes on from an older checkpoint (no error) | reading before rank 0 has written | the step each rank read | rank 0 alone writes; every rank reads after a `barrier` |
# | a rank's process dies | out of memory, a failed node | the rank labkit names; torchrun's exit code | torchrun's `--max-restarts` and a checkpoint |

# %% [markdown] lang="ja" tags=["summary"]
# ## 覚えておくこと
#
# - **全ランクが同じ集団通信を同じ順に呼ぶ**約束で、`if rank == 0:` の中の集団通信はランク 0 を止め、
#   ランクごとに違う演算はどの確認にもかからない間違った値を出すことがあります。
# - **約束を破ったランクと呼び出しは道具で突き止め**、来ないランクは `dist.monitored_barrier`、待っている
#   場所はスタック、どこまで来たかは Flight Recorder、形や種類の食い違いは `TORCH_DISTRIBUTED_DEBUG=DETAIL`
#   が示します。
# - **順伝播で使われないパラメータがあると**、1 回目の勾配は平均されずに 2 回目でエラーになり、
#   `find_unused_parameters=True` は毎ステップ費用を払って、グラフが変わらないなら `static_graph=True` は
#   最初の 1 回で、これを直します。
# - **バッチの数が違うランクには `Join` を使い**、正確な指標は `DistributedSampler` の水増しを除いた和と個数の
#   all-reduce で求めます。
# - **チェックポイントはランク 0 だけが `model.module.state_dict()` を保存し、全ランクが `barrier` のあとで
#   読み**、torchrun の `--max-restarts` と組み合わせれば、学習は 1 ビットも違わずに続きます。

# %% [markdown] lang="en" tags=["summary"]
# ## What to remember
#
# - **Every rank calls the same collectives in the same order**: a collective under
#   `if rank == 0:` hangs rank 0, and a different reduce op on each rank can give wrong
#   values that no check catches.
# - **Tools find the rank and the call that broke the contract**: `dist.monitored_barrier`
#   names who is missing, a stack dump where each rank waits, the Flight Recorder how
#   far each got, and `TORCH_DISTRIBUTED_DEBUG=DETAIL` calls that differ in shape or type.
# - **A parameter the forward pass does not use** leaves the first step's gradients
#   unaveraged and raises at the second; `find_unused_parameters=True` fixes it at a cost
#   every step, `static_graph=True` once, when the graph never changes.
# - **Ranks with different numbers of batches need `Join`**, and an exact metric
#   all-reduces sums and counts without `DistributedSampler`'s padding.
# - **Rank 0 alone writes `model.module.state_dict()`, and every rank reads after a
#   `barrier`**: with torchrun's `--max-restarts`, such a checkpoint resumes a run bit
#   for bit.

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
