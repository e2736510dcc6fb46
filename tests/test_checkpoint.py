"""Checkpoints: atomic writes, safe loading, bit-identical resume, determinism."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from labkit import checkpoint, training
from labkit.__main__ import main

CFG = dict(steps=24, checkpoint_every=5)


def test_resumed_run_ends_bit_identical(tmp_path):
    whole = training.fit(training.TrainConfig(**CFG))
    path = tmp_path / "state.pt"
    first = training.fit(training.TrainConfig(**CFG | {"steps": 10}), path)
    assert first["param_sha256"] != whole["param_sha256"]
    resumed = training.fit(training.TrainConfig(**CFG), path, resume=True)
    assert resumed["resumed_from"] == 10
    assert resumed["losses"] == whole["losses"]
    assert resumed["param_sha256"] == whole["param_sha256"]


def test_same_seed_same_curve_other_seed_other_curve():
    a = training.fit(training.TrainConfig(steps=15))
    b = training.fit(training.TrainConfig(steps=15))
    c = training.fit(training.TrainConfig(steps=15, seed=1))
    assert a["losses"] == b["losses"] and a["param_sha256"] == b["param_sha256"]
    assert a["losses"] != c["losses"]


def test_resume_refuses_other_settings(tmp_path):
    path = tmp_path / "state.pt"
    training.fit(training.TrainConfig(steps=5), path)
    with pytest.raises(ValueError, match="other settings"):
        training.fit(training.TrainConfig(steps=10, lr=0.1), path, resume=True)


KILLED_WHILE_SAVING = """
import os, signal, sys, torch
from labkit import checkpoint
path = sys.argv[1]
checkpoint.save({"version": 1, "w": torch.ones(3)}, path)

def dying_save(obj, f):  # writes part of the file, then the process is killed
    f.write(b"PK\\x03\\x04 half a checkpoint")
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)

torch.save = dying_save
checkpoint.save({"version": 2, "w": torch.zeros(3)}, path)
"""


@pytest.mark.procs
def test_a_process_killed_while_saving_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "state.pt"
    proc = subprocess.run([sys.executable, "-c", KILLED_WHILE_SAVING, str(path)])
    assert proc.returncode == -signal.SIGKILL
    leftovers = list(tmp_path.glob(".state.pt.*.tmp"))
    assert len(leftovers) == 1  # the half-written temporary file, not the checkpoint
    state = checkpoint.load(path)
    assert state["version"] == 1 and torch.equal(state["w"], torch.ones(3))
    checkpoint.save({"version": 3}, path)  # the next save clears the leftover
    assert list(tmp_path.glob(".state.pt.*.tmp")) == []
    assert checkpoint.load(path)["version"] == 3


@pytest.mark.procs
def test_killing_a_real_training_run_never_breaks_its_checkpoint(tmp_path):
    path = tmp_path / "state.pt"
    cmd = [sys.executable, "-m", "labkit", "train", "--steps", "100000",
           "--hidden", "512", "--depth", "3", "--checkpoint", str(path),
           "--checkpoint-every", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Until it has saved a few times over, so that the kill comes during
        # the saves of a run in its stride.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (
                path.exists() and checkpoint.load(path)["step"] >= 5):
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    state = checkpoint.load(path)
    assert state["step"] >= 1
    cfg = training.TrainConfig(**state["config"] | {"steps": state["step"] + 2})
    resumed = training.fit(cfg, path, resume=True)
    assert resumed["resumed_from"] == state["step"]


class Sneaky:
    def __reduce__(self):
        return (os.system, ("echo this must never run",))


def test_loading_refuses_pickled_objects(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"payload": Sneaky()}, path)
    with pytest.raises(checkpoint.CheckpointError, match="cannot read checkpoint"):
        checkpoint.load(path)


def test_truncated_or_missing_checkpoints_are_named(tmp_path):
    path = tmp_path / "state.pt"
    checkpoint.save({"w": torch.ones(1000)}, path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(checkpoint.CheckpointError, match="cannot read"):
        checkpoint.load(path)
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint at"):
        checkpoint.load(tmp_path / "missing.pt")


def test_cli_train_resume_and_errors(tmp_path, capsys):
    path = tmp_path / "state.pt"
    out = tmp_path / "r.json"
    assert main(["train", "--steps", "6", "--checkpoint", str(path)]) == 0
    assert main(["train", "--steps", "12", "--checkpoint", str(path), "--resume",
                 "--json", str(out)]) == 0
    assert '"param_sha256"' in out.read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--checkpoint", str(tmp_path / "none.pt"), "--resume"])
    assert exit_.value.code == 1
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--resume"])
    assert exit_.value.code == 2
    with pytest.raises(SystemExit):
        main(["train", "--steps", "0"])
    assert "steps must be >= 1" in capsys.readouterr().err


def test_a_resumed_run_with_a_schedule_ends_bit_identical(tmp_path, monkeypatch):
    """The scheduler's state is in the checkpoint: without it, the resumed run
    would start its warm-up again and end elsewhere."""
    cfg = training.TrainConfig(steps=24, checkpoint_every=5, schedule="warmup_cosine",
                               warmup_steps=4, optimizer="adam", lr=0.01)
    whole = training.fit(cfg)
    path, save = tmp_path / "state.pt", checkpoint.save

    def save_then_stop(state, where):  # the run stops right after its step-10 save
        save(state, where)
        if state["step"] == 10:
            raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        training.fit(cfg, path)
    monkeypatch.undo()
    resumed = training.fit(cfg, path, resume=True)
    assert resumed["resumed_from"] == 10
    assert resumed["lr"] == whole["lr"]
    assert resumed["param_sha256"] == whole["param_sha256"]


def test_a_schedule_is_not_resumed_for_another_number_of_steps(tmp_path):
    cfg = training.TrainConfig(steps=10, schedule="cosine")
    training.fit(cfg, tmp_path / "state.pt")
    with pytest.raises(ValueError, match="schedule .cosine. was built for 10 steps"):
        training.fit(training.TrainConfig(steps=20, schedule="cosine"),
                     tmp_path / "state.pt", resume=True)
