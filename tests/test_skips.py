"""Skips that say why, and become failures where CI requires what they need.

The browser tests and the network-isolated site build need things a machine may
lack (chromium, root, unshare, ip). Skipped, each says what is missing and how to
get it; where CI provides them (.ci/run sets LABKIT_REQUIRE_BROWSER and
LABKIT_REQUIRE_NETNS), the same test fails instead of passing unseen.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import netns_missing, unavailable

ROOT = Path(__file__).resolve().parent.parent


def test_a_skip_becomes_a_failure_where_its_variable_requires_it(monkeypatch):
    monkeypatch.delenv("LABKIT_REQUIRE_X", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs x .apt-get install x."):
        unavailable("needs x (apt-get install x)", "LABKIT_REQUIRE_X")
    monkeypatch.setenv("LABKIT_REQUIRE_X", "0")
    with pytest.raises(pytest.skip.Exception):
        unavailable("needs x (apt-get install x)", "LABKIT_REQUIRE_X")
    monkeypatch.setenv("LABKIT_REQUIRE_X", "1")
    with pytest.raises(pytest.fail.Exception,
                       match=r"install x. .LABKIT_REQUIRE_X=1 requires it"):
        unavailable("needs x (apt-get install x)", "LABKIT_REQUIRE_X")


def test_netns_missing_names_each_missing_tool_and_its_package(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: f"/usr/bin/{tool}")
    assert netns_missing() == []
    monkeypatch.setattr(shutil, "which",
                        lambda tool: None if tool == "ip" else f"/usr/bin/{tool}")
    assert netns_missing() == ["ip (apt-get install iproute2)"]
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    missing = netns_missing()
    assert len(missing) == 3 and missing[0].startswith("root (")
    assert missing[1:] == ["unshare (apt-get install util-linux)",
                           "ip (apt-get install iproute2)"]


def _outcome(test: str, env: dict) -> tuple[str, str]:
    """Run one test file's `test` in a pytest of its own: (outcome, output)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rsf", "-p", "no:randomly", test],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    tail = done.stdout.strip().splitlines()[-1]
    outcome = ("failed" if "failed" in tail or "error" in tail
               else "skipped" if "skipped" in tail else tail)
    return outcome, done.stdout


# Each test as CI runs it, on a PATH without the tool it needs (ip; chromium):
# the variable turns the skip into a failure that says what to install.
# (test, the tools left on PATH, the variable, the advice shown.)
SWITCHES = {
    "netns": ("tests/test_site.py::test_the_site_builds_without_a_network",
              ("unshare",), "LABKIT_REQUIRE_NETNS", "ip (apt-get install iproute2)"),
    "browser": ("tests/test_browser.py", (), "LABKIT_REQUIRE_BROWSER",
                "apt-get install chromium"),
}


@pytest.mark.procs
@pytest.mark.parametrize("name", SWITCHES)
def test_ci_s_variables_turn_a_missing_tool_into_a_failure(tmp_path, name):
    test, present, variable, advice = SWITCHES[name]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in present:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LABKIT_REQUIRE")}
    env |= {"PATH": str(bin_dir), "LABKIT_SITE": str(tmp_path)}
    # Skipped without the variable, with the same reason: the first test above.
    outcome, output = _outcome(test, env | {variable: "1"})
    assert outcome == "failed" and advice in output, output[-3000:]
    assert f"{variable}=1 requires it" in output
