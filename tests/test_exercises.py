"""Each exercise check passes the reference answer and names typical mistakes."""

import exercise_answers as answers
import pytest

import labkit
from labkit import comm, exercises


def wrong(key):
    """Expect a WrongAnswer whose diagnosis is `key`."""
    return pytest.raises(exercises.WrongAnswer, check=lambda e: e.key == key)


def test_wrong_answers_are_assertion_errors_in_the_lesson_language(capsys):
    labkit.set_lang("ja")
    with pytest.raises(AssertionError, match=r"まだです。.*ヒント: `x.view\(-1\)`"):
        exercises.check_keeps_batch(answers.ViewMinusOne)
    exercises.check_keeps_batch(answers.FlattenEachSample)
    assert capsys.readouterr().out.startswith("✓ 正解です。")


# 01


def test_keeps_batch(capsys):
    exercises.check_keeps_batch(answers.FlattenEachSample)
    assert "Correct" in capsys.readouterr().out
    with wrong("ex_batch_error") as caught:
        exercises.check_keeps_batch(answers.ViewMinusOne)
    assert "shape (100, 10) fails" in str(caught.value)
    assert "flatten each sample only" in str(caught.value)
    with wrong("ex_batch") as caught:  # silently wrong with a batch of one
        exercises.check_keeps_batch(answers.Squeeze)
    assert "output of shape (10,), not (1, 10)" in str(caught.value)


def test_train_step(capsys):
    exercises.check_train_step(answers.train_step)
    assert "3 updates match correct SGD" in capsys.readouterr().out
    with wrong("ex_no_backward") as caught:
        exercises.check_train_step(answers.train_step_as_written)
    assert "call `loss.backward()`" in str(caught.value)
    with wrong("ex_no_zero_grad") as caught:
        exercises.check_train_step(answers.train_step_no_zero_grad)
    assert "Update 1 is right, update 2 is not" in str(caught.value)
    with wrong("ex_no_step"):
        exercises.check_train_step(answers.train_step_no_step)


# 02


def test_chunk_sizes(capsys):
    exercises.check_chunk_sizes({(7, 3): [3, 3, 1], (6, 4): [2, 2, 2]})
    assert "Correct" in capsys.readouterr().out
    with wrong("ex_fill_in"):
        exercises.check_chunk_sizes({(7, 3): None})
    with wrong("ex_chunks") as caught:  # an even spread, as numpy.array_split
        exercises.check_chunk_sizes({(6, 4): [2, 2, 1, 1]})
    assert "rounded up" in str(caught.value)


def test_manual_data_parallel(capsys):
    exercises.check_manual_data_parallel(answers.data_parallel)
    assert "Outputs and gradients equal one device's" in capsys.readouterr().out
    with wrong("ex_dp_type") as caught:
        exercises.check_manual_data_parallel(answers.data_parallel_no_gather)
    assert "returned list" in str(caught.value)
    with wrong("ex_dp_shape"):
        exercises.check_manual_data_parallel(answers.data_parallel_gather_dim1)
    with wrong("ex_dp_replicas") as caught:
        exercises.check_manual_data_parallel(answers.data_parallel_no_replicas)
    assert "the original model 2 times" in str(caught.value)


# 05


STEP = comm.StepModel(compute_s=0.002, sync_s=0.005, optimizer_s=0.001)


def test_step_prediction(capsys):
    exercises.check_step_prediction(STEP, 8, 8 * 0.007 + 0.001, 8 * 0.002 + 0.006)
    assert "sync 57.0 ms, no_sync 22.0 ms" in capsys.readouterr().out
    exercises.check_step_prediction(STEP, 8, STEP.predict(8, False),
                                    STEP.predict(8, True))
    with wrong("ex_fill_in"):
        exercises.check_step_prediction(STEP, 8, None, None)
    with wrong("ex_nosync_once"):  # no_sync counted with K synchronizations
        exercises.check_step_prediction(STEP, 8, 0.057, 0.057)
    with wrong("ex_forgot_o"):
        exercises.check_step_prediction(STEP, 8, 0.056, 0.021)
    with wrong("ex_units"):
        exercises.check_step_prediction(STEP, 8, 57.0, 22.0)
    with wrong("ex_step_hint"):
        exercises.check_step_prediction(STEP, 8, 0.1, 0.022)


AB = comm.AlphaBeta(alpha=1e-4, beta=1e9)


def test_allreduce_prediction(capsys):
    params, n = 2_000_000, 8
    exercises.check_allreduce_prediction(AB, params, n, 1e-4 + 1.75 * 8e6 / 1e9)
    assert "14.10 ms on 8 ranks (8.10 ms on 2)" in capsys.readouterr().out
    with wrong("ex_ring"):
        exercises.check_allreduce_prediction(AB, params, n, 1e-4 + 8e6 / 1e9)
    with wrong("ex_bytes"):
        exercises.check_allreduce_prediction(AB, params, n, 1e-4 + 1.75 * 2e6 / 1e9)
    with wrong("ex_ab_hint"):
        exercises.check_allreduce_prediction(AB, params, n, 1.0)


# 03 and 04: the learner's function runs on two ranks


def test_set_epoch(ranks, capsys):
    exercises.check_set_epoch(ranks, answers.epoch_orders)
    assert "all 16 samples without overlap" in capsys.readouterr().out
    with wrong("ex_repeats") as caught:
        exercises.check_set_epoch(ranks, answers.epoch_orders_no_set_epoch)
    assert "sampler.set_epoch(epoch)" in str(caught.value)
    with wrong("ex_epochs"):  # each rank shuffles with its own epoch number
        exercises.check_set_epoch(ranks, answers.epoch_orders_rank_epoch)


def test_average_gradients(ranks, capsys):
    exercises.check_average_gradients(ranks, answers.average_gradients)
    assert "equals the whole batch's" in capsys.readouterr().out
    with wrong("ex_grads_summed") as caught:
        exercises.check_average_gradients(ranks, answers.average_gradients_sum)
    assert "2 times" in str(caught.value) and "divide by the world size" in str(
        caught.value)
    with wrong("ex_grads_apart"):
        exercises.check_average_gradients(ranks, answers.average_gradients_copy)


def test_accumulation_right(ranks, capsys):
    exercises.check_accumulation(ranks, answers.accumulation_step)
    assert "one all-reduce, identical replicas" in capsys.readouterr().out


@pytest.mark.parametrize(("answer", "key", "says"), [
    ("accumulation_all_inside", "ex_no_sync_at_all", "No all-reduce ran"),
    ("accumulation_not_divided", "ex_not_divided", "4.0 times the K-times batch's"),
    ("accumulation_step_inside", "ex_steps", "ran 4 times in one update"),
    ("accumulation_no_zero_grad", "ex_no_zero_grad", "start every update with"),
    ("accumulation_sync_every", "ex_sync_every", "ran 4 all-reduces, not 1"),
    ("accumulation_sync_first", "ex_apart", "the last micro-batch is the one"),
])
def test_accumulation_mistakes(ranks, answer, key, says):
    with wrong(key) as caught:
        exercises.check_accumulation(ranks, getattr(answers, answer))
    assert says in str(caught.value)


def test_replicas_agree(ranks, capsys):
    exercises.check_replicas_agree(ranks, answers.train)
    assert "learning rate 0.0125" in capsys.readouterr().out
    with wrong("ex_lr_apart") as caught:
        exercises.check_replicas_agree(ranks, answers.train_scheduler_on_rank_0)
    assert "rank 0: 0.0125, rank 1: 0.1" in str(caught.value)
    with wrong("ex_train_apart"):
        exercises.check_replicas_agree(ranks, answers.train_step_on_rank_0)
    with wrong("ex_only_line"):
        exercises.check_replicas_agree(ranks, answers.train_no_scheduler)
