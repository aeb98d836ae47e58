"""Journeys of issue 47 (items 2, 7, 8, 9): a user's own JSON Lines corpus and
tokenizer through the installed command. `data prepare` says how far it is
and records its tokenizer; `train` takes that tokenizer unasked, refuses
another before any worker starts, says when it launches the workers, and on
a terminal of 0 columns still prints its lines; `generate` finds the
tokenizer or takes --tokenizer; `convert` writes no bars into a log; a resume
into other shapes offers only a new run."""
import json
import os
import pty
import shutil
import subprocess
from pathlib import Path

import pytest

from megaresil.events import read_events
from tests.harness.journey import MEGARESIL, megaresil, user_env
from tests.unit.test_data_blend import llama_style_tokenizer

pytestmark = pytest.mark.journey

TINY = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "train.steps=3", "data.seq_len=32",
        "train.micro_batch_size=2", "train.global_batch_size=2", "train.eval_batches=0",
        "logging.tensorboard=false", "model.vocab_size=300"]
OWN_DATA = ["data.source=indexed", "data.path=data/corpus"]


def on_a_terminal_of_no_width(*args: str, cwd: Path) -> tuple[int, str]:
    """`megaresil ARGS` with its output on a new pseudo-terminal, which reports
    0 rows and 0 columns (as some CI runners' do): (exit code, what it showed)."""
    leader, follower = pty.openpty()
    assert os.get_terminal_size(follower).columns == 0
    proc = subprocess.Popen([MEGARESIL, *args], cwd=cwd, env=user_env(), stdin=subprocess.DEVNULL,
                            stdout=follower, stderr=follower)
    os.close(follower)
    shown = bytearray()
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # EIO: every process that held the terminal has ended
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    return proc.wait(timeout=60), shown.decode(errors="replace").replace("\r\n", "\n")


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> Path:
    """A user's directory: a corpus, an own tokenizer, the prepared data (its
    progress lines in prepare.log) and a 3-step run trained on it, runs/a,
    without naming the tokenizer (its console in train.log)."""
    directory = tmp_path_factory.mktemp("own-data")
    llama_style_tokenizer(directory / "tokenizer", vocab_size=300)
    (directory / "corpus.jsonl").write_text("".join(
        json.dumps({"text": f"Record {i}: to be or not to be, that is question {i}."}) + "\n"
        for i in range(300)))
    prepare = megaresil("data", "prepare", "--input", "corpus.jsonl", "--tokenizer", "tokenizer",
                        "--output", "data/corpus", "--workers", "1", cwd=directory,
                        env=user_env(MEGARESIL_PROGRESS_LINE_S="0"))
    (directory / "prepare.log").write_text(prepare.stderr + prepare.stdout)
    code, shown = on_a_terminal_of_no_width("train", "gpt-tiny", *TINY, *OWN_DATA,
                                            "run.dir=runs/a", cwd=directory)
    (directory / "train.log").write_text(shown)
    assert code == 0, shown[-3000:]
    return directory


def test_prepare_says_how_far_it_is_and_records_its_tokenizer(user):
    lines = (user / "prepare.log").read_text().splitlines()
    progress = [line for line in lines if line.startswith("data prepare: ")]
    assert progress[-1].startswith("data prepare: 300 documents, ")
    assert " tokens, 100% of " in progress[-1] and "MB read, ETA 0 s" in progress[-1]
    assert any("ETA" in line for line in progress[:-1])
    assert "-> data/corpus.{bin,idx,prepared.json}" in lines[-1]
    record = json.loads((user / "data/corpus.prepared.json").read_text())
    assert record["tokenizer"] == str((user / "tokenizer").resolve())


def test_train_says_when_it_launches_workers_and_prints_lines_on_a_terminal_of_no_width(user):
    shown = (user / "train.log").read_text().splitlines()
    launching = [i for i, line in enumerate(shown) if line.startswith("megaresil: launching 1 "
                                                                      "worker processes")]
    banner = [i for i, line in enumerate(shown) if line.startswith("megaresil: training ")]
    assert launching and banner and launching[0] < banner[0], shown
    # The terminal reports 0 columns: no bar, the plain line of each step instead.
    assert any(line.startswith("step 3/3 | loss ") for line in shown), shown


def test_another_tokenizer_is_refused_before_any_worker_starts(user):
    refused = megaresil("train", "gpt-tiny", *TINY, *OWN_DATA, "data.tokenizer=bpe",
                        "run.dir=runs/refused", cwd=user, check=False)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert (f"megaresil: error: data.tokenizer: data/corpus was prepared with "
            f"{(user / 'tokenizer').resolve()}") in refused.stderr
    assert not (user / "runs/refused/metrics.jsonl").exists()


def test_generate_takes_the_tokenizer_where_the_recorded_one_moved(user):
    def completion(*extra: str) -> subprocess.CompletedProcess:
        return megaresil("generate", "runs/a", "--prompt", "Record 7:", "--max-new-tokens", "4",
                         "--json", *extra, cwd=user, check=False)
    before = completion()  # the run named no tokenizer: the one its data recorded
    assert before.returncode == 0, before.stderr[-3000:]
    shutil.move(user / "tokenizer", user / "moved")
    try:
        lost = completion()
        assert lost.returncode != 0 and "is not there any more" in lost.stderr
        found = completion("--tokenizer", "moved")
    finally:
        shutil.move(user / "moved", user / "tokenizer")
    assert json.loads(found.stdout.splitlines()[-1]) == json.loads(before.stdout.splitlines()[-1])


def test_a_resume_into_other_shapes_offers_only_a_new_run(user):
    refused = megaresil("train", "gpt-tiny", *TINY, *OWN_DATA, "run.dir=runs/a",
                        "train.steps=4", "model.num_layers=2", cwd=user, check=False)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "model.num_layers: the checkpoint has 4, this recipe 2" in refused.stderr
    assert "other shapes than the checkpoint's" in refused.stderr
    assert "Fix: use a new run.dir (the new model" in refused.stderr
    assert "allow_recipe_change=[" not in refused.stderr and "init_from=" not in refused.stderr
    assert [e["event"] for e in read_events(user / "runs/a")].count("run_finished") == 1


def test_convert_writes_no_bars_into_a_log(user):
    result = megaresil("convert", "runs/a", "converted", "--backend", "zarr", cwd=user)
    assert result.stdout.startswith("wrote converted")
    assert "%|" not in result.stderr, result.stderr  # tqdm's bar: "writing:  50%|#####  | 3/6"


def test_a_prefix_named_by_its_bin_file_is_answered_with_the_prefix(user):
    refused = megaresil("train", "gpt-tiny", *TINY, "data.source=indexed",
                        "data.path=data/corpus.bin", "run.dir=runs/bin", cwd=user, check=False)
    assert refused.returncode == 2
    assert "Fix: give data/corpus instead of data/corpus.bin" in refused.stderr
