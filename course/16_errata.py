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
# # 16 正誤表
#
# 出発点の 2 つの記事 (記事 000: `no_sync` と高速化の方法、記事 004: `data_parallel`、Horovod、
# フレームワーク) の記述とコードを 1 つずつ取り上げ、判定、正しい内容、それを確かめるセルへのリンクを
# 表にまとめます。各行は id (000-1、000-2、…) で指せます。判定は 4 種類です。
#
# - **正しい**: そのとおり (条件は「実際」の欄に)
# - **誤り**: 事実と違う、またはコードが動かない
# - **誤解を招く**: 一部は正しいが、そのままでは間違える
# - **古い**: かつては正しかったが、いまは別の方法を使う
#
# <details><summary>リンクの飛び先</summary>
#
# リンクは見出しのあるセルを指します (`#cell-id=…`)。見出しの名前へのリンク (`#見出し`) では、JupyterLab 4 は
# ノートブックの先頭に留まり、日本語の見出しは見つけられません
# ([jupyterlab#12402](https://github.com/jupyterlab/jupyterlab/issues/12402))。見出しが画面に残るのは、
# このコースの JupyterLab の設定 (`make lab` が使う `jupyterlab-settings/`) のときです。ずれたときは、左の目次から
# 見出しを選んでください。
#
# </details>

# %% [markdown] lang="en"
# # 16 Errata
#
# Every statement and code snippet of the two source articles (doc 000: `no_sync` and
# speed-up tips; doc 004: `data_parallel`, Horovod, frameworks), with a verdict, the
# correction, and a link to the cell that demonstrates it. Each row has an id (000-1,
# 000-2, …). Four verdicts:
#
# - **correct**: right as stated (conditions in the "in fact" column)
# - **wrong**: not true, or the code does not run
# - **misleading**: partly true, but misleading as written
# - **outdated**: was right once; today something else is used
#
# <details><summary>Where the links land</summary>
#
# The links point at the cells that hold the headings (`#cell-id=…`). A link to a
# heading's name (`#Heading`) leaves JupyterLab 4 at the top of the notebook, and a
# Japanese heading is never found
# ([jupyterlab#12402](https://github.com/jupyterlab/jupyterlab/issues/12402)). The
# heading stays on screen with the course's JupyterLab settings (`jupyterlab-settings/`,
# which `make lab` uses); if it is off, pick the heading in the table of contents.
#
# </details>

# %%
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %% [markdown] lang="ja"
# ## 記事 000: no_sync と高速化の方法
#
# | id | 記事の記述 | 判定 | 実際 | 確かめるセル |
# |---|---|---|---|---|
# | 000-1 | 「DistributedDataParallel は複数の GPU で並列処理し、…訓練時間を大幅に短縮できる」 | 誤解を招く | 速さは 1 ステップの計算と勾配のバイト数の比で決まり、2 ランクにしても勾配は半分にならない (セルが数える)。データセットが大きくてもステップが増えるだけ | [03: world size 1 と 2 の 1 ステップの時間](03_ddp.ipynb#cell-id=03-time-per-step-with-world-size-1-and-2) |
# | 000-2 | 「各 GPU はモデルのパラメータの一部を保持し、それらを更新します」 | 誤り | DDP の各ランクは全パラメータの複製を持つ。一部を持つのは FSDP / ZeRO-3 | [03: 各ランクはモデル全体を持つ](03_ddp.ipynb#cell-id=03-every-rank-holds-the-whole-model) |
# | 000-3 | 「各 GPU のパラメータ更新は独立して行われるため整合性が失われる…各パラメータ更新後に勾配同期を行う」 | 誤り | 同期では、逆伝播の途中 (更新の前) に勾配を all-reduce する。そのため全ランクが同じ更新をする | [03: 何が、いつ通信されるか](03_ddp.ipynb#cell-id=03-what-is-communicated-and-when) |
# | 000-4 | 「no_sync() は勾配同期を無効にするオプション」 | 誤解を招く | `with` で使うコンテキストマネージャで、同期を次の `with` の外の逆伝播まで先送りする | [04: 正しい使い方](04_no_sync.ipynb#cell-id=04-correct-use) |
# | 000-5 | 「各 GPU はパラメータ更新後にすぐ次の更新を開始できる」 | 誤り | `no_sync` の中で `step` するとレプリカがずれ、同期を再開しても元に戻らない | [04: 誤用 3: no_sync の中で optimizer.step() する](04_no_sync.ipynb#cell-id=04-misuse-3-optimizer-step-inside-no-sync) |
# | 000-6 | 「メリット: 訓練速度の向上」 | 誤解を招く | 速くなるのは勾配累積で all-reduce が K 回から 1 回に減るときだけ | [04: 1 ステップの時間: K と no_sync](04_no_sync.ipynb#cell-id=04-time-per-step-k-and-no-sync) |
# | 000-7 | 「デメリット: 訓練の不安定化、収束が遅くなる可能性」 | 誤り | 正しく使えば K 倍のバッチと数学的に同じで、更新ごとの曲線は重なる | [04: 収束: 記事の「同期あり vs no_sync」をやり直す](04_no_sync.ipynb#cell-id=04-convergence-the-document-s-sync-vs-no-sync-done-properly) |
# | 000-8 | 「使うべき場合 / 使わないべき場合」(速度優先、安定性重視など) | 誤り | 基準は勾配累積をするかどうか | [04: 1 ステップの時間: K と no_sync](04_no_sync.ipynb#cell-id=04-time-per-step-k-and-no-sync) |
# | 000-9 | 「速度と安定性のトレードオフを調整するオプション」 | 誤り | トレードオフはない。結果は同じで時間だけが変わる | [04: 収束: 記事の「同期あり vs no_sync」をやり直す](04_no_sync.ipynb#cell-id=04-convergence-the-document-s-sync-vs-no-sync-done-properly) |
# | 000-10 | コード `x = x.view(-1)` | 誤り | バッチ全体を 1 本にしてしまう。`x.flatten(1)` を使う | [01: 直し方: サンプルごとに平坦化する](01_models.ipynb#cell-id=01-the-fix-flatten-each-sample) |
# | 000-11 | コード `DistributedDataParallel(model)` (プロセスグループなし) | 誤り | 先に `init_process_group`。なければ ValueError | [01: DDP はプロセスグループなしでは作れない](01_models.ipynb#cell-id=01-ddp-cannot-be-built-without-a-process-group) |
# | 000-12 | コード `ddp_model.no_sync()` (1 行だけ) | 誤り | 何も起きない。`with model.no_sync():` の中で順伝播と逆伝播を行う | [04: 誤用 1: ddp_model.no_sync() と 1 行書く](04_no_sync.ipynb#cell-id=04-misuse-1-writing-ddp-model-no-sync-on-its-own-line) |
# | 000-13 | コード「# 訓練コード」で同期あり/なしを比較 | 誤り | 比較のコードがない。同じ条件で比べると曲線は重なり、no_sync は時間が短い | [04: 収束: 記事の「同期あり vs no_sync」をやり直す](04_no_sync.ipynb#cell-id=04-convergence-the-document-s-sync-vs-no-sync-done-properly) |
# | 000-14 | コード「モデルを 2 つ (4 つ) の GPU に分散」`MyModel().cuda()` | 誤解を招く | `.cuda()` は 1 台の GPU に置くだけ。DDP は 1 GPU に 1 プロセスを起動する | [03: ランクを起動する](03_ddp.ipynb#cell-id=03-start-the-ranks) |
# | 000-15 | コード `for epoch in range(10):` の本体がコメントだけ | 誤り | IndentationError で、2 つ目と 3 つ目の例は実行も始まらない | [16: 記事 000 の本体のない for 文](16_errata.ipynb#cell-id=16-doc-000-s-for-loops-without-a-body) |
# | 000-16 | コード `DistributedDataParallel(model, dim=1)` | 誤解を招く | 1 プロセス 1 デバイスでは DDP は入力を分けないので `dim` は何もしない | [08: 記事の DistributedDataParallel(model, dim=1)](08_training_settings.ipynb#cell-id=08-the-document-s-distributeddataparallel-model-dim-1) |
# | 000-17 | 「データローダーのワーカー数を増やす」 | 正しい | 読み込みが重いときに効く (ワーカー 2 つでエポックの時間の中央値が 0.9 倍未満) | [07: DataLoader のワーカー数](07_speedups.ipynb#cell-id=07-dataloader-workers) |
# | 000-18 | 「バッチサイズを増やす」 | 誤解を招く | 処理速度は上がるが、収束には学習率の調整とウォームアップが要る | [08: 大きなバッチと学習率](08_training_settings.ipynb#cell-id=08-large-batches-and-the-learning-rate) |
# | 000-19 | 「データシャッフルを有効にする」(速度向上として) | 誤り | 速さは変わらない。収束のために必要 | [08: シャッフルは速さではなく収束のため](08_training_settings.ipynb#cell-id=08-shuffling-is-for-convergence-not-speed) |
# | 000-20 | 「ピンメモリーを使用する」 | 正しい | GPU のときだけ。転送が速くなり、`non_blocking=True` なら計算と重なる | [07: pin_memory](07_speedups.ipynb#cell-id=07-pin-memory) |
# | 000-21 | 「軽量なモデル」「精度と速度のバランス」「不要な計算を削減」 | 正しい | パラメータが少ないほど 1 ステップの FLOP が減り、少なすぎると精度が落ちる。評価は `torch.no_grad()` で | [07: 軽いモデル](07_speedups.ipynb#cell-id=07-a-lighter-model) |
# | 000-22 | 「学習率を調整」「オプティマイザーを変更」「スケジューラーを使用」 | 誤解を招く | 1 ステップは速くならない。少ないステップで収束させるためのもの | [08: 学習率、オプティマイザ、スケジューラ](08_training_settings.ipynb#cell-id=08-learning-rate-optimizer-and-scheduler) |
# | 000-23 | 「チェックポイントを活用する」(保存の意味で) | 誤解を招く | 速くはならない。止まっても再開でき、結果は 1 ビットも違わない | [08: チェックポイント: 学習状態を保存して再開する](08_training_settings.ipynb#cell-id=08-checkpoints-save-and-resume-the-training-state) |
# | 000-24 | 「チェックポイントを活用する」(活性化チェックポイントの意味で) | 誤解を招く | 速くする方法ではない。メモリを減らす代わりに、1 ステップで順伝播をもう 1 回計算する (セルが数える) | [07: 活性化チェックポイント](07_speedups.ipynb#cell-id=07-activation-checkpointing) |
# | 000-25 | 「より高速な GPU」「TPU などの専用ハードウェア」 | 誤解を招く | 速い GPU は予算の話で、コードは同じ。TPU には torch_xla とコードの書き換えが要る (`nccl` は CUDA 専用) | [16: TPU には torch_xla が要る](16_errata.ipynb#cell-id=16-a-tpu-needs-torch-xla) |
# | 000-26 | 「Apex」 | 古い | `torch.autocast` と `torch.amp.GradScaler`。`torch.cuda.amp` も非推奨 | [07: 混合精度 (torch.autocast)](07_speedups.ipynb#cell-id=07-mixed-precision-torch-autocast) |
# | 000-27 | 「Horovod」 | 古い | 最新リリースは 2023 年の 0.28.1。PyTorch では torchrun と DDP | [09: Horovod のいま](09_ecosystem.ipynb#cell-id=09-horovod-today) |
# | 000-28 | 「これらの方法は no_sync() と組み合わせることでさらに速くなる」 | 誤解を招く | `no_sync` は勾配累積のときだけの話。ほかの方法とは独立 | [04: 1 ステップの時間: K と no_sync](04_no_sync.ipynb#cell-id=04-time-per-step-k-and-no-sync) |
# | 000-29 | 「効果は訓練データ、モデル、目標によって異なる。さまざまな方法を試す必要がある」 | 正しい | 測って決める | [07: DataLoader のワーカー数](07_speedups.ipynb#cell-id=07-dataloader-workers) |

# %% [markdown] lang="en"
# ## Doc 000: no_sync and speed-up tips
#
# | id | the document says | verdict | in fact | the cell that shows it |
# |---|---|---|---|---|
# | 000-1 | "DDP trains on several GPUs in parallel and can cut the training time … a lot" | misleading | speed depends on a step's computation against its gradient bytes, which two ranks do not halve (both counted); a larger data set only adds steps | [03: Time per step with world size 1 and 2](03_ddp.ipynb#cell-id=03-time-per-step-with-world-size-1-and-2) |
# | 000-2 | "each GPU holds part of the model's parameters and updates them" | wrong | every DDP rank holds a full replica; holding a part is FSDP / ZeRO-3 | [03: Every rank holds the whole model](03_ddp.ipynb#cell-id=03-every-rank-holds-the-whole-model) |
# | 000-3 | "updates happen independently, so consistency may be lost… gradients are synchronized after each update" | wrong | gradients are all-reduced during backward, before the update: every rank makes the same update | [03: What is communicated, and when](03_ddp.ipynb#cell-id=03-what-is-communicated-and-when) |
# | 000-4 | "no_sync() is an option that disables gradient synchronization" | misleading | a context manager that postpones synchronization to the next backward outside the `with` | [04: Correct use](04_no_sync.ipynb#cell-id=04-correct-use) |
# | 000-5 | "each GPU can start the next update right after its update" | wrong | stepping inside `no_sync` makes the replicas drift apart for good | [04: Misuse 3: optimizer.step() inside no_sync](04_no_sync.ipynb#cell-id=04-misuse-3-optimizer-step-inside-no-sync) |
# | 000-6 | "benefit: faster training" | misleading | faster only with gradient accumulation, where K all-reduces become one | [04: Time per step: K and no_sync](04_no_sync.ipynb#cell-id=04-time-per-step-k-and-no-sync) |
# | 000-7 | "drawbacks: unstable training, possibly slower convergence" | wrong | used correctly it equals the K-times batch; loss per update is the same | [04: Convergence: the document's "sync vs no_sync", done properly](04_no_sync.ipynb#cell-id=04-convergence-the-document-s-sync-vs-no-sync-done-properly) |
# | 000-8 | "when to use / not to use it" (speed first, stability first, …) | wrong | the criterion is whether you accumulate gradients | [04: Time per step: K and no_sync](04_no_sync.ipynb#cell-id=04-time-per-step-k-and-no-sync) |
# | 000-9 | "an option that trades speed for stability" | wrong | there is no trade-off: the same result, in less time | [04: Convergence: the document's "sync vs no_sync", done properly](04_no_sync.ipynb#cell-id=04-convergence-the-document-s-sync-vs-no-sync-done-properly) |
# | 000-10 | code `x = x.view(-1)` | wrong | flattens the whole batch; use `x.flatten(1)` | [01: The fix: flatten each sample](01_models.ipynb#cell-id=01-the-fix-flatten-each-sample) |
# | 000-11 | code `DistributedDataParallel(model)` (no process group) | wrong | `init_process_group` first; otherwise ValueError | [01: DDP cannot be built without a process group](01_models.ipynb#cell-id=01-ddp-cannot-be-built-without-a-process-group) |
# | 000-12 | code `ddp_model.no_sync()` (on its own line) | wrong | does nothing; forward and backward inside `with model.no_sync():` | [04: Misuse 1: writing ddp_model.no_sync() on its own line](04_no_sync.ipynb#cell-id=04-misuse-1-writing-ddp-model-no-sync-on-its-own-line) |
# | 000-13 | code "# training code" comparing sync and no_sync | wrong | no code; compared properly the curves coincide and no_sync takes less time | [04: Convergence: the document's "sync vs no_sync", done properly](04_no_sync.ipynb#cell-id=04-convergence-the-document-s-sync-vs-no-sync-done-properly) |
# | 000-14 | code "spread the model over 2 (4) GPUs" `MyModel().cuda()` | misleading | `.cuda()` puts it on one GPU; DDP runs one process per GPU | [03: Start the ranks](03_ddp.ipynb#cell-id=03-start-the-ranks) |
# | 000-15 | code `for epoch in range(10):` whose body is a comment | wrong | an IndentationError: the second and third examples never start | [16: Doc 000's for loops without a body](16_errata.ipynb#cell-id=16-doc-000-s-for-loops-without-a-body) |
# | 000-16 | code `DistributedDataParallel(model, dim=1)` | misleading | with one device per process DDP splits no input, so `dim` does nothing | [08: The document's DistributedDataParallel(model, dim=1)](08_training_settings.ipynb#cell-id=08-the-document-s-distributeddataparallel-model-dim-1) |
# | 000-17 | "more data-loader workers" | correct | helps when loading is slow (two workers: median epoch under 0.9 times) | [07: DataLoader workers](07_speedups.ipynb#cell-id=07-dataloader-workers) |
# | 000-18 | "increase the batch size" | misleading | more samples per second, but convergence needs the learning rate scaled and warm-up | [08: Large batches and the learning rate](08_training_settings.ipynb#cell-id=08-large-batches-and-the-learning-rate) |
# | 000-19 | "enable data shuffling" (as a speed-up) | wrong | no faster; it is needed for convergence | [08: Shuffling is for convergence, not speed](08_training_settings.ipynb#cell-id=08-shuffling-is-for-convergence-not-speed) |
# | 000-20 | "use pinned memory" | correct | on a GPU only: faster copies that, with `non_blocking=True`, overlap computation | [07: pin_memory](07_speedups.ipynb#cell-id=07-pin-memory) |
# | 000-21 | "lighter model", "balance accuracy and speed", "remove unneeded computation" | correct | fewer parameters compute fewer FLOPs per step and, too few, fit worse; evaluate under `torch.no_grad()` | [07: A lighter model](07_speedups.ipynb#cell-id=07-a-lighter-model) |
# | 000-22 | "tune the learning rate", "change the optimizer", "use a scheduler" | misleading | a step is no faster; they converge in fewer steps | [08: Learning rate, optimizer and scheduler](08_training_settings.ipynb#cell-id=08-learning-rate-optimizer-and-scheduler) |
# | 000-23 | "use checkpoints" (saving state) | misleading | no faster; it lets you resume, bit-identically | [08: Checkpoints: save and resume the training state](08_training_settings.ipynb#cell-id=08-checkpoints-save-and-resume-the-training-state) |
# | 000-24 | "use checkpoints" (activation checkpointing) | misleading | not a speed-up: it saves memory by computing the forward once more per step (the cell counts it) | [07: Activation checkpointing](07_speedups.ipynb#cell-id=07-activation-checkpointing) |
# | 000-25 | "a faster GPU", "special hardware such as TPUs" | misleading | a faster GPU is a matter of budget, with the same code; a TPU takes torch_xla and code changes (`nccl` is CUDA only) | [16: A TPU needs torch_xla](16_errata.ipynb#cell-id=16-a-tpu-needs-torch-xla) |
# | 000-26 | "Apex" | outdated | `torch.autocast` and `torch.amp.GradScaler`; `torch.cuda.amp` is deprecated too | [07: Mixed precision (torch.autocast)](07_speedups.ipynb#cell-id=07-mixed-precision-torch-autocast) |
# | 000-27 | "Horovod" | outdated | latest release 0.28.1 (2023); with PyTorch use torchrun and DDP | [09: Horovod today](09_ecosystem.ipynb#cell-id=09-horovod-today) |
# | 000-28 | "combined with no_sync() these methods speed training up further" | misleading | `no_sync` matters only with gradient accumulation, independently of the rest | [04: Time per step: K and no_sync](04_no_sync.ipynb#cell-id=04-time-per-step-k-and-no-sync) |
# | 000-29 | "the effect depends on data, model and goal; try several methods" | correct | measure and decide | [07: DataLoader workers](07_speedups.ipynb#cell-id=07-dataloader-workers) |

# %% [markdown] lang="ja"
# ## 記事 004: data_parallel、Horovod、フレームワーク
#
# | id | 記事の記述 | 判定 | 実際 | 確かめるセル |
# |---|---|---|---|---|
# | 004-1 | 「データ並列処理とは、異なるデータサンプルを複数の GPU に分散させて処理し、訓練と推論を高速化する手法」 | 正しい | 分けるのはデータで、モデルは各デバイスに複製する | [02: 2. replicate: モデルを複製する](02_data_parallel.ipynb#cell-id=02-2-replicate-copy-the-model) |
# | 004-2 | 「data_parallel() はモデルと入力を複数の GPU に分散させ、結果を集約する」 | 正しい | `scatter`、`replicate`、`parallel_apply`、`gather` の 4 段階 | [02: 2. replicate: モデルを複製する](02_data_parallel.ipynb#cell-id=02-2-replicate-copy-the-model) |
# | 004-3 | 「メリット: 訓練と推論の速度を大幅に向上」 | 誤解を招く | 呼び出しのたびにモデルを複製し、レプリカを 1 プロセスのスレッドで動かす。CPU では何もしない | [02: DataParallel が毎ステップ払うもの](02_data_parallel.ipynb#cell-id=02-what-dataparallel-pays-at-every-step) |
# | 004-4 | 「特に、大規模なデータセットや複雑なモデルを扱う場合に有効」 | 誤解を招く | 決めるのは 1 ステップの計算と通信の比。データセットが大きくてもステップが増えるだけ | [03: world size 1 と 2 の 1 ステップの時間](03_ddp.ipynb#cell-id=03-time-per-step-with-world-size-1-and-2) |
# | 004-5 | 「コードの変更を最小限に抑えながら」 | 正しい | 包むだけで使える。ただし推奨は DDP | [02: PyTorch が DDP を勧める理由](02_data_parallel.ipynb#cell-id=02-why-pytorch-recommends-ddp) |
# | 004-6 | 「使い方」: DataParallel で包み、入力を分け、data_parallel に渡す | 誤り | クラスか関数のどちらか一方に、バッチ全体を渡す | [02: 記事 004 の使い方を直す](02_data_parallel.ipynb#cell-id=02-fixing-doc-004-s-recipe) |
# | 004-7 | 最初のコード例: `forward` のない `MyModel` と `torch.randn(100, 1024)` | 誤り | `forward` がないので呼ぶと NotImplementedError | [16: 記事 004 の最初のコード例](16_errata.ipynb#cell-id=16-doc-004-s-first-code-example) |
# | 004-8 | コード `nn.DataParallel(MyModel())` と、入力だけの `.cuda()` (3 つの例) | 誤り | GPU が 2 台以上なら RuntimeError (パラメータが cuda:0 にない)。`nn.DataParallel(MyModel().cuda())` と書く | [16: GPU のあるマシンでの記事 004 の DataParallel](16_errata.ipynb#cell-id=16-doc-004-s-dataparallel-on-a-machine-with-gpus) |
# | 004-9 | コメント「入力データを GPU に分散」と `.cuda()` | 誤解を招く | `.cuda()` はバッチ全体を 1 台の GPU に置くだけ。分けるのは `forward` の中の `scatter` | [16: GPU のあるマシンでの記事 004 の DataParallel](16_errata.ipynb#cell-id=16-doc-004-s-dataparallel-on-a-machine-with-gpus) |
# | 004-10 | 「モデルのすべての層が GPU で実行できる必要」 | 正しい | レプリカは各 GPU で丸ごと動く | [02: 2. replicate: モデルを複製する](02_data_parallel.ipynb#cell-id=02-2-replicate-copy-the-model) |
# | 004-11 | 「モデルのパラメータはすべての GPU に同期されている必要」 | 誤り | 呼び出しのたびに複製し直すので、利用者がそろえる必要はない。必要なのはモデルを `device_ids[0]` に置くこと (004-8) | [02: 記事 004 の使い方を直す](02_data_parallel.ipynb#cell-id=02-fixing-doc-004-s-recipe) |
# | 004-12 | 「データバッチサイズは GPU のメモリ容量に収まる必要」 | 誤解を招く | 各 GPU には分けた一部が載る。出力はデバイス 0 に集まる | [02: 4. gather: 出力を集める](02_data_parallel.ipynb#cell-id=02-4-gather-collect-the-outputs) |
# | 004-13 | 「replicate や scatter_gather は異なる並列処理パターンに対応」 | 誤り | `data_parallel` 自身の部品。`scatter_gather` はモジュール | [02: 記事 004 の使い方を直す](02_data_parallel.ipynb#cell-id=02-fixing-doc-004-s-recipe) |
# | 004-14 | 「PyTorch Lightning などで、さらに簡単に」 | 正しい | 中で DDP と `no_sync` を使う (Lightning を入れたときだけ確かめる) | [09: PyTorch Lightning と Hugging Face Accelerate](09_ecosystem.ipynb#cell-id=09-pytorch-lightning-and-hugging-face-accelerate) |
# | 004-15 | 「data_parallel() は強力なツール」(まとめ) | 古い | 1 台のマシンでも DDP を使う (PyTorch の推奨) | [02: PyTorch が DDP を勧める理由](02_data_parallel.ipynb#cell-id=02-why-pytorch-recommends-ddp) |
# | 004-16 | コード `x.view(-1)` (MLP) | 誤り | バッチ 100 でエラー、バッチ 1 では形が黙って壊れる | [01: バッチが 1 のときは黙って間違える](01_models.ipynb#cell-id=01-with-a-batch-of-one-it-is-silently-wrong) |
# | 004-17 | コード `nn.DataParallel(MyModel())` (GPU なし) | 誤解を招く | CPU では `device_ids` が空で、モデルを 1 回呼ぶだけ | [02: CPU では nn.DataParallel は何もしない](02_data_parallel.ipynb#cell-id=02-on-a-cpu-nn-dataparallel-does-nothing) |
# | 004-18 | コード `.cuda()` | 誤解を招く | GPU がなければ止まる。`device` を選ぶ | [01: 記事 004 の「カスタム損失関数」の例](01_models.ipynb#cell-id=01-doc-004-s-custom-loss-example) |
# | 004-19 | コード `MyLoss` (平均二乗誤差) | 正しい | `nn.MSELoss()` と同じ値 | [01: 記事 004 の「カスタム損失関数」の例](01_models.ipynb#cell-id=01-doc-004-s-custom-loss-example) |
# | 004-20 | コード `optimizer.step()` (`optimizer` が未定義) | 誤り | NameError。オプティマイザを作る | [01: 記事 004 の「カスタム損失関数」の例](01_models.ipynb#cell-id=01-doc-004-s-custom-loss-example) |
# | 004-21 | コード `loss.backward` (括弧なし) | 誤り | 呼ばれず勾配は None。`loss.backward()` | [01: loss.backward と loss.backward() は違う](01_models.ipynb#cell-id=01-loss-backward-is-not-loss-backward) |
# | 004-22 | コード (学習ループ) `zero_grad` なし | 誤り | 勾配がステップごとに積み重なる | [01: zero_grad() を忘れると勾配がたまる](01_models.ipynb#cell-id=01-without-zero-grad-gradients-pile-up) |
# | 004-23 | コード (学習ループ) `optimizer.step()` なし | 誤り | オプティマイザを作っても呼ばないので、パラメータは 1 つも変わらない | [01: 記事 004 の学習ループを書かれたとおりに](01_models.ipynb#cell-id=01-doc-004-s-training-loop-as-written) |
# | 004-24 | コード `MyDataset` (独立な乱数) | 誤解を招く | 学ぶものがない。収束を見るなら学習できる課題で | [01: 記事のデータには学ぶものがない](01_models.ipynb#cell-id=01-the-document-s-data-has-nothing-to-learn) |
# | 004-25 | 「手動で並列処理: 1. モデルを複数の GPU に分割」 | 誤り | データ並列はデータを分けてモデルを複製する。モデルを分けるのはモデル並列 | [09: 手動の並列化](09_ecosystem.ipynb#cell-id=09-parallelism-by-hand) |
# | 004-26 | 「Horovod は MPI を使用して通信」 | 誤解を招く | プロセス間の調整 (コントローラ) は Gloo か MPI のどちらか。GPU のテンソルの all-reduce はふつう NCCL で行う | [09: Horovod のいま](09_ecosystem.ipynb#cell-id=09-horovod-today) |
# | 004-27 | 「Horovod は使いやすく、スケーラブルな分散訓練ソリューション」 | 古い | 2023 年から新しいリリースがなく、新しい PyTorch に対してビルドできないと報告されている | [09: Horovod のいま](09_ecosystem.ipynb#cell-id=09-horovod-today) |
# | 004-28 | 「モデルを Horovod でラップします」 | 誤り | ラップする (包む) のはオプティマイザ (`hvd.DistributedOptimizer`) | [09: Horovod のいま](09_ecosystem.ipynb#cell-id=09-horovod-today) |
# | 004-29 | 「PyTorch Lightning や TensorFlow Lattice などの分散訓練用フレームワーク」 | 誤り | TensorFlow Lattice は形状制約つきの格子モデルのライブラリ | [09: TensorFlow Lattice は分散学習のフレームワークではない](09_ecosystem.ipynb#cell-id=09-tensorflow-lattice-is-not-a-distributed-training-framework) |
# | 004-30 | 「コードを変更することなく、複数の GPU 上で訓練」 | 誤解を招く | 少ない変更で (LightningModule、`accelerator.prepare`) | [09: PyTorch Lightning と Hugging Face Accelerate](09_ecosystem.ipynb#cell-id=09-pytorch-lightning-and-hugging-face-accelerate) |

# %% [markdown] lang="en"
# ## Doc 004: data_parallel, Horovod, frameworks
#
# | id | the document says | verdict | in fact | the cell that shows it |
# |---|---|---|---|---|
# | 004-1 | "data parallelism processes different samples on several GPUs to speed up training and inference" | correct | the data is split, the model is copied to every device | [02: 2. replicate: copy the model](02_data_parallel.ipynb#cell-id=02-2-replicate-copy-the-model) |
# | 004-2 | "data_parallel() spreads model and input over GPUs and gathers the result" | correct | the four steps `scatter`, `replicate`, `parallel_apply`, `gather` | [02: 2. replicate: copy the model](02_data_parallel.ipynb#cell-id=02-2-replicate-copy-the-model) |
# | 004-3 | "benefit: much faster training and inference" | misleading | every call copies the model, and the replicas run as threads of one process; on a CPU it does nothing | [02: What DataParallel pays at every step](02_data_parallel.ipynb#cell-id=02-what-dataparallel-pays-at-every-step) |
# | 004-4 | "especially effective for large data sets and complex models" | misleading | a step's computation against its communication decides; a larger data set only adds steps | [03: Time per step with world size 1 and 2](03_ddp.ipynb#cell-id=03-time-per-step-with-world-size-1-and-2) |
# | 004-5 | "with minimal code changes" | correct | just wrap the model; but PyTorch recommends DDP | [02: Why PyTorch recommends DDP](02_data_parallel.ipynb#cell-id=02-why-pytorch-recommends-ddp) |
# | 004-6 | "how to use": wrap in DataParallel, split the input, pass to data_parallel | wrong | use the class or the function, with the whole batch | [02: Fixing doc 004's recipe](02_data_parallel.ipynb#cell-id=02-fixing-doc-004-s-recipe) |
# | 004-7 | first code example: `MyModel` without `forward`, `torch.randn(100, 1024)` | wrong | no `forward`, so calling it raises NotImplementedError | [16: Doc 004's first code example](16_errata.ipynb#cell-id=16-doc-004-s-first-code-example) |
# | 004-8 | code `nn.DataParallel(MyModel())` with only the input `.cuda()` (three examples) | wrong | with two or more GPUs, RuntimeError (the parameters are not on cuda:0); write `nn.DataParallel(MyModel().cuda())` | [16: Doc 004's DataParallel on a machine with GPUs](16_errata.ipynb#cell-id=16-doc-004-s-dataparallel-on-a-machine-with-gpus) |
# | 004-9 | the comment "spread the input over the GPUs" on `.cuda()` | misleading | `.cuda()` puts the whole batch on one GPU; `scatter`, inside `forward`, splits it | [16: Doc 004's DataParallel on a machine with GPUs](16_errata.ipynb#cell-id=16-doc-004-s-dataparallel-on-a-machine-with-gpus) |
# | 004-10 | "every layer must run on the GPU" | correct | each replica runs whole on its GPU | [02: 2. replicate: copy the model](02_data_parallel.ipynb#cell-id=02-2-replicate-copy-the-model) |
# | 004-11 | "parameters must be synchronized on all GPUs" | wrong | replicas are rebuilt at every call; what is needed is the model on `device_ids[0]` (004-8) | [02: Fixing doc 004's recipe](02_data_parallel.ipynb#cell-id=02-fixing-doc-004-s-recipe) |
# | 004-12 | "the batch must fit in GPU memory" | misleading | each GPU holds its chunk; outputs are gathered on device 0 | [02: 4. gather: collect the outputs](02_data_parallel.ipynb#cell-id=02-4-gather-collect-the-outputs) |
# | 004-13 | "replicate and scatter_gather serve different patterns" | wrong | they are the parts of `data_parallel`; `scatter_gather` is a module | [02: Fixing doc 004's recipe](02_data_parallel.ipynb#cell-id=02-fixing-doc-004-s-recipe) |
# | 004-14 | "PyTorch Lightning makes it even easier" | correct | it uses DDP and `no_sync` underneath (checked only where Lightning is installed) | [09: PyTorch Lightning and Hugging Face Accelerate](09_ecosystem.ipynb#cell-id=09-pytorch-lightning-and-hugging-face-accelerate) |
# | 004-15 | "data_parallel() is a powerful tool" (summary) | outdated | use DDP, even on one machine (PyTorch's advice) | [02: Why PyTorch recommends DDP](02_data_parallel.ipynb#cell-id=02-why-pytorch-recommends-ddp) |
# | 004-16 | code `x.view(-1)` (MLP) | wrong | fails with a batch of 100, silently wrong with a batch of 1 | [01: With a batch of one it is silently wrong](01_models.ipynb#cell-id=01-with-a-batch-of-one-it-is-silently-wrong) |
# | 004-17 | code `nn.DataParallel(MyModel())` (no GPU) | misleading | on a CPU `device_ids` is empty: one plain call | [02: On a CPU, nn.DataParallel does nothing](02_data_parallel.ipynb#cell-id=02-on-a-cpu-nn-dataparallel-does-nothing) |
# | 004-18 | code `.cuda()` | misleading | stops without a GPU; choose a `device` | [01: Doc 004's "custom loss" example](01_models.ipynb#cell-id=01-doc-004-s-custom-loss-example) |
# | 004-19 | code `MyLoss` (mean squared error) | correct | the same value as `nn.MSELoss()` | [01: Doc 004's "custom loss" example](01_models.ipynb#cell-id=01-doc-004-s-custom-loss-example) |
# | 004-20 | code `optimizer.step()` (`optimizer` undefined) | wrong | NameError; create the optimizer | [01: Doc 004's "custom loss" example](01_models.ipynb#cell-id=01-doc-004-s-custom-loss-example) |
# | 004-21 | code `loss.backward` (no parentheses) | wrong | never called, gradients stay None; `loss.backward()` | [01: loss.backward is not loss.backward()](01_models.ipynb#cell-id=01-loss-backward-is-not-loss-backward) |
# | 004-22 | code (training loop) without `zero_grad` | wrong | gradients pile up step after step | [01: Without zero_grad() gradients pile up](01_models.ipynb#cell-id=01-without-zero-grad-gradients-pile-up) |
# | 004-23 | code (training loop) without `optimizer.step()` | wrong | the optimizer is created but never called: not one parameter changes | [01: Doc 004's training loop, as written](01_models.ipynb#cell-id=01-doc-004-s-training-loop-as-written) |
# | 004-24 | code `MyDataset` (independent random numbers) | misleading | nothing to learn; watch convergence on a learnable task | [01: The document's data has nothing to learn](01_models.ipynb#cell-id=01-the-document-s-data-has-nothing-to-learn) |
# | 004-25 | "by hand: 1. split the model across GPUs" | wrong | data parallelism splits data and copies the model; splitting the model is model parallelism | [09: Parallelism by hand](09_ecosystem.ipynb#cell-id=09-parallelism-by-hand) |
# | 004-26 | "Horovod communicates with MPI" | misleading | Gloo or MPI coordinates the processes (the controller); tensors on GPUs are usually all-reduced with NCCL | [09: Horovod today](09_ecosystem.ipynb#cell-id=09-horovod-today) |
# | 004-27 | "Horovod is an easy-to-use, scalable distributed-training solution" | outdated | no release since 2023, reported not to build against recent PyTorch | [09: Horovod today](09_ecosystem.ipynb#cell-id=09-horovod-today) |
# | 004-28 | "wrap the model with Horovod" | wrong | you wrap the optimizer (`hvd.DistributedOptimizer`) | [09: Horovod today](09_ecosystem.ipynb#cell-id=09-horovod-today) |
# | 004-29 | "distributed-training frameworks such as PyTorch Lightning and TensorFlow Lattice" | wrong | TensorFlow Lattice is a library of shape-constrained lattice models | [09: TensorFlow Lattice is not a distributed-training framework](09_ecosystem.ipynb#cell-id=09-tensorflow-lattice-is-not-a-distributed-training-framework) |
# | 004-30 | "train on several GPUs without changing the code" | misleading | with few changes (a LightningModule, `accelerator.prepare`) | [09: PyTorch Lightning and Hugging Face Accelerate](09_ecosystem.ipynb#cell-id=09-pytorch-lightning-and-hugging-face-accelerate) |

# %% [markdown] lang="ja"
# ## 各レッスンの主張
#
# | id | レッスンの主張 | 確かめるセル |
# |---|---|---|
# | L03-1 | DDP の各ランクはモデル全体 (全パラメータ) を持つ | [03: 各ランクはモデル全体を持つ](03_ddp.ipynb#cell-id=03-every-rank-holds-the-whole-model) |
# | L03-2 | `DistributedSampler` はランクごとに重ならないサンプルを配り、`set_epoch` がなければ毎エポック同じ順序になる | [03: DistributedSampler と set_epoch](03_ddp.ipynb#cell-id=03-distributedsampler-and-set-epoch) |
# | L03-3 | DDP の勾配は、全ランクのバッチを合わせた 1 つのバッチの勾配と等しい | [03: DDP の勾配 = 全バッチの勾配](03_ddp.ipynb#cell-id=03-ddp-s-gradient-the-whole-batch-s-gradient) |
# | L03-4 | 勾配は逆伝播の途中で all-reduce され、1 ステップで送るのはパラメータと同じバイト数 | [03: 何が、いつ通信されるか](03_ddp.ipynb#cell-id=03-what-is-communicated-and-when) |
# | L03-5 | 学習を続けてもレプリカは同一のまま | [03: 学習してもレプリカは一致したまま](03_ddp.ipynb#cell-id=03-replicas-stay-identical-through-training) |
# | L03-6 | 2 ランクが 1 ランクより速いか遅いかは、計算と通信の比で決まる | [03: world size 1 と 2 の 1 ステップの時間](03_ddp.ipynb#cell-id=03-time-per-step-with-world-size-1-and-2) |
# | L04-1 | `with model.no_sync():` で K 回の逆伝播を累積すると、all-reduce は 1 更新に 1 回 | [04: 大きなバッチと同じ勾配になる](04_no_sync.ipynb#cell-id=04-the-same-gradient-as-the-large-batch) |
# | L04-2 | 損失を K で割って累積した勾配は、K 倍のバッチの勾配と等しい | [04: 大きなバッチと同じ勾配になる](04_no_sync.ipynb#cell-id=04-the-same-gradient-as-the-large-batch) |
# | L04-3 | 損失を K で割らないと、勾配は K 倍になる | [04: 損失を K で割らないと](04_no_sync.ipynb#cell-id=04-without-dividing-the-loss-by-k) |
# | L04-4 | `ddp_model.no_sync()` を 1 行で呼んでも何も変わらず、毎回 all-reduce する | [04: 誤用 1: ddp_model.no_sync() と 1 行書く](04_no_sync.ipynb#cell-id=04-misuse-1-writing-ddp-model-no-sync-on-its-own-line) |
# | L04-5 | 順伝播を `with` の外で行うと、毎回 all-reduce する | [04: 誤用 2: 順伝播を with の外で行う](04_no_sync.ipynb#cell-id=04-misuse-2-the-forward-pass-outside-the-block) |
# | L04-6 | `no_sync` の中で `step` するとレプリカがずれ、戻らない | [04: 誤用 3: no_sync の中で optimizer.step() する](04_no_sync.ipynb#cell-id=04-misuse-3-optimizer-step-inside-no-sync) |
# | L04-7 | 勾配累積では `no_sync` を使うと 1 更新の時間が短くなる | [04: 1 ステップの時間: K と no_sync](04_no_sync.ipynb#cell-id=04-time-per-step-k-and-no-sync) |
# | L04-8 | 正しく使えば、更新ごとの損失は同期ありと重なる | [04: 収束: 記事の「同期あり vs no_sync」をやり直す](04_no_sync.ipynb#cell-id=04-convergence-the-document-s-sync-vs-no-sync-done-properly) |
# | L05-1 | all-reduce の時間は 2(n−1) × α + 各ランクが送る 2(n−1)/n × S バイト ÷ 帯域で表せる (モデル) | [05: all-reduce を測る](05_communication.ipynb#cell-id=05-timing-all-reduce) |
# | L05-2 | DDP は勾配をバケットにまとめ、バケットごとに 1 回 all-reduce する。`DDP(model)` は最初のステップのあとでバケットを作り直す | [05: `DDP(model)` が実際に送るもの](05_communication.ipynb#cell-id=05-what-ddp-model-really-sends) |
# | L05-3 | 通信の一部は勾配の計算と重なる (隠れる) | [05: 勾配の計算と通信の重なり](05_communication.ipynb#cell-id=05-communication-overlaps-the-gradient-computation) |
# | L05-4 | 1 更新の時間は計算と通信のモデルで予測でき、合わせるのに使っていない K でも当たる | [05: 1 回の更新の時間を予測する](05_communication.ipynb#cell-id=05-predicting-the-time-of-an-update) |
# | L06-1 | 自分で書いた DDP (フック、逆順のバケット、非同期の all-reduce) の勾配は torch の DDP と等しく、最初のステップのあとは all-reduce の回数とバイト数も同じ | [06: torch の DDP と比べる](06_beyond_no_sync.ipynb#cell-id=06-compared-with-torch-s-ddp) |
# | L06-2 | フックから始めた all-reduce は、逆伝播が次の勾配を計算するあいだに進む | [06: 通信は計算と重なっているか](06_beyond_no_sync.ipynb#cell-id=06-does-communication-overlap-the-computation) |
# | L06-3 | `fp16_compress_hook` は送るバイト数をちょうど半分にする。PowerSGD は行列を P と Q で送り (ベクトルはそのまま)、落ちた分は誤差のフィードバックであとで届く。bf16 のフックは torch のビルドしだい | [06: 圧縮フック: fp16 と PowerSGD](06_beyond_no_sync.ipynb#cell-id=06-compression-hooks-fp16-and-powersgd) |
# | L06-4 | `ZeroRedundancyOptimizer` は Adam の状態をランクで分割し、学習は 1 ビットも変わらない。集団通信のバイト数は 2 倍、2 ランクでソケットに書くのは 1.5 倍 | [13: ZeroRedundancyOptimizer: オプティマイザの状態を分割して持つ (シャード)](13_fsdp2.ipynb#cell-id=13-zeroredundancyoptimizer-sharing-out-the-optimizer-state) |
# | L06-5 | `gradient_as_bucket_view=True` は勾配のコピー 1 つ分のメモリを減らす。`static_graph=True` はこのモデルでは何も変えない | [06: DDP のオプション](06_beyond_no_sync.ipynb#cell-id=06-ddp-s-options) |
# | L06-6 | `bucket_cap_mb` を渡すと最初のバケットも同じ上限になる (既定では最初のバケットだけ 1 MB)。このモデルでは 0.25〜4 MB のどの上限でもバケット 3 つ | [06: バケットの大きさ: bucket_cap_mb](06_beyond_no_sync.ipynb#cell-id=06-bucket-size-bucket-cap-mb) |
# | L06-7 | ループバックでは、PowerSGD は送るバイト数を大きく減らしても 1 ステップが DDP の 2 倍速くもならず、モデルの予測より遅い | [06: 並べて比べ、モデルで予測する](06_beyond_no_sync.ipynb#cell-id=06-side-by-side-and-predicted-by-the-model) |
# | L10-1 | 一部のランクだけが集団通信を呼ぶと、呼んだランクは来ない相手を待ち、時間切れになる | [10: 一部のランクだけが呼ぶ集団通信](10_troubleshooting.ipynb#cell-id=10-a-collective-that-only-some-ranks-call) |
# | L10-2 | `dist.monitored_barrier` は来なかったランクを特定して示す | [10: どのランクが来ていないかを知る](10_troubleshooting.ipynb#cell-id=10-which-rank-is-missing) |
# | L10-3 | gloo はランク間の集団通信の食い違いを確かめない: 種類が違えば時間切れ、演算が違えば黙って間違った値 | [10: ランクごとに食い違う集団通信](10_troubleshooting.ipynb#cell-id=10-collectives-that-differ-between-ranks) |
# | L10-4 | `TORCH_DISTRIBUTED_DEBUG=DETAIL` は形や種類の食い違いを検出し、両方の呼び出しを示してエラーで止める。演算の食い違いは見ない | [10: TORCH_DISTRIBUTED_DEBUG=DETAIL](10_troubleshooting.ipynb#cell-id=10-torch-distributed-debug-detail) |
# | L10-5 | 順伝播で使われないパラメータがあると、1 回目の勾配は平均されず、2 回目の順伝播でエラーになる | [10: 順伝播で使われないパラメータ](10_troubleshooting.ipynb#cell-id=10-parameters-the-forward-pass-does-not-use) |
# | L10-6 | `find_unused_parameters=True` では勾配が全体のバッチの勾配と一致する (使われないパラメータは 0 として送る)。`static_graph=True` はグラフが変わるとエラー | [10: 直し方: find_unused_parameters=True と static_graph=True](10_troubleshooting.ipynb#cell-id=10-fixes-find-unused-parameters-true-and-static-graph-true) |
# | L10-7 | ランクごとにバッチの数が違うと、エポックの終わりで止まる | [11: ランクごとに数の違う入力](11_uneven_and_restarts.ipynb#cell-id=11-ranks-with-different-numbers-of-batches) |
# | L10-8 | `Join` の中では、抜けたランクが 0 の勾配で加わり、勾配は world size で割られる。`no_sync` も使える | [11: Join が計算するもの](11_uneven_and_restarts.ipynb#cell-id=11-what-join-computes) |
# | L10-9 | `DistributedSampler` は先頭のサンプルを繰り返して水増しし、ランクの平均の平均は正しい値からずれる | [11: DistributedSampler の水増し](11_uneven_and_restarts.ipynb#cell-id=11-distributedsampler-s-padding) |
# | L10-10 | DDP の `model.state_dict()` のキーには `module.` が付き、包んでいないモデルに読み込めない。ランク 0 が保存し終える前に読むと、前のチェックポイントを黙って読む | [11: DDP でのチェックポイント](11_uneven_and_restarts.ipynb#cell-id=11-checkpoints-under-ddp) |
# | L10-11 | torchrun の `--max-restarts` で起動し直してチェックポイントから続けた学習は、止まらなかった学習と 1 ビットも違わない | [11: 学習の途中で死ぬランク](11_uneven_and_restarts.ipynb#cell-id=11-a-rank-that-dies-mid-step) |
# | L11-1 | fp32 の Adam はパラメータ 1 つにつき 8 バイトの状態と、テンソル 1 つにつき 4 バイトの `step` を持つ。1 ランクあたり DDP は 16Ψ、ZeRO-1 は 8Ψ + 8Ψ/N、ZeRO-2 は 4Ψ + 12Ψ/N、ZeRO-3 は 16Ψ/N バイト | [12: メモリは何に使われるか](12_zero_by_hand.ipynb#cell-id=12-where-the-memory-goes) |
# | L11-2 | 手で書いた ZeRO-1 (reduce-scatter、シャードの更新、all-gather) は 2 ランクの DDP と 1 ビットも違わず、1 プロセスと 1e-6 以内。Adam の状態は自分のシャードの分だけ | [12: ZeRO ステージ 1 を手で書く](12_zero_by_hand.ipynb#cell-id=12-zero-stage-1-by-hand) |
# | L11-3 | 手で書いた ZeRO-2 も同じく正確で、Adam が動くときに持つ勾配は自分のシャードだけ | [12: ZeRO ステージ 2 を手で書く](12_zero_by_hand.ipynb#cell-id=12-zero-stage-2-by-hand) |
# | L11-4 | 手で書いた ZeRO-3 (層ごとに、順伝播と逆伝播の前に集め、使い終わったら解放する) も DDP と 1 ビットも違わない。Adam が動くとき各ランクが持つのは自分のシャードと凍結した層だけ | [12: 演習: ZeRO-3 で、集めたパラメータを層ごとに解放する](12_zero_by_hand.ipynb#cell-id=12-exercise-a-zero-3-layer-frees-after-backward) |
# | L11-5 | 測った各ステージのメモリは、式の値にパディングと `step` を足した値で、DDP から ZeRO-3 へ順に減る | [12: 各ステージが持つメモリ](12_zero_by_hand.ipynb#cell-id=12-memory-each-stage-holds) |
# | L11-6 | リング (NCCL) では、ZeRO-1 と ZeRO-2 が 1 ステップに送るバイト数は DDP と同じで、ZeRO-3 は 1.5 倍 | [12: 1 ステップで送るバイト数](12_zero_by_hand.ipynb#cell-id=12-bytes-sent-per-step) |
# | L11-7 | gloo の reduce-scatter は中で all-reduce を実行する。gloo の 2 ランクでソケットに書くバイト数は DDP の、ZeRO-1 と ZeRO-2 で 1.5 倍、ZeRO-3 で 2 倍 | [12: 1 ステップで送るバイト数](12_zero_by_hand.ipynb#cell-id=12-bytes-sent-per-step) |
# | L11-8 | FSDP2 (`fully_shard`) の 5 ステップは 1 プロセスと 1e-6 以内で、手で書いた ZeRO-3 と 1 ビットも違わない。重みを共有する 2 つのモジュールを別のユニットにすると ValueError | [13: FSDP2: fully_shard](13_fsdp2.ipynb#cell-id=13-fsdp2-fully-shard) |
# | L11-9 | `reshard_after_forward=True` は順伝播と逆伝播の間はシャードだけを持ち、逆伝播で集め直す。False は集めたパラメータを持ち続ける | [13: FSDP2: fully_shard](13_fsdp2.ipynb#cell-id=13-fsdp2-fully-shard) |
# | L11-10 | `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)` は CPU の gloo で動き、all-gather のバイト数はちょうど半分、reduce-scatter は float32 のまま | [13: FSDP2: fully_shard](13_fsdp2.ipynb#cell-id=13-fsdp2-fully-shard) |
# | L11-11 | 2 ランクで保存した `torch.distributed.checkpoint` は、プロセスグループのない 1 プロセスに読み込め (再シャーディング)、ランクの全体の state dict と等しい | [13: FSDP2: fully_shard](13_fsdp2.ipynb#cell-id=13-fsdp2-fully-shard) |
# | L11-12 | 130 億パラメータを 1 ランク 80 GB で学習すると、DDP と ZeRO-1 はいくつランクがあっても収まらず、ZeRO-3 は 3 ランクから、ZeRO-2 は 6 ランクから収まる | [13: いつシャードするか](13_fsdp2.ipynb#cell-id=13-when-to-shard) |
# | L12-1 | `slow_link.SlowLink(α, β)` が有効なあいだ、all-reduce は実際の通信の α + バイト数 / β あとに完了し、続けて 2 回送ると遅延の 2 倍以上かかる | [14: 遅いリンク](14_slow_link.ipynb#cell-id=14-a-slow-link-you-can-dial) |
# | L12-2 | fp16 がリンクに渡すのは DDP の半分、PowerSGD r=1 はバイアスと P、Q で、リンクの遅延は呼び出し回数 × α + バイト数 / β。100 MB/s ではどちらも DDP の 0.8 倍未満の時間 | [14: fp16 と PowerSGD は、帯域がどこまで下がると得になるか](14_slow_link.ipynb#cell-id=14-when-fp16-and-powersgd-pay) |
# | L12-3 | fp16 は β* = (S_DDP − S_fp16) / (t_fp16 − t_DDP) より遅いリンクで DDP より速く、式は 2 つの曲線の交点と 0.1% 以内で一致する | [14: 演習: fp16 の分かれ目を予測する](14_slow_link.ipynb#cell-id=14-exercise-predict-fp16-s-crossover) |
# | L12-4 | モーメンタムのない SGD で H = 1 のローカル SGD は DDP と 1e-6 以内で等しい。平均のあいだにレプリカは離れ、平均の直後は一致する | [15: ローカル SGD](15_communicate_less.ipynb#cell-id=15-local-sgd) |
# | L12-5 | H ステップごとの平均 (1 回がパラメータ全体の all-reduce 1 回) で、送るバイト数は 1/H。この課題では 64 ステップ後の H = 16 の損失は H = 1 と 1% 以内 | [15: ステップ数と送ったバイト数で見た損失](15_communicate_less.ipynb#cell-id=15-loss-against-steps-and-against-bytes-sent) |
# | L12-6 | CPU では、`post_localSGD_hook` の既定の `subgroup=None` はウォームアップのあと ValueError (`post_local_gradient_allreduce=False` か大きさ 1 のサブグループを渡す)。`PeriodicModelAverager` が手で書いたループと一致するのは `warmup_steps` が W + H − 1 のときで、ドキュメントの W ではない | [15: torch の PostLocalSGDOptimizer](15_communicate_less.ipynb#cell-id=15-torch-s-postlocalsgdoptimizer) |
# | L12-7 | 外側の学習率 1、モーメンタムなしの DiLoCo はローカル SGD と 1e-6 以内で等しい。外側のステップはネステロフのモーメンタム (式と 1e-6 以内で一致) | [15: DiLoCo](15_communicate_less.ipynb#cell-id=15-diloco) |
# | L12-8 | 同じバイト数 (H = 16) では、ローカル SGD の損失は DDP の 0.2 倍未満、DiLoCo はローカル SGD の 0.95 倍未満 | [15: 同じバイト数で比べる](15_communicate_less.ipynb#cell-id=15-at-equal-bytes-sent) |
# | L12-9 | DDP の通信フックで記録した勾配から、ノイズスケール B_simple = tr(Σ) / \|G\|² を正確な値と 25% 以内で推定できる | [15: バッチはどこまで大きくできるか](15_communicate_less.ipynb#cell-id=15-how-large-a-batch-can-grow) |
# | L12-10 | B_simple よりずっと小さいバッチ (B = 2 → 8) では、4 倍のバッチで目標の損失までのステップ数が 2.5 分の 1 以下、ずっと大きいバッチ (B = 64 → 256) では 1.5 分の 1 まで | [15: 臨界バッチサイズ: ステップ数はどこで減らなくなるか](15_communicate_less.ipynb#cell-id=15-the-critical-batch-size-where-the-steps-stop-falling) |
# | L12-11 | サンプル数が不揃いだと、DDP の平均はランクごとの平均の平均で、全サンプルの平均の勾配ではない。サンプル数で重み付けすると (`no_sync.accumulate_by_count`) 一致する | [15: 不揃いなバッチの平均](15_communicate_less.ipynb#cell-id=15-averages-over-unequal-batches) |

# %% [markdown] lang="en"
# ## The lessons' own claims
#
# | id | the lesson says | the cell that shows it |
# |---|---|---|
# | L03-1 | every DDP rank holds the whole model (all the parameters) | [03: Every rank holds the whole model](03_ddp.ipynb#cell-id=03-every-rank-holds-the-whole-model) |
# | L03-2 | `DistributedSampler` gives the ranks disjoint samples, and without `set_epoch` every epoch has the same order | [03: DistributedSampler and set_epoch](03_ddp.ipynb#cell-id=03-distributedsampler-and-set-epoch) |
# | L03-3 | DDP's gradient equals the gradient of one batch made of all the ranks' batches | [03: DDP's gradient = the whole batch's gradient](03_ddp.ipynb#cell-id=03-ddp-s-gradient-the-whole-batch-s-gradient) |
# | L03-4 | gradients are all-reduced during backward; a step sends as many bytes as the parameters | [03: What is communicated, and when](03_ddp.ipynb#cell-id=03-what-is-communicated-and-when) |
# | L03-5 | the replicas stay identical through training | [03: Replicas stay identical through training](03_ddp.ipynb#cell-id=03-replicas-stay-identical-through-training) |
# | L03-6 | whether two ranks are faster or slower than one depends on computation against communication | [03: Time per step with world size 1 and 2](03_ddp.ipynb#cell-id=03-time-per-step-with-world-size-1-and-2) |
# | L04-1 | accumulating K backward passes with `with model.no_sync():` makes one all-reduce per update | [04: The same gradient as the large batch](04_no_sync.ipynb#cell-id=04-the-same-gradient-as-the-large-batch) |
# | L04-2 | with the loss divided by K, the accumulated gradient equals the K-times batch's | [04: The same gradient as the large batch](04_no_sync.ipynb#cell-id=04-the-same-gradient-as-the-large-batch) |
# | L04-3 | without dividing the loss by K, the gradient is K times too large | [04: Without dividing the loss by K](04_no_sync.ipynb#cell-id=04-without-dividing-the-loss-by-k) |
# | L04-4 | `ddp_model.no_sync()` on its own line changes nothing: every backward all-reduces | [04: Misuse 1: writing ddp_model.no_sync() on its own line](04_no_sync.ipynb#cell-id=04-misuse-1-writing-ddp-model-no-sync-on-its-own-line) |
# | L04-5 | with the forward pass outside the `with`, every backward all-reduces | [04: Misuse 2: the forward pass outside the block](04_no_sync.ipynb#cell-id=04-misuse-2-the-forward-pass-outside-the-block) |
# | L04-6 | stepping inside `no_sync` makes the replicas drift apart for good | [04: Misuse 3: optimizer.step() inside no_sync](04_no_sync.ipynb#cell-id=04-misuse-3-optimizer-step-inside-no-sync) |
# | L04-7 | with gradient accumulation, `no_sync` makes an update take less time | [04: Time per step: K and no_sync](04_no_sync.ipynb#cell-id=04-time-per-step-k-and-no-sync) |
# | L04-8 | used correctly, the loss per update coincides with synchronizing every step | [04: Convergence: the document's "sync vs no_sync", done properly](04_no_sync.ipynb#cell-id=04-convergence-the-document-s-sync-vs-no-sync-done-properly) |
# | L05-1 | an all-reduce takes 2(n−1) × α plus the 2(n−1)/n × S bytes each rank sends over the bandwidth (a model) | [05: Timing all-reduce](05_communication.ipynb#cell-id=05-timing-all-reduce) |
# | L05-2 | DDP packs gradients into buckets and all-reduces once per bucket; `DDP(model)` rebuilds its buckets after the first step | [05: What `DDP(model)` really sends](05_communication.ipynb#cell-id=05-what-ddp-model-really-sends) |
# | L05-3 | part of the communication overlaps the gradient computation (is hidden) | [05: Communication overlaps the gradient computation](05_communication.ipynb#cell-id=05-communication-overlaps-the-gradient-computation) |
# | L05-4 | a model of computation and communication predicts an update's time, also for a K it was not fitted on | [05: Predicting the time of an update](05_communication.ipynb#cell-id=05-predicting-the-time-of-an-update) |
# | L06-1 | a DDP written by hand (hooks, reversed buckets, asynchronous all-reduces) gives torch DDP's gradients, and after its first step as many all-reduces and bytes | [06: Compared with torch's DDP](06_beyond_no_sync.ipynb#cell-id=06-compared-with-torch-s-ddp) |
# | L06-2 | all-reduces started from the hook run while the backward pass computes further gradients | [06: Does communication overlap the computation?](06_beyond_no_sync.ipynb#cell-id=06-does-communication-overlap-the-computation) |
# | L06-3 | `fp16_compress_hook` sends exactly half the bytes; PowerSGD sends matrices as P and Q (vectors as they are), and error feedback delivers what it drops later; the bf16 hook depends on torch's build | [06: Compression hooks: fp16 and PowerSGD](06_beyond_no_sync.ipynb#cell-id=06-compression-hooks-fp16-and-powersgd) |
# | L06-4 | `ZeroRedundancyOptimizer` shards Adam's state over the ranks and trains bit for bit the same; collectives carry twice the bytes, the sockets 1.5 times on 2 ranks | [13: ZeroRedundancyOptimizer: sharing out the optimizer state](13_fsdp2.ipynb#cell-id=13-zeroredundancyoptimizer-sharing-out-the-optimizer-state) |
# | L06-5 | `gradient_as_bucket_view=True` saves the memory of one copy of the gradients; `static_graph=True` changes nothing on this model | [06: DDP's options](06_beyond_no_sync.ipynb#cell-id=06-ddp-s-options) |
# | L06-6 | passing `bucket_cap_mb` caps the first bucket too (by default it gets 1 MB); on this model every cap from 0.25 to 4 MB gives 3 buckets | [06: Bucket size: bucket_cap_mb](06_beyond_no_sync.ipynb#cell-id=06-bucket-size-bucket-cap-mb) |
# | L06-7 | on loopback, PowerSGD sends far fewer bytes, yet a step is not even twice as fast as DDP's, and is slower than the model predicts | [06: Side by side, and predicted by the model](06_beyond_no_sync.ipynb#cell-id=06-side-by-side-and-predicted-by-the-model) |
# | L10-1 | when only some ranks call a collective, those that do wait for the others and time out | [10: A collective that only some ranks call](10_troubleshooting.ipynb#cell-id=10-a-collective-that-only-some-ranks-call) |
# | L10-2 | `dist.monitored_barrier` names the ranks that did not arrive | [10: Which rank is missing](10_troubleshooting.ipynb#cell-id=10-which-rank-is-missing) |
# | L10-3 | gloo does not check that ranks call the same collective: different types time out, different reduce ops silently give a wrong result | [10: Collectives that differ between ranks](10_troubleshooting.ipynb#cell-id=10-collectives-that-differ-between-ranks) |
# | L10-4 | `TORCH_DISTRIBUTED_DEBUG=DETAIL` stops a mismatch of shape or type naming both calls; it does not see the reduce op | [10: TORCH_DISTRIBUTED_DEBUG=DETAIL](10_troubleshooting.ipynb#cell-id=10-torch-distributed-debug-detail) |
# | L10-5 | with a parameter the forward pass does not use, the first step's gradients are not averaged and the second forward raises | [10: Parameters the forward pass does not use](10_troubleshooting.ipynb#cell-id=10-parameters-the-forward-pass-does-not-use) |
# | L10-6 | with `find_unused_parameters=True` the gradients equal the whole batch's (unused parameters sent as zeros); `static_graph=True` raises when the graph changes | [10: Fixes: find_unused_parameters=True and static_graph=True](10_troubleshooting.ipynb#cell-id=10-fixes-find-unused-parameters-true-and-static-graph-true) |
# | L10-7 | ranks with different numbers of batches hang at the end of the epoch | [11: Ranks with different numbers of batches](11_uneven_and_restarts.ipynb#cell-id=11-ranks-with-different-numbers-of-batches) |
# | L10-8 | inside `Join` a rank out of batches adds zero gradients and the sum is divided by the world size; `no_sync` works there too | [11: What Join computes](11_uneven_and_restarts.ipynb#cell-id=11-what-join-computes) |
# | L10-9 | `DistributedSampler` pads by repeating the first samples, and the mean of the ranks' means is off | [11: DistributedSampler's padding](11_uneven_and_restarts.ipynb#cell-id=11-distributedsampler-s-padding) |
# | L10-10 | DDP's `model.state_dict()` keys start with `module.` and do not load into a plain model; reading before rank 0 has saved silently loads the previous checkpoint | [11: Checkpoints under DDP](11_uneven_and_restarts.ipynb#cell-id=11-checkpoints-under-ddp) |
# | L10-11 | a run restarted by torchrun's `--max-restarts` that goes on from its checkpoint ends with bit-identical weights | [11: A rank that dies mid-step](11_uneven_and_restarts.ipynb#cell-id=11-a-rank-that-dies-mid-step) |
# | L11-1 | fp32 Adam keeps 8 bytes of state per parameter and a 4-byte `step` per tensor; per rank DDP holds 16Ψ bytes, ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N, ZeRO-3 16Ψ/N | [12: Where the memory goes](12_zero_by_hand.ipynb#cell-id=12-where-the-memory-goes) |
# | L11-2 | ZeRO-1 by hand (reduce-scatter, update the shard, all-gather) equals 2-rank DDP bit for bit and one process within 1e-6; each rank's Adam state covers its shard only | [12: ZeRO stage 1 by hand](12_zero_by_hand.ipynb#cell-id=12-zero-stage-1-by-hand) |
# | L11-3 | ZeRO-2 written by hand is as exact, and holds only its shard of the gradients when Adam runs | [12: ZeRO stage 2 by hand](12_zero_by_hand.ipynb#cell-id=12-zero-stage-2-by-hand) |
# | L11-4 | ZeRO-3 by hand (each layer gathered before forward and backward, freed after) equals DDP bit for bit; when Adam runs a rank holds only its shards and the frozen layer | [12: Exercise: a ZeRO-3 layer frees after backward](12_zero_by_hand.ipynb#cell-id=12-exercise-a-zero-3-layer-frees-after-backward) |
# | L11-5 | measured, each stage holds the formula's memory plus padding and `step`, falling from DDP to ZeRO-1, ZeRO-2 and ZeRO-3 | [12: Memory each stage holds](12_zero_by_hand.ipynb#cell-id=12-memory-each-stage-holds) |
# | L11-6 | with a ring (NCCL), ZeRO-1 and ZeRO-2 send per step what DDP sends, ZeRO-3 1.5 times as much | [12: Bytes sent per step](12_zero_by_hand.ipynb#cell-id=12-bytes-sent-per-step) |
# | L11-7 | gloo's reduce-scatter runs an all-reduce inside: on 2 gloo ranks ZeRO-1 and ZeRO-2 write 1.5 times DDP's socket bytes per step, ZeRO-3 twice | [12: Bytes sent per step](12_zero_by_hand.ipynb#cell-id=12-bytes-sent-per-step) |
# | L11-8 | after 5 steps FSDP2 (`fully_shard`) is within 1e-6 of one process and bit for bit ZeRO-3 by hand; modules sharing a weight in separate units raise ValueError | [13: FSDP2: fully_shard](13_fsdp2.ipynb#cell-id=13-fsdp2-fully-shard) |
# | L11-9 | `reshard_after_forward=True` holds only the shards between forward and backward, which gathers again; False keeps the gathered parameters | [13: FSDP2: fully_shard](13_fsdp2.ipynb#cell-id=13-fsdp2-fully-shard) |
# | L11-10 | `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)` runs on gloo on the CPU: the all-gathers carry exactly half the bytes, the reduce-scatters stay float32 | [13: FSDP2: fully_shard](13_fsdp2.ipynb#cell-id=13-fsdp2-fully-shard) |
# | L11-11 | a `torch.distributed.checkpoint` saved on 2 ranks loads into one process without a process group (resharded) and equals the ranks' full state dict | [13: FSDP2: fully_shard](13_fsdp2.ipynb#cell-id=13-fsdp2-fully-shard) |
# | L11-12 | 13 billion parameters at 80 GB per rank: DDP and ZeRO-1 never fit, ZeRO-3 fits from 3 ranks, ZeRO-2 from 6 | [13: When to shard](13_fsdp2.ipynb#cell-id=13-when-to-shard) |
# | L12-1 | while a `slow_link.SlowLink(α, β)` is active, an all-reduce completes α + bytes / β after the real one; two in a row take at least twice the delay | [14: A slow link you can dial](14_slow_link.ipynb#cell-id=14-a-slow-link-you-can-dial) |
# | L12-2 | fp16 hands the link half DDP's bytes, PowerSGD r=1 the biases, P and Q, and the link adds calls × α + bytes / β; at 100 MB/s both take under 0.8 times DDP's step | [14: When fp16 and PowerSGD pay](14_slow_link.ipynb#cell-id=14-when-fp16-and-powersgd-pay) |
# | L12-3 | fp16 beats DDP on links slower than β* = (S_DDP − S_fp16) / (t_fp16 − t_DDP), which matches where the two curves cross within 0.1% | [14: Exercise: predict fp16's crossover](14_slow_link.ipynb#cell-id=14-exercise-predict-fp16-s-crossover) |
# | L12-4 | with SGD without momentum and H = 1, local SGD equals DDP within 1e-6; between averages the replicas drift, right after one they are identical | [15: Local SGD](15_communicate_less.ipynb#cell-id=15-local-sgd) |
# | L12-5 | averaging every H steps (each an all-reduce of the parameters) sends 1/H of the bytes; here H = 16's loss after 64 steps is within 1% of H = 1's | [15: Loss against steps and against bytes sent](15_communicate_less.ipynb#cell-id=15-loss-against-steps-and-against-bytes-sent) |
# | L12-6 | on the CPU, `post_localSGD_hook`'s default `subgroup=None` raises ValueError after the warm-up (pass `post_local_gradient_allreduce=False` or a subgroup of size 1); `PeriodicModelAverager` matches the hand-written loop with `warmup_steps` W + H − 1, not the documented W | [15: torch's PostLocalSGDOptimizer](15_communicate_less.ipynb#cell-id=15-torch-s-postlocalsgdoptimizer) |
# | L12-7 | DiLoCo with outer learning rate 1 and no momentum equals local SGD within 1e-6; its outer step is Nesterov's (the formula matches within 1e-6) | [15: DiLoCo](15_communicate_less.ipynb#cell-id=15-diloco) |
# | L12-8 | at equal bytes sent (H = 16), local SGD's loss is under 0.2 times DDP's and DiLoCo's under 0.95 times local SGD's | [15: At equal bytes sent](15_communicate_less.ipynb#cell-id=15-at-equal-bytes-sent) |
# | L12-9 | gradients recorded by a DDP comm hook estimate the noise scale B_simple = tr(Σ) / \|G\|² within 25% of the exact value | [15: How large a batch can grow](15_communicate_less.ipynb#cell-id=15-how-large-a-batch-can-grow) |
# | L12-10 | well below B_simple (B = 2 → 8), 4 times the batch cuts the steps to a target loss at least 2.5-fold; well above it (B = 64 → 256), at most 1.5-fold | [15: The critical batch size: where the steps stop falling](15_communicate_less.ipynb#cell-id=15-the-critical-batch-size-where-the-steps-stop-falling) |
# | L12-11 | with unequal sample counts, DDP's average is a mean of per-rank means, not the mean over the samples; weighting by count (`no_sync.accumulate_by_count`) makes it exact | [15: Averages over unequal batches](15_communicate_less.ipynb#cell-id=15-averages-over-unequal-batches) |

# %% [markdown] lang="ja"
# ## 記事 004 の最初のコード例
#
# 記事 004 の最初の `MyModel` は中身が `# ...` だけで、`forward` がないので、呼ぶと `NotImplementedError` に
# なります。入力の `torch.randn(100, 1024)` は、2 つ目の例のモデル (`Linear(10, 100)`) とも形が合いません。

# %% [markdown] lang="en"
# ## Doc 004's first code example
#
# Doc 004's first `MyModel` contains only `# ...`: without a `forward`, calling it raises
# `NotImplementedError`. Its input, `torch.randn(100, 1024)`, does not fit the second
# example's `Linear(10, 100)` either.

# %% tags=["hide-input"]
import torch
from torch import nn

from labkit import checks, models


class MyModel(nn.Module):  # as printed: "# ..." and nothing else
    def __init__(self):
        super().__init__()


with checks.expect_error(NotImplementedError, match="forward"):
    nn.DataParallel(MyModel())(torch.randn(100, 1024))
with checks.expect_error(ValueError, match=r"shape \(batch, 10\)"):
    models.MLP()(torch.randn(100, 1024))

# %% [markdown] lang="ja"
# ## 記事 000 の本体のない for 文
#
# 記事 000 の 2 つ目と 3 つ目の例では、`for epoch in range(10):` の本体がコメント「# 訓練コード」だけで、
# `IndentationError` になり、どの行も実行されません。本体に `pass` を置けばコンパイルできます。

# %% [markdown] lang="en"
# ## Doc 000's `for` loops without a body
#
# In doc 000's second and third examples, the body of `for epoch in range(10):` is only
# a comment, "# 訓練コード" (training code): an `IndentationError`, so no line runs. With
# `pass` as the body, the lines compile.

# %%
doc_000_loops = """\
# 勾配同期ありの訓練
for epoch in range(10):
    # 訓練コード

# no_sync() オプションを有効にして訓練
ddp_model.no_sync()
for epoch in range(10):
    # 訓練コード

# 訓練結果を比較
"""
with checks.expect_error(IndentationError,
                         match="expected an indented block after 'for' statement on line 2"):
    compile(doc_000_loops, "doc_000", "exec")

# %% tags=["hide-input"]
with_body = doc_000_loops.replace("# 訓練コード", "pass  # 訓練コード")
code = compile(with_body, "doc_000", "exec")  # with a body, the same lines compile
assert code.co_filename == "doc_000"
print("with a body:", type(code).__name__)

# %% [markdown] lang="ja"
# ## GPU のあるマシンでの記事 004 の DataParallel
#
# 記事 004 の 3 つの例は、モデルを CPU に置いたまま (`nn.DataParallel(MyModel())`)、入力だけを GPU に送ります
# (`.cuda()`)。GPU が 2 台以上あると、`forward` はまずパラメータが `device_ids[0]` (cuda:0) にあるかを確かめ、
# なければ `RuntimeError` を出します。1 台なら DataParallel が自分でモデルを移すので、誤りは表に出ません。
#
# <details><summary>測り方</summary>
#
# このマシンには GPU がないので、`unittest.mock` で torch に「GPU が 2 台 (または 1 台) ある」と答えさせ、
# torch 自身の確認を実行します。どちらの確認も GPU の計算より前に行われます。
#
# </details>

# %% [markdown] lang="en"
# ## Doc 004's DataParallel on a machine with GPUs
#
# Doc 004's three examples leave the model on the CPU (`nn.DataParallel(MyModel())`) and
# send only the input to a GPU (`.cuda()`). With two or more GPUs, `forward` first checks
# that the parameters are on `device_ids[0]` (cuda:0) and raises `RuntimeError`; with
# one, DataParallel moves the model itself, and the mistake does not show.
#
# <details><summary>How this was measured</summary>
#
# This machine has no GPU: `unittest.mock` makes torch report two GPUs (or one), and
# torch's own checks run, since both come before any GPU work.
#
# </details>

# %% tags=["hide-input"]
from types import SimpleNamespace
from unittest import mock


def pretend_gpus(n):
    """Make torch report `n` CUDA devices (no GPU work may follow)."""
    props = SimpleNamespace(total_memory=1, multi_processor_count=1)
    return mock.patch.multiple(torch.cuda, is_available=lambda: True,
                               device_count=lambda: n,
                               get_device_properties=lambda i: props)


with pretend_gpus(2):
    model = nn.DataParallel(models.MLPAsWritten())  # as written: the model stays on the CPU
    assert model.device_ids == [0, 1]
    with checks.expect_error(RuntimeError, match=(
            r"module must have its parameters and buffers on device cuda:0 "
            r"\(device_ids\[0\]\) but found one of them on device: cpu")):
        model(torch.randn(100, 10))

with pretend_gpus(1), mock.patch.object(nn.Module, "to") as moved:
    nn.DataParallel(models.MLPAsWritten())
moved.assert_called_once_with(torch.device("cuda", 0))  # one GPU: it moves the model

# %% [markdown] lang="ja"
# 記事のコメント「入力データを GPU に分散」も正しくありません (004-9)。パラメータのない最初の `MyModel` なら
# `scatter` まで進み、渡るのはバッチ全体 (100 サンプル) と GPU の番号 `[0, 1]` だとわかります。

# %% [markdown] lang="en"
# The comment "spread the input over the GPUs" is wrong too (004-9). The first `MyModel`
# has no parameters, so it reaches `scatter`, which receives the whole batch of 100
# samples and the GPUs `[0, 1]`.

# %% tags=["hide-input"]
class ReachedScatter(Exception):
    """Stops DataParallel's forward where it splits the input."""


def spy_scatter(self, inputs, kwargs, device_ids):
    raise ReachedScatter([tuple(x.shape) for x in inputs], list(device_ids))


with pretend_gpus(2), mock.patch.object(nn.DataParallel, "scatter", spy_scatter):
    with checks.expect_error(ReachedScatter) as caught:
        nn.DataParallel(MyModel())(torch.randn(100, 10))
assert caught.exception.args == ([(100, 10)], [0, 1])  # the whole batch, both GPUs

if torch.cuda.is_available():  # a real GPU: .cuda() puts the whole batch on one device
    X_gpu = torch.randn(100, 10).cuda()
    assert X_gpu.device == torch.device("cuda", torch.cuda.current_device())
    assert X_gpu.shape == (100, 10)

# %% [markdown] lang="ja"
# ## TPU には torch_xla が要る
#
# 記事 000 は TPU を速い GPU と並べていますが、TPU は予算だけの話ではありません。
#
# - DDP の `nccl` バックエンドが扱うのは CUDA のテンソルだけです。
# - PyTorch だけではテンソルを TPU に置けません。`xla` デバイスの演算と通信バックエンドは torch_xla が
#   提供します。
# - torch_xla ではコードを書き換えます: デバイス、データローダー、ステップごとの `torch_xla.sync()`、`xla` の
#   バックエンド ([PyTorch/XLA のドキュメント](https://docs.pytorch.org/xla/))。
#
# 前の 2 つを確かめます。

# %% [markdown] lang="en"
# ## A TPU needs torch_xla
#
# Doc 000 lists TPUs next to faster GPUs; a TPU is not only a matter of budget.
#
# - DDP's `nccl` backend takes CUDA tensors only.
# - PyTorch alone cannot put a tensor on a TPU: the `xla` device's operations and
#   communication backend come with torch_xla.
# - torch_xla takes code changes: its device, its data loader, a `torch_xla.sync()` every
#   step, the `xla` backend ([PyTorch/XLA documentation](https://docs.pytorch.org/xla/)).
#
# The cell checks the first two.

# %%
import importlib.util

from torch import distributed as dist

print("nccl runs on:", dist.Backend.backend_capability["nccl"])
assert dist.Backend.backend_capability["nccl"] == ["cuda"]  # CUDA tensors only
if importlib.util.find_spec("torch_xla") is None:
    assert "xla" not in dist.Backend.backend_list  # torch_xla registers it on import
    with checks.expect_error(NotImplementedError, match="'XLA' backend"):
        torch.zeros(1, device="xla")  # the device type exists; its operations do not
else:
    print("torch_xla is installed here")
