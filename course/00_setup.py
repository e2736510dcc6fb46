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
# # 00 環境確認
#
# この講座は、PyTorch のデータ並列 (`DistributedDataParallel`、`no_sync()`、`DataParallel` など) を、GPU の
# ないノート PC でも動かしながら学びます。このレッスンでは、手元のコンピュータで何が動くかを確かめ、2 つのランクで
# 最初の集団通信を実行し、レッスンのセルの使い方を知ります。ほかに動かせる場所は `README.ja.md` の
# 「どこで動かすか」にあります。
#
# このレッスンを終えると、次のことができます。
#
# - `labkit.doctor` で、手元のコンピュータにあるもの (CPU、PyTorch のビルド、GPU、分散バックエンド) と、
#   ここで動くものを確かめられる。
# - gloo と nccl の違いと、この講座がどちらをどこで使うかを説明できる。
# - ノートブックから 2 つのランクを起動し、`%%px` のセルを全ランクで実行できる。
# - プロセスグループ、ランク、world size を説明し、all-reduce が全ランクのテンソルを足し合わせることを
#   確かめられる。
# - 演習のセルと確認のセル、レッスンの最後の確認問題を使える。

# %% [markdown] lang="en" tags=["outcomes"]
# # 00 Setup
#
# This course teaches PyTorch data parallelism (`DistributedDataParallel`, `no_sync()`,
# `DataParallel` and more) by running it, even on a laptop without a GPU. This lesson
# checks what your computer can run, runs a first collective on two ranks, and shows how
# the lessons' cells work. Where else the course runs: `README.md`, "Where to run it".
#
# After this lesson you can:
#
# - check with `labkit.doctor` what your computer has (CPUs, the PyTorch build, GPUs,
#   distributed backends) and what runs here;
# - tell gloo from nccl, and say which the course uses where;
# - start two ranks from a notebook and run a `%%px` cell on every rank;
# - say what a process group, a rank and the world size are, and see an all-reduce sum
#   the ranks' tensors;
# - work an exercise with its check cell, and the self-check that ends each lesson.

# %% [markdown] lang="ja"
# 各セルを上から順に実行してください (Shift+Enter)。最初のセルは、講座のパッケージ `labkit` が新しいかを
# 確かめ、表示言語を日本語にします。図の文字やメッセージもこの言語になります。

# %% [markdown] lang="en"
# Run the cells from top to bottom (Shift+Enter). The first cell checks that the
# course's package, `labkit`, is recent enough, and sets the language of plots and
# messages to English.

# %%
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## このマシンにあるもの
#
# `labkit.doctor` は CPU コア数、PyTorch のバージョンとビルド (CPU 版か CUDA 版か)、GPU、
# 使える分散バックエンド、日本語フォント、ipywidgets を調べ、ここで動くものと動かないものを
# 一覧にします。
#
# - **gloo** は CPU 上のプロセス同士で通信するバックエンドです。ノートブックのランクは、GPU のある
#   マシンでも**いつも gloo** を使い、CPU の上で動きます。レッスンで学ぶ仕組みは、どのバックエンドでも
#   同じです。
# - **nccl** は NVIDIA GPU 同士の通信用で、CUDA 版の PyTorch と GPU が要り、CUDA のテンソルしか
#   扱えません。この講座では、コマンドライン (`torchrun … -m labkit nosync --backend nccl`) が
#   1 ランクに GPU 1 台で使います。
# - **mpi** は MPI 付きでビルドした PyTorch でだけ使えます (通常の配布物にはありません)。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## What this machine has
#
# `labkit.doctor` looks at the CPU cores, the PyTorch version and build (CPU or CUDA), the
# GPUs, the distributed backends, the Japanese font and ipywidgets, and lists what runs
# here and what does not.
#
# - **gloo** lets processes on CPUs talk to each other. The notebooks' ranks **always**
#   use gloo and run on the CPU, also on a machine with GPUs; what the lessons teach
#   works the same on every backend.
# - **nccl** is for communication between NVIDIA GPUs; it needs a CUDA build and GPUs,
#   and takes CUDA tensors only. In this course the command line uses it
#   (`torchrun … -m labkit nosync --backend nccl`), one GPU per rank.
# - **mpi** exists only in PyTorch builds made with MPI (the usual wheels have none).

# %%
from labkit import doctor

report = doctor.collect()
print(doctor.format_report(report))

# %% [markdown] lang="ja"
# この講座に欠かせないもの、gloo と、日本語のノートブックでは日本語フォントがあることを確かめます。
# 無ければ、このセルがエラーで止まります。

# %% [markdown] lang="en"
# Check what the course cannot do without: gloo, and in the Japanese notebooks a
# Japanese font (the English ones need none). If one is missing, this cell stops with
# an error.

# %%
assert report.backends["gloo"], "this PyTorch build has no gloo backend"
if labkit.get_lang() == "ja":  # a Japanese figure must never show empty boxes
    assert report.japanese_font is not None, "no Japanese font for matplotlib"
if not report.gpus:
    assert "cap_ddp_nccl" in report.cannot_run  # nccl needs GPUs
report.backends

# %% [markdown] lang="ja"
# ノートブックのランクに nccl を頼むと、GPU があってもなくても、理由と代わりに実行するコマンドを
# 示すエラーになります (ランクはまだ 1 つも起動していません)。

# %% [markdown] lang="en"
# Ask for nccl on the notebook's ranks and, with or without GPUs, an error says why not
# and which command to run instead (no rank has been started).

# %%
from labkit import checks, cluster

with checks.expect_error(ValueError, match="tensors on the CPU") as refused:
    cluster.start(2, backend="nccl")
print(refused.exception)
assert "torchrun" in str(refused.exception) and cluster.current() is None

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## 日本語フォント
#
# 日本語のノートブックは図のラベルも日本語です。matplotlib の既定フォントには日本語の字形がなく、
# そのままでは日本語のラベルが「□」(豆腐) になります。labkit は `matplotlib-fontja` の IPAexGothic を
# 既定フォントにします。次の図に日本語と英語が両方きちんと描かれていることを確かめてください。
# `labkit.plots` の図は、描けない文字があるとエラーになります。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## Japanese font
#
# The Japanese notebooks label their figures in Japanese, and matplotlib's default font
# has no Japanese glyphs: the labels would come out as empty boxes ("tofu"). labkit
# makes IPAexGothic, from `matplotlib-fontja`, the default font. The figure below shows
# Japanese and English text (the English notebook draws it only where a Japanese font
# is installed). The figures of `labkit.plots` raise an error when a character cannot
# be drawn.

# %% tags=["hide-input"]
from labkit import plots

# The English notebooks draw no Japanese but here: they need no Japanese font.
if labkit.get_lang() == "ja" or report.japanese_font is not None:
    fig = plots.font_check()

# %% [markdown] lang="ja"
# フォントを英語用の DejaVu Sans に戻すと、同じ図は日本語を描けず、`MissingGlyphError` になります。
# 「□」の図が黙って表示されることはありません。

# %% [markdown] lang="en"
# Switch the font back to DejaVu Sans, which has Latin glyphs only, and the same figure
# cannot draw its Japanese text: it raises `MissingGlyphError` instead of quietly showing
# boxes.

# %% tags=["hide-input"]
import matplotlib
import matplotlib.pyplot as plt

from labkit.fonts import MissingGlyphError

open_before = plt.get_fignums()
with matplotlib.rc_context({"font.family": "DejaVu Sans"}):
    with checks.expect_error(MissingGlyphError):
        plots.font_check()
assert plt.get_fignums() == open_before  # the broken figure was closed, not shown

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## ウィジェット
#
# 後のレッスンでは、スライダーでパラメータを変えながら図を見ます (ipywidgets)。
# スライダーが表示されれば準備完了です。動かすと、1 ランクあたりのバッチサイズが変わります。

# %% [markdown] lang="en" tags=["deep-dive"]
# ## Widgets
#
# Later lessons change parameters with sliders and watch plots change (ipywidgets).
# If a slider appears below, you are ready. Move it to see the batch each rank gets.

# %%
import ipywidgets as widgets


def per_rank_batch(world_size=2, batch_size=64):
    """Each rank of data-parallel training gets batch_size / world_size samples."""
    print(f"world_size={world_size}: {batch_size / world_size:g} samples per rank")


_ = widgets.interact(per_rank_batch, world_size=(1, 8), batch_size=(8, 256, 8))

# %% [markdown] lang="ja" tags=["core"]
# ## 最初の集団通信
#
# 分散学習のプロセスは**プロセスグループ**に属し、それぞれ**ランク** (0, 1, …) を持ちます。
# 全体の数が **world size** です。`cluster.start(2)` は、手元に 2 つのプロセス (エンジン) を起動し、
# ランク 0 と 1 として 1 つの gloo のグループに参加させます。ランクは 127.0.0.1 で待ち合わせます。
# 起動には数秒かかります。起動したあとは、`%%px` で始まるセルが**全ランクで**実行され、各ランクには
# `rank` と `world_size` という変数があります。

# %% [markdown] lang="en" tags=["core"]
# ## A first collective
#
# Processes of distributed training belong to a **process group**, and each has a
# **rank** (0, 1, …); how many there are is the **world size**. `cluster.start(2)`
# starts two local processes (engines) and joins them, as ranks 0 and 1, in
# one gloo group; the ranks meet on 127.0.0.1. The start takes a few seconds. After it,
# a cell that begins with `%%px` runs **on every rank**, and each rank has the variables
# `rank` and `world_size`.

# %%
ranks = cluster.start(2)
print(f"{ranks.world_size} ranks, backend {ranks.backend}")

# %% [markdown] lang="ja"
# 各ランクが違うテンソルを持ち、all-reduce (全ランクのテンソルを足し合わせ、結果を全ランクに配る集団通信) を
# 1 回実行します。ランク 0 は `[0, 1, 2, 3]`、ランク 1 は `[10, 11, 12, 13]` を持ちます。
#
# **予想してから実行:** all-reduce のあと、それぞれのランクは何を持っているでしょうか?

# %% [markdown] lang="en"
# Each rank holds a different tensor, and they run one all-reduce (a collective that
# sums a tensor over all ranks and gives every rank the result). Rank 0 holds
# `[0, 1, 2, 3]`, rank 1 holds `[10, 11, 12, 13]`.
#
# **Predict, then run:** after the all-reduce, what does each rank hold?

# %%
# %%px
import torch
import torch.distributed as dist

x = torch.arange(4.0) + 10 * rank  # a different tensor on each rank
x_before = x.tolist()
dist.all_reduce(x)  # sum over the ranks; every rank gets the sum
x_after = x.tolist()
print(f"rank {rank} of {world_size}: before {x_before}, after {x_after}")
tensors = [torch.arange(4.0) + 10 * r for r in range(world_size)]  # every rank's
assert torch.equal(x, sum(tensors))  # with 2 ranks: [10, 12, 14, 16] on both

# %% [markdown] lang="ja"
# 各ランクの値を、all-reduce の前と後で並べます (2 つのランクから集めた値です)。後の行では、
# どちらのランクも同じ和を持っています。

# %% [markdown] lang="en"
# Each rank's values before and after the all-reduce, pulled from the two ranks: after
# it, both hold the same sums.

# %%
from labkit import diagrams

before, after = ranks.pull("x_before"), ranks.pull("x_after")
assert after[0] == after[1] == [a + b for a, b in zip(*before, strict=True)]
fig = diagrams.collectives({labkit.t("values_before"): before,
                           "dist.all_reduce(x)": after})

# %% [markdown] lang="ja"
# もう 1 つの集団通信 broadcast は、1 つのランク (ここではランク 0) のテンソルを全ランクに配ります。
# 後の行では、どちらのランクもランク 0 の `[0, 1, 2, 3]` を持っています。

# %% [markdown] lang="en"
# Another collective, broadcast, copies one rank's tensor (here rank 0's) to every rank:
# after it, both hold rank 0's `[0, 1, 2, 3]`.

# %%
# %%px
x = torch.arange(4.0) + 10 * rank  # a different tensor on each rank, again
dist.broadcast(x, src=0)  # every rank gets rank 0's tensor
x_broadcast = x.tolist()

# %%
broadcast = ranks.pull("x_broadcast")
assert broadcast == [before[0]] * 2  # rank 0's values, on both ranks
fig = diagrams.collectives({labkit.t("values_before"): before,
                           "dist.broadcast(x, src=0)": broadcast})

# %% [markdown] lang="ja"
# ランクどうしの通信は、手元のコンピュータの中だけで行われます。各ランクの gloo はループバック
# (127.0.0.1) だけで待ち受けるので、LAN に向けて待ち受けることはなく、Windows のファイアウォールの確認も
# 出ません。

# %% [markdown] lang="en"
# The ranks talk inside your computer only: each rank's gloo listens on the loopback
# interface (127.0.0.1) alone, never towards the LAN, so Windows' firewall does not
# ask either.

# %%
# %%px
import os

import psutil

listening = {c.laddr.ip for c in psutil.Process().net_connections("inet")
             if c.status == psutil.CONN_LISTEN}
print(f"rank {rank} listens on {sorted(listening)}")
assert listening <= {"127.0.0.1", "::1"}, listening  # loopback only (IPv4, IPv6)
assert os.environ["MASTER_ADDR"] == "127.0.0.1"  # where the ranks met

# %% [markdown] lang="ja"
# > **時間はばらつき、回数とバイト数はばらつかない。** ほかのプログラムと共有された CPU の上では、
# > 1 ステップや 1 回の集団通信にかかる時間は 1 回ごとに変わります。集団通信が計算する値、呼び出しの回数、
# > 送るバイト数は変わりません。レッスンはこちらを確かめ、時間は「この実行での値」として、測ったすべての
# > 回を示します。
#
# 同じ all-reduce を 5 回実行し、1 回ごとの時間とバイト数を記録します。

# %% [markdown] lang="en"
# > **Times scatter; counts and bytes do not.** On a CPU shared with other programs, the
# > time a step or a collective takes changes from one round to the next. What a
# > collective computes, how many calls are made and how many bytes they send do not:
# > the lessons assert those, and show a time as this run's, with every round measured.
#
# Run the same all-reduce 5 times, and record each round's time and bytes.

# %%
# %%px
from labkit import comm_counting

sums = []
with comm_counting.CollectiveLog() as log:
    for _ in range(5):
        y = torch.ones(1000)  # 1,000 float32 values: 4,000 bytes
        dist.barrier()  # the ranks start each round together
        dist.all_reduce(y)
        sums.append(y.sum().item())
ms = [1000 * (c["end"] - c["start"]) for c in log.calls]
print(f"rank {rank}: {log.count('all_reduce')} all-reduces of "
      f"{[c['bytes'] for c in log.calls]} bytes, sums {sums}")
print(f"rank {rank}: ms on this run", ", ".join(f"{t:.3f}" for t in ms))
assert log.count("all_reduce") == 5 and [c["bytes"] for c in log.calls] == [4000] * 5
assert sums == [1000.0 * world_size] * 5  # the same values every round
assert max(ms) > min(ms)  # but the times differ

# %% [markdown] lang="ja"
# 両方のランクの 5 回を図にします。バイト数はどの回も 4,000 で、時間だけが回ごとに変わります。

# %% [markdown] lang="en"
# Every round of both ranks, in one figure: the bytes are 4,000 each time; only the
# time moves.

# %% tags=["hide-input"]
from labkit import plots

times = ranks.pull("ms")
assert all(len(t) == 5 for t in times)
fig = plots.line_chart({labkit.t("rank_n", r=r): (range(1, 6), t)
                        for r, t in enumerate(times)},
                       xlabel="round", ylabel="allreduce_ms", title="rounds_title",
                       from_zero=True)

# %% [markdown] lang="ja"
# ランクを止めます。ランクを使うレッスンは、それぞれ自分でランクを起動します。

# %% [markdown] lang="en"
# Stop the ranks; each lesson that needs ranks starts its own.

# %%
ranks.stop()
assert cluster.current() is None

# %% [markdown] lang="ja" tags=["deep-dive"]
# ## コマンドラインから
#
# 同じ確認はターミナルからもできます。`--json FILE` を付けると結果を JSON で保存します。
#
# ```
# python -m labkit --lang ja doctor
# ```

# %% [markdown] lang="en" tags=["deep-dive"]
# ## From the command line
#
# The same check runs in a terminal; add `--json FILE` to save the report as JSON.
#
# ```
# python -m labkit --lang en doctor
# ```

# %%
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "doctor.json"
    cmd = [sys.executable, "-m", "labkit", "--lang", labkit.get_lang(), "doctor",
           "--json", str(out)]
    # The child writes UTF-8 and this cell prints what it wrote: a child's own
    # output reaches the notebook only on Linux and macOS (on Windows it goes to
    # the terminal that runs JupyterLab).
    done = subprocess.run(cmd, capture_output=True, encoding="utf-8",
                          env={**os.environ, "PYTHONUTF8": "1"})
    print(done.stdout, end="")
    print(done.stderr, end="", file=sys.stderr)
    assert done.returncode == 0, done.stderr
    saved = json.loads(out.read_text())
assert saved["torch_version"] == torch.__version__

# %% [markdown] lang="ja" tags=["core"]
# ## レッスンの進め方
#
# - **演習**は、見出しに「演習」とあるコードのセルです。セルを書き換えて実行してから、次の**確認のセル**
#   (`exercises.grade_…`) を実行します。正しければ「✓ 正解です。」と確かめた内容が表示され、違っていれば
#   「まだ正解ではありません。」と、どこが違うかがヒントとともに表示されます。完全版のノートブックには解答の
#   セルもありますが、まず自分で解いてみてください。「(任意)」と書いた演習は飛ばせます。
# - 「**予想してから実行:**」とある問いには、セルを実行する前に自分の答えを決めます。セルがその値を示し、
#   確かめます。
# - 各レッスンは「**覚えておくこと**」と 3 問の「**確認問題**」で終わります。
# - レッスンのコード自身が表示する出力 (`print`) は、コードと同じく英語です。labkit が表示するもの
#   (doctor の一覧、図、確認のセルの判定とヒント、確認問題) はノートブックの言語になります。
#
# 次のセルは、レッスン 01 の最初の確認のセルに演習の書き始めのままを渡します。判定はノートブックの言語で、
# ヒント付きです。

# %% [markdown] lang="en" tags=["core"]
# ## How the lessons work
#
# - An **exercise** is a code cell under a heading that says so. Edit it and run it, then
#   run the **check cell** after it (`exercises.grade_…`): it says "✓ Correct." and what
#   it checked when the answer is right, and otherwise "Not yet." with what is wrong and a
#   hint. A solution cell follows in the full notebooks: try on your own first. An
#   exercise marked "(optional)" can be skipped.
# - Where the text asks "**Predict, then run:**", settle on your answer before running
#   the cell; the cell then shows the value and asserts it.
# - Each lesson ends with "**What to remember**" and a three-question **Self-check**.
# - What a lesson's code prints itself (`print`) is in English in both editions, like the
#   code; what labkit shows (the doctor's list, figures, the checks' verdicts and hints,
#   the self-checks) follows the notebook's language.
#
# The next cell gives lesson 01's first check its exercise's starting point: the
# verdict comes in the notebook's language, with a hint.

# %%
from labkit import exercises, models

with checks.expect_error(exercises.WrongAnswer) as not_yet:
    exercises.grade_keeps_batch(models.MLPAsWritten)
assert ("ヒント" in str(not_yet.exception)) == (labkit.get_lang() == "ja")

# %% [markdown] lang="ja" tags=["summary"]
# ## 覚えておくこと
#
# - **ノートブックのランクは、どのマシンでも gloo で CPU の上で動きます**。GPU と nccl を使うのは
#   コマンドライン (`torchrun`) です。
# - **プロセスグループがランクをまとめます**。各プロセスはランク (0 から world size − 1) を持ち、`%%px` の
#   セルは全ランクで実行されます。
# - **all-reduce は全ランクのテンソルを足し合わせ、結果を全ランクに配ります**。`[0, 1, 2, 3]` と
#   `[10, 11, 12, 13]` は、両方のランクで `[10, 12, 14, 16]` になりました。
# - **共有された CPU では時間がばらつき、値と回数とバイト数はばらつきません**。レッスンは後者を確かめ、
#   時間はこの実行での値として示します。
# - **確認のセルは「正解です」か、どこが違うかをヒント付きで示します**。各レッスンは 3 問の確認問題で
#   終わります。

# %% [markdown] lang="en" tags=["summary"]
# ## What to remember
#
# - **The notebooks' ranks use gloo on the CPU, on any machine**; GPUs and nccl are the
#   command line's (`torchrun`).
# - **A process group joins the ranks**: each process has a rank, 0 to world size − 1,
#   and a `%%px` cell runs on every rank.
# - **An all-reduce sums a tensor over the ranks and gives every rank the result**:
#   `[0, 1, 2, 3]` and `[10, 11, 12, 13]` became `[10, 12, 14, 16]` on both ranks.
# - **On a shared CPU times scatter; values, counts and bytes do not**: the lessons
#   assert the latter, and show a time as this run's.
# - **A check cell says "Correct", or what is wrong with a hint**; each lesson ends with
#   a three-question self-check.

# %% [markdown] lang="ja" tags=["self-check"]
# ## 確認問題
#
# 先へ進む前に、次の 3 問に答えてください。答えの折りたたみは、自分の答えを決めてから開きます。

# %% [markdown] lang="en" tags=["self-check"]
# ## Self-check
#
# Answer the three questions below before reading on; open an answer's fold only
# after you have chosen.

# %% tags=["self-check"]
from labkit import selfcheck

selfcheck.show("00_setup")

# %% tags=["self-check"]
# Your answers, "a", "b", "c" or "d" for each question; then run this cell.
my_answers = {1: None, 2: None, 3: None}
selfcheck.check("00_setup", my_answers)
