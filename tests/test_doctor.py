import json

import torch

from labkit import doctor
from labkit.__main__ import main


def test_report_describes_this_machine():
    report = doctor.collect()
    assert report.torch_version == torch.__version__
    assert report.cpu_cores >= 1
    assert set(report.backends) == {"gloo", "nccl", "mpi"}
    assert report.japanese_font == "IPAexGothic"
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
