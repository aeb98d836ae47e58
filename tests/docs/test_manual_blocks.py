"""Every command block of README.md and docs/ runs, as a user would paste it,
in a fresh directory per page (blocks of one page in order, sharing it); a
block tagged `docs: output` is checked against what its command printed."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.journey import user_env
from tests.harness.manual import (blocks_of, looks_like_commands, manual_pages, output_matches,
                                  with_overrides, with_replacements)

pytestmark = pytest.mark.docs

BLOCKS = [b for page in manual_pages() for b in blocks_of(page)]
COMMAND_BLOCKS = [b for b in BLOCKS if b.runs]
BLOCK_TIMEOUT_S = 300


@pytest.fixture(scope="session")
def pages_root(tmp_path_factory) -> dict:
    """Where each page's blocks run, and which pages have had a block fail."""
    return {"root": tmp_path_factory.mktemp("manual"), "failed": set(), "cache": None}


def _page_dir(state: dict, page: str) -> Path:
    d = state["root"] / page.replace("/", "__")
    if not d.exists():
        d.mkdir()
        # The demo corpus prepared by an earlier page: a reader's second page
        # does not tokenize Shakespeare again, and neither do these tests.
        if state["cache"] is not None:
            shutil.copytree(state["cache"], d / ".cache")
    return d


@pytest.mark.parametrize("block", COMMAND_BLOCKS, ids=[b.id for b in COMMAND_BLOCKS])
def test_command_block_runs(block, pages_root):
    if "skip" in block.directives:
        pytest.skip(block.directives["skip"])
    if block.page in pages_root["failed"]:
        pytest.skip(f"an earlier block of {block.page} failed")
    cwd = _page_dir(pages_root, block.page)
    env = user_env()
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    script, missing = with_replacements(block.text, block.directives.get("replace", ""))
    assert not missing, f"{block.id}: its replace directive names text the block lacks: {missing}"
    script = with_overrides(script, block.directives.get("overrides", ""))
    try:
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env,
                                capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pages_root["failed"].add(block.page)
        raise
    output = result.stdout + result.stderr
    if pages_root["cache"] is None and (cwd / ".cache").is_dir():
        pages_root["cache"] = cwd / ".cache"
    expected_exit = int(block.directives.get("exit", "0"))
    if result.returncode != expected_exit:
        pages_root["failed"].add(block.page)
        pytest.fail(f"{block.id} exited {result.returncode}, the page expects {expected_exit}:\n"
                    f"{script}\n--- output ---\n{output[-4000:]}")
    if block.expected_output is not None:
        missing = output_matches(block.expected_output.text, output)
        assert missing is None, (
            f"{block.id}: the output shown at {block.expected_output.id} no longer matches; "
            f"not found: {missing!r}\n--- output ---\n{output[-4000:]}")


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_commands_are_in_command_blocks(block):
    """A block a reader would paste must be a bash block, so it is run."""
    if looks_like_commands(block) and not block.runs:
        pytest.fail(f"{block.id}: starts with a command but is fenced as "
                    f"{block.lang or 'plain text'}; fence it as bash (tag it "
                    f"`<!-- docs: skip REASON -->` if it cannot run here)")


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_directives_are_well_formed(block):
    assert not block.problems, f"{block.id}: {'; '.join(block.problems)}"


def test_every_skip_states_its_reason():
    bare = [b.id for b in COMMAND_BLOCKS if "skip" in b.directives and len(b.directives["skip"]) < 10]
    assert not bare, f"skipped blocks need a reason a reader understands: {bare}"
