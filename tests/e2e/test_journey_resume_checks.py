"""Issue 27 items 1 and 2 through the installed command: a resume refuses a
checkpoint whose manifest was changed after the save (walking back to the
previous one, ending bit-equal), and refuses another recipe before workers
start."""
from __future__ import annotations

import json
import shutil

import pytest

from tests.harness.cli import ROOT
from tests.harness.journey import home, megaresil, with_demo_corpus  # noqa: F401  (home: a fixture)

RECIPE = str(ROOT / "recipes" / "gpt-tiny.yaml")
RUN = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "checkpoint.interval=2",
       "logging.progress=false", "run.dir=run"]


@pytest.mark.slow
@pytest.mark.journey
def test_a_changed_manifest_is_walked_back_from_and_another_recipe_refused(home, demo_corpus):
    with_demo_corpus(home / ".cache" / "megaresil", demo_corpus)  # as an earlier run left it
    megaresil("train", RECIPE, *RUN, "train.steps=4", cwd=home)
    checkpoints = home / "run" / "checkpoints"
    shutil.copytree(checkpoints / "step_0000004", home / "reference")
    manifest = checkpoints / "step_0000004" / "metadata.json"
    manifest.write_text(manifest.read_text().replace('"consumed_samples": ',
                                                     '"consumed_samples": 1'))
    assert "INVALID" in megaresil("ckpt", "verify", str(manifest.parent), cwd=home,
                                  check=False).stdout

    refused = megaresil("train", RECIPE, *RUN, "train.steps=4", "train.seed=7", cwd=home,
                        check=False)
    assert refused.returncode == 2 and "train.seed: the checkpoint has 1234" in refused.stderr

    megaresil("train", RECIPE, *RUN, "train.steps=4", cwd=home)
    events = [json.loads(line) for line in (home / "run" / "events.jsonl").read_text().splitlines()]
    skipped = [e for e in events if e["event"] == "checkpoint_skipped"]
    assert skipped and skipped[-1]["path"].endswith("step_0000004")
    assert "digest" in skipped[-1]["reason"]
    diff = megaresil("ckpt", "diff", str(home / "reference"), str(checkpoints / "step_0000004"),
                     cwd=home)
    assert "0 not identical" in diff.stdout
