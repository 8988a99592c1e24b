"""`fail_together` on three gloo ranks: a step that fails on some ranks only raises the lowest failing rank's one-line
error on every rank (naming it and the others that failed), in its class; a bug keeps its traceback on its rank and is
named on the others; when nothing fails nothing is raised; and afterwards the group still runs collectives (no rank
was left inside one)."""

from __future__ import annotations

import time
from pathlib import Path

from megatron_ds.errors import UserError
from megatron_ds.testing.launch import forked_gloo_ranks
from megatron_ds.training.checkpoint.directory import CheckpointError
from megatron_ds.training.rank_agreement import fail_together


def _case(rank: int, failing: dict[int, Exception]) -> tuple[str, str] | None:
    """(class name, message) of what `fail_together` raised on this rank when `failing` ranks raise; None if nothing."""
    try:
        with fail_together():
            if rank in failing:
                raise failing[rank]
    except Exception as err:  # noqa: BLE001 - the answer
        return type(err).__name__, str(err)
    return None


def _cases(rank: int) -> dict:
    import torch
    import torch.distributed as dist

    start = time.monotonic()
    out = {
        "none": _case(rank, {}),
        "one": _case(rank, {1: CheckpointError("/ck/layer_01.pt: unreadable (bad zip); the checkpoint is damaged")}),
        "two": _case(rank, {2: CheckpointError("/ck/b.pt: missing"), 1: CheckpointError("/ck/a.pt: missing")}),
        "bug": _case(rank, {2: RuntimeError("index out of range\nsecond line")}),
    }
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)  # every rank is here: none was left waiting inside an agreement
    out["after"] = total.item()
    out["seconds"] = time.monotonic() - start
    return out


def test_every_rank_raises_the_lowest_failing_ranks_error(tmp_path: Path) -> None:
    ranks = forked_gloo_ranks(_cases, 3, str(tmp_path / "store"), timeout=120)
    assert all(isinstance(r, dict) for r in ranks), ranks
    one = "/ck/layer_01.pt: unreadable (bad zip); the checkpoint is damaged (on rank 1; every rank stops)"
    two = "/ck/a.pt: missing (on rank 1; ranks 2 failed too; every rank stops)"
    bug = "RuntimeError: index out of range (on rank 2, whose output has its traceback; every rank stops)"
    for rank, r in enumerate(ranks):
        assert r["none"] is None
        assert r["one"] == ("CheckpointError", one)
        assert r["two"] == ("CheckpointError", two)
        assert r["bug"] == (("RuntimeError", "index out of range\nsecond line") if rank == 2 else ("UserError", bug))
        assert r["after"] == 6.0
        assert r["seconds"] < 10.0


def test_without_a_process_group_the_error_passes_through() -> None:
    err = CheckpointError("x.pt: missing")
    try:
        with fail_together():
            raise err
    except UserError as got:
        assert got is err
