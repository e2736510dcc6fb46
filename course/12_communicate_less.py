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
# # 12 通信を減らす: いつ得になるか (遅いリンク、ローカル SGD、DiLoCo、バッチサイズ)
#
# レッスン 04 の `no_sync` は、同期の回数を減らす最初の方法でした。レッスン 06 では送るバイト数を
# 圧縮で減らし、このマシンのループバックではどれも得にならないことを測りました。このレッスンでは、
# 「通信を減らすと、いつ得になるのか」に、測って答えます。
#
# このレッスンで見ること:
# 1. 帯域と遅延を選べる遅いリンク。fp16 と PowerSGD が DDP より速くなる帯域 (分かれ目) を測り、
#    1 ステップの時間のモデルで予測する
# 2. ローカル SGD: 各ランクが自分だけでステップし、H ステップごとにパラメータを平均する
# 3. DiLoCo: 平均した「疑似勾配」で、外側のオプティマイザ (ネステロフのモーメンタム) が更新する
# 4. バッチはどこまで大きくできるか: 勾配のノイズスケールと臨界バッチサイズ
#
# コードのセルが表示する出力は英語のままです (図と確認のメッセージは日本語です)。

# %% [markdown] lang="en"
# # 12 Communicate less, and know when it pays: a slow link, local SGD, DiLoCo, batch size
#
# Lesson 04's `no_sync` was the first way to synchronize less often. Lesson 06 sent fewer
# bytes by compressing them, and measured that on this machine's loopback none of it
# pays. This lesson answers "when does communicating less pay", measured.
#
# In this lesson:
# 1. a slow link whose bandwidth and latency you choose: the bandwidth below which fp16
#    and PowerSGD beat DDP (the crossover), measured and predicted by the step model
# 2. local SGD: each rank steps on its own, and the parameters are averaged every H steps
# 3. DiLoCo: an outer optimizer (Nesterov momentum) on the averaged "pseudo-gradient"
# 4. how large a batch can grow: the gradient noise scale and the critical batch size
#
# The code cells print in English in both editions; figures and checks follow the
# notebook's language.

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
# このマシンのランクは、ループバック (同じマシンの中の通信) で通信します。ネットワークよりずっと速いので、
# レッスン 06 の圧縮はここでは得になりませんでした。そこで、遅いネットワークを模擬します。
# `slow_link.SlowLink(alpha_s, beta_Bps)` を有効にしているあいだ、`dist.all_reduce` は、実際の
# all-reduce が終わったあと、さらに α + バイト数 / β だけ完了を遅らせます。α は 1 回ごとの固定の遅延
# (秒)、β は帯域 (バイト/秒) です。数えるバイト数は、フックが all-reduce に渡すテンソルの大きさです
# (fp16 なら半分、PowerSGD なら P と Q)。
#
# - **回線は 1 本**: リンクは一度に 1 つの all-reduce しか運びません。遅延は、実際の all-reduce が
#   終わり、前の all-reduce がリンクを出てから数えます。
# - **待つのはリンクのスレッド**: DDP のフックは `async_op=True` で呼び、完了をフューチャー (`Future`)
#   で受け取ります。gloo は、フューチャーの完了とそのコールバックを自分のワーカースレッド (既定で 2 本、
#   `ProcessGroupGloo` の `threads`。1 つのキューの仕事を分け合います) で実行します。そのスレッドの中で
#   スリープすると、2 本のうち 1 本がふさがり、そのうしろに並んだ集団通信も待たされます。そのため
#   `SlowLink` は、完了を新しいフューチャーに移し、それをリンク専用のスレッド (名前が `slow_link` で
#   始まり、使い回されます) が時間どおりに完了させます (`labkit/slow_link.py`)。
# - `link.calls` には、all-reduce 1 回ごとに `LinkCall` (バイト数、規則による遅延、実際に止めた時間、
#   予定より遅れた時間、完了させたスレッドの名前) が残ります。
#
# 次のセルは、4 MiB の all-reduce を、α = 1 ms、β = 100 MB/s のリンクで送ります。遅延は
# 1 ms + 4,194,304 / 10⁸ 秒 ≈ 43 ms です。マシンが混んでいるとき、all-reduce はもっと長くかかることは
# あっても、遅延より短く終わることはありません。確かめるのはその下限です。続けて 2 つ送ると、2 つ目は
# 1 つ目がリンクを出るまで待つので、合わせて遅延の 2 倍以上かかります。DDP のフックと同じように
# `async_op=True` で呼んだとき、フューチャーを完了させるのが gloo のスレッドではなく、リンクのスレッド
# であることも、リンクが完了の直前に残した記録で確かめます (これと遅延の値の確認は帳簿の確認です。
# 時間を確かめるのは 2 つの `>=` の行です)。

# %% [markdown] lang="en"
# ## A slow link you can dial
# <!-- section: link -->
#
# This machine's ranks talk over loopback (within one machine), far faster than a
# network, which is why lesson 06's compression did not pay here. So we imitate a slow
# network. While `slow_link.SlowLink(alpha_s, beta_Bps)` is active, `dist.all_reduce`
# completes α + bytes / β later than the real all-reduce: α is a fixed latency per call
# (seconds), β a bandwidth (bytes per second). The bytes are those of the tensor the
# hook hands to the all-reduce (half for fp16; P and Q for PowerSGD).
#
# - **One wire**: the link carries one all-reduce at a time. A call's delay starts when
#   the real all-reduce is done and the call before it has left the link.
# - **The link's own thread waits**: DDP's hooks call with `async_op=True` and take the
#   result as a future (`Future`). gloo completes futures and runs their callbacks on its
#   worker threads (two by default, `ProcessGroupGloo`'s `threads`, serving one queue);
#   sleeping there would hold one of the two, and the collectives queued behind it. So
#   `SlowLink` moves the result into a new future, which a thread of the link's own
#   (named `slow_link...`, reused from call to call) completes on time
#   (`labkit/slow_link.py`).
# - `link.calls` keeps a `LinkCall` per all-reduce: its bytes, the delay by the rule,
#   how long it was really held, how late against the schedule, and the name of the
#   thread that completed it.
#
# The next cell sends a 4 MiB all-reduce over a link of α = 1 ms and β = 100 MB/s: the
# delay is 1 ms + 4,194,304 / 10⁸ s ≈ 43 ms. On a busy machine an all-reduce may take
# longer than that, never shorter: that lower bound is what the cell checks. Two sent in
# a row take at least twice the delay, the second waiting for the first to leave the
# link. Called with `async_op=True`, as DDP's hooks call, the future is completed by the
# link's thread, not gloo's: the cell checks that too, from the record the link wrote
# just before completing it (those checks are bookkeeping; the two `>=` lines check
# the times).

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
# `SlowLink` を外すと (`loopback`)、同じ all-reduce は数 ms で終わります。リンクを通すと、1 回は
# 遅延の 43 ms 以上、続けて 2 回なら 86 ms 以上かかります。`async_op=True` の呼び出しはリンクを待たずに
# 戻り (表示の `returned after`)、待つのは `work.wait()` です。

# %% [markdown] lang="en"
# Without `SlowLink` (`loopback`) the same all-reduce takes a few ms. Over the link one
# takes at least the 43 ms delay, two in a row at least 86 ms. The call with
# `async_op=True` returns without waiting for the link (the printed `returned after`);
# `work.wait()` is where the time goes.

# %% [markdown] lang="ja"
# ### fp16 と PowerSGD は、帯域がどこまで下がると得になるか
#
# レッスン 06 の大きな MLP (幅 1024、3 層) で、DDP、fp16 (`fp16_compress_hook`)、PowerSGD (r = 1。
# Vogels ほか、2019、"PowerSGD: Practical Low-Rank Gradient Compression for Distributed
# Optimization"、NeurIPS) を、
# ループバックと、β = 100 MB/s〜5 GB/s の 6 つのリンク (α = 100 µs) で学習します。
# `slow_link.steps_over_links` は、(リンク, 方法) の組を 1 ステップずつ順番に回し (交互に測る)、
# 負荷がどの組にも同じようにかかるようにします。各方法を、通信をしないコピー
# (`send_less.no_communication`) でも 1 ステップずつ回し、その方法の計算だけの時間 (ローカルの
# ステップ) も測ります。12 ラウンドで、10 秒ほどかかります。

# %% [markdown] lang="en"
# ### When fp16 and PowerSGD pay
#
# On lesson 06's large MLP (width 1024, 3 layers), DDP, fp16 (`fp16_compress_hook`) and
# PowerSGD (r = 1; Vogels et al., 2019, "PowerSGD: Practical Low-Rank Gradient
# Compression for Distributed Optimization", NeurIPS) train over loopback and over six
# links of β = 100 MB/s to 5 GB/s (α = 100 µs). `slow_link.steps_over_links` takes one
# step of each (link, method) pair in turn (interleaved), so that the load falls on
# every pair alike. Each method's copy sending nothing (`send_less.no_communication`)
# takes a step in every round too: the method's compute alone (its local step). Twelve
# rounds, about 10 s.

# %%
# %%px
METHODS = ("DDP", "fp16", "PowerSGD r=1")
LINK_ALPHA = 100e-6  # 100 µs a call
BETAS = (1e8, 2e8, 5e8, 1e9, 2e9, 5e9)  # 100 MB/s to 5 GB/s
over = slow_link.steps_over_links(METHODS, BETAS, LINK_ALPHA, rounds=12, local=True)

# %%
import math

from labkit import plots, send_less, slow_link, workload

METHODS, LINK_ALPHA, BETAS = ranks.pull("METHODS")[0], 1e-4, ranks.pull("BETAS")[0]
over = ranks.pull("over")  # each rank's: {beta: {method: ...}}, math.inf the loopback
steps, loop = over[0], over[0][math.inf]  # rank 0's steps, as its clock saw them


def ratio(beta, name):
    """The method's median step over DDP's, over the link of bandwidth beta."""
    return steps[beta][name]["step_s"] / steps[beta]["DDP"]["step_s"]


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
assert ratio(BETAS[0], "fp16") < 0.8  # at 100 MB/s, half the bytes wins
# PowerSGD sends far less, but its own compute grows most with the load (0.55 once).
assert ratio(BETAS[0], "PowerSGD r=1") < 0.8

fig = plots.line_chart(
    {name: ([b / 1e6 for b in BETAS], [ratio(b, name) for b in BETAS])
     for name in METHODS}, xlabel="link_beta_MBps", ylabel="step_over_ddp",
    title="slow_link_ratio_title", logx=True)

# %% [markdown] lang="ja"
# 遅いリンクでは、圧縮する 2 つの方法が DDP より速くなります。100 MB/s では、DDP の 1 ステップの大部分が
# リンクの遅延で、半分のバイト数を送る fp16 はその遅延が半分、PowerSGD はほとんどありません。
# 帯域が上がるにつれて差は縮み、ループバックでは、レッスン 06 と同じく DDP がいちばん速いか、ほぼ同じです。
#
# 上のセルが確かめるのは、負荷に左右されない測り方の決まりごとと、余裕を持たせた比です。各方法が
# リンクに渡すバイト数は、どのリンクでも同じです。DDP は勾配の全体 (float32)、fp16 はその半分、
# PowerSGD はバイアスをそのまま、n × m の行列を P と Q (n + m 個の値) にして渡します。1 ステップに
# リンクが足した遅延は、呼び出しの回数 × α + バイト数 / β にちょうど等しくなります。これは、リンクが
# 記録した回数とバイト数に規則を当てはめたかという帳簿の確認です。時間を確かめるのは、1 ステップが
# それより長くかかることです。
# 最も遅い 100 MB/s では、fp16 も PowerSGD も DDP の 0.8 倍より短くなります。マシンに負荷をかけながら
# 同じ測定を 16 回繰り返すと、比は fp16 が 0.54〜0.63、PowerSGD が 0.19〜0.33 でした。ただし、
# マシンがとても混んでいたときの短い測定では、PowerSGD の比が 0.55 になったことがあります
# (PowerSGD 自身の計算が負荷でいちばん延びるからです)。そのため、どちらにも余裕のある同じしきい値
# (0.8 倍) にしています。

# %% [markdown] lang="en"
# Over the slow links the two that compress beat DDP. At 100 MB/s most of DDP's step
# is the link's delay; fp16, sending half the bytes, waits half of it, and PowerSGD
# hardly any. The gap narrows as the bandwidth grows, and on loopback DDP is the fastest
# or about even, as in lesson 06.
#
# The cell above checks the rules of the measurement, which no load can change, and
# ratios with room to spare. What each method hands the link is the same on every link:
# DDP the whole gradient in float32, fp16 half of it, PowerSGD the biases whole and, for
# each n × m matrix, P and Q (n + m values). The delay the link added to a step equals
# calls × α + bytes / β exactly: bookkeeping, that the link applied its rule to the
# calls and bytes it recorded. What checks a time is that the step takes longer than
# that. At the slowest,
# 100 MB/s, both fp16's step and PowerSGD's are under 0.8 times DDP's. The same
# measurement repeated 16 times with the machine kept busy gave fp16 0.54 to 0.63 and
# PowerSGD 0.19 to 0.33, but a short run on a very busy machine once gave PowerSGD 0.55
# (its own compute stretches most under load): hence one threshold (0.8) with room for
# both.

# %% [markdown] lang="ja"
# ### 分かれ目を測り、予測する
#
# 分かれ目 (crossover) は、それより遅いリンクなら、その方法の 1 ステップが DDP より短くなる帯域です。
# 測った値は、比が 1 をまたぐ 2 つのリンクのあいだを、log β で補間して求めます
# (`slow_link.crossover_bandwidth`)。
#
# 予測はこう考えます。リンクは、1 ステップに「呼び出しの回数 c × α + バイト数 S / β」を足します。
# ループバックでの 1 ステップを t とすると、リンクを通したときは t + cα + S/β です (リンクの遅延が
# すべてステップに足されるとみなしています。DDP と fp16 では、最初のバケットの遅延の一部が残りの
# 逆伝播の計算と重なって隠れることがあるので、これは上限です。バケットが 1 つで逆伝播の最後に送る PowerSGD
# では、何も隠れません)。方法 m が得になるのは
#
# t_m + c_m α + S_m / β < t_DDP + c_DDP α + S_DDP / β
#
# のときです。fp16 は呼び出しの回数が DDP と同じなので α の項は消え、t_fp16 > t_DDP なら
#
# β* = (S_DDP − S_fp16) / (t_fp16 − t_DDP)
#
# より遅いリンクで得になります。t_fp16 ≤ t_DDP なら、どの帯域でも得です。レッスン 06 のモデルとの違いは、
# t_m を予測せず、ループバックで測った値を使うことです。圧縮の計算も、重なりも、その中に入っています。

# %% [markdown] lang="en"
# ### The crossover, measured and predicted
#
# The crossover is the bandwidth below which a method's step is shorter than DDP's.
# Measured, it is interpolated in log β between the two links where the ratio crosses
# 1 (`slow_link.crossover_bandwidth`).
#
# To predict it: the link adds "calls c × α + bytes S / β" to a step. With t a method's
# step on loopback, its step over the link is t + cα + S/β (the link's delay taken as
# wholly added to the step: for DDP and fp16, part of the first bucket's delay can hide
# behind the rest of the backward, so this is an upper bound; PowerSGD, one bucket sent
# when the backward ends, hides none), and method m pays where
#
# t_m + c_m α + S_m / β < t_DDP + c_DDP α + S_DDP / β.
#
# fp16 makes as many calls as DDP, so the α terms cancel: when t_fp16 > t_DDP it pays on
# links slower than
#
# β* = (S_DDP − S_fp16) / (t_fp16 − t_DDP),
#
# and at every bandwidth when t_fp16 ≤ t_DDP. Unlike lesson 06's model, this does not
# predict t_m: it takes the one measured on loopback, which holds the compression's
# compute and the overlap already.

# %% [markdown] lang="ja"
# ## 演習: fp16 の分かれ目を予測する
#
# `fp16_crossover(t_ddp, t_fp16, S_ddp, S_fp16, calls, alpha_s)` を書いてください。DDP と fp16 の
# ループバックでの 1 ステップの時間 (秒)、1 ステップにリンクに渡すバイト数、1 ステップの all-reduce の回数
# (2 つで同じ)、リンクの α (秒) から、fp16 が DDP より速くなる帯域の上限 β* を、バイト/秒で返します。
# fp16 がループバックですでに DDP より速い (か同じ) ときは、どの帯域でも得なので `math.inf` を返します。
#
# 確認のセルは、上で測った値と、決まった値のいくつかで関数を呼び、答えと比べます。決まった値には、
# 送るバイト数が DDP の半分ではない圧縮の場合も入っています (式は同じです)。

# %% [markdown] lang="en"
# ## Exercise: predict fp16's crossover
#
# Write `fp16_crossover(t_ddp, t_fp16, S_ddp, S_fp16, calls, alpha_s)`: from DDP's and
# fp16's steps on loopback (seconds), the bytes each hands the link per step, the
# all-reduces per step (the same for both) and the link's α (seconds), return the
# bandwidth β* below which fp16 beats DDP, in bytes per second. Where fp16 is already as
# fast as DDP or faster on loopback, it pays at every bandwidth: return `math.inf`.
#
# The check calls your function with the values measured above and with a few fixed
# ones, among them a compression that sends other than half of DDP's bytes (the formula
# is the same), and compares.

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
# PowerSGD は 1 つのバケットで 3 回 (バイアス、P、Q) 呼びます。このモデルの DDP はバケット 2 つで
# 2 回なので、ここでは 1 回多く、α の項が残ります。
# β* = (S_DDP − S_m) / (t_m − t_DDP + (c_m − c_DDP) α) です。次のセルは、2 つの方法の予測と測った値を
# 出し、予測の式が「ループバックの 1 ステップ + リンクの遅延」の 2 本の曲線が交わる帯域と一致すること
# を確かめます。

# %% [markdown] lang="en"
# PowerSGD makes three calls in its one bucket (the biases, P, Q), where DDP's two
# buckets on this model make two: one more here, so its α term stays:
# β* = (S_DDP − S_m) / (t_m − t_DDP + (c_m − c_DDP) α). The next cell prints both
# methods' predicted and measured crossovers, and checks that the formula gives the
# bandwidth where the two curves "loopback step + the link's delay" cross.

# %%
def predicted_crossover(name):
    """β* from the loopback steps: where t + c·α + S/β is equal for name and DDP."""
    m, d = loop[name], loop["DDP"]
    extra = m["step_s"] - d["step_s"] + (m["calls"] - d["calls"]) * LINK_ALPHA
    return (d["bytes"] - m["bytes"]) / extra if extra > 0 else math.inf


def loopback_plus_link(name, beta):
    return loop[name]["step_s"] + loop[name]["calls"] * LINK_ALPHA + loop[name][
        "bytes"] / beta


def shown(beta):
    """A crossover as bandwidth, or where the method never or always pays."""
    if beta is None:
        return "none (slower than DDP on every link)"
    return "at every bandwidth" if beta == math.inf else f"{beta / 1e6:,.0f} MB/s"


grid = [10 ** (6 + k / 100) for k in range(601)]  # 1 MB/s to 1 TB/s
crossover = {}
for name in METHODS[1:]:
    measured = slow_link.crossover_bandwidth([(b, ratio(b, name)) for b in BETAS])
    crossover[name] = predicted = predicted_crossover(name)
    print(f"{name}: crossover measured {shown(measured)}, predicted {shown(predicted)}"
          f" (loopback step {loop[name]['step_s'] / loop['DDP']['step_s']:.2f} x DDP's)")
    on_grid = slow_link.crossover_bandwidth(
        [(b, loopback_plus_link(name, b) / loopback_plus_link("DDP", b)) for b in grid])
    if predicted > grid[-1]:  # math.inf, or a crossing beyond the grid
        assert on_grid == math.inf
    else:
        assert math.isclose(on_grid, predicted, rel_tol=1e-3)  # interpolated
assert crossover["fp16"] == fp16_crossover(t_ddp, t_fp16, S_ddp, S_fp16, calls,
                                           alpha_s)

# %% [markdown] lang="ja"
# 分かれ目は、ループバックでの 2 つの方法の差が数 ms しかないところで決まります。その差はこのマシンの
# 揺らぎと同じくらいなので、測った値も予測も、実行のたびに大きく動きます。bench (`bench/run.py
# --only crossover`) の 7 回の実行では、fp16 の分かれ目 (実測) は 1.2〜4.3 GB/s で、1 回だけ 5 GB/s を
# 超えました (試したどのリンクでも DDP より速かった)。PowerSGD r = 1 は 0.75〜1.9 GB/s で、やはり 1 回は
# 5 GB/s を超えました。
# どの実行でも、500 MB/s 以下では 2 つとも DDP より速くなりました (`bench/README.md`)。
# このセルが確かめるのは、予測の式そのものと、最も遅いリンクで圧縮が得になることまでです。

# %% [markdown] lang="en"
# The crossover is decided where the two methods' loopback steps differ by a few ms,
# about this machine's noise, so both the measured and the predicted crossover move a
# lot from run to run. Over seven runs of the bench (`bench/run.py --only crossover`),
# fp16's measured crossover was 1.2 to 4.3 GB/s and once above 5 GB/s (faster than DDP
# on every link swept), PowerSGD r = 1's 0.75 to 1.9 GB/s and once above 5 GB/s; in
# every run both beat DDP at 500 MB/s and below (`bench/README.md`). What these cells
# check is the formula itself, and that compression pays on the slowest link.

# %% [markdown] lang="ja"
# ## 計算時間も入れた 1 ステップのモデル
#
# レッスン 06 のモデルは、送るバイト数しか考えに入れません。DDP の 1 ステップから DDP の通信の時間を引き、
# その方法の通信の時間を足します。圧縮の計算 (fp16 への変換、PowerSGD の行列の積と直交化) は入って
# いません。`send_less.predicted_step_s(..., added_compute_s=...)` は、その方法が DDP より余分に
# 使う計算の時間を足します。余分な計算は、上で一緒に測ったローカルのステップ (通信をしないコピーの
# 1 ステップ) の、その方法と DDP の差です (2 つのランクの平均)。
#
# PowerSGD の 3 回の all-reduce のうち 2 回目と 3 回目は、フューチャーのコールバックの中から順に
# 発行され、その場で完了を待ちます (`torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py` の
# `powerSGD_hook` の終わり)。gloo はコールバックを自分のワーカースレッドで走らせ、all-reduce のたびに
# 速いほうのランクが遅いほうを待ちます。ローカルのステップではコールバックがメインスレッドでその場で
# 走り、どちらのランクも待たないので、この時間は入っていません。`callback_chain.chain_wait_s` は、
# 同じ形のコールバックの連鎖 (PowerSGD と同じ大きさの all-reduce 3 回と、PowerSGD が足す計算を 4 つに
# 分けたもの) を別に測ります。連鎖全体の時間のうち、計算と all-reduce 3 回の時間を超えた分を、
# コールバックから発行した all-reduce 1 回あたりに直して返します。`predicted_step_s(..., chain_wait_s=...)` はそれを足します
# (PowerSGD では P と Q の 2 回分)。予測するステップに合わせて決めた値ではありません。
#
# 次の 2 つのセルは、α と β をループバックの all-reduce で当てはめ (レッスン 06 と同じ)、ループバックと
# 500 MB/s のリンクで、2 つのモデルの予測と測った値を比べます。リンクを通すときは、当てはめた α–β に
# リンクを足したもの (`slow_link.combined`) で通信の時間を数え、DDP の 1 ステップはリンクを通して
# 測った値から始めます。リンクには、規則の α + バイト数 / β のほかに、それ自身のオーバーヘッドも
# あります。完了をリンクのスレッドに渡して戻すぶんで、all-reduce 1 回ごとにかかります。
# `slow_link.own_cost_s` が遅延 0 のリンクとループバックを交互に測って求め、モデルはそれを α に足します。
# 2 つの中央値の差なので、負荷が高いと負に出ることがありますが、実際のコストは負にならないので、
# 0 を下限にします (負の α は `slow_link.combined` が受け付けません)。

# %% [markdown] lang="en"
# ## A step model that knows compute too
#
# Lesson 06's model takes only the bytes into account: DDP's step, minus DDP's
# communication time, plus the method's. The compression's compute (casting to fp16;
# PowerSGD's products and orthogonalization) is not in it.
# `send_less.predicted_step_s(..., added_compute_s=...)` adds the compute a method
# spends beyond DDP's: its local step (its copy's step sending nothing, timed above in
# the same rounds) minus DDP's, the two ranks' mean.
#
# After the first, PowerSGD's three all-reduces are issued one after the other from
# future callbacks and waited there (the end of `powerSGD_hook` in
# `torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py`). gloo runs the
# callbacks on its worker threads, and at each all-reduce the faster rank waits for the
# slower. The local step runs the callbacks inline on the main thread, and no rank
# waits, so that time is not in it. `callback_chain.chain_wait_s` measures it apart, on
# a chain of the same shape (three all-reduces of PowerSGD's size, its added compute
# in four pieces): what the chain took beyond its compute and its three all-reduces,
# per all-reduce issued in a callback. `predicted_step_s(..., chain_wait_s=...)` adds
# it (P's and Q's for PowerSGD). It is not fitted on the steps it predicts.
#
# The next two cells fit α and β on loopback all-reduces (as lesson 06 does) and compare
# both models with the measured steps, on loopback and over the 500 MB/s link. Over the
# link, communication is priced by the fitted α–β with the link added
# (`slow_link.combined`), and DDP's step is the one measured over the link. Beyond its
# rule α + bytes / β the link has a cost of its own: handing each all-reduce's
# completion to the link's thread and back. `slow_link.own_cost_s` measures it, a link
# of no delay against the loopback in turns, and the model adds it to α. A difference
# of two medians, it can come out negative on a loaded machine; the true cost cannot
# be, so it stops at 0 (`slow_link.combined` refuses a negative α).

# %%
# %%px
from labkit import comm

sizes = [4**k * 1024 for k in range(2, 8)]  # 16 KiB .. 16 MiB
seconds = comm.allreduce_sweep(sizes, repeat=5)

from labkit import callback_chain

# PowerSGD's chain (its P and Q all-reduces issued in callbacks), measured apart on
# a chain of its shape: all-reduces of its size, its added compute in four pieces.
psgd, ddp_loop = over[float("inf")]["PowerSGD r=1"], over[float("inf")]["DDP"]
chain = callback_chain.chain_wait_s(
    3, psgd["bytes"] // 3 // 4,
    max(0.0, psgd["local_step_s"] - ddp_loop["local_step_s"]) / 4, rounds=10)
# The link's own cost per all-reduce (the hand-off to its thread and back),
# measured with no delay against the loopback.
own_s = slow_link.own_cost_s()

# %%
from labkit import callback_chain, comm

ab = comm.fit_alpha_beta(ranks.pull("sizes")[0], ranks.pull("seconds")[0], world_size=2)
chain = ranks.pull("chain")[0]  # the ranks' mean
own_s = ranks.pull("own_s")[0]  # the ranks' mean
LINK_BETA = 5e8
local = [{name: o[math.inf][name]["local_step_s"] for name in METHODS} for o in over]
added = {name: sum(r[name] - r["DDP"] for r in local) / len(local) for name in METHODS}
worst = {}
print(f"alpha = {ab.alpha * 1e6:.0f} µs, beta = {ab.beta / 1e9:.2f} GB/s, "
      f"chain: {chain['per_call_s'] * 1e3:.2f} ms per all-reduce in a callback, "
      f"the link's own cost: {own_s * 1e3:.2f} ms per all-reduce")
print(f"{'link':>10} {'method':>13} {'measured':>9} {'bytes only':>15} "
      f"{'with compute':>15} {'added':>8} {'chain':>8}")
for beta, model_ab in ((math.inf, ab), (LINK_BETA, slow_link.combined(
        ab, LINK_ALPHA + own_s, LINK_BETA, 2))):
    ddp = steps[beta]["DDP"]
    for name in METHODS[1:]:
        r = steps[beta][name]
        chain_s = chain["per_call_s"] * callback_chain.chained_calls(name, r["calls"])
        bytes_only, with_compute = (send_less.predicted_step_s(
            ddp["step_s"], send_less.Sent(ddp["bytes"], ddp["calls"]),
            send_less.Sent(r["bytes"], r["calls"]), model_ab, 2, *extra)
            for extra in ((0.0, 0.0), (added[name], chain_s)))
        errors = [abs(p - r["step_s"]) / r["step_s"]
                  for p in (bytes_only, with_compute)]
        for key, error in zip(("bytes only", "with compute"), errors, strict=True):
            worst[key] = max(worst.get(key, 0.0), error)
        print(f"{'loopback' if beta == math.inf else f'{beta / 1e6:g} MB/s':>10} "
              f"{name:>13} {r['step_s'] * 1e3:>7.1f}ms "
              f"{bytes_only * 1e3:>7.1f}ms {errors[0]:>5.0%} "
              f"{with_compute * 1e3:>7.1f}ms {errors[1]:>5.0%} "
              f"{added[name] * 1e3:>+6.2f}ms {chain_s * 1e3:>6.2f}ms")
print(f"worst error: bytes only {worst['bytes only']:.0%}, "
      f"with compute {worst['with compute']:.0%}")

# %% [markdown] lang="ja"
# バイト数だけのモデルは、圧縮する方法の 1 ステップを実際より短く見積もります (レッスン 06 と同じです)。PowerSGD の
# ローカルのステップは DDP より長く、その差 (行列の積と直交化) がバイト数だけのモデルにない計算です
# (表の added の列)。計算を足すと、たいてい最大誤差は小さくなります。
#
# ただし、どちらも実行ごとに大きく変わります。マシンに負荷をかけながら (`python -c "while True:
# pass"` を並行して 1 つか 2 つ動かして) 同じ測定を 16 回繰り返すと、PowerSGD が足す計算は 3.1〜13.2 ms、
# バイト数だけのモデルの最大誤差は 32〜80%、計算を足したモデルは 7〜56% で、計算を足したほうが
# 小さかったのは 16 回のうち 15 回でした。いつもではないので、このセルは表示するだけで、何も確かめません。
# 確かめられるのは、上のセルのような、負荷に左右されない決まりごとです。
#
# bench (`bench/run.py --only levers`) は、さらに多くの要素を入れたモデルで、レッスン 06 のすべての方法を
# 予測します。fp16 の all-reduce は、float16 の all-reduce で当てはめた α–β で見積もります。この
# マシンの CPU では、gloo の all-reduce は float16 のほうが 1 バイトあたり遅く、当てはめた β は
# float32 の 1.59 GB/s に対して 0.79 GB/s でした。また、DDP の通信のうち逆伝播に隠れていた分は、
# PowerSGD 以外の方法でも同じだけ隠れるとみなして、予測に足し戻します。PowerSGD のバケットは 1 つで、
# 逆伝播が終わるまでそろわないからです (`send_less.hidden_s`、`send_less.hides`)。リンクを通すときは、
# 上のセルと同じく、リンク自身のオーバーヘッドを all-reduce 1 回ごとに足します。負荷の低いマシンでの
# 4 回の実行で、最大誤差はループバックで 0.08〜0.15、500 MB/s のリンクで 0.08〜0.11 でした (目標は
# 0.2)。ただし、別の日の 2 回の実行では、PowerSGD がループバックで 0.21〜0.23 外れました。連鎖の測定
# (`callback_chain.chain_wait_s`) がその日は小さく出ていて、なぜ日によって違うのかはわかっていません
# (`bench/README.md`)。

# %% [markdown] lang="en"
# The model that knows only the bytes predicts the compressing methods too fast (as in
# lesson 06). PowerSGD's local step is longer than DDP's; the difference (its products
# and orthogonalization) is compute the bytes-only model leaves out (the table's added
# column). With the compute added, the worst error usually shrinks.
#
# But both move a lot from run to run. Repeating the same measurement 16 times with the
# machine kept busy (one or two `python -c "while True: pass"` beside it), the compute
# PowerSGD adds was 3.1 to 13.2 ms, the bytes-only model's worst error 32 to 80%, the
# compute-aware one's 7 to 56%, and the compute-aware one was the smaller in 15 of the
# 16. Not always: so this cell prints and asserts nothing. What can be asserted are
# rules no load changes, as in the cell above.
#
# The bench (`bench/run.py --only levers`) predicts all of lesson 06's methods with a
# model that knows more again. It prices fp16's all-reduces by an α–β fitted on float16
# all-reduces: on this CPU gloo's float16 all-reduce costs more per byte; the fitted β was
# 0.79 GB/s against 1.59 GB/s for float32. It also gives back what of DDP's
# communication the backward hid, except to PowerSGD, whose one bucket is ready only
# when the backward ends (`send_less.hidden_s`, `send_less.hides`). Over the link it
# adds the link's own cost to every all-reduce, as the cell above does. In four runs on
# a quiet machine the worst error was 0.08 to 0.15 on the loopback and 0.08 to 0.11 over
# the 500 MB/s link (the goal: 0.2). In two runs on another day, though, PowerSGD was off
# by 0.21 to 0.23 on the loopback: that day the chain measured apart
# (`callback_chain.chain_wait_s`) came out small, and why it differs between days is not
# known (`bench/README.md`).

# %% [markdown] lang="ja"
# ## ローカル SGD
# <!-- section: localsgd -->
#
# DDP は毎ステップ、勾配を all-reduce します。**ローカル SGD** (Stich、2019、"Local SGD Converges
# Fast and Communicates Little"、ICLR) では、各ランクが自分のバッチだけで H 回ステップし
# (all-reduce なし)、そのあとでパラメータを平均します (パラメータの all-reduce ÷ N)。
# 平均と平均のあいだに、レプリカは少しずつ離れていきます。1 回の平均で送るのはパラメータと同じ大きさ、
# つまり DDP の 1 ステップの勾配と同じバイト数なので、H ステップに 1 回にすれば、送るバイト数は
# 1/H になります。
#
# 次のセルがローカル SGD をそのまま書いたものです。課題は教師ネットワークの回帰
# (`data.TeacherDataset`)、モデルは幅 32 の MLP です。`local_sgd.batch` はステップ t のランク r の
# バッチ (DDP のランクと同じサンプル) を、`local_sgd.evaluate` は検証データ 1024 サンプルでの損失を
# 返します。`warmup` は、はじめの何ステップかを DDP と同じく勾配の平均で進めるためのもので、
# あとで torch の実装と比べるときに使います。

# %% [markdown] lang="en"
# ## Local SGD
# <!-- section: localsgd -->
#
# DDP all-reduces the gradients at every step. In **local SGD** (Stich, 2019, "Local SGD
# Converges Fast and Communicates Little", ICLR) each rank takes H steps
# on its own batches alone (no all-reduce), then the parameters are averaged (an
# all-reduce of the parameters, divided by N). Between averages the replicas drift
# apart. One average sends as many bytes as the parameters, the bytes of one DDP step's
# gradients, so averaging every H steps divides the bytes sent by H.
#
# The next cell is local SGD written out. The task is the teacher network's regression
# (`data.TeacherDataset`), the model an MLP of width 32. `local_sgd.batch` gives rank
# r's batch at step t (the samples a DDP rank would get), `local_sgd.evaluate` the loss
# on 1024 samples never trained on. `warmup` takes the first steps with averaged
# gradients, as DDP does: it is for the comparison with torch's implementation below.

# %%
# %%px
import torch
import torch.distributed as dist

from labkit import comm_counting, local_sgd, models

task = local_sgd.Task()  # the teacher's regression, an MLP of width 32
dataset = local_sgd.make_dataset(task)
loss_fn = models.MyLoss()


def average_parameters(model):
    """Every rank's parameters become the ranks' mean: one all-reduce of them all."""
    with torch.no_grad():
        flat = torch.cat([p.reshape(-1) for p in model.parameters()])
        flat /= world_size  # divided first, as torch's averager does
        dist.all_reduce(flat)  # the sum of the ranks' shares: their mean
        offset = 0
        for p in model.parameters():
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def train_local_sgd(H, steps, lr=0.1, warmup=0, drift=None):
    """Local SGD: after `warmup` DDP-like steps, average the parameters every H steps.

    Returns the model and the held-out loss after each average, as (step, loss).
    """
    model = local_sgd.make_model(task)  # the same start on every rank
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)  # plain SGD: no momentum
    curve = []
    for step in range(steps):
        X, y = local_sgd.batch(dataset, task, step, rank, world_size)  # this rank's
        optimizer.zero_grad()
        loss_fn(model(X), y).backward()  # this rank's gradient alone: no all-reduce
        if step < warmup:  # warm-up: average the gradients, as DDP does
            for p in model.parameters():
                p.grad /= world_size
                dist.all_reduce(p.grad)
        optimizer.step()
        if step >= warmup and (step - warmup) % H == H - 1:  # H local steps done
            if drift is not None:
                drift.append(local_sgd.divergence(model))  # apart, before averaging
            average_parameters(model)
            if drift is not None:
                drift.append(local_sgd.divergence(model))  # right after averaging
            curve.append((step + 1, local_sgd.evaluate(model, dataset, task)))
    return model, curve

# %% [markdown] lang="ja"
# H = 1 で、モーメンタムのない SGD なら、ローカル SGD は DDP と同じです。更新が勾配について線形なので、
# 1 ステップのあとのパラメータの平均は、平均した勾配での 1 ステップに等しいからです:
# (1/N) Σ (θ − lr g_r) = θ − lr (1/N) Σ g_r。ただし丸め方が違うので、ビット単位では一致しません
# (ここでは 64 ステップのあとで最大 3e-7 ほどの差でした)。セルは 1e-6 以内を確かめます。
#
# 続いて、H = 8 で、平均の直前と直後にレプリカがどれだけ離れているかを測ります。
# `local_sgd.divergence` は、ランクのパラメータと全ランクの平均との距離 (L2) の最大値です
# (all-gather で集めます)。平均の直前は 0 より大きく、直後はちょうど 0 です。

# %% [markdown] lang="en"
# With H = 1 and SGD without momentum, local SGD is DDP: the update is linear in the
# gradient, so averaging the parameters after one step equals one step with the
# averaged gradient, (1/N) Σ (θ − lr g_r) = θ − lr (1/N) Σ g_r. The rounding differs,
# so not bit for bit (here at most about 3e-7 after 64 steps); the cell checks 1e-6.
#
# Then, with H = 8, how far the replicas are apart right before and right after each
# average. `local_sgd.divergence` is the largest distance (L2) of a rank's parameters
# from the ranks' mean (gathered with an all-gather): above 0 before an average,
# exactly 0 after.

# %%
# %%px
from torch.nn.parallel import DistributedDataParallel as DDP

steps = 64
ddp = DDP(local_sgd.make_model(task))
ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
for step in range(steps):
    X, y = local_sgd.batch(dataset, task, step, rank, world_size)
    ddp_optimizer.zero_grad()
    loss_fn(ddp(X), y).backward()  # DDP all-reduces the gradients
    ddp_optimizer.step()

local1, _ = train_local_sgd(H=1, steps=steps)
gap = max((a - b).abs().max().item()
          for a, b in zip(local1.parameters(), ddp.module.parameters(), strict=True))
print(f"H = 1 after {steps} steps: largest difference from DDP {gap:.1e}")
assert gap <= 1e-6, gap  # momentum or a different lr would break the equality

drift = []
train_local_sgd(H=8, steps=32, drift=drift)
before, after = drift[0::2], drift[1::2]
print("distance from the mean, before each average:", [f"{d:.3f}" for d in before])
print("right after each average:", after)
assert all(d > 1e-3 for d in before)  # the replicas drifted apart
assert all(d == 0 for d in after)  # identical again, bit for bit

# %% [markdown] lang="ja"
# ### ステップ数と送ったバイト数で見た損失
#
# H = 1、4、16 で 64 ステップ学習します。`comm_counting.CollectiveLog` が all-reduce を 1 回ずつ
# 記録するので、送ったバイト数は計算ではなく数えた値です。どの平均も、パラメータ全体
# (682 個の float32、2,728 バイト) の all-reduce 1 回で、回数は 64 / H です。

# %% [markdown] lang="en"
# ### Loss against steps and against bytes sent
#
# 64 steps for H = 1, 4 and 16. `comm_counting.CollectiveLog` records each all-reduce,
# so the bytes sent are counted, not computed: each average is one all-reduce of all
# the parameters (682 float32 values, 2,728 bytes), 64 / H of them.

# %%
# %%px
runs = {}
for H in (1, 4, 16):
    with comm_counting.CollectiveLog(ops=("all_reduce",)) as log:
        model, curve = train_local_sgd(H, steps=64)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert {c["bytes"] for c in log.calls} == {param_bytes}  # the parameters, each time
    assert log.count("all_reduce") == 64 // H  # H divides the bytes
    runs[H] = {"curve": curve, "bytes": log.nbytes(), "param_bytes": param_bytes}
    print(f"H = {H:2d}: {log.count('all_reduce')} averages of {param_bytes:,} bytes = "
          f"{log.nbytes():,} bytes, held-out loss {curve[-1][1]:.4f}")

# %%
import torch

from labkit import exercises, local_sgd, plots

runs = ranks.pull("runs")[0]
param_bytes = runs[1]["param_bytes"]
psi = sum(p.numel() for p in local_sgd.make_model(local_sgd.Task()).parameters())
assert param_bytes == 4 * psi  # float32: 4 bytes per parameter
for H, r in runs.items():
    assert r["bytes"] == (64 // H) * param_bytes  # H = 4 sends a quarter of H = 1's
final = {H: r["curve"][-1][1] for H, r in runs.items()}
assert final[16] < 1.01 * final[1]  # 1/16 of the bytes, within 1% of the loss (0.2%)
by_step = {f"H = {H}": ([s for s, _ in r["curve"]], [v for _, v in r["curve"]])
           for H, r in runs.items()}
by_bytes = {f"H = {H}": ([i * param_bytes for i in range(1, len(r["curve"]) + 1)],
                         [v for _, v in r["curve"]]) for H, r in runs.items()}
fig = plots.line_chart(by_step, xlabel="optimizer_step", ylabel="held_out_loss",
                       title="loss_vs_steps")
fig = plots.line_chart(by_bytes, xlabel="bytes_sent_per_rank",
                       ylabel="held_out_loss", title="loss_vs_bytes")

# %% [markdown] lang="ja"
# 64 ステップのあとの損失は、H = 16 でも H = 1 とほとんど変わらず、送ったバイト数は 1/16 です
# (値は上の出力のとおり。この小さな課題では、レプリカが離れても平均すれば戻ります)。

# %% [markdown] lang="en"
# After 64 steps the loss with H = 16 is almost that of H = 1, for 1/16 of the bytes
# (the values are in the output above: on this small task, the replicas drift apart
# and the average brings them back).

# %% [markdown] lang="ja"
# ### torch の `PostLocalSGDOptimizer`
#
# torch では、DDP の通信フック `post_localSGD_hook` と、パラメータを平均する
# `PostLocalSGDOptimizer` (モデルを平均するもの `ModelAverager` を受け取ります。ここでは
# `PeriodicModelAverager`) を組み合わせます。W ステップの DDP のあとでローカル SGD に切り替える
# post-local SGD (Lin ほか、2020、"Don't Use Large Mini-Batches, Use Local SGD"、ICLR、
# arXiv 1808.07217。torch のドキュメントもこれを挙げています) の実装です。はじめの
# `start_localSGD_iter` ステップは、フックがふつうの DDP と同じく勾配を all-reduce します
# (ウォームアップ)。そのあと、フックは既定では `subgroup` (既定ではノードごとのサブグループ) の中で
# 勾配を all-reduce し続けます。ところが `subgroup=None` のとき、フックはサブグループを
# `dist.new_subgroups()` で作り、その既定の大きさは GPU の数です
# (`torch/distributed/algorithms/ddp_comm_hooks/post_localSGD_hook.py` と
# `torch/distributed/distributed_c10d.py` の `new_subgroups`)。CPU では、ウォームアップが終わったあとの
# 最初の逆伝播で、次のエラーになります (次のセルで捕まえて確かめます)。
#
# 代わりに渡すもの:
# - `post_local_gradient_allreduce=False`: ウォームアップのあとは勾配を送りません。上で書いた
#   ローカル SGD そのものです (このレッスンはこちらを使います)。
# - または `subgroup=dist.new_subgroups(group_size=1)[0]`: ランクを 1 つずつ別々のグループに入れるので、
#   all-reduce しても値は変わりません。GPU のクラスタで、ノードの中では毎ステップ勾配を平均し、
#   ノードの間では H ステップごとにパラメータを平均したいときは、ノードの GPU の数を `group_size` に
#   渡します。

# %% [markdown] lang="en"
# ### torch's `PostLocalSGDOptimizer`
#
# torch combines DDP's communication hook `post_localSGD_hook` with
# `PostLocalSGDOptimizer`, which averages the parameters (it takes a model averager, a
# `ModelAverager`: here a `PeriodicModelAverager`). Together they implement post-local
# SGD, W steps of DDP and then local SGD (Lin et al., 2020, "Don't Use Large
# Mini-Batches, Use Local SGD", ICLR; arXiv 1808.07217, which torch's docstrings
# cite). For the first `start_localSGD_iter` steps the hook
# all-reduces the gradients like plain DDP (the warm-up). After that, by default, it
# keeps all-reducing gradients within `subgroup` (by default one subgroup per node).
# With `subgroup=None` the hook makes it with `dist.new_subgroups()`, whose default
# size is the number of GPUs (`torch/distributed/algorithms/ddp_comm_hooks/
# post_localSGD_hook.py`, and `new_subgroups` in `torch/distributed/distributed_c10d.py`).
# On the CPU, the first backward pass after the warm-up fails with the error below
# (caught and checked in the next cell).
#
# What to pass instead:
# - `post_local_gradient_allreduce=False`: no gradients sent after the warm-up, which
#   is the local SGD written above (this lesson uses it);
# - or `subgroup=dist.new_subgroups(group_size=1)[0]`: each rank alone in its group,
#   where an all-reduce changes nothing. On a GPU cluster, to average gradients within
#   each node at every step and parameters across nodes every H steps, pass the GPUs
#   per node as `group_size`.

# %%
# %%px
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local
from torch.distributed.algorithms.model_averaging import averagers
from torch.distributed.optim import PostLocalSGDOptimizer


def train_torch_local_sgd(H, steps, warmup, averager_warmup, lr=0.1, subgroup=None,
                          **state_args):
    """torch's post-local SGD: `warmup` DDP steps, then parameters averaged every H."""
    ddp = DDP(local_sgd.make_model(task))
    state = post_local.PostLocalSGDState(process_group=None, subgroup=subgroup,
                                         start_localSGD_iter=warmup, **state_args)
    ddp.register_comm_hook(state, post_local.post_localSGD_hook)
    averager = averagers.PeriodicModelAverager(period=H, warmup_steps=averager_warmup)
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(ddp.parameters(), lr=lr), averager)
    for step in range(steps):
        X, y = local_sgd.batch(dataset, task, step, rank, world_size)
        optimizer.zero_grad()
        loss_fn(ddp(X), y).backward()  # all-reduced only while in the warm-up
        optimizer.step()  # the local step, then the averager's turn
    return ddp.module


error = None
try:  # the defaults: subgroup=None, post_local_gradient_allreduce=True
    train_torch_local_sgd(H=4, steps=3, warmup=2, averager_warmup=2)
except ValueError as e:
    error = e
print(f"{type(error).__name__}: {error}")
assert torch.cuda.is_available() or "only takes effect when CUDA" in str(error)

# %% [markdown] lang="ja"
# 次に、torch の実装と、上で手で書いた実装を比べます。数え方を合わせる必要があります。
#
# - フックは逆伝播の回数を数えます (`state.iter`。最後のバケットで 1 つ増えます)。最初の
#   `start_localSGD_iter` = W 回は勾配を all-reduce します。上の `warmup` = W と同じです。
# - 平均するほうは `optimizer.step()` の回数を数え (`averager.step`、0 から)、
#   `step >= warmup_steps` かつ `(step − warmup_steps) % period == 0` のときに平均します。
#   ドキュメントのとおり `warmup_steps` = W にすると、最初の平均はウォームアップ直後の最初の
#   ローカルのステップのすぐあとに来て、上で手で書いた実装 (H 回ローカルにステップしてから平均) とは
#   H − 1 ステップずれます。`warmup_steps` = W + H − 1 にすれば同じ時点で平均します。
#
# そろえると、パラメータはビット単位で一致します (平均も、torch と同じく先に N で割ってから
# all-reduce しているためです)。ドキュメントどおりの `warmup_steps` = W では一致しないことも
# 確かめます。

# %% [markdown] lang="en"
# Now torch's implementation against the one written above. The counting must match:
#
# - the hook counts backward passes (`state.iter`, one more at the last bucket) and
#   all-reduces the gradients in the first `start_localSGD_iter` = W of them: our
#   `warmup` = W;
# - the averager counts `optimizer.step()` calls (`averager.step`, from 0) and averages
#   when `step >= warmup_steps` and `(step − warmup_steps) % period == 0`. With
#   `warmup_steps` = W, as its documentation asks, the first average comes right after
#   the first local step after the warm-up, H − 1 steps away from ours (H local steps,
#   then average). `warmup_steps` = W + H − 1 averages when ours does.
#
# Matched, the parameters are equal bit for bit (our average, like torch's, divides by
# N before the all-reduce). The cell also checks that the documented `warmup_steps` = W
# does not match.

# %%
# %%px
W, H, T = 3, 4, 35
ours, _ = train_local_sgd(H, T, warmup=W)
theirs = train_torch_local_sgd(H, T, warmup=W, averager_warmup=W + H - 1,
                               post_local_gradient_allreduce=False)
gap = max((a - b).abs().max().item()
          for a, b in zip(ours.parameters(), theirs.parameters(), strict=True))
documented = train_torch_local_sgd(H, T, warmup=W, averager_warmup=W,
                                   post_local_gradient_allreduce=False)
shifted = max((a - b).abs().max().item()
              for a, b in zip(ours.parameters(), documented.parameters(), strict=True))
print(f"torch's, averager warm-up W + H - 1: largest difference {gap:.1e}; "
      f"with W: {shifted:.1e}")
assert gap == 0  # bit for bit
assert shifted > 1e-4  # averaging H - 1 steps earlier is another run

# %% [markdown] lang="ja"
# ## DiLoCo
#
# DiLoCo (Douillard ほか、2023) は、ローカル SGD の平均を「外側のオプティマイザ」のステップに変えます。
# 全ランクが同じ θ_global を持ち、H 回の内側のステップのあとで:
#
# 1. 疑似勾配 Δ = θ_global − (θ_local のランク間の平均) を all-reduce で求めます。
# 2. 外側のオプティマイザ (論文ではネステロフのモーメンタム、lr 0.7、モーメンタム 0.9 の SGD) が、
#    Δ を勾配として θ_global を 1 ステップ更新します。
# 3. どのランクも θ_global から再開します。
#
# 送るのは Δ (パラメータと同じ大きさ) の all-reduce 1 回なので、バイト数は同じ H のローカル SGD と
# 同じです。内側のオプティマイザは、論文 (言語モデル) では AdamW ですが、ここではローカル SGD と同じ
# モーメンタムのない SGD にします。違いを外側のステップだけにして比べるためで、この小さな回帰では SGD で
# 十分に学習できます。
#
# 外側の lr を 1、モーメンタムを 0 にすると θ_global − Δ = θ_local の平均なので、DiLoCo は
# ローカル SGD と同じです (丸めの差だけ。測った差は 3e-8 ほど)。セルはこれを確かめ、続いて
# 本来の DiLoCo (外側のモーメンタムあり) で、ラウンドごとの平均した Δ を記録します。

# %% [markdown] lang="en"
# ## DiLoCo
#
# DiLoCo (Douillard et al., 2023) turns local SGD's average into the step of an "outer
# optimizer". Every rank holds the same θ_global; after H inner steps:
#
# 1. the pseudo-gradient Δ = θ_global − (the ranks' mean of θ_local), by an all-reduce;
# 2. the outer optimizer (in the paper SGD with Nesterov momentum, lr 0.7, momentum 0.9)
#    steps θ_global with Δ as its gradient;
# 3. every rank restarts from θ_global.
#
# What is sent is one all-reduce of Δ, the size of the parameters: the bytes of local
# SGD with the same H. The paper's inner optimizer (for language models) is AdamW; here
# it is local SGD's, SGD without momentum, so that the outer step is the only
# difference between the two, and SGD trains this small regression well.
#
# With outer lr 1 and no momentum, θ_global − Δ is the mean of θ_local: DiLoCo is local
# SGD (up to rounding, about 3e-8 here). The cell checks that, then runs DiLoCo proper
# and records the averaged Δ of every round.

# %%
# %%px
def train_diloco(H, steps, lr=0.1, outer_lr=0.7, outer_momentum=0.9, record=None):
    """DiLoCo: H inner SGD steps per rank, then an outer Nesterov step on θ_global."""
    model = local_sgd.make_model(task)  # θ_local, the same start on every rank
    inner = torch.optim.SGD(model.parameters(), lr=lr)
    global_params = [p.detach().clone() for p in model.parameters()]  # θ_global
    # torch refuses nesterov=True without momentum; without it the step is lr × Δ
    outer = torch.optim.SGD(global_params, lr=outer_lr, momentum=outer_momentum,
                            nesterov=outer_momentum > 0)
    curve = []
    for step in range(steps):
        X, y = local_sgd.batch(dataset, task, step, rank, world_size)
        inner.zero_grad()
        loss_fn(model(X), y).backward()  # this rank's gradient alone
        inner.step()
        if (step + 1) % H:
            continue
        with torch.no_grad():  # the pseudo-gradient Δ = θ_global − mean of θ_local
            delta = torch.cat([(g - p).reshape(-1)
                               for g, p in zip(global_params, model.parameters(), strict=True)])
            delta /= world_size
            dist.all_reduce(delta)  # the ranks' mean: the one collective of a round
            offset = 0
            for g in global_params:
                g.grad = delta[offset:offset + g.numel()].view_as(g).clone()
                offset += g.numel()
        outer.step()  # θ_global steps with Δ as its gradient
        with torch.no_grad():
            for g, p in zip(global_params, model.parameters(), strict=True):
                p.copy_(g)  # every rank restarts from θ_global
        if record is not None:
            record.append(delta.clone())
        curve.append((step + 1, local_sgd.evaluate(model, dataset, task)))
    return model, curve


plain, _ = train_diloco(H=4, steps=32, outer_lr=1.0, outer_momentum=0.0)
local, _ = train_local_sgd(H=4, steps=32)
gap = max((a - b).abs().max().item()
          for a, b in zip(plain.parameters(), local.parameters(), strict=True))
print(f"DiLoCo with outer lr 1 and no momentum, against local SGD: {gap:.1e}")
assert gap <= 1e-6, gap

deltas = []
diloco, _ = train_diloco(H=4, steps=32, record=deltas)
theta_start = torch.cat([p.detach().reshape(-1)
                         for p in local_sgd.make_model(task).parameters()])
theta_end = torch.cat([p.detach().reshape(-1) for p in diloco.parameters()])
deltas = torch.stack(deltas)  # one averaged pseudo-gradient per round

# %% [markdown] lang="ja"
# 外側のステップが本当にネステロフの更新かを、カーネルで確かめます。記録した平均の Δ から、式を書いて
# θ_global を計算し直します (`torch/optim/sgd.py` の `nesterov=True` と同じ式です)。モーメンタム
# m は 0 から始まり、ラウンドごとに:
#
# m ← μ m + Δ、θ_global ← θ_global − lr (Δ + μ m)
#
# 8 ラウンドのあとの θ_global が、各ランクの値と一致します。モーメンタムを取り除いた外側のステップ
# (θ_global ← θ_global − lr Δ) では一致しません。

# %% [markdown] lang="en"
# Is the outer step really Nesterov's? The kernel recomputes θ_global from the
# recorded averaged Δ with the formula written out (`nesterov=True` in
# `torch/optim/sgd.py`). The momentum m starts at 0; every round:
#
# m ← μ m + Δ, θ_global ← θ_global − lr (Δ + μ m)
#
# After 8 rounds θ_global equals the ranks'. An outer step without the momentum
# (θ_global ← θ_global − lr Δ) would not.

# %%
theta_start, theta_end, deltas = (ranks.pull(name)[0]
                                  for name in ("theta_start", "theta_end", "deltas"))
outer_lr, mu = 0.7, 0.9
theta, m = theta_start.clone(), torch.zeros_like(theta_start)
for delta in deltas:
    m = mu * m + delta
    theta = theta - outer_lr * (delta + mu * m)
no_momentum = theta_start - outer_lr * deltas.sum(0)
print(f"{len(deltas)} rounds: recomputed vs the ranks' θ_global "
      f"{(theta - theta_end).abs().max():.1e}; without momentum "
      f"{(no_momentum - theta_end).abs().max():.1e}")
torch.testing.assert_close(theta, theta_end, rtol=0, atol=1e-6)
assert (no_momentum - theta_end).abs().max() > 1e-2

# %% [markdown] lang="ja"
# ### 同じバイト数で比べる
#
# 送るバイト数をそろえて、ローカル SGD、DiLoCo (どちらも H = 16 で 512 ステップ)、DDP を比べます。
# どれも 1 回に送るのはパラメータの大きさの all-reduce 1 回なので、同じバイト数なら DDP は H 分の 1 の
# 32 ステップしか進めません。損失は時間ではなく、乱数のシードで決まる値なので、このマシンが混んでいても
# 変わりません。セルは同じ学習を 2 回して、ビット単位で一致することも確かめます。

# %% [markdown] lang="en"
# ### At equal bytes sent
#
# Local SGD and DiLoCo (both H = 16, 512 steps) against DDP, at equal bytes: each sends
# one all-reduce of the parameters' size at a time, so at equal bytes DDP takes H times
# fewer steps, 32. The losses are not times: the seeds decide them, however loaded the
# machine. The cell runs each training twice and checks that they match bit for bit.

# %%
# %%px
H, T = 16, 512
equal_bytes = {}
for name, train in (("DDP", lambda: train_local_sgd(1, T // H)),  # H = 1 is DDP
                    ("local SGD", lambda: train_local_sgd(H, T)),
                    ("DiLoCo", lambda: train_diloco(H, T))):
    with comm_counting.CollectiveLog(ops=("all_reduce",)) as log:
        _, curve = train()
    _, again = train()
    assert again == curve  # the same seeds, the same losses, bit for bit
    equal_bytes[name] = {"curve": curve, "bytes": log.nbytes()}
assert len({r["bytes"] for r in equal_bytes.values()}) == 1  # equal bytes sent

# %%
equal_bytes = ranks.pull("equal_bytes")[0]
rows = {name: (r["curve"][-1][0], r["bytes"], r["curve"][-1][1])
        for name, r in equal_bytes.items()}
print(f"{'':10s} {'steps':>6s} {'bytes sent':>11s} {'held-out loss':>14s}")
for name, (steps, nbytes, loss) in rows.items():
    print(f"{name:10s} {steps:6d} {nbytes:11,d} {loss:14.4f}")
loss = {name: row[2] for name, row in rows.items()}
series = {name: ([(i + 1) * psi * 4 for i in range(len(r["curve"]))],
                 [v for _, v in r["curve"]]) for name, r in equal_bytes.items()}
fig = plots.line_chart(series, xlabel="bytes_sent_per_rank", ylabel="held_out_loss",
                       title="loss_vs_bytes")
assert loss["local SGD"] < 0.2 * loss["DDP"]  # measured 0.13: 16x the steps pay
assert loss["DiLoCo"] < 0.95 * loss["local SGD"]  # measured 0.88: the outer momentum

# %% [markdown] lang="ja"
# この課題では、同じバイト数なら、DDP よりローカル SGD が (16 倍のステップを進めるので) ずっと低い
# 損失に届き、DiLoCo の外側のモーメンタムがさらに 1 割ほど下げます (値は上の表のとおり)。
# 課題が変われば差も変わります。レプリカがもっと離れる課題 (大きな H、大きな lr) では、平均だけの
# ローカル SGD は遅くなります。

# %% [markdown] lang="en"
# On this task, at equal bytes, local SGD reaches a far lower loss than DDP (it takes
# 16 times the steps), and DiLoCo's outer momentum lowers it by about a tenth more
# (the values are in the table above). Another task moves the gaps: where the replicas
# drift further apart (a larger H or lr), averaging alone slows local SGD down.

# %% [markdown] lang="ja"
# ## 演習: DiLoCo の外側のステップを書く
#
# `diloco_outer_step(model, global_params, momentum, outer_lr=0.7, mu=0.9)` を書いてください。
# 各ランクで、H 回の内側のステップのあとに呼ばれます。
#
# - `model`: このランクのモデル。パラメータが θ_local です
# - `global_params`: θ_global (テンソルのリスト、どのランクでも同じ)。その場で更新します
# - `momentum`: 外側のモーメンタム m (同じ形のテンソルのリスト、はじめは 0)。その場で更新し、
#   次のラウンドに持ち越します
#
# 手順: Δ = θ_global − (θ_local のランク間の平均)、m ← μ m + Δ、θ_global ← θ_global − lr (Δ + μ m)、
# そしてモデルを θ_global から再開させます。確認のセルは、ランクごとに違う向きへ進む内側のステップの
# あとで 3 ラウンド呼び、torch.optim.SGD (nesterov=True) の値と比べます。

# %% [markdown] lang="en"
# ## Exercise: write DiLoCo's outer step
#
# Write `diloco_outer_step(model, global_params, momentum, outer_lr=0.7, mu=0.9)`,
# called on every rank after its H inner steps:
#
# - `model`: this rank's model, whose parameters are θ_local;
# - `global_params`: θ_global (a list of tensors, the same on every rank), to update in
#   place;
# - `momentum`: the outer momentum m (a list of tensors of the same shapes, zero at
#   first), to update in place and keep for the next round.
#
# The steps: Δ = θ_global − (the ranks' mean of θ_local), m ← μ m + Δ,
# θ_global ← θ_global − lr (Δ + μ m), then the model restarts from θ_global. The check
# calls it for 3 rounds after inner steps that pull each rank elsewhere, and compares
# with torch.optim.SGD (nesterov=True).

# %% tags=["exercise"]
# %%px
def diloco_outer_step(model, global_params, momentum, outer_lr=0.7, mu=0.9):
    """DiLoCo's outer step, on every rank after its H inner steps."""
    with torch.no_grad():
        for g, p, m in zip(global_params, model.parameters(), momentum, strict=True):
            pass  # TODO: Δ averaged over the ranks, then m, then g, then restart p

# %% tags=["solution"]
# %%px
def diloco_outer_step(model, global_params, momentum, outer_lr=0.7, mu=0.9):
    """DiLoCo's outer step, on every rank after its H inner steps."""
    with torch.no_grad():
        for g, p, m in zip(global_params, model.parameters(), momentum, strict=True):
            delta = g - p  # this rank's pseudo-gradient
            dist.all_reduce(delta)
            delta /= world_size  # the ranks' mean
            m.mul_(mu).add_(delta)  # in place: the momentum carries over the rounds
            g.sub_(outer_lr * (delta + mu * m))  # Nesterov's step
            p.copy_(g)  # every rank restarts from θ_global

# %%
exercises.grade_diloco_outer_step(ranks)

# %% [markdown] lang="ja"
# ## バッチはどこまで大きくできるか
# <!-- section: batch -->
#
# ランクを増やすと、全体バッチのサイズ (N ランク × 1 ランクのバッチ b × 累積の回数 K) が大きく
# なります。勾配のノイズが減るので 1 ステップで進める距離は伸びますが、ノイズがもう小さいところでは、
# バッチを大きくしてもステップ数はほとんど減りません。その境目の目安が **勾配のノイズスケール** です
# (McCandlish ほか、2018、"An Empirical Model of Large-Batch Training")。
#
# G を全データの平均の勾配、Σ を 1 サンプルの勾配の共分散とします。B 個のサンプルを独立に選んだ
# バッチの平均の勾配 G_B について、
#
# E|G_B|² = |G|² + tr(Σ) / B
#
# が成り立ちます (バッチの平均が全体の平均からずれる量の二乗の期待値は、1 サンプルの勾配の分散の合計
# tr(Σ) の 1/B です)。
# ノイズスケールは B_simple = tr(Σ) / |G|² です。B がこれよりずっと小さいと、勾配はほとんどノイズです。
#
# 2 つのバッチサイズ B_small < B_big の平均の勾配 G_small、G_big の二乗ノルムを測れば、上の式が
# 2 本になります。2 本の差をとると tr(Σ) が、それぞれに B を掛けてから差をとると |G|² が残り、
# 不偏推定量が 2 つ得られます (論文の付録 A.1)。
#
# - |G|² ≈ (B_big |G_big|² − B_small |G_small|²) / (B_big − B_small)
# - tr(Σ) ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)
#
# DDP は、この 2 つのバッチをもう持っています。all-reduce の前の各ランクの勾配は b サンプルの平均、
# all-reduce で平均したあとの勾配は N·b サンプルの平均です。そこで、通信フックで両方を記録します。
# フックは torch の `allreduce_hook` (`torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py`)
# と同じことをし、バケットを world size で割る前に、その二乗ノルムを、all-reduce の結果が届いたところ
# (`Future.then` のコールバック) で平均の二乗ノルムを記録します。
#
# 題材は、ラベルにノイズのない線形回帰 (特徴量 16、サンプル 4096) です。ここでは学習のはじめ (重みが 0) で、
# パラメータを動かさずに 200 ステップ分の勾配を測ります。比べる正解は、1 プロセスで全サンプルの
# 1 サンプルごとの勾配 (`torch.func` の `vmap` と `grad`) から厳密に計算した tr(Σ) と |G|² です
# (`noise_scale.exact_stats`)。

# %% [markdown] lang="en"
# ## How large a batch can grow
# <!-- section: batch -->
#
# More ranks make a larger global batch (N ranks × b per rank × K accumulated). Less
# noise in the gradient lets a step go further; but once the noise is small, a larger
# batch saves hardly any steps. Where that happens is told by the **gradient noise
# scale** (McCandlish et al., 2018, "An Empirical Model of Large-Batch Training").
#
# Let G be the mean gradient over the data and Σ the covariance of one sample's
# gradient. The mean gradient G_B of a batch of B samples drawn independently has
#
# E|G_B|² = |G|² + tr(Σ) / B
#
# (the batch mean's expected squared distance from G is 1/B of tr(Σ), one sample's
# total variance). The noise
# scale is B_simple = tr(Σ) / |G|²: at batches much smaller, the gradient is mostly
# noise.
#
# The squared norms of the mean gradients G_small and G_big of two batch sizes
# B_small < B_big give two such equations. Their difference leaves tr(Σ); their
# difference after multiplying each by its B leaves |G|²: two unbiased estimates (the
# paper's appendix A.1):
#
# - |G|² ≈ (B_big |G_big|² − B_small |G_small|²) / (B_big − B_small)
# - tr(Σ) ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)
#
# DDP already has both batches: each rank's gradient before the all-reduce is the mean
# of b samples, the averaged one after it the mean of N·b. A comm hook records both.
# It does what torch's `allreduce_hook` does
# (`torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py`), noting the
# bucket's squared norm before dividing it, and the mean's when the all-reduce's result
# arrives (in the `Future.then` callback).
#
# The task: a linear regression without label noise (16 features, 4096 samples). We
# measure at the start of training (weights 0), 200 steps of gradients with the
# parameters held still. The reference is tr(Σ) and |G|² computed exactly in one
# process from every sample's own gradient (`torch.func`'s `vmap` and `grad`;
# `noise_scale.exact_stats`).

# %%
# %%px
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import checks, no_sync, noise_scale

X_all, y_all = noise_scale.regression_data()  # the same 4096 samples on every rank
loss_fn = nn.MSELoss()


def sample(size, generator):
    """`size` samples drawn uniformly with replacement, as the formula assumes."""
    index = torch.randint(0, len(X_all), (size,), generator=generator)
    return X_all[index], y_all[index]


def capture(norms, bucket):
    """DDP's all-reduce, as torch's allreduce_hook, noting |g|² before and after."""
    grad = bucket.buffer()
    norms["small"].append(grad.square().sum().item())  # this rank's b samples
    future = dist.all_reduce(grad.div_(world_size), async_op=True).get_future()

    def averaged(future):
        mean = future.value()[0]
        norms["big"].append(mean.square().sum().item())  # all N·b samples
        return mean

    return future.then(averaged)


model = nn.Linear(16, 1, bias=False)
nn.init.zeros_(model.weight)  # where we measure: the start of training
measured = DDP(model)
norms = {"small": [], "big": []}
measured.register_comm_hook(norms, capture)
b, steps = 8, 200
generator = torch.Generator().manual_seed(1 + rank)  # each rank draws its own
for _ in range(steps):
    X, y = sample(b, generator)
    measured.zero_grad()
    loss_fn(measured(X), y).backward()  # the hook runs here; no step: the model stays

assert len(norms["small"]) == len(norms["big"]) == steps  # one bucket, once a step
g2_small = torch.tensor(norms["small"]).mean()
dist.all_reduce(g2_small)
g2_small = g2_small.item() / world_size  # both ranks' small batches
g2_big = sum(norms["big"]) / steps
B_simple = noise_scale.simple_noise_scale(b, world_size * b, g2_small, g2_big)
exact = noise_scale.exact_stats(model, loss_fn, X_all, y_all)
trace = noise_scale.estimated_trace(b, world_size * b, g2_small, g2_big)
norm_sq = noise_scale.estimated_norm_sq(b, world_size * b, g2_small, g2_big)
print(f"rank {rank}: mean |G_small|² = {g2_small:.3f} (B = {b}), "
      f"mean |G_big|² = {g2_big:.3f} (B = {world_size * b})")
print(f"estimated: tr(Σ) = {trace:.1f}, |G|² = {norm_sq:.2f}, B_simple = {B_simple:.1f}")
print(f"exact, on all 4096 samples: tr(Σ) = {exact['trace']:.1f}, "
      f"|G|² = {exact['norm_sq']:.2f}, B_simple = {exact['noise_scale']:.1f}")
# 300 other draws of these 200 steps miss by 17% at most (tests/test_noise_scale.py).
# A hook that notes the averaged gradient as the small one makes tr(Σ) 0.
assert abs(B_simple / exact["noise_scale"] - 1) < 0.25

# %% [markdown] lang="ja"
# 推定は正解に近くなりました。上のセルは、二乗ノルムを **200 ステップで平均してから** 比をとって
# います。1 ステップごとの推定も不偏ですが、ばらつきが大きく、tr(Σ) の推定が負になる
# こともあります。不偏推定量どうしの比は、比の不偏推定量にはならないので、1 ステップごとの比を
# 平均すると当てになりません (論文も、分子と分母を別々に平均してから割ります)。

# %% [markdown] lang="en"
# The estimate is close to the exact value. The cell above averages the squared norms
# **over the 200 steps first**, then takes the ratio. One step's estimates are
# unbiased too, but so noisy that tr(Σ) can come out negative; and a ratio of unbiased
# estimates is not an unbiased estimate of the ratio, so an average of per-step ratios
# cannot be trusted (the paper too averages numerator and denominator separately).

# %%
# %%px
per_step_traces = [noise_scale.estimated_trace(b, world_size * b, s, g)
                   for s, g in zip(norms["small"], norms["big"], strict=True)]
per_step_ratios = [noise_scale.simple_noise_scale(b, world_size * b, s, g)
                   for s, g in zip(norms["small"], norms["big"], strict=True)]
print(f"rank {rank}: tr(Σ) estimated negative in "
      f"{sum(t < 0 for t in per_step_traces)} of {steps} steps; the mean of the "
      f"per-step ratios is {sum(per_step_ratios) / steps:.1f}, the ratio of the "
      f"means {B_simple:.1f}, exact {exact['noise_scale']:.1f}")
assert min(per_step_traces) < 0  # one step alone can say the noise is negative
# Here the mean of the ratios misses by more than the tolerance above; a lucky draw
# can land close, so the point is that it cannot be trusted, not that it always misses.
assert abs(sum(per_step_ratios) / steps / exact["noise_scale"] - 1) > 0.25

# %% [markdown] lang="ja"
# ## 演習: 2 つのバッチサイズからノイズスケールを求める
#
# 上のセルで測った数を使います。1 ランクのバッチ b = 8、ランクは 2 つ、200 ステップで平均した
# 二乗ノルムは、all-reduce の前 (各ランク) が 25.289、あと (平均) が 16.629 でした (ランク 0 の表示)。
# `noise_scale_estimate(b, world_size, g2_small, g2_big)` を書いて、B_simple = tr(Σ) / |G|² を
# 返してください。`noise_scale` の関数は使わずに、上の 2 つの式から書きます。
#
# 確認のセルは、このレッスンで測った値のほか、b、world_size、tr(Σ)、|G|² を変えた場合でも比べます。
# この関数はカーネルで実行されます。

# %% [markdown] lang="en"
# ## Exercise: the noise scale from two batch sizes
#
# Use the numbers measured above: b = 8 per rank, 2 ranks, and squared norms averaged
# over the 200 steps of 25.289 before the all-reduce (each rank's) and 16.629 after it
# (the mean), as rank 0 printed. Write `noise_scale_estimate(b, world_size, g2_small,
# g2_big)` returning B_simple = tr(Σ) / |G|², from the two formulas above, without
# `noise_scale`'s functions.
#
# The check compares with the lesson's numbers and with other b, world_size, tr(Σ)
# and |G|². The function runs in the kernel.

# %% tags=["exercise"]
def noise_scale_estimate(b, world_size, g2_small, g2_big):
    """B_simple from |G|² measured at b samples (one rank) and N·b (the average)."""
    return None  # TODO: the two batch sizes, |G|², tr(Σ), then their ratio

# %% tags=["solution"]
def noise_scale_estimate(b, world_size, g2_small, g2_big):
    """B_simple from |G|² measured at b samples (one rank) and N·b (the average)."""
    b_small, b_big = b, world_size * b  # one rank's batch; the average's
    norm_sq = (b_big * g2_big - b_small * g2_small) / (b_big - b_small)
    trace = (g2_small - g2_big) / (1 / b_small - 1 / b_big)
    return trace / norm_sq

# %%
from labkit import exercises

exercises.grade_noise_scale(noise_scale_estimate, (8, 2, 25.289, 16.629))

# %% [markdown] lang="ja"
# ## 臨界バッチサイズ: ステップ数はどこで減らなくなるか
#
# 論文は、目標の損失に届くまでのステップ数 S とバッチサイズ B の関係を
# S = S_min (1 + B_noise / B) と見積もります (B_noise はノイズスケールで、B_simple はその近似です)。
# B ≪ B_noise ではバッチを 2 倍にするとステップ数がほぼ半分になり、B ≫ B_noise では S_min から
# ほとんど減りません。処理するサンプル数は E = E_min (1 + B / B_noise) です。論文は
# B_crit = E_min / S_min を **臨界バッチサイズ** と呼び、この式では B_crit = B_noise です。そこでは
# ステップ数が S_min の 2 倍、サンプル数が E_min の 2 倍で、時間と計算の釣り合いがとれます。
#
# 試します。全体バッチのサイズ B = N·b·K を 2 から 256 まで変え、それぞれ重み 0 から SGD で、全データの
# 損失がはじめの 1% 以下になるまでのステップ数を数えます。1 ランクのバッチ b は 16 まで、それより
# 大きいバッチはレッスン 04 の `no_sync.accumulate_no_sync` で K 個のマイクロバッチを累積します
# (同期は 1 ステップに 1 回だけです。レッスン 04 で確かめました)。学習率は、1 つ前のバッチでいちばん
# よかった値から √2 倍ずつ上げていき、ステップ数が減らなくなったところで止めて、その直前の値を使います
# (論文も、バッチごとに学習率を選び直します)。ステップ数は 3 つのシードの平均です。

# %% [markdown] lang="en"
# ## The critical batch size: where the steps stop falling
#
# The paper models the steps S to reach a target loss at batch size B as
# S = S_min (1 + B_noise / B) (B_noise is the noise scale; B_simple approximates it).
# Well below B_noise, twice the batch takes about half the steps; well above it, the
# steps hardly fall below S_min. The samples processed are E = E_min (1 + B / B_noise).
# The paper calls B_crit = E_min / S_min the **critical batch size**; in this model
# B_crit = B_noise, where a run takes twice S_min's steps and twice E_min's samples:
# the balance between time and compute.
#
# We try it: the global batch B = N·b·K from 2 to 256, each trained from zero weights
# with SGD until the loss on all the data is 1% of the start's, counting the steps. A
# rank's batch b goes up to 16; a larger batch accumulates K micro-batches with lesson
# 04's `no_sync.accumulate_no_sync` (one synchronization a step, as lesson 04 checked).
# The learning rate is
# searched upwards in factors of √2 from the previous batch's best, until the steps
# stop falling (the paper too tunes it per batch). The steps are the mean over 3
# seeds.

# %%
# %%px
target = 0.01 * loss_fn(torch.zeros_like(y_all), y_all).item()  # 1% of the start's
trainer = DDP(nn.Linear(16, 1, bias=False))  # weights set to zero before each run
sgd = torch.optim.SGD(trainer.parameters(), lr=0.1)


def steps_to_target(B, lr, seed, max_steps=400):
    """Steps from zero weights, at global batch B = N·b·K, until the loss on all
    the data is at most `target` (max_steps + 1 if not by then)."""
    b = min(B // world_size, 16)  # samples per rank and micro-batch
    K = B // (world_size * b)  # micro-batches per step, accumulated under no_sync
    assert world_size * b * K == B  # the global batch each step averages over
    with torch.no_grad():
        trainer.module.weight.zero_()
    sgd.param_groups[0]["lr"] = lr
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    for step in range(1, max_steps + 1):
        sgd.zero_grad()
        no_sync.accumulate_no_sync(trainer, loss_fn,
                                   [sample(b, generator) for _ in range(K)])
        sgd.step()
        with torch.no_grad():
            loss = loss_fn(trainer.module(X_all), y_all).item()
        if loss <= target:
            return step
        if not loss < 1e4 * target:  # diverged, or NaN
            break
    return max_steps + 1


def mean_steps(B, lr, seeds=(0, 1, 2)):
    return sum(steps_to_target(B, lr, seed) for seed in seeds) / len(seeds)


def best_lr(B, lr):
    """(mean steps, lr) at the best learning rate on a grid of factors of √2,
    searched up from `lr`: a larger batch takes at least a smaller one's best."""
    best = (mean_steps(B, lr), lr)
    while (tried := (mean_steps(B, lr * 2 ** 0.5), lr * 2 ** 0.5))[0] < best[0]:
        best, lr = tried, tried[1]
    return best


batches = [2, 4, 8, 16, 32, 64, 128, 256]
steps_at, lr_at, lr = {}, {}, 0.03
for B in batches:
    steps_at[B], lr = best_lr(B, lr)
    lr_at[B] = lr
s_min = steps_at[batches[-1]]  # the largest batch's steps stand for S_min
print(f"rank {rank}: measured noise scale B_simple = {B_simple:.1f}")
for B in batches:
    print(f"B = {B:3d}: lr {lr_at[B]:.3f}, {steps_at[B]:5.1f} steps, "
          f"{steps_at[B] * B:6.0f} samples; S_min (1 + B_simple / B) = "
          f"{s_min * (1 + B_simple / B):5.1f}")
# Deterministic given the seeds: a run again takes exactly its steps.
assert mean_steps(8, lr_at[8]) == steps_at[8]
assert 8 <= B_simple / 2 and 256 / 4 >= 2 * B_simple  # the pairs compared below
# Well below B_simple, 4 times the batch saves most steps (4 times as few at best) ...
assert steps_at[2] / steps_at[8] >= 2.5
# ... well above it, little: at most 1.5 times as few.
assert steps_at[64] / steps_at[256] <= 1.5
# The samples processed grow: the largest batch needs many times the smallest's.
assert steps_at[256] * 256 >= 4 * steps_at[2] * 2
# The paper's curve with the measured B_simple: within 0.8 to 1.5 times the steps
# everywhere (0.94 to 1.40 on this task's seeds); with B_simple halved or doubled
# it is not (2.54 at B = 2, 0.73 at B = 4).
assert all(0.8 <= steps_at[B] / (s_min * (1 + B_simple / B)) <= 1.5 for B in batches)
# On this task the noise scale moves little: computed exactly where the largest
# batch's run (seed 0) reaches the target, it is within 25% of the start's.
steps_to_target(batches[-1], lr_at[batches[-1]], seed=0)
at_target = noise_scale.exact_stats(trainer.module, loss_fn, X_all, y_all)
print(f"exact B_simple: {exact['noise_scale']:.1f} at the start, "
      f"{at_target['noise_scale']:.1f} at the target")
assert abs(at_target["noise_scale"] / exact["noise_scale"] - 1) < 0.25

# %% [markdown] lang="ja"
# ステップ数は、B_simple より十分小さいところではバッチにほぼ反比例して減り、B_simple を超えると
# ほとんど減りません。処理するサンプル数 (ステップ数 × B) は逆に、大きいバッチほど増えます。
# つまり、B_simple を超えてランクを増やしても、学習はほとんど速くならず、計算の多くが無駄になります。
# 図の点線が測ったノイズスケール、破線が論文の式です。論文は、学習が進んで勾配が小さくなるほど
# ノイズスケールが大きくなることを報告しています。この課題ではあまり変わりません。上のセルで、
# 目標に届いたところで厳密に計算し直すと、はじめとの違いは 25% 未満でした。そのため、はじめに測った値が
# 学習全体の目安になります。

# %% [markdown] lang="en"
# Well below B_simple the steps fall almost in proportion to the batch; past it they
# hardly fall. The samples processed (steps × B) do the opposite: the larger the batch,
# the more. Ranks added past B_simple make training hardly faster, and their compute
# is mostly wasted.
# The dotted line is the measured noise scale, the dashed one the paper's formula.
# The paper reports the noise scale growing as training goes on and the gradient
# shrinks. On this task it moves little: computed exactly again where the target is
# reached (the cell above), it is within 25% of the start's, so the value measured at
# the start stands for the whole run.

# %%
from labkit import noise_scale

# rank 0's values; rank 1's are the same
steps_at, B_simple, s_min = (ranks.pull(name)[0]
                             for name in ("steps_at", "B_simple", "s_min"))
fig = noise_scale.steps_vs_batch(steps_at, B_simple, s_min=s_min)

# %% [markdown] lang="ja"
# ## 不揃いなバッチの平均
#
# DDP の平均は、ランクごとの平均の平均です。ランクのサンプル数が違うと、それは全サンプルの平均では
# ありません。レッスン 04
# ([「K 倍のバッチと同じ」が成り立つ条件](04_no_sync.ipynb#cell-id=04-when-the-same-as-a-k-times-batch-holds))
# でマイクロバッチについて見たのと同じことで、ノイズスケールの推定では、平均したあとの勾配がもう N·b サンプル
# の平均ではなくなり、B_big = N·b の式が成り立ちません。次のセルでは、ランク 0 が 3 サンプル、
# ランク 1 が 13 サンプルを持ちます。サンプル数で重み付けする `no_sync.accumulate_by_count`
# (レッスン 04) なら、16 サンプル全体の勾配と一致します。

# %% [markdown] lang="en"
# ## Averages over unequal batches
#
# DDP's average is a mean of the ranks' means. When the ranks hold unequal counts, it
# is not the mean over the samples. Lesson 04 showed this for micro-batches
# ([When "the same as a K-times batch" holds](04_no_sync.ipynb#cell-id=04-when-the-same-as-a-k-times-batch-holds));
# for the noise scale it means the averaged gradient is no longer the mean of N·b samples, and the formula
# with B_big = N·b does not hold. In the next cell rank 0 holds 3 samples and rank 1
# holds 13. Weighting by count, lesson 04's `no_sync.accumulate_by_count`, gives the
# gradient of all 16.

# %%
# %%px
counts = (3, 13)  # samples on rank 0 and rank 1
X16, y16 = sample(16, torch.Generator().manual_seed(7))  # the same 16 on every rank
mine = slice(sum(counts[:rank]), sum(counts[:rank + 1]))
with torch.no_grad():
    trainer.module.weight.zero_()
trainer.zero_grad()
loss_fn(trainer(X16[mine]), y16[mine]).backward()  # DDP averages the two means
mean_of_means = [trainer.module.weight.grad.clone()]
trainer.zero_grad()
no_sync.accumulate_by_count(trainer, loss_fn, [(X16[mine], y16[mine])])
by_count = [trainer.module.weight.grad.clone()]
one = nn.Linear(16, 1, bias=False)
one.load_state_dict(trainer.module.state_dict())
loss_fn(one(X16), y16).backward()  # one process, all 16 samples
gap = checks.grads_differ(mean_of_means, [one.weight.grad])
fixed = checks.grads_match(by_count, [one.weight.grad])
print(f"rank {rank}: DDP's mean of means is off the 16 samples' gradient by {gap:.2e}; "
      f"weighted by count, by {fixed:.1e}")

# %% [markdown] lang="ja"
# ## まとめ
#
# 通信を減らす方法と、それが得になるとき (このマシンの 2 ランクで測った値):
#
# | 方法 | 減らすもの | 得になるとき | ここで測ったこと |
# |---|---|---|---|
# | `no_sync` (レッスン 04) | all-reduce の回数 (K 回に 1 回) | 同期 1 回のコスト s が大きいとき | 勾配は K 倍のバッチと同じ |
# | fp16、PowerSGD (レッスン 06 と本レッスン) | 1 回に送るバイト数 | リンクが分かれ目 β* より遅いとき。fp16 では β* = (S_DDP − S_fp16) / (t_fp16 − t_DDP) | 100 MB/s ではどちらも DDP の 0.8 倍未満。分かれ目は 0.75〜4.3 GB/s ほどで、試した 5 GB/s を超えることもあり、実行ごとに動く |
# | ローカル SGD (H ステップごとに平均) | バイト数を 1/H に | レプリカが離れても、平均で戻るとき | H = 1 は DDP と同じ。H = 16 の損失は H = 1 と 1% 以内 |
# | DiLoCo | ローカル SGD と同じバイト数 | 外側のモーメンタムが、平均した疑似勾配を生かすとき | 同じバイト数で、DDP よりずっと低い損失。ローカル SGD よりも低い |
# | バッチを大きくする | ステップ数 (と同期の回数) | 全体バッチが勾配のノイズスケール B_simple より小さいあいだ | B_simple は 17 ほど。それを超えると、ステップ数はほとんど減らない |
#
# - 遅いリンクは、all-reduce のあとに α + バイト数 / β を足します。その遅延は規則どおりに、どの負荷でも
#   足されます。分かれ目を決めるのは、ループバックでの 1 ステップの差と、リンクに渡すバイト数の差です。
# - 1 ステップの時間のモデルは、各方法が足す計算を入れると、ほとんどの実行でバイト数だけのモデルより正確に
#   なりました。ただし PowerSGD は、まだ速く見積もりすぎます (`bench/README.md`)。
# - ローカル SGD と DiLoCo は、送る回数を減らす代わりに、レプリカが平均と平均のあいだに離れることを許します。
#   この小さな回帰の課題では、それで困りませんでした。大きなモデルでどれだけの H が使えるかは、
#   ここでは測っていません。
# - ランクを増やすと全体バッチが大きくなります。B_simple を超えたバッチでは、ランクを増やしても
#   学習はほとんど速くなりません。不揃いなバッチでは、サンプル数で重み付けした平均 (レッスン 04) が
#   正しい全体バッチの勾配です。

# %% [markdown] lang="en"
# ## Summary
#
# Ways to communicate less, and when each pays (measured here, on 2 ranks):
#
# | way | what it cuts | pays when | measured here |
# |---|---|---|---|
# | `no_sync` (lesson 04) | all-reduces (one in K) | one synchronization's cost s is large | gradients equal the K-times batch's |
# | fp16, PowerSGD (lesson 06 and here) | bytes per all-reduce | the link is slower than the crossover β*; for fp16 β* = (S_DDP − S_fp16) / (t_fp16 − t_DDP) | at 100 MB/s both under 0.8 times DDP's step; crossovers about 0.75 to 4.3 GB/s, sometimes above the 5 GB/s swept, moving from run to run |
# | local SGD (average every H steps) | bytes, to 1/H | the replicas drift apart and the average brings them back | H = 1 is DDP; H = 16's loss within 1% of H = 1's |
# | DiLoCo | local SGD's bytes | the outer momentum makes use of the averaged pseudo-gradients | at equal bytes, far below DDP's loss, and below local SGD's |
# | a larger batch | steps (and synchronizations) | the global batch is below the gradient noise scale B_simple | B_simple about 17; past it the steps hardly fall |
#
# - The slow link adds α + bytes / β after each all-reduce, by its rule, under any load.
#   What sets the crossover is the difference between the loopback steps and between the
#   bytes handed to the link.
# - With the compute each method adds, the step model was more accurate than the
#   bytes-only one in most runs; it still predicts PowerSGD too fast
#   (`bench/README.md`).
# - Local SGD and DiLoCo send less often and let the replicas drift apart between
#   averages. On this small regression that did no harm; how large an H a large model
#   tolerates is not measured here.
# - More ranks make the global batch larger. Past B_simple, more ranks make training
#   hardly faster. With unequal batches, the average weighted by sample count (lesson
#   04) is the true global batch's gradient.

# %%
ranks.stop()
