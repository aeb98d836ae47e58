"""A killed `megaresil convert` leaves `DST.partial-<pid>` / `DST.replaced-<pid>`
behind; the next convert to DST settles them: leftovers of a dead process are
removed, an --overwrite stopped between moving the old DST aside and
committing the new one gets the old DST back (or keeps the new one when it was
committed), and leftovers of a live process are reported, not touched.

Each kill is simulated by laying out the directories as the killed process
would have left them, under the pid of a process that has exited."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.offline.convert import Target, convert
from megaresil.cli import main

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def versions(tmp_path_factory) -> tuple[Path, Path]:
    """Two committed checkpoints of one model: the `old` DST (tp=1) and the
    `new` one a convert --tp 2 would write."""
    root = tmp_path_factory.mktemp("versions")
    config = transformers.GPT2Config(vocab_size=300, n_positions=128, n_embd=32, n_layer=1,
                                     n_head=4)
    transformers.GPT2LMHeadModel(config).save_pretrained(root / "hf")
    assert main(["convert", "--from-hf", str(root / "hf"), str(root / "old")]) == 0
    return root / "old", convert(root / "old", root / "new", Target(tp=2, weights_only=True))


@pytest.fixture
def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def tp_of(checkpoint: Path) -> int:
    return json.loads((checkpoint / fmt.MANIFEST).read_text())["layout"]["tp"]


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()
                  if ".partial-" in p.name or ".replaced-" in p.name)


def uncommitted(checkpoint: Path, where: Path) -> Path:
    """`checkpoint` as it is between the rename into place and the marker."""
    shutil.copytree(checkpoint, where)
    (where / fmt.MARKER).unlink()
    return where


def convert_again(capsys, *argv: str) -> tuple[int, str]:
    """`megaresil convert` as a user runs it again (the sources hold weights only)."""
    code = main(["convert", *argv, *([] if "--to-hf" in argv else ["--weights-only"])])
    return code, capsys.readouterr().err


def test_partial_of_a_killed_convert_is_removed(versions, tmp_path, dead_pid, capsys):
    old, _ = versions
    partial = tmp_path / f"dst.partial-{dead_pid}"
    partial.mkdir()
    (partial / "half-written.distcp").write_bytes(b"\0" * 100)
    code, err = convert_again(capsys, str(old), str(tmp_path / "dst"))
    assert code == 0 and (tmp_path / "dst" / fmt.MARKER).exists()
    assert leftovers(tmp_path) == []
    assert f"removed {partial}" in err and f"pid {dead_pid}" in err


def test_kill_between_the_two_renames_restores_the_old_destination(versions, tmp_path,
                                                                   dead_pid, capsys):
    """Old DST moved aside, the new one still a partial: DST is missing."""
    old, new = versions
    dst = tmp_path / "dst"
    shutil.copytree(old, tmp_path / f"dst.replaced-{dead_pid}")
    uncommitted(new, tmp_path / f"dst.partial-{dead_pid}")
    code, err = convert_again(capsys, str(old), str(dst), "--tp", "2")
    assert code == 1 and "already exists" in err  # the old DST is back, so no --overwrite: no
    assert f"restored {dst}" in err
    assert tp_of(dst) == 1 and main(["ckpt", "verify", str(dst)]) == 0
    assert leftovers(tmp_path) == []


def test_kill_before_the_new_destination_was_committed_restores_the_old(versions, tmp_path,
                                                                        dead_pid, capsys):
    """The new DST renamed into place without its marker: the old one is the
    only complete copy and comes back; then --overwrite replaces it."""
    old, new = versions
    dst = uncommitted(new, tmp_path / "dst")
    shutil.copytree(old, tmp_path / f"dst.replaced-{dead_pid}")
    code, err = convert_again(capsys, str(old), str(dst), "--tp", "4", "--overwrite")
    assert code == 0 and f"restored {dst}" in err
    assert tp_of(dst) == 4 and (dst / fmt.MARKER).exists()
    assert leftovers(tmp_path) == []


def test_kill_while_deleting_the_replaced_destination_keeps_the_new_one(versions, tmp_path,
                                                                        dead_pid, capsys):
    """Committed new DST, the old one half deleted beside it: the rest goes."""
    old, new = versions
    dst = tmp_path / "dst"
    shutil.copytree(new, dst)
    replaced = tmp_path / f"dst.replaced-{dead_pid}"
    shutil.copytree(old, replaced)
    (replaced / fmt.MANIFEST).unlink()
    code, err = convert_again(capsys, str(old), str(dst), "--tp", "2")
    assert code == 1 and "already exists" in err
    assert f"removed {replaced}" in err
    assert tp_of(dst) == 2 and leftovers(tmp_path) == []


def test_kill_during_an_overwriting_hf_export_restores_the_old_export(versions, tmp_path,
                                                                      dead_pid, capsys):
    old, _ = versions
    out = tmp_path / "hf"
    assert main(["convert", str(old), "--to-hf", str(out)]) == 0
    out.rename(tmp_path / f"hf.replaced-{dead_pid}")
    code, err = convert_again(capsys, str(old), "--to-hf", str(out))
    assert code == 1 and f"restored {out}" in err and "already exists" in err
    assert (out / "config.json").exists() and leftovers(tmp_path) == []


def test_leftovers_of_a_live_process_are_reported_and_kept(versions, tmp_path, capsys):
    old, _ = versions
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as writer:
        try:
            partial = tmp_path / f"dst.partial-{writer.pid}"
            partial.mkdir()
            code, err = convert_again(capsys, str(old), str(tmp_path / "dst"))
        finally:
            writer.kill()
    assert code == 1 and f"running process {writer.pid}" in err and "Fix:" in err
    assert partial.exists() and not (tmp_path / "dst").exists()


def test_failure_after_moving_the_old_destination_aside_puts_it_back(versions, tmp_path,
                                                                     monkeypatch, capsys):
    """In-process: the marker of the new DST cannot be written."""
    old, new = versions
    dst = tmp_path / "dst"
    shutil.copytree(old, dst)
    real = fmt.write_text_atomic

    def no_marker(path, text):
        if path.name == fmt.MARKER:
            raise OSError(28, "No space left on device")
        return real(path, text)

    monkeypatch.setattr(fmt, "write_text_atomic", no_marker)
    with pytest.raises(OSError, match="No space left"):
        convert(old, dst, Target(tp=2, weights_only=True), overwrite=True)
    assert tp_of(dst) == 1 and (dst / fmt.MARKER).exists()
    assert leftovers(tmp_path) == []
