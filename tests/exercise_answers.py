"""Learners' answers to the exercises, right and typically wrong, for test_exercises.py.

A separate module so that the engines can import the answers that run on ranks
by name (pytest would rewrite a test module's asserts).
"""

import math
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from labkit import data_parallel as dp
from labkit import models, no_sync

# 01: doc 004's model with view(-1) fixed


class FlattenEachSample(models.MLPAsWritten):
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class ViewMinusOne(models.MLPAsWritten):
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.view(-1))))


class Squeeze(models.MLPAsWritten):
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.squeeze())))


class ViewMinusTen(models.MLPAsWritten):
    """Right for this model: its first layer takes 10 features."""

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.view(-1, 10))))


class ViewBatch100(models.MLPAsWritten):
    """The lesson's batch of 100, written as a number."""

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.view(100, -1))))


class NoFlatten(models.MLPAsWritten):
    """The view(-1) line deleted: right while samples are already flat."""

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class FlattenLastDim(models.MLPAsWritten):
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.view(-1, x.size(-1)))))


# 01: one training step


def train_step(model, optimizer, criterion, X, y):
    optimizer.zero_grad()
    loss = criterion(model(X), y)
    loss.backward()
    optimizer.step()
    return loss.item()


def train_step_as_written(model, optimizer, criterion, X, y):
    loss = criterion(model(X), y)
    loss.backward  # noqa: B018  (the document's line: no call, and no step after it)


def train_step_no_zero_grad(model, optimizer, criterion, X, y):
    criterion(model(X), y).backward()
    optimizer.step()


def train_step_no_step(model, optimizer, criterion, X, y):
    optimizer.zero_grad()
    criterion(model(X), y).backward()


def train_step_backward_only(model, optimizer, criterion, X, y):
    """Only the parentheses of backward() added."""
    loss = criterion(model(X), y)
    loss.backward()
    return loss.item()


def train_step_zero_grad_at_end(model, optimizer, criterion, X, y):
    """Right: the gradients are cleared after the step rather than before."""
    loss = criterion(model(X), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def train_step_zero_grad_before_step(model, optimizer, criterion, X, y):
    loss = criterion(model(X), y)
    loss.backward()
    optimizer.zero_grad()
    optimizer.step()
    return loss.item()


def train_step_step_before_backward(model, optimizer, criterion, X, y):
    optimizer.zero_grad()
    loss = criterion(model(X), y)
    optimizer.step()
    loss.backward()
    return loss.item()


# 02: data_parallel by hand


def data_parallel(module, X, device_ids):
    chunks = dp.scatter(X, device_ids)
    replicas = dp.replicate(module, device_ids[: len(chunks)])
    outputs = dp.parallel_apply(replicas, chunks, devices=device_ids[: len(chunks)])
    return dp.gather(outputs, 0)


def data_parallel_no_gather(module, X, device_ids):
    chunks = dp.scatter(X, device_ids)
    return dp.parallel_apply(dp.replicate(module, device_ids), chunks)


def data_parallel_gather_dim1(module, X, device_ids):
    chunks = dp.scatter(X, device_ids)
    outputs = dp.parallel_apply(dp.replicate(module, device_ids), chunks)
    return dp.gather(outputs, 0, dim=1)


def data_parallel_no_replicas(module, X, device_ids):
    return dp.gather([module(c) for c in dp.scatter(X, device_ids)], 0)


def data_parallel_every_device(module, X, device_ids):
    """A replica on every device, even one without a chunk."""
    chunks = dp.scatter(X, device_ids)
    replicas = dp.replicate(module, device_ids)
    outputs = dp.parallel_apply(replicas, chunks, devices=device_ids)
    return dp.gather(outputs, output_device=0)


def data_parallel_in_this_thread(module, X, device_ids):
    """Replicas, but the exercise's step 3 left as it was: one after another."""
    chunks = dp.scatter(X, device_ids)
    replicas = dp.replicate(module, device_ids[: len(chunks)])
    return dp.gather([r(c) for r, c in zip(replicas, chunks, strict=True)], 0)


def data_parallel_whole_batch(module, X, device_ids):
    replicas = dp.replicate(module, device_ids)
    return dp.gather(dp.parallel_apply(replicas, [X] * len(replicas)), 0)


def data_parallel_deepcopy(module, X, device_ids):
    """Copies that share no autograd with the original: its .grad stays empty."""
    import copy

    chunks = dp.scatter(X, device_ids)
    replicas = [copy.deepcopy(module) for _ in chunks]
    return dp.gather(dp.parallel_apply(replicas, chunks), 0)


# 03: set_epoch


def _orders(dataset, rank, world_size, num_epochs, epoch_of, seed=0):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=seed)
    orders = []
    for epoch in range(num_epochs):
        if epoch_of is not None:
            sampler.set_epoch(epoch_of(epoch, rank))
        orders.append(list(sampler))
    return orders


def epoch_orders(dataset, rank, world_size, num_epochs):
    return _orders(dataset, rank, world_size, num_epochs, lambda e, r: e)


def epoch_orders_no_set_epoch(dataset, rank, world_size, num_epochs):
    return _orders(dataset, rank, world_size, num_epochs, None)


def epoch_orders_rank_epoch(dataset, rank, world_size, num_epochs):
    return _orders(dataset, rank, world_size, num_epochs, lambda e, r: e + r)


def epoch_orders_rank_0_only(dataset, rank, world_size, num_epochs):
    """set_epoch on rank 0 only: rank 1 keeps epoch 0's order."""
    return _orders(dataset, rank, world_size, num_epochs,
                   lambda e, r: e if r == 0 else 0)


def epoch_orders_seed_rank(dataset, rank, world_size, num_epochs):
    return _orders(dataset, rank, world_size, num_epochs, lambda e, r: e, seed=rank)


def epoch_orders_set_after(dataset, rank, world_size, num_epochs):
    """set_epoch at the end of the epoch: epoch 1 repeats epoch 0."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=0)
    orders = []
    for epoch in range(num_epochs):
        orders.append(list(sampler))
        sampler.set_epoch(epoch)
    return orders


def epoch_orders_one_short(dataset, rank, world_size, num_epochs):
    return _orders(dataset, rank, world_size, num_epochs - 1, lambda e, r: e)


# 03: gradient averaging by hand


def average_gradients(model, world_size):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size


def average_gradients_sum(model, world_size):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def average_gradients_copy(model, world_size):
    for p in model.parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        g /= world_size


def average_gradients_two(model, world_size):
    """The lesson's 2 ranks written as a number: right on 2 ranks only."""
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= 2


def average_gradients_mean_on_rank_0(model, world_size):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        if dist.get_rank() == 0:
            p.grad /= world_size


def average_gradients_params(model, world_size):
    """The parameters all-reduced instead of their gradients."""
    for p in model.parameters():
        dist.all_reduce(p.data)
        p.data /= world_size


def average_gradients_divide_last(model, world_size):
    """The division outdented: only the last parameter's sum becomes a mean."""
    for p in model.parameters():
        dist.all_reduce(p.grad)
    p.grad /= world_size


# 04: one update of K micro-batches


def accumulation_step(model, optimizer, criterion, batches):
    K = len(batches)
    optimizer.zero_grad()
    for i, (X, y) in enumerate(batches):
        if i < K - 1:
            with model.no_sync():
                (criterion(model(X), y) / K).backward()
        else:
            (criterion(model(X), y) / K).backward()
    optimizer.step()


def accumulation_all_inside(model, optimizer, criterion, batches):
    """No final synchronized micro-batch."""
    K = len(batches)
    optimizer.zero_grad()
    with model.no_sync():
        for X, y in batches:
            (criterion(model(X), y) / K).backward()
    optimizer.step()


def accumulation_not_divided(model, optimizer, criterion, batches):
    optimizer.zero_grad()
    for i, (X, y) in enumerate(batches):
        with model.no_sync() if i < len(batches) - 1 else nullcontext():
            criterion(model(X), y).backward()
    optimizer.step()


def accumulation_step_inside(model, optimizer, criterion, batches):
    """The document's misuse: every micro-batch steps, inside no_sync."""
    K = len(batches)
    for i, (X, y) in enumerate(batches):
        with model.no_sync() if i < K - 1 else nullcontext():
            optimizer.zero_grad()
            (criterion(model(X), y) / K).backward()
            optimizer.step()


def accumulation_no_zero_grad(model, optimizer, criterion, batches):
    K = len(batches)
    for i, (X, y) in enumerate(batches):
        with model.no_sync() if i < K - 1 else nullcontext():
            (criterion(model(X), y) / K).backward()
    optimizer.step()


def accumulation_sync_every(model, optimizer, criterion, batches):
    """Forward outside no_sync: DDP synchronizes every micro-batch."""
    K = len(batches)
    optimizer.zero_grad()
    for i, (X, y) in enumerate(batches):
        loss = criterion(model(X), y) / K
        with model.no_sync() if i < K - 1 else nullcontext():
            loss.backward()
    optimizer.step()


def accumulation_sync_first(model, optimizer, criterion, batches):
    """Synchronizes the first micro-batch instead of the last."""
    K = len(batches)
    optimizer.zero_grad()
    for i, (X, y) in enumerate(batches):
        with model.no_sync() if i > 0 else nullcontext():
            (criterion(model(X), y) / K).backward()
    optimizer.step()


def accumulation_k_as_4(model, optimizer, criterion, batches):
    """The lesson's K = 4 written as a number."""
    optimizer.zero_grad()
    for i, (X, y) in enumerate(batches):
        with model.no_sync() if i < 3 else nullcontext():
            (criterion(model(X), y) / 4).backward()
    optimizer.step()


def accumulation_zero_grad_inside(model, optimizer, criterion, batches):
    K = len(batches)
    for i, (X, y) in enumerate(batches):
        optimizer.zero_grad()
        with model.no_sync() if i < K - 1 else nullcontext():
            (criterion(model(X), y) / K).backward()
    optimizer.step()


def accumulation_by_world_size(model, optimizer, criterion, batches):
    """Each loss divided by the number of ranks rather than K."""
    K, world_size = len(batches), dist.get_world_size()
    optimizer.zero_grad()
    for i, (X, y) in enumerate(batches):
        with model.no_sync() if i < K - 1 else nullcontext():
            (criterion(model(X), y) / world_size).backward()
    optimizer.step()


def accumulation_step_on_rank_0(model, optimizer, criterion, batches):
    K = len(batches)
    optimizer.zero_grad()
    for i, (X, y) in enumerate(batches):
        with model.no_sync() if i < K - 1 else nullcontext():
            (criterion(model(X), y) / K).backward()
    if dist.get_rank() == 0:
        optimizer.step()


# 04: replicas that drift apart


def train(model, optimizer, scheduler, criterion, updates, rank):
    for batches in updates:
        optimizer.zero_grad()
        no_sync.accumulate_no_sync(model, criterion, batches)
        optimizer.step()
        scheduler.step()


def train_scheduler_on_rank_0(model, optimizer, scheduler, criterion, updates, rank):
    for batches in updates:
        optimizer.zero_grad()
        no_sync.accumulate_no_sync(model, criterion, batches)
        optimizer.step()
        if rank == 0:
            scheduler.step()


def train_no_scheduler(model, optimizer, scheduler, criterion, updates, rank):
    for batches in updates:
        optimizer.zero_grad()
        no_sync.accumulate_no_sync(model, criterion, batches)
        optimizer.step()


def train_step_on_rank_0(model, optimizer, scheduler, criterion, updates, rank):
    for batches in updates:
        optimizer.zero_grad()
        no_sync.accumulate_no_sync(model, criterion, batches)
        if rank == 0:
            optimizer.step()
        scheduler.step()


def train_scheduler_first(model, optimizer, scheduler, criterion, updates, rank):
    """On every rank, but before the update it should follow."""
    for batches in updates:
        optimizer.zero_grad()
        no_sync.accumulate_no_sync(model, criterion, batches)
        scheduler.step()
        optimizer.step()


# 06: the bytes PowerSGD sends in a step (lesson 06's answer, and wrong ones)


def powersgd_bytes(shapes, r):
    values = 0
    for shape in shapes:
        if len(shape) == 1:  # a vector: sent as it is
            values += shape[0]
            continue
        n, m = shape[0], math.prod(shape[1:])
        compressed = (n + m) * r
        values += compressed if compressed * 2 < n * m else n * m
    return 4 * values


def powersgd_bytes_as_matrices(shapes, r):
    """No rule for vectors: each is an n × 1 matrix, which never passes the rate."""
    values = 0
    for shape in shapes:
        n, m = shape[0], math.prod(shape[1:])
        values += (n + m) * r if (n + m) * r * 2 < n * m else n * m
    return 4 * values


def powersgd_bytes_at_most_half(shapes, r):
    """`<=`: compresses a matrix that compression would only halve."""
    values = 0
    for shape in shapes:
        n, m = shape[0], math.prod(shape[1:]) if len(shape) > 1 else 1
        values += (n + m) * r if (n + m) * r * 2 <= n * m and m > 1 else n * m
    return 4 * values


def powersgd_bytes_whole_model(shapes, r):
    """The rate rule decided once for all the matrices together."""
    vectors = sum(s[0] for s in shapes if len(s) == 1)
    matrices = [(s[0], math.prod(s[1:])) for s in shapes if len(s) > 1]
    compressed = sum((n + m) * r for n, m in matrices)
    whole = sum(n * m for n, m in matrices)
    return 4 * (vectors + (compressed if compressed * 2 < whole else whole))


def powersgd_bytes_without_r(shapes, r):
    """P and Q as if the rank were 1."""
    return powersgd_bytes(shapes, 1)


def powersgd_bytes_sorting_shapes(shapes, r):
    """Right, but sorts the caller's list in place (and pops it empty)."""
    shapes.sort(key=len)
    total = powersgd_bytes(shapes, r)
    shapes.clear()
    return total


# 06: DDP's buckets (lesson 06's answer, and wrong ones)


def ddp_buckets(param_bytes, bucket_cap_mb, *, first_always=False, close_before=False,
                count_last=True):
    mib = 1024 * 1024
    cap = (25 if bucket_cap_mb is None else bucket_cap_mb) * mib
    first = mib if bucket_cap_mb is None or first_always else cap
    buckets, size = 0, 0
    for nbytes in reversed(param_bytes):
        limit = first if buckets == 0 else cap
        if close_before:  # a parameter that would overflow starts a new bucket
            if size and size + nbytes > limit:
                buckets, size = buckets + 1, 0
            size += nbytes
            continue
        size += nbytes
        if size >= limit:
            buckets, size = buckets + 1, 0
    return buckets + (size > 0 and count_last)


def ddp_buckets_first_always(param_bytes, bucket_cap_mb):
    """A 1 MiB first bucket whatever the cap."""
    return ddp_buckets(param_bytes, bucket_cap_mb, first_always=True)


def ddp_buckets_close_before(param_bytes, bucket_cap_mb):
    return ddp_buckets(param_bytes, bucket_cap_mb, close_before=True)


def ddp_buckets_last_left_out(param_bytes, bucket_cap_mb):
    """Counts only the buckets that closed."""
    return ddp_buckets(param_bytes, bucket_cap_mb, count_last=False)


def ddp_buckets_reversing_the_list(param_bytes, bucket_cap_mb):
    """Right, but reverses the caller's list in place."""
    param_bytes.reverse()
    return ddp_buckets(param_bytes[::-1], bucket_cap_mb)


# 07: the bytes of activations DeepMLP keeps for backward


def saved_bytes(batch, width, depth, segments, checkpointed):
    kept = segments if checkpointed else depth + 1  # segment inputs; or X + every ReLU
    return kept * batch * width * 4


def saved_values(batch, width, depth, segments, checkpointed):
    """Values, not bytes."""
    return saved_bytes(batch, width, depth, segments, checkpointed) // 4


def saved_bytes_twice(batch, width, depth, segments, checkpointed):
    """Each Linear's input and each ReLU's output, counted apart."""
    kept = segments if checkpointed else 2 * depth
    return kept * batch * width * 4


def saved_bytes_without_x(batch, width, depth, segments, checkpointed):
    kept = segments if checkpointed else depth  # the model's input forgotten
    return kept * batch * width * 4


def saved_bytes_with_outputs(batch, width, depth, segments, checkpointed):
    kept = segments + 1 if checkpointed else depth + 1  # the last output as well
    return kept * batch * width * 4


def saved_bytes_checkpoint_ignored(batch, width, depth, segments, checkpointed):
    return (depth + 1) * batch * width * 4


def saved_bytes_per_sample(batch, width, depth, segments, checkpointed):
    """The batch forgotten: one sample's activations."""
    return saved_bytes(batch, width, depth, segments, checkpointed) // batch


def saved_megabytes(batch, width, depth, segments, checkpointed):
    """As the lesson prints it: MB."""
    return saved_bytes(batch, width, depth, segments, checkpointed) / 1e6


def saved_bytes_float64(batch, width, depth, segments, checkpointed):
    return 2 * saved_bytes(batch, width, depth, segments, checkpointed)


def saved_bytes_checkpoint_without_x(batch, width, depth, segments, checkpointed):
    """The first segment's input, the model's input X, left out."""
    kept = segments - 1 if checkpointed else depth + 1
    return kept * batch * width * 4


# 07: an evaluation that changes nothing and keeps nothing


def evaluate(model, X, y):
    model.eval()
    with torch.no_grad():
        return models.MyLoss()(model(X), y).item()


def evaluate_with_grad(model, X, y):
    model.eval()
    return models.MyLoss()(model(X), y).item()


def evaluate_in_training_mode(model, X, y):
    with torch.no_grad():
        return models.MyLoss()(model(X), y).item()


def evaluate_sum(model, X, y):
    model.eval()
    with torch.no_grad():
        return ((model(X) - y) ** 2).sum().item()  # a sum, not the mean


def evaluate_tensor(model, X, y):
    model.eval()
    with torch.no_grad():
        return models.MyLoss()(model(X), y)  # no .item()


def evaluate_grad_off(model, X, y):
    """Gradients switched off for good, not for the block."""
    model.eval()
    torch.set_grad_enabled(False)
    return models.MyLoss()(model(X), y).item()


def evaluate_frozen(model, X, y):
    """No activation kept, but the parameters frozen for the training after."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return models.MyLoss()(model(X), y).item()


def evaluate_training_false(model, X, y):
    """`training = False` on the outer module only: BatchNorm still trains."""
    model.training = False
    with torch.no_grad():
        return models.MyLoss()(model(X), y).item()


# 08: the learning rate of a large batch (lr 0.2 at batch 32, warm-up 20 steps)


def _warmup(peak, step, start=1 / 20):
    return peak * (start + (1 - start) * min(step, 20) / 20)


def lr_at(step, batch_size):
    return _warmup(0.2 * batch_size / 32, step)


def lr_at_not_scaled(step, batch_size):
    return _warmup(0.2, step)


def lr_at_sqrt(step, batch_size):
    return _warmup(0.2 * (batch_size / 32) ** 0.5, step)


def lr_at_no_warmup(step, batch_size):
    return 0.2 * batch_size / 32


def lr_at_from_zero(step, batch_size):
    return _warmup(0.2 * batch_size / 32, step, start=0)


def lr_at_one_step_early(step, batch_size):
    """The usual hand-written ramp (step + 1) / W: at the peak by step W − 1."""
    return 0.2 * batch_size / 32 * min(1, (step + 1) / 20)


def lr_at_from_base(step, batch_size):
    """Goyal et al.'s ramp, from the small batch's rate to the peak."""
    peak = 0.2 * batch_size / 32
    return 0.2 + (peak - 0.2) * min(step, 20) / 20


def lr_at_floor(step, batch_size):
    """Right for multiples of 32 only."""
    return _warmup(0.2 * (batch_size // 32), step)


def lr_at_never_stops(step, batch_size):
    """The ramp without min(step, 20): past the peak after step 20."""
    return 0.2 * batch_size / 32 * (1 / 20 + (1 - 1 / 20) * step / 20)


def lr_at_batch_512(step, batch_size):
    """The lesson's run written in: batch 512's peak whatever the batch."""
    return _warmup(3.2, step)


# 08: SyncBatchNorm's statistics by hand (these run on the ranks)


def _sums(*tensors):
    for x in tensors:
        dist.all_reduce(x)
    return tensors


def global_mean_var(x):
    count, total = _sums(torch.tensor(float(len(x))), x.sum(0))
    mean = total / count
    (squares,) = _sums(((x - mean) ** 2).sum(0))
    return mean, squares / count


def global_mean_var_local(x):
    return x.mean(0), x.var(0, unbiased=False)


def global_mean_var_mean_of_means(x):
    mean, var = x.mean(0), x.var(0, unbiased=False)
    _sums(mean, var)
    return mean / dist.get_world_size(), var / dist.get_world_size()


def global_mean_var_not_divided(x):
    (total,) = _sums(x.sum(0))
    return total, x.var(0, unbiased=False)


def global_mean_var_local_count(x):
    (total,) = _sums(x.sum(0))
    return total / len(x), x.var(0, unbiased=False)


def global_mean_var_of_vars(x):
    """The right mean, then the ranks' variances averaged."""
    mean, _ = global_mean_var(x)
    (var,) = _sums(x.var(0, unbiased=False))
    return mean, var / dist.get_world_size()


def global_mean_var_unbiased(x):
    count, total = _sums(torch.tensor(float(len(x))), x.sum(0))
    (squares,) = _sums(((x - total / count) ** 2).sum(0))
    return total / count, squares / (count - 1)


def global_mean_var_equal_batches(x):
    """All samples counted as world size × this rank's batch."""
    (total,) = _sums(x.sum(0))
    mean = total / (dist.get_world_size() * len(x))
    (squares,) = _sums(((x - mean) ** 2).sum(0))
    return mean, squares / (dist.get_world_size() * len(x))


def global_mean_var_reduce(x):
    """dist.reduce: the sums reach rank 0 only."""
    count, total = torch.tensor(float(len(x))), x.sum(0)
    for t in (count, total):
        dist.reduce(t, dst=0)
    mean = total / count
    squares = ((x - mean) ** 2).sum(0)
    dist.reduce(squares, dst=0)
    return mean, squares / count


def global_mean_var_count_written_in(x):
    """The check's 3 + 9 samples written in."""
    (total,) = _sums(x.sum(0))
    mean = total / 12
    (squares,) = _sums(((x - mean) ** 2).sum(0))
    return mean, squares / 12


def global_mean_var_squares(x):
    """E[x²] without − mean²."""
    count, total, squares = _sums(torch.tensor(float(len(x))), x.sum(0), (x * x).sum(0))
    return total / count, squares / count


# 09: what torchrun hands each process


def torchrun_env(nnodes, nproc_per_node, node_rank):
    return [{"RANK": node_rank * nproc_per_node + i, "LOCAL_RANK": i,
             "WORLD_SIZE": nnodes * nproc_per_node} for i in range(nproc_per_node)]


def torchrun_env_as_strings(nnodes, nproc_per_node, node_rank):
    """As in os.environ: strings."""
    return [{k: str(v) for k, v in env.items()}
            for env in torchrun_env(nnodes, nproc_per_node, node_rank)]


def torchrun_env_rank_is_local(nnodes, nproc_per_node, node_rank):
    return [dict(env, RANK=env["LOCAL_RANK"])
            for env in torchrun_env(nnodes, nproc_per_node, node_rank)]


def torchrun_env_world_is_node(nnodes, nproc_per_node, node_rank):
    return [dict(env, WORLD_SIZE=nproc_per_node)
            for env in torchrun_env(nnodes, nproc_per_node, node_rank)]


def torchrun_env_rank_sum(nnodes, nproc_per_node, node_rank):
    return [dict(env, RANK=node_rank + env["LOCAL_RANK"])
            for env in torchrun_env(nnodes, nproc_per_node, node_rank)]


def torchrun_env_interleaved(nnodes, nproc_per_node, node_rank):
    return [dict(env, RANK=env["LOCAL_RANK"] * nnodes + node_rank)
            for env in torchrun_env(nnodes, nproc_per_node, node_rank)]


def torchrun_env_rank_by_nnodes(nnodes, nproc_per_node, node_rank):
    """nnodes where nproc_per_node belongs: right whenever the two are equal."""
    return [dict(env, RANK=node_rank * nnodes + env["LOCAL_RANK"])
            for env in torchrun_env(nnodes, nproc_per_node, node_rank)]


def torchrun_env_world_is_nnodes(nnodes, nproc_per_node, node_rank):
    """The number of nodes for WORLD_SIZE: right for 2 nodes of 1 process."""
    return [dict(env, WORLD_SIZE=nnodes)
            for env in torchrun_env(nnodes, nproc_per_node, node_rank)]


def torchrun_env_every_node(nnodes, nproc_per_node, node_rank):
    """Every process of every node, not this node's."""
    return [env for node in range(nnodes)
            for env in torchrun_env(nnodes, nproc_per_node, node)]


# 09: values of a parameter one rank holds under fully_shard


def values_held(shape, rank, world_size):
    rows, per_row = shape[0], math.prod(shape[1:])
    piece = -(-rows // world_size)  # torch.chunk: rows / world_size, rounded up
    return min(piece, max(0, rows - rank * piece)) * per_row


def values_held_whole(shape, rank, world_size):
    return math.prod(shape)


def values_held_even(shape, rank, world_size):
    return math.prod(shape) // world_size


def values_held_padded(shape, rank, world_size):
    return -(-shape[0] // world_size) * math.prod(shape[1:])


def values_held_array_split(shape, rank, world_size):
    rows = shape[0]
    return (rows // world_size + (rank < rows % world_size)) * math.prod(shape[1:])


def values_held_negative(shape, rank, world_size):
    """torch.chunk's piece, without max(0, ...) for the ranks past the last one."""
    rows, per_row = shape[0], math.prod(shape[1:])
    piece = -(-rows // world_size)
    return min(piece, rows - rank * piece) * per_row


def values_held_rest_on_last(shape, rank, world_size):
    rows, per_row = shape[0], math.prod(shape[1:])
    if rank < world_size - 1:
        return rows // world_size * per_row
    return (rows - (world_size - 1) * (rows // world_size)) * per_row


# 10: the parameters that get no gradient


def unused_parameters(model, X):
    model.zero_grad(set_to_none=True)
    model(X).sum().backward()
    return sorted(name for name, p in model.named_parameters() if p.grad is None)


def unused_parameters_stale(model, X):
    """Gradients left from earlier training hide the unused ones."""
    model(X).sum().backward()
    return sorted(name for name, p in model.named_parameters() if p.grad is None)


def unused_parameters_used(model, X):
    """The used ones instead."""
    model.zero_grad(set_to_none=True)
    model(X).sum().backward()
    return sorted(name for name, p in model.named_parameters() if p.grad is not None)


def unused_parameters_zero_grads(model, X):
    """A gradient of zeros taken for no gradient."""
    model.zero_grad(set_to_none=True)
    model(X).sum().backward()
    return sorted(name for name, p in model.named_parameters()
                  if p.grad is None or not p.grad.any())


def unused_parameters_frozen(model, X):
    """requires_grad instead of a backward pass."""
    return sorted(name for name, p in model.named_parameters() if not p.requires_grad)


# 10: an uneven epoch (these run on the ranks)


def train_epoch(model, optimizer, batches):
    from torch.distributed.algorithms.join import Join

    with Join([model]):
        for X, y in batches:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(X), y).backward()
            optimizer.step()


def train_epoch_plain(model, optimizer, batches):
    for X, y in batches:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(X), y).backward()
        optimizer.step()


def train_epoch_common(model, optimizer, batches):
    """Every rank stops at 4 batches: no hang, but a batch is dropped."""
    for X, y in batches[:4]:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(X), y).backward()
        optimizer.step()


def train_epoch_module(model, optimizer, batches):
    """model.module: no all-reduce, so no hang, and no synchronization either."""
    for X, y in batches:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model.module(X), y).backward()
        optimizer.step()


def train_epoch_divide_by_live_ranks(model, optimizer, batches):
    from torch.distributed.algorithms.join import Join

    with Join([model], divide_by_initial_world_size=False):
        for X, y in batches:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(X), y).backward()
            optimizer.step()


def train_epoch_repeat_last(model, optimizer, batches):
    """Evens the counts out by training again on a rank's last batch."""
    most = torch.tensor(len(batches))
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    for X, y in batches + batches[-1:] * (int(most) - len(batches)):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(X), y).backward()
        optimizer.step()


def train_epoch_join_optimizer(model, optimizer, batches):
    """The optimizer is no Joinable: Join raises before any step."""
    from torch.distributed.algorithms.join import Join

    with Join([model, optimizer]):
        for X, y in batches:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(X), y).backward()
            optimizer.step()


# 10: an exact validation metric (these run on the ranks)


def exact_mean(values, total):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    real = (rank + torch.arange(len(values)) * world_size) < total
    sums = torch.stack([values[real].sum(), real.sum().to(values.dtype)])
    dist.all_reduce(sums)
    return sums[0] / sums[1]


def exact_mean_local(values, total):
    return values.mean()


def exact_mean_of_means(values, total):
    mean = values.mean().reshape(1)
    dist.all_reduce(mean)
    return mean / dist.get_world_size()


def exact_mean_padded(values, total):
    count = torch.tensor(float(len(values)), dtype=values.dtype)  # padding too
    sums = torch.stack([values.sum(), count])
    dist.all_reduce(sums)
    return sums[0] / sums[1]


def exact_mean_drop_last(values, total):
    """Every rank counts total // world_size samples, as drop_last=True keeps."""
    kept = values[:total // dist.get_world_size()]
    sums = torch.stack([kept.sum(), torch.tensor(float(len(kept)), dtype=values.dtype)])
    dist.all_reduce(sums)
    return sums[0] / sums[1]


def exact_mean_last_rank_padding(values, total):
    """Padding taken as the last rank's last sample: right on 2 ranks only."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    padded = len(values) * world_size - total
    real = values[:len(values) - padded] if rank == world_size - 1 else values
    sums = torch.stack([real.sum(), torch.tensor(float(len(real)), dtype=values.dtype)])
    dist.all_reduce(sums)
    return sums[0] / sums[1]


# 11: sharding. Stage 2's gradient reduce-scatter (these run on the ranks: the
# tests import them into the ranks' namespace, where the lesson's %%px cell
# defines the learner's function)


def shard_of_mean_gradient(flat_grad, rank, world_size):
    shard = torch.empty(flat_grad.numel() // world_size, dtype=flat_grad.dtype)
    dist.reduce_scatter_single(shard, flat_grad)
    return shard / world_size


def shard_of_mean_gradient_avg(flat_grad, rank, world_size):
    shard = torch.empty(flat_grad.numel() // world_size, dtype=flat_grad.dtype)
    dist.reduce_scatter_single(shard, flat_grad, op=dist.ReduceOp.AVG)
    return shard


def shard_of_mean_gradient_async(flat_grad, rank, world_size):
    """Asynchronous, then waited for: gloo's reduce-scatter work has no future,
    and its wait() is what copies the result into the shard."""
    shard = torch.empty(flat_grad.numel() // world_size, dtype=flat_grad.dtype)
    work = dist.reduce_scatter_single(shard, flat_grad, async_op=True)
    work.wait()
    return shard / world_size


def shard_of_mean_gradient_async_avg(flat_grad, rank, world_size):
    shard = torch.empty(flat_grad.numel() // world_size, dtype=flat_grad.dtype)
    dist.reduce_scatter_single(shard, flat_grad, op=dist.ReduceOp.AVG,
                               async_op=True).wait()
    return shard


def shard_of_mean_gradient_async_not_waited(flat_grad, rank, world_size):
    """The work dropped: on gloo the shard is never written."""
    shard = torch.empty(flat_grad.numel() // world_size, dtype=flat_grad.dtype)
    dist.reduce_scatter_single(shard, flat_grad, async_op=True)
    return shard / world_size


def _averaged(flat_grad, world_size):
    """DDP's way: every rank gets the whole mean."""
    dist.all_reduce(flat_grad)
    return flat_grad / world_size


def shard_of_mean_gradient_all_reduce(flat_grad, rank, world_size):
    k = flat_grad.numel() // world_size
    return _averaged(flat_grad, world_size)[rank * k:(rank + 1) * k].clone()


def shard_of_mean_gradient_whole(flat_grad, rank, world_size):
    return _averaged(flat_grad, world_size)


def shard_of_mean_gradient_in_place(flat_grad, rank, world_size):
    """Averaged in place, as DDP leaves .grad; nothing returned."""
    dist.all_reduce(flat_grad)
    flat_grad /= world_size


def shard_of_mean_gradient_next_shard(flat_grad, rank, world_size):
    """Counting ranks from 1."""
    k = flat_grad.numel() // world_size
    return _averaged(flat_grad, world_size)[(rank + 1) * k:(rank + 2) * k].clone()


def shard_of_mean_gradient_one_off(flat_grad, rank, world_size):
    k = flat_grad.numel() // world_size
    return _averaged(flat_grad, world_size)[rank * k + 1:(rank + 1) * k + 1].clone()


def shard_of_mean_gradient_sum(flat_grad, rank, world_size):
    shard = torch.empty(flat_grad.numel() // world_size, dtype=flat_grad.dtype)
    dist.reduce_scatter_single(shard, flat_grad)
    return shard


def shard_of_mean_gradient_by_numel(flat_grad, rank, world_size):
    """The mean over the values, not over the ranks."""
    shard = torch.empty(flat_grad.numel() // world_size, dtype=flat_grad.dtype)
    dist.reduce_scatter_single(shard, flat_grad)
    return shard / flat_grad.numel()


def shard_of_mean_gradient_own_slice(flat_grad, rank, world_size):
    """The reduce-scatter's output left unused: this rank's own piece returned."""
    k = flat_grad.numel() // world_size
    dist.reduce_scatter_single(torch.empty(k), flat_grad)
    return flat_grad[rank * k:(rank + 1) * k] / world_size


def shard_of_mean_gradient_view(flat_grad, rank, world_size):
    """The output is this rank's piece of a buffer as large as the gradient."""
    shard = torch.empty_like(flat_grad).chunk(world_size)[rank]
    dist.reduce_scatter_single(shard, flat_grad)
    return shard.div_(world_size)


def shard_of_mean_gradient_list(flat_grad, rank, world_size):
    """dist.reduce_scatter with a list of pieces: right, but not the call asked for."""
    shard = torch.empty(flat_grad.numel() // world_size, dtype=flat_grad.dtype)
    dist.reduce_scatter(shard, list(flat_grad.chunk(world_size)))
    return shard / world_size


def shard_of_mean_gradient_halves(flat_grad, rank, world_size):
    """Two reduce-scatters, each of half of every rank's piece."""
    pieces = flat_grad.view(world_size, -1)
    half = pieces.shape[1] // 2
    parts = []
    for columns in (slice(0, half), slice(half, None)):
        part = torch.empty(pieces[:, columns].shape[1])
        dist.reduce_scatter_single(part, pieces[:, columns].flatten())
        parts.append(part)
    return torch.cat(parts) / world_size


def shard_of_mean_gradient_gathered(flat_grad, rank, world_size):
    """The shard, then every shard gathered back and this rank's taken again."""
    shard = shard_of_mean_gradient(flat_grad, rank, world_size)
    whole = torch.empty_like(flat_grad)
    dist.all_gather_single(whole, shard)
    return whole.chunk(world_size)[rank].clone()


def shard_of_mean_gradient_as_list(flat_grad, rank, world_size):
    return shard_of_mean_gradient(flat_grad, rank, world_size).tolist()


def shard_of_mean_gradient_todo(flat_grad, rank, world_size):
    """The lesson's starting point."""
    return None


# 11: ZeRO-3's two methods. Mixed, on the ranks, into the lesson's Zero3Base
# (`class Zero3(Zero3Frees, Zero3Base): pass`), which gathers and calls them.


class Zero3Frees:
    """The lesson's solution: each layer freed right after its own use."""

    def after_forward(self, flat, output):
        flat.full.untyped_storage().resize_(0)
        output.register_hook(lambda grad: self.gather(flat))

    def after_backward(self, flat):
        flat.full.untyped_storage().resize_(0)


class Zero3FreesAtTheRoot(Zero3Frees):
    """Every layer freed only when the root's forward ends (its unit is last),
    and all gathered again when the backward starts: the whole model is held
    gathered through the forward pass, and again at the backward's start."""

    def after_forward(self, flat, output):
        if flat is self.units[-1]:
            for unit in self.units:
                unit.full.untyped_storage().resize_(0)
                output.register_hook(lambda grad, unit=unit: self.gather(unit))


class Zero3FreesAfterTheLastBackward(Zero3Frees):
    """Forward right; after backward every layer freed at the root's, the last."""

    def after_backward(self, flat):
        if flat is self.units[-1]:
            for unit in self.units:
                unit.full.untyped_storage().resize_(0)


class Zero3FreesOneLayerLate(Zero3Frees):
    """Each layer's forward frees the layer before it; the root's, what is left."""

    def after_forward(self, flat, output):
        at = self.units.index(flat)
        late = self.units[at - 1:] if flat is self.units[-1] else self.units[at - 1:at]
        for unit in late if at else []:
            unit.full.untyped_storage().resize_(0)
            output.register_hook(lambda grad, unit=unit: self.gather(unit))


# 11: the bytes of model state per rank, fp32 Adam


def bytes_per_rank(params, world_size, stage):
    p, g, o = 4 * params, 4 * params, 8 * params  # fp32: Adam's exp_avg, exp_avg_sq
    n = world_size
    return {"DDP": p + g + o, "ZeRO-1": p + g + o / n, "ZeRO-2": p + (g + o) / n,
            "ZeRO-3": (p + g + o) / n}[stage]


def _bytes_per_rank_with(params, world_size, stage, p=4, g=4, o=8, share=None):
    share = share or (lambda x: x / world_size)
    return {"DDP": (p + g + o) * params,
            "ZeRO-1": (p + g) * params + o * share(params),
            "ZeRO-2": p * params + (g + o) * share(params),
            "ZeRO-3": (p + g + o) * share(params)}[stage]


def bytes_per_rank_mixed(params, world_size, stage):
    """The ZeRO paper's 2 + 2 + 12."""
    return _bytes_per_rank_with(params, world_size, stage, p=2, g=2, o=12)


def bytes_per_rank_adam_one(params, world_size, stage):
    return _bytes_per_rank_with(params, world_size, stage, o=4)


def bytes_per_rank_master(params, world_size, stage):
    """A master copy counted in fp32 training: 4 + 4 + 12."""
    return _bytes_per_rank_with(params, world_size, stage, o=12)


def bytes_per_rank_gb(params, world_size, stage):
    return bytes_per_rank(params, world_size, stage) / 1e9


def bytes_per_rank_values(params, world_size, stage):
    return _bytes_per_rank_with(params, world_size, stage, p=1, g=1, o=2)


def bytes_per_rank_integer(params, world_size, stage):
    return _bytes_per_rank_with(params, world_size, stage,
                                share=lambda x: x // world_size)


def bytes_per_rank_integer_bytes(params, world_size, stage):
    """The bytes divided with //: 8 * 1001 // 3 = 2669, not 2669.33."""
    n = world_size
    p, g, o = 4 * params, 4 * params, 8 * params
    return {"DDP": p + g + o, "ZeRO-1": p + g + o // n, "ZeRO-2": p + (g + o) // n,
            "ZeRO-3": (p + g + o) // n}[stage]


def bytes_per_rank_padded(params, world_size, stage):
    return _bytes_per_rank_with(params, world_size, stage,
                                share=lambda x: math.ceil(x / world_size))


def bytes_per_rank_stage1_grads(params, world_size, stage):
    return bytes_per_rank(params, world_size, "ZeRO-2" if stage == "ZeRO-1" else stage)


def bytes_per_rank_stage2_params(params, world_size, stage):
    return bytes_per_rank(params, world_size, "ZeRO-3" if stage == "ZeRO-2" else stage)


def bytes_per_rank_stage3_params(params, world_size, stage):
    return bytes_per_rank(params, world_size, "ZeRO-2" if stage == "ZeRO-3" else stage)


def bytes_per_rank_ddp_only(params, world_size, stage):
    """Right for DDP; every stage answered as DDP."""
    return 16 * params


def bytes_per_rank_todo(params, world_size, stage):
    return None


# 11: the bytes one rank sends per step, ring collectives


def bytes_sent_per_rank(params, world_size, stage):
    S = 4 * params  # the fp32 gradient, or the fp32 parameters
    half = (world_size - 1) / world_size * S  # a ring reduce-scatter or all-gather
    return {"DDP": 2 * half, "ZeRO-1": 2 * half, "ZeRO-2": 2 * half,
            "ZeRO-3": 3 * half}[stage]


def _sent_with(params, world_size, stage, calls=None, share=None, value_bytes=4):
    """Halves per stage (an all-reduce is 2), each `share` of the buffer."""
    calls = calls or {"DDP": 2, "ZeRO-1": 2, "ZeRO-2": 2, "ZeRO-3": 3}
    share = (world_size - 1) / world_size if share is None else share
    return calls[stage] * share * value_bytes * params


def bytes_sent_per_rank_whole(params, world_size, stage):
    """Each collective sends its whole buffer from every rank."""
    return _sent_with(params, world_size, stage, share=1)


def bytes_sent_per_rank_buffers(params, world_size, stage):
    """CollectiveLog's bytes: each collective's buffer, S."""
    return _sent_with(params, world_size, stage, share=1,
                      calls={"DDP": 1, "ZeRO-1": 2, "ZeRO-2": 2, "ZeRO-3": 3})


def bytes_sent_per_rank_received_too(params, world_size, stage):
    return 2 * bytes_sent_per_rank(params, world_size, stage)


def bytes_sent_per_rank_all_reduce_once(params, world_size, stage):
    """DDP's all-reduce counted as one pass over the buffer."""
    return _sent_with(params, world_size, stage,
                      calls={"DDP": 1, "ZeRO-1": 2, "ZeRO-2": 2, "ZeRO-3": 3})


def bytes_sent_per_rank_no_regather(params, world_size, stage):
    return _sent_with(params, world_size, stage,
                      calls={"DDP": 2, "ZeRO-1": 2, "ZeRO-2": 2, "ZeRO-3": 2})


def bytes_sent_per_rank_stage3_all_reduce(params, world_size, stage):
    """Stage 3's gradients all-reduced, then two all-gathers."""
    return _sent_with(params, world_size, stage,
                      calls={"DDP": 2, "ZeRO-1": 2, "ZeRO-2": 2, "ZeRO-3": 4})


def bytes_sent_per_rank_all_reduce_kept(params, world_size, stage):
    """Stages 1 and 2 as DDP's all-reduce plus the parameters' all-gather."""
    return _sent_with(params, world_size, stage,
                      calls={"DDP": 2, "ZeRO-1": 3, "ZeRO-2": 3, "ZeRO-3": 3})


def bytes_sent_per_rank_no_gather(params, world_size, stage):
    """Stages 1 and 2 with the reduce-scatter only."""
    return _sent_with(params, world_size, stage,
                      calls={"DDP": 2, "ZeRO-1": 1, "ZeRO-2": 1, "ZeRO-3": 3})


def bytes_sent_per_rank_sharded(params, world_size, stage):
    """Sharding taken to divide the traffic too."""
    sent = bytes_sent_per_rank(params, world_size, stage)
    return sent if stage == "DDP" else sent / world_size


def bytes_sent_per_rank_fp16(params, world_size, stage):
    return _sent_with(params, world_size, stage, value_bytes=2)


def bytes_sent_per_rank_bits(params, world_size, stage):
    return 8 * bytes_sent_per_rank(params, world_size, stage)


def bytes_sent_per_rank_integer_share(params, world_size, stage):
    """(N − 1) // N: 0 in integer division."""
    return _sent_with(params, world_size, stage,
                      share=(world_size - 1) // world_size)


def bytes_sent_per_rank_integer_bytes(params, world_size, stage):
    """The bytes divided with //: 2 × 2 × 4004 // 3 = 5338, not 5338.67."""
    calls = {"DDP": 2, "ZeRO-1": 2, "ZeRO-2": 2, "ZeRO-3": 3}[stage]
    return calls * (world_size - 1) * 4 * params // world_size


def bytes_sent_per_rank_constant(params, world_size, stage):
    return 1.0


# 12: fp16's crossover bandwidth (runs in the kernel)


def fp16_crossover(t_ddp, t_fp16, S_ddp, S_fp16, calls, alpha_s):
    if t_fp16 <= t_ddp:
        return math.inf
    return (S_ddp - S_fp16) / (t_fp16 - t_ddp)


def _crossover_with(rule):
    """`rule(t_ddp, t_fp16, S_ddp, S_fp16, calls, alpha_s)` where fp16 is slower
    on loopback, math.inf where it pays at every bandwidth."""
    def answer(t_ddp, t_fp16, S_ddp, S_fp16, calls, alpha_s):
        if t_fp16 <= t_ddp:
            return math.inf
        return rule(t_ddp, t_fp16, S_ddp, S_fp16, calls, alpha_s)
    return answer


# Right for fp16 alone, which sends exactly half: S_ddp − S_fp16 = S_fp16 = S_ddp/2.
fp16_crossover_fp16_bytes = _crossover_with(lambda td, tf, Sd, Sf, c, a: Sf / (tf - td))
fp16_crossover_half = _crossover_with(lambda td, tf, Sd, Sf, c, a: Sd / (2 * (tf - td)))
fp16_crossover_ddp_bytes = _crossover_with(lambda td, tf, Sd, Sf, c, a: Sd / (tf - td))
fp16_crossover_upside_down = _crossover_with(
    lambda td, tf, Sd, Sf, c, a: (tf - td) / (Sd - Sf))
fp16_crossover_sign = _crossover_with(
    lambda td, tf, Sd, Sf, c, a: (Sd - Sf) / (td - tf))
fp16_crossover_bits = _crossover_with(lambda *case: 8 * fp16_crossover(*case))
fp16_crossover_megabytes = _crossover_with(lambda *case: fp16_crossover(*case) / 1e6)
fp16_crossover_alpha_kept = _crossover_with(
    lambda td, tf, Sd, Sf, c, a: (Sd - Sf) / (tf - td + c * a))
fp16_crossover_alpha_other_side = _crossover_with(
    lambda td, tf, Sd, Sf, c, a: (Sd - Sf) / (tf - td - c * a))
fp16_crossover_guess = _crossover_with(lambda *case: 1e9)


def fp16_crossover_no_branch(t_ddp, t_fp16, S_ddp, S_fp16, calls, alpha_s):
    """No math.inf where fp16 already pays: a negative bandwidth there."""
    return (S_ddp - S_fp16) / (t_fp16 - t_ddp) if t_fp16 != t_ddp else math.nan


def fp16_crossover_todo(t_ddp, t_fp16, S_ddp, S_fp16, calls, alpha_s):
    return None


# 12: DiLoCo's outer step (these run on the ranks)


def diloco_outer_step(model, global_params, momentum, outer_lr=0.7, mu=0.9):
    world_size = dist.get_world_size()
    with torch.no_grad():
        for g, p, m in zip(global_params, model.parameters(), momentum, strict=True):
            delta = g - p
            dist.all_reduce(delta)
            delta /= world_size
            m.mul_(mu).add_(delta)
            g.sub_(outer_lr * (delta + mu * m))
            p.copy_(g)


def diloco_outer_step_momentum_before_update(model, global_params, momentum,
                                             outer_lr=0.7, mu=0.9):
    """Nesterov's step with the momentum before this round's update."""
    world_size = dist.get_world_size()
    with torch.no_grad():
        for g, p, m in zip(global_params, model.parameters(), momentum, strict=True):
            delta = g - p
            dist.all_reduce(delta)
            delta /= world_size
            g.sub_(outer_lr * (delta + mu * m))
            m.mul_(mu).add_(delta)
            p.copy_(g)


def diloco_outer_step_heavy_ball(model, global_params, momentum, outer_lr=0.7,
                                 mu=0.9):
    """Plain momentum: torch.optim.SGD(momentum=0.9) without nesterov=True."""
    world_size = dist.get_world_size()
    with torch.no_grad():
        for g, p, m in zip(global_params, model.parameters(), momentum, strict=True):
            delta = g - p
            dist.all_reduce(delta)
            delta /= world_size
            m.mul_(mu).add_(delta)
            g.sub_(outer_lr * m)
            p.copy_(g)


def diloco_outer_step_momentum_unused(model, global_params, momentum, outer_lr=0.7,
                                      mu=0.9):
    """The momentum kept up to date, but the step is plain SGD on Δ."""
    world_size = dist.get_world_size()
    with torch.no_grad():
        for g, p, m in zip(global_params, model.parameters(), momentum, strict=True):
            delta = g - p
            dist.all_reduce(delta)
            delta /= world_size
            m.mul_(mu).add_(delta)
            g.sub_(outer_lr * delta)
            p.copy_(g)


def diloco_outer_step_no_momentum(model, global_params, momentum, outer_lr=0.7,
                                  mu=0.9):
    """FedAvg with a learning rate: no momentum at all, `momentum` left at zero."""
    world_size = dist.get_world_size()
    with torch.no_grad():
        for g, p in zip(global_params, model.parameters(), strict=True):
            delta = g - p
            dist.all_reduce(delta)
            delta /= world_size
            g.sub_(outer_lr * delta)
            p.copy_(g)


def diloco_outer_step_torch_sgd(model, global_params, momentum, outer_lr=0.7,
                                mu=0.9):
    """torch's own Nesterov SGD, its buffer seeded with the momentum given."""
    world_size = dist.get_world_size()
    with torch.no_grad():
        params = [torch.nn.Parameter(g.clone()) for g in global_params]
        for q, g, p in zip(params, global_params, model.parameters(), strict=True):
            q.grad = g - p
            dist.all_reduce(q.grad)
            q.grad /= world_size
        sgd = torch.optim.SGD(params, lr=outer_lr, momentum=mu, nesterov=True)
        for q, m in zip(params, momentum, strict=True):
            sgd.state[q]["momentum_buffer"] = m  # updated in place by step()
        sgd.step()
        for q, g, p in zip(params, global_params, model.parameters(), strict=True):
            g.copy_(q)
            p.copy_(q)


# 12: the noise scale from two batch sizes (runs in the kernel)


def noise_scale_estimate(b, world_size, g2_small, g2_big):
    b_small, b_big = b, world_size * b
    norm_sq = (b_big * g2_big - b_small * g2_small) / (b_big - b_small)
    trace = (g2_small - g2_big) / (1 / b_small - 1 / b_big)
    return trace / norm_sq


def noise_scale_estimate_swapped(b, world_size, g2_small, g2_big):
    """The sizes of the two norms exchanged."""
    b_small, b_big = world_size * b, b
    norm_sq = (b_big * g2_big - b_small * g2_small) / (b_big - b_small)
    return (g2_small - g2_big) / (1 / b_small - 1 / b_big) / norm_sq


def noise_scale_estimate_big_alone(b, world_size, g2_small, g2_big):
    """|G|² taken as the big batch's squared norm: biased upwards."""
    trace = (g2_small - g2_big) / (1 / b - 1 / (world_size * b))
    return trace / g2_big


def noise_scale_estimate_no_inverse(b, world_size, g2_small, g2_big):
    """tr(Σ) as the norms' difference, without the 1/B terms."""
    b_small, b_big = b, world_size * b
    norm_sq = (b_big * g2_big - b_small * g2_small) / (b_big - b_small)
    return (g2_small - g2_big) / norm_sq


def noise_scale_estimate_inverted(b, world_size, g2_small, g2_big):
    return 1 / noise_scale_estimate(b, world_size, g2_small, g2_big)


def noise_scale_estimate_per_rank(b, world_size, g2_small, g2_big):
    """b for the big batch too, not world_size × b: a division by zero."""
    return noise_scale_estimate(b, 1, g2_small, g2_big)


def noise_scale_estimate_per_rank_torch(b, world_size, g2_small, g2_big):
    """The same in torch: inf or nan, and no error."""
    small, big = torch.tensor(g2_small), torch.tensor(g2_big)
    return ((small - big) / (1 / b - 1 / b) / ((b * big - b * small) / (b - b))).item()


def noise_scale_estimate_two_ranks(b, world_size, g2_small, g2_big):
    return noise_scale_estimate(b, 2, g2_small, g2_big)


def noise_scale_estimate_b_plus_n(b, world_size, g2_small, g2_big):
    """The big batch taken as b + world_size samples."""
    b_small, b_big = b, b + world_size
    norm_sq = (b_big * g2_big - b_small * g2_small) / (b_big - b_small)
    return (g2_small - g2_big) / (1 / b_small - 1 / b_big) / norm_sq


def noise_scale_estimate_trace_only(b, world_size, g2_small, g2_big):
    """tr(Σ) returned, not divided by |G|²."""
    return (g2_small - g2_big) / (1 / b - 1 / (world_size * b))


def noise_scale_estimate_off(b, world_size, g2_small, g2_big):
    return 1.1 * noise_scale_estimate(b, world_size, g2_small, g2_big)


def noise_scale_estimate_todo(b, world_size, g2_small, g2_big):
    return None
