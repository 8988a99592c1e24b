"""The schedule registry (`estimate/pipeline_schedules.py`) is the stream the engine runs.

Every registered schedule's instructions equal the runtime schedule's, instruction for instruction
with buffers, chunks and micro-batches, for many sizes: DeepSpeed's own generator for `1f1b`,
Megatron-DeepSpeed's `ZeroBubbleH1Pipeline` for `zbh1` (a fixture made by upstream's code), and for
`interleaved` the runtime's schedule built on torch.distributed.pipelining's order; ZB-H1's order is
torch's too. The facts read off the stream (activations in flight, weight passes pending, forward
order) match what the schedules document; importing the registry loads neither torch nor DeepSpeed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ds.config.parallel import PIPELINE_SCHEDULES
from megatron_ds.estimate import pipeline_schedules as schedules
from megatron_ds.training import pipe_schedules

SIZES = [(m, p) for p in (1, 2, 3, 4, 5, 8) for m in (1, 2, 3, 4, 7, 8, 16)]
FIXTURE = Path(__file__).parent / "fixtures" / "zbh1" / "megatron_deepspeed_streams.json"


def cases(name: str) -> list[tuple[int, int, int]]:
    """(M, P, v) the schedule runs."""
    vs = (2, 3) if schedules.find(name).virtual else (1,)
    return [(m, p, v) for m, p in SIZES for v in vs if schedules.find(name, v).check(m, p) is None]


@pytest.mark.parametrize("name", PIPELINE_SCHEDULES)
def test_the_stream_is_the_engines(name: str) -> None:
    for m, p, v in cases(name):
        entry = schedules.find(name, v)
        for s in range(p):
            steps = entry.steps(m, p, s)
            ours = [[(i.kind, i.buffer, i.chunk) for i in step] for step in steps]
            assert ours == pipe_schedules.engine_stream(name, m, p, s, v), (name, m, p, v, s)
            sched = pipe_schedules.build(name, m, p, s, v)
            slots = sched.num_pipe_buffers()
            assert schedules.pipe_buffers(entry, m, p, s) == slots
            for i in (i for step in steps for i in step if i.buffer is not None):
                assert i.micro_batch is not None and 0 <= i.buffer < slots
                assert i.buffer == (i.chunk * m + i.micro_batch if entry.virtual else i.micro_batch % slots)


def test_zbh1_is_megatron_deepspeeds_exact_semantics() -> None:
    """Upstream's `ZeroBubbleH1Pipeline` with `--enable-zbh1-exact-semantics`, step for step
    (fixtures/zbh1/README.md: how the fixture was made)."""
    upstream = json.loads(FIXTURE.read_text())
    assert len(upstream) == 90
    for key, steps in upstream.items():
        m, p, s = map(int, key.split(","))
        ours = [[[i.kind, i.buffer] for i in step] for step in schedules.find("zbh1").steps(m, p, s)]
        assert ours == steps, key


def _expand_whole_backwards(order: tuple) -> list[tuple[str, int, int]]:
    """torch writes a backward that nothing separates from its weight pass as I then W."""
    out = []
    for letter, stage, j in order:
        out += [("I", stage, j), ("W", stage, j)] if letter == "B" else [(letter, stage, j)]
    return out


@pytest.mark.parametrize("m,p", [(m, p) for m, p in SIZES if m >= p - 1])
def test_zbh1_computes_in_torchs_zero_bubble_order(m: int, p: int) -> None:
    """torch's ScheduleInterleavedZeroBubble with one stage per rank; with fewer micro-batches than
    P - 1 upstream (and we) run the drain's weight passes at once, where torch defers s of them."""
    for s in range(p):
        ours = _expand_whole_backwards(schedules.compute_order(schedules.find("zbh1"), m, p, s))
        theirs = [(k, chunk * p + s, j) for k, chunk, j in pipe_schedules.torch_order("zbh1", m, p, s)]
        assert ours == theirs, (m, p, s)


def test_interleaved_computes_in_torchs_interleaved_1f1b_order() -> None:
    for m, p, v in cases("interleaved"):
        for r in range(p):
            ours = schedules.compute_order(schedules.find("interleaved", v), m, p, r)
            theirs = [(k, chunk * p + r, j) for k, chunk, j in pipe_schedules.torch_order("interleaved", m, p, r, v)]
            assert list(ours) == theirs, (m, p, v, r)


@pytest.mark.parametrize("m,p", SIZES)
def test_1f1b_in_flight_is_min_of_remaining_stages_and_micro_batches(m: int, p: int) -> None:
    entry = schedules.find("1f1b")
    for s in range(p):
        first, later = schedules.activations_in_flight(entry, m, p, s)
        assert first == min(p - s, m)
        # a forward follows every later backward in the steady state (M > P - s), else one fewer
        assert later == (first if m > p - s else first - 1)
        assert schedules.forward_micro_batches(entry, m, p, s) == tuple(range(m))
        # each clock step's forward or backward runs the micro-batch DeepSpeed's clock maps it to
        sched = pipe_schedules.engine_schedule("1f1b")(micro_batches=m, stages=p, stage_id=s)
        for step, cmds in enumerate(entry.steps(m, p, s)):
            for i in cmds:
                if i.kind in (schedules.FORWARD, schedules.BACKWARD):
                    want = sched._step_to_micro_batch(step)
                    assert (i.micro_batch, i.kind == schedules.FORWARD) == want


@pytest.mark.parametrize("m,p", SIZES)
def test_zbh1_holds_1f1bs_activations_and_at_most_s_weight_passes(m: int, p: int) -> None:
    """ZB-H1 keeps 1F1B's activations in flight; stage s has at most s backwards whose weight
    gradients wait (stage 0 none), and every forward order is the micro-batch order."""
    zb, one = schedules.find("zbh1"), schedules.find("1f1b")
    for s in range(p):
        assert schedules.activations_in_flight(zb, m, p, s)[0] == schedules.activations_in_flight(one, m, p, s)[0]
        pending = [w for _, w, _ in schedules.backward_moments(zb, m, p, s)]
        assert max(pending) <= min(s, m - 1) and (s > 0 or max(pending) == 0)
        assert schedules.forward_micro_batches(zb, m, p, s) == tuple(range(m))
        kinds = [i.kind for i in zb.instructions(m, p, s)]
        assert kinds.count(schedules.WEIGHT) == (0 if s == 0 else m)


def test_interleaved_chunks_each_run_every_micro_batch_in_order() -> None:
    for m, p, v in cases("interleaved"):
        entry = schedules.find("interleaved", v)
        for r in range(p):
            stream = entry.instructions(m, p, r)
            for c in range(v):
                fwd = [i.micro_batch for i in stream if i.kind == schedules.FORWARD and i.chunk == c]
                bwd = [i.micro_batch for i in stream if i.kind == schedules.BACKWARD and i.chunk == c]
                assert fwd == bwd == list(range(m)), (m, p, v, r, c)
            flight = max(sum(f) for f, _, _ in schedules.backward_moments(entry, m, p, r))
            assert flight <= v * m


def test_schedules_refuse_what_they_cannot_run() -> None:
    assert schedules.find("interleaved", 2).check(4, 1) is not None  # one rank
    assert schedules.find("interleaved", 2).check(9, 4) is not None  # M = 9 not a multiple of max(1, 9 // 4)
    assert schedules.find("interleaved", 2).check(8, 4) is None
    with pytest.raises(AssertionError):
        schedules.find("zbh1", 2)


def test_the_registry_and_the_config_agree() -> None:
    assert tuple(schedules.REGISTRY) == PIPELINE_SCHEDULES == tuple(pipe_schedules.ENGINE_SCHEDULES)


def test_importing_the_registry_and_the_simulator_loads_no_torch_or_deepspeed() -> None:
    code = (
        "import sys; import megatron_ds.estimate.pipeline_schedules, megatron_ds.estimate.step_simulator as s; "
        "s.simulate(8, [1.0] * 4, [2.0] * 4); s.simulate(8, [1.0] * 4, [2.0] * 4, schedule='zbh1', weight=1.0); "
        "s.simulate(8, [1.0] * 8, [2.0] * 8, schedule='interleaved', virtual_stages=2); "
        "bad = [m for m in ('torch', 'deepspeed') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_steady_schedules_moments_beyond_2p_plus_2_are_those_of_the_whole_stream() -> None:
    """The memory model reads a steady schedule at M = 2P + 2 in place of a larger M (the planner's speed):
    the distinct backward moments must be exactly those of the whole stream, in the same order."""
    for entry in (e for e in schedules.REGISTRY.values() if e.steady):
        sizes = [(m, p) for p in range(1, 13) for m in range(1, 4 * p + 8)]
        sizes += [(280, 35), (96, 40), (3 * 64 + 1, 64)]
        for m, p in sizes:
            for s in sorted({0, 1, p // 2, p - 2, p - 1} & set(range(p))):
                got = schedules.distinct_moments(entry, m, p, s)
                assert got == schedules.stream_moments(entry, m, p, s), (entry.name, m, p, s)


def test_interleaved_moments_beyond_3p_are_those_of_the_whole_stream() -> None:
    """Interleaving (`steady_rounds`) is read at M = 3P in place of a larger multiple of P: the same distinct
    moments, in the same order, for every v; other M are read whole."""
    entries = [e for e in schedules.REGISTRY.values() if e.steady_rounds]
    assert entries
    for entry, v in ((e, v) for e in entries for v in (2, 3, 4, 5)):
        chunked = schedules.find(entry.name, v)
        sizes = [(k * p, p) for p in range(2, 11) for k in range(1, 9)] + [(6 * 16, 16), (5 * 32, 32), (15, 4)]
        for m, p in sizes:
            if chunked.check(m, p) is not None:
                continue
            for s in sorted({0, 1, p // 2, p - 2, p - 1}):
                got = schedules.distinct_moments(chunked, m, p, s)
                assert got == schedules.stream_moments(chunked, m, p, s), (v, m, p, s)
