"""Learners' answers to the exercises, right and typically wrong, for test_exercises.py.

A separate module so that the engines can import the answers that run on ranks
by name (pytest would rewrite a test module's asserts).
"""

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from labkit import data_parallel as dp
from labkit import models, nosync

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


# 01: one training step


def train_step(model, optimizer, criterion, X, y):
    optimizer.zero_grad()
    loss = criterion(model(X), y)
    loss.backward()
    optimizer.step()
    return loss.item()


def train_step_as_written(model, optimizer, criterion, X, y):
    loss = criterion(model(X), y)
    loss.backward  # noqa: B018  (the document's line: no call)
    optimizer.step()


def train_step_no_zero_grad(model, optimizer, criterion, X, y):
    criterion(model(X), y).backward()
    optimizer.step()


def train_step_no_step(model, optimizer, criterion, X, y):
    optimizer.zero_grad()
    criterion(model(X), y).backward()


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


# 04: replicas that drift apart


def train(model, optimizer, scheduler, criterion, updates, rank):
    for batches in updates:
        optimizer.zero_grad()
        nosync.accumulate_no_sync(model, criterion, batches)
        optimizer.step()
        scheduler.step()


def train_scheduler_on_rank_0(model, optimizer, scheduler, criterion, updates, rank):
    for batches in updates:
        optimizer.zero_grad()
        nosync.accumulate_no_sync(model, criterion, batches)
        optimizer.step()
        if rank == 0:
            scheduler.step()


def train_no_scheduler(model, optimizer, scheduler, criterion, updates, rank):
    for batches in updates:
        optimizer.zero_grad()
        nosync.accumulate_no_sync(model, criterion, batches)
        optimizer.step()


def train_step_on_rank_0(model, optimizer, scheduler, criterion, updates, rank):
    for batches in updates:
        optimizer.zero_grad()
        nosync.accumulate_no_sync(model, criterion, batches)
        if rank == 0:
            optimizer.step()
        scheduler.step()
