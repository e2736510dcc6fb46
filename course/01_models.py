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
# この講座の出発点の 2 つの記事 (no_sync の解説 = 記事 000、data_parallel の解説 = 記事 004) のコードは、
# そのままでは動きません。**書かれたとおりに**実行して失敗を確かめ、直したモデルを 1 プロセスで学習させます。
# これが以後のレッスンの比べる相手です。
#
# このレッスンを終えると、次のことができます。
#
# - 記事のコードの誤りを、失敗させて示し、直せる。
# - `zero_grad()` → 順伝播 → 損失 → `backward()` → `step()` の 1 ステップを書ける。
# - 学習できる課題で、シードを固定して学習を再現できる。

# %% [markdown] lang="en" tags=["outcomes"]
# # 01 The documents' models
#
# The course starts from two Japanese articles (quoted here: doc 000 on `no_sync`, doc
# 004 on `data_parallel`) whose code does not run. See it fail **as written**, then
# train the corrected model in one process: the baseline for later lessons.
#
# After this lesson you can:
#
# - show each of the documents' mistakes failing, and fix it;
# - write the step `zero_grad()` → forward → loss → `backward()` → `step()`;
# - train on a learnable task, reproducibly from its seeds.

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
# 記事 004 のモデル (`labkit.models.MLPAsWritten`) は最初に `x = x.view(-1)` とします。100 サンプルのバッチは
# 長さ 1000 の 1 本のベクトルになり、`fc1 = nn.Linear(10, 100)` に入りません。

# %% [markdown] lang="en"
# ## Doc 004's model, as written
#
# Doc 004's model (`labkit.models.MLPAsWritten`) starts with `x = x.view(-1)`: a batch
# of 100 becomes one vector of 1000 values, too long for `fc1 = nn.Linear(10, 100)`.

# %%
X, Y = torch.randn(100, 10), torch.randn(100, 10)  # doc 004's batch and targets
as_written = models.MLPAsWritten()
with checks.expect_error(RuntimeError, match="shapes cannot be multiplied"):
    as_written(X)

# %% [markdown] lang="ja"
# 記事 000 のモデルも同じように失敗します。

# %% [markdown] lang="en"
# Doc 000's model fails the same way.

# %% tags=["hide-input"]
with checks.expect_error(RuntimeError, match="shapes cannot be multiplied"):
    models.TwoLinearAsWritten()(X)

# %% [markdown] lang="ja"
# ## バッチが 1 のときは黙って間違える
#
# **予想してから実行:** 1 サンプル `(1, 10)` ならエラーになるでしょうか。ならないなら、出力はどんな形でしょうか?

# %% [markdown] lang="en"
# ## With a batch of one it is silently wrong
#
# **Predict, then run:** does one sample, `(1, 10)`, fail? If not, what shape is the
# output?

# %%
as_written(torch.randn(1, 10)).shape

# %% [markdown] lang="ja"
# エラーは出ませんが、形は `(10,)` で、バッチの次元が消えています。図のとおり、`fc1` に入るのは 1 サンプルの
# ときだけです。

# %% [markdown] lang="en"
# No error, but the shape is `(10,)`: the batch dimension is gone. The figure shows why:
# `fc1` fits only one sample.

# %% tags=["hide-input"]
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
# ## 演習: `view(-1)` を直す
#
# 印の 1 行を直して、どんなバッチでもサンプルごとの出力を返すようにしてください。確認のセルは 3 つの形の
# バッチで試します。

# %% [markdown] lang="en"
# ## Exercise: fix `view(-1)`
#
# Fix the marked line so that any batch gives one output per sample; the check tries
# three batch shapes.

# %% tags=["exercise"]
class FixedMLP(models.MLPAsWritten):
    def forward(self, x):
        x = x.view(-1)  # <- fix this line
        return self.fc2(torch.relu(self.fc1(x)))

# %% tags=["solution"]
class FixedMLP(models.MLPAsWritten):
    """Doc 004's model, fixed: flatten each sample, keep the batch dimension."""

    def forward(self, x):
        x = x.flatten(1)  # (N, ...) -> (N, features): one row per sample
        return self.fc2(torch.relu(self.fc1(x)))

# %%
exercises.grade_keeps_batch(FixedMLP)

# %% [markdown] lang="ja"
# ## 直し方: サンプルごとに平坦化する
#
# `x.flatten(1)` はバッチの次元を残します (`labkit.models.MLP` と `TwoLinear`)。1 サンプルなら元のモデルと
# 同じ値を返します。

# %% [markdown] lang="en"
# ## The fix: flatten each sample
#
# `x.flatten(1)` keeps the batch dimension (`labkit.models.MLP`, `TwoLinear`); one
# sample gives the original's numbers.

# %%
model = models.MLP()
model.load_state_dict(as_written.state_dict())
Y_hat = model(X)
Y_hat.shape

# %% tags=["hide-input"]
assert Y_hat.shape == (100, 10)
assert torch.equal(model(x1)[0], as_written(x1))
torch.testing.assert_close(Y_hat[7], model(X[7:8])[0])  # each row is its sample's output
assert models.TwoLinear()(X).shape == (100, 10)

# %% [markdown] lang="ja"
# ## DDP はプロセスグループなしでは作れない
#
# 記事 000 は、プロセスグループを作る前に `DistributedDataParallel(model)` を呼びます (作り方はレッスン 03)。

# %% [markdown] lang="en"
# ## DDP cannot be built without a process group
#
# Doc 000 calls `DistributedDataParallel(model)` before any process group exists
# (lesson 03 creates one).

# %%
with checks.expect_error(ValueError, match="process group has not been initialized"):
    nn.parallel.DistributedDataParallel(models.TwoLinear())

# %% [markdown] lang="ja"
# ## 記事 004 の「カスタム損失関数」の例
#
# 問題は 3 つです。`.cuda()` は GPU が必要、`optimizer` が未定義、`MyLoss` は `nn.MSELoss()` と同じです。

# %% [markdown] lang="en"
# ## Doc 004's "custom loss" example
#
# Three problems: `.cuda()` needs a GPU, `optimizer` is never defined, and `MyLoss` is
# just `nn.MSELoss()`.

# %% tags=["hide-input"]
if not torch.cuda.is_available():
    # A CPU-only build raises AssertionError; a CUDA build without a GPU, RuntimeError.
    with checks.expect_error((AssertionError, RuntimeError)):
        torch.randn(100, 10).cuda()

# %%
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# %%
criterion = models.MyLoss()
criterion(Y_hat, Y).item()

# %% tags=["hide-input"]
with checks.expect_error(NameError, match="optimizer"):
    optimizer.step()  # noqa: F821  (undefined, as in the document)
torch.testing.assert_close(criterion(Y_hat, Y), nn.MSELoss()(Y_hat, Y))

# %% [markdown] lang="ja"
# ## `loss.backward` と `loss.backward()` は違う
#
# 記事 004 の最後の行、括弧のない `loss.backward` は呼び出されません。勾配は黙って `None` のままです。

# %% [markdown] lang="en"
# ## `loss.backward` is not `loss.backward()`
#
# Doc 004's last line, `loss.backward` without parentheses, is never called: the
# gradients silently stay `None`.

# %%
loss = criterion(model(X), Y)  # the fixed model above: no gradient yet
loss.backward  # as in the document: nothing happens
[p.grad for p in model.parameters()]

# %% tags=["hide-input"]
assert all(p.grad is None for p in model.parameters())
loss.backward()  # the call computes the gradients
assert all(p.grad is not None for p in model.parameters())

# %% [markdown] lang="ja"
# ## `zero_grad()` を忘れると勾配がたまる
#
# `backward()` は `.grad` に**足し込みます**が、記事は `zero_grad()` を呼びません。
#
# **予想してから実行:** 同じバッチで `backward()` を 3 回呼ぶと、`.grad` は 1 回目の何倍になるでしょうか?

# %% [markdown] lang="en"
# ## Without `zero_grad()` gradients pile up
#
# `backward()` **adds** into `.grad`, and the document never calls `zero_grad()`.
#
# **Predict, then run:** three `backward()` calls on one batch: how many times the first
# gradient does `.grad` hold after each?

# %%
model = models.MLP()
piled = []  # the norm of fc1's gradient after each backward()
for _ in range(3):
    criterion(model(X), Y).backward()  # no zero_grad, as in the document
    piled.append(model.fc1.weight.grad.norm().item())

# %% tags=["hide-input"]
cleared = []  # the same, with zero_grad() before each backward()
for _ in range(3):
    model.zero_grad()
    criterion(model(X), Y).backward()
    cleared.append(model.fc1.weight.grad.norm().item())
print("without zero_grad, times the first:", [f"{n / piled[0]:.2f}" for n in piled])
torch.testing.assert_close(torch.tensor(piled), piled[0] * torch.tensor([1.0, 2, 3]))
assert cleared[0] == cleared[1] == cleared[2]
fig = plots.line_chart({"no zero_grad()": (range(1, 4), piled),
                        "zero_grad()": (range(1, 4), cleared)},
                       xlabel="backward_calls", ylabel="grad_norm",
                       title="zero_grad_title", from_zero=True)

# %% [markdown] lang="ja"
# ## 記事 004 の学習ループを書かれたとおりに
#
# ループは `optimizer.step()` も `loss.backward()` も呼びません。ここで動くように変えたのは、直したモデル、
# `.to(device)`、`nn.DataParallel` なし、の 3 点だけです。
#
# **予想してから実行:** 10 エポックのあと、4 つのパラメータのうち、いくつが変わっているでしょうか?

# %% [markdown] lang="en"
# ## Doc 004's training loop, as written
#
# The loop calls neither `optimizer.step()` nor `loss.backward()`. Changed only to run
# here: the fixed model, `.to(device)`, no `nn.DataParallel`.
#
# **Predict, then run:** after 10 epochs, how many of the 4 parameters have changed?

# %%
torch.manual_seed(0)
model = models.MLP().to(device)
train_loader = torch.utils.data.DataLoader(data.MyDataset(seed=0), batch_size=64,
                                           shuffle=True)
criterion = nn.MSELoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)  # created, never used

for epoch in range(10):
    for batch_idx, (inputs, target) in enumerate(train_loader):  # `data` in the document
        inputs, target = inputs.to(device), target.to(device)
        output = model(inputs)
        loss = criterion(output, target)
        loss.backward  # the document's last line: no call, and no optimizer.step()

# %% tags=["hide-input"]
torch.manual_seed(0)
before = models.MLP().to(device)  # the same seed: the weights the loop started from
changed = sum(not torch.equal(b, p)
              for b, p in zip(before.parameters(), model.parameters(), strict=True))
print(f"{epoch + 1} epochs, {batch_idx + 1} batches each: {changed} parameters changed")
assert all(p.grad is None for p in model.parameters())
assert changed == 0

# %% [markdown] lang="ja"
# ## 演習: 学習の 1 ステップを書く
#
# `train_step` は記事 004 のループの中身で、上の誤りが 3 つあります。直してください。

# %% [markdown] lang="en"
# ## Exercise: write one training step
#
# `train_step` is doc 004's loop body, with three of the mistakes above: fix them.

# %% tags=["exercise"]
def train_step(model, optimizer, criterion, X, y):
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
# 記事 004 の例 (バッチ 64、シャッフルあり、SGD、学習率 0.01、10 エポック) を、上の誤りをすべて直して回します。
# 1 ステップは `zero_grad()` → 順伝播 → 損失 → `backward()` → `step()` の順です。

# %% [markdown] lang="en"
# ## The corrected training loop
#
# Doc 004's example (batch 64, shuffled, SGD, learning rate 0.01, 10 epochs), every
# mistake above fixed. Each step is `zero_grad()` → forward → loss → `backward()` →
# `step()`.

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
        total = 0.0
        for X, y in loader:
            X, y = X.to(device), y.to(device)
            optimizer.zero_grad()
            loss = criterion(model(X), y)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(X)
        history.append(total / len(dataset))
    return history

# %% [markdown] lang="ja"
# ## 記事のデータには学ぶものがない
#
# `MyDataset` の入力と目標は独立な乱数で、損失は目標値の分散 (約 1) から下がりません。固定した乱数の
# ネットワークが目標を作る `TeacherDataset` なら学習できます。

# %% [markdown] lang="en"
# ## The document's data has nothing to learn
#
# `MyDataset`'s inputs and targets are independent random numbers: the loss stays at the
# targets' variance (about 1). `TeacherDataset`, made by a fixed random network, can be
# learned.

# %%
random_data = data.MyDataset(seed=0)
teacher_data = data.TeacherDataset(seed=0)
curves = {"MyDataset": fit(random_data), "TeacherDataset": fit(teacher_data)}

# %% tags=["hide-input"]
variance = random_data.target.var().item()
fig = plots.loss_curves(curves, xlabel="epoch",
                        references={labkit.t("target_variance"): variance})
assert min(curves["MyDataset"]) > 0.95 * variance  # stuck near the variance
assert curves["TeacherDataset"][-1] < 0.7 * curves["TeacherDataset"][0]  # learns

# %% [markdown] lang="ja"
# ## 同じシードなら同じ結果
#
# 初期値、データ、シャッフルはシードで決まり、CPU では損失がビット単位で一致します。

# %% [markdown] lang="en"
# ## Same seed, same result
#
# Weights, data and shuffling come from seeds: on the CPU the losses match bit for bit.

# %%
assert fit(teacher_data) == curves["TeacherDataset"]  # bit for bit

# %% [markdown] lang="ja"
# ## 記事のコードと直し方
#
# <details><summary>8 つの誤りを 1 つの表で</summary>
#
# | 記事のコード | 何が起きるか | 直し方 |
# |---|---|---|
# | `x = x.view(-1)` | バッチ 100 でエラー、バッチ 1 では形が黙って間違う | `x.flatten(1)` |
# | `DistributedDataParallel(model)` | プロセスグループがなくエラー | 先に `init_process_group` (レッスン 03) |
# | `.cuda()` | GPU がなければエラー | `.to(device)` |
# | `optimizer.step()` | `optimizer` が未定義 | `torch.optim.SGD(...)` |
# | `loss.backward` | 呼ばれず、勾配は `None` | `loss.backward()` |
# | `zero_grad` なし | 勾配が積み重なる | 毎ステップ `optimizer.zero_grad()` |
# | `optimizer.step()` なし | パラメータが変わらない | `backward()` のあとに `optimizer.step()` |
# | `MyDataset` | 学ぶものがない | 学習できる課題を使う |
#
# </details>

# %% [markdown] lang="en"
# ## The documents' code, corrected
#
# <details><summary>The eight mistakes in one table</summary>
#
# | the documents' code | what happens | fix |
# |---|---|---|
# | `x = x.view(-1)` | fails on a batch of 100, wrong shape on a batch of 1 | `x.flatten(1)` |
# | `DistributedDataParallel(model)` | fails: no process group | `init_process_group` first (lesson 03) |
# | `.cuda()` | fails without a GPU | `.to(device)` |
# | `optimizer.step()` | `optimizer` is undefined | `torch.optim.SGD(...)` |
# | `loss.backward` | never called, gradients stay `None` | `loss.backward()` |
# | no `zero_grad` | gradients pile up | `optimizer.zero_grad()` every step |
# | no `optimizer.step()` | no parameter changes | `optimizer.step()` after `backward()` |
# | `MyDataset` | nothing to learn | a learnable task |
#
# </details>

# %% [markdown] lang="ja" tags=["summary"]
# ## 覚えておくこと
#
# - **平坦化するのは各サンプルで、バッチではありません**。`x.view(-1)` はバッチ 1 で黙って形を壊します。
# - **括弧のない `loss.backward` は何も計算しません**。
# - **1 ステップは `zero_grad()` → 順伝播 → 損失 → `backward()` → `step()` です**。
# - **収束は学習できる課題で、シードを固定して確かめます**。

# %% [markdown] lang="en" tags=["summary"]
# ## What to remember
#
# - **Flatten each sample, not the batch**: `x.view(-1)` silently breaks a batch of one.
# - **`loss.backward` without parentheses computes nothing.**
# - **A step is `zero_grad()` → forward → loss → `backward()` → `step()`.**
# - **Check convergence on a learnable task, with the seeds fixed.**

# %% [markdown] lang="ja" tags=["self-check"]
# ## 確認問題
#
# 答えを決めてから、折りたたみを開いてください。

# %% [markdown] lang="en" tags=["self-check"]
# ## Self-check
#
# Choose your answers before opening their folds.

# %% tags=["self-check"]
from labkit import selfcheck

selfcheck.show("01_models")

# %% tags=["self-check"]
# Your answers, "a", "b", "c" or "d" for each question; then run this cell.
my_answers = {1: None, 2: None, 3: None}
selfcheck.check("01_models", my_answers)
