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
# # 09 エコシステムとスケールアウト
#
# このレッスンを終えると、次のことができます。
#
# - DDP のプログラムを `torchrun` で 1 台のマシンで、また複数のマシンで (ノードごとに 1 つの torchrun を
#   起動し、c10d のランデブーで待ち合わせて) 動かす
# - torchrun が各プロセスに渡す `RANK`、`LOCAL_RANK`、`WORLD_SIZE` を求める
# - ノードごとに torchrun を 1 つ起動する SLURM、PBS、PJM のジョブスクリプトを、自分のシステムに合わせて直す
# - Lightning と Accelerate が DDP の上で代わりにしてくれることを説明し、DDP (モデルを丸ごと複製) と
#   FSDP / ZeRO (分割して持つ) を区別する
#
# 「記事の補足」の節 (Horovod、TensorFlow Lattice) は記事 000 と 004 の記述を確かめる節で、飛ばしてかまいません。

# %% [markdown] lang="en" tags=["outcomes"]
# # 09 Ecosystem and scale-out
#
# After this lesson you can:
#
# - run a DDP program with `torchrun` on one machine, and on several (one torchrun per
#   node, meeting through c10d rendezvous);
# - work out the `RANK`, `LOCAL_RANK` and `WORLD_SIZE` torchrun hands each process;
# - adapt a SLURM, PBS or PJM job script that starts one torchrun per node to your site;
# - say what Lightning and Accelerate do for you on top of DDP, and tell DDP (a whole
#   copy of the model on every rank) from FSDP and ZeRO (shards).
#
# The sections marked *article material* (Horovod, TensorFlow Lattice) check docs 000
# and 004; skip them unless you came for the articles.

# %%
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %%
import json
import tempfile
from pathlib import Path

import torch

from labkit import doctor, ecosystem, exercises
from labkit.cluster import torchrun

# %% [markdown] lang="ja"
# ## 1 台のマシンで torchrun
#
# `torchrun` は PyTorch の標準のランチャーです。ランクごとにプロセスを起動し、`RANK`、`WORLD_SIZE`、
# `LOCAL_RANK`、待ち合わせ場所 (`MASTER_ADDR`、`MASTER_PORT`) を環境変数で渡し、1 つでも失敗すれば全体を止めます。
# labkit のコマンドはそのまま torchrun の下で動きます (レッスン 04)。
#
# ```
# torchrun --nproc-per-node 2 -m labkit nosync --accum 2 --steps 2 --repeat 1
# ```
#
# 次のセルはこれをここで実行します (`torchrun.run_nodes` は torchrun を子プロセスとして起動します)。

# %% [markdown] lang="en"
# ## torchrun on one machine
#
# `torchrun` is PyTorch's standard launcher. It starts one process per rank, hands each
# its `RANK`, `WORLD_SIZE`, `LOCAL_RANK` and the meeting point (`MASTER_ADDR`,
# `MASTER_PORT`) in environment variables, and stops everything if one fails. labkit's
# commands run under torchrun unchanged (lesson 04).
#
# ```
# torchrun --nproc-per-node 2 -m labkit nosync --accum 2 --steps 2 --repeat 1
# ```
#
# The next cell runs exactly that here (`torchrun.run_nodes` starts torchrun as a child
# process).

# %%
experiment = ["-m", "labkit", "nosync", "--accum", "2", "--steps", "2", "--repeat", "1"]
with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "one_node.json"
    node, = torchrun.run_nodes([*experiment, "--json", str(out)], nnodes=1,
                                nproc_per_node=2, timeout_s=120)
    one_node = json.loads(out.read_text())
print("exit code", node.returncode, "| world size", one_node["world_size"])

# %% tags=["hide-input"]
assert node.returncode == 0, node.output[-3000:]  # on failure: what torchrun printed
assert one_node["world_size"] == 2
assert one_node["allreduce_calls_per_step_nosync"] == 1

# %% [markdown] lang="ja"
# ## 2 台のマシンを模擬する
#
# 複数のマシンでは、**各マシンで 1 つずつ** torchrun を起動します。どのマシンも同じコマンドで、
# `--nnodes` (マシンの数)、`--nproc-per-node` (マシンあたりのプロセス数)、`--rdzv-id` (この学習の名前)、
# `--rdzv-endpoint` (どれか 1 台の「ホスト:ポート」) をそろえます。torchrun どうしが c10d の
# ランデブー (待ち合わせ) で互いを見つけ、ランク番号を割り振ります。
#
# ここではマシン 2 台を、1 台の上の torchrun 2 つ (それぞれ 1 プロセス) で模擬し、同じ実験をします。
#
# **予想してから実行:** ランクが見る world size はいくつで、マイクロバッチ 2 個の 1 ステップの all-reduce は、
# `no_sync` なしとありでそれぞれ何回でしょうか (モデルのバケットは 1 つです)?

# %% [markdown] lang="en"
# ## Two machines, simulated
#
# On several machines, start **one torchrun on each machine**. Every machine runs the same
# command with the same `--nnodes` (machines), `--nproc-per-node` (processes per machine),
# `--rdzv-id` (a name for this run) and `--rdzv-endpoint` ("host:port" of one of them).
# The torchrun agents find each other through c10d rendezvous and hand out the ranks.
#
# Here two torchrun agents on this one machine (one process each) simulate two
# machines and run the same experiment.
#
# **Predict, then run:** what world size do the ranks see, and how many all-reduces does
# a step of 2 micro-batches make, without and with `no_sync` (the model has one bucket)?

# %%
print(" ".join(torchrun.command(
    experiment, nnodes=2, nproc_per_node=1, endpoint="127.0.0.1:PORT",
    run_id="RUN_ID", python="python")))
with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "two_nodes.json"
    nodes = torchrun.run_nodes([*experiment, "--json", str(out)], nnodes=2,
                                nproc_per_node=1, timeout_s=120)
    two_nodes = json.loads(out.read_text())

# %% tags=["hide-input"]
for n in nodes:
    print(f"node {n.node}: exit code {n.returncode}")
print({k: two_nodes[k] for k in ("world_size", "grad_max_abs_diff",
                                 "allreduce_calls_per_step_sync",
                                 "allreduce_calls_per_step_nosync")})
assert [n.returncode for n in nodes] == [0, 0], [n.output[-2000:] for n in nodes]
assert two_nodes["world_size"] == 2 and two_nodes["grad_max_abs_diff"] <= 1e-6
assert two_nodes["allreduce_calls_per_step_sync"] == 2
assert two_nodes["allreduce_calls_per_step_nosync"] == 1

# %% [markdown] lang="ja"
# 1 台で 2 プロセスでも、2 台で 1 プロセスずつでも、1 ステップの all-reduce の回数は同じです。

# %% [markdown] lang="en"
# One machine with two processes or two machines with one each: the all-reduces per
# step are the same.

# %%
from labkit import plots

counts = {labkit.t(label): {"DDP": run["allreduce_calls_per_step_sync"],
                            "no_sync": run["allreduce_calls_per_step_nosync"]}
          for label, run in (("one_node", one_node), ("two_nodes", two_nodes))}
assert counts[labkit.t("one_node")] == counts[labkit.t("two_nodes")] == {
    "DDP": 2, "no_sync": 1}
fig = plots.bar_chart(counts, ylabel="allreduces_per_step", title="nodes_title",
                      fmt="{:.0f}")

# %% [markdown] lang="ja"
# ## 演習: torchrun が各プロセスに渡す番号
#
# torchrun は各プロセスに、`RANK` (全ノードを通した番号)、`LOCAL_RANK` (ノードの中での番号。そのノードの
# どの GPU を使うかを決めます)、`WORLD_SIZE` (全ノードのプロセスの数) を環境変数で渡します。ランデブーは
# 各ノードに `node_rank` (0 から `nnodes` − 1) を割り振り、`RANK` はノード 0 のプロセスから順に付きます。
#
# `torchrun_env(nnodes, nproc_per_node, node_rank)` を書いてください。ノード `node_rank` で動く各プロセスの
# `{"RANK": ..., "LOCAL_RANK": ..., "WORLD_SIZE": ...}` を、`LOCAL_RANK` の順に並べたリストを返します。
#
# 確認のセルは、いくつかの組み合わせ (最大 4 ノード × 8 プロセス) で確かめてから、実際の torchrun
# (2 ノード × 2 プロセス) の各プロセスが受け取った環境変数と比べます。

# %% [markdown] lang="en"
# ## Exercise: the numbers torchrun hands each process
#
# torchrun hands each process `RANK` (its number across all nodes), `LOCAL_RANK` (its
# number within its node, which picks the node's GPU) and `WORLD_SIZE` (the number of
# processes on all nodes) in environment variables. The rendezvous gives each node a
# `node_rank` (0 to `nnodes` − 1), and `RANK` numbers node 0's processes first.
#
# Write `torchrun_env(nnodes, nproc_per_node, node_rank)`. It returns, in `LOCAL_RANK`
# order, `{"RANK": ..., "LOCAL_RANK": ..., "WORLD_SIZE": ...}` for each process that
# runs on node `node_rank`.
#
# The check tries a few set-ups (up to 4 nodes × 8 processes), then compares with the
# environment each process of a real torchrun (2 nodes × 2 processes) received.

# %% tags=["exercise"]
def torchrun_env(nnodes, nproc_per_node, node_rank):
    """RANK, LOCAL_RANK and WORLD_SIZE of each process torchrun starts on one node."""
    envs = []
    for local_rank in range(nproc_per_node):
        envs.append({"RANK": None, "LOCAL_RANK": local_rank, "WORLD_SIZE": None})  # TODO
    return envs

# %% tags=["solution"]
def torchrun_env(nnodes, nproc_per_node, node_rank):
    """RANK, LOCAL_RANK and WORLD_SIZE of each process torchrun starts on one node."""
    envs = []
    for local_rank in range(nproc_per_node):
        envs.append({"RANK": node_rank * nproc_per_node + local_rank,  # earlier nodes first
                     "LOCAL_RANK": local_rank,
                     "WORLD_SIZE": nnodes * nproc_per_node})  # every node's processes
    return envs

# %%
exercises.grade_torchrun_env(torchrun_env)

# %% [markdown] lang="ja"
# 確認に通った `torchrun_env` で描いた 2 ノード × 4 プロセスの番号です。`RANK` は前のノードから続けて数え、
# `LOCAL_RANK` はノードごとに 0 から数え直します。

# %% [markdown] lang="en"
# The numbers of 2 nodes × 4 processes, from the `torchrun_env` that passed the check:
# `RANK` counts on from the node before, `LOCAL_RANK` starts at 0 on every node.

# %% tags=["hide-input"]
from labkit import diagrams

envs = [torchrun_env(2, 4, node) for node in (0, 1)]
table = {key: [[e[key] for e in node] for node in envs]
         for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
assert table["RANK"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
fig = diagrams.collectives(table, column="node_n", title="torchrun_title",
                           fmt="{:.0f}", shade=False)

# %% [markdown] lang="ja"
# ## 実機のクラスタ: SLURM、PBS、PJM
#
# クラスタでは、ジョブスケジューラがノードを割り当てます。どのスケジューラでも、ノードごとに torchrun を
# 1 つ起動し、割り当ての最初のノードを待ち合わせ場所にします。3 つのスケジューラの例は、どれも起動コマンドで
# 各ノードに `labkit/cluster/torchrun_node.sh` を 1 回ずつ実行させます。ノード間は nccl バックエンドです。
#
# | スケジューラ | 投入 | 例 | ノードの一覧 | ノードごとに 1 回起動 | 導入例 |
# |---|---|---|---|---|---|
# | SLURM | `sbatch` | `labkit/cluster/slurm_example.sh` | `scontrol show hostnames $SLURM_JOB_NODELIST` | `srun` (ノードあたり 1 タスク) | 京都大学のスーパーコンピュータ ([利用の手引き](https://web.kudpc.kyoto-u.ac.jp/manual/en/run/resource)) |
# | PBS Professional | `qsub` | `labkit/cluster/pbs_example.sh` | `$PBS_NODEFILE` | `mpirun -map-by ppr:1:node` | ABCI 3.0 ([ジョブの実行](https://docs.abci.ai/v3/en/job-execution/)) |
# | 富士通の PJM | `pjsub` | `labkit/cluster/pjm_example.sh` | `$PJM_O_NODEINF` | `mpiexec -npernode 1` | 富岳 ([利用手引書](https://www.r-ccs.riken.jp/fugaku/docs/user-guide/sys-use/user-guide-use-1.49/build/en/JobExecution/BulkJob.html))、Wisteria/BDEC-01 (東京大学)、不老 (名古屋大学、[FAQ](https://icts.nagoya-u.ac.jp/ja/sc/faq.html)) |
#
# 自分のシステムで変えるのは、冒頭の指定 (キューやリソースグループ、グループ、時間)、`module load` の行、
# ノードあたりのプロセス数 (`PROCS_PER_NODE`、GPU の数) です。富岳のノードには GPU がないので、ランクを
# CPU で動かします (`BACKEND=gloo`)。次のセルは各スクリプトの要の行を表示し、構文を確かめます。
#
# <details><summary>測り方</summary>
#
# `pbs_example.sh` は ABCI 3.0 の、`pjm_example.sh` は Wisteria/BDEC-01 Aquarius の書き方に合わせてあります。
#
# `tests/test_cluster_scripts.py` は、3 つのスクリプトを、スケジューラの環境 (ノードの一覧、ジョブ ID) と
# 起動コマンドを模擬して、この 1 台で 2 ノードとして実行し、結果を確かめます。実機のクラスタでは
# 動かしたことがありません。
#
# </details>

# %% [markdown] lang="en"
# ## A real cluster: SLURM, PBS, PJM
#
# On a cluster a job scheduler hands out the nodes. Whatever the scheduler, the job
# starts one torchrun per node and uses the allocation's first node as the meeting
# point. Each of the three examples has the scheduler's launcher run
# `labkit/cluster/torchrun_node.sh` once on every node. Between nodes, use nccl.
#
# | scheduler | submit | example | node list | once per node | used at (examples) |
# |---|---|---|---|---|---|
# | SLURM | `sbatch` | `labkit/cluster/slurm_example.sh` | `scontrol show hostnames $SLURM_JOB_NODELIST` | `srun` (one task per node) | Kyoto University's supercomputers ([guide](https://web.kudpc.kyoto-u.ac.jp/manual/en/run/resource)) |
# | PBS Professional | `qsub` | `labkit/cluster/pbs_example.sh` | `$PBS_NODEFILE` | `mpirun -map-by ppr:1:node` | ABCI 3.0 ([job execution](https://docs.abci.ai/v3/en/job-execution/)) |
# | Fujitsu's PJM | `pjsub` | `labkit/cluster/pjm_example.sh` | `$PJM_O_NODEINF` | `mpiexec -npernode 1` | Fugaku ([user guide](https://www.r-ccs.riken.jp/fugaku/docs/user-guide/sys-use/user-guide-use-1.49/build/en/JobExecution/BulkJob.html)), Wisteria/BDEC-01 (University of Tokyo), Flow (Nagoya University, [FAQ](https://icts.nagoya-u.ac.jp/ja/sc/faq.html)) |
#
# What to change for your site: the directives at the top (queue or resource group,
# group, time), the `module load` line, and the processes per node (`PROCS_PER_NODE`, the
# number of GPUs). Fugaku's nodes have no GPU: there the ranks run on the CPU
# (`BACKEND=gloo`). The next cell prints each script's key lines and checks its syntax.
#
# <details><summary>How this was measured</summary>
#
# `pbs_example.sh` follows ABCI 3.0's conventions, `pjm_example.sh` Wisteria/BDEC-01
# Aquarius's.
#
# `tests/test_cluster_scripts.py` runs each of the three scripts on this one machine as
# two nodes, with the scheduler's environment (node list, job id) and its launcher
# faked, and checks the result. None has run on a real cluster.
#
# </details>

# %% tags=["hide-input"]
import os
import shutil
import subprocess

# The scripts run on the cluster's Linux nodes. Here `bash -n` checks their syntax
# where there is a bash; Windows has none of its own (WSL's cannot read C:\ paths).
bash = shutil.which("bash") if os.name != "nt" else None
for scheduler, path in torchrun.JOB_SCRIPTS.items():
    script = path.read_text(encoding="utf-8")
    print(f"--- {path.name}")
    print("\n".join(line for line in script.splitlines() if line.startswith(
        ("#SBATCH", "#PBS", "#PJM", "srun", "mpirun", "mpiexec", "head_node", "nnodes",
         "    "))))
    if bash:
        syntax = subprocess.run([bash, "-n"], input=script, capture_output=True,
                                encoding="utf-8")
        assert syntax.returncode == 0, syntax.stderr
    else:
        print(f"(bash -n {path.name}: skipped, no bash here)")
    assert '"$PWD/labkit/cluster/torchrun_node.sh"' in script  # one node's part, the same for all
node = torchrun.NODE_SCRIPT.read_text()
assert "--rdzv-backend c10d" in node and '--nnodes "$nnodes"' in node

# %% [markdown] lang="ja"
# ## PyTorch Lightning と Hugging Face Accelerate
#
# どちらも DDP の学習ループ (プロセスの起動、`DistributedSampler`、勾配累積、チェックポイントなど) を
# 代わりに書くライブラリです。勾配累積は
#
# - Lightning: `Trainer(strategy="ddp", accumulate_grad_batches=K)`
# - Accelerate: `Accelerator(gradient_accumulation_steps=K)` と `with accelerator.accumulate(model):`
#
# と書きます。DDP で勾配累積を速く行うには `no_sync` が要ります (レッスン 04)。両者が中で `no_sync` を使う
# ことを、ソースコードと `DistributedDataParallel.no_sync` の呼び出し回数で確かめます。8 バッチを K = 4 で
# 累積すると、更新は 2 回、`no_sync` に入るのは 6 回のはずです。
#
# 2 つとも**任意の追加パッケージ**です。入っていなければ、次のセルは飛ばしたことを表示します。確かめるには
# `pip install lightning accelerate` のあと、このセルをもう一度実行してください。

# %% [markdown] lang="en"
# ## PyTorch Lightning and Hugging Face Accelerate
#
# Both write the DDP training loop for you (starting processes, `DistributedSampler`,
# gradient accumulation, checkpoints, and so on). Gradient accumulation is
#
# - Lightning: `Trainer(strategy="ddp", accumulate_grad_batches=K)`
# - Accelerate: `Accelerator(gradient_accumulation_steps=K)` and
#   `with accelerator.accumulate(model):`
#
# Gradient accumulation under DDP needs `no_sync` to be fast (lesson 04). Check that
# both use it underneath, in their source and by counting calls of
# `DistributedDataParallel.no_sync`: 8 batches with K = 4 should give 2 updates and 6
# entries into `no_sync`.
#
# Both are **optional extras**: without them the next cell says which it skipped. To
# check, run `pip install lightning accelerate` and run the cell again.

# %%
checked = []
for name in ecosystem.FRAMEWORKS:
    installed = doctor.version(name)
    if installed is None:
        print(labkit.t("framework_skip", name=name))
        continue
    checked.append(name)
    print(f"{name} {installed}:", *ecosystem.no_sync_lines(name), sep="\n    ")
    counted = ecosystem.run_counted(name)
    for r in counted:
        print(f"  rank {r['rank']}: wrapped in {r['wrapped_in']}, {r['batches']} batches, "
              f"{r['optimizer_steps']} optimizer steps, no_sync entered "
              f"{r['no_sync_entries']} times")
        assert r["wrapped_in"] == "DistributedDataParallel"
        assert r["optimizer_steps"] == r["batches"] // r["accum_steps"]
        assert r["no_sync_entries"] == r["batches"] - r["optimizer_steps"]
print(labkit.t("frameworks_checked", checked=", ".join(checked) or "-",
               skipped=", ".join(n for n in ecosystem.FRAMEWORKS if n not in checked)
               or "-"))

# %% [markdown] lang="ja"
# 記事は「コードを変更することなく」と書いていますが、Lightning では学習コードを `LightningModule` に
# 書き直し、Accelerate では `accelerator.prepare` と `accelerator.backward` を書き加えます。正確には
# 「少ない変更で済む」です。

# %% [markdown] lang="en"
# The document says "without changing the code". Lightning needs the training code
# rewritten as a `LightningModule`; Accelerate needs `accelerator.prepare` and
# `accelerator.backward` added. "With few changes" is accurate.

# %% [markdown] lang="ja"
# ## 手動の並列化
#
# 記事 004 の「手動で並列処理を実装する」手順は「1. モデルを複数の GPU に分割します」から始まります。
# データ並列で分けるのはデータで、モデルは**丸ごと複製**します。モデルそのものを GPU に分けるのは
# モデル並列 (パイプライン並列やテンソル並列) という別の方式です。
#
# データ並列を手で組み立てる部品は `torch.nn.parallel` の `replicate`、`scatter`、`parallel_apply`、
# `gather` で、`data_parallel()` はこの 4 つを順に呼ぶだけです (レッスン 02)。複数のプロセスなら部品は
# 集団通信 (`all_reduce` など) で、それを自動でするのが DDP です (レッスン 03)。

# %% [markdown] lang="en"
# ## Parallelism by hand
#
# Doc 004's steps for "implementing parallelism by hand" start with "1. split the model
# across the GPUs". Data parallelism splits the data and **copies the whole model**.
# Splitting the model itself across GPUs is model parallelism (pipeline or tensor
# parallelism), a different method.
#
# The parts for building data parallelism by hand are `torch.nn.parallel`'s `replicate`,
# `scatter`, `parallel_apply` and `gather`; `data_parallel()` just calls these four in
# turn (lesson 02). Across processes the parts are collectives (`all_reduce` and so on),
# and DDP does it for you (lesson 03).

# %% tags=["hide-input"]
import inspect
import re

source = inspect.getsource(torch.nn.parallel.data_parallel)
calls = re.findall(r"\b(scatter|replicate|parallel_apply|gather)\w*\(", source)
print(calls)  # scatter appears as scatter_kwargs, which splits args and kwargs
assert calls == ["scatter", "replicate", "parallel_apply", "gather"]

# %% [markdown] lang="ja"
# ## FSDP と ZeRO: パラメータを分割して持つ
#
# 記事 000 の「各 GPU はモデルのパラメータの一部を保持し」は DDP には当てはまりません (DDP の各ランクは
# 全パラメータを持ちます。レッスン 03)。パラメータを分割して持つのは **ZeRO** (DeepSpeed) と
# PyTorch の **FSDP** です。
#
# - ZeRO-1 はオプティマイザの状態を、ZeRO-2 はさらに勾配を、ZeRO-3 はさらにパラメータそのものを
#   ランクに分割して持ちます。
# - FSDP2 (`torch.distributed.fsdp.fully_shard`) は ZeRO-3 と同じく 3 つとも分け、各パラメータを
#   0 番目の次元でランク数で分割して (`torch.chunk(dim=0)`) 持ちます。順伝播と逆伝播の前に、その層の
#   パラメータを all-gather で一時的に集め、使い終わったら解放します
#   ([fully_shard のドキュメント](https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html))。
#
# FSDP2 は gloo を使えば CPU でも動きます。小さな MLP (2,110 パラメータ) を 2 ランクで分割し、各ランクが
# 各パラメータの半分を持ち、それでも勾配は 1 プロセスで全体のバッチを使ったものと一致することを確かめます。
# ここでは分け方を見るだけです。各ステージのバイト数は [12: メモリは何に使われるか](12_zero_by_hand.ipynb#cell-id=12-where-the-memory-goes)
# で数え、FSDP2 での学習は [13: FSDP2: fully_shard](13_fsdp2.ipynb#cell-id=13-fsdp2-fully-shard) で扱います。
#
# **予想してから実行:** 2,110 個の値のうち、各ランクはいくつを持つでしょうか?

# %% [markdown] lang="en"
# ## FSDP and ZeRO: holding part of the parameters
#
# Doc 000's "each GPU holds part of the model's parameters" is not DDP (every DDP rank
# holds all parameters: lesson 03). Holding parts of the parameters is **ZeRO**
# (DeepSpeed) and PyTorch's **FSDP**.
#
# - ZeRO-1 shards the optimizer states over the ranks, ZeRO-2 the gradients as well, and
#   ZeRO-3 the parameters themselves too.
# - FSDP2 (`torch.distributed.fsdp.fully_shard`) shards all three like ZeRO-3: it cuts
#   every parameter along dimension 0 into one chunk per rank (`torch.chunk(dim=0)`).
#   Before a layer's forward and backward it gathers that layer's parameters with an
#   all-gather, and frees them afterwards
#   ([fully_shard documentation](https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html)).
#
# FSDP2 runs on gloo on the CPU. Shard a tiny MLP (2,110 parameters) over two ranks and
# check that each rank holds half of every parameter, and that the gradients still equal
# those of one process on the whole batch. This is only a look at the cut: the bytes
# each stage holds are counted in
# [12: Where the memory goes](12_zero_by_hand.ipynb#cell-id=12-where-the-memory-goes),
# and training with FSDP2 is [13: FSDP2: fully_shard](13_fsdp2.ipynb#cell-id=13-fsdp2-fully-shard).
#
# **Predict, then run:** of the 2,110 values, how many does each rank hold?

# %%
from labkit import cluster

ranks = cluster.start(2)

# %%
# %%px
import torch

from labkit import sharding

fsdp = sharding.fsdp_experiment(rank, world_size)
print(f"rank {rank}: holds {fsdp['local_numel']} of {fsdp['full_numel']} values; "
      f"|grad - whole-batch grad| = {fsdp['grad_max_abs_diff']:.1e}")

# %% tags=["hide-input"]
# %%px
shard_rows = []  # (parameter, whole shape, first row, the row after its last)
for name, s in fsdp["shards"].items():
    pieces = torch.arange(s["global"][0]).chunk(world_size)  # dim 0, as torch.chunk cuts
    assert s["local"][0] == len(pieces[rank]), name  # this rank holds its piece
    start = sum(len(p) for p in pieces[:rank])
    shard_rows.append((name, s["global"], start, start + s["local"][0]))
assert fsdp["local_numel"] * world_size == fsdp["full_numel"]
assert fsdp["shards"]["fc1.weight"]["local"] == (100 // world_size, 10)
assert fsdp["grad_max_abs_diff"] <= 1e-6

# %% [markdown] lang="ja"
# 各ランクが各パラメータの値をいくつ持ち、0 番目の次元のどの行を持つかです。2 つ目の図では、どのパラメータも
# 行の前半がランク 0、後半がランク 1 です。

# %% [markdown] lang="en"
# How many values of each parameter each rank holds, and which rows of dimension 0: in
# the second figure every parameter's first half of rows is rank 0's, the second rank 1's.

# %% tags=["hide-input"]
import math

held = ranks.pull("fsdp")
rows = {name: [[math.prod(h["shards"][name]["local"])] for h in held]
        for name in held[0]["shards"]}
assert all(sum(v for v, in r) == math.prod(held[0]["shards"][name]["global"])
           for name, r in rows.items())  # the shards add up to each whole parameter
fig = diagrams.collectives(rows, title="fsdp_held_title", fmt="{:.0f}")

# %% tags=["hide-input"]
shards = ranks.pull("shard_rows")  # per rank: (parameter, shape, first row, row after)
for spans in zip(*shards, strict=True):  # one parameter: every rank's rows, in turn
    starts, stops = [s[2] for s in spans], [s[3] for s in spans]
    assert starts == [0, *stops[:-1]] and stops[-1] == spans[0][1][0]  # dim 0, once
fig = diagrams.dim0_shards(shards)

# %% [markdown] lang="ja"
# ## 演習 (任意): 各ランクはいくつの値を持つか
#
# 2 ランクでは、小さな MLP のどのパラメータも行数が偶数なので、各ランクはちょうど半分を持ちました。
# 行数がランク数で割り切れないときはどうなるでしょうか。`values_held(shape, rank, world_size)` を
# 書いてください。`fully_shard` で `world_size` ランクに分けたとき、形が `shape` のパラメータの値を
# ランク `rank` がいくつ持つかを返します。FSDP2 は 0 番目の次元を `torch.chunk` と同じように切ります
# (レッスン 02 の `scatter` がバッチを切るのと同じ切り方です)。
#
# 確認のセルは、行数が奇数の MLP (`Linear(10, 5)` と `Linear(5, 1)`) を 2 ランクで実際に `fully_shard` で
# 分けた結果と、3 ランクと 8 ランクでの `torch.chunk` と比べます。関数はカーネルで実行されます。

# %% [markdown] lang="en"
# ## Exercise (optional): how much does each rank hold?
#
# On two ranks every parameter of the tiny MLP has an even number of rows, so each rank
# held exactly half. What if the rows do not divide by the number of ranks? Write
# `values_held(shape, rank, world_size)`: how many values of a parameter of shape
# `shape` rank `rank` holds when `fully_shard` shards it over `world_size` ranks. FSDP2
# cuts dimension 0 as `torch.chunk` does (the way lesson 02's `scatter` cuts a batch).
#
# The check compares with what `fully_shard` really does on two ranks to an MLP with odd
# numbers of rows (`Linear(10, 5)` and `Linear(5, 1)`), and with `torch.chunk` on 3 and
# 8 ranks. The function runs in the kernel.

# %% tags=["exercise", "optional"]
import math


def values_held(shape, rank, world_size):
    """How many values of a parameter of `shape` rank `rank` holds under fully_shard."""
    return None  # TODO: the rows of this rank's piece of dimension 0, times a row's values

# %% tags=["solution"]
def values_held(shape, rank, world_size):
    """How many values of a parameter of `shape` rank `rank` holds under fully_shard."""
    rows, per_row = shape[0], math.prod(shape[1:])
    piece = math.ceil(rows / world_size)  # torch.chunk: every piece but the last this size
    mine = min(piece, max(0, rows - rank * piece))  # the last pieces: fewer rows, or none
    return mine * per_row

# %%
exercises.grade_shard_sizes(ranks, values_held)

# %%
ranks.stop()

# %% [markdown] lang="ja"
# ## Horovod のいま
#
# *記事の補足: 記事 000 と 004 が挙げる Horovod が、いまどうなっているかを確かめます。*
#
# Horovod は Uber が作った分散学習ライブラリです。記事 000 と 004 は選択肢に挙げていますが、PyTorch で
# 新しく使う理由はほとんどありません。2023 年の 0.28.1 を最後にリリースがなく、ホイールもありません。
# 0.28.1 は C++14 でビルドしますが、いまの torch のヘッダは C++17 以降を要求します。Databricks も非推奨にしています。
#
# <details><summary>測り方</summary>
#
# - **最新のリリースは 0.28.1** です (`pip index versions horovod` で確認。PyPI に
#   あるのは 0.28.1 まで)。配布物の `PKG-INFO` の日付は 2023-06-12 で、それ以降のリリースはありません。
# - **ホイールがなく、ソースからビルドします** (`pip download --only-binary :all: horovod==0.28.1` は
#   「No matching distribution」)。CMake と C++ コンパイラが要り、PyTorch に対してビルドされます。
# - 0.28.1 の `CMakeLists.txt` は C++14 でビルドします (`set(CMAKE_CXX_STANDARD 14)`)。一方 PyTorch 2.1 以降の
#   ヘッダは C++17 を要求し、0.28.1 は PyTorch 2.1.0 に対してビルドできないと報告されています
#   ([horovod#3996](https://github.com/horovod/horovod/issues/3996))。修正
#   ([horovod#3998](https://github.com/horovod/horovod/pull/3998)、C++17 でコンパイル) はリリースに
#   含まれていません。torch のヘッダが要求する規格は、そのあとさらに上がりました。torch 2.13 のヘッダは
#   C++17、torch 2.14 のヘッダは C++20 を要求します (次のセルが、インストールされた torch のヘッダで確かめます)。
# - Databricks は Horovod と HorovodRunner を非推奨とし、PyTorch には TorchDistributor を勧めています
#   ([Databricks のドキュメント、フランス語版](https://docs.databricks.com/aws/fr/archive/machine-learning/train-model/horovod))。
#
# </details>
#
# 使い方の対応表です。記事 004 の「モデルを Horovod でラップします」も正確ではありません。包むのは
# **オプティマイザ**です。
#
# | Horovod (PyTorch) | PyTorch DDP |
# |---|---|
# | `horovodrun -np 4 python train.py` (または `mpirun`) | `torchrun --nproc-per-node 4 train.py` |
# | `hvd.init()` | `dist.init_process_group("nccl")` |
# | `hvd.rank()`、`hvd.size()`、`hvd.local_rank()` | `dist.get_rank()`、`dist.get_world_size()`、`int(os.environ["LOCAL_RANK"])` |
# | `torch.cuda.set_device(hvd.local_rank())` | `torch.cuda.set_device(local_rank)` |
# | `hvd.DistributedOptimizer(optimizer, named_parameters=...)` | `DistributedDataParallel(model, device_ids=[local_rank])` |
# | `hvd.broadcast_parameters(model.state_dict(), root_rank=0)` | DDP が作るときに自動で broadcast |
# | `hvd.broadcast_optimizer_state(optimizer, root_rank=0)` | (同じ初期値から始めるので不要) |
# | `DistributedOptimizer(..., backward_passes_per_step=K)` | `with model.no_sync():` (レッスン 04) |
# | `hvd.allreduce(t)` (既定は平均) | `dist.all_reduce(t)` (和。平均は world size で割る) |
# | `DistributedSampler(num_replicas=hvd.size(), rank=hvd.rank())` | `DistributedSampler(dataset)` |

# %% [markdown] lang="en"
# ## Horovod today
#
# *Article material: where Horovod, which docs 000 and 004 name, stands today.*
#
# Horovod is a distributed-training library started at Uber. Docs 000 and 004 list it as
# an option; for PyTorch there is little reason to start with it today: nothing has
# been released since 0.28.1 in 2023, there are no wheels, and 0.28.1 builds as C++14
# while today's torch headers require C++17 or later. Databricks has deprecated it.
#
# <details><summary>How this was measured</summary>
#
# - **The latest release is 0.28.1** (checked with `pip index versions horovod`: PyPI
#   has nothing newer). Its `PKG-INFO` is dated 2023-06-12, and nothing
#   has been released since.
# - **There are no wheels: it builds from source** (`pip download --only-binary :all:
#   horovod==0.28.1` finds "No matching distribution"). It needs CMake and a C++
#   compiler, and it is built against your PyTorch.
# - 0.28.1's `CMakeLists.txt` builds as C++14 (`set(CMAKE_CXX_STANDARD 14)`), while the
#   headers of PyTorch 2.1 and later require C++17; 0.28.1 is reported not to build
#   against PyTorch 2.1.0 ([horovod#3996](https://github.com/horovod/horovod/issues/3996)).
#   The fix ([horovod#3998](https://github.com/horovod/horovod/pull/3998), compiling as
#   C++17) is in no release. torch's headers have moved on since: torch 2.13's require
#   C++17, torch 2.14's C++20 (the next cell reads the installed torch's).
# - Databricks has deprecated Horovod and HorovodRunner and recommends TorchDistributor
#   for PyTorch ([Databricks documentation, French edition](https://docs.databricks.com/aws/fr/archive/machine-learning/train-model/horovod)).
#
# </details>
#
# How its API maps to DDP. Doc 004's "wrap the model with Horovod" is not accurate
# either: what you wrap is the **optimizer**.
#
# | Horovod (PyTorch) | PyTorch DDP |
# |---|---|
# | `horovodrun -np 4 python train.py` (or `mpirun`) | `torchrun --nproc-per-node 4 train.py` |
# | `hvd.init()` | `dist.init_process_group("nccl")` |
# | `hvd.rank()`, `hvd.size()`, `hvd.local_rank()` | `dist.get_rank()`, `dist.get_world_size()`, `int(os.environ["LOCAL_RANK"])` |
# | `torch.cuda.set_device(hvd.local_rank())` | `torch.cuda.set_device(local_rank)` |
# | `hvd.DistributedOptimizer(optimizer, named_parameters=...)` | `DistributedDataParallel(model, device_ids=[local_rank])` |
# | `hvd.broadcast_parameters(model.state_dict(), root_rank=0)` | done by DDP when it is built |
# | `hvd.broadcast_optimizer_state(optimizer, root_rank=0)` | (not needed: every rank starts from the same state) |
# | `DistributedOptimizer(..., backward_passes_per_step=K)` | `with model.no_sync():` (lesson 04) |
# | `hvd.allreduce(t)` (averages by default) | `dist.all_reduce(t)` (sums; divide by the world size to average) |
# | `DistributedSampler(num_replicas=hvd.size(), rank=hvd.rank())` | `DistributedSampler(dataset)` |

# %% tags=["hide-input"]
import importlib.util

header = Path(torch.__file__).parent / "include" / "torch" / "csrc" / "api" / "include" / "torch" / "all.h"
if header.exists():
    error = next(line for line in header.read_text().splitlines() if "#error" in line)
    print(error)
    cxx = int(re.search(r"C\+\+(\d+) or later", error).group(1))
    assert cxx > 14  # on any torch: newer than the C++14 that Horovod 0.28.1 builds as
    # the versions the course was checked with: 2.13 asks for C++17, 2.14 for C++20
    minor = tuple(int(part) for part in torch.__version__.split(".")[:2])
    assert cxx == {(2, 13): 17, (2, 14): 20}.get(minor, cxx), (torch.__version__, cxx)
print("horovod installed:", importlib.util.find_spec("horovod") is not None)

# %% [markdown] lang="ja"
# ## TensorFlow Lattice は分散学習のフレームワークではない
#
# *記事の補足: 記事 004 の記述を確かめます。*
#
# 記事 004 は「PyTorch Lightning や TensorFlow Lattice などのフレームワークは、分散訓練を自動的に処理する」と
# 書いていますが、TensorFlow Lattice は**格子 (lattice) ベースのモデル**を実装するライブラリで、単調性などの
# **形状制約**でドメイン知識をモデルに組み込む Keras の層を提供します
# ([TensorFlow Lattice の概要](https://www.tensorflow.org/lattice/overview))。分散学習とは関係ありません。
# PyTorch での分散学習のフレームワークなら、Lightning、Accelerate、DeepSpeed などです。

# %% [markdown] lang="en"
# ## TensorFlow Lattice is not a distributed-training framework
#
# *Article material: a claim of doc 004, checked.*
#
# Doc 004 says "frameworks such as PyTorch Lightning and TensorFlow Lattice handle
# distributed training automatically". TensorFlow Lattice is a library of **lattice
# based models**: Keras layers that put domain knowledge into a model through **shape
# constraints** such as monotonicity
# ([TensorFlow Lattice overview](https://www.tensorflow.org/lattice/overview)). It has
# nothing to do with distributed training. Frameworks for distributed training with
# PyTorch are Lightning, Accelerate, DeepSpeed and others.

# %% [markdown] lang="ja" tags=["summary"]
# ## 覚えておくこと
#
# - **torchrun はノードごとに 1 つ起動し**、どれも同じ `--nnodes`、`--nproc-per-node`、`--rdzv-id`、
#   `--rdzv-endpoint` で、c10d のランデブーが互いを見つけてランク番号を割り振ります。
# - **`RANK = node_rank × nproc_per_node + LOCAL_RANK`、`WORLD_SIZE = nnodes × nproc_per_node`** で、
#   `LOCAL_RANK` はそのノードのどの GPU を使うかを決めます。
# - **クラスタでは、スケジューラの起動コマンドが各ノードで `torchrun_node.sh` を 1 回ずつ実行し**、割り当ての
#   最初のノードが待ち合わせ場所になります (システムごとに変えるのは冒頭の指定、`module load`、ノードあたりの
#   プロセス数です)。
# - **Lightning と Accelerate は DDP の学習ループを代わりに書き**、勾配累積には中で `no_sync` を使います
#   (コードの変更は少なくて済みますが、なくはなりません)。
# - **DDP は全ランクがモデルを丸ごと持ち、FSDP と ZeRO は分割して持ち**、FSDP2 は各パラメータを 0 番目の
#   次元で切って、層を動かすあいだだけ集めます。

# %% [markdown] lang="en" tags=["summary"]
# ## What to remember
#
# - **One torchrun per node**, all with the same `--nnodes`, `--nproc-per-node`,
#   `--rdzv-id` and `--rdzv-endpoint`: the c10d rendezvous finds the agents and hands
#   out the ranks.
# - **`RANK = node_rank × nproc_per_node + LOCAL_RANK` and `WORLD_SIZE = nnodes ×
#   nproc_per_node`**; `LOCAL_RANK` picks the node's GPU.
# - **On a cluster, the scheduler's launcher runs `torchrun_node.sh` once on every
#   node**, and the allocation's first node is the meeting point; what changes per site
#   is the header, the `module load` line and the processes per node.
# - **Lightning and Accelerate write the DDP loop for you** and accumulate gradients with
#   `no_sync` underneath, with few changes to your code (not none).
# - **DDP keeps a whole copy of the model on every rank; FSDP and ZeRO shard it**, FSDP2
#   cutting each parameter along dimension 0 and gathering it only while its layer runs.

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

selfcheck.show("09_ecosystem")

# %% tags=["self-check"]
# Your answers, "a", "b", "c" or "d" for each question; then run this cell.
my_answers = {1: None, 2: None, 3: None}
selfcheck.check("09_ecosystem", my_answers)
