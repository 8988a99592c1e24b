"""Keep the command output pasted in the docs true: rerun it, compare, and refresh it.

A documented run is a fenced ```text block whose first line is `$ <command>` (continued by
trailing backslashes) followed by what the command printed. The commands that run quickly in
one process are checked: `python pretrain_gpt.py ... --print-layout` (and errors before launch)
and `python -m megatron_ds.plan ...`. A block with a line `...` is abridged: its other lines
must appear in the real output in the same order. Other blocks must equal the output exactly.

    python -m megatron_ds.testing.docs            # check every block; exit 1 naming the stale ones
    python -m megatron_ds.testing.docs --refresh  # rewrite the stale complete blocks in place
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = ("README.md", "docs/*.md", "benchmarks/README.md")
BLOCK = re.compile(r"^```text\n(\$ .*?)^```$", re.M | re.S)
ELISION = "..."
EXIT_STATUS = re.compile(r"\(exit status -?\d+\)")


@dataclass(frozen=True)
class Block:
    """One documented run: where it is, the command and the output as pasted."""

    path: Path
    start: int
    end: int
    argv: list[str]
    shown: list[str]

    @property
    def abridged(self) -> bool:
        return any(line.strip() == ELISION for line in self.shown)

    @property
    def label(self) -> str:
        line = self.path.read_text()[: self.start].count("\n") + 1
        return f"{self.path.relative_to(ROOT)}:{line}"


def blocks(paths: list[Path] | None = None) -> Iterator[Block]:
    """Every documented run of a command this module knows how to rerun."""
    for path in paths or sorted({p for pattern in DOC_FILES for p in ROOT.glob(pattern)}):
        text = path.read_text()
        for m in BLOCK.finditer(text):
            lines = m.group(1).rstrip("\n").split("\n")
            command, rest = lines[0][2:], lines[1:]
            while command.endswith("\\") and rest:
                command = command[:-1] + rest.pop(0).strip()
            argv = shlex.split(command)
            if runner_for(argv) is not None:
                yield Block(path, m.start(1), m.end(1), argv, rest)


def runner_for(argv: list[str]) -> Callable[[list[str]], int] | None:
    """The in-process entry point of a documented command, or None for commands not checked here."""
    if argv[:1] != ["python"]:
        return None
    if argv[1:2] == ["pretrain_gpt.py"] and ("--print-layout" in argv or "--lr" not in argv):
        from pretrain_gpt import main

        return main
    if argv[1:3] == ["-m", "megatron_ds.plan"]:
        from megatron_ds.plan.cli import main as plan_main

        return plan_main
    return None


def run(block: Block) -> list[str]:
    """The lines the command prints (stdout, then stderr, as a terminal shows a one-line error),
    and `(exit status N)` when the block shows its command's status that way."""
    main = runner_for(block.argv)
    assert main is not None
    args = block.argv[2:] if block.argv[1] == "pretrain_gpt.py" else block.argv[3:]
    out, err = io.StringIO(), io.StringIO()
    # In a scratch directory: a documented `--write-config ds.json` must not leave files behind.
    with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(args)
            except SystemExit as exit_:
                status = exit_.code
    lines = (out.getvalue() + err.getvalue()).rstrip("\n").split("\n")
    if block.shown and EXIT_STATUS.fullmatch(block.shown[-1]):
        lines.append(f"(exit status {status or 0})")
    return lines


def agrees(block: Block, actual: list[str]) -> bool:
    if not block.abridged:
        return block.shown == actual
    wanted = iter(actual)
    return all(any(line == got for got in wanted) for line in block.shown if line.strip() != ELISION)


def refresh(block: Block, actual: list[str]) -> None:
    text = block.path.read_text()
    first = text[block.start :].split("\n", 1)[0]
    command_lines = text[block.start : block.end].split("\n")[: _command_line_count(block) or 1]
    assert command_lines[0] == first
    new = "\n".join([*command_lines, *actual]) + "\n"
    block.path.write_text(text[: block.start] + new + text[block.end :])


def _command_line_count(block: Block) -> int:
    lines = block.path.read_text()[block.start : block.end].split("\n")
    n = 1
    while lines[n - 1].endswith("\\"):
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    stale = []
    # Refresh from the end of each file backwards so earlier offsets stay valid.
    for block in sorted(blocks(), key=lambda b: (str(b.path), -b.start)):
        actual = run(block)
        if agrees(block, actual):
            continue
        if "--refresh" in argv and not block.abridged:
            refresh(block, actual)
            print(f"refreshed {block.label}")
        else:
            stale.append(block.label)
    for label in stale:
        print(f"stale: {label} (rerun the command and paste its output)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
