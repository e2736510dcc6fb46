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
# # 14 圧縮が割に合うとき: 遅い回線
#
# このレッスンを終えると、次のことができます。
#
# - 帯域 β と遅延 α を選べる遅いリンクで all-reduce を送り、1 回に少なくとも α + バイト数 / β
#   かかることを確かめる
# - fp16 と PowerSGD が 1 ステップにリンクへ渡すバイト数を数え、遅いリンクではどちらも DDP より
#   速くなることを測る
# - ループバックでの 1 ステップの差とバイト数の差から、分かれ目の帯域 β* を式で予測し、測った値と比べる
# - 呼び出しの回数が DDP と違う方法 (PowerSGD) で、α の項が分かれ目をどう動かすかを説明する
#
# レッスン 06 では、ループバック (同じマシンの中の通信) では圧縮が得にならないことを測りました。ここでは
# 遅いネットワークを模擬して、圧縮がいつ得になるかを測ります。コードのセルの表示は英語のままです
# (図と確認のメッセージは日本語です)。

# %% [markdown] lang="en" tags=["outcomes"]
# # 14 When compressing pays: a slow link
#
# After this lesson you can:
#
# - send all-reduces over a slow link whose bandwidth β and latency α you choose, and
#   check that each takes at least α + bytes / β;
# - count the bytes fp16 and PowerSGD hand the link per step, and measure that over a
#   slow link both beat DDP;
# - predict the crossover bandwidth β* from the loopback steps and the bytes, and set it
#   beside the measured one;
# - say how the α term moves the crossover of a method that makes more calls than DDP
#   (PowerSGD).
#
# Lesson 06 measured that over loopback (within one machine) compressing does not pay.
# Here we imitate a slow network and measure when it does. The code cells print in
# English in both editions.

# %%
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %%
from labkit import cluster

ranks = cluster.start(2, background=True)  # the ranks boot while you read

# %% [markdown] lang="ja"
# ## 遅いリンク
# <!-- section: link -->
#
# ループバックはネットワークよりずっと速いので、遅いネットワークを模擬します。
# `slow_link.SlowLink(alpha_s, beta_Bps)` を有効にしているあいだ、`dist.all_reduce` は、実際の
# all-reduce のあと、さらに α + バイト数 / β だけ遅れて完了します。α は 1 回ごとの遅延 (秒)、β は帯域
# (バイト/秒)、バイト数はフックが all-reduce に渡すテンソルの大きさです (fp16 なら半分、PowerSGD なら
# P と Q)。
#
# - **回線は 1 本**: リンクは一度に 1 つの all-reduce しか運びません。続けて送ると遅延が積み重なります。
# - `async_op=True` で呼ぶと (DDP のフックと同じ)、呼び出しはすぐに戻り、完了はフューチャーで届きます。
# - `link.calls` には、all-reduce 1 回ごとの記録 (`LinkCall`: バイト数、規則の遅延、実際に止めた時間など)
#   が残ります。
#
# 次のセルは、4 MiB の all-reduce を α = 1 ms、β = 100 MB/s のリンクで送ります。遅延は
# 1 ms + 4,194,304 / 10⁸ 秒 ≈ 43 ms です。これより長くなることはあっても、短くはなりません。折りたたんだ
# セルが確かめるのはこの下限です。
#
# **予想してから実行:** このリンクで 4 MiB の all-reduce を 1 回送ると、少なくとも何 ms かかるでしょうか?
# 続けて 2 回送ると?
#
# <details><summary>測り方</summary>
#
# gloo は、フューチャーの完了とそのコールバックを自分のワーカースレッド (既定で 2 本、
# `ProcessGroupGloo` の `threads`。1 つのキューの仕事を分け合います) で実行します。そのスレッドの中で
# スリープすると、2 本のうち 1 本がふさがり、そのうしろに並んだ集団通信も待たされます。そのため
# `SlowLink` は、完了を新しいフューチャーに移し、それをリンク専用のスレッド (名前が `slow_link` で
# 始まり、使い回されます) が完了させます (`labkit/slow_link.py`)。`LinkCall` には、予定より遅れた時間と
# 完了させたスレッドの名前も残ります。確認のセルの最後の行は、完了させたのがリンクのスレッドである
# ことを確かめます。
#
# </details>

# %% [markdown] lang="en"
# ## A slow link you can dial
# <!-- section: link -->
#
# Loopback is far faster than a network, so we imitate a slow one. While
# `slow_link.SlowLink(alpha_s, beta_Bps)` is active, `dist.all_reduce` completes
# α + bytes / β after the real all-reduce: α a latency per call (seconds), β a
# bandwidth (bytes per second), the bytes those of the tensor the hook hands over (half
# for fp16; P and Q for PowerSGD).
#
# - **One wire**: the link carries one all-reduce at a time; calls in a row add up.
# - Called with `async_op=True`, as DDP's hooks call, it returns at once and the result
#   comes as a future.
# - `link.calls` keeps a `LinkCall` per all-reduce: its bytes, the rule's delay, how
#   long it was really held, and more.
#
# The next cell sends a 4 MiB all-reduce over a link of α = 1 ms and β = 100 MB/s: the
# delay is 1 ms + 4,194,304 / 10⁸ s ≈ 43 ms. Load can make it longer, never shorter:
# that lower bound is what the folded cell checks.
#
# **Predict, then run:** at least how many ms will one 4 MiB all-reduce take over this
# link? Two in a row?
#
# <details><summary>How this was measured</summary>
#
# gloo completes futures and runs their callbacks on its worker threads (two by
# default, `ProcessGroupGloo`'s `threads`, serving one queue); sleeping there would hold
# one of the two, and the collectives queued behind it. So `SlowLink` moves the result
# into a new future, which a thread of the link's own (named `slow_link...`, reused
# from call to call) completes (`labkit/slow_link.py`). A `LinkCall` also records how
# late the call was against the schedule and the thread that completed it; the check's
# last line asks that it was the link's.
#
# </details>

# %%
# %%px
import math
import time

import torch
import torch.distributed as dist

from labkit import slow_link

ALPHA, BETA = 1e-3, 100e6  # 1 ms a call, 100 MB/s
x = torch.ones(2**20)  # 4 MiB of float32
nbytes = x.numel() * x.element_size()
delay = ALPHA + nbytes / BETA  # the rule: α + bytes / β

dist.barrier()
start = time.perf_counter()
dist.all_reduce(x)
loopback_s = time.perf_counter() - start
with slow_link.SlowLink(ALPHA, BETA) as link:
    dist.barrier()  # not an all-reduce: the link does not slow it
    start = time.perf_counter()
    dist.all_reduce(x)  # the real all-reduce, then the link's delay
    one_s = time.perf_counter() - start
    dist.barrier()
    start = time.perf_counter()
    works = [dist.all_reduce(x, async_op=True) for _ in range(2)]  # as DDP's hooks call
    returned_s = time.perf_counter() - start
    for work in works:
        work.wait()
    two_s = time.perf_counter() - start

# %% tags=["hide-input"]
# %%px
if rank == 0:
    print(link.describe())
    print(f"loopback {loopback_s * 1e3:.1f} ms; over the link: one all-reduce "
          f"{one_s * 1e3:.1f} ms (delay {delay * 1e3:.1f} ms); two in a row "
          f"{two_s * 1e3:.1f} ms, returned after {returned_s * 1e3:.1f} ms")
    for call in link.calls:
        print(f"  {call}")
assert [call.nbytes for call in link.calls] == [nbytes] * 3
assert all(math.isclose(call.delay_s, delay) for call in link.calls)  # bookkeeping
assert one_s >= delay  # at least the delay, whatever the load
assert two_s >= 2 * delay  # one wire: the second waits for the first to leave it
# Who completed the two async calls, as the link noted it before completing them
# (a `.then` attached now would run here, on the main thread, once they are done).
assert all(call.thread.startswith("slow_link") for call in link.calls[1:])

# %% [markdown] lang="ja"
# ループバック (`loopback`) なら数 ms の all-reduce が、リンクでは 1 回 43 ms 以上、続けて 2 回なら
# 86 ms 以上かかります。`async_op=True` の呼び出しはすぐに戻り (`returned after`)、待つのは
# `work.wait()` です。図の 3 回目は、2 回目が回線を出るのを待ったぶん長くなっています。

# %% [markdown] lang="en"
# Over loopback the all-reduce takes a few ms; over the link one takes at least 43 ms,
# two in a row at least 86 ms. The `async_op=True` calls return at once (`returned
# after`); `work.wait()` is where the time goes. In the figure the third call also
# waited for the second to leave the wire.

# %% tags=["hide-input"]
from labkit import plots

calls = ranks.pull("link.calls")[0]  # rank 0's record of each all-reduce, in order
rule, held = [c.delay_s * 1e3 for c in calls], [c.held_s * 1e3 for c in calls]
assert all(h >= d for h, d in zip(held, rule, strict=True))  # never shorter than the rule
fig = plots.line_chart({labkit.t("link_rule_delay"): ([1, 2, 3], rule),
                        labkit.t("link_held"): ([1, 2, 3], held)},
                       xlabel="link_call_n", ylabel="link_ms", title="link_calls_title",
                       from_zero=True)

# %% [markdown] lang="ja"
# ### fp16 と PowerSGD は、帯域がどこまで下がると得になるか
#
# レッスン 06 の大きな MLP (幅 1024、3 層) で、DDP、fp16 (`fp16_compress_hook`)、PowerSGD (r = 1、
# Vogels ほか、2019) を、ループバックと、β = 100 MB/s〜5 GB/s の 6 つのリンク (α = 100 µs) で学習します。
# `slow_link.steps_over_links` は (リンク, 方法) の組を 1 ステップずつ交互に回すので、どの組も
# 同じ条件で測られます。通信しないコピー (`send_less.no_communication`) の 1 ステップも測ります (その
# 方法の計算だけの時間)。12 ラウンドで 10 秒ほどかかります。
#
# **予想してから実行:** 100 MB/s のリンクで、3 つの方法のうち 1 ステップがいちばん短いのはどれでしょうか?
# ループバックでは?

# %% [markdown] lang="en"
# ### When fp16 and PowerSGD pay
#
# On lesson 06's large MLP (width 1024, 3 layers), DDP, fp16 (`fp16_compress_hook`) and
# PowerSGD (r = 1; Vogels et al., 2019) train over loopback and over six links of
# β = 100 MB/s to 5 GB/s (α = 100 µs). `slow_link.steps_over_links` takes one step of
# each (link, method) pair in turn, so that the load falls on every pair alike; each
# method's copy sending nothing (`send_less.no_communication`) steps too, its compute
# alone. Twelve rounds, about 10 s.
#
# **Predict, then run:** over the 100 MB/s link, which of the three methods takes the
# shortest step? And over loopback?

# %%
# %%px
METHODS = ("DDP", "fp16", "PowerSGD r=1")
LINK_ALPHA = 100e-6  # 100 µs a call
BETAS = (1e8, 2e8, 5e8, 1e9, 2e9, 5e9)  # 100 MB/s to 5 GB/s
over = slow_link.steps_over_links(METHODS, BETAS, LINK_ALPHA, rounds=12, local=True)

# %% [markdown] lang="ja"
# 測ったすべての回を、リンクごとに並べます (ランク 0 の時計、縦軸は対数、黒い横棒が中央値)。右の遅い
# リンクほど、DDP の印がほかの 2 つより上に離れます。

# %% [markdown] lang="en"
# Every timed round, link by link (rank 0's clock, log scale, the black bar the
# median): the slower the link (to the right), the further DDP's markers rise above
# the other two.

# %% tags=["hide-input"]
import math
import statistics

import labkit
from labkit import diagrams, slow_link  # slow_link: the labels of its links

steps = ranks.pull("over")[0]  # rank 0's {beta: {method: ...}}, math.inf the loopback
links = sorted(steps, reverse=True)  # loopback, then slower and slower links
names = list(steps[math.inf])
counts = {len(steps[beta][name]["rounds_s"]) for beta in links for name in names}
assert len(counts) == 1 and counts.pop() > 1  # every pair, the same rounds
for beta in links:
    for name in names:
        row = steps[beta][name]
        assert statistics.median(row["rounds_s"]) == row["step_s"]  # the table's median
        assert min(row["rounds_s"]) >= row["link_s"]  # each round waited the link out
shown = {labkit.t("loopback") if beta == math.inf else f"{beta / 1e6:g} MB/s":
         {name: [s * 1e3 for s in steps[beta][name]["rounds_s"]] for name in names}
         for beta in links}
fig = diagrams.rounds(shown, ylabel="step_time_ms", title="link_rounds_title",
                      logy=True)

# %%
import math

import labkit
from labkit import plots, send_less, slow_link, workload

METHODS, LINK_ALPHA, BETAS = ranks.pull("METHODS")[0], 1e-4, ranks.pull("BETAS")[0]
over = ranks.pull("over")  # each rank's: {beta: {method: ...}}, math.inf the loopback
steps, loop = over[0], over[0][math.inf]  # rank 0's steps, as its clock saw them


def ratio(beta, name):
    """The method's median step over DDP's, over the link of bandwidth beta."""
    return steps[beta][name]["step_s"] / steps[beta]["DDP"]["step_s"]

# %% tags=["hide-input"]
print(f"{'link':>10} " + " ".join(f"{m + ' ms':>16}" for m in METHODS)
      + f" {'fp16/DDP':>9} {'PSGD/DDP':>9} {'DDP link ms':>12}")
for beta in (math.inf, *BETAS):
    row = steps[beta]
    print(f"{'loopback' if beta == math.inf else f'{beta / 1e6:g} MB/s':>10} "
          + " ".join(f"{row[m]['step_s'] * 1e3:>16.1f}" for m in METHODS)
          + f" {ratio(beta, 'fp16'):>9.2f} {ratio(beta, 'PowerSGD r=1'):>9.2f}"
          + f" {row['DDP']['link_s'] * 1e3:>12.1f}")

# What each method hands the link per step: exact, and the same on every link.
model = workload.make_model(send_less.large_config())
grad_bytes = 4 * sum(p.numel() for p in model.parameters())
psgd_bytes = sum(4 * (sum(p.shape) if p.dim() == 2 else p.numel())  # P, Q at r = 1
                 for p in model.parameters())
for beta, row in steps.items():
    assert row["DDP"]["bytes"] == grad_bytes  # every gradient, in float32
    assert row["fp16"]["bytes"] == grad_bytes // 2  # the same in float16
    assert row["PowerSGD r=1"]["bytes"] == psgd_bytes  # biases whole, matrices P and Q
    for name in METHODS:
        calls, sent = row[name]["calls"], row[name]["bytes"]
        added = calls * LINK_ALPHA + sent / beta if beta < math.inf else 0.0
        assert math.isclose(row[name]["link_s"], added)  # bookkeeping: calls·α + bytes/β
        assert row[name]["step_s"] >= row[name]["link_s"]  # one wire: all of it waited
assert ratio(BETAS[0], "fp16") < 1  # at 100 MB/s, half the bytes wins
# PowerSGD sends far less, but its own compute grows most with the load.
assert ratio(BETAS[0], "PowerSGD r=1") < 1
sent = {name: steps[BETAS[0]][name]["bytes"] for name in METHODS}  # the same at every β
fig = plots.bar_chart({labkit.t("bytes_per_step"): sent}, ylabel="bytes",
                      title="methods_bytes_title", fmt="{:,.0f}")

fig = plots.line_chart(
    {name: ([b / 1e6 for b in BETAS], [ratio(b, name) for b in BETAS])
     for name in METHODS}, xlabel="link_beta_MBps", ylabel="step_over_ddp",
    title="slow_link_ratio_title", logx=True)

# %% [markdown] lang="ja"
# 遅いリンクでは、圧縮する 2 つの方法が DDP より速くなります。100 MB/s では DDP の 1 ステップの大部分が
# リンクの遅延で、fp16 はその半分、PowerSGD はほとんど待ちません。帯域が上がるにつれて差は縮み、
# ループバックでは、レッスン 06 と同じく DDP がいちばん速いか、ほぼ同じです。
#
# 各方法がリンクに渡すバイト数は、どのリンクでも同じです。DDP は勾配の全体 (float32)、fp16 はその半分、
# PowerSGD はバイアスをそのまま、n × m の行列を P と Q (n + m 個の値) にして渡します。
#
# <details><summary>測り方</summary>
#
# 確認のセルは、リンクが 1 ステップに足した遅延が呼び出しの回数 × α + バイト数 / β にちょうど等しいこと
# (帳簿の確認) と、1 ステップがそれより長いこと、100 MB/s で fp16 も PowerSGD も DDP より短いことを
# 確かめます。マシンに負荷をかけながら同じ測定を 16 回繰り返すと、100 MB/s での比は fp16 が 0.54〜0.63、
# PowerSGD が 0.19〜0.33 でした。ただし、マシンがとても混んでいたときの短い測定では、PowerSGD の比が
# 0.55 になったことがあります (PowerSGD 自身の計算が負荷でいちばん延びるからです)。負荷で計算が k 倍に
# 延びると、100 MB/s での fp16 の 1 ステップは「計算 + 43 ms」、DDP は「計算 + 85 ms」なので、比は 1 に
# 近づいていきます。そのため、確かめるのは比のしきい値ではなく、DDP より短いこと (比 < 1) だけにしています。
#
# </details>

# %% [markdown] lang="en"
# Over the slow links the two that compress beat DDP. At 100 MB/s most of DDP's step
# is the link's delay; fp16 waits half of it, PowerSGD hardly any. The gap narrows as
# the bandwidth grows, and on loopback DDP is the fastest or about even, as in
# lesson 06.
#
# What each method hands the link is the same on every link: DDP the whole gradient in
# float32, fp16 half of it, PowerSGD the biases whole and, for each n × m matrix, P and
# Q (n + m values).
#
# <details><summary>How this was measured</summary>
#
# The check asks that the delay the link added to a step equals calls × α + bytes / β
# exactly (bookkeeping), that the step took longer, and that at 100 MB/s both fp16 and
# PowerSGD beat DDP. The same measurement repeated 16 times with the machine kept busy
# gave ratios at 100 MB/s of 0.54 to 0.63 for fp16 and 0.19 to 0.33 for PowerSGD, but a
# short run on a very busy machine once gave PowerSGD 0.55 (its own compute stretches
# most under load). With compute stretched k-fold by load, fp16's step at 100 MB/s is
# compute + 43 ms against DDP's compute + 85 ms, and the ratio creeps towards 1: hence
# the check asks only that both beat DDP (ratio < 1), not a margin.
#
# </details>

# %% [markdown] lang="ja"
# ### 分かれ目を測り、予測する
#
# 分かれ目 (crossover) は、それより遅いリンクなら、その方法の 1 ステップが DDP より短くなる帯域です。
# 測った値は、比が 1 をまたぐ 2 つのリンクのあいだを log β で補間して求めます
# (`slow_link.crossover_bandwidth`)。
#
# 予測: リンクは 1 ステップに「呼び出しの回数 c × α + バイト数 S / β」を足します。ループバックでの
# 1 ステップを t とすると、方法 m が得になるのは
#
# t_m + c_m α + S_m / β < t_DDP + c_DDP α + S_DDP / β
#
# のときです。fp16 は呼び出しの回数が DDP と同じなので α の項は消え、t_fp16 > t_DDP なら
#
# β* = (S_DDP − S_fp16) / (t_fp16 − t_DDP)
#
# より遅いリンクで得になります。t_fp16 ≤ t_DDP なら、どの帯域でも得です。t_m はループバックで測った値で、
# 圧縮の計算も重なりもその中に入っています。
#
# <details><summary>測り方</summary>
#
# リンクの遅延はすべてステップに足されるとみなしています。DDP と fp16 では、最初のバケットの遅延の
# 一部が残りの逆伝播の計算と重なって隠れることがあるので、これは上限です。バケットが 1 つで逆伝播の
# 最後に送る PowerSGD では、何も隠れません。レッスン 06 のモデルと違い、t_m は予測せずに測ります。
#
# </details>

# %% [markdown] lang="en"
# ### The crossover, measured and predicted
#
# The crossover is the bandwidth below which a method's step is shorter than DDP's.
# Measured, it is interpolated in log β between the two links where the ratio crosses
# 1 (`slow_link.crossover_bandwidth`).
#
# To predict it: the link adds "calls c × α + bytes S / β" to a step. With t a method's
# step on loopback, method m pays where
#
# t_m + c_m α + S_m / β < t_DDP + c_DDP α + S_DDP / β.
#
# fp16 makes as many calls as DDP, so the α terms cancel: when t_fp16 > t_DDP it pays on
# links slower than
#
# β* = (S_DDP − S_fp16) / (t_fp16 − t_DDP),
#
# and at every bandwidth when t_fp16 ≤ t_DDP. t_m is measured on loopback, so it holds
# the compression's compute and the overlap already.
#
# <details><summary>How this was measured</summary>
#
# The link's delay is taken as wholly added to the step: for DDP and fp16, part of the
# first bucket's delay can hide behind the rest of the backward, so this is an upper
# bound; PowerSGD, one bucket sent when the backward ends, hides none. Unlike lesson
# 06's model, t_m is measured, not predicted.
#
# </details>

# %% [markdown] lang="ja"
# ## 演習: fp16 の分かれ目を予測する
#
# `fp16_crossover(t_ddp, t_fp16, S_ddp, S_fp16, calls, alpha_s)` を書いてください。DDP と fp16 の
# ループバックでの 1 ステップの時間 (秒)、1 ステップにリンクに渡すバイト数、1 ステップの all-reduce の回数
# (2 つで同じ)、リンクの α (秒) から、fp16 が DDP より速くなる帯域の上限 β* を、バイト/秒で返します。
# fp16 がループバックですでに DDP より速い (か同じ) ときは、どの帯域でも得なので `math.inf` を返します。
#
# 確認のセルは、上で測った値と、送るバイト数が DDP の半分ではない圧縮を含むいくつかの決まった値で
# 関数を呼び、答えと比べます。

# %% [markdown] lang="en"
# ## Exercise: predict fp16's crossover
#
# Write `fp16_crossover(t_ddp, t_fp16, S_ddp, S_fp16, calls, alpha_s)`: from DDP's and
# fp16's steps on loopback (seconds), the bytes each hands the link per step, the
# all-reduces per step (the same for both) and the link's α (seconds), return the
# bandwidth β* below which fp16 beats DDP, in bytes per second. Where fp16 is already as
# fast as DDP or faster on loopback, it pays at every bandwidth: return `math.inf`.
#
# The check calls it with the values measured above and with a few fixed ones (among
# them a compression sending other than half of DDP's bytes), and compares.

# %%
t_ddp, t_fp16 = loop["DDP"]["step_s"], loop["fp16"]["step_s"]  # seconds, loopback
S_ddp, S_fp16 = loop["DDP"]["bytes"], loop["fp16"]["bytes"]  # bytes per step
calls, alpha_s = loop["DDP"]["calls"], LINK_ALPHA  # all-reduces per step, the link's α
print(f"t_ddp = {t_ddp * 1e3:.2f} ms, t_fp16 = {t_fp16 * 1e3:.2f} ms, "
      f"S_ddp = {S_ddp:,} B, S_fp16 = {S_fp16:,} B, calls = {calls}, "
      f"alpha_s = {alpha_s:g} s")

# %% tags=["exercise"]
def fp16_crossover(t_ddp, t_fp16, S_ddp, S_fp16, calls, alpha_s):
    """The bandwidth (bytes/s) below which fp16's step is shorter than DDP's."""
    return None  # TODO: t + calls·α + S/β equal for both; solve for β

# %% tags=["solution"]
def fp16_crossover(t_ddp, t_fp16, S_ddp, S_fp16, calls, alpha_s):
    """The bandwidth (bytes/s) below which fp16's step is shorter than DDP's."""
    if t_fp16 <= t_ddp:
        return math.inf  # faster on loopback already: every link adds less to it
    # t_fp16 + calls·α + S_fp16/β = t_ddp + calls·α + S_ddp/β; the α terms cancel
    return (S_ddp - S_fp16) / (t_fp16 - t_ddp)

# %%
from labkit import exercises

exercises.grade_crossover_bandwidth(fp16_crossover, t_ddp, t_fp16, S_ddp, S_fp16,
                                    calls, alpha_s)

# %% [markdown] lang="ja"
# PowerSGD は 1 つのバケットで 3 回 (バイアス、P、Q) 呼び、このモデルの DDP (バケット 2 つ) より 1 回
# 多いので、α の項が残ります。β* = (S_DDP − S_m) / (t_m − t_DDP + (c_m − c_DDP) α) です。次のセルは
# 2 つの方法の予測と測った値を出し、予測が「ループバックの 1 ステップ + リンクの遅延」の 2 本の曲線の
# 交点と一致することを確かめます。
#
# **予想してから実行:** PowerSGD の余分な 1 回の α (100 µs) は、分かれ目を上げるでしょうか、下げるでしょうか?

# %% [markdown] lang="en"
# PowerSGD makes three calls in its one bucket (the biases, P, Q), one more than DDP's
# two buckets here, so its α term stays:
# β* = (S_DDP − S_m) / (t_m − t_DDP + (c_m − c_DDP) α). The next cell prints both
# methods' predicted and measured crossovers, and checks that the prediction is where
# the two curves "loopback step + the link's delay" cross.
#
# **Predict, then run:** does PowerSGD's one extra α (100 µs) raise its crossover or
# lower it?

# %%
def predicted_crossover(name):
    """β* from the loopback steps: where t + c·α + S/β is equal for name and DDP."""
    m, d = loop[name], loop["DDP"]
    extra = m["step_s"] - d["step_s"] + (m["calls"] - d["calls"]) * LINK_ALPHA
    return (d["bytes"] - m["bytes"]) / extra if extra > 0 else math.inf


def shown(beta):
    """A crossover as bandwidth, or where the method never or always pays."""
    if beta is None:
        return "none (slower than DDP on every link)"
    return "at every bandwidth" if beta == math.inf else f"{beta / 1e6:,.0f} MB/s"


crossover = {}
for name in METHODS[1:]:
    measured = slow_link.crossover_bandwidth([(b, ratio(b, name)) for b in BETAS])
    crossover[name] = predicted = predicted_crossover(name)
    print(f"{name}: crossover measured {shown(measured)}, predicted {shown(predicted)}"
          f" (loopback step {loop[name]['step_s'] / loop['DDP']['step_s']:.2f} x DDP's)")

# %% tags=["hide-input"]
def loopback_plus_link(name, beta):
    return loop[name]["step_s"] + loop[name]["calls"] * LINK_ALPHA + loop[name][
        "bytes"] / beta


grid = [10 ** (6 + k / 100) for k in range(601)]  # 1 MB/s to 1 TB/s
for name, predicted in crossover.items():
    on_grid = slow_link.crossover_bandwidth(
        [(b, loopback_plus_link(name, b) / loopback_plus_link("DDP", b)) for b in grid])
    if predicted > grid[-1]:  # math.inf, or a crossing beyond the grid
        assert on_grid == math.inf
    else:
        assert math.isclose(on_grid, predicted, rel_tol=1e-3)  # interpolated
assert crossover["fp16"] == fp16_crossover(t_ddp, t_fp16, S_ddp, S_fp16, calls,
                                           alpha_s)

# %% [markdown] lang="ja"
# 分かれ目は、ループバックでの数 ms の差で決まります。その差は時間の揺らぎと同じくらいなので、測った値も
# 予測も実行のたびに大きく動きます。変わらないのは予測の式と、最も遅いリンクで圧縮が得になることで、
# セルが確かめるのもその 2 つです。
#
# <details><summary>測り方</summary>
#
# bench (`bench/run.py --only crossover`) の 7 回の実行では、fp16 の分かれ目 (実測) は 1.2〜4.3 GB/s で、
# 1 回だけ 5 GB/s を超えました (試したどのリンクでも DDP より速かった)。PowerSGD r = 1 は
# 0.75〜1.9 GB/s で、やはり 1 回は 5 GB/s を超えました。どの実行でも、500 MB/s 以下では 2 つとも
# DDP より速くなりました (`bench/README.md`)。計算の時間も入れた 1 ステップのモデルで、レッスン 06 の
# すべての方法をこのリンクで予測する測定も、bench (`--only levers`) にあります。
#
# </details>

# %% [markdown] lang="en"
# The crossover hangs on a few ms of loopback difference, about as much as times
# scatter, so the measured and the predicted crossover both move from run to run. What
# does not move is the formula and that compression pays on the slowest link: what the
# cells check.
#
# <details><summary>How this was measured</summary>
#
# Over seven runs of the bench (`bench/run.py --only crossover`), fp16's measured
# crossover was 1.2 to 4.3 GB/s and once above 5 GB/s (faster than DDP on every link
# swept), PowerSGD r = 1's 0.75 to 1.9 GB/s and once above 5 GB/s; in every run both
# beat DDP at 500 MB/s and below (`bench/README.md`). A step model that also prices each
# method's compute, predicting all of lesson 06's methods over this link, is in the
# bench too (`--only levers`).
#
# </details>

# %%
ranks.stop()

# %% [markdown] lang="ja" tags=["summary"]
# ## 覚えておくこと
#
# - **遅いリンクは、all-reduce 1 回ごとに α + バイト数 / β を足し**、回線が 1 本なので、続けて送ればその
#   遅延が積み重なります。
# - **fp16 は DDP の半分のバイト数、PowerSGD はずっと少ないバイト数をリンクに渡し**、100 MB/s ではどちらも
#   1 ステップが DDP より短くなりました。
# - **分かれ目は、ループバックでの 1 ステップの差とバイト数の差で決まり**、fp16 では
#   β* = (S_DDP − S_fp16) / (t_fp16 − t_DDP) で、それより遅いリンクで得になります。
# - **呼び出しの回数が DDP より多い方法 (PowerSGD) では α の項が残り**、分母に (c_m − c_DDP) α が足されます。
# - **分かれ目は、ループバックでの数 ms の差で決まるので**、その値は測ったときのものとして読みます。セルが
#   確かめるのは、式と、最も遅いリンクで圧縮が得になることです。

# %% [markdown] lang="en" tags=["summary"]
# ## What to remember
#
# - **A slow link adds α + bytes / β to each all-reduce**, and with one wire the delays
#   of calls sent in a row add up.
# - **fp16 hands the link half of DDP's bytes and PowerSGD far fewer**: at 100 MB/s both
#   took a shorter step than DDP.
# - **The crossover is set by the difference of the loopback steps and of the bytes**:
#   for fp16 β* = (S_DDP − S_fp16) / (t_fp16 − t_DDP), below which it pays.
# - **A method making more calls than DDP (PowerSGD) keeps its α term**: (c_m − c_DDP) α
#   joins the denominator.
# - **The crossover hangs on a few ms of loopback difference**, so read its value as
#   this run's; the cells check the formula, and that compression pays on the slowest
#   link.

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

selfcheck.show("14_slow_link")

# %% tags=["self-check"]
# Your answers, "a", "b", "c" or "d" for each question; then run this cell.
my_answers = {1: None, 2: None, 3: None}
selfcheck.check("14_slow_link", my_answers)
