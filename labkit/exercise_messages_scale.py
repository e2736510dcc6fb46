"""What the checks of labkit.exercises_scale say, in Japanese and English."""

from __future__ import annotations

from . import i18n

__all__ = ["MESSAGES"]

MESSAGES = {  # key: (ja, en)
    # 06: the learning rate of a large batch
    "ex_lr_not_scaled": (
        "ウォームアップのあと、バッチ {batch} の学習率が {got:g} で、バッチ 32 "
        "のときと同じです。ヒント: 学習率をバッチサイズに比例させます (0.2 の "
        "batch_size / 32 倍)。",
        "After the warm-up, batch {batch} trains at {got:g}, the rate of batch 32. "
        "Hint: scale the rate with the batch: batch_size / 32 times 0.2."),
    "ex_lr_sqrt": (
        "ウォームアップのあと、バッチ {batch} の学習率が {got:g} で、0.2 × "
        "√(batch_size / 32) (平方根に比例させる規則) になっています。ヒント: "
        "このレッスンでは、学習率をバッチサイズそのものに比例させます。",
        "After the warm-up, batch {batch} trains at {got:g}, "
        "0.2 × √(batch_size / 32): the square-root rule. Hint: this lesson scales the "
        "rate linearly with the batch."),
    "ex_lr_peak": (
        "ウォームアップのあと、バッチ {batch} の学習率が {got:g} で、"
        "比例させた値になっていません。ヒント: バッチが 16 倍なら学習率も 16 倍です "
        "(0.2 × batch_size / 32)。",
        "After the warm-up, batch {batch} trains at {got:g}, not the scaled rate. "
        "Hint: 16 times the batch, 16 times the rate (0.2 × batch_size / 32)."),
    "ex_lr_no_warmup": (
        "バッチ {batch} で、ステップ 0 から最大の学習率になっています。"
        "ウォームアップがありません。ヒント: LinearLR は start_factor × 最大値 = "
        "最大値 / 20 から始まります。",
        "Batch {batch} trains at the peak rate from step 0: there is no warm-up. "
        "Hint: LinearLR starts at start_factor × peak = peak / 20."),
    "ex_lr_from_zero": (
        "ステップ 0 の学習率が 0 です (バッチ {batch})。これでは最初の更新で"
        "何も変わりません。ヒント: LinearLR は 0 ではなく、start_factor × 最大値 = "
        "最大値 / 20 から始まります。",
        "At step 0 the rate is 0 (batch {batch}): the first update does nothing. "
        "Hint: LinearLR starts at start_factor × peak = peak / 20, not at 0."),
    "ex_lr_from_base": (
        "ステップ 0 で、バッチ {batch} の学習率が {got:g} (バッチ 32 の学習率) です。"
        "Goyal らの論文のウォームアップはここから始まります。ヒント: このレッスンの "
        "LinearLR(start_factor=1/20) は、最大値 / 20 から始まります。",
        "At step 0 batch {batch} gets {got:g}, the rate of batch 32, where Goyal et "
        "al.'s warm-up starts. Hint: the lesson's LinearLR(start_factor=1/20) starts "
        "at peak / 20."),
    "ex_lr_start": (
        "ステップ 0 で、バッチ {batch} の学習率が {got:g} です。ヒント: LinearLR は "
        "start_factor × 最大値 = 最大値 / 20 から始まります (上の実行では、バッチ 512 "
        "で 0.16)。",
        "At step 0 batch {batch} gets {got:g}. Hint: LinearLR starts at "
        "start_factor × peak = peak / 20 (0.16 at batch 512 in the run above)."),
    "ex_lr_warmup_end": (
        "バッチ {batch} の学習率が最大値に届くのがステップ {step} です。ヒント: "
        "LinearLR(total_iters=20) が最大値に届くのはステップ 20 です。"
        "それまでの倍率は 1/20 + (1 − 1/20) × step / 20 です。",
        "Batch {batch} reaches the peak at step {step}. Hint: "
        "LinearLR(total_iters=20) reaches it at step 20; until then the factor is "
        "1/20 + (1 − 1/20) × step / 20."),
    "ex_lr_hint": (
        "ステップ 0 から 20 まで、学習率は直線で上がります。",
        "from step 0 to step 20 the rate rises in a straight line."),
    "ex_lr_ok": (
        "バッチ 512 では、ステップ 0 で {first:.2f}、そこから直線で上がり、ステップ "
        "{steps} で {peak:g} になります。上の実行の LinearLR と同じです。",
        "Batch 512: {first:.2f} at step 0, then up in a straight line to {peak:g} at "
        "step {steps}, as LinearLR in the run above."),
    # 06: SyncBatchNorm's statistics by hand
    "ex_bn_shape": (
        "平均と分散の 2 つのテンソルを返します。どちらも特徴ごとに 1 つずつ、"
        "{features} 個の値です。",
        "Return two tensors, the mean and the variance, each with one value per "
        "feature ({features})."),
    "ex_bn_local": (
        "`{what}` が各ランクのバッチだけの統計で、ランクごとに違う値で正規化することに"
        "なります。ヒント: 必要な量 (サンプル数、和など) を all-reduce して、"
        "どのランクも全サンプルの統計を得るようにします。",
        "`{what}` is each rank's own statistic, so the ranks normalize differently. "
        "Hint: all-reduce what you need (the number of samples, the sum, ...) so that "
        "every rank gets the statistics of all samples."),
    "ex_bn_count": (
        "`{what}` で、all-reduce した和を自分のランクのサンプル数で割っています。"
        "ヒント: 全ランクのサンプル数で割ります。サンプル数も all-reduce します。",
        "`{what}` divides the all-reduced sum by this rank's number of samples. Hint: "
        "divide by the number of all ranks' samples; all-reduce that too."),
    "ex_bn_mean_of_means": (
        "`{what}` がランクごとの平均の平均です。バッチの大きさが違うと、"
        "小さいバッチのサンプルほど重く数えられます。ヒント: 和とサンプル数をそれぞれ "
        "all-reduce してから割ります。",
        "`{what}` is the average of the ranks' means. With batches of different sizes "
        "that gives the samples of a small batch more weight. Hint: all-reduce the "
        "sums and the numbers of samples, then divide."),
    "ex_bn_not_divided": (
        "`{what}` が全サンプルの和のままです。ヒント: 全ランクのサンプル数で割ります。",
        "`{what}` is a sum over all samples. Hint: divide by the number of all ranks' "
        "samples."),
    "ex_bn_var_of_vars": (
        "`{what}` がランクごとの分散の平均で、ランクの平均どうしの離れ具合が"
        "抜けています。ヒント: 各サンプルの、全体の平均からのずれで計算します "
        "(または二乗和を all-reduce します)。",
        "`{what}` averages the ranks' variances and misses how far apart the ranks' "
        "means lie. Hint: take every sample's distance from the global mean (or "
        "all-reduce the sums of squares)."),
    "ex_bn_unbiased": (
        "`{what}` が不偏分散 (サンプル数 − 1 で割ったもの) です。ヒント: BatchNorm "
        "が正規化に使うのは、サンプル数で割った分散です。",
        "`{what}` is the unbiased variance (divided by the number of samples − 1). "
        "Hint: BatchNorm normalizes with the variance divided by the number of "
        "samples."),
    "ex_bn_squares": (
        "`{what}` が二乗の平均です。ヒント: 分散は「二乗の平均 − 平均の二乗」です。",
        "`{what}` is the mean of the squares. Hint: the variance is the mean of the "
        "squares minus the square of the mean."),
    "ex_bn_hint": (
        "どのランクも、全ランクのサンプルを合わせた同じ平均と分散を得ます。",
        "every rank ends with the same mean and variance, those of all ranks' samples "
        "together."),
    "ex_bn_ok": (
        "サンプル数がランクごとに違っても ({counts} = {total})、どのランクも"
        "全サンプルの平均と分散を得ました。SyncBatchNorm が学習中の正規化に"
        "使う値です。",
        "With {counts} = {total} samples on the ranks, every rank got the mean and "
        "variance of all of them: what SyncBatchNorm normalizes with in training."),
    # 07: what torchrun hands each process
    "ex_env_form": (
        "{name} は、そのノードのプロセスごとに 1 つの dict (キーは RANK、LOCAL_RANK、"
        "WORLD_SIZE、値は数) を並べたリストを返すようにします。",
        "{name} should be a list of one dict per process of the node, with the keys "
        "RANK, LOCAL_RANK and WORLD_SIZE (numbers)."),
    "ex_env_count": (
        "{name} のプロセスが {got} 個ですが、このノードで動くのは {nproc} 個です。"
        "ヒント: このノードのプロセスごとに 1 つ、LOCAL_RANK の順に並べます。",
        "{name} lists {got} processes; the node runs {nproc}. Hint: one entry per "
        "process of this node, in LOCAL_RANK order."),
    "ex_env_rank_local": (
        "{name} の RANK が LOCAL_RANK と同じです。これでは、どのノードにもランク 0 "
        "ができてしまいます。ヒント: RANK は全ノードのプロセスの通し番号です。"
        "このノードより前のノードに、node_rank × nproc_per_node "
        "個のプロセスがあります。",
        "{name} gives RANK equal to LOCAL_RANK, so every node would have a rank 0. "
        "Hint: RANK numbers the processes of all nodes; the nodes before this one run "
        "node_rank × nproc_per_node of them."),
    "ex_env_rank_sum": (
        "{name} の RANK が node_rank + LOCAL_RANK で、ノードの間で番号が重なります "
        "(1 ノードあたり 2 プロセスなら、ノード 0 の 2 番目とノード 1 の 1 番目が"
        "どちらもランク 1)。ヒント: 前の各ノードに nproc_per_node 個ずつ"
        "プロセスがあります。",
        "{name} gives RANK = node_rank + LOCAL_RANK, so nodes share numbers (with 2 "
        "processes a node, node 0's second and node 1's first are both rank 1). Hint: "
        "every node before this one runs nproc_per_node processes."),
    "ex_env_rank_interleaved": (
        "{name} は、ノードを順に巡って番号を付けています "
        "(RANK = LOCAL_RANK × nnodes + node_rank)。ヒント: torchrun は"
        "ノードごとにまとめて番号を付けます。ノード 0 のプロセスが先、"
        "次にノード 1 のプロセス、という順です。",
        "{name} numbers the processes across the nodes in turn (RANK = LOCAL_RANK × "
        "nnodes + node_rank). Hint: torchrun numbers node by node: node 0's processes "
        "first, then node 1's, and so on."),
    "ex_env_rank": (
        "{name} の RANK が違います: {got}。ヒント: RANK はノード 0 "
        "のプロセスから順に付けた、全ノードの通し番号です。",
        "{name} gives other RANKs: {got}. Hint: RANK numbers the processes of all "
        "nodes, node 0's first."),
    "ex_env_local": (
        "{name} の LOCAL_RANK が違います: {got}。ヒント: LOCAL_RANK "
        "はノードの中での番号で、どのノードでも 0 から nproc_per_node − 1 までです "
        "(そのノードの GPU を選ぶのに使います)。",
        "{name} gives other LOCAL_RANKs: {got}. Hint: LOCAL_RANK numbers the "
        "processes within the node, 0 to nproc_per_node − 1 on every node (it picks "
        "the node's GPU)."),
    "ex_env_world_nproc": (
        "{name} の WORLD_SIZE が nproc_per_node で、このノードのプロセスだけを"
        "数えています。ヒント: WORLD_SIZE は全ノードのプロセスの数です。",
        "{name} gives WORLD_SIZE = nproc_per_node, the processes of this node only. "
        "Hint: WORLD_SIZE counts the processes of all nodes."),
    "ex_env_world": (
        "{name} の WORLD_SIZE が違います: {got}。ヒント: WORLD_SIZE "
        "は全ノードのプロセスの数で、どのプロセスでも同じです。",
        "{name} gives another WORLD_SIZE: {got}. Hint: WORLD_SIZE is the number of "
        "processes of all nodes, the same in every process."),
    "ex_env_real": (
        "ノード {node} について、関数は {got} ですが、本物の torchrun は {real} "
        "でした。",
        "For node {node} the function gives {got}, but the real torchrun gave {real}."),
    "ex_env_ok_formula": (
        "2〜32 プロセスのどの場合も式が合っています。",
        "The formulas agree for 2 to 32 processes."),
    "ex_env_ok": (
        "2〜32 プロセスのどの場合も式が合っています。このマシンで本物の torchrun "
        "(2 ノード × 2 プロセス) を実行した結果も同じでした "
        "({nodes}、WORLD_SIZE 4)。",
        "The formulas agree for 2 to 32 processes, and a real torchrun of 2 nodes × 2 "
        "processes here gave the same ({nodes}; WORLD_SIZE 4)."),
    # 07: how much of each parameter a rank holds under fully_shard
    "ex_shard_whole": (
        "values_held({shape}, {rank}, {n}) = {got} はパラメータ全体です。"
        "全ランクがすべてを持つのは DDP です。ヒント: fully_shard では、各ランクは"
        " 0 番目の次元の自分の分だけを持ちます。",
        "values_held({shape}, {rank}, {n}) = {got} is the whole parameter: every rank "
        "holding everything is DDP. Hint: under fully_shard a rank keeps only its "
        "piece of dimension 0."),
    "ex_shard_even": (
        "values_held({shape}, {rank}, {n}) = {got} は、値の数を均等に分けた数です。"
        "ヒント: fully_shard は torch.chunk と同じく行 (0 番目の次元) ごとに切ります。"
        "1 つの行が分かれることはありません。",
        "values_held({shape}, {rank}, {n}) = {got} is an even share of the values. "
        "Hint: fully_shard cuts whole rows (dimension 0), as torch.chunk does; a row "
        "is never split."),
    "ex_shard_padding": (
        "values_held({shape}, {rank}, {n}) = {got} はパディング まで"
        "数えています。ヒント: torch.chunk では、最後のほうのランクの行は"
        "少ないか、ありません。FSDP2 は all-gather のために内部で同じ大きさに"
        "詰めますが、`to_local()` にあるのは本物の行だけです。",
        "values_held({shape}, {rank}, {n}) = {got} counts padding. Hint: torch.chunk "
        "gives the last ranks fewer rows, or none. FSDP2 pads the pieces to one size "
        "inside for its all-gather, but `to_local()` holds only real rows."),
    "ex_shard_spread": (
        "values_held({shape}, {rank}, {n}) = {got} は、numpy.array_split "
        "のように行をできるだけ均等に配った数です。ヒント: レッスン 02 の `scatter` "
        "と同じく、1 つのチャンクは「行数 ÷ ランク数」の切り上げで、"
        "小さくなるのは最後のチャンクだけです。何も持たないランクもあります。",
        "values_held({shape}, {rank}, {n}) = {got} spreads the rows as evenly as "
        "possible, as numpy.array_split does. Hint: as `scatter` in lesson 02, a "
        "piece holds rows / ranks rounded up, only the last is smaller, and some "
        "ranks may hold nothing."),
    "ex_shard_off": (
        "values_held({shape}, {rank}, {n}) = {got} は fully_shard が持つ数と違います。"
        "ヒント: (このランクが受け持つ 0 番目の次元の行数) × (1 行の値の数) です。",
        "values_held({shape}, {rank}, {n}) = {got} is not what fully_shard holds. "
        "Hint: (the rows of this rank's piece of dimension 0) × (the values in one "
        "row)."),
    "ex_shard_ok": (
        "どの数も合っています。この {n} ランクでの fully_shard の実測 "
        "(Linear(5, 1) の重みは 1 行だけなので、すべてランク 0 にあり、"
        "ほかのランクは何も持ちません) とも、3 ランクと 8 ランクでの記事 004 の MLP "
        "の torch.chunk (8 ランクでは、fc2 の 10 行は 5 ランクにしか行き渡りません) "
        "とも一致しました。",
        "Every count matches: fully_shard measured on these {n} ranks (Linear(5, 1)'s "
        "weight has a single row, all on rank 0; the other ranks hold none of it), "
        "and torch.chunk for doc 004's MLP on 3 and 8 ranks (on 8, fc2's 10 rows "
        "reach only 5 ranks)."),
}
i18n.register({key: {"ja": ja, "en": en} for key, (ja, en) in MESSAGES.items()})
