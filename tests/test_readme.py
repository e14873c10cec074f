"""Every fenced code block of README.md runs as a test, so the README cannot drift from the code.

Fence languages: ``python`` blocks run as a script in a fresh interpreter; ``console`` and
``shell`` blocks run each ``$ `` line as a command (``ort-offload`` becomes this interpreter's
``-m ort_offload``), in order, in one directory; ``text`` blocks (trees, ``make`` targets, which
would recurse, and signatures) are skipped. Any other language, or a fence without one, fails:
a new block must say whether it runs. The word ``slow`` after the language (```` ```python slow ````)
puts the block under the ``slow`` marker (``make test-all``).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
RUN_LANGUAGES = ("python", "console", "shell")
SKIP_LANGUAGES = ("text",)
KNOWN_FLAGS = ("slow",)
BLOCK_TIMEOUT_S = 300
_FENCE = re.compile(r"^```(.*)$")


@dataclass(frozen=True)
class Block:
    """One fenced block: its language, flags after the language, first line number and body."""

    language: str
    flags: tuple[str, ...]
    line: int
    body: str

    @property
    def id(self) -> str:
        return f"{self.language}-line{self.line}"


def readme_blocks(text: str) -> list[Block]:
    """The fenced blocks of ``text`` in order; an unclosed fence is an error."""
    blocks, open_at, info, body = [], None, "", []
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line)
        if open_at is None and match:
            open_at, info, body = number, match.group(1).strip(), []
        elif open_at is not None and line.strip() == "```":
            words = info.split()
            blocks.append(Block(words[0] if words else "", tuple(words[1:]), open_at, "\n".join(body) + "\n"))
            open_at = None
        elif open_at is not None:
            body.append(line)
    assert open_at is None, f"README.md: the fence opened at line {open_at} is never closed"
    return blocks


def console_commands(body: str) -> list[str]:
    """The ``$ `` lines of a console block (a trailing backslash continues a line), with
    ``ort-offload`` run as this interpreter's ``-m ort_offload``."""
    commands, pending = [], None
    for line in body.splitlines():
        if pending is not None:
            pending += " " + line.strip()
        elif line.startswith("$ "):
            pending = line[2:].strip()
        else:
            continue  # output shown in the README, not checked
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        commands.append(re.sub(r"^ort-offload\b", f"{shlex.quote(sys.executable)} -m ort_offload", pending))
        pending = None
    return commands


def _env() -> dict[str, str]:
    """The test's environment with this checkout first on the import path (blocks run elsewhere)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def _run(command, cwd: Path, what: str) -> None:
    result = subprocess.run(command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert result.returncode == 0, f"{what} exited {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"


BLOCKS = readme_blocks(README.read_text())


def _params():
    return [
        pytest.param(block, id=block.id, marks=[pytest.mark.slow] if "slow" in block.flags else [])
        for block in BLOCKS
        if block.language in RUN_LANGUAGES
    ]


def test_every_block_says_whether_it_runs():
    unknown = [f"line {b.line}: {b.language or '(none)'}" for b in BLOCKS if b.language not in RUN_LANGUAGES + SKIP_LANGUAGES]
    assert not unknown, f"README fences need a language from {RUN_LANGUAGES + SKIP_LANGUAGES}: {unknown}"
    bad_flags = [f"line {b.line}: {f}" for b in BLOCKS for f in b.flags if f not in KNOWN_FLAGS]
    assert not bad_flags, f"unknown fence flags (known: {KNOWN_FLAGS}): {bad_flags}"
    empty = [b.line for b in BLOCKS if b.language in ("console", "shell") and not console_commands(b.body)]
    assert not empty, f"console blocks without a `$ ` command at lines {empty}"


def test_readme_is_short():
    """The README is for users (issue acceptance: under 350 lines); detail belongs in docs/."""
    assert len(README.read_text().splitlines()) < 350


def test_parser_reads_languages_flags_and_commands():
    blocks = readme_blocks("x\n```python slow\nprint(1)\n```\n```console\n$ ort-offload a \\\n  b\nout\n```\n")
    assert [(b.language, b.flags, b.line) for b in blocks] == [("python", ("slow",), 2), ("console", (), 5)]
    assert console_commands(blocks[1].body) == [f"{shlex.quote(sys.executable)} -m ort_offload a b"]
    with pytest.raises(AssertionError):
        readme_blocks("```python\nprint(1)\n")


@pytest.mark.parametrize("block", _params())
def test_readme_block_runs(block: Block, tmp_path: Path):
    if block.language == "python":
        script = tmp_path / "readme_block.py"
        script.write_text(block.body)
        _run([sys.executable, str(script)], tmp_path, f"README.md python block at line {block.line}")
        return
    for command in console_commands(block.body):
        _run(["bash", "-c", command], tmp_path, f"README.md line {block.line}: {command}")
