"""Every documented run of `pretrain_gpt.py --print-layout` (or an error before launch) and of
`python -m megatron_ds.plan` shows what the command prints today (`megatron_ds.testing.docs`;
`python -m megatron_ds.testing.docs --refresh` rewrites stale blocks)."""

from __future__ import annotations

import pytest

from megatron_ds.testing import docs

BLOCKS = list(docs.blocks())


def test_the_docs_have_checked_runs() -> None:
    files = {b.path.name for b in BLOCKS}
    assert {"README.md", "layouts.md", "planner.md"} <= files, files


@pytest.mark.parametrize("block", BLOCKS, ids=[b.label for b in BLOCKS])
def test_documented_output_is_current(block: docs.Block) -> None:
    actual = docs.run(block)
    assert docs.agrees(block, actual), (
        f"{block.label} is stale; run `python -m megatron_ds.testing.docs --refresh`\n" + "\n".join(actual[:40])
    )


def test_an_abridged_block_must_keep_its_order() -> None:
    block = BLOCKS[0]
    fake = docs.Block(block.path, 0, 0, block.argv, ["b", "...", "a"])
    assert docs.agrees(fake, ["a", "b", "c", "a"])
    assert not docs.agrees(fake, ["a", "b"])
    exact = docs.Block(block.path, 0, 0, block.argv, ["a", "b"])
    assert docs.agrees(exact, ["a", "b"]) and not docs.agrees(exact, ["a", "b", "c"])
