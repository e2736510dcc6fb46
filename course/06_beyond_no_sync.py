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
# # 06 no_sync の先へ: DDP を自分で書き、通信量を減らす
#
# `no_sync` は、送る回数を減らす方法の 1 つでした (レッスン 04)。このレッスンでは、まず DDP そのものが
# 1 ステップで何をしているのかを自分で書いて確かめ、次に PyTorch にある、通信量やメモリを減らすほかの
# 方法を、同じ仕事で並べて測ります。
#
# 1. DDP を 50 行ほどで書く: 勾配のフック、逆順に詰めるバケット、非同期の all-reduce、
#    `optimizer.step()` の前の完了待ち (`work.wait()`)、平均、`no_sync`
# 2. torch の DDP と比べる: 勾配が等しいこと、1 ステップの all-reduce の回数が同じこと、
#    通信が勾配の計算と重なること
# 3. 圧縮フック: `fp16_compress_hook` と PowerSGD (送るバイト数を予測する演習つき)
# 4. `ZeroRedundancyOptimizer`: オプティマイザの状態を分割して持つ (シャード)
# 5. DDP のオプション: `gradient_as_bucket_view`、`static_graph`、`bucket_cap_mb` (バケットの数を予測する
#    演習つき)
# 6. すべてを並べて比べ、レッスン 05 の 1 ステップのモデルに圧縮率を入れて予測する
#
# コードのセルが表示する出力は英語のままです (図と確認のメッセージは日本語です)。

# %% [markdown] lang="en"
# # 06 Beyond no_sync: DDP written by hand, and sending less
#
# `no_sync` was one way to send less often (lesson 04). This lesson first writes what
# DDP itself does in a step and checks it, then measures PyTorch's other ways to send
# less, or hold less memory, side by side on one workload.
#
# 1. write DDP in about 50 lines: gradient hooks, buckets filled in reverse order, an
#    asynchronous all-reduce, a wait before `optimizer.step()`, averaging, `no_sync`
# 2. compare it with torch's DDP: equal gradients, as many all-reduces per step, and
#    communication that overlaps the gradient computation
# 3. compression hooks: `fp16_compress_hook` and PowerSGD (with an exercise predicting
#    the bytes sent)
# 4. `ZeroRedundancyOptimizer`: the optimizer state shared out
# 5. DDP's options: `gradient_as_bucket_view`, `static_graph`, `bucket_cap_mb` (with an
#    exercise predicting the number of buckets)
# 6. all of them side by side, predicted by lesson 05's step model with a compression
#    factor
#
# The code cells print in English in both editions; figures and checks follow the
# notebook's language.

# %%
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %%
from labkit import cluster, exercises, plots

ranks = cluster.start(2, background=True)  # the ranks boot while you read

# %% [markdown] lang="ja"
# ## DDP が 1 ステップでしていること
#
# レッスン 03〜05 で見た torch の `DistributedDataParallel` の仕事を並べると、次のとおりです。
#
# 1. 作るときに、ランク 0 のパラメータを全ランクに配ります (`broadcast`)。全レプリカが同じ重みから
#    始まります。
# 2. パラメータを**バケット**に分けます。順番は `model.parameters()` の**逆**です。逆伝播は最後の層の
#    勾配から計算するので、逆順に詰めると、先にそろうバケットから送れます。1 つのバケットは、
#    上限 (`bucket_cap_mb`) に達したところで閉じます。
# 3. 各パラメータに、勾配ができたときに呼ばれる**フック**を付けます。バケットの勾配がすべてそろうと、
#    バケットの **all-reduce を始めます** (非同期。終わるのを待たずに逆伝播を続けます)。始める順番は
#    バケットの番号順です。番号の大きいバケットが先にそろっても、前のバケットが始まるまで待たせます
#    (torch の `reducer.cpp` の `mark_bucket_ready`: 「Buckets are reduced in sequence」)。
# 4. 逆伝播の終わりで、すべての all-reduce の**完了を待ち**、和を world size で割って**平均**にします
#    (torch の既定のフックは、足す前に割ります)。
# 5. `no_sync()` の中では 3 と 4 をせず、勾配は `.grad` にたまります。次に同期する逆伝播が、
#    たまった和を送ります。
#
# 下の `BucketedDDP` と `ScratchDDP` は、この 5 つを書いたものです。torch の DDP との違いは 3 つです。
# 完了待ちは、`backward()` の中ではなく、学習ループが `optimizer.step()` の前に呼ぶ
# `finish_sync()` で行います。バケットは最初のステップから固定です (torch の DDP は最初のステップを
# 1 つのバケットで送り、勾配ができた順にバケットを作り直します。レッスン 05)。そして、バケットを
# そろった順に送ります。この演習のモデルでは、逆伝播がバケットを番号順にそろえるので、順番は同じに
# なります。torch が番号順を守るのは、どのランクでも集団通信が同じ順に呼ばれるようにするためです
# (順番が食い違うと何が起きるかは、レッスン 10)。

# %% [markdown] lang="en"
# ## What DDP does in a step
#
# The work of torch's `DistributedDataParallel`, as lessons 03 to 05 showed it:
#
# 1. When built, it hands rank 0's parameters to every rank (`broadcast`): every replica
#    starts from the same weights.
# 2. It splits the parameters into **buckets**, in the **reverse** order of
#    `model.parameters()`: the backward pass computes the last layer's gradients first,
#    so in that order the buckets that complete first can go first. A bucket closes once
#    it reaches the cap (`bucket_cap_mb`).
# 3. It puts a **hook** on each parameter, called once its gradient is computed. When all
#    of a bucket's gradients are there, the hook **starts the bucket's all-reduce**
#    (asynchronously: the backward pass goes on without waiting for it). It starts them
#    in the buckets' index order: a later bucket that completes first waits until the
#    ones before it have started (`mark_bucket_ready` in torch's `reducer.cpp`:
#    "Buckets are reduced in sequence").
# 4. At the end of the backward pass it **waits** for every all-reduce and divides the sum
#    by the world size: the **mean** (torch's default hook divides before summing).
# 5. Inside `no_sync()` it skips 3 and 4, and the gradients add up in `.grad`; the next
#    synchronized backward pass sends their sum.
#
# `BucketedDDP` and `ScratchDDP` below write these five steps. They differ from torch's
# DDP in three ways. They wait not inside `backward()` but in `finish_sync()`, which the
# training loop calls before `optimizer.step()`. Their buckets are fixed from the first
# step (torch's DDP sends its first step as one bucket, then rebuilds the buckets in the
# order the gradients came: lesson 05). And they send each bucket as soon as it is
# complete. With this exercise's model the backward pass completes the buckets in index
# order, so the order is the same. Torch keeps to the index order so that every rank
# calls its collectives in the same order (lesson 10 shows what a mismatch does).

# %%
# %%px
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from labkit import from_scratch

# %% [markdown] lang="ja"
# ### 演習: フックと完了待ちを書く
#
# 下のセルの `BucketedDDP` に、`__init__` (配る、バケットに分ける、フックを付ける)、`forward`、
# `no_sync` が書いてあります。それを継承した `ScratchDDP` の 2 つのメソッドを書いてください。
#
# - `_grad_ready(p)`: パラメータ `p` の勾配ができるたびに autograd が呼びます。`no_sync()` の中なら
#   何もしません。そうでなければ、`p` のバケットの残り (`self.pending`) を 1 つ減らし、0 になったら
#   バケットの勾配を 1 本のテンソルにつなげて (`torch.cat`)、`dist.all_reduce(flat, async_op=True)` で
#   送り始め、`(バケット, flat, work)` を `self.in_flight` に入れます。
# - `finish_sync()`: 送った all-reduce をそれぞれ `work.wait()` で待ち、world size で割り、各パラメータの
#   `.grad` に書き戻します。最後に、次のステップのために `in_flight` と `pending` を元に戻します。
#
# 確認のセルは、自分で書いた `ScratchDDP` と torch の DDP を、同じモデルと同じデータで 2 つのランクで
# 動かします。勾配、all-reduce の回数、待つ時点、all-reduce が逆伝播の途中で始まること、`no_sync` の
# 中で送らないことを確かめ、違っていれば、どこが違うかを表示します。確かめられないことが 1 つあります。`flat` を `wait()` の
# あとで読んでいるかどうかです。all-reduce が先に終わっていれば、前に読んでも値は合います。
# クラスは各ランク (エンジン) 上で定義するので、セルは `%%px` です。

# %% [markdown] lang="en"
# ### Exercise: write the hook and the wait
#
# `BucketedDDP`, in the cell below, writes `__init__` (hand out, split into buckets, put
# on the hooks), `forward` and `no_sync`. Write the two methods of `ScratchDDP`, which
# builds on it.
#
# - `_grad_ready(p)`: autograd calls it each time parameter `p`'s gradient is ready.
#   Inside `no_sync()` it does nothing. Otherwise it counts `p` off its bucket
#   (`self.pending`); when none is left, it joins the bucket's gradients into one tensor
#   (`torch.cat`), starts `dist.all_reduce(flat, async_op=True)`, and puts
#   `(bucket, flat, work)` in `self.in_flight`.
# - `finish_sync()`: waits for each all-reduce sent (`work.wait()`), divides by the world
#   size, and copies the result back into each parameter's `.grad`. At the end it resets
#   `in_flight` and `pending` for the next step.
#
# The check runs your `ScratchDDP` and torch's DDP on the same model and data on two
# ranks. It checks the gradients, the number of all-reduces, when they are waited for,
# that they start during the backward pass, and that nothing is sent inside
# `no_sync`, and says what differs. One thing it cannot check: that you read `flat` only
# after its `wait()`. An all-reduce that has already finished gives the right values
# either way. The class is defined on the ranks, so the cell is a `%%px` cell.

# %%
# %%px
class BucketedDDP(nn.Module):
    """What ScratchDDP builds on: the replicas' start, the buckets, the hooks."""

    def __init__(self, module, bucket_cap_mb=25):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        for p in module.parameters():  # every replica starts from rank 0's weights
            dist.broadcast(p.data, src=0)
        # Buckets in reverse order of the parameters: the backward pass computes
        # the last layer's gradients first. A bucket closes once it holds the cap.
        cap = bucket_cap_mb * 2**20
        self.buckets, bucket, size = [], [], 0
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            bucket.append(p)
            size += p.numel() * p.element_size()
            if size >= cap:
                self.buckets.append(bucket)
                bucket, size = [], 0
        if bucket:
            self.buckets.append(bucket)
        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        self.require_sync = True
        self.pending = [len(b) for b in self.buckets]  # gradients still to come
        self.in_flight = []  # (bucket, flat gradients, work) of the all-reduces sent
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = True

# %% tags=["exercise"]
# %%px
class ScratchDDP(BucketedDDP):
    """Data parallelism by hand: bucketed, asynchronous, averaged all-reduces."""

    def _grad_ready(self, p):  # autograd calls it once p.grad is complete
        pass  # TODO: count p off its bucket; send a complete bucket, don't wait

    def finish_sync(self):  # call after backward, before optimizer.step()
        pass  # TODO: wait, divide by the world size, copy back into .grad, reset

# %% tags=["solution"]
# %%px
class ScratchDDP(BucketedDDP):
    """Data parallelism by hand: bucketed, asynchronous, averaged all-reduces."""

    def _grad_ready(self, p):  # autograd calls it once p.grad is complete
        if not self.require_sync:
            return  # accumulate locally; the next synced backward sends the sum
        i = self.bucket_of[p]
        self.pending[i] -= 1
        if self.pending[i] == 0:  # the bucket is complete: send it, don't wait
            flat = torch.cat([q.grad.flatten() for q in self.buckets[i]])
            work = dist.all_reduce(flat, async_op=True)
            self.in_flight.append((self.buckets[i], flat, work))

    def finish_sync(self):  # call after backward, before optimizer.step()
        for bucket, flat, work in self.in_flight:
            work.wait()
            flat /= self.world_size  # the sum of the ranks' gradients -> their mean
            for q, g in zip(bucket, flat.split([q.numel() for q in bucket]), strict=True):
                q.grad.copy_(g.view_as(q))
        self.in_flight = []
        self.pending = [len(b) for b in self.buckets]

# %%
exercises.grade_scratch_ddp(ranks)

# %% [markdown] lang="ja"
# ## torch の DDP と比べる
#
# 確認のセルがしたことを、数字を出して見ます。モデルはレッスン 05 の MLP (幅 512、8 層、1 MB の重みが
# 7 つ) で、バケットの上限は 1 MB です。両方のモデルが同じ初期値から、このランクの同じバッチで
# 3 ステップずつ逆伝播し、そのあと `no_sync` で勾配をためる更新を 1 回します。
# `from_scratch.compare_with_ddp` は、`ScratchDDP` が呼んだ `dist.all_reduce` をすべて記録し
# (バイト数、始まり、終わり、待った時刻)、torch の DDP の all-reduce を通信フックで数えます。

# %% [markdown] lang="en"
# ## Compared with torch's DDP
#
# What the check did, with its numbers shown. The model is lesson 05's MLP (width 512,
# 8 layers, seven 1 MB weights) with a 1 MB bucket cap. Both models start from the same
# weights and run 3 backward passes on this rank's same batch, then one update that
# accumulates with `no_sync`. `from_scratch.compare_with_ddp` records every
# `dist.all_reduce` that `ScratchDDP` calls (bytes, start, end, when it was waited for)
# and counts torch DDP's all-reduces with a comm hook.

# %%
# %%px
result = from_scratch.compare_with_ddp(ScratchDDP)
for i, s in enumerate(result["steps"], start=1):
    print(f"rank {rank}, step {i}: {s['calls']} all-reduces ({s['ddp_calls']} in "
          f"torch's DDP), {s['bytes'] / 2**20:.2f} MiB ({s['ddp_bytes'] / 2**20:.2f}); "
          f"largest gradient difference {s['max_diff']:.1e}")
update = result["update"]
print(f"rank {rank}, update with no_sync: {update['calls_in_no_sync']} all-reduces "
      f"inside no_sync, {update['calls']} after; difference {update['max_diff']:.1e}")
assert all(s["max_diff"] == 0 for s in [*result["steps"], update])  # exactly
assert result["steps"][0]["ddp_calls"] == 1  # torch's first step: one bucket
assert all(s["calls"] == s["ddp_calls"] for s in [*result["steps"][1:], update])
assert all(s["bytes"] == s["ddp_bytes"] for s in [*result["steps"], update])
# The same buckets, started in the same order (bytes of each all-reduce, in turn).
print(f"rank {rank}, step 3, bytes of each all-reduce in turn: {result['steps'][2]['sizes']}")
assert all(s["sizes"] == s["ddp_sizes"] for s in [*result["steps"][1:], update])
assert update["calls_in_no_sync"] == 0

# %% [markdown] lang="ja"
# 勾配は torch の DDP と一致し (2 ランクでは、足してから割っても割ってから足しても、2 で割るのは
# 誤差なく計算できるので差は 0 です)、2 ステップ目からは all-reduce の回数も送るバイト数も同じです。
# 1 ステップ目だけ torch の DDP は 1 回で、`ScratchDDP` は最初から 8 回です。2 ステップ目からは、
# 各 all-reduce のバイト数を始まった順に並べた列も同じです。同じバケットを同じ順に送っています。

# %% [markdown] lang="en"
# The gradients equal torch DDP's (with two ranks, summing then halving and halving then
# summing give the same: dividing by 2 is exact), and from step 2 on the number of
# all-reduces and the bytes sent are the same too. Only in step 1 does torch's DDP make
# one all-reduce where `ScratchDDP` makes 8 from the start. From step 2 on, the bytes of
# each all-reduce, listed in the order they started, are the same too: the same buckets,
# sent in the same order.

# %% [markdown] lang="ja"
# ### 通信は計算と重なっているか
#
# フックは all-reduce を始めるだけで、逆伝播はその間に次の層の勾配を計算します。下のセルは、
# 各 all-reduce が終わる前に、逆伝播がほかの勾配をいくつ書いたかを数えます (`overlapped`: 書かれた
# 勾配が 1 つでもあった all-reduce の数)。フックの中で `work.wait()` を呼ぶと、待つあいだ逆伝播が
# 止まるので、この数は 0 になります (tests/test_from_scratch.py がそれを確かめます)。どの all-reduce も
# 逆伝播の途中で始まることは毎ステップ確かめます。all-reduce が次の勾配より先に終わるかどうかは
# マシンの負荷で変わるので、重なりは 3 ステップのどこかで 1 つ以上あることを確かめます。図は、
# レッスン 05 と同じ描き方で、最後のステップの各 all-reduce の時間を示します。

# %% [markdown] lang="en"
# ### Does communication overlap the computation?
#
# The hook only starts the all-reduce; meanwhile the backward pass computes the next
# layers' gradients. The cell below counts, for each all-reduce, how many other
# gradients the backward pass wrote before it ended (`overlapped`: the all-reduces during
# which at least one was written). Calling `work.wait()` inside the hook stops the
# backward pass while it waits, and this count drops to 0 (tests/test_from_scratch.py
# checks that). The cell checks that every all-reduce starts during the backward pass, at
# every step; whether one ends before the next gradient is written depends on the
# machine's load, so it checks that at least one overlapped in the three steps. The plot
# shows each all-reduce of the last step, drawn as in lesson 05.

# %%
# %%px
for i, s in enumerate(result["steps"], start=1):
    print(f"rank {rank}, step {i}: {s['overlapped']} of {s['calls']} all-reduces ran "
          f"while the backward pass wrote more gradients")
# Whether an all-reduce ends before the next gradient is written depends on the
# machine's load; that each one starts while the backward pass runs does not.
assert all(s["started_after_grads"] == 0 for s in result["steps"])
assert sum(s["overlapped"] for s in result["steps"]) >= 1
assert all(s["waited_before_grads"] == 0 for s in result["steps"])

# %%
fig = plots.timeline(ranks.pull("result")[0]["records"], title="scratch_overlap_title",
                     end_label="sync_finished")

# %% [markdown] lang="ja"
# ## 通信量やメモリを減らす、ほかの 4 つの方法
#
# `no_sync` は送る**回数**を減らしました。PyTorch には、送る**量**やメモリを減らす仕組みがほかにもあります。
# どれも DDP に 1 か所だけ手を加えるものです。
#
# - **圧縮フック** (`register_comm_hook`): バケットの all-reduce を、圧縮して送るものに置き換えます。
#   `fp16_compress_hook` (float16 にして送る) と PowerSGD (低ランクの近似を送る)。
# - **`ZeroRedundancyOptimizer`** (ZeRO-1、ZeRO ステージ 1): オプティマイザの状態をランクで分割して持ちます。
# - **DDP のオプション**: `gradient_as_bucket_view=True` (勾配をバケットの一部として持つ)、
#   `static_graph=True` (毎ステップ同じ計算グラフだと約束する)。
# - **`bucket_cap_mb`**: バケットの大きさ (次の節で数えます)。
#
# 同じ仕事 (レッスン 05 の大きな MLP: 幅 1024、3 層、210 万パラメータ、勾配 8,482,856 バイト) で、
# 各方法を 1 ステップずつ順番に 25 ステップ動かします (レッスン 04 と同じく、交互に測ります)。
# バイト数は、`dist.all_reduce` と `dist.broadcast` に渡されたテンソルを
# `comm_counting.CollectiveLog` が数えます。そのため、ふつうの DDP も、既定の動作を Python で
# 書いた torch のフック (`default_hooks.allreduce_hook`。計算は既定と同じ) を通します。
# 10 秒ほどかかります。

# %% [markdown] lang="en"
# ## Four more ways to send less
#
# `no_sync` sent less **often**. PyTorch has other means to send **less**, or to hold
# less memory, each a single change to DDP:
#
# - **compression hooks** (`register_comm_hook`): replace a bucket's all-reduce with one
#   that sends it compressed: `fp16_compress_hook` (sends float16) and PowerSGD (sends a
#   low-rank approximation);
# - **`ZeroRedundancyOptimizer`** (ZeRO-1, ZeRO stage 1): the ranks share out the optimizer
#   state;
# - **DDP's options**: `gradient_as_bucket_view=True` (gradients live inside the
#   buckets), `static_graph=True` (a promise that the graph is the same at every step);
# - **`bucket_cap_mb`**: the bucket size (counted in the next section).
#
# On one workload (lesson 05's large MLP: width 1024, 3 layers, 2.1 million parameters,
# 8,482,856 bytes of gradients), each method runs one step in turn, for 25 steps
# (timed alternately, as in lesson 04). `comm_counting.CollectiveLog` counts the bytes of
# the tensors handed to `dist.all_reduce` and `dist.broadcast`; so plain DDP too goes
# through torch's hook that writes its default in Python (`default_hooks.allreduce_hook`,
# the same computation). It takes about 10 s.

# %%
# %%px
from labkit import send_less

runs = send_less.compare_methods(steps=25)
if rank == 0:
    print(f"{'method':24} {'bytes/step':>10} {'calls':>5} {'ms/step':>7} {'loss':>7}"
          f" {'grad+state MiB':>14}")
    for name, r in runs.items():
        print(f"{name:24} {r['bytes'][-1]:>10,} {r['calls'][-1]:>5} "
              f"{r['step_s'] * 1e3:>7.1f} {r['final_loss']:>7.4f} "
              f"{(r['grad_bytes'] + r['state_bytes']) / 2**20:>14.1f}")

# %%
from labkit import send_less

runs = ranks.pull("runs")
by_method = {m: runs[0][m] for m in send_less.METHODS}  # rank 0's, in the table's order
fig = plots.methods_chart({
    "sent_per_step": {m: r["bytes"][-1] for m, r in by_method.items()},
    "step_ms_median": {m: r["step_s"] * 1e3 for m, r in by_method.items()},
    "final_loss": {m: r["final_loss"] for m, r in by_method.items()},
    "memory_mib": {m: (r["grad_bytes"] + r["state_bytes"]) / 2**20
                   for m, r in by_method.items()},
}, title="levers_title", logx=["sent_per_step"])

# %% [markdown] lang="ja"
# ### 圧縮フック: fp16 と PowerSGD
#
# `fp16_compress_hook` は、バケットを float16 にしてから all-reduce し、float32 に戻します。送るバイト数は
# ちょうど半分で、丸めの誤差が入ります。`bf16_compress_hook` (bfloat16) を受け付けるかどうかを、
# torch 2.13 の DDP は、プロセスグループのバックエンドではなく torch のビルドで決めます。CUDA (または
# ROCm) と NCCL 2.10 以上を含むビルド、または XPU と XCCL を使えるビルドなら受け付けます
# (`DistributedDataParallel._check_comm_hook`)。CPU 版の torch ではエラーになります。Linux で PyPI から
# 入る CUDA 版なら gloo のランクでも登録でき、gloo は bfloat16 のまま足し合わせます。下のセルは、
# どちらのビルドでも、torch と同じ条件で結果を確かめます。
#
# **PowerSGD** は、n × m の勾配行列 M を、近似ランク r (`matrix_approximation_rank`) の積 P Qᵀ
# (P は n × r、Q は m × r) で近似し、M の n·m 個の値の代わりに P と Q を all-reduce します。
#
# - **ウォームアップ**: 最初の `start_powerSGD_iter` ステップ (ここでは 10) は、ふつうの all-reduce を
#   します。学習のはじめは、勾配の誤差に敏感だからです (PowerSGD のドキュメントが挙げる理由)。
# - **誤差のフィードバック** (`use_error_feedback`、既定で有効): このランクの勾配 (前のステップの
#   誤差を足したもの) から、実際に使われた勾配 (全ランクで平均し、P Qᵀ に戻したもの) を引いた差を
#   覚えておき、次のステップの勾配に足します (torch の `powerSGD_hook.py`:
#   `input_tensor_cp - input_tensor`)。近似で落ちた分は、遅れて届きます。
# - すべてのテンソルを圧縮するわけではありません。どれを圧縮し、1 ステップに何バイト送るかは、
#   あとの演習で予測します。
#
# PowerSGD には、ここではバケットを 1 つだけ使わせます (`bucket_cap_mb=100`)。フック自身が送るのは
# 圧縮しないテンソルだけで、P と Q の all-reduce は、前の all-reduce が終わったときに走るコールバック
# (future の `.then`) から呼ばれます (tests/test_levers.py が確かめます)。バケットが 2 つ以上あると、
# それが次のバケットの all-reduce の前になるかあとになるかがランクごとに変わりうるので、集団通信の順が
# 食い違います (レッスン 10)。

# %% [markdown] lang="en"
# ### Compression hooks: fp16 and PowerSGD
#
# `fp16_compress_hook` casts the bucket to float16, all-reduces it, and casts back to
# float32: exactly half the bytes, with rounding. Whether torch 2.13's DDP accepts
# `bf16_compress_hook` (bfloat16) depends on how torch was built, not on the process
# group's backend: a build with CUDA (or ROCm) and NCCL 2.10 or later, or with XPU and
# XCCL, accepts it (`DistributedDataParallel._check_comm_hook`). The CPU build refuses
# it; the CUDA build that PyPI installs on Linux accepts it even on gloo ranks, and gloo
# sums bfloat16 as it is. The cell below checks the outcome against torch's own
# condition, on either build.
#
# **PowerSGD** approximates an n × m gradient matrix M by a product P Qᵀ of approximation
# rank r (`matrix_approximation_rank`; P is n × r, Q is m × r) and all-reduces P and Q
# instead of M's n·m values.
#
# - **Warm-up**: for the first `start_powerSGD_iter` steps (10 here) it runs plain
#   all-reduces: the start of training is sensitive to inexact gradients (the reason
#   PowerSGD's documentation gives).
# - **Error feedback** (`use_error_feedback`, on by default): it keeps this rank's
#   gradient (with the previous step's error added) minus what was applied (the
#   all-reduced mean, turned back into P Qᵀ), and adds it to the next step's gradient
#   (torch's `powerSGD_hook.py`: `input_tensor_cp - input_tensor`): what the
#   approximation dropped arrives later.
# - Not every tensor is compressed. Which are, and how many bytes a step sends, is the
#   exercise below.
#
# PowerSGD gets one bucket here (`bucket_cap_mb=100`). The hook itself sends only the
# uncompressed tensors; P's and Q's all-reduces are called from callbacks that run when
# the all-reduce before them completes (a future's `.then`; tests/test_levers.py checks
# that). With two buckets or more, whether those come before or after the next bucket's
# all-reduce can differ between the ranks: mismatched collectives (lesson 10).

# %%
# %%px
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

# The condition torch 2.13 tests: the build, whatever the group's backend.
cuda_build = torch.version.cuda is not None or torch.version.hip is not None
accepts_bf16 = (
    (cuda_build and dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10))
    or (dist.is_xccl_available() and torch.xpu.is_available()))
bf16_model = DDP(nn.Linear(4, 4, bias=False))
try:
    bf16_model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    refused = None
except TypeError as err:
    refused = str(err)
print(f"rank {rank}: torch {torch.__version__}, CUDA build: {cuda_build}, "
      f"gloo group; refused: {refused}")
assert (refused is None) == accepts_bf16
if refused is None:  # accepted on gloo: a step in bfloat16
    bf16_model(torch.full((2, 4), rank + 1.0)).sum().backward()
    # Each weight's gradient is 2 (rank + 1) here; the mean over 2 ranks is 3.
    assert torch.equal(bf16_model.module.weight.grad, torch.full((4, 4), 3.0))
    print(f"rank {rank}: gloo averaged the gradients in bfloat16: 3.0 everywhere")

# %%
plain, fp16 = by_method["DDP"], by_method["fp16"]
print(f"fp16 sends {fp16['bytes'][-1]:,} bytes a step, DDP {plain['bytes'][-1]:,}")
assert 2 * fp16["bytes"][-1] == plain["bytes"][-1]  # half
assert abs(fp16["final_loss"] - plain["final_loss"]) < 1e-3  # rounding, little else
for r in (1, 2, 4):
    psgd = by_method[f"PowerSGD r={r}"]
    print(f"PowerSGD r={r}: {psgd['bytes'][0]:,} bytes in a warm-up step, "
          f"{psgd['bytes'][-1]:,} after it ({plain['bytes'][-1] / psgd['bytes'][-1]:.0f}x "
          f"fewer); final loss {psgd['final_loss']:.4f} (DDP {plain['final_loss']:.4f})")
    assert psgd["bytes"][0] == plain["bytes"][-1]  # the warm-up sends everything
    assert psgd["step_s"] > plain["step_s"] / 2  # ~100x fewer bytes, not 2x faster
assert (by_method["PowerSGD r=1"]["bytes"][-1] < by_method["PowerSGD r=2"]["bytes"][-1]
        < by_method["PowerSGD r=4"]["bytes"][-1] < plain["bytes"][-1] / 50)
final = {m: by_method[m]["final_loss"] for m in by_method}
assert (final["DDP"] < final["PowerSGD r=4"] < final["PowerSGD r=2"]
        < final["PowerSGD r=1"])  # slower to fall; closer to DDP as r grows

# %%
fig = plots.loss_curves({m: by_method[m]["loss"] for m in
                         ("DDP", "fp16", "PowerSGD r=1", "PowerSGD r=2", "PowerSGD r=4")},
                        title="levers_loss_title")

# %% [markdown] lang="ja"
# 25 ステップでは、PowerSGD の損失は DDP より下がり方が遅く、近似ランク r が大きいほど DDP に
# 近づきます (この実行の図)。送るバイト数は数十分の 1 以下になりましたが、1 ステップの時間は DDP の
# 半分にもなりません。それは最後の節で、通信のモデルと比べて調べます。

# %% [markdown] lang="en"
# Over 25 steps PowerSGD's loss falls more slowly than DDP's, and comes closer to it as
# the rank r grows (this run's plot). The bytes per step dropped by a factor of tens or
# more, yet a step is not even twice as fast as DDP's: the last section looks into that
# with the communication model.

# %% [markdown] lang="ja"
# 誤差のフィードバックが何をするかは、毎ステップ同じ勾配 C (16 × 16 の行列) になる層で確かめられます。
# 近似ランク 1 では、C の大部分が毎回落ちます。下のセルは、ウォームアップのあと k ステップで
# 実際に使われた勾配の和が、本当の和 k C からどれだけ離れているか (相対誤差) を比べます。
# フィードバックがなければ落ちた分は失われたままで、あれば次のステップに足されるので、和が追いつきます。

# %% [markdown] lang="en"
# What error feedback does shows on a layer whose gradient is the same matrix C
# (16 × 16) at every step. A rank-1 approximation drops most of C each time. The cell
# below compares how far the sum of the gradients applied in k steps after the warm-up
# is from the true sum k C (relative error). Without feedback, what is dropped stays
# lost; with it, it is added to the next step, and the sum catches up.

# %%
# %%px
without = send_less.error_feedback_trial(use_error_feedback=False)
with_feedback = send_less.error_feedback_trial(use_error_feedback=True)
for k in (1, 10, len(without)):
    print(f"rank {rank}, after {k:>2} steps: sum off by {without[k - 1]:.0%} without "
          f"error feedback, {with_feedback[k - 1]:.0%} with it")
assert with_feedback[-1] < 0.3 < 0.8 < without[-1]
assert with_feedback[-1] < with_feedback[9] / 2  # falls as 1/k: the sum catches up

# %% [markdown] lang="ja"
# ### 演習: PowerSGD が 1 ステップに送るバイト数
#
# 関数 `powersgd_bytes(shapes, r)` を書いてください。`shapes` はモデルのパラメータの形のリスト
# (例: `[(1024, 10), (1024,)]`)、`r` は PowerSGD の近似ランク (`matrix_approximation_rank`) です。
# ウォームアップのあとの 1 ステップで、PowerSGD が all-reduce する float32 のバイト数を返します。
# torch の `powerSGD_hook.py` の決まりは 2 つです。
#
# - どのテンソルも、行列 (`shape[0]`, 残りの次元の積) として見ます。ベクトル (バイアス) は n × 1 の
#   行列です。
# - 圧縮して値の数が半分より少なくなる行列 (`(n + m) * r * 2 < n * m`) だけを P と Q にして送り、
#   それ以外は圧縮せずにそのまま送ります (`min_compression_rate=2`、`_should_compress`)。n × 1 の
#   行列 (ベクトル) は、この条件を満たすことがありません。
#
# 確認のセルは、いくつかの層の組と近似ランクについて、2 つのランクで実際に PowerSGD を動かして数えたバイト数と
# 比べます。ベクトルを「圧縮しない」という別の決まりで扱っても、n × 1 の行列として上の条件で判定しても、
# バイト数は同じです。確認のセルはこの 2 つを区別せず、どちらも正解とします。

# %% [markdown] lang="en"
# ### Exercise: the bytes PowerSGD sends in a step
#
# Write `powersgd_bytes(shapes, r)`. `shapes` lists the shapes of a model's parameters
# (for instance `[(1024, 10), (1024,)]`) and `r` is PowerSGD's approximation rank
# (`matrix_approximation_rank`). Return the bytes of float32 that PowerSGD all-reduces in
# one step after its warm-up. torch's `powerSGD_hook.py` has two rules:
#
# - every tensor is seen as the matrix (`shape[0]`, product of the other dimensions); a
#   vector (a bias) is an n × 1 matrix
# - only a matrix that compression makes less than half as many values
#   (`(n + m) * r * 2 < n * m`) is sent as P and Q; any other is sent as it is
#   (`min_compression_rate=2`, `_should_compress`). An n × 1 matrix (a vector) never
#   passes that rule.
#
# The check compares with the bytes counted while PowerSGD really runs on the two ranks,
# for several sets of layers and ranks. A vector given a rule of its own ("never
# compressed") and a vector judged as an n × 1 matrix by the rule above give the same
# bytes, so the check does not tell them apart: it accepts both.

# %% tags=["exercise"]
import math


def powersgd_bytes(shapes, r):
    """Bytes PowerSGD all-reduces per step at rank r for parameters of `shapes`."""
    return None  # TODO

# %% tags=["solution"]
import math


def powersgd_bytes(shapes, r):
    """Bytes PowerSGD all-reduces per step at rank r for parameters of `shapes`."""
    values = 0
    for shape in shapes:
        if len(shape) == 1:  # a vector: sent as it is
            values += shape[0]
            continue
        n, m = shape[0], math.prod(shape[1:])
        compressed = (n + m) * r
        values += compressed if compressed * 2 < n * m else n * m
    return 4 * values  # float32

# %%
exercises.grade_powersgd_bytes(ranks, powersgd_bytes)

# %%
mlp = [(1024, 10), (1024,), (1024, 1024), (1024,), (1024, 1024), (1024,), (10, 1024),
       (10,)]  # the large MLP's parameters
for r in (1, 2, 4):
    print(f"r={r}: predicted {powersgd_bytes(mlp, r):,}, "
          f"measured {by_method[f'PowerSGD r={r}']['bytes'][-1]:,}")
    assert powersgd_bytes(mlp, r) == by_method[f"PowerSGD r={r}"]["bytes"][-1]

# %% [markdown] lang="ja"
# ### ZeroRedundancyOptimizer: オプティマイザの状態を分割して持つ (シャード)
#
# Adam は、パラメータ 1 つにつき 2 つの値 (勾配の移動平均と二乗の移動平均) を持つので、状態は
# パラメータの 2 倍の大きさです (ほかにテンソルごとのステップ数)。DDP では、その全部を全ランクが持ちます。
# `ZeroRedundancyOptimizer` (ZeRO-1 の考え方) では、各ランクがパラメータの一部だけを更新し、その部分の
# 状態だけを持ちます。更新したパラメータは、ステップの終わりに `broadcast` で全ランクに配ります。
# そのため集団通信に渡すバイト数 (表の数) は、勾配の all-reduce にパラメータの broadcast が加わって
# 2 倍になります。ただし broadcast で送るのは送り元のランクだけで、各ランクが送り元になるのは自分の
# 担当分だけです。各ランクがソケットに書き込むバイト数は、2 ランクでは 1.5 倍です (下のセルが
# `/proc/self/io` で数えます。`/proc` のない macOS と Windows では、そう表示して数えません)。
# この増え方は torch の `ZeroRedundancyOptimizer` の作り (勾配は DDP の
# all-reduce で全部そろえ、更新したパラメータを broadcast する) によるものです。ZeRO の論文の
# ステージ 1 は、勾配を reduce-scatter し、パラメータを all-gather するので、通信量は DDP と同じです
# (論文の 7 節)。勾配とパラメータは全ランクが全部持ったままです。それも分割して持つのが ZeRO-2、ZeRO-3 と FSDP
# です。レッスン 11 で、ZeRO のステージ 1〜3 を手で書き、FSDP2 と比べます。

# %% [markdown] lang="en"
# ### ZeroRedundancyOptimizer: sharing out the optimizer state
#
# Adam keeps two values per parameter (moving averages of the gradient and of its
# square): its state is twice the parameters (and a step count per tensor). Under DDP every rank holds all of it.
# With `ZeroRedundancyOptimizer` (the idea of ZeRO-1) each rank updates only a share of
# the parameters and holds only that share's state; at the end of the step it hands the
# parameters it updated to every rank with `broadcast`. So the bytes handed to
# collectives (what the table counts) double: the gradients' all-reduce plus the
# parameters' broadcast. But in a broadcast only the source sends, and each rank is the
# source of its own share only: the bytes each rank writes to its sockets grow 1.5× on 2
# ranks (the cell below counts them through `/proc/self/io`; on macOS and Windows, which
# have no `/proc`, it says so and counts nothing). That growth comes from the
# design of torch's `ZeroRedundancyOptimizer` (the gradients all-reduced whole by DDP,
# then the updated parameters broadcast); stage 1 as the ZeRO paper describes it
# reduce-scatters the gradients and all-gathers the parameters, the same volume as DDP
# (the paper's section 7). Every rank still holds all the gradients and parameters;
# sharing those out too is ZeRO-2, ZeRO-3 and FSDP. Lesson 11 writes ZeRO's stages 1 to
# 3 by hand and compares them with FSDP2.

# %%
adam, zero = by_method["DDP + Adam"], by_method["ZeRO + Adam"]
per_rank = [r["ZeRO + Adam"]["state_bytes"] for r in runs]
print(f"Adam's state on each rank: {adam['state_bytes']:,} bytes; with ZeRO: "
      f"{per_rank} (together {sum(per_rank):,})")
print(f"bytes per step: DDP + Adam {adam['bytes'][-1]:,}, ZeRO + Adam {zero['bytes'][-1]:,}")
assert 2 * plain["bytes"][-1] <= adam["state_bytes"] < 2 * plain["bytes"][-1] + 1024
assert sum(per_rank) == adam["state_bytes"]  # the same state, shared out
assert max(per_rank) < 0.51 * adam["state_bytes"]
assert zero["bytes"][-1] == 2 * adam["bytes"][-1]  # + the parameters' broadcast
assert zero["sent"][-1].broadcast_bytes == adam["bytes"][-1]  # every parameter, once
# On the wire: what each rank wrote to its sockets in the last step, both ranks summed.
if all(r["DDP + Adam"]["wire"][-1] is not None for r in runs):
    wire = {m: sum(r[m]["wire"][-1] for r in runs) for m in ("DDP + Adam", "ZeRO + Adam")}
    print(f"written to sockets, both ranks: DDP + Adam {wire['DDP + Adam']:,}, "
          f"ZeRO + Adam {wire['ZeRO + Adam']:,} ({wire['ZeRO + Adam'] / wire['DDP + Adam']:.2f}x)")
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
# ### DDP のオプション
#
# `gradient_as_bucket_view=True` では、各パラメータの `.grad` がバケットの一部 (view) になります。
# ふつうの DDP は、勾配をバケットにコピーしてから送るので、勾配を二重に (`.grad` とバケットに)
# 持っています。下のセルは、勾配とバケットが使うメモリ (重ならない記憶領域の合計) を比べます。
# ただし、コピーがなくなるわけではありません。`zero_grad()` の既定 (`set_to_none=True`) は毎ステップ
# `.grad` を None にする (解放する) ので、次の逆伝播の勾配は新しいテンソルにでき、DDP はそれをバケットにコピーしてから
# `.grad` をバケットの view に付け替えます (torch 2.13 の `DistributedDataParallel` のドキュメント。
# tests/test_levers.py が数えて確かめます)。節約できるのはメモリで、コピーの時間ではありません。`static_graph=True` は、毎ステップ同じ
# パラメータが使われると DDP に約束します (レッスン 10)。このモデルでは送るものも学習も変わりません。

# %% [markdown] lang="en"
# ### DDP's options
#
# With `gradient_as_bucket_view=True`, each parameter's `.grad` is a view into a bucket.
# Plain DDP copies the gradients into its buckets before sending them, so it holds the
# gradients twice (in `.grad` and in the buckets). The cell below compares the memory
# that gradients and buckets use (the total of their distinct storages). The copy does
# not go away, though: `zero_grad()`'s default (`set_to_none=True`) drops `.grad` at
# every step, so the next backward pass writes its gradient to a new tensor, which DDP
# copies into the bucket before pointing `.grad` at the bucket's view (torch 2.13's
# `DistributedDataParallel` documentation; tests/test_levers.py counts it). What it
# saves is memory, not the copy's time. `static_graph=True` promises DDP that every
# step uses the same parameters (lesson 10); on this model it changes neither what is
# sent nor the training.

# %%
view, static = by_method["gradient_as_bucket_view"], by_method["static_graph"]
saved = plain["grad_bytes"] - view["grad_bytes"]
print(f"gradients and buckets: DDP {plain['grad_bytes']:,} bytes, "
      f"gradient_as_bucket_view {view['grad_bytes']:,}: {saved:,} saved")
assert saved == plain["bytes"][-1]  # one copy of the gradients (8,482,856 bytes)
assert view["loss"] == plain["loss"] and static["loss"] == plain["loss"]
assert static["bytes"] == plain["bytes"]
assert static["calls"][0] == plain["calls"][0] == 1  # step 1: one bucket (lesson 05)

# %% [markdown] lang="ja"
# ### バケットの大きさ: `bucket_cap_mb`
#
# バケットの数は、1 ステップの all-reduce の回数です。`bucket_cap_mb` を変えて、3 ステップ目 (作り直した
# あと) の回数を数えます。`None` は DDP の既定 (上限 25 MB、ただし最初のバケットだけ 1 MB) です。
# 数値を渡すと、最初のバケットも同じ上限になります (torch 2.13 の `distributed.py`)。
# このモデルの 1024 × 1024 の重みは 1 つで 4 MiB あるので、上限が 4 MB より小さいと、重みが 1 つ
# 入るたびにバケットが閉じます。0.25 MB から 4 MB までは、どれも 3 つです。上限をさらに小さくすると
# (0.01 MB)、小さな層 (出力層は重みとバイアスで 41,000 バイト) も 1 つでバケットを閉じるので、
# バケットは増えます。

# %% [markdown] lang="en"
# ### Bucket size: `bucket_cap_mb`
#
# The number of buckets is the number of all-reduces in a step. Count them at step 3
# (after the rebuild) for several `bucket_cap_mb`. `None` is DDP's default (a 25 MB cap,
# but 1 MB for the first bucket); pass a number and the first bucket gets that cap too
# (torch 2.13's `distributed.py`). Each 1024 × 1024 weight of this model is 4 MiB on its
# own, so with a cap below 4 MB each weight closes a bucket: every cap from 0.25 MB to
# 4 MB gives 3 buckets. A smaller cap (0.01 MB) lets the small layers close buckets too
# (the output layer's weight and bias are 41,000 bytes), and the buckets grow in number.

# %%
# %%px
counts = send_less.bucket_counts([None, 0.01, 0.25, 1, 4, 25, 100])
if rank == 0:
    for cap, calls in counts.items():
        print(f"bucket_cap_mb={cap}: all-reduces per step {calls}")
assert all(calls[0] == 1 for calls in counts.values())  # step 1: one bucket
assert counts[None][-1] == 2  # the 1 MB first bucket, then the rest
assert counts[25][-1] == counts[100][-1] == 1  # 8.1 MiB fits in one
assert counts[0.25][-1] == counts[1][-1] == counts[4][-1] == 3  # one per 4 MiB weight
assert counts[0.01][-1] > 3  # small layers close buckets of their own
cap_calls = list(counts.items())  # ipyparallel sorts dict keys: None and numbers fail

# %% [markdown] lang="ja"
# ### 演習: DDP のバケットの数を予測する
#
# 関数 `ddp_buckets(param_bytes, bucket_cap_mb)` を書いてください。`param_bytes` は、モデルの
# パラメータのバイト数を `model.parameters()` の順に並べたリスト、`bucket_cap_mb` は DDP に渡す値
# (`None` か数) です。DDP がバケットを作り直したあと (2 ステップ目から) の、1 ステップの all-reduce の
# 回数を返します。規則は上の節と `ScratchDDP` のとおりです。勾配ができる順 (パラメータの逆順) に
# バケットへ入れ、入れたパラメータで上限以上になったらバケットを閉じます。上限は、`None` なら最初の
# バケットが 1 MiB、それ以外が 25 MiB、数なら全部がその MiB (1 MiB = 1024 × 1024 バイト) です。
# 確認のセルは、いくつかのモデルと上限で、2 つのランクで DDP が実際にした all-reduce の回数と比べます。

# %% [markdown] lang="en"
# ### Exercise: predict DDP's buckets
#
# Write `ddp_buckets(param_bytes, bucket_cap_mb)`. `param_bytes` lists the bytes of a
# model's parameters in `model.parameters()` order; `bucket_cap_mb` is what DDP is given
# (`None` or a number). Return the number of all-reduces per step once DDP has rebuilt
# its buckets (from step 2 on). The rules are those of the section above and of
# `ScratchDDP`: fill buckets in the order the gradients come (the parameters' reverse
# order), and close a bucket once the parameter just added makes it reach the cap. The
# caps: with `None`, 1 MiB for the first bucket and 25 MiB for the others; with a number,
# that many MiB for all (1 MiB = 1024 × 1024 bytes). The check compares with the
# all-reduces DDP really made on the two ranks, for several models and caps.

# %% tags=["exercise"]
def ddp_buckets(param_bytes, bucket_cap_mb):
    """All-reduces per step of DDP after its rebuild, for parameters of these bytes."""
    return None  # TODO

# %% tags=["solution"]
def ddp_buckets(param_bytes, bucket_cap_mb):
    """All-reduces per step of DDP after its rebuild, for parameters of these bytes."""
    mib = 1024 * 1024
    cap = (25 if bucket_cap_mb is None else bucket_cap_mb) * mib
    first = mib if bucket_cap_mb is None else cap
    buckets, size = 0, 0
    for nbytes in reversed(param_bytes):  # the order the gradients come
        size += nbytes
        if size >= (first if buckets == 0 else cap):  # reached the cap: close it
            buckets, size = buckets + 1, 0
    return buckets + (size > 0)  # the last bucket, if it is still open

# %%
exercises.grade_bucket_count(ranks, ddp_buckets)

# %%
mlp_bytes = [4 * math.prod(shape) for shape in mlp]  # the large MLP, as above
assert sum(mlp_bytes[-2:]) == 41_000  # the output layer's weight and bias
for cap, calls in ranks.pull("cap_calls")[0]:
    print(f"bucket_cap_mb={cap}: predicted {ddp_buckets(mlp_bytes, cap)}, "
          f"measured {calls[-1]}")
    assert ddp_buckets(mlp_bytes, cap) == calls[-1]

# %% [markdown] lang="ja"
# ## 並べて比べ、モデルで予測する
#
# レッスン 05 の 1 ステップのモデルに、送るバイト数の割合 (圧縮率) を入れます。DDP の 1 ステップの
# 実測から、DDP の通信の時間 (α–β モデル) を引き、その方法が送るバイト数と回数での通信の時間を
# 足したものを、その方法の予測とします (`send_less.predicted_step_s`。Adam を使う 2 つは DDP + Adam を
# 基にします)。all-reduce はリングの時間で、ZeRO の broadcast は送り元が 1 回送る時間 (2 ランクでは
# α + S/β) で数えます。α と β は、ここで all-reduce を測って当てはめます。

# %% [markdown] lang="en"
# ## Side by side, and predicted by the model
#
# Put the share of bytes sent (the compression) into lesson 05's step model: a method's
# predicted step is DDP's measured step, minus DDP's communication time (the alpha-beta
# model), plus the communication time of the bytes and calls the method sends
# (`send_less.predicted_step_s`; the two with Adam start from DDP + Adam). All-reduces are
# priced as a ring, ZeRO's broadcasts as the source sending once (α + S/β on 2 ranks).
# Alpha and beta are fitted here on timed all-reduces.

# %%
# %%px
from labkit import comm

sizes = [4**k * 1024 for k in range(2, 8)]  # 16 KiB .. 16 MiB
seconds = comm.allreduce_sweep(sizes, repeat=5)

# %%
from labkit import comm

ab = comm.fit_alpha_beta(ranks.pull("sizes")[0], ranks.pull("seconds")[0], world_size=2)
print(f"alpha = {ab.alpha * 1e6:.0f} µs, beta = {ab.beta / 1e9:.2f} GB/s")
errors = {}
print(f"{'method':24} {'sent':>10} {'measured':>9} {'predicted':>9} {'error':>7}")
for name, r in by_method.items():
    base = by_method["DDP + Adam" if "Adam" in name else "DDP"]  # the same optimizer
    predicted = send_less.predicted_step_s(base["step_s"], base["sent"][-1], r["sent"][-1],
                                        ab, 2)
    errors[name] = (predicted - r["step_s"]) / r["step_s"]
    print(f"{name:24} {r['bytes'][-1]:>10,} {r['step_s'] * 1e3:>7.1f}ms "
          f"{predicted * 1e3:>7.1f}ms {errors[name]:>+7.0%}")

# %%
assert all(errors[f"PowerSGD r={r}"] < 0 for r in (1, 2, 4))  # slower than predicted
assert all(by_method[f"PowerSGD r={r}"]["step_s"] > plain["step_s"] / 2 for r in (1, 2, 4))
sending = ab.time(plain["bytes"][-1], 2)  # all of DDP's gradients, by the model
print(f"DDP's gradients take {sending * 1e3:.1f} ms to send, its step {plain['step_s'] * 1e3:.1f} ms")
assert sending < plain["step_s"]  # a part of a step: all that sending less can save

# %% [markdown] lang="ja"
# モデルは、送るバイト数が減った分だけ速くなると予測します。PowerSGD の実測は予測より遅く
# (誤差がマイナス)、1 ステップは DDP の半分の時間にもなりません (表の measured の列で、この実行の
# DDP と比べられます)。ここで当てはめた帯域 β では、DDP の勾配を送るのは 1 ステップより短い時間で、
# 通信量を減らして得られるのは、多くてもその時間です。
#
# 予測との差がどこから来るかは、このセルでは測っていません。モデルにないものは少なくとも 2 つあります。
# 1 つは圧縮の計算 (P と Q を求める行列の積と直交化) です。もう 1 つは重なりです。モデルは DDP の
# 通信の時間をすべて引きますが、DDP の 2 つのバケットの通信は逆伝播と重なっていて、その一部は
# もともと表に出ていません。PowerSGD はバケットが 1 つなので、通信はすべて逆伝播のあとです。
# モデルによれば、圧縮が効くのは通信が 1 ステップの大きな部分を占めるとき (遅いネットワーク、多くの
# ランク) で、そのときの通信の時間はレッスン 05 の探索ウィジェットで見積もれます。

# %% [markdown] lang="en"
# The model predicts that a method gets faster by the bytes it no longer sends.
# PowerSGD measured slower than predicted (a negative error), and a step is not even
# twice as fast as DDP's (the table's measured column compares it with DDP on this run).
# At the bandwidth beta fitted here, DDP's gradients take less than a step to send, and
# sending less can save that time at most.
#
# Where the difference from the prediction comes from, these cells do not measure. The
# model leaves out at least two things. One is the compression's compute (the products
# and the orthogonalization that make P and Q). The other is overlap: the model
# subtracts all of DDP's communication time, but DDP's two buckets overlap the backward
# pass, so part of that time was never exposed; PowerSGD has one bucket, so all of its
# communication comes after the backward pass. By the model, compression pays when
# communication takes a large part of a step (a slow network, many ranks); lesson 05's
# explorer estimates that communication time.

# %%
ranks.stop()
