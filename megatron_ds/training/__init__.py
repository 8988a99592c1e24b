"""The runtime: the engine builder, the training loop, checkpoints, measurements of a live run.

    builder           `build_pipeline`: every invariant in one call (docs/training.md)
    loop              `pretrain`: the loop's named steps
    checkpoint/       atomic save, validated load, the layout-free (universal) form
    measure/          measured per-stage memory and compute of a live run

The flat modules beside them are the pieces the builder and the loop assemble (the device probe
and the layout resolved on it, optimizer groups, the counted gradient-norm clip, preflight and
watchdog, the DeepSpeed JSON and the engine's pipeline schedules, the learning-rate schedule, the
log line, run state, the pre-launch file checks). docs/architecture.md places each.
"""
