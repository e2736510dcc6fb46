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
# # 06 no_sync の先へ: DDP を自分で書く
#
# `no_sync` は、送る回数を減らす方法の 1 つでした (レッスン 04)。その前に、DDP そのものが 1 ステップで
# 何をしているのかを、自分で書いて確かめます。
#
# 1. DDP を 50 行ほどで書く: 勾配のフック、逆順に詰めるバケット、非同期の all-reduce、
#    `optimizer.step()` の前の待ち合わせ、平均、`no_sync`
# 2. torch の DDP と比べる: 勾配が等しいこと、1 ステップの all-reduce の回数が同じこと、
#    通信が勾配の計算と重なること

# %% [markdown] lang="en"
# # 06 Beyond no_sync: DDP written by hand
#
# `no_sync` was one way to send less often (lesson 04). First, find out what DDP itself
# does in a step, by writing it yourself.
#
# 1. write DDP in about 50 lines: gradient hooks, buckets filled in reverse order, an
#    asynchronous all-reduce, a wait before `optimizer.step()`, averaging, `no_sync`
# 2. compare it with torch's DDP: equal gradients, as many all-reduces per step, and
#    communication that overlaps the gradient computation

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
# 1. 作るときに、ランク 0 のパラメータを全ランクに配る (`broadcast`)。全レプリカが同じ重みから始まります。
# 2. パラメータを**バケット**に分ける。順番は `model.parameters()` の**逆**です。逆伝播は最後の層の
#    勾配から計算するので、逆順に詰めると、先にそろうバケットから送れます。1 つのバケットは、
#    上限 (`bucket_cap_mb`) に達したところで閉じます。
# 3. 各パラメータに、勾配ができたときに呼ばれる**フック**を付ける。バケットの勾配がすべてそろったら、
#    その場でバケットの **all-reduce を始めます** (非同期。終わるのを待たずに逆伝播を続けます)。
# 4. 逆伝播の終わりで、すべての all-reduce を**待ち**、和を world size で割って**平均**にする
#    (torch の既定のフックは、足す前に割ります)。
# 5. `no_sync()` の中では 3 と 4 をせず、勾配は `.grad` にたまります。次に同期する逆伝播が、
#    たまった和を送ります。
#
# 下のクラス `ScratchDDP` は、この 5 つを書いたものです。torch の DDP との違いは 2 つです。
# 待ち合わせは、`backward()` の中ではなく、学習ループが `optimizer.step()` の前に呼ぶ
# `finish_sync()` で行います。バケットは最初のステップから固定です (torch の DDP は最初のステップを
# 1 つのバケットで送り、勾配ができた順にバケットを作り直します。レッスン 05)。

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
#    of a bucket's gradients are there, the hook **starts the bucket's all-reduce** at once
#    (asynchronously: the backward pass goes on without waiting for it).
# 4. At the end of the backward pass it **waits** for every all-reduce and divides the sum
#    by the world size: the **mean** (torch's default hook divides before summing).
# 5. Inside `no_sync()` it skips 3 and 4, and the gradients add up in `.grad`; the next
#    synchronized backward pass sends their sum.
#
# The class `ScratchDDP` below writes these five steps. It differs from torch's DDP in
# two ways. It waits not inside `backward()` but in `finish_sync()`, which the training
# loop calls before `optimizer.step()`. Its buckets are fixed from the first step (torch's
# DDP sends its first step as one bucket, then rebuilds the buckets in the order the
# gradients came: lesson 05).

# %%
# %%px
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from labkit import from_scratch

# %% [markdown] lang="ja"
# ### 演習: フックと待ち合わせを書く
#
# `ScratchDDP` の `__init__` (配る、バケットに分ける、フックを付ける)、`forward`、`no_sync` は
# 書いてあります。残りの 2 つのメソッドを書いてください。
#
# - `_grad_ready(p)`: パラメータ `p` の勾配ができるたびに autograd が呼びます。`no_sync()` の中なら
#   何もしません。そうでなければ、`p` のバケットの残り (`self.pending`) を 1 つ減らし、0 になったら
#   バケットの勾配を 1 本のテンソルにつなげて (`torch.cat`)、`dist.all_reduce(flat, async_op=True)` で
#   送り始め、`(バケット, flat, work)` を `self.in_flight` に入れます。
# - `finish_sync()`: 送った all-reduce をそれぞれ `work.wait()` で待ち、world size で割り、各パラメータの
#   `.grad` に書き戻します。最後に、次のステップのために `in_flight` と `pending` を元に戻します。
#
# 確認のセルは、あなたの `ScratchDDP` と torch の DDP を、同じモデルと同じデータで 2 つのランクで
# 動かします。勾配、all-reduce の回数、待つ時点、`no_sync` の中で送らないことを確かめ、違えば何が
# 違うかを言います。クラスはランクの上で定義するので、セルは `%%px` です。

# %% [markdown] lang="en"
# ### Exercise: write the hook and the wait
#
# `ScratchDDP`'s `__init__` (hand out, split into buckets, put on the hooks), `forward`
# and `no_sync` are written. Write the other two methods.
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
# ranks. It checks the gradients, the number of all-reduces, when they are waited for, and
# that nothing is sent inside `no_sync`, and says what differs. The class is defined on
# the ranks, so the cell is a `%%px` cell.

# %% tags=["exercise"]
# %%px
class ScratchDDP(nn.Module):
    """Data parallelism by hand: bucketed, asynchronous, averaged all-reduces."""

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

    def _grad_ready(self, p):  # autograd calls it once p.grad is complete
        pass  # TODO: count p off its bucket; send a complete bucket, don't wait

    def finish_sync(self):  # call after backward, before optimizer.step()
        pass  # TODO: wait, divide by the world size, copy back into .grad, reset

# %% tags=["solution"]
# %%px
class ScratchDDP(nn.Module):
    """Data parallelism by hand: bucketed, asynchronous, averaged all-reduces."""

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
assert all(s["max_diff"] <= 1e-6 for s in [*result["steps"], update])
assert result["steps"][0]["ddp_calls"] == 1  # torch's first step: one bucket
assert all(s["calls"] == s["ddp_calls"] for s in [*result["steps"][1:], update])
assert all(s["bytes"] == s["ddp_bytes"] for s in [*result["steps"], update])
assert update["calls_in_no_sync"] == 0

# %% [markdown] lang="ja"
# 勾配は torch の DDP と一致し (2 ランクでは、足してから割っても割ってから足しても、2 で割るのは
# 誤差なく計算できるので差は 0 です)、2 ステップ目からは all-reduce の回数も送るバイト数も同じです。
# 1 ステップ目だけ torch の DDP は 1 回で、`ScratchDDP` は最初から 8 回です。

# %% [markdown] lang="en"
# The gradients equal torch DDP's (with two ranks, summing then halving and halving then
# summing give the same: dividing by 2 is exact), and from step 2 on the number of
# all-reduces and the bytes sent are the same too. Only in step 1 does torch's DDP make
# one all-reduce where `ScratchDDP` makes 8 from the start.

# %% [markdown] lang="ja"
# ### 通信は計算と重なっているか
#
# フックは all-reduce を始めるだけで、逆伝播はその間に次の層の勾配を計算します。下のセルは、
# 各 all-reduce が終わる前に、逆伝播がほかの勾配をいくつ書いたかを数えます (`overlapped`: 書かれた
# 勾配が 1 つでもあった all-reduce の数)。フックの中で `work.wait()` を呼ぶと、待つあいだ逆伝播が
# 止まるので、この数は 0 になります (tests/test_from_scratch.py がそれを確かめます)。図は、レッスン 05 と
# 同じ描き方で、最後のステップの各 all-reduce の時間を示します。

# %% [markdown] lang="en"
# ### Does communication overlap the computation?
#
# The hook only starts the all-reduce; meanwhile the backward pass computes the next
# layers' gradients. The cell below counts, for each all-reduce, how many other
# gradients the backward pass wrote before it ended (`overlapped`: the all-reduces during
# which at least one was written). Calling `work.wait()` inside the hook stops the
# backward pass while it waits, and this count drops to 0 (tests/test_from_scratch.py
# checks that). The plot shows each all-reduce of the last step, drawn as in lesson 05.

# %% tags=["nbval-ignore-output"]
# %%px
for i, s in enumerate(result["steps"], start=1):
    print(f"rank {rank}, step {i}: {s['overlapped']} of {s['calls']} all-reduces ran "
          f"while the backward pass wrote more gradients")
assert all(s["overlapped"] >= 1 for s in result["steps"])
assert all(s["waited_before_grads"] == 0 for s in result["steps"])

# %%
fig = plots.timeline(ranks.pull("result")[0]["records"], title="scratch_overlap_title",
                     end_label="sync_finished")

# %%
ranks.stop()
