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
# # 00 環境確認
#
# この講座は、PyTorch のデータ並列 (`DataParallel`、`data_parallel()`、
# `DistributedDataParallel`、`no_sync()`) を、GPU のないノート PC でも動かしながら学びます。
# 最初のレッスンでは、このマシンに何があり、何がここで動いて何が動かないかを確かめます。
#
# 各セルを上から順に実行してください (Shift+Enter)。

# %% [markdown] lang="en"
# # 00 Setup
#
# This course teaches PyTorch data parallelism (`DataParallel`, `data_parallel()`,
# `DistributedDataParallel`, `no_sync()`) by running it, even on a laptop without a GPU.
# This first lesson checks what this machine has, and what can and cannot run here.
#
# Run the cells from top to bottom (Shift+Enter).

# %% [markdown] lang="ja"
# 最初のセルは、講座のパッケージ `labkit` が新しいかを確かめ、表示言語を日本語にします。
# 図の文字やメッセージもこの言語になります。

# %% [markdown] lang="en"
# The first cell checks that the course's package, `labkit`, is recent enough, and sets the
# language of plots and messages to English.

# %%
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %% [markdown] lang="ja"
# ## このマシンにあるもの
#
# `labkit.doctor` は CPU コア数、PyTorch のバージョンとビルド (CPU 版か CUDA 版か)、GPU、
# 使える分散バックエンド、日本語フォント、ipywidgets を調べ、ここで動くものと動かないものを
# 一覧にします。
#
# - **gloo** は CPU 上のプロセス同士で通信するバックエンドです。ノートブックのランクは、GPU のある
#   マシンでも**いつも gloo** を使い、CPU の上で動きます。セルがモデルもテンソルも CPU に作るからです。
#   レッスンで学ぶ仕組み (勾配の all-reduce、バケット、`no_sync`) はどのバックエンドでも同じです。
# - **nccl** は NVIDIA GPU 同士の通信用で、CUDA 版の PyTorch と GPU が要り、CUDA のテンソルしか
#   扱えません。この講座では、コマンドライン (`torchrun … -m labkit nosync --backend nccl`) が
#   1 ランクに GPU 1 台で使います。
# - **mpi** は MPI 付きでビルドした PyTorch でだけ使えます (通常の配布物にはありません)。

# %% [markdown] lang="en"
# ## What this machine has
#
# `labkit.doctor` looks at the CPU cores, the PyTorch version and build (CPU or CUDA), the
# GPUs, the distributed backends, the Japanese font and ipywidgets, and lists what runs
# here and what does not.
#
# - **gloo** lets processes on CPUs talk to each other. The notebooks' ranks **always**
#   use gloo and run on the CPU, also on a machine with GPUs: the cells build their models
#   and tensors on the CPU. What the lessons teach (the gradients' all-reduce, buckets,
#   `no_sync`) works the same on every backend.
# - **nccl** is for communication between NVIDIA GPUs; it needs a CUDA build and GPUs,
#   and takes CUDA tensors only. In this course the command line uses it
#   (`torchrun … -m labkit nosync --backend nccl`), one GPU per rank.
# - **mpi** exists only in PyTorch builds made with MPI (the usual wheels have none).

# %%
from labkit import doctor

report = doctor.collect()
print(doctor.format_report(report))

# %% [markdown] lang="ja"
# この講座に欠かせないもの (gloo と日本語フォント) があることを確かめます。
# どちらかが無ければ、このセルがエラーで止まります。

# %% [markdown] lang="en"
# Check what the course cannot do without: gloo and a Japanese font.
# If either is missing, this cell stops with an error.

# %%
assert report.backends["gloo"], "this PyTorch build has no gloo backend"
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

# %% [markdown] lang="ja"
# ## 日本語フォント
#
# matplotlib の既定フォントには日本語の字形がなく、日本語のラベルは「□」(豆腐) になります。
# labkit は `matplotlib-fontja` の IPAexGothic を既定フォントにします (`labkit.plots` を読み込んだとき。
# matplotlib をすでに使っていれば `labkit.set_lang` のときにも)。
# 次の図に日本語と英語が両方きちんと描かれていることを確かめてください。
# `labkit.plots` の図は、描けない文字があるとエラーになります。

# %% [markdown] lang="en"
# ## Japanese font
#
# matplotlib's default font has no Japanese glyphs, so Japanese labels come out as empty
# boxes ("tofu"). labkit makes IPAexGothic, from `matplotlib-fontja`, the default font
# (when `labkit.plots` is imported, and at `labkit.set_lang` where matplotlib is already
# in use). Check that the figure below shows both Japanese and English text.
# The figures of `labkit.plots` raise an error when a character cannot be drawn.

# %%
from labkit import plots

fig = plots.font_check()

# %% [markdown] lang="ja"
# フォントを英語用の DejaVu Sans に戻すと、同じ図は日本語を描けず、`MissingGlyphError` になります。
# 「□」の図が黙って表示されることはありません。

# %% [markdown] lang="en"
# Switch the font back to DejaVu Sans, which has Latin glyphs only, and the same figure
# cannot draw its Japanese text: it raises `MissingGlyphError` instead of quietly showing
# boxes.

# %%
import matplotlib
import matplotlib.pyplot as plt

from labkit.fonts import MissingGlyphError

open_before = plt.get_fignums()
with matplotlib.rc_context({"font.family": "DejaVu Sans"}):
    with checks.expect_error(MissingGlyphError):
        plots.font_check()
assert plt.get_fignums() == open_before  # the broken figure was closed, not shown

# %% [markdown] lang="ja"
# ## ウィジェット
#
# 後のレッスンでは、スライダーでパラメータを変えながら図を見ます (ipywidgets)。
# スライダーが表示されれば準備完了です。動かすと、1 ランクあたりのバッチサイズが変わります。

# %% [markdown] lang="en"
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

# %% [markdown] lang="ja"
# ## 最初の集団通信
#
# 分散学習のプロセスは**プロセスグループ**に属し、それぞれ**ランク** (0, 1, …) を持ちます。
# 全体の数が **world size** です。ここではこのカーネルだけを 1 ランクとする gloo のグループを作り、
# all-reduce (全ランクのテンソルを足し合わせ、結果を全ランクに配る通信) を 1 回実行します。
# ランクが 1 つなので値は変わりませんが、gloo が動くことがわかります。
# 2 ランク以上はレッスン 03 で扱います。

# %% [markdown] lang="en"
# ## A first collective
#
# Processes of distributed training belong to a **process group**, and each has a
# **rank** (0, 1, …); how many there are is the **world size**. Here this kernel alone
# forms a gloo group of one rank and runs one all-reduce (sum a tensor over all ranks and
# give every rank the result). With one rank the values stay the same, but it shows that
# gloo works. Lesson 03 uses two ranks and more.

# %%
import os

import torch
import torch.distributed as dist

from labkit.cluster import rendezvous

# gloo listens on the address the host name resolves to, often the LAN's (on
# Windows, a firewall prompt): the loopback interface keeps it on this machine.
os.environ.setdefault("GLOO_SOCKET_IFNAME", rendezvous.loopback_interface())
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
x = torch.arange(4.0)
dist.all_reduce(x)  # sum over ranks: with one rank, x itself
print(dist.get_backend(), dist.get_rank(), dist.get_world_size(), x)
assert torch.equal(x, torch.arange(4.0))
dist.destroy_process_group()

# %% [markdown] lang="ja"
# ## コマンドラインから
#
# 同じ確認はターミナルからもできます。`--json FILE` を付けると結果を JSON で保存します。
#
# ```
# python -m labkit --lang ja doctor
# ```

# %% [markdown] lang="en"
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

# %% [markdown] lang="ja"
# ## どこで動かすか
#
# | 環境 | 使い方 |
# |---|---|
# | GPU のない PC (この講座の基準) | Linux と macOS では `python3 tools/course.py lab` (`make lab` でも同じ)、Windows では `py tools\course.py lab` (`py` がなければ `python tools\course.py lab`)。DDP は gloo、DataParallel は CPU 上の再現で学びます。 |
# | GPU のあるマシン | `python3 tools/course.py lab --torch "torch==2.13.0 …"` (`make lab TORCH="torch==2.13.0 …"`) で CUDA 版の PyTorch を指定します。ノートブックのランクは、ここでも gloo で CPU の上で動きます。実際の GPU を使うのは、GPU が 2 台以上あるときのレッスン 02 の DataParallel と、コマンドラインです (`torchrun --nproc-per-node N -m labkit nosync --backend nccl`、1 ランクに GPU 1 台)。 |
# | リモートの GPU サーバー | サーバーで `python3 tools/course.py lab` (127.0.0.1 で待ち受け) し、手元から `ssh -L 8888:127.0.0.1:8888 サーバー` で転送してブラウザで開きます。 |
# | クラスタ | ノートブックではなく `torchrun` でスクリプトを起動します (レッスン 09)。 |
# | コンテナ (VS Code の Dev Containers、GitHub Codespaces) | リポジトリを開くと `.devcontainer/devcontainer.json` が Python 3.11 と CPU 版の PyTorch で環境を作ります (`python tools/course.py setup`)。ターミナルで `python tools/course.py lab` を実行すると、エディタがポート 8888 を転送します。CPU 2 コアを指定してあります。 |
# | Binder | `binder/` の設定で、ブラウザだけで開けます (URL は `https://mybinder.org/v2/gh/<リポジトリ>/HEAD?urlpath=lab`)。mybinder.org は CPU 1 つ、メモリは多くて 2 GB です ([利用の目安](https://mybinder.readthedocs.io/en/latest/about/user-guidelines.html))。ランクを使うレッスンは遅く、メモリが足りずにカーネルが再起動することがあります。読むだけならサイト (README) が向いています。 |
# | Google Colab | 下の「Colab で動かす」を見てください。 |
#
# 上の doctor の「ここでは動かないもの」に出た項目のうち、GPU を使うものは GPU のあるマシンで動きます。
# ただし、この講座の GPU の経路 (nccl と CUDA) は、まだ一度も GPU の上で動かしたことがありません。
# この講座の開発に、GPU のあるマシンが使えなかったからです。テストで確かめているのは、GPU の台数を
# モックして (差し替えて)、labkit がその台数から選ぶもの (バックエンド、doctor の表示) だけです。

# %% [markdown] lang="en"
# ## Where to run it
#
# | machine | how |
# |---|---|
# | a PC without a GPU (what the course is built for) | `python3 tools/course.py lab` on Linux and macOS (or `make lab`), `py tools\course.py lab` on Windows (`python tools\course.py lab` where there is no `py`). DDP runs on gloo; DataParallel is simulated on the CPU. |
# | a machine with GPUs | `python3 tools/course.py lab --torch "torch==2.13.0 …"` (or `make lab TORCH="torch==2.13.0 …"`) to pick a CUDA build of PyTorch. The notebooks' ranks still use gloo on the CPU there; real GPUs are used by lesson 02's DataParallel (with two or more GPUs) and by the command line (`torchrun --nproc-per-node N -m labkit nosync --backend nccl`, one GPU per rank). |
# | a remote GPU server | run `python3 tools/course.py lab` there (it listens on 127.0.0.1) and forward it with `ssh -L 8888:127.0.0.1:8888 server`, then open it in your browser. |
# | a cluster | start scripts with `torchrun`, not notebooks (lesson 09). |
# | a container (VS Code's Dev Containers, GitHub Codespaces) | opening the repository, `.devcontainer/devcontainer.json` builds the environment with Python 3.11 and the CPU build of PyTorch (`python tools/course.py setup`). Run `python tools/course.py lab` in its terminal; the editor forwards port 8888. It asks for 2 CPU cores. |
# | Binder | `binder/` opens the course in a browser alone (`https://mybinder.org/v2/gh/<repository>/HEAD?urlpath=lab`). mybinder.org gives one CPU and at most 2 GB of memory ([guidelines](https://mybinder.readthedocs.io/en/latest/about/user-guidelines.html)): lessons with ranks run slowly and their kernel may restart for lack of memory. To read, the website (README) suits better. |
# | Google Colab | see "Running on Colab" below. |
#
# What the doctor listed under "does not run here" and needs GPUs runs on a machine with
# GPUs. But the course's GPU paths (nccl and CUDA) have never run on a GPU: no machine
# with a GPU has been available to this project. Tests fake the GPU count and check only
# what labkit chooses from it (the backend, what the doctor reports).

# %% [markdown] lang="ja"
# ## Colab で動かす
#
# Google Colab のランタイムには、Colab 自身の Python と PyTorch が入っています。2026 年 8 月の時点では
# Python 3.13 と torch 2.11 です ([googlecolab/backend-info](https://github.com/googlecolab/backend-info))。
# この講座の `tools/course.py lab` は使えないので、講座のフォルダ (git clone したもの、またはアップロードしたもの) で
# `%pip install -e ".[lab]"` を実行し、セッションを再起動してからレッスンを開きます。labkit は torch 2.4
# 以上なら受け付けるので、この行は Colab の torch を入れ替えません。
#
# この講座の事実は torch 2.13.0 と 2.14.1 で確かめてあります (`tools/course.py lab` が入れるのは 2.13.0 です。2.14.1 は
# PyPI から入る CUDA 版を、GPU のないマシンで動かしました)。2 つの版で事実が違うところは、どちらの版で
# 何が起きるかをレッスンに書いてあります (レッスン 09: torch のヘッダが要求する C++ の規格)。ほかの版の
# torch では、どのレッスンも最初のセルの `labkit.require` がそう警告します (`TorchVersionWarning`)。
# Colab の torch なら次のとおりです。

# %% [markdown] lang="en"
# ## Running on Colab
#
# Google Colab's runtime comes with its own Python and PyTorch: in August 2026, Python 3.13
# and torch 2.11 ([googlecolab/backend-info](https://github.com/googlecolab/backend-info)).
# The course's `tools/course.py lab` does not apply there: in the course's folder (cloned with git,
# or uploaded), run `%pip install -e ".[lab]"`, restart the session, then open a lesson.
# labkit accepts torch 2.4 or newer, so that line leaves Colab's torch in place.
#
# The course's facts were checked with torch 2.13.0 and 2.14.1 (`tools/course.py lab` installs
# 2.13.0; 2.14.1 ran as PyPI's CUDA build, on a machine without a GPU). Where a fact
# differs between the two, the lesson says which shows what (lesson 09: the C++ standard
# torch's headers require). With another torch, every lesson's first cell warns so
# (`labkit.require`, a `TorchVersionWarning`). With Colab's torch it reads:

# %%
colab_note = labkit.torch_note("2.11.0+cpu")  # what require() warns with Colab's torch
print(colab_note)
# every version checked is named; labkit.CHECKED_TORCH is the one tools/course.py lab pins
assert "2.11.0+cpu" in colab_note and labkit.CHECKED_TORCH in colab_note
assert all(checked in colab_note for checked in labkit.CHECKED_TORCH_VERSIONS)
print(labkit.torch_note() or f"here: torch {torch.__version__}, a version checked")
