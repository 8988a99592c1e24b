"""The pipeline schedules a configuration can run and those the planner prices: every (schedule, virtual
stages) the engine runs at this tensor, pipeline and micro-batch size and ZeRO stage (only the one the flags fix,
when they fix one), those whose replay is short enough to price (`REPLAY_LIMIT`; 1F1B always, by its closed
form), the search's (interleaving at v = 2) and the refinement's (v = 2-4), and what was left unpriced for its
size (`Unreplayed`, `replay_note`). The search that prices them is `plan/ranking.py`."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ds.config.parallel import DEFAULT_PIPELINE_SCHEDULE
from megatron_ds.estimate import pipeline_schedules
from megatron_ds.plan.inputs import Resolved
from megatron_ds.plan.search import REPLAY_LIMIT

SCHEDULES = tuple((entry.name, entry.virtual_stages) for entry in pipeline_schedules.REGISTRY.values())
"""The pipeline schedules the search tries (name, virtual stages: interleaving's default v = 2), in tie-break
order: the registry's, 1F1B first."""
assert SCHEDULES[0] == (DEFAULT_PIPELINE_SCHEDULE, 1), "ties prefer 1F1B"
VIRTUAL_STAGES = (2, 3, 4)
"""Chunks per rank the refinement tries for interleaving (the search itself tries v = 2: each v is one more
schedule to replay for every configuration)."""


def schedule_order(schedule: tuple[str, int]) -> tuple[int, int]:
    """Tie-break order of a (name, virtual stages): the registry's, then fewer chunks."""
    return list(pipeline_schedules.REGISTRY).index(schedule[0]), schedule[1]


def num_micro_batches(res: Resolved, t: int, p: int, mb: int) -> int:
    """Micro-batches per step M of this configuration (gradient accumulation steps)."""
    return res.global_batch_size // (mb * (res.num_gpus // (t * p)))


def _runnable(res: Resolved, t: int, p: int, mb: int, zero: int, chunks: tuple[int, ...]) -> list[tuple[str, int]]:
    """Every (schedule, v) the engine runs for this configuration, v from `chunks` for interleaving: 1F1B
    always; ZB-H1 and interleaving on the pipeline engine (ZeRO 0/1) with P >= 2, interleaving when the layers
    divide into v x P chunks and the micro-batches are a multiple of P (config/tree.py's `_check_engine`).
    Only the schedule and chunks the flags fix (`Resolved.schedule`), where they are fixed; at P = 1 a fixed
    ZB-H1 runs as given (DeepSpeed's engine runs it; no weight pass waits)."""
    fixed, chunks_fixed = res.schedule
    chunks = chunks if chunks_fixed is None else (chunks_fixed,)
    if fixed is not None and fixed != SCHEDULES[0][0] and zero >= 2:
        return []  # the plain engine runs 1F1B only
    if p < 2 or zero >= 2:
        return [SCHEDULES[0]] if fixed in (None, SCHEDULES[0][0]) else [(fixed, 1)] if chunks == (1,) else []
    if res.model().is_moe:  # experts at P > 1: DeepSpeed's own 1F1B only (`Config._moe_pipeline_refusals`)
        return [SCHEDULES[0]] if fixed in (None, SCHEDULES[0][0]) else []
    m = num_micro_batches(res, t, p, mb)
    layers = res.dims["num_layers"]
    out = [(name, v) for name, v in SCHEDULES if v == 1]
    interleaved = [name for name, v in SCHEDULES if v > 1]
    out += [(n, v) for n in interleaved for v in chunks if v > 1 and layers % (v * p) == 0 and m % p == 0]
    return [s for s in out if fixed in (None, s[0]) and chunks_fixed in (None, s[1])]


def _replayable(res: Resolved, t: int, p: int, mb: int, schedule: tuple[str, int]) -> bool:
    """1F1B (its closed form past the replay limit), or M x P x v within REPLAY_LIMIT."""
    return schedule == SCHEDULES[0] or num_micro_batches(res, t, p, mb) * p * schedule[1] <= REPLAY_LIMIT


def schedules_for(res: Resolved, t: int, p: int, mb: int, zero: int) -> list[tuple[str, int]]:
    """The schedules the search prices a configuration under: `_runnable`'s with v = 2, those past
    REPLAY_LIMIT but 1F1B left out."""
    return [s for s in _runnable(res, t, p, mb, zero, (2,)) if _replayable(res, t, p, mb, s)]


@dataclass(frozen=True, order=True)
class Unreplayed:
    """A configuration the fixed schedule runs on but the search does not price: its replay is too long."""

    steps: int
    """Micro-batches x stages x chunks per rank, over REPLAY_LIMIT."""
    tp: int
    pp: int
    micro_batch_size: int


def unreplayed(res: Resolved, t: int, p: int, sizes: list[int], zero: int) -> list[Unreplayed]:
    """The (t, p, micro-batch) of `sizes` whose runnable schedules the search leaves out for their size."""
    return [
        Unreplayed(num_micro_batches(res, t, p, mb) * p * v, t, p, mb)
        for mb in sizes
        for s in _runnable(res, t, p, mb, zero, (2,))
        if not _replayable(res, t, p, mb, s)
        for v in (s[1],)
    ]


def replay_note(skipped: list[Unreplayed]) -> str:
    """What the search left unpriced for its size (empty when nothing)."""
    if not skipped:
        return ""
    first = min(skipped)
    count = len(set(skipped))
    which = "one configuration" if count == 1 else f"{count} configurations"
    return (
        f"{which} that {'runs' if count == 1 else 'run'} it {'was' if count == 1 else 'were'} not priced, {'its' if count == 1 else 'each'} replay too long (micro-batches "
        f"x P x v over the planner's limit of {REPLAY_LIMIT:,}; the shortest: t={first.tp}, p={first.pp}, "
        f"micro-batch {first.micro_batch_size}, {first.steps:,})"
    )


def schedule_options(res: Resolved, t: int, p: int, mb: int, zero: int) -> list[tuple[str, int]]:
    """The schedules the refinement prices: `schedules_for`'s with interleaving at every v of VIRTUAL_STAGES."""
    return [s for s in _runnable(res, t, p, mb, zero, VIRTUAL_STAGES) if _replayable(res, t, p, mb, s)]


def too_long_to_replay(res: Resolved, t: int, p: int, mb: int, zero: int) -> list[tuple[str, int]]:
    """The schedules the refinement leaves out for their size alone."""
    return [s for s in _runnable(res, t, p, mb, zero, VIRTUAL_STAGES) if not _replayable(res, t, p, mb, s)]
