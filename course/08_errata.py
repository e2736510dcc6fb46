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
# # 08 正誤表
#
# 出発点の 2 つの記事 (記事 000: `no_sync` と高速化の方法、記事 004: `data_parallel`、Horovod、
# フレームワーク) の記述とコードを 1 つずつ取り上げ、判定、正しい内容、それを確かめるセルへのリンクを
# 表にまとめます。判定は 4 種類です。
#
# - **正しい**: そのとおり (条件つきのものは「正しくは」の欄に条件を書きます)
# - **誤り**: 事実と違う、またはコードが動かない
# - **誤解を招く**: 一部は正しいが、そのまま受け取ると間違える
# - **古い**: かつては正しかったが、いまは別の方法を使う
#
# リンクは、この日本語版のノートブックの見出しを指します。JupyterLab のバージョンによっては、日本語の見出しへの
# リンクでノートブックは開いても、その見出しまではスクロールしないことがあります
# ([jupyterlab#12402](https://github.com/jupyterlab/jupyterlab/issues/12402))。そのときは左の目次から
# 見出しを選んでください。

# %% [markdown] lang="en"
# # 08 Errata
#
# Every statement and code snippet of the two source articles (doc 000: `no_sync` and
# speed-up tips; doc 004: `data_parallel`, Horovod, frameworks), with a verdict, the
# correction, and a link to the cell that demonstrates it. There are four verdicts:
#
# - **correct**: right as stated (conditions, if any, are in the "in fact" column)
# - **wrong**: not true, or the code does not run
# - **misleading**: partly true, but taken as written it leads you astray
# - **outdated**: was right once; today something else is used
#
# The links point at headings of the English notebooks. In some JupyterLab versions a
# link to a Japanese heading opens the notebook without scrolling to the heading
# ([jupyterlab#12402](https://github.com/jupyterlab/jupyterlab/issues/12402)); then pick
# the heading in the table of contents on the left.

# %% lang="ja"
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %% lang="en"
import labkit

labkit.require("0.1.0")
labkit.set_lang("en")

# %% [markdown] lang="ja"
# ## 記事 000: no_sync と高速化の方法
#
# | # | 記事の記述 | 判定 | 正しくは | 確かめるセル |
# |---|---|---|---|---|
# | 1 | 「DistributedDataParallel は複数の GPU で並列処理し、訓練時間を大幅に短縮できる」 | 正しい | 計算が通信より十分大きいときに限る。小さなモデルでは 2 ランクのほうが遅い | [03: world size 1 と 2 の 1 ステップの時間](03_ddp.ipynb#world-size-1-と-2-の-1-ステップの時間) |
# | 2 | 「各 GPU はモデルのパラメータの一部を保持し、それらを更新します」 | 誤り | DDP の各ランクは全パラメータの複製を持つ。一部を持つのは FSDP / ZeRO-3 | [03: 各ランクはモデル全体を持つ](03_ddp.ipynb#各ランクはモデル全体を持つ) |
# | 3 | (2 の記述が当てはまるもの) | 正しい | FSDP2 の `fully_shard` では各ランクが各パラメータの 1/N を持つ | [07: FSDP と ZeRO: パラメータを分割して持つ](07_ecosystem.ipynb#FSDP-と-ZeRO:-パラメータを分割して持つ) |
# | 4 | 「各 GPU のパラメータ更新は独立して行われるため整合性が失われる…各パラメータ更新後に勾配同期を行う」 | 誤り | 同期は逆伝播の途中、更新の前に勾配を all-reduce する。だから全ランクが同じ更新をする | [03: 何が、いつ通信されるか](03_ddp.ipynb#何が、いつ通信されるか) |
# | 5 | 「no_sync() は勾配同期を無効にするオプション」 | 誤解を招く | `with` で使うコンテキストマネージャで、同期を次の `with` の外の逆伝播まで先送りする | [04: 正しい使い方](04_no_sync.ipynb#正しい使い方) |
# | 6 | 「各 GPU はパラメータ更新後にすぐ次の更新を開始できる」 | 誤り | `no_sync` の中で `step` するとレプリカがずれ、同期に戻しても戻らない | [04: 誤用 3: no_sync の中で optimizer.step() する](04_no_sync.ipynb#誤用-3:-no_sync-の中で-optimizer.step()-する) |
# | 7 | 「メリット: 訓練速度の向上」 | 誤解を招く | 速くなるのは勾配累積で all-reduce が K 回から 1 回に減るときだけ | [04: 1 ステップの時間: K と no_sync](04_no_sync.ipynb#1-ステップの時間:-K-と-no_sync) |
# | 8 | 「デメリット: 訓練の不安定化、収束が遅くなる可能性」 | 誤り | 正しく使えば K 倍のバッチと数学的に同じで、更新ごとの曲線は重なる | [04: 収束: 記事の「同期あり vs no_sync」をやり直す](04_no_sync.ipynb#収束:-記事の「同期あり-vs-no_sync」をやり直す) |
# | 9 | 「使うべき場合 / 使わないべき場合」(速度優先、安定性重視など) | 誤り | 基準は勾配累積をするかどうか | [04: いつ使うか (記事のリストの書き直し)](04_no_sync.ipynb#いつ使うか-(記事のリストの書き直し)) |
# | 10 | 「速度と安定性のトレードオフを調整するオプション」 | 誤り | トレードオフはない。結果は同じで時間だけが変わる | [04: 収束: 記事の「同期あり vs no_sync」をやり直す](04_no_sync.ipynb#収束:-記事の「同期あり-vs-no_sync」をやり直す) |
# | 11 | コード `x = x.view(-1)` | 誤り | バッチ全体を 1 本にしてしまう。`x.flatten(1)` | [01: 直し方: サンプルごとに平らにする](01_models.ipynb#直し方:-サンプルごとに平らにする) |
# | 12 | コード `DistributedDataParallel(model)` (プロセスグループなし) | 誤り | 先に `init_process_group`。なければ ValueError | [01: DDP はプロセスグループなしでは作れない](01_models.ipynb#DDP-はプロセスグループなしでは作れない) |
# | 13 | コード `ddp_model.no_sync()` (1 行だけ) | 誤り | 何も起きない。`with model.no_sync():` の中で順伝播と逆伝播 | [04: 誤用 1: ddp_model.no_sync() と 1 行書く](04_no_sync.ipynb#誤用-1:-ddp_model.no_sync()-と-1-行書く) |
# | 14 | コード「# 訓練コード」で同期あり/なしを比較 | 誤り | 比較のコードがない。同じ条件で比べると曲線は重なり、no_sync は時間が短い | [04: 収束: 記事の「同期あり vs no_sync」をやり直す](04_no_sync.ipynb#収束:-記事の「同期あり-vs-no_sync」をやり直す) |
# | 15 | コード「モデルを 2 つ (4 つ) の GPU に分散」`MyModel().cuda()` | 誤解を招く | `.cuda()` は 1 台の GPU に置くだけ。DDP は 1 GPU に 1 プロセスを起動する | [03: ランクを起動する](03_ddp.ipynb#ランクを起動する) |
# | 16 | コード `DistributedDataParallel(model, dim=1)` | 誤解を招く | 1 プロセス 1 デバイスでは DDP は入力を分けないので `dim` は何もしない | [06: 記事の DistributedDataParallel(model, dim=1)](06_speedups.ipynb#記事の-DistributedDataParallel(model,-dim=1)) |
# | 17 | 「データローダーのワーカー数を増やす」 | 正しい | 読み込みが重いときに効く。データは変わらない | [06: DataLoader のワーカー数](06_speedups.ipynb#DataLoader-のワーカー数) |
# | 18 | 「バッチサイズを増やす」 | 誤解を招く | 処理速度は上がるが、収束には学習率の調整とウォームアップが要る | [06: 大きなバッチと学習率](06_speedups.ipynb#大きなバッチと学習率) |
# | 19 | 「データシャッフルを有効にする」(速度向上として) | 誤り | 速さは変わらない。収束のために必要 | [06: シャッフルは速さではなく収束のため](06_speedups.ipynb#シャッフルは速さではなく収束のため) |
# | 20 | 「ピンメモリーを使用する」 | 誤解を招く | CPU→GPU 転送でだけ効く。GPU がなければ何もしない | [06: pin_memory](06_speedups.ipynb#pin_memory) |
# | 21 | 「軽量なモデル」「精度と速度のバランス」「不要な計算を削減」 | 正しい | パラメータ数と時間、精度を測った。評価は `torch.no_grad()` で | [06: 軽いモデル](06_speedups.ipynb#軽いモデル) |
# | 22 | 「学習率を調整」「オプティマイザーを変更」「スケジューラーを使用」 | 誤解を招く | 1 ステップは速くならない。少ないステップで収束させるためのもの | [06: 学習率、オプティマイザ、スケジューラ](06_speedups.ipynb#学習率、オプティマイザ、スケジューラ) |
# | 23 | 「チェックポイントを活用する」(保存の意味で) | 誤解を招く | 速くはならない。止まっても再開でき、結果は 1 ビットも同じ | [06: チェックポイント (1): 学習状態を保存して再開する](06_speedups.ipynb#チェックポイント-(1):-学習状態を保存して再開する) |
# | 24 | 「チェックポイントを活用する」(活性化チェックポイントの意味で) | 誤解を招く | メモリを減らし、1 ステップは遅くなる | [06: チェックポイント (2): 活性化チェックポイント](06_speedups.ipynb#チェックポイント-(2):-活性化チェックポイント) |
# | 25 | 「より高速な GPU」「TPU」 | 正しい | 予算の話。同じコードが nccl で動く | [06: ハードウェア](06_speedups.ipynb#ハードウェア) |
# | 26 | 「Apex」 | 古い | `torch.autocast` と `torch.amp.GradScaler`。`torch.cuda.amp` も非推奨 | [06: 混合精度 (torch.autocast)](06_speedups.ipynb#混合精度-(torch.autocast)) |
# | 27 | 「Horovod」 | 古い | 最新リリースは 2023 年の 0.28.1。PyTorch では torchrun と DDP | [07: Horovod のいま](07_ecosystem.ipynb#Horovod-のいま) |
# | 28 | 「効果は訓練データ、モデル、目標によって異なる。さまざまな方法を試す必要がある」 | 正しい | 測って決める。このレッスンの数字もこのマシンでの値 | [06: DataLoader のワーカー数](06_speedups.ipynb#DataLoader-のワーカー数) |
# | 29 | 「これらの方法は no_sync() と組み合わせることでさらに速くなる」 | 誤解を招く | `no_sync` は勾配累積のときだけの話。ほかの方法とは独立 | [04: いつ使うか (記事のリストの書き直し)](04_no_sync.ipynb#いつ使うか-(記事のリストの書き直し)) |

# %% [markdown] lang="en"
# ## Doc 000: no_sync and speed-up tips
#
# | # | the document says | verdict | in fact | the cell that shows it |
# |---|---|---|---|---|
# | 1 | "DDP trains on several GPUs in parallel and can cut training time a lot" | correct | only when computation outweighs communication; a small model is slower on 2 ranks | [03: Time per step with world size 1 and 2](03_ddp.ipynb#Time-per-step-with-world-size-1-and-2) |
# | 2 | "each GPU holds part of the model's parameters and updates them" | wrong | every DDP rank holds a full replica; holding a part is FSDP / ZeRO-3 | [03: Every rank holds the whole model](03_ddp.ipynb#Every-rank-holds-the-whole-model) |
# | 3 | (what sentence 2 actually describes) | correct | with FSDP2's `fully_shard` each rank holds 1/N of every parameter | [07: FSDP and ZeRO: holding part of the parameters](07_ecosystem.ipynb#FSDP-and-ZeRO:-holding-part-of-the-parameters) |
# | 4 | "updates happen independently, so consistency may be lost… gradients are synchronized after each update" | wrong | gradients are all-reduced during backward, before the update, so every rank makes the same update | [03: What is communicated, and when](03_ddp.ipynb#What-is-communicated,-and-when) |
# | 5 | "no_sync() is an option that disables gradient synchronization" | misleading | a context manager that postpones synchronization to the next backward outside the `with` | [04: Correct use](04_no_sync.ipynb#Correct-use) |
# | 6 | "each GPU can start the next update right after its update" | wrong | stepping inside `no_sync` makes the replicas drift apart for good | [04: Misuse 3: optimizer.step() inside no_sync](04_no_sync.ipynb#Misuse-3:-optimizer.step()-inside-no_sync) |
# | 7 | "benefit: faster training" | misleading | faster only with gradient accumulation, where K all-reduces become one | [04: Time per step: K and no_sync](04_no_sync.ipynb#Time-per-step:-K-and-no_sync) |
# | 8 | "drawbacks: unstable training, possibly slower convergence" | wrong | used correctly it equals the K-times batch; loss per update is the same | [04: Convergence: the document's "sync vs no_sync", done properly](04_no_sync.ipynb#Convergence:-the-document's-"sync-vs-no_sync",-done-properly) |
# | 9 | "when to use / not to use it" (speed first, stability first, …) | wrong | the criterion is whether you accumulate gradients | [04: When to use it (the document's lists, rewritten)](04_no_sync.ipynb#When-to-use-it-(the-document's-lists,-rewritten)) |
# | 10 | "an option that trades speed for stability" | wrong | there is no trade-off: the same result, in less time | [04: Convergence: the document's "sync vs no_sync", done properly](04_no_sync.ipynb#Convergence:-the-document's-"sync-vs-no_sync",-done-properly) |
# | 11 | code `x = x.view(-1)` | wrong | flattens the whole batch; use `x.flatten(1)` | [01: The fix: flatten each sample](01_models.ipynb#The-fix:-flatten-each-sample) |
# | 12 | code `DistributedDataParallel(model)` (no process group) | wrong | `init_process_group` first; otherwise ValueError | [01: DDP cannot be built without a process group](01_models.ipynb#DDP-cannot-be-built-without-a-process-group) |
# | 13 | code `ddp_model.no_sync()` (on its own line) | wrong | does nothing; forward and backward inside `with model.no_sync():` | [04: Misuse 1: writing ddp_model.no_sync() on its own line](04_no_sync.ipynb#Misuse-1:-writing-ddp_model.no_sync()-on-its-own-line) |
# | 14 | code "# training code" comparing sync and no_sync | wrong | no code; compared properly the curves coincide and no_sync takes less time | [04: Convergence: the document's "sync vs no_sync", done properly](04_no_sync.ipynb#Convergence:-the-document's-"sync-vs-no_sync",-done-properly) |
# | 15 | code "spread the model over 2 (4) GPUs" `MyModel().cuda()` | misleading | `.cuda()` puts it on one GPU; DDP runs one process per GPU | [03: Start the ranks](03_ddp.ipynb#Start-the-ranks) |
# | 16 | code `DistributedDataParallel(model, dim=1)` | misleading | with one device per process DDP splits no input, so `dim` does nothing | [06: The document's DistributedDataParallel(model, dim=1)](06_speedups.ipynb#The-document's-DistributedDataParallel(model,-dim=1)) |
# | 17 | "more data-loader workers" | correct | helps when loading is slow; the data does not change | [06: DataLoader workers](06_speedups.ipynb#DataLoader-workers) |
# | 18 | "increase the batch size" | misleading | more samples per second, but convergence needs the learning rate scaled and warm-up | [06: Large batches and the learning rate](06_speedups.ipynb#Large-batches-and-the-learning-rate) |
# | 19 | "enable data shuffling" (as a speed-up) | wrong | no faster; it is needed for convergence | [06: Shuffling is for convergence, not speed](06_speedups.ipynb#Shuffling-is-for-convergence,-not-speed) |
# | 20 | "use pinned memory" | misleading | helps only CPU→GPU copies; without a GPU it does nothing | [06: pin_memory](06_speedups.ipynb#pin_memory) |
# | 21 | "lighter model", "balance accuracy and speed", "remove unneeded computation" | correct | measured parameters, time and accuracy; evaluate under `torch.no_grad()` | [06: A lighter model](06_speedups.ipynb#A-lighter-model) |
# | 22 | "tune the learning rate", "change the optimizer", "use a scheduler" | misleading | a step is no faster; they converge in fewer steps | [06: Learning rate, optimizer and scheduler](06_speedups.ipynb#Learning-rate,-optimizer-and-scheduler) |
# | 23 | "use checkpoints" (saving state) | misleading | no faster; it lets you resume, bit-identically | [06: Checkpoints (1): save and resume the training state](06_speedups.ipynb#Checkpoints-(1):-save-and-resume-the-training-state) |
# | 24 | "use checkpoints" (activation checkpointing) | misleading | saves memory and makes a step slower | [06: Checkpoints (2): activation checkpointing](06_speedups.ipynb#Checkpoints-(2):-activation-checkpointing) |
# | 25 | "a faster GPU", "a TPU" | correct | a matter of budget; the same code runs on nccl | [06: Hardware](06_speedups.ipynb#Hardware) |
# | 26 | "Apex" | outdated | `torch.autocast` and `torch.amp.GradScaler`; `torch.cuda.amp` is deprecated too | [06: Mixed precision (torch.autocast)](06_speedups.ipynb#Mixed-precision-(torch.autocast)) |
# | 27 | "Horovod" | outdated | latest release 0.28.1 (2023); with PyTorch use torchrun and DDP | [07: Horovod today](07_ecosystem.ipynb#Horovod-today) |
# | 28 | "the effect depends on data, model and goal; try several methods" | correct | measure and decide; this lesson's numbers are this machine's | [06: DataLoader workers](06_speedups.ipynb#DataLoader-workers) |
# | 29 | "combined with no_sync() these methods speed training up further" | misleading | `no_sync` matters only with gradient accumulation, independently of the rest | [04: When to use it (the document's lists, rewritten)](04_no_sync.ipynb#When-to-use-it-(the-document's-lists,-rewritten)) |

# %% [markdown] lang="ja"
# ## 記事 004: data_parallel、Horovod、フレームワーク
#
# | # | 記事の記述 | 判定 | 正しくは | 確かめるセル |
# |---|---|---|---|---|
# | 1 | 「データ並列処理とは、異なるデータサンプルを複数の GPU に分散させて処理し、訓練と推論を高速化する手法」 | 正しい | 分けるのはデータで、モデルは各デバイスに複製する | [02: 2. replicate: モデルを複製する](02_data_parallel.ipynb#2.-replicate:-モデルを複製する) |
# | 2 | 「data_parallel() はモデルと入力を複数の GPU に分散させ、結果を集約する」 | 正しい | `scatter`、`replicate`、`parallel_apply`、`gather` の 4 段階 | [02: 2. replicate: モデルを複製する](02_data_parallel.ipynb#2.-replicate:-モデルを複製する) |
# | 3 | 「メリット: 訓練と推論の速度を大幅に向上」 | 誤解を招く | スレッドと毎回の複製のため DDP より遅い。CPU では何もしない | [02: スレッドの DataParallel とプロセスの DDP](02_data_parallel.ipynb#スレッドの-DataParallel-とプロセスの-DDP) |
# | 4 | 「コードの変更を最小限に抑えながら」 | 正しい | 包むだけで使える。ただし推奨は DDP | [02: PyTorch が DDP を勧める理由](02_data_parallel.ipynb#PyTorch-が-DDP-を勧める理由) |
# | 5 | 「使い方」: DataParallel で包み、入力を分け、data_parallel に渡す | 誤り | クラスか関数のどちらか一方に、バッチ全体を渡す | [02: 記事 004 の使い方を直す](02_data_parallel.ipynb#記事-004-の使い方を直す) |
# | 6 | 最初のコード例: `forward` のない `MyModel` と `torch.randn(100, 1024)` | 誤り | `forward` がないので呼ぶと NotImplementedError | [08: 記事 004 の最初のコード例](08_errata.ipynb#記事-004-の最初のコード例) |
# | 7 | 「モデルのすべての層が GPU で実行できる必要」 | 正しい | レプリカは各 GPU で丸ごと動く | [02: 2. replicate: モデルを複製する](02_data_parallel.ipynb#2.-replicate:-モデルを複製する) |
# | 8 | 「モデルのパラメータはすべての GPU に同期されている必要」 | 誤り | 呼び出しのたびに複製し直すので、利用者がそろえる必要はない | [02: 記事 004 の使い方を直す](02_data_parallel.ipynb#記事-004-の使い方を直す) |
# | 9 | 「データバッチサイズは GPU のメモリ容量に収まる必要」 | 誤解を招く | 各 GPU には分けた一部が載る。出力はデバイス 0 に集まる | [02: 4. gather: 出力を集める](02_data_parallel.ipynb#4.-gather:-出力を集める) |
# | 10 | 「replicate や scatter_gather は異なる並列処理パターンに対応」 | 誤り | `data_parallel` 自身の部品。`scatter_gather` はモジュール | [02: 記事 004 の使い方を直す](02_data_parallel.ipynb#記事-004-の使い方を直す) |
# | 11 | 「PyTorch Lightning などで、さらに簡単に」 | 正しい | 中で DDP と `no_sync` を使う | [07: PyTorch Lightning と Hugging Face Accelerate](07_ecosystem.ipynb#PyTorch-Lightning-と-Hugging-Face-Accelerate) |
# | 12 | 「data_parallel() は強力なツール」(まとめ) | 古い | 1 台のマシンでも DDP を使う (PyTorch の推奨) | [02: PyTorch が DDP を勧める理由](02_data_parallel.ipynb#PyTorch-が-DDP-を勧める理由) |
# | 13 | コード `x.view(-1)` (MLP) | 誤り | バッチ 100 でエラー、バッチ 1 では形が黙って壊れる | [01: バッチが 1 のときは黙って間違える](01_models.ipynb#バッチが-1-のときは黙って間違える) |
# | 14 | コード `nn.DataParallel(MyModel())` (GPU なし) | 誤解を招く | CPU では `device_ids` が空で、モデルを 1 回呼ぶだけ | [02: CPU では nn.DataParallel は何もしない](02_data_parallel.ipynb#CPU-では-nn.DataParallel-は何もしない) |
# | 15 | コード `.cuda()` | 誤解を招く | GPU がなければ止まる。`device` を選ぶ | [01: 記事 004 の「カスタム損失関数」の例](01_models.ipynb#記事-004-の「カスタム損失関数」の例) |
# | 16 | コード `MyLoss` (平均二乗誤差) | 正しい | `nn.MSELoss()` と同じ値 | [01: 記事 004 の「カスタム損失関数」の例](01_models.ipynb#記事-004-の「カスタム損失関数」の例) |
# | 17 | コード `optimizer.step()` (`optimizer` が未定義) | 誤り | NameError。オプティマイザを作る | [01: 記事 004 の「カスタム損失関数」の例](01_models.ipynb#記事-004-の「カスタム損失関数」の例) |
# | 18 | コード `loss.backward` (括弧なし) | 誤り | 呼ばれず勾配は None。`loss.backward()` | [01: loss.backward と loss.backward() は違う](01_models.ipynb#loss.backward-と-loss.backward()-は違う) |
# | 19 | コード (学習ループ) `zero_grad` なし | 誤り | 勾配がステップごとに積み重なる | [01: zero_grad() を忘れると勾配がたまる](01_models.ipynb#zero_grad()-を忘れると勾配がたまる) |
# | 20 | コード `MyDataset` (独立な乱数) | 誤解を招く | 学ぶものがない。収束を見るなら学習できる課題で | [01: 記事のデータには学ぶものがない](01_models.ipynb#記事のデータには学ぶものがない) |
# | 21 | 「手動で並列処理: 1. モデルを複数の GPU に分割」 | 誤り | データ並列はデータを分けてモデルを複製する。モデルを分けるのはモデル並列 | [07: 手動の並列化](07_ecosystem.ipynb#手動の並列化) |
# | 22 | 「Horovod は MPI を使用して通信…使いやすく、スケーラブル」 | 古い | 2023 年から新しいリリースがなく、新しい PyTorch に対してビルドできないと報告されている | [07: Horovod のいま](07_ecosystem.ipynb#Horovod-のいま) |
# | 23 | 「モデルを Horovod でラップします」 | 誤り | 包むのはオプティマイザ (`hvd.DistributedOptimizer`) | [07: Horovod のいま](07_ecosystem.ipynb#Horovod-のいま) |
# | 24 | 「PyTorch Lightning や TensorFlow Lattice などの分散訓練用フレームワーク」 | 誤り | TensorFlow Lattice は形状制約つきの格子モデルのライブラリ | [07: TensorFlow Lattice は分散学習のフレームワークではない](07_ecosystem.ipynb#TensorFlow-Lattice-は分散学習のフレームワークではない) |
# | 25 | 「コードを変更することなく、複数の GPU 上で訓練」 | 誤解を招く | 少ない変更で (LightningModule、`accelerator.prepare`) | [07: PyTorch Lightning と Hugging Face Accelerate](07_ecosystem.ipynb#PyTorch-Lightning-と-Hugging-Face-Accelerate) |
# | 26 | (書かれていない) 複数のマシンへ広げるには | 正しい | 各ノードで torchrun、c10d ランデブー。SLURM の例あり | [07: 2 台のマシンを模擬する](07_ecosystem.ipynb#2-台のマシンを模擬する) |

# %% [markdown] lang="en"
# ## Doc 004: data_parallel, Horovod, frameworks
#
# | # | the document says | verdict | in fact | the cell that shows it |
# |---|---|---|---|---|
# | 1 | "data parallelism processes different samples on several GPUs to speed up training and inference" | correct | the data is split, the model is copied to every device | [02: 2. replicate: copy the model](02_data_parallel.ipynb#2.-replicate:-copy-the-model) |
# | 2 | "data_parallel() spreads model and input over GPUs and gathers the result" | correct | the four steps `scatter`, `replicate`, `parallel_apply`, `gather` | [02: 2. replicate: copy the model](02_data_parallel.ipynb#2.-replicate:-copy-the-model) |
# | 3 | "benefit: much faster training and inference" | misleading | slower than DDP (threads, a copy at every call); on a CPU it does nothing | [02: Thread-based DataParallel against process-based DDP](02_data_parallel.ipynb#Thread-based-DataParallel-against-process-based-DDP) |
# | 4 | "with minimal code changes" | correct | just wrap the model; but PyTorch recommends DDP | [02: Why PyTorch recommends DDP](02_data_parallel.ipynb#Why-PyTorch-recommends-DDP) |
# | 5 | "how to use": wrap in DataParallel, split the input, pass to data_parallel | wrong | use the class or the function, with the whole batch | [02: Fixing doc 004's recipe](02_data_parallel.ipynb#Fixing-doc-004's-recipe) |
# | 6 | first code example: `MyModel` without `forward`, `torch.randn(100, 1024)` | wrong | no `forward`, so calling it raises NotImplementedError | [08: Doc 004's first code example](08_errata.ipynb#Doc-004's-first-code-example) |
# | 7 | "every layer must run on the GPU" | correct | each replica runs whole on its GPU | [02: 2. replicate: copy the model](02_data_parallel.ipynb#2.-replicate:-copy-the-model) |
# | 8 | "parameters must be synchronized on all GPUs" | wrong | replicas are rebuilt at every call; nothing for the user to do | [02: Fixing doc 004's recipe](02_data_parallel.ipynb#Fixing-doc-004's-recipe) |
# | 9 | "the batch must fit in GPU memory" | misleading | each GPU holds its chunk; outputs are gathered on device 0 | [02: 4. gather: collect the outputs](02_data_parallel.ipynb#4.-gather:-collect-the-outputs) |
# | 10 | "replicate and scatter_gather serve different patterns" | wrong | they are the parts of `data_parallel`; `scatter_gather` is a module | [02: Fixing doc 004's recipe](02_data_parallel.ipynb#Fixing-doc-004's-recipe) |
# | 11 | "PyTorch Lightning makes it even easier" | correct | it uses DDP and `no_sync` underneath | [07: PyTorch Lightning and Hugging Face Accelerate](07_ecosystem.ipynb#PyTorch-Lightning-and-Hugging-Face-Accelerate) |
# | 12 | "data_parallel() is a powerful tool" (summary) | outdated | use DDP, even on one machine (PyTorch's advice) | [02: Why PyTorch recommends DDP](02_data_parallel.ipynb#Why-PyTorch-recommends-DDP) |
# | 13 | code `x.view(-1)` (MLP) | wrong | fails with a batch of 100, silently wrong with a batch of 1 | [01: With a batch of one it is silently wrong](01_models.ipynb#With-a-batch-of-one-it-is-silently-wrong) |
# | 14 | code `nn.DataParallel(MyModel())` (no GPU) | misleading | on a CPU `device_ids` is empty: one plain call | [02: On a CPU, nn.DataParallel does nothing](02_data_parallel.ipynb#On-a-CPU,-nn.DataParallel-does-nothing) |
# | 15 | code `.cuda()` | misleading | stops without a GPU; choose a `device` | [01: Doc 004's "custom loss" example](01_models.ipynb#Doc-004's-"custom-loss"-example) |
# | 16 | code `MyLoss` (mean squared error) | correct | the same value as `nn.MSELoss()` | [01: Doc 004's "custom loss" example](01_models.ipynb#Doc-004's-"custom-loss"-example) |
# | 17 | code `optimizer.step()` (`optimizer` undefined) | wrong | NameError; create the optimizer | [01: Doc 004's "custom loss" example](01_models.ipynb#Doc-004's-"custom-loss"-example) |
# | 18 | code `loss.backward` (no parentheses) | wrong | never called, gradients stay None; `loss.backward()` | [01: loss.backward is not loss.backward()](01_models.ipynb#loss.backward-is-not-loss.backward()) |
# | 19 | code (training loop) without `zero_grad` | wrong | gradients pile up step after step | [01: Without zero_grad() gradients pile up](01_models.ipynb#Without-zero_grad()-gradients-pile-up) |
# | 20 | code `MyDataset` (independent random numbers) | misleading | nothing to learn; watch convergence on a learnable task | [01: The document's data has nothing to learn](01_models.ipynb#The-document's-data-has-nothing-to-learn) |
# | 21 | "by hand: 1. split the model across GPUs" | wrong | data parallelism splits data and copies the model; splitting the model is model parallelism | [07: Parallelism by hand](07_ecosystem.ipynb#Parallelism-by-hand) |
# | 22 | "Horovod communicates with MPI… easy to use and scalable" | outdated | no release since 2023, reported not to build against recent PyTorch | [07: Horovod today](07_ecosystem.ipynb#Horovod-today) |
# | 23 | "wrap the model with Horovod" | wrong | you wrap the optimizer (`hvd.DistributedOptimizer`) | [07: Horovod today](07_ecosystem.ipynb#Horovod-today) |
# | 24 | "distributed-training frameworks such as PyTorch Lightning and TensorFlow Lattice" | wrong | TensorFlow Lattice is a library of shape-constrained lattice models | [07: TensorFlow Lattice is not a distributed-training framework](07_ecosystem.ipynb#TensorFlow-Lattice-is-not-a-distributed-training-framework) |
# | 25 | "train on several GPUs without changing the code" | misleading | with few changes (a LightningModule, `accelerator.prepare`) | [07: PyTorch Lightning and Hugging Face Accelerate](07_ecosystem.ipynb#PyTorch-Lightning-and-Hugging-Face-Accelerate) |
# | 26 | (not said) how to go beyond one machine | correct | one torchrun per node with c10d rendezvous; a SLURM example | [07: Two machines, simulated](07_ecosystem.ipynb#Two-machines,-simulated) |

# %% [markdown] lang="ja"
# ## 記事 004 の最初のコード例
#
# 記事 004 の最初のコード例では、`MyModel` の中身が `# ...` だけで、`forward` がありません。
# `nn.DataParallel` で包んでも、呼んだ時点で `NotImplementedError` になります。さらに入力は
# `torch.randn(100, 1024)` で、2 つ目の例のモデル (`Linear(10, 100)`) とも形が合いません。

# %% [markdown] lang="en"
# ## Doc 004's first code example
#
# In doc 004's first code example `MyModel` contains only `# ...`: there is no `forward`.
# Wrapped in `nn.DataParallel` or not, calling it raises `NotImplementedError`. And its
# input, `torch.randn(100, 1024)`, does not fit the second example's model
# (`Linear(10, 100)`) either.

# %%
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
# ## 表の確認
#
# この表自体も確かめます。すべての行に 4 種類のどれかの判定とリンクがあり、リンク先のノートブックと見出しが
# 存在することを、JupyterLab と同じ規則 (見出しの表示テキストの空白を `-` に置き換える) で調べます。

# %% [markdown] lang="en"
# ## Checking the table
#
# Check the table itself: every row has one of the four verdicts and a link, and every
# linked notebook and heading exists, with anchors made the way JupyterLab makes them
# (the heading's visible text with spaces replaced by `-`).

# %%
import json
from pathlib import Path

from labkit import links

here = Path.cwd()
if (here / "08_errata.ipynb").exists():  # run from the notebook's folder
    nb = json.loads((here / "08_errata.ipynb").read_text(encoding="utf-8"))
    lang = nb["metadata"]["labkit"]["lang"]
    verdicts = {"ja": ("正しい", "誤り", "誤解を招く", "古い"),
                "en": ("correct", "wrong", "misleading", "outdated")}[lang]
    rows = [line for cell in nb["cells"] if cell["cell_type"] == "markdown"
            for line in "".join(cell["source"]).splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    counts = {v: sum(line.split("|")[3].strip() == v for line in rows) for v in verdicts}
    print(f"{len(rows)} rows:", counts)
    assert sum(counts.values()) == len(rows) >= 50  # every row has a known verdict
    assert all(links.LINK.search(line) for line in rows)  # and a link
    broken = links.broken_links(here)
    print("broken links:", broken or "none")
    assert broken == []
