"""docs/architecture.md's "Where to change one behaviour" rows for the registries are true: the
modules that spell an entry's name are exactly the files its row names, derived from the source.

An entry's name spelled as a string literal anywhere else would be a second owner of it (a reader
that matches the name instead of reading the entry), and a newcomer who adds an entry would have to
find that file too. The scan is of every module under megatron_ds/.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from megatron_ds.estimate import pipeline_schedules
from megatron_ds.model import activations, norms

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_ds"
DOC = (ROOT / "docs" / "architecture.md").read_text()

ROWS = {
    # row label -> (the registry's names, the files adding an entry edits)
    "a norm": (tuple(norms.REGISTRY), {"model/norms.py", "config/model.py"}),
    "a pipeline schedule": (
        tuple(pipeline_schedules.REGISTRY),
        {"estimate/pipeline_schedules.py", "config/parallel.py", "training/pipe_schedules.py"},
    ),
    "an activation": (
        tuple(activations.REGISTRY),
        {"model/activations.py", "config/model.py", "flags/to_model_config.py"},
    ),
}


HOMONYMS = {("a pipeline schedule", "interop/megatron_deepspeed_layout.py"): "interleaved QKV rows, not a schedule"}
"""A file that spells an entry's name for something else."""


def spelled(source: str, names: tuple[str, ...]) -> bool:
    """A string literal in `source` is exactly one of `names`."""
    return any(
        isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
        for node in ast.walk(ast.parse(source))
    )


def files_spelling(names: tuple[str, ...]) -> set[str]:
    return {str(p.relative_to(PACKAGE)) for p in sorted(PACKAGE.rglob("*.py")) if spelled(p.read_text(), names)}


def doc_row(label: str) -> str:
    rows = [line for line in DOC.splitlines() if line.startswith(f"| {label} |")]
    assert len(rows) == 1, f"docs/architecture.md needs one '| {label} | ...' row in 'Where to change one behaviour'"
    return rows[0]


@pytest.mark.parametrize("label", ROWS)
def test_the_files_that_spell_an_entry_are_the_rows_files(label: str) -> None:
    names, files = ROWS[label]
    found = {f for f in files_spelling(names) if (label, f) not in HOMONYMS}
    assert found == files, (
        f"{label}: modules spelling an entry's name {sorted(found)}; read the entry through its registry "
        f"instead (or update ROWS and docs/architecture.md)"
    )
    assert set(re.findall(r"`([\w/]+\.py)`", doc_row(label))) == files


def test_a_norm_takes_at_most_two_files() -> None:
    assert len(ROWS["a norm"][1]) <= 2


def test_the_scan_sees_a_spelled_name() -> None:
    """The check above would pass vacuously if the scan missed literals."""
    assert spelled("x = m.normalization == 'rmsnorm'", ("rmsnorm",)) and spelled('f("1f1b")', ("1f1b",))
    assert not spelled("x = '--normalization-rmsnorm'", ("rmsnorm",)) and not spelled("x = 1", ("1f1b",))
