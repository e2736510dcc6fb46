"""What the exercise checks say, in Japanese and English (see labkit.exercises)."""

from __future__ import annotations

from . import i18n

__all__ = ["MESSAGES"]

MESSAGES = {  # key: (ja, en)
    "ex_right": ("✓ 正解です。", "✓ Correct. "),
    "ex_not_yet": ("まだです。", "Not yet. "),
    "ex_off": ("{what} が正解と最大 {diff:.1e} 違います。ヒント: {hint}",
               "{what} is off by up to {diff:.1e}. Hint: {hint}"),
    "ex_value_off": ("{name} = {got:.4g} 秒はモデルの値と違います。ヒント: {hint}",
                     "{name} = {got:.4g} s is not the model's value. Hint: {hint}"),
    "ex_fill_in": ("{name} がまだ None です。自分の答えに置き換えてください。",
                   "{name} is still None: put your answer there."),
    "ex_units": ("{name} はミリ秒の値のようです。答えは秒で書きます。",
                 "{name} looks like milliseconds: answer in seconds."),
    # 01
    "ex_batch": ("形 {shape} の入力の出力が {got} です ({want} のはずです)。ヒント: "
                 "平坦化するのは各サンプルだけで、バッチの次元 (0) は残します。",
                 "An input of shape {shape} gives an output of shape {got}, not "
                 "{want}. Hint: flatten each sample only; keep the batch dimension "
                 "(0)."),
    "ex_batch_error": ("形 {shape} の入力でエラーになりました ({err})。ヒント: "
                       "`x.view(-1)` はバッチ全体を 1 本のベクトルにします。"
                       "平坦化するのは各サンプルだけです。",
                       "An input of shape {shape} fails ({err}). Hint: `x.view(-1)` "
                       "makes the whole batch one vector; flatten each sample only."),
    "ex_batch_fix": ("変えるのは `view(-1)` の行だけです。",
                     "change the `view(-1)` line only."),
    "ex_batch_ok": ("形 {shapes} のどの入力でも、直したモデルと同じ出力です。",
                    "Inputs of shapes {shapes} all give the corrected model's output."),
    "ex_no_backward": ("勾配が None のままです。ヒント: `loss.backward()` "
                       "と括弧を付けます。",
                       "The gradients stay None. Hint: call `loss.backward()`."),
    "ex_no_step": ("パラメータが変わっていません。ヒント: 最後に `optimizer.step()` "
                   "を呼びます。",
                   "The parameters did not change. Hint: end with `optimizer.step()`."),
    "ex_no_zero_grad": (
        "1 回目の更新は正しいのですが、{step} 回目が違います。ヒント: `.grad` "
        "に前の更新の勾配が残っていて、backward() はそこに足します。毎回、最初に "
        "`optimizer.zero_grad()` を呼びます。",
        "Update 1 is right, update {step} is not. Hint: `.grad` still holds the "
        "previous update's gradient and backward() adds to it; start every update "
        "with `optimizer.zero_grad()`."),
    "ex_order_step": ("zero_grad() → 順伝播 → 損失 → backward() → step() の順です。",
                      "zero_grad() → forward → loss → backward() → step()."),
    "ex_train_ok": ("{steps} 回の更新が正しい SGD と一致しました。",
                    "{steps} updates match correct SGD."),
    # 02
    "ex_chunks": ("バッチ {batch} を {n} 台に分けた結果は {pred} ではありません。"
                  "ヒント: 1 つのチャンクの大きさは「バッチ ÷ 台数」の切り上げで、"
                  "小さくなるのは最後のチャンクだけです。"
                  "チャンクの数が台数より少なくなることもあります。",
                  "Batch {batch} on {n} devices is not split as {pred}. Hint: a "
                  "chunk holds batch / devices, rounded up; only the last is "
                  "smaller, and there can be fewer chunks than devices."),
    "ex_chunks_ok": ("どれも `scatter` の分け方と同じです: {sizes}",
                     "All as `scatter` splits them: {sizes}"),
    "ex_dp_type": ("戻り値が {got} で、テンソルではありません。ヒント: 最後に "
                   "`dp.gather(outputs, 0)` で出力を 1 つにつなぎます。",
                   "It returned {got}, not a tensor. Hint: end with "
                   "`dp.gather(outputs, 0)`, which joins the outputs into one."),
    "ex_dp_shape": ("出力の形が {got} です ({want} のはずです)。ヒント: "
                    "出力はバッチの次元 (dim=0) に沿ってつなぎます。",
                    "The output has shape {got}, not {want}. Hint: join the outputs "
                    "along the batch dimension (dim=0)."),
    "ex_dp_replicas": ("模擬デバイス {n} 台で、レプリカが {replicas} 回、"
                       "もとのモデルが {original} 回呼ばれました。ヒント: "
                       "`dp.replicate` で作ったレプリカを `dp.parallel_apply` で、"
                       "チャンクごとに 1 つずつ動かします。",
                       "On {n} simulated devices the replicas ran {replicas} times, "
                       "the original model {original} times. Hint: run the replicas "
                       "made by `dp.replicate` with `dp.parallel_apply`, one per "
                       "chunk."),
    "ex_dp_hint": ("レプリカは `dp.replicate` で作り、"
                   "チャンク i をレプリカ i に入れます。",
                   "make replicas with `dp.replicate`; chunk i goes to replica i."),
    "ex_dp_ok": ("バッチ / 台数 = {cases} で、出力も勾配も 1 デバイスと同じです。",
                 "Outputs and gradients equal one device's for {cases} (batch / "
                 "devices)."),
    # 03
    "ex_epochs": ("エポック {epoch} で、ランクの添字が重なっているか、"
                  "欠けているサンプルがあります。ヒント: 全ランクが同じ `seed` "
                  "と同じエポック番号を使えば、1 つの並びを重ならずに分け合います。",
                  "In epoch {epoch} the ranks' indices overlap or miss samples. "
                  "Hint: with the same `seed` and the same epoch number on every "
                  "rank, the ranks share one order without overlap."),
    "ex_repeats": ("エポック {a} と {b} の並びが同じです。ヒント: 各エポックの初めに "
                   "`sampler.set_epoch(epoch)` を呼びます。",
                   "Epochs {a} and {b} have the same order. Hint: call "
                   "`sampler.set_epoch(epoch)` at the start of each epoch."),
    "ex_epochs_ok": ("どのエポックでも、ランクは全 {n} サンプルを重ならずに分け合い、"
                     "並びはエポックごとに変わりました。",
                     "In every epoch the ranks share all {n} samples without "
                     "overlap, and the order changes from epoch to epoch."),
    "ex_grads_apart": ("ランクの勾配が {diff:.1e} 違います。各ランクの `.grad` は、"
                       "まだ自分の分のデータの勾配です。ヒント: 各パラメータの "
                       "`p.grad` そのものを `dist.all_reduce` します (コピーを "
                       "all-reduce しても `p.grad` は変わりません)。",
                       "The ranks' gradients differ by {diff:.1e}: each `.grad` "
                       "still holds its own share's gradient. Hint: all-reduce each "
                       "parameter's `p.grad` itself (all-reducing a copy leaves "
                       "`p.grad` as it was)."),
    "ex_grads_summed": (
        "勾配が全体バッチの勾配のちょうど {ratio:.0f} 倍です。ヒント: all-reduce "
        "は全ランクの値を足し合わせます。平均にするには world size で割ります。",
        "The gradients are exactly {ratio:.0f} times the whole batch's. Hint: "
        "all-reduce adds up the ranks' values; divide by the world size for their "
        "mean."),
    "ex_mean_hint": ("平均 = 全ランクの和 ÷ world size です。",
                     "the mean is the ranks' sum divided by the world size."),
    "ex_grads_ok": ("どのランクの勾配も、全体バッチの勾配と同じになりました。DDP "
                    "が逆伝播の中で行っていることです。",
                    "Every rank's gradient equals the whole batch's: what DDP does "
                    "during backward."),
    # 04
    "ex_steps": (
        "1 回の更新で `optimizer.step()` が {steps} 回呼ばれました。ヒント: `step()` "
        "は、最後のマイクロバッチで同期したあとに 1 回だけ呼びます。`no_sync` の中で "
        "`step()` すると、レプリカがずれます。",
        "`optimizer.step()` ran {steps} times in one update. Hint: call `step()` "
        "once, after the last micro-batch has synchronized; a `step()` inside "
        "`no_sync` splits the replicas."),
    "ex_no_sync_at_all": ("all-reduce が 1 回もありません。ヒント: "
                          "最後のマイクロバッチは `no_sync` "
                          "の外で順伝播と逆伝播をします。",
                          "No all-reduce ran. Hint: the last micro-batch runs "
                          "forward and backward outside `no_sync`."),
    "ex_sync_every": ("1 回の更新で all-reduce が {calls} 回起きました (1 "
                      "回のはずです)。ヒント: 最初の K−1 個のマイクロバッチは、"
                      "順伝播も逆伝播も `with model.no_sync():` の中で行います。",
                      "An update ran {calls} all-reduces, not 1. Hint: the first K−1 "
                      "micro-batches run both forward and backward inside `with "
                      "model.no_sync():`."),
    "ex_apart": ("{step} 回目の更新で、ランクのパラメータが {diff:.1e} ずれました。"
                 "ヒント: `step()` の前に全ランクの勾配がそろっている必要があります。"
                 "同期させるのは最後のマイクロバッチです。",
                 "Update {step} left the ranks' parameters {diff:.1e} apart. Hint: "
                 "every rank needs the same gradient before `step()`; the last "
                 "micro-batch is the one to synchronize."),
    "ex_not_divided": ("更新の大きさが、K 倍のバッチでの更新の {ratio:.1f} 倍です。"
                       "ヒント: 各マイクロバッチの損失を K で割ります。",
                       "The update is {ratio:.1f} times the K-times batch's. Hint: "
                       "divide each micro-batch's loss by K."),
    "ex_order_accum": ("zero_grad()、K−1 個を no_sync の中、最後の 1 個を外、step()。",
                       "zero_grad(), K−1 inside no_sync, the last outside, step()."),
    "ex_accum_ok": ("{updates} 回の更新のどれでも、all-reduce は 1 回、"
                    "レプリカは一致し、K 倍のバッチで 1 回更新したのと同じ結果です。",
                    "In all {updates} updates: one all-reduce, identical replicas, "
                    "and the same result as one update on the K-times batch."),
    "ex_lr_apart": ("ランクの学習率が違います ({lrs})。ヒント: `scheduler.step()` "
                    "も全ランクで呼びます。`if rank == 0:` の中に置くのは、"
                    "記録や保存のようにパラメータを変えない処理だけです。",
                    "The ranks' learning rates differ ({lrs}). Hint: every rank "
                    "calls `scheduler.step()`; only work that changes no parameter, "
                    "such as logging and saving, goes under `if rank == 0:`."),
    "ex_train_apart": (
        "ランクのパラメータが {diff:.1e} 違います。ヒント: 全ランクが、"
        "同じ勾配と同じ学習率で、同じ回数だけ `step()` します。",
        "The ranks' parameters differ by {diff:.1e}. Hint: every rank calls `step()` "
        "as often, with the same gradient and learning rate."),
    "ex_only_line": ("直すのは、レプリカをずらしていた行だけです。",
                     "change only the line that split the replicas."),
    "ex_diverge_ok": ("レプリカは一致し、学習率はどのランクも {lr:g} です。",
                      "The replicas agree; every rank ends at learning rate {lr:g}."),
    # 05
    "ex_nosync_once": ("{name} の式では K 回同期しています。ヒント: no_sync では、"
                       "同期は 1 回の更新につき 1 回です。",
                       "{name} synchronizes K times. Hint: with no_sync an update "
                       "synchronizes once."),
    "ex_sync_k": ("{name} の式では同期が 1 回です。ヒント: no_sync を使わなければ、K "
                  "個のマイクロバッチのそれぞれで同期します。",
                  "{name} synchronizes once. Hint: without no_sync each of the K "
                  "micro-batches synchronizes."),
    "ex_forgot_o": ("{name} の式に o がありません。ヒント: 1 回の更新ごとに o が 1 "
                    "回加わります。",
                    "{name} lacks o. Hint: every update adds o once."),
    "ex_forgot_k": ("{name} の式では c が 1 回分です。ヒント: 順伝播と逆伝播は、K "
                    "個のマイクロバッチのそれぞれで行います。",
                    "{name} counts c once. Hint: each of the K micro-batches runs "
                    "forward and backward."),
    "ex_step_hint": ("c が K 回、s が K 回 (no_sync なら 1 回)、o が 1 回です。",
                     "c K times, s K times (once with no_sync), o once."),
    "ex_step_ok": ("K = {K}: 同期あり {sync:.1f} ms、no_sync {nosync:.1f} ms "
                   "の予測です。",
                   "Predicted for K = {K}: sync {sync:.1f} ms, no_sync {nosync:.1f} "
                   "ms."),
    "ex_bytes": ("{name} の式では、パラメータの数をバイト数として使っています。"
                 "ヒント: float32 は 1 つ 4 バイトです。",
                 "{name} takes the number of parameters for bytes. Hint: a float32 "
                 "takes 4 bytes."),
    "ex_ring": ("{name} の式の係数が違います。ヒント: n ランクのリング all-reduce "
                "では、各ランクが S の 2(n−1)/n 倍を送ります。",
                "{name} has a wrong factor. Hint: in a ring all-reduce over n ranks "
                "each rank sends 2(n−1)/n times S."),
    "ex_alpha_steps": ("{name} の式では α を 1 回しか払っていません。ヒント: "
                       "リング all-reduce は 2(n−1) ステップで、"
                       "ステップごとに α がかかります。",
                       "{name} pays alpha once. Hint: a ring all-reduce takes 2(n−1) "
                       "steps, and each step pays alpha."),
    "ex_ab_hint": ("時間 = 2(n−1) × α + 2(n−1)/n × S / β、S はバイト数です。",
                   "time = 2(n−1) × alpha + 2(n−1)/n × S / beta, S in bytes."),
    "ex_ab_ok": ("{n} ランクで {ms:.2f} ms の予測です (2 ランクでは {ms2:.2f} ms)。",
                 "The model predicts {ms:.2f} ms on {n} ranks ({ms2:.2f} ms on 2)."),
}
i18n.register({key: {"ja": ja, "en": en} for key, (ja, en) in MESSAGES.items()})
