"""The checkpoint a user means by a path, and the failure of finding none
usable (where a run's checkpoints live: checkpoint/paths.py)."""
from __future__ import annotations

from pathlib import Path

from megaresil.errors import MegaresilError


class NoValidCheckpoint(MegaresilError, RuntimeError):
    """Checkpoints exist but none can be loaded: never silently start over."""

    fatal, reported_by_cli = True, True


def resolve_checkpoint(path: Path) -> tuple[Path, str]:
    """The checkpoint a user means by `path`: a checkpoint directory itself,
    a root's `latest` file (the step directory beside it that it names), a
    checkpoint root or a run directory (its checkpoints/): the newest
    checkpoint whose marker and manifest read, the one a resume takes
    (`latest` is a hint for people and tools: nothing checksums it, so a
    damaged one must not choose). Returns it and a line saying which (empty
    when `path` was the checkpoint itself); CheckpointError when none reads."""
    from megaresil.checkpoint import format as fmt
    from megaresil.checkpoint.validation import read_manifest

    if not path.exists():
        raise fmt.CheckpointError(f"{path} does not exist. Fix: give a checkpoint directory, "
                                  "a run directory, its checkpoints/ or their latest file")
    if path.is_file() and path.name == fmt.LATEST:
        named = named_by_latest(path)
        return named, f"{path} names {named.name}"
    if ((path / fmt.MARKER).exists() or (path / fmt.MANIFEST).exists()
            or fmt.STEP_DIR.match(path.name)):
        return path, ""
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    skipped = []
    for candidate in fmt.committed_checkpoints(root):
        try:
            read_manifest(candidate)
        except fmt.CheckpointError as err:
            skipped.append(f"{candidate.name}: {err}")
            continue
        passed = f" (skipped {'; '.join(skipped)})" if skipped else ""
        return candidate, f"using {candidate}, the newest committed checkpoint under {path}{passed}"
    raise fmt.CheckpointError(f"{path} holds no valid checkpoint" +
                              (f" ({'; '.join(skipped)})" if skipped else
                               " (no step_* directory)") +
                              ". Fix: give a checkpoint directory, a run directory or its "
                              "checkpoints/ after at least one save")


def named_by_latest(latest: Path) -> Path:
    """The step directory beside `latest` that it names; CheckpointError
    when it names anything else (a damaged or crafted file)."""
    from megaresil.checkpoint import format as fmt

    name = latest.read_text(errors="replace").strip()
    if not fmt.STEP_DIR.fullmatch(name) or not (latest.parent / name).is_dir():
        raise fmt.CheckpointError(f"{latest} names {name[:80]!r}, not a step directory beside it. "
                                  "Fix: give the run directory or its checkpoints/ (the newest "
                                  "valid checkpoint is found without it)")
    return latest.parent / name
