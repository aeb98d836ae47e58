"""Journey of issue 50: a user brings a checkpoint that Megatron-Core saved
(the session's `mcore_checkpoints`, a llama at tp=2) and, through the
installed `megaresil` command from a fresh directory, inspects it, imports
it at another layout, and starts a run from it directly."""
import shutil

import pytest

from megaresil.events import read_events
from tests.harness.journey import home, megaresil  # noqa: F401
from tests.harness.mcore import FLAVOURS, TINY

pytestmark = [pytest.mark.journey, pytest.mark.slow]


def test_inspect_import_and_train_from_a_megatron_save(mcore_checkpoints, home):  # noqa: F811
    shutil.copytree(mcore_checkpoints["llama-tp2-pp1"], home / "megatron")
    shown = megaresil("ckpt", "inspect", "megatron", cwd=home).stdout
    assert "iteration   7" in shown and "tp=2 pp=1" in shown
    assert "megaresil convert --from-megatron megatron DST" in shown

    converted = megaresil("convert", "--from-megatron", "megatron", "imported", "--tp", "1",
                          "--pp", "2", "--dp", "1", cwd=home)
    assert "weights only: no optimizer state in the checkpoint" in converted.stderr
    imported = megaresil("ckpt", "inspect", "imported", cwd=home).stdout
    assert "step        7" in imported and "tp=1 pp=2 dp=1" in imported

    run = megaresil("train", "gpt-tiny", *TINY, *FLAVOURS["llama"], "parallel.tp=1",
                    "parallel.pp=1", "parallel.dp=1", "train.steps=1",
                    "train.micro_batch_size=2", "train.global_batch_size=2",
                    "train.eval_batches=0", "logging.tensorboard=false", "run.dir=runs/from-mcore",
                    "checkpoint.init_from=megatron", cwd=home)
    started = [e for e in read_events(home / "runs" / "from-mcore")
               if e["event"] == "initialized_from"]
    assert [e["source"] for e in started] == ["megatron"], run.stdout
