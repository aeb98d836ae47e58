"""Issue 26's first-contact defects of the chaos, plan, ckpt, --from-hf,
straggler and Slurm paths: each test failed on the code before the fix."""
from __future__ import annotations

import pytest

from megaresil.cli import CHAOS_SCENARIOS, build_parser


def test_chaos_help_lists_every_scenario(monkeypatch):
    from megaresil.resilience.chaos import scenarios

    monkeypatch.setenv("COLUMNS", "2000")  # no wrapping inside hyphenated names
    assert set(CHAOS_SCENARIOS) == set(scenarios(rank=1, step=3, save_step=2))
    chaos = build_parser()._subparsers._group_actions[0].choices["chaos"]
    help_text = chaos.format_help()
    for name in CHAOS_SCENARIOS:
        assert name in help_text


def test_chaos_takes_overrides_after_the_scenario(cli_main, monkeypatch):
    import megaresil.resilience.chaos as chaos

    seen = {}

    def fake_run_scenario(recipe, overrides, name, **kwargs):
        seen.update(recipe=recipe, overrides=overrides, name=name)
        return {"recovered": True, "final_loss_equal": True}

    monkeypatch.setattr(chaos, "run_scenario", fake_run_scenario)
    monkeypatch.setattr(chaos, "format_result", lambda result: "ok")
    cli_main("chaos", "recipes/gpt-tiny.yaml", "train.steps=6", "--scenario", "kill-rank",
             "parallel.dp=2", "--timeout", "60", "data.seq_len=32")
    assert seen == {"recipe": "recipes/gpt-tiny.yaml", "name": "kill-rank",
                    "overrides": ["train.steps=6", "parallel.dp=2", "data.seq_len=32"]}


def test_chaos_refuses_an_unknown_scenario(cli_main):
    with pytest.raises(SystemExit) as exc:
        cli_main("chaos", "recipes/gpt-tiny.yaml", "--scenario", "no-such")
    assert exc.value.code == 2
