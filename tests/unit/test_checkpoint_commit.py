"""The commit protocol's order on disk: the manifest is durable before the
partial directory is renamed into place, and the marker covers it."""
from __future__ import annotations

from pathlib import Path

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint import manager


def test_the_manifest_is_fsynced_before_the_rename_into_place(tmp_path, monkeypatch):
    steps = []
    fsync = fmt.fsync_path
    rename = Path.rename
    monkeypatch.setattr(fmt, "fsync_path",
                        lambda path: (steps.append(("fsync", Path(path).name)), fsync(path))[1])
    monkeypatch.setattr(Path, "rename",
                        lambda self, target: (steps.append(("rename", self.name)),
                                              rename(self, target))[1])
    partial, final = tmp_path / "step_0000001.partial-0", tmp_path / "step_0000001"
    (partial / "dcp").mkdir(parents=True)
    manager.commit(partial, final, {"tensors": {}}, make_room=lambda existing: None)
    renamed = steps.index(("rename", partial.name))
    assert ("fsync", fmt.MANIFEST) in steps[:renamed]
    assert {("fsync", partial.name), ("fsync", "dcp")} <= set(steps[:renamed])
    assert fmt.read_covered_json(final, fmt.MANIFEST) == {"tensors": {}}
