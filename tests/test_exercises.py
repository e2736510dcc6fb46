"""Each exercise check passes the reference answer and names typical mistakes."""

import exercise_answers as answers
import pytest
import torch

import labkit
from labkit import cluster, comm, exercises


def wrong(key):
    """Expect a WrongAnswer whose diagnosis is `key`."""
    return pytest.raises(exercises.WrongAnswer, check=lambda e: e.key == key)


def test_wrong_answers_are_assertion_errors_in_the_lesson_language(capsys):
    labkit.set_lang("ja")
    with pytest.raises(AssertionError,
                       match=r"まだ正解ではありません。.*ヒント: `x.view\(-1\)`"):
        exercises.grade_keeps_batch(answers.ViewMinusOne)
    exercises.grade_keeps_batch(answers.FlattenEachSample)
    assert capsys.readouterr().out.startswith("✓ 正解です。")


# 01


def test_keeps_batch(capsys):
    exercises.grade_keeps_batch(answers.FlattenEachSample)
    assert "Correct" in capsys.readouterr().out
    with wrong("ex_batch_error") as caught:
        exercises.grade_keeps_batch(answers.ViewMinusOne)
    assert "shape (100, 10) fails" in str(caught.value)
    assert "flatten each sample only" in str(caught.value)
    with wrong("ex_batch") as caught:  # silently wrong with a batch of one
        exercises.grade_keeps_batch(answers.Squeeze)
    assert "output of shape (10,), not (1, 10)" in str(caught.value)


def test_train_step(capsys):
    exercises.grade_train_step(answers.train_step)
    assert "3 updates match correct SGD" in capsys.readouterr().out
    with wrong("ex_no_backward") as caught:
        exercises.grade_train_step(answers.train_step_as_written)
    assert "call `loss.backward()`" in str(caught.value)
    with wrong("ex_no_zero_grad") as caught:
        exercises.grade_train_step(answers.train_step_no_zero_grad)
    assert "Update 1 is right, update 2 is not" in str(caught.value)
    with wrong("ex_no_step"):
        exercises.grade_train_step(answers.train_step_no_step)
    with wrong("ex_no_step") as caught:  # only the parentheses of backward added
        exercises.grade_train_step(answers.train_step_backward_only)
    assert "end with `optimizer.step()`" in str(caught.value)
    exercises.grade_train_step(answers.train_step_zero_grad_at_end)  # right too


@pytest.mark.parametrize("answer", ["train_step_zero_grad_before_step",
                                    "train_step_step_before_backward"])
def test_train_step_with_the_lines_out_of_order(answer):
    # backward() did run: saying "call backward()" (gradients None) would mislead.
    with wrong("ex_step_no_grad") as caught:
        exercises.grade_train_step(getattr(answers, answer))
    assert "call `step()` after `loss.backward()`" in str(caught.value)


def test_keeps_batch_right_only_for_some_shapes(capsys):
    exercises.grade_keeps_batch(answers.ViewMinusTen)  # right for this model
    assert "Correct" in capsys.readouterr().out
    for answer, shape in [(answers.ViewBatch100, "(1, 10)"),
                          (answers.NoFlatten, "(4, 2, 5)"),
                          (answers.FlattenLastDim, "(4, 2, 5)")]:
        with wrong("ex_batch_error_later") as caught:
            exercises.grade_keeps_batch(answer)
        assert f"one of shape {shape} fails" in str(caught.value)
        assert "write neither the batch size nor the shape" in str(caught.value)


# 02


def test_chunk_sizes(capsys):
    exercises.grade_chunk_sizes({(7, 3): [3, 3, 1], (6, 4): [2, 2, 2], (2, 4): [1, 1]})
    assert "Correct" in capsys.readouterr().out
    with wrong("ex_fill_in"):
        exercises.grade_chunk_sizes({(7, 3): None})
    with wrong("ex_chunks") as caught:  # an even spread, as numpy.array_split
        exercises.grade_chunk_sizes({(6, 4): [2, 2, 1, 1]})
    assert "rounded up" in str(caught.value)
    with wrong("ex_chunks") as caught:  # a chunk for every device, some empty
        exercises.grade_chunk_sizes({(6, 4): [2, 2, 2, 0]})
    assert "fewer chunks than devices" in str(caught.value)
    with wrong("ex_chunks"):  # the remainder spread from the front
        exercises.grade_chunk_sizes({(7, 3): [3, 2, 2]})
    with wrong("ex_chunks_list") as caught:  # the size of one chunk only
        exercises.grade_chunk_sizes({(7, 3): 3, (6, 4): 2, (2, 4): 1})
    assert "predicted[7, 3] = 3 is not a list" in str(caught.value)
    with wrong("ex_chunks_missing") as caught:  # a pair deleted: nothing to check
        exercises.grade_chunk_sizes({(7, 3): [3, 3, 1], (6, 4): [2, 2, 2]})
    assert "no prediction for (2, 4)" in str(caught.value)
    with wrong("ex_chunks_missing"):
        exercises.grade_chunk_sizes({})


def test_manual_data_parallel(capsys):
    exercises.grade_manual_data_parallel(answers.data_parallel)
    assert "Outputs and gradients equal one device's" in capsys.readouterr().out
    with wrong("ex_dp_type") as caught:
        exercises.grade_manual_data_parallel(answers.data_parallel_no_gather)
    assert "returned list" in str(caught.value)
    with wrong("ex_dp_shape"):
        exercises.grade_manual_data_parallel(answers.data_parallel_gather_dim1)
    with wrong("ex_dp_replicas") as caught:
        exercises.grade_manual_data_parallel(answers.data_parallel_no_replicas)
    assert "the original model 2 times" in str(caught.value)
    with wrong("ex_dp_fewer") as caught:  # batch 6 on 4 devices: 3 chunks
        exercises.grade_manual_data_parallel(answers.data_parallel_every_device)
    assert "Batch 6 on 4 devices makes 3 chunks" in str(caught.value)
    assert "`device_ids[:len(chunks)]`" in str(caught.value)
    with wrong("ex_dp_threads") as caught:  # the exercise's step 3 left as it was
        exercises.grade_manual_data_parallel(answers.data_parallel_in_this_thread)
    assert "in a thread of its own" in str(caught.value)
    with wrong("ex_dp_whole_batch") as caught:
        exercises.grade_manual_data_parallel(answers.data_parallel_whole_batch)
    assert "200 rows, 2 times the batch's 100" in str(caught.value)
    with wrong("ex_dp_hint") as caught:  # deep copies: no gradient reaches module
        exercises.grade_manual_data_parallel(answers.data_parallel_deepcopy)
    assert "module.parameters() .grad" in str(caught.value)


# 05


STEP = comm.StepModel(compute_s=0.002, sync_s=0.005, optimizer_s=0.001)


def test_step_prediction(capsys):
    exercises.grade_step_prediction(STEP, 8, 8 * 0.007 + 0.001, 8 * 0.002 + 0.006)
    assert "sync 57.0 ms, no_sync 22.0 ms" in capsys.readouterr().out
    exercises.grade_step_prediction(STEP, 8, STEP.predict(8, False),
                                    STEP.predict(8, True))
    with wrong("ex_fill_in"):
        exercises.grade_step_prediction(STEP, 8, None, None)
    with wrong("ex_nosync_once"):  # no_sync counted with K synchronizations
        exercises.grade_step_prediction(STEP, 8, 0.057, 0.057)
    with wrong("ex_forgot_o"):
        exercises.grade_step_prediction(STEP, 8, 0.056, 0.021)
    with wrong("ex_units"):
        exercises.grade_step_prediction(STEP, 8, 57.0, 22.0)
    with wrong("ex_step_hint"):
        exercises.grade_step_prediction(STEP, 8, 0.1, 0.022)
    with wrong("ex_o_every") as caught:  # the optimizer counted per micro-batch
        exercises.grade_step_prediction(STEP, 8, 8 * 0.008, 8 * 0.003 + 0.005)
    assert "sync_s counts o K times" in str(caught.value)
    with wrong("ex_nosync_zero") as caught:  # no_sync taken for no synchronization
        exercises.grade_step_prediction(STEP, 8, 0.057, 8 * 0.002 + 0.001)
    assert "the last micro-batch still synchronizes" in str(caught.value)
    assert "Note" not in capsys.readouterr().out  # every part was large enough


def test_step_prediction_says_what_a_part_fitted_as_0_leaves_unchecked(capsys):
    # fit_step_model sets a part to 0 when the free fit makes it negative: then a
    # formula without o gives the right number, and the verdict must not claim more.
    no_o = comm.StepModel(compute_s=0.002, sync_s=0.005, optimizer_s=0.0)
    exercises.grade_step_prediction(no_o, 8, 8 * 0.007, 8 * 0.002 + 0.005)
    out = capsys.readouterr().out
    assert "Correct" in out and "Note: on this run o is too small" in out
    with wrong("ex_sync_k"):  # s is still checked
        exercises.grade_step_prediction(no_o, 8, 8 * 0.002 + 0.005, 0.021)


AB = comm.AlphaBeta(alpha=1e-4, beta=1e9)


def test_allreduce_prediction(capsys):
    params, n = 2_000_000, 8
    exercises.grade_allreduce_prediction(AB, params, n, 14e-4 + 1.75 * 8e6 / 1e9)
    assert "15.40 ms on 8 ranks (8.20 ms on 2)" in capsys.readouterr().out
    with wrong("ex_ring"):
        exercises.grade_allreduce_prediction(AB, params, n, 14e-4 + 8e6 / 1e9)
    with wrong("ex_bytes"):
        exercises.grade_allreduce_prediction(AB, params, n, 14e-4 + 1.75 * 2e6 / 1e9)
    with wrong("ex_alpha_steps"):
        exercises.grade_allreduce_prediction(AB, params, n, 1e-4 + 1.75 * 8e6 / 1e9)
    with wrong("ex_ab_hint"):
        exercises.grade_allreduce_prediction(AB, params, n, 1.0)
    S, send = 8e6, 1.75 * 8e6 / 1e9
    for latency, count in [(0.0, 0), (7e-4, 7)]:  # no alpha; the n − 1 of one pass
        with wrong("ex_alpha_count") as caught:
            exercises.grade_allreduce_prediction(AB, params, n, latency + send)
        assert f"pays alpha {count} times" in str(caught.value)
    # A reduce-scatter alone; 2(n − 1) without the / n (on 8 ranks also S in bits).
    for factor in (7 / 8, 14):
        with wrong("ex_ring"):
            exercises.grade_allreduce_prediction(AB, params, n,
                                                 14e-4 + factor * S / 1e9)
    with wrong("ex_ab_ranks") as caught:  # the lesson's 2 ranks: 2 alpha + S / beta
        exercises.grade_allreduce_prediction(AB, params, n, 2e-4 + S / 1e9)
    assert "the time on 2 ranks" in str(caught.value)
    assert "Note" not in capsys.readouterr().out


def test_allreduce_prediction_with_alpha_fitted_as_0(capsys):
    # comm.fit_alpha_beta clamps a negative alpha to 0: an answer without the
    # 2(n − 1) latency steps is then the right number. It is accepted (it is right
    # for this fit), and the verdict says that the latency was not checked.
    no_alpha, params, n = comm.AlphaBeta(alpha=0.0, beta=1e9), 2_000_000, 8
    exercises.grade_allreduce_prediction(no_alpha, params, n, 1.75 * 8e6 / 1e9)
    out = capsys.readouterr().out
    assert "Correct" in out and "Note: on this run alpha is too small" in out
    with wrong("ex_ring"):  # the bandwidth term is still checked
        exercises.grade_allreduce_prediction(no_alpha, params, n, 8e6 / 1e9)


# 03 and 04: the learner's function runs on two ranks


def test_set_epoch(ranks, capsys):
    exercises.grade_set_epoch(ranks, answers.epoch_orders)
    assert "all 16 samples without overlap" in capsys.readouterr().out
    with wrong("ex_repeats") as caught:
        exercises.grade_set_epoch(ranks, answers.epoch_orders_no_set_epoch)
    assert "sampler.set_epoch(epoch)" in str(caught.value)
    with wrong("ex_epochs"):  # each rank shuffles with its own epoch number
        exercises.grade_set_epoch(ranks, answers.epoch_orders_rank_epoch)


def test_average_gradients(ranks, capsys):
    exercises.grade_average_gradients(ranks, answers.average_gradients)
    assert "equals the whole batch's" in capsys.readouterr().out
    with wrong("ex_grads_summed") as caught:
        exercises.grade_average_gradients(ranks, answers.average_gradients_sum)
    assert "2 times" in str(caught.value) and "divide by the world size" in str(
        caught.value)
    with wrong("ex_grads_apart"):
        exercises.grade_average_gradients(ranks, answers.average_gradients_copy)


def test_accumulation_right(ranks, capsys):
    exercises.grade_accumulation(ranks, answers.accumulation_step)
    assert "one all-reduce, identical replicas" in capsys.readouterr().out


def test_replicas_agree(ranks, capsys):
    exercises.grade_replicas_agree(ranks, answers.train)
    assert "learning rate 0.0125" in capsys.readouterr().out
    with wrong("ex_lr_apart") as caught:
        exercises.grade_replicas_agree(ranks, answers.train_scheduler_on_rank_0)
    assert "rank 0: 0.0125, rank 1: 0.1" in str(caught.value)
    with wrong("ex_train_apart"):
        exercises.grade_replicas_agree(ranks, answers.train_step_on_rank_0)
    with wrong("ex_only_line"):
        exercises.grade_replicas_agree(ranks, answers.train_no_scheduler)
    with wrong("ex_scheduler_first") as caught:
        exercises.grade_replicas_agree(ranks, answers.train_scheduler_first)
    assert "`scheduler.step()` comes before `optimizer.step()`" in str(caught.value)


def test_average_gradients_over_2_written_as_a_number_passes(ranks):
    # Not checkable on the lesson's 2 ranks; lesson 03 says so beside the exercise.
    exercises.grade_average_gradients(ranks, answers.average_gradients_two)


# 03 and 04: more of what learners get wrong, each with the hint that fits
@pytest.mark.parametrize(("check", "answer", "key", "says"), [
    ("set_epoch", "epoch_orders_rank_0_only", "ex_epochs", "the same epoch number"),
    ("set_epoch", "epoch_orders_seed_rank", "ex_epochs", "the same `seed`"),
    ("set_epoch", "epoch_orders_set_after", "ex_repeats",
     "Epochs 0 and 1 have the same order"),
    ("set_epoch", "epoch_orders_one_short", "ex_epoch_count",
     "On rank 0 the function returned 2 orders for 3 epochs"),
    ("average_gradients", "average_gradients_mean_on_rank_0", "ex_grads_one_rank",
     "Rank 0 got the whole batch's gradient, rank 1 did not"),
    ("average_gradients", "average_gradients_params", "ex_grads_apart",
     "all-reduce each parameter's `p.grad` itself"),
    ("average_gradients", "average_gradients_divide_last", "ex_mean_hint",
     "divided by the world size"),
    ("accumulation", "accumulation_k_as_4", "ex_accum_k",
     "The updates with K = 4 are right, the one with K = 2 is not"),
    ("accumulation", "accumulation_zero_grad_inside", "ex_zero_grad_inside",
     "`zero_grad()` inside the loop"),
    ("accumulation", "accumulation_by_world_size", "ex_not_divided",
     "2.0 times the K-times batch's"),
    ("accumulation", "accumulation_step_on_rank_0", "ex_steps_rank",
     "On rank 1 `optimizer.step()` ran 0 times in one update"),
])
def test_more_mistakes_on_ranks(ranks, check, answer, key, says):
    with wrong(key) as caught:
        getattr(exercises, f"grade_{check}")(ranks, getattr(answers, answer))
    assert says in str(caught.value)


# 06: PowerSGD's bytes and DDP's buckets, measured on two ranks


@pytest.mark.timeout(300)
def test_powersgd_bytes(ranks, capsys):
    exercises.grade_powersgd_bytes(ranks, answers.powersgd_bytes)
    assert "bytes PowerSGD sends per step for 8 " in capsys.readouterr().out
    # A vector as an n × 1 matrix gives the same bytes as a rule of its own: the
    # check cannot tell them apart, and the lesson says so.
    exercises.grade_powersgd_bytes(ranks, answers.powersgd_bytes_as_matrices)
    for _ in range(2):  # an answer that empties its argument leaves the cases whole
        exercises.grade_powersgd_bytes(ranks, answers.powersgd_bytes_sorting_shapes)
    with wrong("ex_psgd_hint_boundary") as caught:
        exercises.grade_powersgd_bytes(ranks, answers.powersgd_bytes_at_most_half)
    assert "For Linear(8, 8)" in str(caught.value)
    assert "you answered 160 bytes; PowerSGD sent 288" in str(caught.value)
    assert "would only be halved" in str(caught.value)
    with wrong("ex_psgd_hint_rate") as caught:
        exercises.grade_powersgd_bytes(ranks, answers.powersgd_bytes_whole_model)
    assert "For MLP 10-1024-1024-1024-10" in str(caught.value)
    with wrong("ex_psgd_hint_matrix") as caught:
        exercises.grade_powersgd_bytes(ranks, answers.powersgd_bytes_without_r)
    assert "P (n × r) and Q (m × r)" in str(caught.value)


@pytest.mark.timeout(300)
def test_bucket_count(ranks, capsys):
    for _ in range(2):  # an answer that reverses its argument leaves the cases whole
        exercises.grade_bucket_count(ranks, answers.ddp_buckets_reversing_the_list)
    assert "for 7 models and caps" in capsys.readouterr().out
    with wrong("ex_buckets_hint_first_given") as caught:
        exercises.grade_bucket_count(ranks, answers.ddp_buckets_first_always)
    assert "the first bucket has that cap too" in str(caught.value)
    with wrong("ex_buckets_hint_close") as caught:
        exercises.grade_bucket_count(ranks, answers.ddp_buckets_close_before)
    assert "makes it reach the cap" in str(caught.value)
    with wrong("ex_buckets_hint_rule") as caught:
        exercises.grade_bucket_count(ranks, answers.ddp_buckets_last_left_out)
    assert "the last, unclosed bucket counts too" in str(caught.value)


# 07: the bytes of activations DeepMLP keeps


def test_saved_activations(capsys):
    exercises.grade_saved_activations(answers.saved_bytes)
    out = capsys.readouterr().out
    assert "matches the measured bytes for 8 shapes" in out
    assert "27.3 MB, and 8.4 MB with 4 checkpointed segments" in out  # lesson 07's
    with wrong("ex_fill_in"):
        exercises.grade_saved_activations(lambda *shape: None)
    for answer, key in [(answers.saved_values, "ex_act_values"),
                        (answers.saved_bytes_twice, "ex_act_twice"),
                        (answers.saved_bytes_without_x, "ex_act_one_short"),
                        (answers.saved_bytes_with_outputs, "ex_act_ckpt_output"),
                        (answers.saved_bytes_checkpoint_ignored, "ex_act_ckpt_same")]:
        with wrong(key):
            exercises.grade_saved_activations(answer)
    with wrong("ex_act_hint"):  # wrong in no way the check knows
        exercises.grade_saved_activations(lambda *shape: 1)
    for answer, key, says in [
            (answers.saved_bytes_per_sample, "ex_act_batch", "that is one sample's"),
            (answers.saved_megabytes, "ex_act_units", "that is in MB"),
            (answers.saved_bytes_float64, "ex_act_float64", "(8 is float64)"),
            (answers.saved_bytes_checkpoint_without_x, "ex_act_ckpt_short",
             "the first segment's input (the model's input X)")]:
        with wrong(key) as caught:
            exercises.grade_saved_activations(answer)
        assert says in str(caught.value)


# 07: an evaluation that changes nothing and keeps nothing


def test_evaluation(capsys):
    exercises.grade_evaluation(answers.evaluate)
    assert "no activation saved" in capsys.readouterr().out
    with wrong("ex_fill_in"):
        exercises.grade_evaluation(lambda model, X, y: None)
    with wrong("ex_eval_graph") as caught:
        exercises.grade_evaluation(answers.evaluate_with_grad)
    assert "torch.no_grad()" in str(caught.value)
    with wrong("ex_eval_mode") as caught:
        exercises.grade_evaluation(answers.evaluate_in_training_mode)
    assert "model.eval()" in str(caught.value)
    with wrong("ex_eval_hint"):
        exercises.grade_evaluation(answers.evaluate_sum)
    with wrong("ex_eval_mode"):  # the outer module's flag only: BatchNorm trains
        exercises.grade_evaluation(answers.evaluate_training_false)
    with wrong("ex_eval_tensor") as caught:
        exercises.grade_evaluation(answers.evaluate_tensor)
    assert "`.item()`" in str(caught.value)
    with wrong("ex_eval_frozen") as caught:
        exercises.grade_evaluation(answers.evaluate_frozen)
    assert "parameters 0.weight, 0.bias" in str(caught.value)


def test_evaluation_that_leaves_gradients_off():
    with wrong("ex_eval_grad_off") as caught:
        exercises.grade_evaluation(answers.evaluate_grad_off)
    assert "`with torch.no_grad():` block" in str(caught.value)
    assert torch.is_grad_enabled()  # the grader put the learner's process right


# 08: the learning rate of a large batch


def test_warmup_schedule(capsys):
    exercises.grade_warmup_schedule(answers.lr_at)
    assert "0.16 at step 0, then up in a straight line to 3.2 at step 20" in (
        capsys.readouterr().out)
    with wrong("ex_fill_in"):
        exercises.grade_warmup_schedule(lambda step, batch_size: None)


def test_warmup_schedule_wrong_factor():
    with wrong("ex_lr_peak") as caught:  # scaled by the world size of 8 ranks
        exercises.grade_warmup_schedule(lambda step, batch_size: 8 * answers.lr_at(
            step, 32))
    assert "16 times the batch, 16 times the rate" in str(caught.value)


def test_warmup_schedule_right_for_the_lessons_batches_only():
    with wrong("ex_lr_floor") as caught:  # 80 is no multiple of 32
        exercises.grade_warmup_schedule(answers.lr_at_floor)
    assert "batch 80 trains at 0.4: batch_size // 32" in str(caught.value)
    with wrong("ex_lr_after_warmup") as caught:
        exercises.grade_warmup_schedule(answers.lr_at_never_stops)
    assert "reaches the peak 0.8 at step 20, but gets 0.838 at step 21" in str(
        caught.value)
    with wrong("ex_lr_peak") as caught:  # batch 512's 3.2 written in
        exercises.grade_warmup_schedule(answers.lr_at_batch_512)
    assert "batch 128 trains at 3.2, not the scaled rate" in str(caught.value)


# 08: SyncBatchNorm's statistics by hand, on two ranks


def test_global_statistics(ranks, capsys):
    exercises.grade_global_statistics(ranks, answers.global_mean_var)
    assert "With 3 + 9 = 12 samples on the ranks, every rank got the mean and " \
           "variance of all of them" in capsys.readouterr().out
    with wrong("ex_bn_equal_batches") as caught:
        exercises.grade_global_statistics(ranks, answers.global_mean_var_equal_batches)
    assert "world size × this rank's batch" in str(caught.value)
    with wrong("ex_bn_one_rank") as caught:
        exercises.grade_global_statistics(ranks, answers.global_mean_var_reduce)
    assert "`mean` is right on rank 0 but not on rank 1" in str(caught.value)
    with wrong("ex_bn_again") as caught:  # right for the first call's 12 samples
        exercises.grade_global_statistics(ranks,
                                          answers.global_mean_var_count_written_in)
    assert "Right for 12 samples, but called with 5 + 2 = 7 samples of 3 features, " \
           "`mean` is wrong" in str(caught.value)


# 09: what torchrun hands each process, and what FSDP's ranks hold


@pytest.mark.procs
def test_torchrun_env(capsys):
    exercises.grade_torchrun_env(answers.torchrun_env)  # with a real torchrun run
    assert "node 0: RANK 0, 1; node 1: RANK 2, 3" in capsys.readouterr().out
    exercises.grade_torchrun_env(answers.torchrun_env_as_strings, real=False)
    with wrong("ex_fill_in"):
        exercises.grade_torchrun_env(lambda nnodes, nproc_per_node, node_rank: None)
    with wrong("ex_fill_in"):  # the lesson's starting point
        exercises.grade_torchrun_env(lambda nnodes, nproc_per_node, node_rank: [
            {"RANK": None, "LOCAL_RANK": i, "WORLD_SIZE": None}
            for i in range(nproc_per_node)])


def test_shard_sizes(ranks, capsys):
    exercises.grade_shard_sizes(ranks, answers.values_held)
    assert "fully_shard measured on these 2 ranks" in capsys.readouterr().out
    with wrong("ex_fill_in"):
        exercises.grade_shard_sizes(ranks, lambda shape, rank, world_size: None)


# Typical mistakes: each check names the one it sees


@pytest.mark.parametrize(("check", "answer", "key", "says"), [
    ("warmup_schedule", "lr_at_not_scaled", "ex_lr_not_scaled", "the rate of batch 32"),
    ("warmup_schedule", "lr_at_sqrt", "ex_lr_sqrt", "the square-root rule"),
    ("warmup_schedule", "lr_at_no_warmup", "ex_lr_no_warmup", "there is no warm-up"),
    ("warmup_schedule", "lr_at_from_zero", "ex_lr_from_zero", "does nothing"),
    ("warmup_schedule", "lr_at_one_step_early", "ex_lr_warmup_end", "at step 19"),
    ("warmup_schedule", "lr_at_from_base", "ex_lr_from_base", "Goyal et al.'s"),
    ("torchrun_env", "torchrun_env_rank_is_local", "ex_env_rank_local",
     "torchrun_env(2, 1, 1) gives RANK equal to LOCAL_RANK"),
    ("torchrun_env", "torchrun_env_world_is_node", "ex_env_world_nproc",
     "this node only"),
    ("torchrun_env", "torchrun_env_rank_sum", "ex_env_rank_sum",
     "torchrun_env(2, 2, 1) gives RANK = node_rank + LOCAL_RANK"),
    ("torchrun_env", "torchrun_env_interleaved", "ex_env_rank_interleaved",
     "torchrun_env(2, 2, 0) numbers the processes across the nodes in turn"),
    ("torchrun_env", "torchrun_env_rank_by_nnodes", "ex_env_rank_nnodes",
     "torchrun_env(2, 1, 1) gives RANK = node_rank × nnodes + LOCAL_RANK"),
    # At (2, 2, 0) nnodes and nproc_per_node are both 2: a case with 4 and 8 tells.
    ("torchrun_env", "torchrun_env_world_is_nnodes", "ex_env_world_nodes",
     "torchrun_env(2, 2, 0) gives WORLD_SIZE = nnodes, the number of nodes"),
    ("torchrun_env", "torchrun_env_every_node", "ex_env_count",
     "torchrun_env(2, 1, 1) lists 2 processes; the node runs 1"),
])
def test_mistakes(check, answer, key, says):
    with wrong(key) as caught:
        getattr(exercises, f"grade_{check}")(getattr(answers, answer))
    assert says in str(caught.value)


@pytest.mark.parametrize(("check", "answer", "key", "says"), [
    ("accumulation", "accumulation_all_inside", "ex_no_sync_at_all",
     "No all-reduce ran"),
    ("accumulation", "accumulation_not_divided", "ex_not_divided",
     "4.0 times the K-times batch's"),
    ("accumulation", "accumulation_step_inside", "ex_steps",
     "ran 4 times in one update"),
    ("accumulation", "accumulation_no_zero_grad", "ex_no_zero_grad",
     "start every update with"),
    ("accumulation", "accumulation_sync_every", "ex_sync_every",
     "ran 4 all-reduces, not 1"),
    ("accumulation", "accumulation_sync_first", "ex_apart",
     "the last micro-batch is the one"),
    ("global_statistics", "global_mean_var_local", "ex_bn_local",
     "`mean` is each rank's own statistic"),
    ("global_statistics", "global_mean_var_mean_of_means", "ex_bn_mean_of_means",
     "a small batch more weight"),
    ("global_statistics", "global_mean_var_not_divided", "ex_bn_not_divided",
     "`mean` is a sum"),
    ("global_statistics", "global_mean_var_local_count", "ex_bn_count",
     "by this rank's number of samples"),
    ("global_statistics", "global_mean_var_of_vars", "ex_bn_var_of_vars",
     "how far apart the ranks' means"),
    ("global_statistics", "global_mean_var_unbiased", "ex_bn_unbiased",
     "`var` is the unbiased variance"),
    ("global_statistics", "global_mean_var_squares", "ex_bn_squares",
     "`var` is the mean of the squares"),
    ("shard_sizes", "values_held_whole", "ex_shard_whole",
     "values_held((5, 10), 0, 2) = 50 is the whole parameter"),
    ("shard_sizes", "values_held_even", "ex_shard_even",
     "values_held((5, 10), 0, 2) = 25 is an even share"),
    ("shard_sizes", "values_held_padded", "ex_shard_padding",
     "values_held((5, 10), 1, 2) = 30 counts padding"),
    ("shard_sizes", "values_held_array_split", "ex_shard_spread",
     "values_held((100, 10), 1, 3) = 330 spreads"),
    ("shard_sizes", "values_held_negative", "ex_shard_negative",
     "values_held((10, 100), 6, 8) = -200 is negative"),
    ("shard_sizes", "values_held_rest_on_last", "ex_shard_floor",
     "values_held((5, 10), 0, 2) = 20 gives each rank rows / ranks rounded down"),
])
def test_mistakes_on_ranks(ranks, check, answer, key, says):
    with wrong(key) as caught:
        getattr(exercises, f"grade_{check}")(ranks, getattr(answers, answer))
    assert says in str(caught.value)


# 10: the parameters that get no gradient


def test_unused_parameters(capsys):
    exercises.grade_unused_parameters(answers.unused_parameters)
    assert "in 5 models, left-over gradients or not" in capsys.readouterr().out
    with wrong("ex_fill_in"):
        exercises.grade_unused_parameters(lambda model, X: None)
    with wrong("ex_unused_stale") as caught:
        exercises.grade_unused_parameters(answers.unused_parameters_stale)
    assert "zero_grad(set_to_none=True)" in str(caught.value)
    with wrong("ex_unused_wrong"):
        exercises.grade_unused_parameters(answers.unused_parameters_used)
    with wrong("ex_unused_wrong") as caught:
        exercises.grade_unused_parameters(answers.unused_parameters_frozen)
    assert "For _Branches(use_aux=False) you answered []" in str(caught.value)
    with wrong("ex_unused_zero") as caught:  # a dead ReLU: gradients of zeros
        exercises.grade_unused_parameters(answers.unused_parameters_zero_grads)
    assert "For _Dead() you answered ['hidden.bias', 'hidden.weight', 'out.weight']" \
           in str(caught.value)
    assert "whether `.grad` is None" in str(caught.value)


# 10: an uneven epoch, on two ranks


def test_uneven_epoch(ranks, capsys):
    exercises.grade_uneven_epoch(ranks, answers.train_epoch)
    assert "weights are those of a run with `Join`" in capsys.readouterr().out
    with wrong("ex_join_hang") as caught:  # rank 0's fifth backward waits
        exercises.grade_uneven_epoch(ranks, answers.train_epoch_plain)
    assert "rank 0 timed out" in str(caught.value)
    with wrong("ex_join_dropped"):
        exercises.grade_uneven_epoch(ranks, answers.train_epoch_common)
    with wrong("ex_join_apart"):
        exercises.grade_uneven_epoch(ranks, answers.train_epoch_module)
    with wrong("ex_join_divide") as caught:
        exercises.grade_uneven_epoch(ranks, answers.train_epoch_divide_by_live_ranks)
    assert "divide_by_initial_world_size=False" in str(caught.value)
    with wrong("ex_join_hint") as caught:  # no hang, equal replicas, other weights
        exercises.grade_uneven_epoch(ranks, answers.train_epoch_repeat_last)
    assert "the mean of its own gradient and zeros" in str(caught.value)
    # An error in the answer's own code is shown as it is, not as a hang.
    with pytest.raises(cluster.RankError, match="join_hook"):
        exercises.grade_uneven_epoch(ranks, answers.train_epoch_join_optimizer)


# 10: an exact validation metric, on two ranks


def test_exact_mean(ranks, capsys):
    exercises.grade_exact_mean(ranks, answers.exact_mean)
    assert "every rank got the exact mean" in capsys.readouterr().out
    with wrong("ex_fill_in"):
        exercises.grade_exact_mean(ranks, lambda values, total: None)
    for answer, key in [(answers.exact_mean_local, "ex_exact_local"),
                        (answers.exact_mean_of_means, "ex_exact_padding"),
                        (answers.exact_mean_padded, "ex_exact_padding")]:
        with wrong(key):
            exercises.grade_exact_mean(ranks, answer)
    with wrong("ex_exact_dropped") as caught:
        exercises.grade_exact_mean(ranks, answers.exact_mean_drop_last)
    assert "For a data set of 9 you returned" in str(caught.value)
    assert "1 real sample(s) left out" in str(caught.value)
    # Right on 2 ranks, where all padding is rank 1's last sample; wrong on 3 or
    # more, which the check does not run: lesson 11 says so.
    exercises.grade_exact_mean(ranks, answers.exact_mean_last_rank_padding)

