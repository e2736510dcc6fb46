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
# # 05 通信のコスト
#
# DDP が 1 回の同期で送るのは全パラメータの勾配です (レッスン 03)。その時間を測り、予測できる
# モデルにします。
#
# このレッスンを終えると、次のことができます。
#
# - 測った all-reduce の時間から**アルゴリズム帯域** (algbw) と**バス帯域** (busbw) を出し、リング型では
#   各ランクが 2(n−1)/n × S バイトを送る理由を説明できる
# - **α–β モデル** (固定の遅延 α、帯域 β) を実測に当てはめ、別の大きさやランク数の時間を予測できる
# - DDP が勾配を**バケット**にまとめる理由 (呼び出しごとの α と、逆伝播との重なり) を説明し、
#   `DDP(model)` が送るバケットを読める
# - 通信のタイムラインで、計算に**隠れた**通信と**表に出た**通信を見分けられる
# - 1 回の更新の時間を c、s、o、K と `no_sync` から予測できる

# %% [markdown] lang="en" tags=["outcomes"]
# # 05 Communication cost
#
# One DDP synchronization sends the gradients of every parameter (lesson 03). Here we
# time it and turn the times into a model that predicts.
#
# After this lesson you can:
#
# - compute **algorithm bandwidth** (algbw) and **bus bandwidth** (busbw) from a timed
#   all-reduce, and say why each rank of a ring sends 2(n−1)/n × S bytes;
# - fit the **alpha-beta model** (latency alpha, bandwidth beta) and predict another
#   size or number of ranks;
# - explain why DDP packs gradients into **buckets** (alpha per call, overlap with the
#   backward pass) and read the buckets `DDP(model)` sends;
# - read a communication timeline: what is **hidden** behind the backward pass and what
#   is **exposed**;
# - predict the time of an update from c, s, o, K and `no_sync`.

# %%
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %% [markdown] lang="ja" tags=["core"]
# ## リング all-reduce を 1 ステップずつ
#
# 4 つのランクでリング all-reduce を手で実行します (`labkit.ring.all_reduce`)。各ランクはテンソルを
# 4 つのチャンクに切り、6 ステップのそれぞれで 1 つのチャンクを右隣へ送り、左隣から 1 つ受け取ります。
# 前半の 3 ステップ (reduce-scatter) では受け取った部分和を自分のチャンクに足し、後半の 3 ステップ
# (all-gather) では完成したチャンクを受け取ります。
#
# **予想してから実行:** reduce-scatter が終わったとき (3 ステップのあと)、各ランクで 4 ランク分の和が
# そろっているチャンクはいくつでしょうか?

# %% [markdown] lang="en" tags=["core"]
# ## A ring all-reduce, step by step
#
# Run a ring all-reduce by hand on four ranks (`labkit.ring.all_reduce`). Each rank
# cuts its tensor into four chunks and, in each of 6 steps, sends one chunk to its
# right neighbour and receives one from its left: in the first three steps (the
# reduce-scatter) it adds the partial sum it receives to its own chunk, in the last
# three (the all-gather) it keeps the finished chunk.
#
# **Predict, then run:** when the reduce-scatter ends (after 3 steps), how many chunks
# of each rank hold the sum of all four ranks?

# %%
from labkit import cluster, diagrams, ring

with cluster.start(4) as four:  # four ranks for this picture, stopped after it
    records = four.run(ring.all_reduce, 12)

# %% tags=["hide-input"]
for r in records:
    assert max(abs(a - b) for a, b in zip(r["after"], r["expected"], strict=True)) < 1e-5
    assert sum(c == 4 for c in r["counts"][3]) == 1  # one whole chunk after 3 steps
# each rank sends 6 chunks of a quarter: 2(n - 1)/n of the tensor, 1.5 x on 4 ranks
assert sum(r["sent_bytes"] for r in records) == 4 * 1.5 * records[0]["tensor_bytes"]
fig = diagrams.ring(records)

# %% [markdown] lang="ja"
# 各ランクは 1 ステップにテンソルの 1/n を送り、2(n − 1) ステップで 2(n − 1)/n を送ります (4 ランクで
# 1.5 倍、2 ランクで 1 倍)。これが下の busbw の係数です。

# %% [markdown] lang="en"
# Each rank sends 1/n of the tensor per step, 2(n − 1)/n of it in 2(n − 1) steps: 1.5
# times on four ranks, once on two. That is busbw's factor below.

# %%
from labkit import cluster, comm, exercises, plots

ranks = cluster.start(2, background=True)  # the ranks boot while you read

# %% [markdown] lang="ja" tags=["core"]
# ## all-reduce を測る
#
# 2 つのランクで、大きさを 4 倍ずつ変えながら all-reduce を 7 回ずつ測ります (図の点が 1 回ずつ、実線が
# 中央値、破線が下の α–β モデル)。nccl-tests の定義では、大きさ S、時間 t、ランク数 n のとき
#
# - アルゴリズム帯域 algbw = S / t
# - バス帯域 busbw = algbw × 2(n−1)/n
#
# です。リングの各ランクは 2(n−1)/n × S バイトを時間 t で送るので、busbw は各ランクの回線が運ぶ帯域で、
# 回線の速さと比べられます。

# %% [markdown] lang="en" tags=["core"]
# ## Timing all-reduce
#
# On two ranks, time an all-reduce 7 times for each size, sizes growing four-fold (in
# the figure a point per round, their median solid, the alpha-beta model below dashed).
# nccl-tests defines, for size S, time t and n ranks,
#
# - algorithm bandwidth algbw = S / t
# - bus bandwidth busbw = algbw × 2(n−1)/n
#
# Each rank of a ring sends 2(n−1)/n × S bytes in time t, so busbw is what each rank's
# link carries, and compares with a link's speed.

# %%
# %%px
from labkit import comm

sizes = [4**k * 1024 for k in range(9)]  # 1 KiB .. 64 MiB
rounds = comm.allreduce_rounds(sizes, repeat=7)  # 7 timed rounds of each size

# %%
import statistics

sizes, rounds = ranks.pull("sizes")[0], ranks.pull("rounds")[0]
seconds = [statistics.median(r) for r in rounds]
ab = comm.fit_alpha_beta(sizes, seconds, world_size=2)
print(f"alpha = {ab.alpha * 1e6:.0f} µs, beta = {ab.beta / 1e9:.2f} GB/s")

# %% tags=["hide-input"]
assert [len(r) for r in rounds] == [7] * len(sizes)  # every round rank 0 timed
assert ab.alpha >= 0 and ab.beta > 0
assert len(sizes) == 9 and sizes[0] == 1024 and sizes[-1] == 64 * 1024 * 1024
print(f"{'size':>10} {'time':>10} {'algbw':>11} {'busbw':>11} {'model':>10}")
for size, t in zip(sizes, seconds, strict=True):
    algbw, busbw = comm.bandwidths(size, t, 2)
    print(f"{size:>10} {t * 1e3:>8.3f}ms {algbw / 1e9:>7.3f}GB/s {busbw / 1e9:>7.3f}GB/s "
          f"{ab.time(size, 2) * 1e3:>8.3f}ms")
fig = plots.rounds(
    {labkit.t("measured"): (sizes, [[t * 1e3 for t in r] for r in rounds])},
    lines={labkit.t("alpha_beta_model"): (sizes, [ab.time(s, 2) * 1e3 for s in sizes])},
    xlabel="message_bytes", ylabel="allreduce_ms", title="allreduce_rounds_title",
    logx=True, logy=True, x_bytes=True)

# %% [markdown] lang="ja"
# busbw の係数を実測で確かめます。16 MiB の all-reduce 1 回で各ランクが送ったバイト数を OS に数えさせ、
# S で割ると、2(n−1)/n (2 ランクでは 1) になるはずです。rank 0 に集めてから配り直す方式なら、この比は
# ランクごとに違います。
#
# <details><summary>測り方</summary>
#
# Linux の `/proc/self/io` の `wchar` (プロセスがソケットなどに書き込んだバイト数) で数えます。`/proc` の
# ない macOS と Windows では数えられないので、セルはそう表示し、この比を確かめません。
#
# </details>

# %% [markdown] lang="en"
# Check busbw's factor on measured data: the bytes each rank sends in one 16 MiB
# all-reduce, counted by the operating system, over S, should be 2(n−1)/n (1 on two
# ranks). Gathering on rank 0 and sending back would give each rank a different ratio.
#
# <details><summary>How this was measured</summary>
#
# Linux's `/proc/self/io` (`wchar`: the bytes a process has written, to sockets
# included) counts them. macOS and Windows have no `/proc`: there the cell says it
# cannot count, and checks no ratio.
#
# </details>

# %%
# %%px
counted = comm.can_count_bytes_written()  # Linux's /proc/self/io
share = comm.sent_per_allreduce(16 * 2**20) if counted else None
if counted:
    print(f"rank {rank}: sent {share} × S per all-reduce")

# %% tags=["hide-input"]
import math

shares = ranks.pull("share")
if not comm.can_count_bytes_written():  # macOS, Windows
    assert shares == [None, None]
    print(labkit.t("bytes_sent_not_counted"))
for share in shares:
    if share is not None:
        assert math.isclose(share, comm.ring_factor(2), rel_tol=0.01), share
        t = seconds[sizes.index(16 * 2**20)]
        algbw, busbw = comm.bandwidths(16 * 2**20, t, 2)
        # busbw is what each rank's link carried per second, measured:
        assert math.isclose(busbw, share * 16 * 2**20 / t, rel_tol=0.01)

# %% [markdown] lang="ja"
# モデルはリング型を仮定して、時間 = 2(n−1) × α + 2(n−1)/n × S / β とします (2 ランクでは
# 2α + S/β)。α は 1 ステップの固定の遅延、β は 1 本の回線の帯域で、小さなメッセージのほぼ一定の時間が
# 2α、大きなメッセージでの傾きが 1/β です。ここでの回線は同じマシンのループバックなので、β は GPU の
# 回線よりずっと小さな値です。
#
# **このモデルが扱わないもの:** 木構造の all-reduce、セグメントに分けて送受信を重ねる実装、回線の共有
# による競合です。2 ランクで当てはめて多くのランクへ延ばした値は**モデルによる予測**です。
#
# <details><summary>測り方</summary>
#
# torch 2.13 の gloo は CPU のテンソルの all-reduce にアルゴリズムを指定せず、gloo の既定のリング型が
# 動きます (3 ランクで各ランクが S の 4/3 倍を送ることを tests/test_comm.py が数えます)。そのリングは
# データをセグメントに分けます (gloo/allreduce.cc)。バイト数の比は Linux では tests/test_comm.py も
# 確かめます。
#
# </details>

# %% [markdown] lang="en"
# The model assumes a ring: time = 2(n−1) × alpha + 2(n−1)/n × S / beta (2 alpha +
# S / beta on two ranks), with alpha the fixed latency of one step and beta the
# bandwidth of one link. The nearly constant time of small messages is 2 alpha; the
# slope for large ones is 1/beta. The link here is loopback on one machine, so beta is
# far below a GPU link's.
#
# **What the model leaves out:** tree all-reduces, rings that cut the data into
# segments and overlap their sends, and ranks competing for a shared link. A value
# fitted on two ranks and extended to many is a **prediction by the model**.
#
# <details><summary>How this was measured</summary>
#
# For CPU tensors torch 2.13 asks gloo for no particular algorithm, and gloo's default
# ring runs (tests/test_comm.py counts each of 3 ranks sending 4/3 of S); that ring cuts
# the data into segments (gloo/allreduce.cc). tests/test_comm.py also checks the byte
# ratio on Linux.
#
# </details>

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## 演習: all-reduce の時間を予測する
#
# 上で当てはめた α (`ab.alpha`、1 ステップの秒数) と β (`ab.beta`、バイト/秒) で、約 210 万
# パラメータ (`2_120_714` 個、float32) の勾配を **8 ランク**のリングで all-reduce する時間を計算し、
# 秒で `allreduce_s` に入れてください。`ab.time` は使わずに、モデルの式を書きます。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## Exercise: predict an all-reduce
#
# With alpha (`ab.alpha`, seconds per step) and beta (`ab.beta`, bytes per second) fitted
# above, compute how long a ring all-reduce of the gradients of about 2.1 million
# parameters (`2_120_714` float32 values) takes on **8 ranks**, in seconds, in
# `allreduce_s`. Write the model's formula rather than calling `ab.time`.

# %% tags=["exercise"]
n_params = 2_120_714  # the 2.1 M-parameter MLP below; one float32 gradient per parameter
allreduce_s = None  # TODO: seconds of one all-reduce over 8 ranks, by the model

# %% tags=["solution"]
nbytes = 4 * n_params  # float32: 4 bytes each
allreduce_s = 2 * (8 - 1) * ab.alpha + 2 * (8 - 1) / 8 * nbytes / ab.beta

# %%
exercises.grade_allreduce_prediction(ab, n_params, 8, allreduce_s)

# %% [markdown] lang="ja" tags=["core"]
# ## バケット: DDP が勾配をまとめる理由
#
# DDP が勾配を 1 つずつ送らず、全部がそろうのを待ちもしない理由は 2 つです。
#
# - **呼び出しのたびに α を払います。** P 個のテンソルを 1 つずつ送ると固定の部分を P 回払います。
#   次のセルが、この実行の α と β で計算します。
# - **全部を待つと、逆伝播との重なりを捨てます。** 逆伝播は最後の層から勾配を計算するので、早くそろった
#   勾配は前の層の計算と同時に送れます。
#
# そこで DDP は、逆伝播が勾配を出す順に勾配を**バケット**に詰め、バケットがそろうたびに all-reduce を
# 1 回実行します。大きすぎるバケットは通信の始まりを遅らせ、小さすぎると α がかさみます。

# %% [markdown] lang="en" tags=["core"]
# ## Buckets: why DDP groups gradients
#
# DDP neither sends the gradients one by one nor waits for all of them, for two
# reasons.
#
# - **Every call pays alpha.** Sending P tensors one by one pays the fixed part P
#   times. The next cell computes it with this run's alpha and beta.
# - **Waiting for every gradient forfeits overlap.** Backward computes the last layer's
#   gradients first; those can travel while the earlier layers still compute.
#
# So DDP packs the gradients, in the order backward produces them, into **buckets**
# and runs one all-reduce each time a bucket is complete. Too large a bucket starts
# communication late; too small a bucket adds up alpha.

# %%
from labkit import workload

big = workload.Config(hidden=1024, depth=3, accum_steps=1)
tensor_bytes = [4 * p.numel() for p in workload.make_model(big).parameters()]
one_by_one = sum(ab.time(b, 2) for b in tensor_bytes)
together = ab.time(sum(tensor_bytes), 2)
print(f"{len(tensor_bytes)} tensors, {sum(tensor_bytes) / 2**20:.2f} MiB: one by one "
      f"{one_by_one * 1e3:.2f} ms, in one call {together * 1e3:.2f} ms (alpha-beta model)")

# %% tags=["hide-input"]
# The same bytes; the difference is (P - 1) fixed parts 2 alpha.
assert math.isclose(one_by_one - together, (len(tensor_bytes) - 1) * ab.time(0, 2),
                    rel_tol=1e-6, abs_tol=1e-12)
assert one_by_one >= together

# %% [markdown] lang="ja"
# ### `DDP(model)` が実際に送るもの
#
# torch のドキュメントは `bucket_cap_mb` の既定値を 25 としていますが、`DDP(model)` は
# `DDP(model, bucket_cap_mb=25)` と同じではありません。210 万パラメータ (8.09 MiB) の MLP を両方で包み、
# 送られたバケットの大きさを通信フック (`comm_counting.CommCounter`) でステップごとに記録します
# (torch の MB は MiB = 2^20 バイトです)。
#
# **予想してから実行:** `DDP(model)` は 1 ステップ目にいくつのバケットを送るでしょうか? 2 ステップ目は?
# `bucket_cap_mb=25` ではどうでしょうか?

# %% [markdown] lang="en"
# ### What `DDP(model)` really sends
#
# torch documents 25 as the default of `bucket_cap_mb`, yet `DDP(model)` is not
# `DDP(model, bucket_cap_mb=25)`. Wrap the 2.1 M-parameter MLP (8.09 MiB) both ways and
# record the size of every bucket sent, step by step, with a communication hook
# (`comm_counting.CommCounter`). (Torch's "MB" means MiB, 2^20 bytes.)
#
# **Predict, then run:** how many buckets will `DDP(model)` send at step 1? At step 2?
# And with `bucket_cap_mb=25`?

# %%
# %%px
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import buckets, comm_counting, models, workload


def log_buckets(cfg, steps=3, **ddp_kwargs):
    """Bytes of each bucket DDP sent, per step, on this rank's first micro-batch."""
    model = DDP(workload.make_model(cfg), **ddp_kwargs)
    log = comm_counting.CommCounter(per_step=True).attach(model)
    X, y = workload.micro_batches(workload.make_dataset(cfg), cfg, 0, rank, world_size)[0]
    for _ in range(steps):
        log.step()
        models.MyLoss()(model(X), y).backward()
    return log.steps, 4 * models.count_params(model.module)


big = workload.Config(hidden=1024, depth=3, accum_steps=1)
seen = {}
ways = {"DDP(model)": {}, "bucket_cap_mb=25": {"bucket_cap_mb": 25}}
for name, kwargs in ways.items():
    seen[name], param_bytes = log_buckets(big, **kwargs)
assert seen["DDP(model)"][1][0] >= dist._DEFAULT_FIRST_BUCKET_BYTES  # 1 MiB
# The buckets a training step sends, for the cells below (the tiny MLP's too).
buckets_used = {"tiny MLP": log_buckets(workload.Config(accum_steps=1))[0][-1],
                "2.1 M-parameter MLP": seen["DDP(model)"][-1]}

# %%
# %%px
for name, steps in seen.items():
    for step, sizes in enumerate(steps, start=1):
        print(f"{name}, step {step}: {len(sizes)} bucket(s), "
              + " + ".join(f"{b / 2**20:.2f}" for b in sizes) + " MiB")
# DDP(model): one bucket, then from step 2 a rebuilt split; the sizes add up to
# every gradient's bytes in each step.
buckets.check_buckets_rebuilt(seen["DDP(model)"], param_bytes)
assert seen["bucket_cap_mb=25"] == [[param_bytes]] * 3  # one bucket every step

# %% [markdown] lang="ja"
# 1 ステップ目の前、DDP は勾配がそろう順を知らないので、全勾配を **1 つのバケット**にして逆伝播の
# あとに送り、2 ステップ目の前に見た順でバケットを**作り直します**。最初のバケットの上限は通信を早く
# 始めるために 1 MiB、残りは 25 MiB ですが、`bucket_cap_mb` を渡すと最初の上限もその値になり、25 なら
# 毎ステップ 1 つに収まるので、「既定は 25 MB」は正確ではありません。
#
# <details><summary>測り方</summary>
#
# torch 2.13 の `torch/nn/parallel/distributed.py` で読めます。1 ステップ目を 1 つのバケットにする理由は
# `_ddp_init_helper` のコメント (ほかの集団通信があるモデルや、一部のランクで使われないパラメータが
# あるモデルで、ランクどうしの集団通信の組み合わせがずれるのを防ぐ) にあり、上限は
# `_BucketCapacityConfig.compute_bucket_size_limits` の `[sys.maxsize]` です (`find_unused_parameters`
# を使わないときと `static_graph=True` のとき)。作り直しは `_rebuild_buckets`、最初の上限は
# `dist._DEFAULT_FIRST_BUCKET_BYTES` です。
#
# </details>

# %% [markdown] lang="en"
# Before step 1 DDP does not know in which order the gradients become ready, so it
# sends them all as **one bucket** after the backward pass, and before step 2
# **rebuilds** the buckets in the order it saw: the first capped at 1 MiB so that
# communication starts early, the rest at 25 MiB. Passing `bucket_cap_mb` caps the
# first bucket too, so with 25 everything fits in one bucket every step, and "25 MB by
# default" is not exact.
#
# <details><summary>How this was measured</summary>
#
# It can be read in torch 2.13's `torch/nn/parallel/distributed.py`. Why step 1 has one
# bucket is the comment in `_ddp_init_helper` (in a model with other collectives in its
# backward or parameters unused on some ranks, an early all-reduce could match a
# different collective on another rank); the limit is `[sys.maxsize]` in
# `_BucketCapacityConfig.compute_bucket_size_limits` (without `find_unused_parameters`,
# and with `static_graph=True`). The rebuild is `_rebuild_buckets`, the first limit
# `dist._DEFAULT_FIRST_BUCKET_BYTES`.
#
# </details>

# %% [markdown] lang="ja" tags=["core"]
# ## 勾配の計算と通信の重なり
#
# all-reduce はバケットがそろった時点で始まるので、通信は逆伝播の**途中で**始まり、残りの計算と
# 重なります。1 MB の重みが 7 つある MLP を上限 1 MB で包み、4 ステップ分、各バケットの all-reduce の
# 始まりと終わりを、セルに書いた通信フック `allreduce_hook` (DDP の既定のフックと同じ仕事) で記録します。
#
# 勾配の計算が終わる前に走った通信は計算に**隠れ**、あとに走った通信は**表に出て**ステップを
# 長くします。`buckets.check_overlap` は、2 ステップ目からどのステップにも隠れた通信があることを
# 確かめます。
#
# **予想してから実行:** 1 ステップ目は何回 all-reduce するでしょうか? 作り直したあとのステップは?
#
# <details><summary>測り方</summary>
#
# この見方は時刻だけを数え、隠れた通信が同じコアや回線を使う計算を遅くしたかどうかは数えません。
# 勾配の計算が終わった時刻は、各パラメータの `register_post_accumulate_grad_hook` (勾配が書き込まれた
# 直後に呼ばれるフック) の最後の呼び出しです。`loss.backward()` が戻る時刻ではありません。DDP はそこで
# 全バケットの all-reduce を待つからです。始まりの時刻は DDP が gloo に渡した時刻で、先の all-reduce が
# 終わるまで待つこともあります。all-reduce を最後のバケットまで止めておく通信フックでは `check_overlap`
# が失敗することを tests/test_comm.py が確かめます。
#
# </details>

# %% [markdown] lang="en" tags=["core"]
# ## Communication overlaps the gradient computation
#
# A bucket's all-reduce starts as soon as the bucket is complete, so communication
# starts **during** the backward pass and overlaps the computation that remains. Wrap an
# MLP with seven 1 MB weights with a 1 MB limit and record for 4 steps when each
# bucket's all-reduce starts and ends, with the comm hook written in the cell,
# `allreduce_hook` (the work of DDP's default hook).
#
# Communication that runs before the gradient computation ends is **hidden** behind it;
# what runs after is **exposed** and lengthens the step. `buckets.check_overlap` asserts
# that every step after the first hid some communication.
#
# **Predict, then run:** how many all-reduces will step 1 make? And the steps after the
# rebuild?
#
# <details><summary>How this was measured</summary>
#
# This view counts only times, not whether hidden communication slowed the computation
# it shares cores or links with. The gradient computation ends at the last call of each parameter's
# `register_post_accumulate_grad_hook` (a hook called right after its gradient is
# written), not at the return of `loss.backward()`: DDP waits there for every bucket's
# all-reduce. A start is when DDP hands the bucket to gloo; it may wait there for
# earlier ones. tests/test_comm.py checks that a comm hook holding every all-reduce
# until the last bucket makes `check_overlap` fail.
#
# </details>

# %%
# %%px
cfg = workload.Config(hidden=512, depth=8, bucket_cap_mb=1, accum_steps=1)


def allreduce_hook(timeline, bucket):  # DDP calls it with each bucket once it is full
    return timeline.allreduce(bucket.buffer())  # starts the all-reduce, returns its future


timeline = buckets.bucket_timeline(rank, world_size, cfg, allreduce_hook, steps=4)

# %% tags=["hide-input"]
# %%px
for i, step in enumerate(timeline, start=1):
    print(f"rank {rank}, step {i}: {len(step['events'])} all-reduce(s); gradients done "
          f"at {step['grad_end'] * 1e3:.1f} ms, backward() returned at "
          f"{step['backward_end'] * 1e3:.1f} ms; hidden {step['hidden_s'] * 1e3:.1f} ms, "
          f"exposed {step['exposed_s'] * 1e3:.1f} ms")
assert len(timeline[-1]["events"]) > 3  # several buckets after the rebuild
buckets.check_overlap(timeline)  # every step after the first hid some communication

# %% tags=["hide-input"]
timeline = ranks.pull("timeline")[0]
fig = plots.timeline(timeline, title="overlap_title")

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## バケットの上限と通信の始まり
#
# **見るところ:** 最初の緑の棒が始まる位置です。バケットが多いほど通信は逆伝播の早くに始まり、
# バケットが 1 つなら最後の勾配まで待ちます。同じモデルの 4 ステップ目で、`bucket_cap_mb` だけを
# 1 MB、既定 (`DDP(model)`)、25 MB (モデル全体より大きい) と変えます。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## The bucket cap and when communication starts
#
# **Look at** where the first green bar starts: the more buckets, the earlier
# communication starts; one bucket waits for the last gradient. Step 4 of one model;
# only `bucket_cap_mb` changes: 1 MB, the default (`DDP(model)`), 25 MB (all of it).

# %%
# %%px
import dataclasses

by_cap = [("bucket_cap_mb=1", timeline[-1])] + [  # step 4 of each, caps growing
    (name, buckets.bucket_timeline(rank, world_size, dataclasses.replace(
        cfg, bucket_cap_mb=cap), allreduce_hook, steps=4)[-1])
    for name, cap in [("DDP(model)", None), ("bucket_cap_mb=25", 25)]]

# %% tags=["hide-input"]
from labkit import buckets

by_cap = ranks.pull("by_cap")[0]
# Fewer all-reduces as the cap grows; one bucket starts after the last gradient.
buckets.check_by_cap([step for _, step in by_cap])
fig = plots.timelines({labkit.t("cap_panel", name=name, n=len(step["events"])): step
                       for name, step in by_cap}, title="by_cap_title")

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## 1 回の更新の時間を予測する
#
# K 個のマイクロバッチで 1 回更新する時間は、ほぼ次の 3 つで決まります。
#
# - c: マイクロバッチ 1 つの順伝播と逆伝播
# - s: 同期 1 回 (all-reduce と DDP 自身の仕事)
# - o: オプティマイザのステップなど、更新ごとの残り
#
# 全マイクロバッチで同期すると K·c + K·s + o、`no_sync` なら K·c + s + o です。
# 小さな MLP (2,110 パラメータ) と 210 万パラメータの MLP で、K = 1, 2, 4 の実測から c, s, o を求め、
# 見ていない K = 8 を予測して実測と比べます。**このモデルが扱わないもの:** 通信と計算の重なりと、
# マイクロバッチごとの仕事の違い (下で見ます) です。
#
# <details><summary>測り方</summary>
#
# セルは、大きなモデルの最大の誤差が 50% 未満であることを確かめます。小さなモデルの更新は 1〜2 ms と
# 短く、all-reduce の待ちの揺れが大きな部分を占めるので、誤差は表示するだけにして、K = 8 で `no_sync`
# の更新が全同期より 1.2 倍以上速いことを確かめます。中央値をとる巡の数は、小さなモデル 15、
# 大きなモデル 9 です。このマシンでは、大きなモデルの誤差はコアを 1 つ忙しくしても 10〜21% でした。小さなモデルの誤差は 6 回の実行で 9〜58% とばらつき、
# K = 8 の `no_sync` の効果は 3.8〜6.7 倍 (`no_sync` を外すと 0.97〜1.00 倍) で、2 コアで負荷平均が 8 ほどの
# ときに一度 1.33 倍まで下がりました。1.2 倍はその両方のあいだにあります。
#
# </details>

# %% [markdown] lang="en" tags=["deep-dive"]
# ## Predicting the time of an update
#
# An update of K micro-batches costs, to a good approximation,
#
# - c: forward and backward of one micro-batch
# - s: one synchronization (the all-reduce and DDP's own work)
# - o: the optimizer step and the rest of an update
#
# Synchronizing every micro-batch gives K·c + K·s + o; `no_sync` gives K·c + s + o.
# For a tiny MLP (2,110 parameters) and a 2.1 M-parameter MLP, fit c, s and o on the
# measurements for K = 1, 2, 4, predict the unseen K = 8, and compare. **What the model
# leaves out:** overlap, and micro-batches that do different work (see below).
#
# <details><summary>How this was measured</summary>
#
# The cell asserts that the large model's worst error stays under 50%. The tiny model's
# update lasts 1-2 ms, much of it the jittery wait of an all-reduce, so the cell prints
# its error and asserts what holds anyway: at K = 8, a synced update takes at least
# 1.2 times as long as a `no_sync` one. The medians are over 15 rounds for the tiny
# model and 9 for the large one. On this machine the large model's error stayed at
# 10-21% even with a core kept busy; the tiny model's ranged over 9-58% in six runs,
# and its `no_sync` saving at K = 8 over 3.8-6.7x (0.97-1.00x with `no_sync` removed);
# with a load average of about 8 on two cores it fell once to 1.33x. 1.2x lies between.
#
# </details>

# %%
# %%px
# Medians over rounds: the tiny model's steps last milliseconds, where timing
# jitter is largest, so it gets more rounds (and costs little).
step_times = {name: comm.step_times_by_k(rank, world_size, hidden, depth, repeat=repeat)
              for name, (hidden, depth, repeat) in {"tiny MLP": (100, 1, 15),
                                                    "2.1 M-parameter MLP": (1024, 3, 9)}.items()}

# %%
step_times = ranks.pull("step_times")[0]
fitted = {name: comm.fit_step_model(times, fit_on=(1, 2, 4))  # K = 8 left unseen
          for name, times in step_times.items()}
for name, m in fitted.items():
    print(f"{name}: c = {m.compute_s * 1e3:.2f} ms, s = {m.sync_s * 1e3:.2f} ms, "
          f"o = {m.optimizer_s * 1e3:.2f} ms")

# %%
measured, predicted, errors = {}, {}, {}
for name, times in step_times.items():
    model = fitted[name]
    errors[name] = comm.max_rel_error(model, times)
    ks = sorted(times)
    for mode in ("sync", "no_sync"):
        measured[f"{name}, {mode}"] = (ks, [getattr(times[k], mode) * 1e3 for k in ks])
        predicted[f"{name}, {mode}"] = (ks, [model.predict(k, mode == "no_sync") * 1e3
                                             for k in ks])
    print(f"{name}: worst error {errors[name]:.0%}")
fig = plots.measured_vs_model(measured, predicted, xlabel="accum_k",
                              ylabel="step_time_ms", title="model_vs_measured")
# The unseen K = 8 too: a model missing s or o is off by more than 50%.
# The tiny model's error is printed, not asserted; its no_sync saving is.
assert errors["2.1 M-parameter MLP"] < 0.5, errors
small_k8 = step_times["tiny MLP"][8]
assert small_k8.sync > 1.2 * small_k8.no_sync, small_k8  # 1.0 without no_sync

# %% [markdown] lang="ja"
# c、s、o は負にならないように求めますが、o が 0 になることがあります。`zero_grad()` のあとの最初の逆伝播は
# 勾配を書き込むだけで、2 回目からは前の勾配に足し込む (全勾配をもう 1 回読んで書く) ので、最初の
# マイクロバッチは仕事が少なく、その分がモデルでは o を小さく見せます。大きなモデルで、1 プロセスで確かめます。

# %% [markdown] lang="en"
# c, s and o are fitted non-negative, yet o can come out 0. After `zero_grad()` the
# first backward only writes the gradients; from the second on, each adds to them
# (reading and writing every gradient once more). The first micro-batch does less
# work, which in the model makes o look smaller. Check it in one process with the
# large model.

# %%
import time

import torch

from labkit import models, workload

net = workload.make_model(workload.Config(hidden=1024, depth=3))
criterion = models.MyLoss()
X, y = torch.randn(16, 10), torch.randn(16, 10)
first, later = [], []
for _ in range(20):
    net.zero_grad()  # the gradients are gone (None)
    t0 = time.perf_counter()
    criterion(net(X), y).backward()  # writes the gradients
    first.append(time.perf_counter() - t0)
    written = [(p.grad.data_ptr(), p.grad.clone()) for p in net.parameters()]
    t0 = time.perf_counter()
    criterion(net(X), y).backward()  # adds to them
    later.append(time.perf_counter() - t0)
    for p, (ptr, grad) in zip(net.parameters(), written, strict=True):
        assert p.grad.data_ptr() == ptr  # the same tensor, added to in place
        torch.testing.assert_close(p.grad, 2 * grad)  # the sum of both micro-batches

# %% tags=["hide-input"]
assert len(first) == len(later) == 20  # every round timed, drawn
fig = plots.rounds({labkit.t("measured"): (
    [labkit.t("first_backward"), labkit.t("second_backward")],
    [[t * 1e3 for t in first], [t * 1e3 for t in later]])},
    xlabel="", ylabel="fwd_bwd_ms", title="first_vs_second_title")
print("fitted o: " + ", ".join(f"{name} {m.optimizer_s * 1e3:.2f} ms"
                               for name, m in fitted.items()))

# %% [markdown] lang="ja"
# 同期 1 回のコスト s のうち、all-reduce そのものはどれだけでしょうか。上で記録したバケットごとに
# α–β モデルで all-reduce の時間を足し、s と比べます。残りは DDP 自身の仕事 (勾配をバケットに集めて
# 戻す処理など) とランクどうしの同期待ちです。

# %% [markdown] lang="en"
# How much of one synchronization's cost s is the all-reduce itself? Add up the
# alpha-beta time of each bucket recorded above and compare with s. The rest is DDP's
# own work (gathering gradients into buckets and back) and the ranks waiting for each
# other.

# %%
buckets_used = ranks.pull("buckets_used")[0]
allreduce_s = {name: sum(ab.time(b, 2) for b in sizes)
               for name, sizes in buckets_used.items()}
for name, sizes in buckets_used.items():
    s_fit = fitted[name].sync_s
    share = allreduce_s[name] / s_fit if s_fit else float("nan")
    print(f"{name}: s = {s_fit * 1e3:.2f} ms, of which the all-reduce of {len(sizes)} "
          f"bucket(s) is {allreduce_s[name] * 1e3:.2f} ms ({share:.0%})")

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## 演習: K = 16 の更新を予測する
#
# 大きなモデル (210 万パラメータの MLP) の c、s、o から、K = 16 の 1 回の更新の時間を、全マイクロバッチで
# 同期する場合 (`sync_s`) と `no_sync` の場合 (`no_sync_s`) について、秒で計算してください。
# `predict` は使わずに、式を書きます。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## Exercise: predict an update with K = 16
#
# From c, s and o of the large model (the 2.1 M-parameter MLP), compute the time of one update with
# K = 16, in seconds, when every micro-batch synchronizes (`sync_s`) and with `no_sync`
# (`no_sync_s`). Write the formulas rather than calling `predict`.

# %% tags=["exercise"]
fit = fitted["2.1 M-parameter MLP"]
c, s, o = fit.compute_s, fit.sync_s, fit.optimizer_s
K = 16
sync_s = None  # TODO: seconds per update, every micro-batch synchronized
no_sync_s = None  # TODO: seconds per update with no_sync

# %% tags=["solution"]
sync_s = K * c + K * s + o  # K computations, K synchronizations, one optimizer step
no_sync_s = K * c + s + o  # no_sync: one synchronization per update

# %%
exercises.grade_step_prediction(fit, K, sync_s, no_sync_s)

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## モデルで探る: GPU とランク数
#
# スライダーで条件を変えると、モデルが予測する 1 ランクに対する速度向上をランク数ごとに描きます。
# 同期 1 回は、上で記録したバケットの α–β の時間の和 (重なりは数えない、控えめな見積もり) と DDP 自身の
# 仕事 (s の残り) です。最初の値はここで測った α、β と大きなモデルの c で、回線を選ぶと β がその回線の
# 公称帯域になります。**これはモデルによる予測で、測定ではありません。** GPU では計算も速くなるので、
# c も小さくしてみてください。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## Explore with the model: GPUs and ranks
#
# Move the sliders and the model plots the predicted speed-up over one rank for each
# number of ranks. One synchronization is the alpha-beta time of the buckets recorded
# above, added up (no overlap counted: a cautious estimate), plus DDP's own work (the
# rest of s). The starting values are alpha, beta and the large model's c measured
# here; choosing a link sets beta to its nominal bandwidth. **This is a prediction by
# the model, not a measurement.** GPUs also compute faster, so try a smaller c too.

# %%
import ipywidgets as widgets
import matplotlib.pyplot as plt

links = {"this machine (measured)": ab.beta, **comm.LINKS}
c_measured = fitted["2.1 M-parameter MLP"].compute_s
big_buckets = buckets_used["2.1 M-parameter MLP"]
overhead = max(fitted["2.1 M-parameter MLP"].sync_s - allreduce_s["2.1 M-parameter MLP"], 0.0)


def explore(link="this machine (measured)", alpha_us=ab.alpha * 1e6, grad_scale=1.0,
            compute_ms=c_measured * 1e3, K=4):
    model = comm.AlphaBeta(alpha_us * 1e-6, links[link])
    buckets = [b * grad_scale for b in big_buckets]
    ns = [1, 2, 4, 8, 16, 32, 64]
    series = {
        f"{mode}, K={K}": (ns, [comm.predicted_speedup(n, K, mode == "no_sync", buckets,
                                                       compute_ms * 1e-3, model,
                                                       overhead) for n in ns])
        for mode in ("sync", "no_sync")}
    series["ideal"] = (ns, ns)
    plots.line_chart(series, xlabel="world_size_n", ylabel="speedup",
                     title="explorer_title", logx=True, logy=True)
    plt.show()


explorer = widgets.interactive(
    explore, link=list(links),
    alpha_us=widgets.FloatLogSlider(value=max(ab.alpha * 1e6, 0.1), base=10, min=-1,
                                    max=4),
    grad_scale=widgets.FloatLogSlider(value=1.0, base=10, min=-2, max=3),
    compute_ms=widgets.FloatLogSlider(value=c_measured * 1e3, base=10, min=-2, max=3),
    K=widgets.IntSlider(value=4, min=1, max=16))
explorer

# %% [markdown] lang="ja"
# モデルから導かれることを 1 つ確かめます。K が同じなら、`no_sync` の予測は同期ありの予測より速いか
# 同じで、理想 (ランク数倍) を超えません。

# %% [markdown] lang="en"
# One thing that follows from the model, checked: for the same K, `no_sync` is never
# predicted slower than synchronizing every micro-batch, nor above the ideal (the number
# of ranks).

# %% tags=["hide-input"]
for link, beta in links.items():
    model = comm.AlphaBeta(ab.alpha, beta)
    for n in (2, 8, 64):
        for K in (1, 4, 8):
            fast = comm.predicted_speedup(n, K, True, big_buckets, c_measured, model)
            slow = comm.predicted_speedup(n, K, False, big_buckets, c_measured, model)
            assert slow <= fast <= n

# %%
ranks.stop()

# %% [markdown] lang="ja" tags=["summary"]
# ## 覚えておくこと
#
# - **リング型の all-reduce では各ランクが 2(n−1)/n × S バイトを送ります**。busbw = algbw × 2(n−1)/n は
#   ランク数によらず、回線の速さと比べられます。
# - **all-reduce の時間は、ステップごとの固定の遅延 α と、帯域 β で決まる大きさに比例する部分の和です**
#   (2 ランクで 2α + S/β)。ほかのランク数への延長はモデルによる予測です。
# - **DDP が勾配をバケットにまとめるのは、呼び出しのたびに α を払うからと、早く送って逆伝播と
#   重ねるためです**。`DDP(model)` は 1 ステップ目は 1 つのバケット、2 ステップ目から作り直した
#   バケットを送ります。
# - **勾配の計算が終わる前に走った通信は隠れ、あとに走った通信だけがステップを長くします**。
# - **1 回の更新は全同期で K·c + K·s + o、`no_sync` で K·c + s + o です**。`no_sync` が省くのは
#   (K−1)·s です。

# %% [markdown] lang="en" tags=["summary"]
# ## What to remember
#
# - **In a ring all-reduce each rank sends 2(n−1)/n × S bytes**, so busbw = algbw ×
#   2(n−1)/n does not depend on the number of ranks and compares with a link's speed.
# - **An all-reduce costs a fixed latency alpha per step plus a part proportional to
#   the size, set by beta** (2 alpha + S / beta on two ranks); extending it to more ranks
#   is a prediction by the model.
# - **DDP packs gradients into buckets because every call pays alpha and because
#   sending early overlaps the backward pass**; `DDP(model)` sends one bucket at step 1
#   and rebuilt buckets from step 2.
# - **Communication that runs before the gradients are done is hidden; only what runs
#   after lengthens the step.**
# - **An update costs K·c + K·s + o synchronizing every micro-batch and K·c + s + o with
#   `no_sync`**, which saves (K−1)·s.

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

selfcheck.show("05_communication")

# %% tags=["self-check"]
# Your answers, "a", "b", "c" or "d" for each question; then run this cell.
my_answers = {1: None, 2: None, 3: None}
selfcheck.check("05_communication", my_answers)
