"""The quick commands answer without importing torch, and recipes are found by name."""
import subprocess
import sys

import pytest

from megaresil.config import ConfigError, find_recipe, packaged_recipes


def modules_after(argv: list[str]) -> set[str]:
    """sys.modules after `megaresil ARGV` ran (or, for ckpt inspect, was parsed), in a
    fresh interpreter."""
    code = ("import sys\nfrom megaresil import cli\n"
            f"argv = {argv!r}\n"
            "try:\n"
            "    cli.main(argv) if argv[0] != 'ckpt' else cli.build_parser().parse_args(argv)\n"
            "except SystemExit:\n    pass\n"
            "print('\\n'.join(sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    return set(out.split())


@pytest.mark.parametrize("argv", [["--help"], ["recipes"], ["config", "docs"],
                                  ["config", "show", "gpt-tiny"],
                                  ["ckpt", "inspect", "runs/x"]], ids=" ".join)
def test_quick_commands_do_not_import_torch(argv):
    modules = modules_after(argv)
    assert "megaresil.cli" in modules
    assert "torch" not in modules


def test_a_recipe_is_found_by_name_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    by_name = find_recipe("gpt-tiny")
    assert by_name == find_recipe("gpt-tiny.yaml")
    assert by_name.is_file() and by_name.parent.name == "recipes"
    (tmp_path / "gpt-tiny").write_text("{}\n")  # an existing path wins over a name
    assert find_recipe("gpt-tiny").resolve() == (tmp_path / "gpt-tiny").resolve()


def test_an_unknown_recipe_name_lists_the_names():
    with pytest.raises(ConfigError) as err:
        find_recipe("gpt-huge")
    assert "gpt-tiny" in str(err.value) and "llama-3.2-1b" in str(err.value)
    assert "\n" not in str(err.value)


def test_every_packaged_recipe_has_a_one_line_description():
    recipes = dict(packaged_recipes())
    assert {"gpt-tiny", "gpt2-124m", "llama-1b", "llama-3.2-1b"} <= set(recipes)
    assert all(recipes.values())
