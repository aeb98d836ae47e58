"""The fixtures every kind of test shares (what they run lives in tests/harness/)."""
import shutil
from pathlib import Path

import pytest

from tests.harness.cli import ROOT, SMALL, megaresil_cli


@pytest.fixture
def cli():
    return megaresil_cli


@pytest.fixture
def cli_main(capfd, monkeypatch):
    """`megaresil ARGS` run by the CLI's main() in this process, from the
    repository root, its output (and that of the processes it starts)
    captured as a CompletedProcess's; raises, like `cli`, on a failure unless
    check=False. For commands that read files or start processes of their own
    (chaos, ckpt, plan, data prepare, config): a call saves starting Python and
    importing torch (and, for chaos's report, matplotlib), seconds each. The
    `cli` fixture's subprocess stays for train, which is what users run."""
    import subprocess

    from megaresil.cli import main

    monkeypatch.chdir(ROOT)

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        capfd.readouterr()  # only this call's output
        code = main(list(args))
        out, err = capfd.readouterr()
        if check and code != 0:
            raise AssertionError(f"megaresil {' '.join(args)} returned {code}:\n"
                                 f"{out[-3000:]}\n{err[-5000:]}")
        return subprocess.CompletedProcess(["megaresil", *args], code, out, err)

    return run


@pytest.fixture(scope="session")
def chaos_reference(tmp_path_factory) -> Path:
    """SMALL's fault-free run (a checkpoint every 2 steps), the one every
    chaos test compares against: trained once for the whole session."""
    run_dir = tmp_path_factory.mktemp("chaos-reference")
    megaresil_cli("train", *SMALL, "checkpoint.interval=2", f"run.dir={run_dir}",
                  "logging.progress=false", timeout=300)
    return run_dir


@pytest.fixture(scope="session")
def demo_corpus(tmp_path_factory) -> Path:
    """The demo's corpus (Shakespeare, its BPE trained to gpt-tiny's
    vocabulary) as a data.cache_dir of its own: prepared at most once a
    session, in the repository's cache, which the `cli` fixture's runs
    (started from the repository) use too; a fresh directory would train the
    same tokenizer again, ~12 s of each journey whose point is not the first
    preparation (test_journey_recipes keeps one that is)."""
    from megaresil.config import load_recipe
    from megaresil.data.prepare import prepare_dataset

    shared = ROOT / ".cache" / "megaresil"  # data.cache_dir's default, from the repository
    cfg = load_recipe(ROOT / "recipes" / "gpt-tiny.yaml", [f"data.cache_dir={shared}"])
    entry = Path(prepare_dataset(cfg.data, cfg.model.vocab_size).train_prefix).parent
    cache = tmp_path_factory.mktemp("demo-corpus") / "megaresil"
    # The prepared files alone, as a preparation leaves them: not the shuffle
    # indexes runs add beside them (.megaresil-index), nor other entries.
    shutil.copytree(entry, cache / entry.name, ignore=shutil.ignore_patterns(".megaresil-index"))
    return cache


@pytest.fixture(scope="session")
def mcore_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Checkpoints Megatron-Core saved itself (tests/harness/mcore.py): llama
    and gpt2 at tp=1 and tp=2, llama at pp=2, llama with experts at ep=1 and
    ep=2, qwen2, qwen3 and llama with Llama 3's RoPE scaling at tp=2, qwen3-moe and
    experts with an expert bias at ep=2, each with its logits; llama trained two steps with Mcore's
    distributed optimizer and saved with its state (fully_reshardable at
    tp=1 and tp=2, dp_reshardable); saved once a session (one 2-rank group,
    ~1 min on two cores)."""
    from tests.harness import mcore

    reason = mcore.missing_reason()
    if reason:
        pytest.skip(reason)
    saves = [mcore.Saved(flavour, tp=tp) for flavour in ("llama", "gpt2") for tp in (1, 2)]
    saves += [mcore.Saved("llama", pp=2), mcore.Saved("moe"), mcore.Saved("moe", ep=2)]
    saves += [mcore.Saved("qwen2", tp=2), mcore.Saved("qwen3", tp=2), mcore.Saved("qwen3moe", ep=2),
              mcore.Saved("llama3", tp=2), mcore.Saved("moebias", ep=2)]
    # Last: training with Mcore's optimizer patches the saving processes for good.
    saves += [mcore.Saved("llama", tp=tp, optimizer="fully_reshardable") for tp in (1, 2)]
    saves += [mcore.Saved("llama", optimizer="dp_reshardable")]
    return mcore.save_checkpoints(saves, tmp_path_factory.mktemp("mcore"))
