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
# # 01 記事のモデルを動かす
#
# この講座の出発点の 2 つの記事 (no_sync の解説 = 記事 000、data_parallel の解説 = 記事 004) には、
# モデル、損失関数、データセット、学習ループのコードが載っています。そのままでは動きません。
# このレッスンでは、記事のコードを**書かれたとおりに**実行してどこでどう失敗するかを確かめ、直したモデルで
# 記事の `DataLoader` の例を 1 プロセスで学習させます。以後のレッスンの DataParallel や DDP は、
# ここで作る 1 プロセスの学習と比べて正しさを確かめます。
#
# このレッスンを終えると、次のことができます。
#
# - 記事のコードの誤り (`x.view(-1)`、括弧のない `loss.backward`、`zero_grad()` と `optimizer.step()` の抜け) を、
#   それぞれセルで示せる。
# - バッチの次元を残して各サンプルを平坦化し、バッチが 1 のときに誤りが隠れる理由を説明できる。
# - `zero_grad()` → 順伝播 → 損失 → `backward()` → `step()` の 1 ステップを書ける。
# - 学ぶもののないデータと学習できる課題を、学習曲線と目標値の分散で見分けられる。
# - シードを固定して、同じ学習をビット単位で再現できる。

# %% [markdown] lang="en" tags=["outcomes"]
# # 01 The documents' models
#
# The two Japanese articles this course starts from (quoted here: doc 000 on
# `no_sync`, doc 004 on `data_parallel`) print a model, a loss, a data set and a
# training loop. As printed, they do not run. This lesson runs the documents' code
# **as written** to see where and how it fails, then trains the corrected model on doc
# 004's `DataLoader` example in one process. Later lessons check DataParallel and DDP
# against this single-process training.
#
# After this lesson you can:
#
# - show with a cell each of the documents' mistakes: `x.view(-1)`, `loss.backward`
#   without a call, no `zero_grad()`, no `optimizer.step()`;
# - flatten each sample while keeping the batch dimension, and say why a batch of one
#   hides the bug;
# - write the step `zero_grad()` → forward → loss → `backward()` → `step()`;
# - tell data with nothing to learn from a learnable task, by the loss curve against
#   the targets' variance;
# - reproduce a training run bit for bit from its seeds.

# %%
import labkit

labkit.require("0.1.0")
labkit.set_lang("ja")

# %%
import torch
from torch import nn

from labkit import checks, data, exercises, models, plots

torch.manual_seed(0)

# %% [markdown] lang="ja"
# ## 記事 004 のモデルを書かれたとおりに
#
# 記事 004 のモデルは次のとおりです (`labkit.models.MLPAsWritten` に同じコードがあります)。
#
# ```python
# def forward(self, x):
#     x = x.view(-1)
#     x = self.fc1(x)          # nn.Linear(10, 100)
#     x = torch.relu(x)
#     x = self.fc2(x)          # nn.Linear(100, 10)
#     return x
# ```
#
# 記事と同じく 100 サンプルのバッチ `torch.randn(100, 10)` を入れてみます。
# `x.view(-1)` はバッチ全体を長さ 1000 の 1 本のベクトルにしてしまうので、`Linear(10, 100)` に入りません。

# %% [markdown] lang="en"
# ## Doc 004's model, as written
#
# Doc 004's model reads as follows (`labkit.models.MLPAsWritten` holds the same code):
#
# ```python
# def forward(self, x):
#     x = x.view(-1)
#     x = self.fc1(x)          # nn.Linear(10, 100)
#     x = torch.relu(x)
#     x = self.fc2(x)          # nn.Linear(100, 10)
#     return x
# ```
#
# Feed it a batch of 100 samples, `torch.randn(100, 10)`, as the document does.
# `x.view(-1)` turns the whole batch into one vector of length 1000, which
# `Linear(10, 100)` cannot take.

# %%
X = torch.randn(100, 10)
as_written = models.MLPAsWritten()
with checks.expect_error(RuntimeError, match="shapes cannot be multiplied"):
    as_written(X)

# %% [markdown] lang="ja"
# 記事 000 のモデル (`Linear(10, 10)` が 2 つ) も同じ `x.view(-1)` を持ち、同じように失敗します。

# %% [markdown] lang="en"
# Doc 000's model (two `Linear(10, 10)`) has the same `x.view(-1)` and fails the same way.

# %%
with checks.expect_error(RuntimeError, match="shapes cannot be multiplied"):
    models.TwoLinearAsWritten()(X)

# %% [markdown] lang="ja"
# ## バッチが 1 のときは黙って間違える
#
# バッチが 1 サンプル `(1, 10)` だと、`view(-1)` の結果は長さ 10 のベクトルで、たまたま `Linear(10, 100)` に
# 入ります。図で、2 本の線が重なるところを見てください。
#
# **予想してから実行:** エラーになるでしょうか。ならないなら、出力はどんな形でしょうか?

# %% [markdown] lang="en"
# ## With a batch of one it is silently wrong
#
# With a batch of one sample, `(1, 10)`, `view(-1)` gives a vector of length 10, which
# happens to fit `Linear(10, 100)`. Look where the figure's two lines meet.
#
# **Predict, then run:** does it fail? If not, what shape is the output?

# %%
received = []  # the length of the vector fc1 receives, for batches of 1 to 6 samples
hook = as_written.fc1.register_forward_pre_hook(
    lambda module, args: received.append(args[0].shape[-1]))
x1 = torch.randn(1, 10)
out = as_written(x1)
print(tuple(x1.shape), "->", tuple(out.shape))
assert out.shape == (10,)  # not (1, 10)
for n in range(2, 7):
    with checks.expect_error(RuntimeError, match="shapes cannot be multiplied"):
        as_written(torch.randn(n, 10))
hook.remove()
assert received == [10 * n for n in range(1, 7)]  # the whole batch in one vector
fig = plots.line_chart(
    {"x.view(-1)": (range(1, 7), received),
     labkit.t("fc1_takes"): (range(1, 7), [as_written.fc1.in_features] * 6)},
    xlabel="fc1_batch", ylabel="fc1_len", title="fc1_fits_title", from_zero=True)

# %% [markdown] lang="ja"
# エラーは出ませんが、出力の形は `(1, 10)` ではなく `(10,)` で、バッチの次元が消えています。
# 動いたように見える分、こちらのほうが危険です。

# %% [markdown] lang="en"
# Nothing fails, but the output has shape `(10,)`, not `(1, 10)`: the batch dimension
# is gone. Because it seems to work, this is the more dangerous case.

# %% [markdown] lang="ja"
# ## 演習: `view(-1)` を直す
#
# 次のセルの `FixedMLP` は、記事 004 のモデルそのままです。印を付けた 1 行だけを書き換えて、
# どんなバッチでもサンプルごとの出力を返すようにしてください。確認のセルは、100 サンプルのバッチ
# `(100, 10)`、1 サンプルのバッチ `(1, 10)`、各サンプルが `(2, 5)` の形をしたバッチ `(4, 2, 5)` を入れ、
# 直したモデルの出力と比べます (演習と確認のセルの使い方はレッスン 00 にあります)。

# %% [markdown] lang="en"
# ## Exercise: fix `view(-1)`
#
# `FixedMLP` in the next cell is doc 004's model as printed. Change only the marked line so
# that any batch gives one output per sample. The check feeds a batch of 100 samples
# `(100, 10)`, a batch of one `(1, 10)`, and a batch `(4, 2, 5)` whose samples are shaped
# `(2, 5)`, and compares with the corrected model (how an exercise and its check cell
# work: lesson 00).

# %% tags=["exercise"]
class FixedMLP(models.MLPAsWritten):
    """Doc 004's model: fix the marked line so that every sample keeps its row."""

    def forward(self, x):
        x = x.view(-1)  # <- fix this line
        x = self.fc1(x)
        x = torch.relu(x)
        x = self.fc2(x)
        return x

# %% tags=["solution"]
class FixedMLP(models.MLPAsWritten):
    """Doc 004's model, fixed: flatten each sample, keep the batch dimension."""

    def forward(self, x):
        x = x.flatten(1)  # (N, ...) -> (N, features): one row per sample
        x = self.fc1(x)
        x = torch.relu(x)
        x = self.fc2(x)
        return x

# %%
exercises.grade_keeps_batch(FixedMLP)

# %% [markdown] lang="ja"
# ## 直し方: サンプルごとに平坦化する
#
# 平坦化するのは各サンプルだけで、バッチの次元 (0 番目) は残します: `x.flatten(1)`
# (`x.view(x.size(0), -1)` と同じ)。入力がもともと `(N, 10)` なら何もしないのと同じです。
# `labkit.models.MLP` と `labkit.models.TwoLinear` が直したモデルです。
#
# 同じ重みを読み込むと、1 サンプルの計算結果は元のモデルと一致します。間違っていたのは
# 形の扱いだけだとわかります。さらに、バッチの各行はそのサンプル単独の出力と一致します。

# %% [markdown] lang="en"
# ## The fix: flatten each sample
#
# Flatten each sample only and keep the batch dimension (dimension 0): `x.flatten(1)`
# (the same as `x.view(x.size(0), -1)`). For an input that is already `(N, 10)` it
# changes nothing. `labkit.models.MLP` and `labkit.models.TwoLinear` are the corrected
# models.
#
# Loaded with the same weights, the corrected model computes the same numbers as the
# original for one sample: only the shape handling was wrong. And each row of a batch
# equals that sample's output on its own.

# %%
model = models.MLP()
model.load_state_dict(as_written.state_dict())
Y_hat = model(X)
print(tuple(X.shape), "->", tuple(Y_hat.shape))
assert Y_hat.shape == (100, 10)
assert torch.equal(model(x1)[0], as_written(x1))
torch.testing.assert_close(Y_hat[7], model(X[7:8])[0])
assert models.TwoLinear()(X).shape == (100, 10)

# %% [markdown] lang="ja"
# ## DDP はプロセスグループなしでは作れない
#
# 記事 000 は `nnparallel.DistributedDataParallel(model)` といきなり書いています。
# DDP はランク間で勾配を平均するため、先に `torch.distributed.init_process_group(...)` で
# プロセスグループを作っておく必要があります。無ければその場でエラーです。
# 正しい手順はレッスン 03 で扱います。

# %% [markdown] lang="en"
# ## DDP cannot be built without a process group
#
# Doc 000 writes `nnparallel.DistributedDataParallel(model)` straight away. DDP averages
# gradients between ranks, so a process group must exist first
# (`torch.distributed.init_process_group(...)`); without one it fails at once.
# Lesson 03 does it properly.

# %%
from torch.nn.parallel import DistributedDataParallel

with checks.expect_error(ValueError, match="process group has not been initialized"):
    DistributedDataParallel(models.TwoLinear())

# %% [markdown] lang="ja"
# ## 記事 004 の「カスタム損失関数」の例
#
# この例には 3 つの問題があります。
#
# 1. `.cuda()`: GPU のないマシンではここで止まります。使えるデバイスを選ぶのが正解です。
# 2. `optimizer.step()`: `optimizer` がどこにも定義されておらず、`NameError` になります。
# 3. `MyLoss` は平均二乗誤差そのもので、`nn.MSELoss()` と同じ値になります (自作は不要ですが、害もありません)。

# %% [markdown] lang="en"
# ## Doc 004's "custom loss" example
#
# This example has three problems.
#
# 1. `.cuda()`: on a machine without a GPU it stops here. Choose the device that exists.
# 2. `optimizer.step()`: `optimizer` is never defined: `NameError`.
# 3. `MyLoss` is exactly the mean squared error, the same value as `nn.MSELoss()`
#    (writing it is unnecessary, but harmless).

# %%
if torch.cuda.is_available():
    print("CUDA:", torch.cuda.get_device_name(0))
else:
    # A CPU-only build raises AssertionError; a CUDA build without a GPU, RuntimeError.
    with checks.expect_error((AssertionError, RuntimeError)):
        torch.randn(100, 10).cuda()
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
device

# %%
with checks.expect_error(NameError, match="optimizer"):
    optimizer.step()  # noqa: F821  (undefined, as in the document)

# %%
Y = torch.randn(100, 10)
criterion = models.MyLoss()
torch.testing.assert_close(criterion(Y_hat, Y), nn.MSELoss()(Y_hat, Y))
criterion(Y_hat, Y).item()

# %% [markdown] lang="ja"
# ## `loss.backward` と `loss.backward()` は違う
#
# 記事 004 の `DataLoader` の例の最後の行は `loss.backward` で、括弧がありません。
# これはメソッドを取り出すだけで呼び出しません。エラーは出ず、勾配は `None` のままです。

# %% [markdown] lang="en"
# ## `loss.backward` is not `loss.backward()`
#
# The last line of doc 004's `DataLoader` example is `loss.backward`, without
# parentheses. That only looks the method up and never calls it: no error, and the
# gradients stay `None`.

# %%
model = models.MLP()
loss = criterion(model(X), Y)
loss.backward  # as in the document: nothing happens
print([p.grad for p in model.parameters()])
assert all(p.grad is None for p in model.parameters())

loss.backward()  # the call computes the gradients
assert all(p.grad is not None for p in model.parameters())

# %% [markdown] lang="ja"
# ## `zero_grad()` を忘れると勾配がたまる
#
# PyTorch は `backward()` のたびに勾配を `.grad` に**足し込みます**。記事の学習ループには
# `optimizer.zero_grad()` がないので、ステップごとに前の勾配が積み重なります
# (この「足し込み」は、レッスン 04 の勾配累積ではわざと使います)。
#
# **予想してから実行:** 同じバッチで `zero_grad()` なしに `backward()` を 3 回呼ぶと、1 回ごとの `.grad` は
# 1 回目の勾配の何倍でしょうか?

# %% [markdown] lang="en"
# ## Without `zero_grad()` gradients pile up
#
# PyTorch **adds** each `backward()` into `.grad`. The document's training loop has no
# `optimizer.zero_grad()`, so every step's gradient lands on top of the previous ones
# (lesson 04 uses this accumulation on purpose).
#
# **Predict, then run:** three `backward()` calls on the same batch without
# `zero_grad()`: how many times the first gradient does `.grad` hold after each?

# %%
model = models.MLP()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
norms = []
for _ in range(3):
    criterion(model(X), Y).backward()  # no zero_grad, as in the document
    norms.append(model.fc1.weight.grad.norm().item())
print("without zero_grad, times the first:", [f"{n / norms[0]:.2f}" for n in norms])
torch.testing.assert_close(torch.tensor(norms), norms[0] * torch.tensor([1.0, 2, 3]))
piled = norms

norms = []
for _ in range(3):
    optimizer.zero_grad()
    criterion(model(X), Y).backward()
    norms.append(model.fc1.weight.grad.norm().item())
assert norms[0] == norms[1] == norms[2]
fig = plots.line_chart({"no zero_grad()": (range(1, 4), piled),
                        "optimizer.zero_grad()": (range(1, 4), norms)},
                       xlabel="backward_calls", ylabel="grad_norm",
                       title="zero_grad_title", from_zero=True)

# %% [markdown] lang="ja"
# ## 記事 004 の学習ループを書かれたとおりに
#
# 記事 004 の `DataLoader` の例は、オプティマイザを作りますが、学習ループの中で `optimizer.step()` を
# 一度も呼びません。最後の行は括弧のない `loss.backward` なので、勾配も計算されません。
# このループを書かれたとおりに 10 エポック回します。変えたのは、このマシンで止まる所だけです:
# `x.view(-1)` を直したモデル、`.cuda()` の代わりに `.to(device)`、そして GPU がなければ何もしない
# `nn.DataParallel` の包みを外しました。
#
# **予想してから実行:** 10 エポックのあと、モデルの 4 つのパラメータ (重みとバイアス) のうち、いくつが
# 変わっているでしょうか?

# %% [markdown] lang="en"
# ## Doc 004's training loop, as written
#
# Doc 004's `DataLoader` example creates an optimizer, but its training loop never calls
# `optimizer.step()`. Its last line is `loss.backward` without parentheses, so no
# gradient is computed either. Run that loop as written for 10 epochs, changing only what
# stops on this machine: the model with `x.view(-1)` fixed, `.to(device)` instead of
# `.cuda()`, and no `nn.DataParallel` wrapper (without GPUs it does nothing).
#
# **Predict, then run:** after 10 epochs, how many of the model's 4 parameters (weights
# and biases) have changed?

# %%
torch.manual_seed(0)
model = models.MLP().to(device)
train_loader = torch.utils.data.DataLoader(data.MyDataset(seed=0), batch_size=64,
                                           shuffle=True)
criterion = nn.MSELoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)  # created, never used
before = [p.detach().clone() for p in model.parameters()]

for epoch in range(10):
    for batch_idx, (inputs, target) in enumerate(train_loader):  # `data` in the document
        inputs, target = inputs.to(device), target.to(device)
        output = model(inputs)
        loss = criterion(output, target)
        loss.backward  # the document's last line: no call, and no optimizer.step()

changed = sum(not torch.equal(b, p)
              for b, p in zip(before, model.parameters(), strict=True))
print(f"{epoch + 1} epochs, {batch_idx + 1} batches each: {changed} parameters changed")
assert all(p.grad is None for p in model.parameters())
assert changed == 0

# %% [markdown] lang="ja"
# ## 演習: 学習の 1 ステップを書く
#
# `train_step` は、記事 004 の学習ループの中身を書かれたとおりに写したものです。上で見た誤りが
# 3 つあります。直して、正しい 1 回の更新にしてください。確認のセルは、同じ重みから正しい SGD で
# 3 回更新したモデルと比べます。

# %% [markdown] lang="en"
# ## Exercise: write one training step
#
# `train_step` copies the body of doc 004's training loop as written. It has three of the
# mistakes shown above: fix them, so that it makes one correct update. The check compares
# three updates with correct SGD from the same weights.

# %% tags=["exercise"]
def train_step(model, optimizer, criterion, X, y):
    """One update on the batch (X, y), as doc 004 writes it: three mistakes to fix."""
    outputs = model(X)
    loss = criterion(outputs, y)
    loss.backward
    return loss.item()

# %% tags=["solution"]
def train_step(model, optimizer, criterion, X, y):
    """One update on the batch (X, y)."""
    optimizer.zero_grad()  # drop the previous step's gradient
    outputs = model(X)
    loss = criterion(outputs, y)
    loss.backward()  # a call: it computes the gradients
    optimizer.step()
    return loss.item()

# %%
exercises.grade_train_step(train_step)

# %% [markdown] lang="ja"
# ## 直した学習ループ
#
# 記事 004 の `DataLoader` の例 (バッチ 64、シャッフルあり、SGD、学習率 0.01、10 エポック) を、
# 上の問題をすべて直して 1 プロセスで動かします。
#
# 1 ステップは必ず `zero_grad()` → 順伝播 → 損失 → `backward()` → `step()` の順です。

# %% [markdown] lang="en"
# ## The corrected training loop
#
# Doc 004's `DataLoader` example (batch 64, shuffled, SGD, learning rate 0.01, 10 epochs),
# with every problem above fixed, in one process.
#
# Each step is always `zero_grad()` → forward → loss → `backward()` → `step()`.

# %%
def fit(dataset, num_epochs=10, lr=0.01, batch_size=64, seed=0):
    """Train doc 004's corrected model; return the mean loss of each epoch."""
    torch.manual_seed(seed)  # same initial weights for every run
    model = models.MLP().to(device)
    loader = data.make_loader(dataset, batch_size=batch_size, shuffle=True, seed=seed)
    criterion = models.MyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    history = []
    for epoch in range(num_epochs):
        total, count = 0.0, 0
        for X, y in loader:
            X, y = X.to(device), y.to(device)
            optimizer.zero_grad()
            loss = criterion(model(X), y)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(X)
            count += len(X)
        history.append(total / count)
    return history

# %% [markdown] lang="ja"
# ## 記事のデータには学ぶものがない
#
# 記事の `MyDataset` は入力も目標も独立な乱数です。入力から目標を予測する手がかりがないので、
# どんなモデルでも平均二乗誤差は目標値の分散 (約 1) より下がりません。
# 比べるために、重みを乱数で固定した教師ネットワーク (教師モデル) が目標を作る課題 (`TeacherDataset`、
# ノイズの標準偏差 0.1) も用意しました。こちらは学習すると損失が下がります。

# %% [markdown] lang="en"
# ## The document's data has nothing to learn
#
# The document's `MyDataset` draws inputs and targets as independent random numbers.
# Nothing in an input predicts its target, so no model gets the mean squared error below
# the targets' variance (about 1). For comparison, a task whose targets come from a
# teacher network with fixed random weights (`TeacherDataset`, noise with standard deviation 0.1)
# can be learned: its loss falls.

# %%
random_data = data.MyDataset(seed=0)
teacher_data = data.TeacherDataset(seed=0)
curves = {
    "MyDataset": fit(random_data),
    "TeacherDataset": fit(teacher_data),
}
variance = random_data.target.var().item()
fig = plots.loss_curves(curves, xlabel="epoch",
                        references={labkit.t("target_variance"): variance})

# %%
assert min(curves["MyDataset"]) > 0.95 * variance  # stuck near the variance
assert curves["TeacherDataset"][-1] < 0.7 * curves["TeacherDataset"][0]  # learns

# %% [markdown] lang="ja"
# ## 同じシードなら同じ結果
#
# 重みの初期値、データ、シャッフルの順序はすべてシードで決まります。
# CPU では、同じシードで 2 回学習すると損失は 1 ビットも違わず一致します。

# %% [markdown] lang="en"
# ## Same seed, same result
#
# Initial weights, data and shuffling order all come from seeds. On the CPU, training
# twice with the same seed gives bit-identical losses.

# %%
again = fit(teacher_data)
assert again == curves["TeacherDataset"]  # bit for bit

# %% [markdown] lang="ja"
# ## 記事のコードと直し方
#
# | 記事のコード | 何が起きるか | 直し方 |
# |---|---|---|
# | `x = x.view(-1)` | バッチ 100 でエラー、バッチ 1 では形が黙って間違う | `x.flatten(1)` |
# | `DistributedDataParallel(model)` | プロセスグループがなくエラー | 先に `init_process_group` (レッスン 03) |
# | `.cuda()` | GPU がなければエラー | `device` を選んで `.to(device)` |
# | `optimizer.step()` | `optimizer` が未定義 | `torch.optim.SGD(model.parameters(), lr=...)` |
# | `loss.backward` | 呼ばれず、勾配は `None` | `loss.backward()` |
# | `zero_grad` なし | 勾配がステップごとに積み重なる | 毎ステップ `optimizer.zero_grad()` |
# | `optimizer.step()` なし | パラメータが 1 つも変わらない | `backward()` のあとに `optimizer.step()` |
# | `MyDataset` | 学ぶものがない乱数 | 収束を見るには学習できる課題を使う |

# %% [markdown] lang="en"
# ## The documents' code, corrected
#
# | the documents' code | what happens | fix |
# |---|---|---|
# | `x = x.view(-1)` | fails with a batch of 100, silently wrong shape with a batch of 1 | `x.flatten(1)` |
# | `DistributedDataParallel(model)` | fails: no process group | `init_process_group` first (lesson 03) |
# | `.cuda()` | fails without a GPU | choose a `device` and `.to(device)` |
# | `optimizer.step()` | `optimizer` is undefined | `torch.optim.SGD(model.parameters(), lr=...)` |
# | `loss.backward` | never called, gradients stay `None` | `loss.backward()` |
# | no `zero_grad` | gradients pile up step after step | `optimizer.zero_grad()` every step |
# | no `optimizer.step()` | not one parameter changes | `optimizer.step()` after `backward()` |
# | `MyDataset` | random numbers with nothing to learn | use a learnable task to watch convergence |

# %% [markdown] lang="ja" tags=["summary"]
# ## 覚えておくこと
#
# - **平坦化するのは各サンプルで、バッチではありません**。`x.flatten(1)` は次元 0 を残します。`x.view(-1)` は
#   バッチ 100 でエラーになり、バッチ 1 では黙って形を壊します。
# - **括弧のない `loss.backward` は何も計算しません**。勾配は `None` のままで、エラーも出ません。
# - **`backward()` は `.grad` に足し込みます**。毎ステップ `optimizer.zero_grad()` を呼ばないと、勾配が積み重なります。
# - **1 ステップは `zero_grad()` → 順伝播 → 損失 → `backward()` → `step()` です**。`step()` がなければ
#   パラメータは 1 つも変わりません。
# - **収束は学習できる課題で、シードを固定して確かめます**。記事の乱数のデータでは損失が目標値の分散より
#   下がりません。同じシードなら損失はビット単位で一致し、これが以後のレッスンの比べる相手になります。

# %% [markdown] lang="en" tags=["summary"]
# ## What to remember
#
# - **Flatten each sample, not the batch**: `x.flatten(1)` keeps dimension 0;
#   `x.view(-1)` fails on a batch of 100 and silently breaks the shape of a batch of one.
# - **`loss.backward` without parentheses computes nothing**: the gradients stay `None`,
#   and no error says so.
# - **`backward()` adds into `.grad`**: without `optimizer.zero_grad()` every step, the
#   gradients pile up.
# - **A step is `zero_grad()` → forward → loss → `backward()` → `step()`**; without
#   `step()` not one parameter changes.
# - **Watch convergence on a learnable task, with the seeds fixed**: on the documents'
#   random data the loss never gets below the targets' variance, and the same seeds give
#   bit-identical losses, the baseline later lessons compare with.

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

selfcheck.show("01_models")

# %% tags=["self-check"]
# Your answers, "a", "b", "c" or "d" for each question; then run this cell.
my_answers = {1: None, 2: None, 3: None}
selfcheck.check("01_models", my_answers)
