"""`megaresil plan` and `megaresil report` on records that parse as JSON
but hold another kind where a number or a name belongs, and `plan` given
numbers no plan can use: one line naming the file, record and field (or the
option), exit 2, instead of a traceback or a plan built on nonsense."""
from __future__ import annotations

import json
import math

import pytest

from megaresil.plan.model import Policy, young_interval
from tests.harness.journey import home, megaresil  # noqa: F401  (home: a fixture)
from tests.unit.test_plan import write_run_with_a_replacement

WINDOW = {"time": 1001.0, "window": [1, 4], "steps": 4, "sections": {},
          "ratios": {"0": {"forward": 1.0}, "1": {"forward": 1.1}},
          "scores": {"0": 1.0, "1": 0.9}, "mem_peak_mb": {"0": 100.0, "1": 101.0}}


def malformed_run(tmp_path, name: str, index: int, change) -> tuple:
    """A run's records (tests/unit/test_plan.py's run with a replacement,
    and a straggler window) with record `index` of file `name` changed:
    fields updated from a dict, a field removed (a str), or replaced whole."""
    run = tmp_path / "run"
    write_run_with_a_replacement(run, downtime_s=3.0)
    (run / "stragglers.jsonl").write_text(json.dumps(WINDOW) + "\n")
    records = [json.loads(line) for line in (run / name).read_text().splitlines()]
    if isinstance(change, dict):
        records[index].update(change)
    elif isinstance(change, str):
        del records[index][change]
    else:
        records[index] = change
    (run / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    return run, f"{run / name} line {index + 1}: "


MALFORMED = [  # file, record, change, what the line says of it
    ("metrics.jsonl", 2, {"step": "3"}, "has step='3', not a whole number >= 1"),
    ("metrics.jsonl", 2, {"step": 0}, "has step=0, not a whole number >= 1"),
    ("metrics.jsonl", 0, {"time": None}, "has time=None, not a finite number"),
    ("metrics.jsonl", 4, {"tokens_per_s": 0}, "has tokens_per_s=0, not a finite number > 0"),
    ("metrics.jsonl", 1, {"loss": "low"}, "has loss='low', not a number"),
    ("metrics.jsonl", 1, "tokens", ("has no 'tokens' (a finite number >= 0)",  # plan's
                                    "has none of 'step_time_s', 'tokens'")),  # the report's
    ("metrics.jsonl", 0, [1, 2], "is not a JSON object"),
    ("events.jsonl", 0, {"launched_at": "early"}, "has launched_at='early', not a finite number"),
    ("events.jsonl", 1, {"kind": "reboot"}, "has kind='reboot', not one of in_process, replace, "
                                            "relaunch"),
    ("events.jsonl", 2, {"event": ["x"]}, "has event=['x'], not a string"),
    ("events.jsonl", 3, "bytes", "has no 'bytes' (a finite number >= 0)"),
    ("events.jsonl", 3, {"seconds": "fast"}, "has seconds='fast', not a finite number >= 0"),
    ("events.jsonl", 3, {"bytes_per_rank": 8}, "has bytes_per_rank=8, not a list"),
    ("events.jsonl", 2, {"window": [3]}, "has window=[3], not [first step, last step]"),
]


@pytest.mark.parametrize("name, index, change, says", MALFORMED)
def test_plan_and_report_name_a_malformed_record(cli_main, tmp_path, name, index, change, says):
    run, where = malformed_run(tmp_path, name, index, change)
    plan_says, report_says = (says, says) if isinstance(says, str) else says
    for command, said in ((["plan", str(run), "--gpus", "8"], plan_says),
                          (["report", str(run)], report_says)):
        result = cli_main(*command, check=False)
        assert result.returncode == 2, (command, result.stderr[-3000:])
        assert_names_the_line(result.stderr, where, said)


def assert_names_the_line(stderr: str, where: str, said: str) -> None:
    """One line: the file and line, the line's start, what is wrong, the fix."""
    assert stderr.startswith(f"megaresil: error: {where}'"), stderr
    assert stderr.endswith(f"' {said}. Fix: repair or delete that line (megaresil only appends "
                           "to this file; a deleted line loses only that record).\n"), stderr
    assert stderr.count("\n") == 1, stderr


def test_report_names_a_malformed_straggler_window(cli_main, tmp_path):
    run, where = malformed_run(tmp_path, "stragglers.jsonl", 0, {"ratios": {"zero": {}}})
    result = cli_main("report", str(run), check=False)
    assert result.returncode == 2
    assert_names_the_line(result.stderr, where, "has ratios={'zero': {}}, not a map of rank "
                          "to a map of names to numbers")


def test_plan_names_malformed_costs_and_trace_lines(cli_main, tmp_path):
    run, _ = malformed_run(tmp_path, "metrics.jsonl", 0, {})
    costs = json.loads(cli_main("plan", str(run), "--gpus", "8", "--json").stdout)
    costs["costs"]["outages"][0]["kind"] = "reboot"
    (tmp_path / "plan.json").write_text(json.dumps(costs))
    result = cli_main("plan", str(tmp_path / "plan.json"), "--gpus", "8", check=False)
    assert (result.returncode, result.stderr) == (2, (
        f"megaresil: error: {tmp_path / 'plan.json'} is not what `megaresil plan --json` "
        "writes: its costs outages[0] has kind='reboot', not one of in_process, replace, "
        "relaunch, requeue. Fix: give a run directory, or such a file\n"))
    trace = tmp_path / "trace.jsonl"
    for lines, says in [('{"hours": 2, "path": "relaunch"}\n{"hours": "soon", "path": "x"}\n',
                         f"{trace}: record 2 has hours='soon', not a finite number >= 0. Fix:"),
                        ('{"hours": 0, "path": "relaunch"}\n',
                         f"failure trace {trace} spans no time"),
                        ('{"hours": 1, "path": "relaunch"}\n{"hours": 2,\n',
                         f"{trace}: line 2 is not JSON (")]:
        trace.write_text(lines)
        result = cli_main("plan", str(run), "--gpus", "8", "--failure-trace", str(trace),
                          check=False)
        assert result.returncode == 2 and result.stderr.startswith(f"megaresil: error: {says}")


@pytest.mark.parametrize("option, value, bounds", [
    ("--gpus", "-8", "> 0"), ("--gpus", "0", "> 0"), ("--step-s", "-1", "> 0"),
    ("--mtbf-hours", "nan", "> 0"), ("--mtbf-hours", "0", "> 0"), ("--mtbf-hours", "inf", "> 0"),
    ("--replacement-s", "-5", ">= 0"), ("--state-bytes", "-1", "> 0"), ("--days", "0", "> 0"),
    ("--storage-gbps", "0", "> 0"), ("--gpus-per-node", "0", "> 0")])
def test_plan_refuses_a_number_no_plan_can_use(cli_main, tmp_path, option, value, bounds):
    """They were taken: --gpus -8 and --mtbf-hours nan planned checkpoint.interval=1,
    --gpus 0 and --mtbf-hours inf died of a ZeroDivisionError."""
    run, _ = malformed_run(tmp_path, "metrics.jsonl", 0, {})
    args = ["--gpus", "8", option, value] if option != "--gpus" else [option, value]
    result = cli_main("plan", str(run), *args, "--simulate", check=False)
    assert result.returncode == 2
    assert result.stderr.startswith(f"megaresil: error: {option}: must be a finite number "
                                    f"{bounds}, got "), result.stderr
    assert result.stderr.endswith(f"Fix: give {option} a value {bounds}.\n")


def test_a_simulation_shorter_than_a_step_is_refused(cli_main, tmp_path):
    run, _ = malformed_run(tmp_path, "metrics.jsonl", 0, {})
    result = cli_main("plan", str(run), "--gpus", "8", "--simulate", "--days", "1e-9",
                      check=False)
    assert (result.returncode, result.stderr) == (2, "megaresil: error: --days 1e-09 holds no "
                                                     "step of 0.5 s: simulate at least one step\n")


def test_a_long_mtbf_plans_long_intervals_not_one_step():
    """The search's range is 4 MTBF wide: 100 golden sections of it could
    not find an optimum of a few steps in 1e60 s, and planned one step."""
    policy = Policy("sync", blocking_s=0.2, total_s=0.2, restart_s=10)
    for mtbf in (1e5, 1e12, 1e60):
        tau = policy.best_interval(mtbf, step_s=0.5)
        young = young_interval(0.2, mtbf)
        assert policy.goodput(tau, mtbf) >= policy.goodput(young, mtbf) - 1e-12
        assert tau >= min(young, 1e15) / 2 and math.isfinite(tau)


@pytest.mark.journey
def test_plan_and_report_through_the_installed_command(home):
    malformed_run(home, "metrics.jsonl", 2, {"step": "3"})
    report = megaresil("report", "run", cwd=home, check=False)
    plan = megaresil("plan", "run", "--gpus", "-8", cwd=home, check=False)
    assert (report.returncode, plan.returncode) == (2, 2)
    assert_names_the_line(report.stderr, "run/metrics.jsonl line 3: ",
                          "has step='3', not a whole number >= 1")
    assert plan.stderr == ("megaresil: error: --gpus: must be a finite number > 0, got -8. "
                           "Fix: give --gpus a value > 0.\n")
