"""labkit.comm_counting: the comm hook and the patcher each count a known sequence.

One process in a gloo group of one: DDP still all-reduces every bucket and
broadcasts its buffers there, and torch's Flight Recorder records every
collective the process group ran, the independent witness of what was sent.
"""

import json
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import buckets, comm_counting

# Linear(40, 40) and Linear(40, 1): 1681 float32 values. In buckets of 52 bytes
# DDP sends them as one bucket in step 1, then rebuilt in the order the
# gradients arrived: the second layer (41 values), the first's bias, its weight.
STEPS = [[6724], [164, 160, 6400], [164, 160, 6400]]
CAP_MB = 52 / 2**20


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(**kwargs) -> DDP:
    torch.manual_seed(0)
    return DDP(torch.nn.Sequential(torch.nn.Linear(40, 40), torch.nn.Linear(40, 1)),
               bucket_cap_mb=CAP_MB, **kwargs)


def _flight_records() -> list[dict]:
    return json.loads(c10d._dump_fr_trace_json()).get("entries", [])


def _seen_per_step(counter, steps=3):
    """What `counter` recorded per step, what the patched all_reduce and the
    Flight Recorder saw per step (bytes of each all-reduce), on _model()."""
    model = _model()
    counter.attach(model)
    patched, recorded = [], []
    with comm_counting.CollectiveLog() as log:
        for _ in range(steps):
            counter.step()
            log.reset()
            last = max((e["record_id"] for e in _flight_records()), default=-1)
            model(torch.ones(2, 40)).sum().backward()
            patched.append([c["bytes"] for c in log.calls])
            recorded.append([4 * math.prod(e["input_sizes"][0])
                             for e in _flight_records() if e["record_id"] > last
                             and e["profiling_name"] == "gloo:all_reduce"])
    return counter.steps, patched, recorded


class _Forgetful(comm_counting.CommCounter):
    """A broken counter: it all-reduces every bucket but records only the first."""

    def attach(self, model):
        model.register_comm_hook(self, _Forgetful._hook)
        return self

    @staticmethod
    def _hook(counter, bucket):
        if not counter.sizes:
            return comm_counting.CommCounter._hook(counter, bucket)
        return comm_counting.default_hooks.allreduce_hook(None, bucket)


def test_the_comm_hook_records_every_bucket_the_process_group_all_reduced(one_rank):
    counter = comm_counting.CommCounter(per_step=True)
    counted, patched, recorded = _seen_per_step(counter)
    assert counted == patched == recorded == STEPS
    # The broken variant: a hook that stops recording disagrees with both.
    forgot, patched, recorded = _seen_per_step(_Forgetful(per_step=True))
    assert patched == recorded == STEPS and forgot != STEPS


def test_the_counter_sums_its_calls_and_resets(one_rank):
    model = _model()
    counter = comm_counting.CommCounter().attach(model)
    for _ in range(2):
        counter.reset()
        model(torch.ones(2, 40)).sum().backward()
    assert counter.sizes == STEPS[1] and counter.steps == []  # no step() asked
    assert counter.calls == 3 and counter.bytes == 6724


def test_a_per_step_counter_needs_a_step_before_the_backward():
    with pytest.raises(RuntimeError, match=r"step\(\) must be called"):
        comm_counting.CommCounter._hook(comm_counting.CommCounter(per_step=True), None)


def test_the_log_counts_tensors_passed_by_position_or_by_name(one_rank):
    original = dist.all_reduce
    with comm_counting.CollectiveLog() as sent:
        dist.all_reduce(torch.ones(10))
        dist.broadcast(tensor=torch.ones(3, dtype=torch.float16), src=0)  # as ZeRO does
        work = dist.all_reduce(torch.ones(2, dtype=torch.float64), dist.ReduceOp.SUM,
                               None, True)  # asynchronous, said by position
        work.wait()
    assert [(c["op"], c["bytes"], c["async"]) for c in sent.calls] == [
        ("all_reduce", 40, False), ("broadcast", 6, False), ("all_reduce", 16, True)]
    assert sent.count("all_reduce") == 2 and sent.count("broadcast") == 1
    assert sent.nbytes("all_reduce") == 56 and sent.nbytes() == 62
    for call in sent.calls:  # an asynchronous one may still run when waited for
        assert call["start"] <= call["end"] and call["start"] <= call["waited"]
        assert call["async"] or call["end"] == call["waited"]
    assert dist.all_reduce is original  # restored on leaving
    with comm_counting.CollectiveLog() as again:
        pass
    assert again.calls == [] and again.nbytes() == 0


def test_an_asynchronous_call_never_waited_for_says_so(one_rank):
    """Waited for through its future, not its handle: no wait noted, its end is.
    The end is noted by a callback that may run after the work's own future
    completes (once in 60 here), so the handle's future is the one after it."""
    for _ in range(500):
        with comm_counting.CollectiveLog() as log:
            out = dist.all_reduce(torch.ones(4), async_op=True).get_future().wait()
        call = log.calls[0]
        assert math.isnan(call["waited"]) and not math.isnan(call["end"])
        assert torch.equal(out[0], torch.ones(4))  # the result, as the work's future


def test_an_asynchronous_collective_without_a_future_is_logged_and_waited(one_rank):
    """gloo's reduce-scatter returns a work with no future ("Work::getFuture not
    implemented"), whose wait() copies the result out: the log hands it back."""
    whole, shard = torch.arange(1.0, 5.0), torch.zeros(4)  # one rank: shard is whole
    work = dist.reduce_scatter_single(shard, whole, async_op=True)
    with pytest.raises(RuntimeError, match="getFuture not implemented"):
        work.get_future()  # the premise, in this torch
    work.wait()
    shard.zero_()
    with comm_counting.CollectiveLog() as log:
        work = dist.reduce_scatter_single(shard, whole, async_op=True)
        assert math.isnan(log.calls[0]["end"]) and not shard.any()  # copied at wait
        work.wait()
        gathered = torch.zeros(4)
        dist.all_gather_single(gathered, whole, async_op=True).wait()  # has a future
    assert torch.equal(shard, whole) and torch.equal(gathered, whole)
    assert [(c["op"], c["bytes"], c["async"]) for c in log.calls] == [
        ("reduce_scatter", 16, True), ("all_gather", 16, True)]
    scatter, gather = log.calls
    assert scatter["start"] <= scatter["waited"] <= scatter["end"]  # ended at wait
    assert gather["start"] <= min(gather["waited"], gather["end"])


def test_the_log_puts_torch_back_after_an_error_and_refuses_to_nest_itself(one_rank):
    original = dist.broadcast
    log = comm_counting.CollectiveLog()
    with pytest.raises(KeyError), log:
        assert dist.broadcast is not original
        raise KeyError("a cell that fails inside the block")
    assert dist.broadcast is original
    with log, pytest.raises(RuntimeError, match="already active"):
        log.__enter__()
    assert dist.broadcast is original
    with pytest.raises(ValueError, match="ops must be some of"):
        comm_counting.CollectiveLog(("all_to_all",))


def test_neither_sees_what_ddp_sends_from_cpp_but_the_flight_recorder_does(one_rank):
    """The docstring's claim: DDP's buffer broadcasts and find_unused_parameters'
    map of used parameters reach the process group without Python's collectives."""
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4),
                                    torch.nn.Linear(4, 1)), find_unused_parameters=True)
    counter = comm_counting.CommCounter().attach(model)
    with comm_counting.CollectiveLog() as log:
        for _ in range(3):
            counter.reset()
            log.reset()
            last = max((e["record_id"] for e in _flight_records()), default=-1)
            model(torch.ones(2, 4)).sum().backward()
    seen = [(e["profiling_name"], e["input_dtypes"][0])
            for e in _flight_records() if e["record_id"] > last]
    gradients = 4 * (16 + 4 + 8 + 4 + 1)  # BatchNorm's weight and bias included
    assert seen == [("gloo:broadcast", "Float"), ("gloo:broadcast", "Long"),
                    ("gloo:all_reduce", "Float"), ("gloo:all_reduce", "Int")]
    assert counter.sizes == [gradients]
    assert [(c["op"], c["bytes"]) for c in log.calls] == [("all_reduce", gradients)]


def test_a_timeline_records_each_all_reduce_against_the_gradients(one_rank):
    model = _model()
    original = dist.all_reduce
    with buckets.Timeline(model, buckets.allreduce_hook) as timeline:
        records = [timeline.backward(model(torch.ones(2, 40)).sum()) for _ in range(3)]
        assert dist.all_reduce is original  # patched only within a step
        with pytest.raises(RuntimeError, match="end_step"):
            timeline.step()
            timeline.step()
    assert dist.all_reduce is original  # leaving ends the open step
    assert [[c["bytes"] for c in r["calls"]] for r in records] == STEPS
    for r in records:
        assert len(r["grad_times"]) == 4 and r["grad_end"] == r["grad_times"][-1]
        assert r["grad_end"] <= r["end"] == r["backward_end"]
        assert r["events"] == sorted((c["start"], c["end"]) for c in r["calls"])
        assert r["hidden_s"] + r["exposed_s"] > 0
    # Its gradient hooks are gone with the block.
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_reduce_scatter_and_all_gather_count_the_whole_buffer_once(one_rank):
    """Both names torch has for each (the deprecated ones call the new ones
    inside distributed_c10d) give one record, sized by the whole buffer."""
    whole, shard = torch.ones(6), torch.empty(6)  # one rank: the shard is whole
    names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor",
                         "all_gather_single", "all_gather_into_tensor")
             if hasattr(dist, n)]
    assert names, "this torch has neither name for the reduce-scatter"
    before = {n: getattr(dist, n) for n in names}
    with comm_counting.CollectiveLog() as log, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old names, in 2.13
        for name in names:
            if name.startswith("reduce_scatter"):
                getattr(dist, name)(shard, whole)
            else:
                getattr(dist, name)(whole, shard)
    assert [(c["op"], c["bytes"]) for c in log.calls] == [
        ("reduce_scatter" if n.startswith("reduce") else "all_gather", 24)
        for n in names]
    assert log.nbytes("all_gather") == 24 * sum(n.startswith("all_g") for n in names)
    assert {n: getattr(dist, n) for n in names} == before  # put back


def test_a_training_step_records_forward_backward_buckets_and_the_optimizer(one_rank):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    X, y = torch.ones(2, 40), torch.zeros(2, 1)
    before = model.module[1].bias.detach().clone()
    with buckets.Timeline(model, buckets.allreduce_hook) as timeline:
        records = [timeline.train_step(model, X, y, torch.nn.MSELoss(), optimizer)
                   for _ in range(2)]
    last = records[-1]  # after the rebuild: three buckets
    assert [c["bytes"] for c in last["calls"]] == STEPS[1]
    assert last["grad_names"] == ["1.bias", "1.weight", "0.bias", "0.weight"]
    assert 0 < last["forward_end"] <= last["grad_times"][0]
    assert last["grad_end"] <= last["backward_end"] < last["end"]
    buckets.check_step([last, last])
    assert not torch.equal(before, model.module[1].bias)  # the optimizer stepped


def _traced_step(**changes) -> dict:
    """A step record as Timeline.train_step makes it: forward to 2 ms, gradients
    at 3, 4 and 6 ms, two buckets (the first hidden), backward back at 8 ms."""
    step = {"forward_end": 0.002, "grad_times": [0.003, 0.004, 0.006],
            "grad_end": 0.006, "events": [(0.0041, 0.005), (0.0061, 0.0075)],
            "backward_end": 0.008, "end": 0.009}
    return step | changes


def test_the_step_check_fails_where_ddp_would_not_behave_so():
    buckets.check_step([_traced_step(), _traced_step()])
    with pytest.raises(AssertionError, match="same number"):
        buckets.check_step([_traced_step(), _traced_step(events=[(0.0061, 0.0075)])])
    with pytest.raises(AssertionError, match="more than one bucket"):
        buckets.check_step([_traced_step(events=[(0.0061, 0.0075)])])
    with pytest.raises(AssertionError, match="before the forward ended"):
        buckets.check_step([_traced_step(forward_end=0.0035)])
    with pytest.raises(AssertionError, match="averaged gradients"):  # still running
        buckets.check_step([_traced_step(events=[(0.0041, 0.005), (0.0061, 0.0085)])])
    with pytest.raises(AssertionError, match="nothing overlapped"):
        buckets.check_step([_traced_step(events=[(0.0061, 0.007), (0.0065, 0.0075)])])
    with pytest.raises(ValueError, match="no rank"):
        buckets.check_step([])
