"""The layout-free ("universal") form of the whole training state, and the conversions to and from it.

A checkpoint saved under one P, layout, T, DP size, ZeRO stage or precision resumes under any
other: `--load` converts it once (`convert.ensure_converted`) and every rank takes its own part
(`restore`). Modules:

    names             layout-free tensor names; a stage's parameters in DeepSpeed's order
    deepspeed_source  reads a DeepSpeed checkpoint tensor by tensor (ZeRO-0 torch state, ZeRO-1
                      and bf16 flat partitions, tensor-parallel shards joined)
    zero3_source      ZeRO-3's partitions; `open_source`, which reader a checkpoint gets
    moe_source        a mixture-of-experts checkpoint (DeepSpeed's MoE files, P = 1)
    moe_pipeline_source  the same saved at P > 1: each stage's own files
    state_files       the restricted loader of DeepSpeed's state files, each tensor read from disk
    store             the universal directory: write, validate, read
    convert           atomic conversion with progress and summary; the collective one on `--load`
    restore           into a live engine: weights, fp32 masters, optimizer states, counters, schedule

Why not DeepSpeed's own universal checkpoint (`deepspeed/checkpoint/ds_to_universal.py` and
`load_universal`)? It reads ZeRO-1/2 and bf16 optimizer files only (ZeRO-0's plain torch
optimizer state is keyed by position, not name), it joins tensor-parallel shards from patterns
Megatron-DeepSpeed stores in the checkpoint, which ours do not carry (our fused QKV and fc1
shards need `megatron_ds.model.sharding`), and its loader expects every rank's parameters by
name in one directory tree with DeepSpeed's engine driving the load. We use its facts and its
fragment machinery (`param_slice_mappings` to read, `_hp_mapping` to write) and replace the rest.
See docs/checkpoints.md.
"""
