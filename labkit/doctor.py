"""What this machine can run: CPU, torch build, GPUs, backends, font, widgets,
and the system features (signals, /proc) the course uses where it has them."""

from __future__ import annotations

import os
import platform
import shutil
import signal
import sys
import tempfile
import unicodedata
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata

import torch
import torch.distributed as dist

from . import checkpoint, comm, fonts, i18n
from .cluster import cpus, forkserver, stalls
from .i18n import t

__all__ = ["ASCII_MARKS", "MARKS", "Report", "collect", "format_report", "version"]

i18n.register({
    "no_torch_xla": {
        "ja": "torch_xla はインストールされていません。"
              "PyTorch で TPU を使うには torch_xla が必要です",
        "en": "torch_xla is not installed; PyTorch needs it to use a TPU",
    },
    "doctor_title": {"ja": "この環境で動くもの", "en": "What this machine can run"},
    "python": {"ja": "Python", "en": "Python"},
    "cpu_cores": {"ja": "CPU コア数", "en": "CPU cores"},
    "torch_threads": {"ja": "torch のスレッド数", "en": "torch threads"},
    "torch": {"ja": "PyTorch", "en": "PyTorch"},
    "torch_build": {"ja": "PyTorch のビルド", "en": "PyTorch build"},
    "build_cpu": {"ja": "CPU 版", "en": "CPU only"},
    "build_cuda": {"ja": "CUDA {v} 版", "en": "CUDA {v}"},
    "gpus": {"ja": "GPU", "en": "GPUs"},
    "none": {"ja": "なし", "en": "none"},
    "backends": {"ja": "分散バックエンド", "en": "distributed backends"},
    "jp_font": {"ja": "日本語フォント", "en": "Japanese font"},
    "widgets": {"ja": "ipywidgets", "en": "ipywidgets"},
    "not_installed": {"ja": "未インストール", "en": "not installed"},
    "can_run": {"ja": "ここで動くもの", "en": "Runs here"},
    "cannot_run": {"ja": "ここでは動かないもの", "en": "Does not run here"},
    # The notebooks' ranks use gloo on the CPU on every machine (labkit.cluster):
    # GPUs serve lesson 02's DataParallel and the command line.
    "cap_ddp_gloo": {
        "ja": "ノートブックの DDP (gloo、CPU 上のランク。GPU のあるマシンでも同じ)",
        "en": "DDP in the notebooks (gloo, ranks on the CPU, also on a GPU machine)",
    },
    "cap_ddp_nccl": {
        "ja": "nccl の DDP をコマンドラインで (torchrun、1 ランクに GPU 1 台)",
        "en": "DDP on nccl from the command line (torchrun, one GPU per rank)",
    },
    "cap_dp_real": {
        "ja": "実際の GPU での DataParallel (レッスン 02 と python -m labkit dp、"
              "GPU 2 台以上)",
        "en": "DataParallel on real GPUs (lesson 02 and python -m labkit dp, two or "
              "more GPUs)",
    },
    "cap_dp_sim": {
        "ja": "DataParallel の 4 段階を CPU で再現 (labkit)",
        "en": "the four DataParallel steps simulated on the CPU (labkit)",
    },
    "cap_bf16": {
        "ja": "torch.autocast による bfloat16 (CPU)",
        "en": "bfloat16 with torch.autocast (CPU)",
    },
    "cap_fp16": {
        "ja": "float16 と GradScaler による混合精度 (GPU)",
        "en": "float16 mixed precision with GradScaler (GPU)",
    },
    "lacks_title": {
        "ja": "この OS にないもの (コースの代わりの動き)",
        "en": "Missing on this system (what the course does instead)",
    },
    # One per feature the course uses where the system has it; each says what
    # is missing, then what labkit and the lessons do without it.
    "lacks_fork": {
        "ja": "os.fork (Windows にはありません。macOS では torch を読み込んだ"
              "プロセスの fork が安全ではありません): ランクは ipyparallel の"
              "起動方法で新しいプロセスとして起動します。fork より起動に時間が"
              "かかります",
        "en": "os.fork (not on Windows; on macOS, forking a process that imported "
              "torch is unsafe): the ranks start as new processes, through "
              "ipyparallel's launchers, which takes longer than forking",
    },
    "lacks_stack_dumps": {
        "ja": "SIGUSR1 (Windows にはありません): ランクにスタックを書き出させる"
              "ことができません。止まったときの報告はそう書き、"
              "py-spy dump --pid PID を示します",
        "en": "SIGUSR1 (not on Windows): a rank cannot be asked for its stacks; a "
              "stall report says so and names py-spy dump --pid PID instead",
    },
    "lacks_proc_io": {
        "ja": "/proc/self/io (Linux のものです): レッスン 05 と 06 はソケットに送った"
              "バイト数を数えず、そう表示します。集団通信に渡したバイト数は数えて確かめます",
        "en": "/proc/self/io (Linux's): lessons 05 and 06 do not count the bytes "
              "sent on sockets, and say so; they still count and check the bytes "
              "handed to collectives",
    },
    "lacks_sigkill": {
        "ja": "SIGKILL: --fault kill と --die-at のランクは os._exit で終わります "
              "(同じくすぐに、後始末なしで)。labkit がプロセスを終わらせるときは "
              "TerminateProcess を使います",
        "en": "SIGKILL: --fault kill and --die-at end the rank with os._exit (as "
              "abruptly, with no cleanup); labkit ends other processes with "
              "TerminateProcess",
    },
    "lacks_sigstop": {
        "ja": "SIGSTOP: --fault stop は使えず、そう表示します。全スレッドが一時停止した"
              "ランク (デバッガなど) は、止まったランクとして見つけて終わらせます",
        "en": "SIGSTOP: --fault stop is refused with a message; a rank whose threads "
              "are all suspended (a debugger) is still found and ended as stopped",
    },
    "lacks_killpg": {
        "ja": "os.killpg (プロセスグループ): torchrun のノードを止めるとき、"
              "エージェントとワーカーを 1 つずつ終わらせます",
        "en": "os.killpg (process groups): stopping torchrun's nodes ends each agent "
              "and worker one by one",
    },
    "lacks_folder_fsync": {
        "ja": "フォルダの fsync (Windows ではフォルダを開けません): チェックポイントの"
              "置き換えはアトミックなままですが、停電に備えたディスクへの書き出しはしません",
        "en": "fsync of a folder (Windows cannot open one): a checkpoint is still "
              "replaced atomically, but the rename is not forced to disk against a "
              "power cut",
    },
    "lacks_netns": {
        "ja": "unshare -n (Linux のネットワーク名前空間): サイトがネットワークなしで"
              "作れることの確認 (tests/test_site.py) は飛ばされます",
        "en": "unshare -n (Linux's network namespaces): the check that the site "
              "builds without a network (tests/test_site.py) is skipped",
    },
})

# What each feature's absence looks like here; looked up when `collect` runs.
def _no_fork() -> bool:
    """Whether the ranks cannot be forked here (not: LABKIT_FORKSERVER=0 chose so)."""
    try:
        return forkserver.usable() in (forkserver.NO_FORK, forkserver.MACOS)
    except (ValueError, forkserver.ForkServerError):  # a bad LABKIT_FORKSERVER:
        return not hasattr(os, "fork")  # the ranks' start says so itself


LACKS: dict[str, Callable[[], bool]] = {
    "lacks_fork": _no_fork,
    "lacks_stack_dumps": lambda: not stalls.can_dump_stacks(),
    "lacks_proc_io": lambda: not comm.can_count_bytes_written(),
    "lacks_sigkill": lambda: not hasattr(signal, "SIGKILL"),
    "lacks_sigstop": lambda: not hasattr(signal, "SIGSTOP"),
    "lacks_killpg": lambda: not hasattr(os, "killpg"),
    "lacks_folder_fsync": lambda: not checkpoint.can_sync_folder(tempfile.gettempdir()),
    "lacks_netns": lambda: (not sys.platform.startswith("linux")
                            or shutil.which("unshare") is None),
}


@dataclass
class Report:
    """Facts about this machine, in plain values (JSON-ready via asdict)."""

    python: str
    cpu_cores: int
    usable_cpus: int  # affinity and cgroup quota: what the ranks' threads share
    torch_threads: int
    torch_version: str
    cuda_version: str | None
    gpus: list[str]
    backends: dict[str, bool]
    japanese_font: str | None
    ipywidgets: str | None
    can_run: list[str] = field(default_factory=list)
    cannot_run: list[str] = field(default_factory=list)
    lacks: list[str] = field(default_factory=list)  # keys of LACKS

    def as_dict(self) -> dict:
        return asdict(self)


def version(dist_name: str) -> str | None:
    """The installed version of the distribution `dist_name`, or None."""
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def _japanese_font() -> str | None:
    try:
        return fonts.setup_japanese_font()
    except ImportError:
        return None


def collect() -> Report:
    """Look at this machine and say what the course can run on it."""
    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    backends = {
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
        "mpi": dist.is_available() and dist.is_mpi_available(),
    }
    capabilities = {
        "cap_ddp_gloo": backends["gloo"],
        "cap_ddp_nccl": backends["nccl"] and len(gpus) >= 1,
        "cap_dp_real": len(gpus) >= 2,
        "cap_dp_sim": True,
        "cap_bf16": True,
        "cap_fp16": len(gpus) >= 1,
    }
    return Report(
        python=platform.python_version(),
        cpu_cores=os.cpu_count() or 1,
        usable_cpus=cpus.usable_cpus(),
        torch_threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        gpus=gpus,
        backends=backends,
        japanese_font=_japanese_font(),
        ipywidgets=version("ipywidgets"),
        can_run=[k for k, ok in capabilities.items() if ok],
        cannot_run=[k for k, ok in capabilities.items() if not ok],
        lacks=[k for k, missing in LACKS.items() if missing()],
    )


def _width(text: str) -> int:
    """Columns `text` takes in a terminal: wide (Japanese) characters take two."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


MARKS = ("✓", "✗")
# For an output that cannot encode the marks: cp1252 and cp932, where a Windows
# Python writes a redirected `doctor > report.txt` or a pipe.
ASCII_MARKS = ("OK", "NO")


def format_report(report: Report, marks: tuple[str, str] = MARKS) -> str:
    """The report as aligned text in the current language; `marks` for yes and no."""
    yes, no = marks
    build = (t("build_cuda", v=report.cuda_version) if report.cuda_version
             else t("build_cpu"))
    backends = ", ".join(f"{name} {yes if ok else no}"
                         for name, ok in report.backends.items())
    rows = [
        (t("python"), report.python),
        (t("cpu_cores"), str(report.cpu_cores)),
        (t("usable_cpus"), str(report.usable_cpus)),
        (t("torch_threads"), str(report.torch_threads)),
        (t("torch"), report.torch_version),
        (t("torch_build"), build),
        (t("gpus"), ", ".join(report.gpus) or t("none")),
        (t("backends"), backends),
        (t("jp_font"), report.japanese_font or t("not_installed")),
        (t("widgets"), report.ipywidgets or t("not_installed")),
    ]
    width = max(_width(k) for k, _ in rows)
    lines = [f"== {t('doctor_title')} =="]
    lines += [k + " " * (width - _width(k) + 2) + v for k, v in rows]
    lines.append(f"{t('can_run')}:")
    lines += [f"  {yes} {t(k)}" for k in report.can_run]
    lines.append(f"{t('cannot_run')}:")
    lines += [f"  {no} {t(k)}" for k in report.cannot_run] or [f"  ({t('none')})"]
    lines.append(f"{t('lacks_title')}:")
    lines += [f"  - {t(k)}" for k in report.lacks] or [f"  ({t('none')})"]
    return "\n".join(lines)
