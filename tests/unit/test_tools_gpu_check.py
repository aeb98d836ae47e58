"""The device call, rehearsed: its time budget adds up, the carried wheels'
dependencies are checked, and `tools/gpu_check.sh --rehearse` runs the call
under the device's conditions on this CPU (slow)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest

from tests.harness.cli import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import gpu_check_budget  # noqa: E402
import gpu_check_wheels  # noqa: E402

SCRIPT = ROOT / "tools" / "gpu_check.sh"


def test_the_call_budget_adds_up_to_eight_minutes_and_names_every_part():
    import gpu_check

    budget = gpu_check_budget.BUDGET_S
    assert sum(budget.values()) <= gpu_check_budget.CALL_BUDGET_S == 480
    checks = [fn.__name__ for fn in gpu_check.CHECKS]
    assert set(budget) == {*checks, "startup", *gpu_check_budget.SHELL_PARTS}
    assert gpu_check_budget.checks_budget_s() == sum(budget[c] for c in checks) + budget["startup"]
    script = SCRIPT.read_text()
    for part in ("install", "checks", "pytest_gpu"):  # the shell's limits come from the table
        assert f'$(budget {part} "$@")' in script, part  # "$@": --dry-run's slack
    assert gpu_check.DRILL_TIMEOUT_S < budget["nccl_hang_drill"]  # chaos ends before the check


def test_a_check_past_its_deadline_fails_and_the_next_still_runs():
    import time
    import types

    import gpu_check

    def slow(check):
        time.sleep(30)

    def quick(check):
        return {"ok": True}

    check = types.SimpleNamespace(deadline_s=lambda part: 1)
    assert gpu_check.run_check(slow, check)["error"].startswith("PastDeadline: past its 1 s")
    assert gpu_check.run_check(quick, check)["status"] == "ok"
    assert gpu_check_budget.deadline_s("mcore_1b", dry_run=True) == 3 * gpu_check_budget.BUDGET_S[
        "mcore_1b"]


def fake_wheel(folder, name: str, version: str, requires: list[str], tag="py3-none-any"):
    path = folder / f"{name.replace('-', '_')}-{version}-{tag}.whl"
    meta = "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                      *[f"Requires-Dist: {r}" for r in requires]]) + "\n"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


def test_the_wheel_check_finds_what_the_device_would_lack(tmp_path):
    fake_wheel(tmp_path, "carried", "1.0", [
        "pytest",  # present (this environment stands for the device's set)
        "helper>=2",  # carried below
        "absent-thing",  # neither carried nor present
        'only-on-312; python_version >= "3.12"',  # pip here (3.11) would not even ask
        'only-before-3; python_version < "3"'])
    fake_wheel(tmp_path, "helper", "2.1", [])
    fake_wheel(tmp_path, "cp311only", "1.0", [], tag="cp311-cp311-manylinux_2_28_x86_64")
    problems = gpu_check_wheels.problems_of(gpu_check_wheels.folder(tmp_path),
                                            gpu_check_wheels.installed())
    assert sorted(problems) == [
        "carried 1.0 needs absent-thing: neither carried nor on the device",
        "carried 1.0 needs only-on-312; python_version >= \"3.12\": neither carried nor on the "
        "device",
        "cp311only-1.0-cp311-cp311-manylinux_2_28_x86_64.whl: no tag installs on CPython 3.12 "
        "manylinux x86_64"]


def test_the_wheel_check_compares_the_two_folders_by_name(tmp_path):
    device, host = tmp_path / "device", tmp_path / "host"
    device.mkdir(), host.mkdir()
    fake_wheel(device, "both", "2.0", [])
    fake_wheel(host, "both", "1.0", [])
    fake_wheel(device, "device-only", "1.0", [])
    missing, versions = gpu_check_wheels.differences(gpu_check_wheels.folder(device),
                                                     gpu_check_wheels.folder(host))
    assert missing == ["device-only: in the device's folder only"]
    assert versions == ["both: 2.0 for the device, 1.0 rehearsed"]


@pytest.mark.slow
def test_the_rehearsal_runs_the_device_call_offline_into_an_existing_out(tmp_path):
    """A fresh environment with only the device's package set, the carried
    wheels installed offline, $OUT an existing empty directory, and the
    table and verdict in the last 12,000 characters. The device's package
    set is built once (network, pip's cache) and kept in ~/.cache."""
    import gpu_check

    out = tmp_path / "out"
    out.mkdir()
    run = subprocess.run(["bash", str(SCRIPT), "--rehearse"], cwd=tmp_path,
                         env={**os.environ, "OUT": str(out)}, capture_output=True, text=True,
                         timeout=900)
    tail = (run.stdout + run.stderr)[-3000:]
    assert run.returncode == 0, tail
    summary = json.loads((out / "gpu_check.json").read_text())
    for check in gpu_check.CHECKS:  # every check has a status, and a skip its reason
        result = summary[check.__name__]
        assert result["status"] in ("ok", "skipped"), (check.__name__, result)
        assert result["status"] == "ok" or result["skipped"]
    assert summary["mcore_1b"]["status"] == "ok"  # megatron-core came from the carried wheels
    assert {"gpu_check.stderr.log", "gpu_pytest.log", "pip_install.log"} <= {
        p.name for p in out.iterdir()}
    came_back = (ROOT / ".cache" / "gpu_rehearse" / "call_tail.log").read_text()
    assert len(came_back) <= 12000
    assert "\ncheck  " in came_back and "gpu_check: passed" in came_back
    assert "all install on the device" in run.stdout
