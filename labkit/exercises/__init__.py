"""Graders of the lessons' exercises: right, or what is wrong and a hint.

A lesson's exercise ends in a cell that calls `exercises.grade_NAME(answer)`.
A grader prints its verdict in the lesson's language when the answer is right,
and raises WrongAnswer (an AssertionError) naming the mistake and a hint when
it is not; graders that take `ranks` run the learner's function on every rank.
Each lesson's graders, with their messages, live in the module named after the
lesson (lesson 04, `course/04_no_sync.py`: `labkit/exercises/l04_no_sync.py`);
the sharding lessons' in two: lesson 11's graders on the ranks in
`l11_sharding.py`, and the predictions in the kernel, lesson 12's exercises, in
`l11_predicted_bytes.py`.
`l10_troubleshooting.py` holds the graders of two lessons: lesson 10's
(`course/10_troubleshooting.py`) and those of `course/11_uneven_and_restarts.py`.
"""

from __future__ import annotations

from .feedback import WrongAnswer
from .l01_models import grade_keeps_batch, grade_train_step
from .l02_data_parallel import grade_chunk_sizes, grade_manual_data_parallel
from .l03_ddp import grade_average_gradients, grade_ddp_script, grade_set_epoch
from .l04_no_sync import grade_accumulation, grade_replicas_agree
from .l05_communication import grade_allreduce_prediction, grade_step_prediction
from .l06_beyond_no_sync import (
    grade_bucket_count,
    grade_powersgd_bytes,
    grade_scratch_ddp,
)
from .l07_speedups import grade_evaluation, grade_saved_activations
from .l08_training_settings import grade_global_statistics, grade_warmup_schedule
from .l09_ecosystem import grade_shard_sizes, grade_torchrun_env
from .l10_troubleshooting import (
    grade_exact_mean,
    grade_uneven_epoch,
    grade_unused_parameters,
)
from .l11_predicted_bytes import grade_bytes_per_rank, grade_bytes_sent
from .l11_sharding import grade_gradient_shard, grade_zero3_frees
from .l12_local_sgd import grade_diloco_outer_step
from .l12_noise_scale import grade_noise_scale
from .l12_slow_link import grade_crossover_bandwidth

__all__ = [
    "WrongAnswer",
    "grade_accumulation",
    "grade_allreduce_prediction",
    "grade_average_gradients",
    "grade_bucket_count",
    "grade_bytes_per_rank",
    "grade_bytes_sent",
    "grade_chunk_sizes",
    "grade_crossover_bandwidth",
    "grade_ddp_script",
    "grade_diloco_outer_step",
    "grade_evaluation",
    "grade_exact_mean",
    "grade_global_statistics",
    "grade_gradient_shard",
    "grade_keeps_batch",
    "grade_manual_data_parallel",
    "grade_noise_scale",
    "grade_powersgd_bytes",
    "grade_replicas_agree",
    "grade_saved_activations",
    "grade_scratch_ddp",
    "grade_set_epoch",
    "grade_shard_sizes",
    "grade_step_prediction",
    "grade_torchrun_env",
    "grade_train_step",
    "grade_uneven_epoch",
    "grade_unused_parameters",
    "grade_warmup_schedule",
    "grade_zero3_frees",
]
