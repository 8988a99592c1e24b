"""Checkpoints: written atomically, validated before loading, resumed under any parallel layout.

    save_load   save and load through DeepSpeed's engine (the `--save`/`--load` side of a run)
    directory   the checkpoint directory's names (`latest`, `megatron_ds.json`), its metadata, `CheckpointError`
    rules       what may change between save and load (free: the whole parallel layout), and what may not
    reader      our stored tensors as full (T=1) tensors, one at a time (export, inference, tools)
    universal/  the layout-free form and the conversions to and from it

See docs/checkpoints.md.
"""
