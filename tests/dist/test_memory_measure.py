"""The measured memory report (`megatron_ds/training/measure/memory.py`, `allocation_trace.py`) against exact counts.

* The allocation trace, in one process, on blocks of known sizes: the peak, what was held at the
  window's start and end, a leftover of the warm-up step freed inside the window, and a block
  whose last reference another thread drops (as gloo's worker threads do).
* A 2-stage pipeline on 2 gloo ranks, fp32 without ZeRO and with ZeRO-1: the reported
  parameter, gradient and optimizer bytes equal an exact count of the tensors DeepSpeed and torch
  hold, and the measured peak is at least the model states plus the saved activations.

Run as a script, this file is the per-rank worker of the second test.
"""
from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from megatron_ds.training.measure.allocation_trace import CpuAllocationTrace

MIB = 1 << 20


def floats(mib: float) -> torch.Tensor:
    return torch.empty(int(mib * MIB) // 4)


def storages(*tensors: torch.Tensor) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def test_trace_peak_start_and_end_are_exact_byte_counts() -> None:
    old = floats(1)  # allocated before the trace: its bytes come from the scan
    trace = CpuAllocationTrace()
    trace.start()
    leftover = floats(2)  # the warm-up step's leftover, freed inside the window
    at_start = storages(old, leftover)
    with trace.window():
        a = floats(4)  # 7 MiB held
        del leftover  # 5
        b = floats(1)  # 6
        del a  # 2
        c = floats(0.5)  # 2.5
    trace.stop(at_start, storages(old, b, c))
    assert (trace.held_at_start, trace.peak, trace.held_at_end) == (3 * MIB, 7 * MIB, 5 * MIB // 2)
    assert trace.inferred_frees == 0 and trace.unseen_frees == 0


def test_a_block_freed_on_another_thread_is_freed_after_its_last_read() -> None:
    trace = CpuAllocationTrace()
    trace.start()
    holder: list[torch.Tensor] = []
    with trace.window():
        d = floats(2)
        d.fill_(1.0)  # its last read
        holder.append(d)
        del d
        # The other thread drops the last reference: the profiler sees no free.
        worker = threading.Thread(target=holder.clear)
        worker.start()
        worker.join()
        e = floats(3)
    trace.stop({}, storages(e))
    assert trace.inferred_frees == 1
    assert trace.peak == 3 * MIB and trace.held_at_end == 3 * MIB  # not 5: d was gone before e


# --- the pipeline -----------------------------------------------------------------------------------

def exact_counts(engine: Any, zero_stage: int, grads_at_step: int) -> dict[str, int]:
    """What torch and DeepSpeed hold, counted from their own fields (4 bytes per fp32 element)."""
    params = list(engine.module.parameters())
    basic = engine.basic_optimizer if zero_stage else engine.optimizer
    # AdamW's exp_avg and exp_avg_sq, and its float32 step counter, per stepped tensor.
    moments = sum(4 * (s["exp_avg"].numel() + s["exp_avg_sq"].numel()) + 4 for s in basic.state.values())
    if zero_stage == 0:
        n = 4 * sum(p.numel() for p in params)
        return {"params": n, "grads": n, "optimizer": moments}
    zero = engine.optimizer
    master = 4 * sum(m.numel() for m in zero.single_partition_of_fp32_groups)
    return {"params": 4 * sum(f.numel() for f in zero.bit16_groups_flat),  # the parameters are views of these
            "grads": grads_at_step,
            "optimizer": master + moments + 4}  # + ZeRO's _global_grad_norm, a float32 scalar


def zero1_gradient_probe(engine: Any) -> list[int]:
    """Gradient bytes DeepSpeed's ZeRO-1 holds at each group's optimizer step (it steps one group at
    a time): parameters' .grad, the averaged gradients (views of one flat buffer) and the flat
    fp32 gradient of the partition being stepped."""
    zero, seen = engine.optimizer, []

    def count(*_: Any) -> None:
        storages = {}
        tensors = [p.grad for p in engine.module.parameters()] + [m.grad for m in zero.single_partition_of_fp32_groups]
        tensors += [g for group in zero.averaged_gradients.values() if group for g in group]
        for t in tensors:
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        seen.append(sum(storages.values()))

    engine.basic_optimizer.register_step_pre_hook(count)
    return seen


def worker(out_dir: str) -> None:
    import torch.distributed as dist

    from megatron_ds.distributed import init_distributed, shutdown_distributed
    from megatron_ds.model.naming import gpt_spec_groups
    from megatron_ds.pipeline.layout import build_layout
    from megatron_ds.testing.scenario import micro_batches, tiny_config
    from megatron_ds.training.measure import memory
    from megatron_ds.training.builder import build_pipeline

    results = []
    for zero in (0, 1):
        cfg = tiny_config(parallel__pipeline_model_parallel_size=2, training__zero_stage=zero)
        init_distributed(cfg.parallel)
        engine = build_pipeline(cfg, layout=build_layout(gpt_spec_groups(cfg.model), 2)).engine
        meter = memory.StepMeter(engine)
        for step in range(2):  # a warm-up step (traced), then the measured one
            zero1_grads = zero1_gradient_probe(engine) if zero and step == 1 else []
            with memory.step_context(meter, step + 1, 2):
                engine.train_batch(data_iter=iter(list(micro_batches(cfg, step, 0))))
        got = meter.result(dist.get_rank(), engine.stage_id)
        results.append({"zero": zero, "measured": {k: getattr(got, k) for k in
                                                   ("params", "grads", "optimizer", "activations", "peak",
                                                    "unseen_frees", "held_at_start", "held_at_end")},
                        "exact": exact_counts(engine, zero, max(zero1_grads, default=0))})
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    shutdown_distributed()


def test_reported_model_states_equal_exact_counts(tmp_path: Path) -> None:
    from megatron_ds.testing.launch import run_ranks

    run_ranks([__file__, str(tmp_path)], 2, timeout=180)
    for rank in range(2):
        for res in json.loads((tmp_path / f"rank{rank}.json").read_text()):
            got, exact = res["measured"], res["exact"]
            what = f"rank {rank}, ZeRO-{res['zero']}"
            assert {k: got[k] for k in exact} == exact, what
            assert got["activations"] > 0, what
            assert 0 <= got["unseen_frees"] <= 64, what  # a few scalars of the previous step, at most
            assert got["peak"] >= got["params"] + got["grads"] + got["optimizer"], what
            assert got["peak"] >= got["params"] + got["optimizer"] + got["activations"], what
            assert got["held_at_start"] >= got["params"] + got["optimizer"], what


if __name__ == "__main__":
    from megatron_ds.distributed import run_and_exit

    run_and_exit(worker, sys.argv[1])
