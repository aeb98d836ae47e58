"""The manual as data: the fenced blocks of README.md and docs/*.md, and the
directives that say how the docs tests run them (docs/contributing.md,
"An executable manual", describes the conventions for writers).

A block fenced as bash (or sh, shell) is a command block: the tests run it.
The HTML comment lines right above a fence are its directives:

  <!-- docs: skip REASON -->          not run; REASON is the skip's reason
  <!-- docs: overrides K=V ... -->    appended to each `megaresil train`,
                                       `chaos` or `soak` command of the block
  <!-- docs: replace OLD => NEW -->   OLD in the block replaced by NEW before it
                                       runs (pairs separated by ` ;; `); OLD must occur
  <!-- docs: exit N -->               the exit status the block must end with
  <!-- docs: output -->               (above a text block) what the command
                                       block before it prints, checked
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import docs_site  # noqa: E402  (a tool, not a package)
SHELL_LANGS = {"bash", "sh", "shell"}
# Commands a reader would paste: a block starting with one must be a command block.
COMMAND_WORDS = ("megaresil ", "make ", "torchrun ", "srun ", "sbatch ", "pip ", "python ",
                 "python3 ", "bash ", "mkdocs ", "pytest ")
DIRECTIVE = re.compile(r"^<!--\s*docs:\s*(\w[\w-]*)\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
# Commands that take a recipe's KEY=VALUE overrides.
OVERRIDABLE = re.compile(r"\bmegaresil\s+(train|chaos|soak)\b")


@dataclass
class Block:
    page: str          # path relative to the repository, e.g. docs/data.md
    line: int          # 1-based line of the opening fence
    lang: str
    text: str
    directives: dict[str, str] = field(default_factory=dict)
    expected_output: "Block | None" = None
    problems: list[str] = field(default_factory=list)  # malformed directives

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang in SHELL_LANGS


def manual_pages() -> list[Path]:
    """The manual a user reads: the pages the site publishes (tools/docs_site.py
    is their one list)."""
    return docs_site.manual_pages()


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of one page, each with the directives above it, and
    each command block paired with the text block checked as its output."""
    lines = path.read_text().splitlines()
    page = str(path.relative_to(ROOT))
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, lang = opening.group(2), opening.group(3).lower()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        directives = _directives_above(lines, i)
        unknown = sorted(set(directives) - {"skip", "overrides", "replace", "exit", "output"})
        blocks.append(Block(page, i + 1, lang, "\n".join(lines[i + 1:end]), directives,
                            problems=[f"unknown docs directive(s) {unknown}"] if unknown else []))
        i = end + 1
    _pair_outputs(blocks)
    return blocks


def _directives_above(lines: list[str], fence_index: int) -> dict[str, str]:
    found: dict[str, str] = {}
    j = fence_index - 1
    while j >= 0 and (m := DIRECTIVE.match(lines[j].strip())):
        found[m.group(1)] = m.group(2)
        j -= 1
    return found


def _pair_outputs(blocks: list[Block]) -> None:
    last_command: Block | None = None
    for block in blocks:
        if block.runs:
            last_command = block
        elif "output" in block.directives:
            if last_command is None or last_command.expected_output is not None:
                block.problems.append("an output block must follow its own command block")
            else:
                last_command.expected_output = block


def looks_like_commands(block: Block) -> bool:
    """A block a reader would paste into a shell, whatever its fence says."""
    first = next((ln.strip() for ln in block.text.splitlines()
                  if ln.strip() and not ln.strip().startswith("#")), "")
    return first.startswith(COMMAND_WORDS)


def with_overrides(script: str, overrides: str) -> str:
    """The block's script with OVERRIDES appended to each `megaresil
    train|chaos|soak` command (after its last continuation line)."""
    if not overrides:
        return script
    out: list[str] = []
    pending = False
    for line in script.splitlines():
        if OVERRIDABLE.search(line) and not line.lstrip().startswith("#"):
            pending = True
        if pending and not line.rstrip().endswith("\\"):
            line = _append_before_comment(line, overrides)
            pending = False
        out.append(line)
    return "\n".join(out)


def _append_before_comment(line: str, overrides: str) -> str:
    # `megaresil train X  # why`: the overrides go before the comment.
    code, sep, comment = line.partition("  #")
    return f"{code.rstrip()} {overrides}" + (f"  #{comment}" if sep else "")


def with_replacements(script: str, spec: str) -> tuple[str, list[str]]:
    """The script with each `OLD => NEW` pair of SPEC applied, and the OLDs
    that do not occur (a replacement that no longer applies has rotted)."""
    missing = []
    for pair in filter(None, (p.strip() for p in spec.split(" ;; "))):
        old, _, new = pair.partition(" => ")
        if old not in script:
            missing.append(old)
        script = script.replace(old, new)
    return script, missing


def output_matches(expected: str, actual: str) -> str | None:
    """None when each line of EXPECTED appears, in order, among ACTUAL's lines
    (`...` in a line stands for any text); else the first line not found."""
    actual_lines = actual.splitlines()
    pos = 0
    for want in (ln.rstrip() for ln in expected.splitlines()):
        if not want.strip() or want.strip() == "...":
            continue
        pattern = re.compile(".*?".join(re.escape(part) for part in want.strip().split("...")))
        while pos < len(actual_lines) and not pattern.search(actual_lines[pos]):
            pos += 1
        if pos == len(actual_lines):
            return want
        pos += 1
    return None
