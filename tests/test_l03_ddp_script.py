"""Lesson 03's own DDP script: its grader passes the reference under torchrun and
names each plausible mistake, and leaves no process behind."""

import pytest
from conftest import child_processes, leftovers

import labkit
from labkit import exercises

pytestmark = [pytest.mark.procs, pytest.mark.timeout(900)]

# The solution of lesson 03's exercise (course/03_ddp.py, the cell after it).
SCRIPT = '''\
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from labkit import data, models

on_gpu = torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else "cpu"
dist.init_process_group("nccl" if on_gpu else "gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()

torch.manual_seed(0)
model = DDP(models.MLP().to(device))
criterion = models.MyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
dataset = data.TeacherDataset(n=256, seed=0)
sampler = DistributedSampler(dataset, seed=0)
loader = DataLoader(dataset, batch_size=64 // world_size, sampler=sampler)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for X, y in loader:
        X, y = X.to(device), y.to(device)
        optimizer.zero_grad()
        loss = criterion(model(X), y)
        loss.backward()
        optimizer.step()
    if rank == 0:
        print(f"epoch {epoch}: loss {loss.item():.4f}")
torch.save(model.module.state_dict(), f"ddp_train_rank{rank}.pt")
dist.destroy_process_group()
'''

# The exercise cell as given: lesson 01's loop on one process.
ONE_PROCESS = '''\
import torch
from torch.utils.data import DataLoader

from labkit import data, models

rank, world_size = 0, 1
torch.manual_seed(0)
model = models.MLP()
criterion = models.MyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
dataset = data.TeacherDataset(n=256, seed=0)
loader = DataLoader(dataset, batch_size=64, shuffle=True)
for epoch in range(2):
    for X, y in loader:
        optimizer.zero_grad()
        loss = criterion(model(X), y)
        loss.backward()
        optimizer.step()
    print(f"epoch {epoch}: loss {loss.item():.4f}")
torch.save(model.state_dict(), f"ddp_train_rank{rank}.pt")
'''


def variant(old: str, new: str) -> str:
    assert old in SCRIPT
    return SCRIPT.replace(old, new)


WRONG = {
    "ex_script_no_init": ONE_PROCESS,
    "ex_script_no_ddp": variant("DDP(models.MLP().to(device))",
                                "models.MLP().to(device)").replace(
        "model.module.state_dict()", "model.state_dict()"),
    "ex_script_set_epoch": variant("    sampler.set_epoch(epoch)\n", ""),
    "ex_script_batch": variant("batch_size=64 // world_size", "batch_size=64"),
    "ex_script_logs": variant("    if rank == 0:\n        print", "    print"),
    "ex_script_no_destroy": variant("dist.destroy_process_group()\n", ""),
    "ex_script_hint": variant("torch.manual_seed(0)\n",  # rank 0 starts elsewhere
                              "torch.manual_seed(rank + 1)\n"),
    "ex_script_failed": variant("loss.backward()", "loss.backward(retain_graf=True)"),
}


def grade(tmp_path, text):
    path = tmp_path / "ddp_train.py"
    path.write_text(text)
    exercises.grade_ddp_script(path)


def test_the_reference_script_passes_and_leaves_nothing_behind(tmp_path, capsys):
    before = {p.pid for p in child_processes()}
    grade(tmp_path, SCRIPT)
    assert "replicas are equal" in capsys.readouterr().out
    assert leftovers(before) == set()
    assert not list(tmp_path.glob("*.pt"))  # it ran in a folder of its own


@pytest.mark.parametrize("key", WRONG)
def test_each_mistake_is_named(tmp_path, key):
    before = {p.pid for p in child_processes()}
    with pytest.raises(exercises.WrongAnswer, check=lambda e: e.key == key):
        grade(tmp_path, WRONG[key])
    assert leftovers(before) == set()


def test_a_crash_shows_the_ranks_error_in_the_lesson_language(tmp_path):
    labkit.set_lang("ja")
    try:
        failed = "(?s)失敗しました.*retain_graf"
        with pytest.raises(exercises.WrongAnswer, match=failed):
            grade(tmp_path, WRONG["ex_script_failed"])
    finally:
        labkit.set_lang("en")


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(exercises.WrongAnswer, match="ddp_train.py"):
        exercises.grade_ddp_script(tmp_path / "ddp_train.py")
