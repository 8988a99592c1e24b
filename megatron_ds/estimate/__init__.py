"""Estimates from the config, a layout and the device's facts alone: pure arithmetic, no torch, no
DeepSpeed (tests/unit/test_import_layers.py enforces it). What measures lives in the runtime layer
(`megatron_ds.training.machine`, `megatron_ds.training.measure`) and hands its numbers down.

    memory_inputs.py, spec_memory.py, memory_model.py, memory_moments.py, model_states.py,
    activation_memory.py, attention_activations.py, activation_kernels.py, transients.py
                            predicted memory per spec and stage (inputs, results, the terms)
    compute.py              FLOPs per spec and stage
    stage_contents.py       what a stage holds and recomputes (read by the FLOPs, time and memory models)
    pipeline_schedules.py   the pipeline-schedule registry: each stage's instruction stream
    step_simulator.py       a step's time replayed over those streams
    measured_time.py        stage times from measured per-group times (`profile`)
    layout_costs.py, run_layout.py, remedies.py, fit_advice.py
                            the costs a partition method needs; the layout a config asks for; the
                            changes that may make it fit, and what would
    machine.py, devices.py  the device facts handed down; the GPU table (memory, compute
                            capability, peak FLOP/s) of common GPUs

Used by the layout methods that balance memory or time, by `--print-layout`'s predictions, and by
the planner (`megatron_ds.plan`). Import the modules themselves; this file imports nothing.
"""
