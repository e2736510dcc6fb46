import copy
import json
from collections import namedtuple
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from labkit import compare, dp_experiments, models
from labkit import data_parallel as dp

# The simulation runs on CPU tensors; a model on the CPU selects it even with CUDA.


def grads(model):
    return [p.grad for p in model.parameters()]


def twins(seed=0):
    """Doc 004's corrected model and an identical copy for the single-device run."""
    torch.manual_seed(seed)
    model = models.MLP()
    return model, copy.deepcopy(model)


def run_both(batch, device_ids, seed=0):
    model, reference = twins(seed)
    X, y = torch.randn(batch, 10), torch.randn(batch, 10)
    out = dp.data_parallel(model, X, device_ids)
    models.MyLoss()(out, y).backward()
    ref = reference(X)
    models.MyLoss()(ref, y).backward()
    return (compare.max_abs_diff(out, ref),
            compare.max_abs_diff(grads(model), grads(reference)), out)


@pytest.mark.parametrize(("batch", "n"), [(100, 2), (100, 3), (10, 4), (7, 2), (1, 2)])
def test_outputs_and_gradients_equal_one_device(batch, n):
    out_diff, grad_diff, out = run_both(batch, list(range(n)))
    assert out.shape == (batch, 10)
    assert out_diff <= 1e-6 and grad_diff <= 1e-6


def test_uneven_batches_chunk_like_tensor_chunk():
    for batch, n, sizes in [(100, 3, [34, 34, 32]), (10, 4, [3, 3, 3, 1]),
                            (5, 4, [2, 2, 1]), (3, 4, [1, 1, 1])]:
        chunks = dp.scatter(torch.randn(batch, 3), list(range(n)))
        assert [len(c) for c in chunks] == sizes


def test_fewer_chunks_than_devices_use_fewer_replicas():
    model, _ = twins()
    ran = []
    model.register_forward_hook(lambda m, args, out: ran.append(len(args[0])))
    out = dp.data_parallel(model, torch.randn(5, 10), device_ids=[0, 1, 2, 3])
    assert sorted(ran) == [1, 2, 2]  # three replicas; device 3 gets nothing
    assert out.shape == (5, 10)


def test_gradients_of_all_replicas_sum_into_the_original():
    model, reference = twins()
    X, y = torch.randn(8, 10), torch.randn(8, 10)
    replicas = dp.replicate(model, [0, 1])
    seen = []
    for r in replicas:
        r.fc2.bias.register_hook(seen.append)
    outputs = dp.parallel_apply(replicas, dp.scatter(X, [0, 1]))
    models.MyLoss()(dp.gather(outputs, 0), y).backward()
    models.MyLoss()(reference(X), y).backward()
    torch.testing.assert_close(model.fc2.bias.grad, seen[0] + seen[1])
    assert compare.max_abs_diff(grads(model), grads(reference)) <= 1e-6
    # A second backward accumulates, as with one device.
    models.MyLoss()(dp.data_parallel(model, X, [0, 1]), y).backward()
    torch.testing.assert_close(model.fc2.bias.grad, 2 * reference.fc2.bias.grad)


def test_replicas_share_storage_on_device_0_and_copy_elsewhere():
    model, _ = twins()
    r0, r1 = dp.replicate(model, [0, 1])
    assert r0.fc1.weight.data_ptr() == model.fc1.weight.data_ptr()
    assert r1.fc1.weight.data_ptr() != model.fc1.weight.data_ptr()
    assert torch.equal(r1.fc1.weight, model.fc1.weight)
    assert not r1.fc1.weight.is_leaf and r1.fc1.weight.requires_grad
    assert list(r1.parameters()) == []  # as torch's replicas: no leaf parameters
    detached = dp.replicate(model, [0, 1], detach=True)
    assert not detached[1].fc1.weight.requires_grad


def test_tied_weights_stay_tied_and_buffers_update_on_device_0():
    lin = nn.Linear(4, 4)
    tied = nn.Sequential(lin, nn.BatchNorm1d(4), lin)
    r0, r1 = dp.replicate(tied, [0, 1])
    assert r1[0].weight is r1[2].weight
    tied.train()
    dp.data_parallel(tied, torch.randn(8, 4), [0, 1])
    # Replica 0 shares the buffers, so its in-place update reaches the original;
    # the other replica's is lost, as in torch.
    assert tied[1].num_batches_tracked.item() == 1


def test_dim_other_than_zero():
    torch.manual_seed(0)
    layer = nn.Linear(10, 4)
    seq = torch.randn(7, 9, 10)  # (time, batch, features)
    chunks = dp.scatter(seq, [0, 1, 2], dim=1)
    assert [c.shape for c in chunks] == [(7, 3, 10)] * 3
    out = dp.data_parallel(layer, seq, [0, 1, 2], dim=1)
    assert compare.max_abs_diff(out, layer(seq)) <= 1e-6
    out = dp.data_parallel(layer, seq, [0, 1], dim=-2)
    assert compare.max_abs_diff(out, layer(seq)) <= 1e-6


class Scaled(nn.Module):
    """Takes keyword inputs and returns a nested tuple and a dict."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, *, scale, offset=None, label="plain"):
        assert label == "shared"  # non-tensors reach every replica unchanged
        h = self.lin(x) * scale
        return (h, (h.sum(1, keepdim=True), None)), {"h": h, "shifted": h + offset}


def test_keyword_inputs_and_nested_outputs():
    torch.manual_seed(0)
    model = Scaled()
    X, offset = torch.randn(6, 3), torch.randn(6, 3)
    kwargs = {"scale": 2.0, "offset": offset, "label": "shared"}
    (h, (s, nothing)), extra = dp.data_parallel(model, X, [0, 1, 2],
                                                module_kwargs=kwargs)
    (ref_h, (ref_s, _)), ref_extra = model(X, **kwargs)
    torch.testing.assert_close(h, ref_h)
    torch.testing.assert_close(s, ref_s)
    assert nothing is None
    torch.testing.assert_close(extra["shifted"], ref_extra["shifted"])
    args, kw = dp.scatter_kwargs((X,), kwargs, [0, 1])
    assert [len(a[0]) for a in args] == [len(k["offset"]) for k in kw] == [3, 3]
    assert kw[0]["scale"] == kw[1]["scale"] == 2.0


def test_outputs_that_cannot_be_gathered():
    with pytest.raises(TypeError, match="cannot gather outputs of type str"):
        dp.gather(["a", "b"], 0)
    with pytest.raises(ValueError, match="outputs is empty"):
        dp.gather([], 0)


def test_keyword_only_and_no_inputs():
    args, kwargs = dp.scatter_kwargs((), {"x": torch.randn(4, 2)}, [0, 1])
    assert args == ((), ()) and [len(k["x"]) for k in kwargs] == [2, 2]
    args, kwargs = dp.scatter_kwargs((torch.randn(4, 2),), None, [0, 1])
    assert kwargs == ({}, {})
    lin = nn.Linear(2, 2)
    out = dp.data_parallel(lin, (), [0, 1], module_kwargs={"input": torch.randn(4, 2)})
    assert out.shape == (4, 2)


def test_scatter_containers_and_named_tuples():
    Pair = namedtuple("Pair", "a b")
    X = torch.arange(12.0).reshape(6, 2)
    parts = dp.scatter(Pair(X, "tag"), [0, 1])
    assert all(isinstance(p, Pair) and p.b == "tag" for p in parts)
    parts = dp.scatter([X, {"y": X[:4]}], [0, 1, 2])
    assert [len(p[1]["y"]) for p in parts] == [2, 2]  # the fewest chunks decide
    assert dp.gather([Pair(X, None), Pair(X, None)], 0).a.shape == (12, 2)


def test_gather_scalars_becomes_a_vector_with_a_warning():
    with pytest.warns(UserWarning, match="scalars"):
        out = dp.gather([torch.tensor(1.0), torch.tensor(2.0)], 0)
    assert out.tolist() == [1.0, 2.0]


def test_a_failing_replica_names_its_device():
    class FailsOnSmall(nn.Module):
        def forward(self, x):
            if len(x) < 3:
                raise KeyError("too small")
            return x

    # chunks 3, 3, 2: only the replica on device 7 fails
    with pytest.raises(KeyError, match="replica 2 on simulated device 7"):
        dp.data_parallel(FailsOnSmall(), torch.randn(8, 2), [4, 5, 7])
    with pytest.raises(RuntimeError, match="replica 0 on simulated device 0"):
        dp.data_parallel(models.MLPAsWritten(), torch.randn(100, 10))


def test_replicas_run_in_separate_threads():
    import threading

    model, _ = twins()
    names = []
    model.register_forward_hook(
        lambda m, a, o: names.append(threading.current_thread().name))
    dp.data_parallel(model, torch.randn(6, 10), [0, 1, 2])
    assert sorted(names) == ["replica 0", "replica 1", "replica 2"]


def test_grad_mode_reaches_the_replica_threads():
    model, _ = twins()
    with torch.no_grad():
        out = dp.data_parallel(model, torch.randn(6, 10), [0, 1])
    assert not out.requires_grad


@pytest.mark.parametrize(
    ("device_ids", "match"),
    [([], "device_ids is empty"), ([0, 0], "device_ids: device 0 appears twice"),
     ([-1, 0], "device_ids: -1 is negative"), (["cuda:0"], "device_ids: 'cuda:0'"),
     ([0.5], "device_ids: 0.5")],
)
def test_bad_device_ids(device_ids, match):
    if torch.cuda.is_available() and device_ids == ["cuda:0"]:
        pytest.skip("names a real CUDA device here")
    model, _ = twins()
    with pytest.raises(ValueError, match=match):
        dp.data_parallel(model, torch.randn(4, 10), device_ids)
    with pytest.raises(ValueError, match="device_ids"):
        dp.scatter(torch.randn(4, 10), device_ids)
    with pytest.raises(ValueError, match="device_ids"):
        dp.replicate(model, device_ids)


def test_bad_dim_and_output_device():
    with pytest.raises(ValueError, match=r"dim=2 does not exist .* \(4, 3\)"):
        dp.scatter(torch.randn(4, 3), [0, 1], dim=2)
    with pytest.raises(ValueError, match="dim=0: a 0-dimensional tensor"):
        dp.scatter(torch.tensor(1.0), [0, 1])
    with pytest.raises(ValueError, match="dim=-3 does not exist"):
        dp.gather([torch.randn(2, 2)] * 2, 0, dim=-3)
    with pytest.raises(ValueError, match="output_device"):
        dp.data_parallel(nn.Linear(2, 2), torch.randn(4, 2), [0, 1], output_device=-2)
    with pytest.raises(ValueError, match="output_device"):
        dp.gather([torch.randn(2, 2)] * 2, "gpu")
    assert dp.gather([torch.randn(2, 2)] * 2, "cpu").shape == (4, 2)


def test_parallel_apply_checks_lengths():
    model, _ = twins()
    with pytest.raises(ValueError, match="inputs has 1 entries for 2 replicas"):
        dp.parallel_apply(dp.replicate(model, [0, 1]), [torch.randn(2, 10)])


def test_default_is_two_simulated_devices():
    assert dp.simulated_devices() == [0, 1] == list(range(dp.DEFAULT_DEVICES))
    model, _ = twins()
    ran = []
    model.register_forward_hook(lambda m, a, o: ran.append(len(a[0])))
    dp.data_parallel(model, torch.randn(10, 10))
    assert ran == [5, 5]


def test_dp_experiment_fields():
    result = dp_experiments.dp_experiment(devices=3, batch=100, seed=1)
    assert result["devices"] == 3 and result["batch"] == 100
    assert result["output_max_abs_diff"] <= 1e-6
    assert result["grad_max_abs_diff"] <= 1e-6
    if result["simulated"]:
        assert result["chunk_sizes"] == [34, 34, 32] and result["replicas_used"] == 3
    with pytest.raises(ValueError, match="devices and batch must be >= 1"):
        dp_experiments.dp_experiment(devices=0)


@settings(max_examples=50, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=4),
       n=st.integers(1, 5), data=st.data())
def test_scatter_gather_round_trip(shape, n, data):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    X = torch.randn(*shape)
    chunks = dp.scatter(X, list(range(n)), dim=dim)
    size = shape[dim]
    assert len(chunks) == len(X.chunk(n, dim)) <= min(n, size)
    assert [c.shape[dim] for c in chunks] == [c.shape[dim] for c in X.chunk(n, dim)]
    assert torch.equal(dp.gather(list(chunks), 0, dim=dim), X)


@settings(max_examples=50, deadline=None)
@given(batch=st.integers(1, 12), n=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_data_parallel_matches_one_device(batch, n, seed):
    out_diff, grad_diff, _ = run_both(batch, list(range(n)), seed)
    assert out_diff <= 1e-6 and grad_diff <= 1e-6


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA: compares with torch's own data_parallel on GPUs")


@needs_cuda
def test_simulation_matches_torch_data_parallel_on_cuda():
    n = torch.cuda.device_count()
    model, reference = twins()
    X, y = torch.randn(64, 10), torch.randn(64, 10)
    cuda_model = copy.deepcopy(model).cuda()
    out_cuda = dp.data_parallel(cuda_model, X.cuda(), list(range(n)))  # torch's own
    models.MyLoss()(out_cuda, y.cuda()).backward()
    out_sim = dp.data_parallel(model, X, list(range(max(n, 2))))  # the simulation
    models.MyLoss()(out_sim, y).backward()
    assert dp.uses_cuda(cuda_model) and not dp.uses_cuda(model)
    assert compare.max_abs_diff(out_cuda.cpu(), out_sim) <= 1e-5
    cuda_grads = [g.cpu() for g in grads(cuda_model)]
    assert compare.max_abs_diff(cuda_grads, grads(model)) <= 1e-5
    with pytest.raises(ValueError, match="device_ids"):
        dp.data_parallel(cuda_model, X.cuda(), [n])  # beyond device_count


def test_cli_dp_writes_the_differences(tmp_path, capsys):
    from labkit.__main__ import main

    out = tmp_path / "dp.json"
    assert main(["dp", "--devices", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["output_max_abs_diff"] <= 1e-6
    assert result["grad_max_abs_diff"] <= 1e-6
    assert result["devices"] == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["dp", "--devices", "0"])
    assert exit_.value.code == 2
    assert "devices and batch must be >= 1" in capsys.readouterr().err


def _replications_in(steps, run_step):
    """How often dp.replicate ran in `steps` calls of `run_step` (lessons 02, 03)."""
    with mock.patch.object(dp, "replicate", wraps=dp.replicate) as replicate:
        for _ in range(steps):
            run_step()
    return replicate.call_count


def test_dataparallel_replicates_at_every_step():
    step = dp_experiments.dp_stepper(100, 1, 64, devices=2)
    before = [p.detach().clone() for p in step.model.parameters()]
    assert _replications_in(3, step) == 3
    assert compare.max_abs_diff(list(step.model.parameters()), before) > 0  # it trained


def test_the_replication_count_catches_replicas_built_once():
    # The broken variant the lessons' count must tell apart: replicas built once.
    model, _ = twins()
    X, replicas = torch.randn(64, 10), []

    def data_parallel_replicating_once():
        if not replicas:
            replicas.extend(dp.replicate(model, [0, 1]))
        return dp.gather(dp.parallel_apply(replicas, dp.scatter(X, [0, 1])))

    assert _replications_in(3, data_parallel_replicating_once) == 1


def test_dp_stepper_times_a_step_and_restores_threads():
    threads = torch.get_num_threads()
    step = dp_experiments.dp_stepper(100, 1, 64, devices=2, threads=1)
    assert step() > 0 and torch.get_num_threads() == threads
    with pytest.raises(ValueError, match="threads must be >= 1"):
        dp_experiments.dp_stepper(100, 1, 64, threads=0)


def test_ddp_stepper_shards_the_batch_and_keeps_replicas_equal(ranks):
    ranks.execute(
        "from labkit import compare, dp_experiments\n"
        "step = dp_experiments.ddp_stepper(100, 1, 64)\n"
        "seen = []\n"
        "hook = step.model.module.register_forward_hook(\n"
        "    lambda module, args, out: seen.append(len(args[0])))\n"
        "seconds = [step() for _ in range(2)]\n"
        "hook.remove()\n"
        "diff = compare.replica_max_diff(step.model)\n")
    assert ranks.pull("seen") == [[32, 32], [32, 32]]  # half the batch per rank
    assert ranks.pull("diff") == [0.0, 0.0]
    assert all(s > 0 for seconds in ranks.pull("seconds") for s in seconds)
