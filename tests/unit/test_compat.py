"""The torch versions megaresil runs on: pyproject's floor, compat's checked
range and its refusal of others, every module importing on the installed
torch, and private torch APIs used nowhere but megaresil/compat.py."""
from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import pytest
import torch

import megaresil
from megaresil import compat

PACKAGE = Path(megaresil.__file__).parent


def pyproject_torch_floor() -> tuple[int, int]:
    text = (PACKAGE.parent / "pyproject.toml").read_text()
    found = re.search(r'"torch>=(\d+)\.(\d+)', text)
    assert found, "pyproject.toml lists no torch>= floor"
    return int(found.group(1)), int(found.group(2))


def test_checked_range_starts_at_pyprojects_floor():
    assert compat.CHECKED_TORCH[0] == pyproject_torch_floor()
    assert compat.CHECKED_TORCH[0] <= compat.CHECKED_TORCH[1]


def test_installed_torch_is_in_the_checked_range():
    compat.check_torch_version(torch.__version__)


@pytest.mark.parametrize("version", ["2.9.0", "2.14.1+cu126", "2.11.0a0+git1234abc"])
def test_versions_in_range_pass(version):
    compat.check_torch_version(version)


def test_older_torch_is_refused_naming_versions_and_fix():
    with pytest.raises(compat.UnsupportedTorch) as refused:
        compat.check_torch_version("2.8.0+cpu", allow_newer=True)
    message = str(refused.value)
    assert "torch 2.8.0+cpu" in message and "2.9 to 2.14" in message
    assert "pip install 'torch>=2.9'" in message and "\n" not in message


def test_newer_torch_is_refused_unless_allowed():
    oldest, newest = compat.CHECKED_TORCH
    newer = f"{newest[0]}.{newest[1] + 1}.0"
    with pytest.raises(compat.UnsupportedTorch) as refused:
        compat.check_torch_version(newer)
    message = str(refused.value)
    assert f"torch {newer} is newer" in message and f"{oldest[0]}.{oldest[1]} to" in message
    assert compat.UNCHECKED_TORCH_ENV in message and "CHECKED_TORCH" in message
    compat.check_torch_version(newer, allow_newer=True)


def test_unreadable_version_is_refused():
    with pytest.raises(compat.UnsupportedTorch, match="cannot read torch version"):
        compat.check_torch_version("nightly")


def megaresil_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(megaresil.__path__, "megaresil.")
                  if not m.name.endswith("__main__"))  # __main__ runs the CLI


def test_every_module_imports_on_this_torch():
    """The import check: every module of the package imports (compat's
    version check included), so an API the installed torch lacks fails here
    and not in a worker."""
    assert len(megaresil_modules()) > 30
    for name in megaresil_modules():
        importlib.import_module(name)


def _torch_names(tree: ast.Module) -> set[str]:
    """Local names bound to torch modules or objects by the file's imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names
                      if a.name.split(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names |= {a.asname or a.name for a in node.names}
    return names


def private_torch_uses(source: str) -> list[str]:
    """`torch.x._y`-style attributes and `from torch._x import` / `import _y`
    in `source` (dunders are public protocol)."""
    tree = ast.parse(source)
    torch_names, found = _torch_names(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            private = [a.name for a in node.names if a.name.startswith("_")]
            if "._" in f".{node.module}" or private:
                found.append(f"line {node.lineno}: from {node.module} import {private or '...'}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in torch_names:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_private_torch_apis_only_in_compat():
    uses = {str(path.relative_to(PACKAGE)): private_torch_uses(path.read_text())
            for path in PACKAGE.rglob("*.py") if path.name != "compat.py"}
    assert {path: found for path, found in uses.items() if found} == {}


def test_private_use_finder_finds_them():
    sample = ("import torch\nimport torch.distributed as dist\n"
              "from torch.utils._pytree import tree_map_only\n"
              "from torch.distributed.checkpoint.filesystem import _StorageInfo\n"
              "torch._foreach_norm([])\ndist.distributed_c10d._world\n"
              "torch.Tensor.__torch_dispatch__\nself._private\n")
    assert len(private_torch_uses(sample)) == 4


def test_rendezvous_records_name_their_method_as_torchs_own_lookup_does():
    """The frame-based get_method_name an elastic launch puts in place of
    torch's inspect.stack() one names the same method, at every depth, and is
    torch's own again afterwards."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    original = dynamic_rendezvous.get_method_name

    def a_rendezvous_step(lookup, depth):
        return record(lookup, depth)

    def record(lookup, depth):  # as DynamicRendezvousHandler's _record calls it
        return lookup(depth)

    def names(lookup):  # a loop, not a comprehension: that would add a frame of its own
        found = []
        for depth in (0, 1, 2, 3, 4, 10_000):
            found.append(a_rendezvous_step(lookup, depth))
        return found

    expected = names(original)
    assert expected[2:5] == ["a_rendezvous_step", "names",
                             "test_rendezvous_records_name_their_method_as_torchs_own_lookup_does"]
    assert expected[-1] == "no_method_name"
    with compat.rendezvous_method_names_from_frames():
        replaced = dynamic_rendezvous.get_method_name
        assert replaced is not original
        assert names(replaced) == expected
    assert dynamic_rendezvous.get_method_name is original
