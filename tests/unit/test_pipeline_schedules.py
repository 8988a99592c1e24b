"""The schedule registry (`estimate/pipeline_schedules.py`) is the stream the engine runs.

Every registered schedule's instructions equal the runtime schedule's (DeepSpeed's own generator
for `1f1b`), instruction for instruction with buffers and micro-batches, for many sizes; the facts
read off the stream (activations in flight, forward order, idle share) match what the engine's
schedule documents; importing the registry loads neither torch nor DeepSpeed.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_ds.config.parallel import PIPELINE_SCHEDULES
from megatron_ds.estimate import pipeline_schedules as schedules
from megatron_ds.training import pipe_schedules

SIZES = [(m, p) for p in (1, 2, 3, 4, 5, 8) for m in (1, 2, 3, 4, 7, 8, 16)]


@pytest.mark.parametrize("name", PIPELINE_SCHEDULES)
@pytest.mark.parametrize("m,p", SIZES)
def test_the_stream_is_the_engines(name: str, m: int, p: int) -> None:
    entry = schedules.find(name)
    for s in range(p):
        steps = entry.steps(m, p, s)
        ours = [[(i.kind, i.buffer) for i in step] for step in steps]
        assert ours == pipe_schedules.engine_stream(name, m, p, s), (name, m, p, s)
        sched = pipe_schedules.engine_schedule(name)(micro_batches=m, stages=p, stage_id=s)
        assert schedules.pipe_buffers(entry, m, p, s) == sched.num_pipe_buffers()
        for i in (i for step in steps for i in step if i.buffer is not None):
            assert i.micro_batch is not None and i.micro_batch % sched.num_pipe_buffers() == i.buffer


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
                if i.kind in schedules.COMPUTE:
                    want = sched._step_to_micro_batch(step)
                    assert (i.micro_batch, i.kind == schedules.FORWARD) == want
    assert schedules.idle_fraction(entry, m, p) == pytest.approx((p - 1) / (m + p - 1))


def test_the_registry_and_the_config_agree() -> None:
    assert tuple(schedules.REGISTRY) == PIPELINE_SCHEDULES == tuple(pipe_schedules.ENGINE_SCHEDULES)


def test_importing_the_registry_and_the_simulator_loads_no_torch_or_deepspeed() -> None:
    code = (
        "import sys; import megatron_ds.estimate.pipeline_schedules, megatron_ds.estimate.step_simulator as s; "
        "s.simulate(8, [1.0] * 4, [2.0] * 4); "
        "bad = [m for m in ('torch', 'deepspeed') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
