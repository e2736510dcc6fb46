import json

import matplotlib
import pytest
import torch
from matplotlib import font_manager
from matplotlib.ft2font import FT2Font

import labkit
from labkit import doctor
from labkit.__main__ import main


def test_report_describes_this_machine():
    report = doctor.collect()
    assert report.torch_version == torch.__version__
    assert report.cpu_cores >= 1
    assert 1 <= report.usable_cpus <= report.cpu_cores
    assert set(report.backends) == {"gloo", "nccl", "mpi"}
    # The font reported is the one plots use, and it draws Japanese (whatever
    # its name: matplotlib-fontja may ship another font one day).
    assert report.japanese_font == matplotlib.rcParams["font.family"][0]
    path = font_manager.findfont(report.japanese_font, fallback_to_default=False)
    assert all(ord(c) in FT2Font(path).get_charmap() for c in "勾配の同期ランク")
    assert set(report.can_run).isdisjoint(report.cannot_run)
    if not torch.cuda.is_available():
        assert report.gpus == []
        assert "cap_ddp_nccl" in report.cannot_run


def test_cli_writes_json_and_speaks_japanese(tmp_path, capsys):
    out = tmp_path / "doctor.json"
    assert main(["--lang", "ja", "doctor", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "分散バックエンド" in text
    saved = json.loads(out.read_text(encoding="utf-8"))
    assert saved["torch_version"] == torch.__version__
    assert saved["backends"]["gloo"] == torch.distributed.is_gloo_available()


@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_gpus_serve_the_command_line_and_dataparallel_never_the_engines(fake_gpus,
                                                                        gpus):
    fake_gpus(gpus)
    report = doctor.collect()
    assert report.gpus == [f"Fake GPU {i}" for i in range(gpus)]
    assert "cap_ddp_gloo" in report.can_run  # the notebooks' ranks: gloo, always
    assert ("cap_ddp_nccl" in report.can_run) == (gpus >= 1)
    assert ("cap_dp_real" in report.can_run) == (gpus >= 2)
    for lang in ("en", "ja"):
        labkit.set_lang(lang)
        lines = doctor.format_report(report).splitlines()
        runs = [line for line in lines if line.startswith("  ✓")]  # what runs here
        nccl = [line for line in runs if "nccl" in line]
        # Only the command line runs nccl; the notebooks' DDP says gloo.
        assert all("torchrun" in line for line in nccl), nccl
        assert len(nccl) == (gpus >= 1)
        gloo = [line for line in runs if "DDP" in line and "gloo" in line]
        assert len(gloo) == 1 and "nccl" not in gloo[0]


def test_this_linux_lacks_none_of_the_posix_features():
    lacks = doctor.collect().lacks
    assert set(lacks) <= {"lacks_netns"}, lacks  # unshare is a package away


def test_each_missing_feature_is_listed_with_what_the_course_does_instead(
        monkeypatch):
    """As on Windows, where every one is missing: taken away here one by one."""
    import os
    import shutil
    import signal

    for name in ("SIGUSR1", "SIGKILL", "SIGSTOP"):
        monkeypatch.delattr(signal, name)
    monkeypatch.delattr(os, "killpg")
    monkeypatch.delattr(os, "fork")
    monkeypatch.delenv("LABKIT_FORKSERVER", raising=False)
    exists, open_, which = os.path.exists, os.open, shutil.which
    monkeypatch.setattr(os.path, "exists",
                        lambda p: str(p) != "/proc/self/io" and exists(p))

    def no_folders(path, *args, **kwargs):
        if os.path.isdir(path):
            raise PermissionError(13, "Permission denied", str(path))
        return open_(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_folders)
    monkeypatch.setattr(shutil, "which", lambda cmd, *a, **k:
                        None if cmd == "unshare" else which(cmd, *a, **k))
    report = doctor.collect()
    assert report.lacks == list(doctor.LACKS)
    for lang, words in (("en", ["os.fork (not on Windows", "SIGUSR1 (not on Windows)",
                                "/proc/self/io",
                                "os._exit", "--fault stop is refused",
                                "os.killpg", "fsync of a folder", "unshare -n"]),
                        ("ja", ["os.fork (Windows にはありません",
                                "SIGUSR1 (Windows にはありません)", "/proc/self/io",
                                "os._exit", "--fault stop は使えず", "os.killpg",
                                "フォルダの fsync", "unshare -n"])):
        labkit.set_lang(lang)
        text = doctor.format_report(report)
        listed = text.split(labkit.t("lacks_title"))[1].splitlines()[1:]
        assert len(listed) == len(doctor.LACKS)
        for line, word in zip(listed, words, strict=True):
            assert line.startswith("  - ") and word in line, (line, word)
    labkit.set_lang("en")
    assert doctor.format_report(doctor.Report(**{**report.as_dict(), "lacks": []})
                                ).endswith(f"{labkit.t('lacks_title')}:\n  (none)")


@pytest.mark.parametrize(("platform", "variable", "listed"), [
    ("linux", "", False), ("linux", "0", False),  # forked, or new processes by choice
    ("darwin", "", True), ("darwin", "1", False),  # macOS: forks only when asked
])
def test_fork_is_listed_where_the_ranks_cannot_be_forked(monkeypatch, platform,
                                                         variable, listed):
    monkeypatch.setattr("sys.platform", platform)
    monkeypatch.setenv("LABKIT_FORKSERVER", variable)
    assert ("lacks_fork" in doctor.collect().lacks) == listed
