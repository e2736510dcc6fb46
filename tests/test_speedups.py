"""The helpers of lessons 07 and 08: loading, precision, activations, training."""

import math
import warnings

import pytest
import torch
from torch.utils.data import DataLoader

from labkit import activations, loading, precision, throughput, timing, training


@pytest.mark.procs
def test_workers_change_speed_not_data():
    dataset = loading.SlowDataset(n=24, cost_s=0)
    plain = [X for X, _ in DataLoader(dataset, batch_size=8)]
    workers = [X for X, _ in DataLoader(dataset, batch_size=8, num_workers=2)]
    assert all(torch.equal(a, b) for a, b in zip(plain, workers, strict=True))


@pytest.mark.procs
def test_loader_times_calls_the_step_on_every_batch():
    seen = []
    times = loading.loader_times(loading.SlowDataset(n=20, cost_s=0), 1,
                                 batch_size=5, epochs=2,
                                 step=lambda X, y: seen.append(len(X)))
    assert seen == [5] * 8
    assert len(times.epoch_s) == len(times.first_batch_s) == 2


@pytest.mark.procs
def test_persistent_workers_are_the_same_processes_every_epoch():
    kept = loading.worker_pids(2, persistent_workers=True, epochs=3)
    fresh = loading.worker_pids(2, persistent_workers=False, epochs=2)
    assert kept[0] == kept[1] == kept[2] and len(kept[0]) == 2
    assert fresh[0].isdisjoint(fresh[1])
    assert len(loading.worker_pids(0, persistent_workers=True, epochs=1)[0]) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="machine has a GPU")
def test_pin_memory_does_nothing_without_an_accelerator():
    report = loading.pin_memory_report(loading.SlowDataset(n=8, cost_s=0))
    assert report["pinned"] is False
    assert any("no accelerator" in w for w in report["warnings"])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"n": 0}, "n must be >= 1"), ({"cost_s": -1}, "cost_s must be >= 0")])
def test_slow_dataset_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        loading.SlowDataset(**kwargs)


def test_fit_is_repeatable_and_learns():
    cfg = training.TrainConfig(steps=40, eval_every=10)
    a, b = training.fit(cfg), training.fit(cfg)
    assert a["heldout_loss"] == b["heldout_loss"]
    assert a["steps"] == [0, 10, 20, 30, 40]
    assert a["heldout_loss"][-1] < a["heldout_loss"][0]


def test_linear_scaling_rule():
    cfg = training.scaled(training.TrainConfig(lr=0.05, n=2048), 512, epochs=10)
    assert cfg.lr == pytest.approx(0.8) and cfg.steps == 40 and cfg.batch_size == 512


@pytest.mark.parametrize("schedule", training.SCHEDULES)
def test_schedules_are_torch_schedulers(schedule):
    cfg = training.TrainConfig(steps=40, schedule=schedule, warmup_steps=10,
                               eval_every=40)
    run = training.fit(cfg)
    assert len(run["lr"]) == 40
    if schedule.startswith("warmup"):
        assert run["lr"][0] == pytest.approx(0.05 / 10)
        assert max(run["lr"]) == pytest.approx(0.05)
    if schedule == "constant":
        assert set(run["lr"]) == {0.05}


def test_sorted_order_is_fixed_and_shuffled_is_not():
    sorted_cfg = training.TrainConfig(order="sorted", n=64)
    shuffled = training.TrainConfig(order="shuffled", n=64)
    order = training.epoch_order
    assert torch.equal(order(sorted_cfg, 0), order(sorted_cfg, 1))
    assert not torch.equal(order(shuffled, 0), order(shuffled, 1))
    (_, y), _ = training.split(sorted_cfg)
    assert torch.all(y[1:, 0] >= y[:-1, 0])


def test_a_diverging_run_reports_inf():
    run = training.fit(training.TrainConfig(steps=60, lr=50.0, eval_every=60))
    assert math.isinf(run["heldout_loss"][-1])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"optimizer": "lion"}, "unknown optimizer"),
    ({"schedule": "warmup"}, "needs 0 < warmup_steps"),
    ({"batch_size": 5000}, "larger than the data set"),
    ({"lr": 0}, "lr must be > 0"),
])
def test_bad_configs_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        training.fit(training.TrainConfig(**kwargs))


def test_autocast_keeps_weights_and_gradients_in_float32():
    dtypes = precision.autocast_dtypes(torch.nn.Linear(8, 8), torch.randn(4, 8))
    assert dtypes == {"output": torch.bfloat16, "weight": torch.float32,
                      "grad": torch.float32}


def test_bfloat16_training_follows_float32():
    run = {p: training.fit(training.TrainConfig(steps=15, hidden=64, batch_size=64,
                                                optimizer="momentum", precision=p))
           for p in training.PRECISIONS}
    f32, bf16 = run["float32"]["losses"], run["bfloat16"]["losses"]
    assert f32[0] == pytest.approx(bf16[0], rel=0.02)
    assert bf16[-1] == pytest.approx(f32[-1], rel=0.05)
    assert bf16 != f32  # autocast did change the arithmetic
    with pytest.raises(ValueError, match="unknown precision 'float16'"):
        training.fit(training.TrainConfig(precision="float16"))


def test_old_cuda_amp_names_warn_with_the_new_ones():
    found = precision.cuda_amp_warnings()
    assert any("FutureWarning" in w and "torch.amp.GradScaler('cuda'" in w
               for w in found)
    assert any("FutureWarning" in w and "torch.amp.autocast('cuda'" in w
               for w in found)


def _pair():
    torch.manual_seed(0)
    plain = activations.DeepMLP(width=32, depth=4, segments=2)
    checkpointed = activations.DeepMLP(width=32, depth=4, segments=2,
                                       checkpointed=True)
    checkpointed.load_state_dict(plain.state_dict())
    return plain, checkpointed


def test_checkpointing_keeps_fewer_activations_and_the_same_gradients():
    plain, checkpointed = _pair()
    X = torch.randn(64, 32)
    a = activations.saved_activation_bytes(plain, X)
    b = activations.saved_activation_bytes(checkpointed, X)
    assert a == 5 * 64 * 32 * 4  # four Linear inputs and the last ReLU output
    assert b == 2 * 64 * 32 * 4  # the two segments' inputs
    for model in (plain, checkpointed):
        model(X).pow(2).mean().backward()
    for p, q in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_no_grad_keeps_nothing_and_peak_memory_is_measured():
    plain, checkpointed = _pair()
    X = torch.randn(256, 32)
    with torch.no_grad():
        assert activations.saved_activation_bytes(plain, X) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peaks = [activations.step_cost(m, X)["peak_bytes"]
                 for m in (plain, checkpointed)]
    assert peaks[0] > peaks[1] > 0


def test_checkpointing_runs_every_forward_again_and_only_that():
    plain, checkpointed = _pair()
    X = torch.randn(64, 32)
    work = {m.checkpointed: activations.step_work(m, X) for m in (plain, checkpointed)}
    assert work[False]["linear_forwards"] == 4  # the lesson asserts 12 -> 24
    assert work[True]["linear_forwards"] == 8
    one_forward = 2 * 64 * 4 * 32 * 32  # 4 Linear layers of 32 x 32
    assert work[True]["flops"] - work[False]["flops"] == one_forward
    # The hooks are gone afterwards: counting again gives the same, not double.
    assert activations.step_work(plain, X) == work[False]


def test_step_times_take_turns_and_count_per_step():
    times = throughput.step_times([4, 8], batch_size=16, rounds=3, steps=2)
    assert list(times) == [4, 8] and all(len(t) == 3 for t in times.values())
    assert all(t > 0 for ts in times.values() for t in ts)
    order = []
    timing.interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                       rounds=2, warmup=1)
    assert order == ["a", "b", "a", "b", "a", "b"]  # warm-up, then turns
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        timing.interleaved({"a": lambda: None}, rounds=0)


@pytest.mark.procs
def test_workers_shorten_epochs_of_a_sleeping_data_set():
    times = loading.epoch_times(loading.SlowDataset(n=32, cost_s=0.004), (0, 2),
                                batch_size=8, rounds=3)
    assert {k: len(v) for k, v in times.items()} == {0: 3, 2: 3}
    # Without workers an epoch sleeps 32 x 4 ms, one sample after another.
    assert min(times[0]) >= 32 * 0.004
    with pytest.raises(ValueError, match="must be >= 0"):
        loading.epoch_times(loading.SlowDataset(n=8, cost_s=0), (-1,))


def test_deep_mlp_rejects_segments_that_do_not_divide_depth():
    with pytest.raises(ValueError, match="segments must divide depth"):
        activations.DeepMLP(depth=5, segments=2)


def test_every_timed_step_starts_from_the_same_weights_and_data():
    a, b = throughput.timed_problem(16, 1, 8), throughput.timed_problem(16, 1, 8)
    assert all(torch.equal(p, q) for p, q in
               zip(a[0].parameters(), b[0].parameters(), strict=True))
    assert torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])  # X and y
    assert a[2].shape == (8, 10)


def test_samples_per_s_is_per_batch_size():
    per_s = throughput.samples_per_s([4, 64], hidden=8, repeat=2)
    assert list(per_s) == [4, 64] and all(v > 0 for v in per_s.values())
