"""The forked-rank runner of unit tests names and kills a rank that stalls, so it never outlives the test."""

from __future__ import annotations

import time

import pytest

from megatron_ds.testing.launch import RanksFailed, forked_gloo_ranks


def _answer(rank: int, stall: int) -> int:
    if rank == stall:
        time.sleep(60)
    return rank * 10


def test_each_ranks_answer_in_rank_order(tmp_path) -> None:
    assert forked_gloo_ranks(_answer, 2, str(tmp_path / "store"), -1) == [0, 10]


def test_a_stalled_rank_is_named_and_killed_at_the_timeout(tmp_path) -> None:
    started = time.monotonic()
    with pytest.raises(RanksFailed, match=r"rank\(s\) \[1\] gave no result within 6s \(killed\); the others: \{0: 0\}"):
        forked_gloo_ranks(_answer, 2, str(tmp_path / "store"), 1, timeout=6)
    assert time.monotonic() - started < 30  # not the 60 s the rank sleeps
