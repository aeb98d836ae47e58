"""Health checks before a node joins: NVML's readings (a fake NVML here:
no GPU on this machine), the recipe's command, and the exclusion a failure
leaves in the run directory."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time

import psutil
import pytest

from megaresil.config import ConfigError, HealthConfig
from megaresil.events import EventLog, read_events
from megaresil.launch.health import (Exclusions, Failure, admission_refusal, command_problem,
                                     nvml_problems)
from megaresil.safe_files import LinkRefused, refuse_links
from tests.harness.journey import home, megaresil  # noqa: F401  (home: a fixture)
from tests.unit.test_safe_files import SMALL


class FakeNvml:
    """pynvml as far as the check reads it: devices given as dicts."""
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, NVML_TEMPERATURE_GPU = 1, 0, 0

    class NVMLError_NotSupported(Exception):
        pass

    def __init__(self, *devices: dict):
        self.devices = devices

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        return self.devices[index]

    def _read(self, device, key):
        if device.get(key) == "unsupported":
            raise self.NVMLError_NotSupported()
        return device.get(key, 0)

    def nvmlDeviceGetTotalEccErrors(self, device, kind, counter):
        assert (kind, counter) == (1, 0)  # uncorrected, since the driver loaded
        return self._read(device, "ecc")

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device):
        return self._read(device, "pending")

    def nvmlDeviceGetRemappedRows(self, device):
        return (0, 0, 0, self._read(device, "remap_failed"))

    def nvmlDeviceGetTemperature(self, device, sensor):
        return device.get("temperature", 40)


def test_healthy_devices_pass_and_unsupported_readings_are_no_failure():
    consumer = {"ecc": "unsupported", "pending": "unsupported", "remap_failed": "unsupported"}
    assert nvml_problems(FakeNvml({}, consumer), gpus_needed=2, max_temperature_c=85) == []


def test_each_nvml_problem_names_its_device():
    nvml = FakeNvml({}, {"ecc": 3, "temperature": 91}, {"pending": 1}, {"remap_failed": 1})
    assert nvml_problems(nvml, gpus_needed=8, max_temperature_c=85) == [
        "4 GPU(s) visible to NVML, 8 needed",
        "GPU 1: 3 uncorrectable ECC error(s) since the driver loaded",
        "GPU 1: 91 C, at or over resilience.health.max_temperature_c=85",
        "GPU 2: memory pages wait to be retired (a reset is due)",
        "GPU 3: a memory row could not be remapped"]


def test_the_commands_last_line_is_the_reason():
    assert command_problem("true", 10) is None
    assert command_problem("echo checking; echo '/scratch is full' >&2; exit 3", 10) == (
        "`echo checking; echo '/scratch is full' >&2; exit 3` exited with 3: /scratch is full")
    assert "did not finish within resilience.health.timeout_s=0.2" in command_problem(
        f"{sys.executable} -c 'import time; time.sleep(5)'", 0.2)


def test_a_node_that_fails_is_excluded_and_refused_until_its_file_is_deleted(tmp_path):
    events = EventLog(tmp_path)
    failing = HealthConfig(command="echo 'ib0 down'; exit 1")
    refusal = admission_refusal(failing, tmp_path, 0, 0, events, host="node7")
    assert refusal == (f"node node7 failed its health check (command: `echo 'ib0 down'; exit 1` "
                       f"exited with 1: ib0 down) and is excluded from this run: it will not "
                       f"rejoin until {tmp_path}/excluded_nodes/node7.json is deleted")
    [event] = read_events(tmp_path)
    assert event["event"] == "node_excluded" and event["host"] == "node7"
    # Healthy again (or its check changed): still refused, until a person says so.
    again = admission_refusal(HealthConfig(), tmp_path, 0, 0, events, host="node7")
    assert again.startswith("node node7 was excluded from this run at ")
    assert "(command check: `echo 'ib0 down'; exit 1` exited with 1: ib0 down)" in again
    assert admission_refusal(HealthConfig(), tmp_path, 0, 0, events, host="node8") is None
    Exclusions(tmp_path).path("node7").unlink()
    assert admission_refusal(HealthConfig(), tmp_path, 0, 0, events, host="node7") is None
    assert json.loads((tmp_path / "events.jsonl").read_text().splitlines()[0])["check"] == (
        "command")


def test_without_gpus_nvml_is_not_asked(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # importing it would fail
    assert admission_refusal(HealthConfig(gpu=True), tmp_path, 0, 0, EventLog(tmp_path),
                             host="cpu0") is None
    with pytest.raises(ImportError):
        admission_refusal(HealthConfig(gpu=True), tmp_path, 1, 1, EventLog(tmp_path),
                          host="gpu0")


# --- the command's processes and output ---------------------------------------------------------

def gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether `pid` has ended (a zombie no reaper collected counts), polled
    briefly: a SIGKILL is delivered, not executed, by the kill() call."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def started(tmp_path):
    """Pid files a command writes for the processes it starts; whatever of
    them is left is killed at the end, whatever the test found."""
    files = [tmp_path / f"pid{i}" for i in range(2)]
    yield files
    for file in files:
        if file.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(file.read_text()), signal.SIGKILL)


def test_a_command_out_of_time_leaves_none_of_its_processes_running(started):
    """Only the shell was killed: its children ran on (one per interval on a spare)."""
    a, b = started
    command = f"sleep 300 & echo $! > {a}; sleep 300 & echo $! > {b}; wait"
    assert "did not finish within resilience.health.timeout_s=1" in command_problem(command, 1)
    assert gone(int(a.read_text())) and gone(int(b.read_text()))


def test_a_command_that_ends_leaves_nothing_it_started_behind(started):
    a, _ = started
    assert command_problem(f"sleep 300 >/dev/null 2>&1 & echo $! > {a}; exit 0", 30) is None
    assert gone(int(a.read_text()))


def test_output_that_is_not_utf8_is_a_reason_not_a_crash():
    assert command_problem(r"printf 'latin-1 \351t\351\n'; exit 0", 30) is None
    failing = r"printf 'GPU \377 lost\n' >&2; exit 2"
    assert command_problem(failing, 30) == f"`{failing}` exited with 2: GPU \ufffd lost"


# --- the exclusion record ---------------------------------------------------------------------

@pytest.mark.parametrize("content", [b"garbage", b"{}", b"[]", b"null",
                                     b'{"check": 1, "reason": ["x"], "time": "noon"}',
                                     b'{"check": "command", "reason": "ib0", "time": 1e400}',
                                     b'{"check": "command", "reason": "ib0", "time": 1' + b"0" * 400
                                     + b"}",
                                     b'{"check": "command", "reason": "ib0", "time": 1e300}',
                                     b'{"check": "command", "reason": "ib0", "time": true}',
                                     b'\xff\xfe'])
def test_a_record_that_cannot_be_read_still_excludes_its_node_and_says_so(tmp_path, content):
    """The file is what excludes (docs/clusters.md): its content only says why."""
    path = Exclusions(tmp_path).path("node7")
    path.parent.mkdir()
    path.write_bytes(content)
    refusal = admission_refusal(HealthConfig(), tmp_path, 0, 0, EventLog(tmp_path), host="node7")
    assert refusal.startswith("node node7 was excluded from this run ")
    assert refusal.endswith(f"; after repairing it, delete {path} to admit it again")
    assert "cannot be read" in refusal or "at an unreadable time (command check: ib0)" in refusal
    assert "\n" not in refusal


def test_a_directory_in_place_of_the_record_excludes_its_node(tmp_path):
    path = Exclusions(tmp_path).path("node7")
    path.mkdir(parents=True)
    refusal = admission_refusal(HealthConfig(), tmp_path, 0, 0, EventLog(tmp_path), host="node7")
    assert refusal == (f"node node7 was excluded from this run (its record cannot be read: Is a "
                       f"directory); after repairing it, delete {path} to admit it again")


def test_an_excluded_nodes_file_is_a_run_dir_error(tmp_path):
    (tmp_path / "excluded_nodes").write_text("")
    with pytest.raises(ConfigError, match=r"^run.dir: .*excluded_nodes is not a directory"):
        admission_refusal(HealthConfig(), tmp_path, 0, 0, EventLog(tmp_path), host="node7")


def test_the_record_is_not_written_through_a_planted_directory_link(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "excluded_nodes").symlink_to(elsewhere)
    with pytest.raises(LinkRefused, match="excluded_nodes is a link"):
        Exclusions(tmp_path / "run").record("node7", Failure("command", "ib0 down"))
    assert list(elsewhere.iterdir()) == []
    with pytest.raises(ConfigError, match=f"{tmp_path / 'run' / 'excluded_nodes'} -> {elsewhere}"):
        refuse_links(tmp_path / "run", tmp_path / "run" / "checkpoints")


# --- through the installed command --------------------------------------------------------------

def launch_lines(result) -> list[str]:
    """The launcher's lines, none of them a traceback's."""
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr.strip().splitlines()


@pytest.mark.journey
def test_train_refuses_a_node_whose_record_cannot_be_read_before_any_worker(home):
    """A garbage record broke every later start with a traceback."""
    host = socket.gethostname()
    (home / "run" / "excluded_nodes").mkdir(parents=True)
    (home / "run" / "excluded_nodes" / f"{host}.json").write_text("{garbage")
    result = megaresil("train", "gpt-tiny", *SMALL, "run.dir=run", cwd=home, check=False)
    assert result.returncode == 1
    assert launch_lines(result)[-1] == (
        f"megaresil: node {host} was excluded from this run (its record cannot be read: not "
        f"JSON); after repairing it, delete run/excluded_nodes/{host}.json to admit it again")
    assert not (home / "run" / "metrics.jsonl").exists()


@pytest.mark.journey
def test_train_refuses_a_planted_excluded_nodes_link(home):
    (home / "elsewhere").mkdir()
    (home / "run").mkdir()
    (home / "run" / "excluded_nodes").symlink_to(home / "elsewhere")
    result = megaresil("train", "gpt-tiny", *SMALL, "run.dir=run", "resilience.health.command=false",
                       cwd=home, check=False)
    assert result.returncode == 2
    assert launch_lines(result)[-1].startswith("megaresil: error: run.dir: a run writes only "
                                               "files of its own, but these are links: "
                                               f"run/excluded_nodes -> {home / 'elsewhere'}.")
    assert list((home / "elsewhere").iterdir()) == []


@pytest.mark.journey
def test_a_health_command_that_prints_no_utf8_gets_its_line(home):
    result = megaresil("train", "gpt-tiny", *SMALL, "run.dir=run",
                       r"resilience.health.command=printf 'ib0 \377 down'; exit 1", cwd=home,
                       check=False)
    assert result.returncode == 1
    assert launch_lines(result)[-1].startswith(
        f"megaresil: node {socket.gethostname()} failed its health check (command: `printf "
        r"'ib0 \377 down'; exit 1` exited with 1: ib0 " "\ufffd down) and is excluded")
