"""Megatron-LM's flags of the groups "data and tokenizer", "checkpointing" and "logging" that
Megatron-DeepSpeed lacks, spliced into those groups by `megatron_ds.flags.registry` (its other flags,
and `GROUPS`, every table of them: `megatron_ds.flags.megatron_lm`). Each means what it means in
Megatron-LM or changes nothing here (the help says why).
"""

from __future__ import annotations

from megatron_ds.config import PROFILER_MODES
from megatron_ds.flags.declare import MEGATRON_LM, VALUE, Flag, accepted, no_op, switch

_DATA, _CKPT, _LOG = "data and tokenizer", "checkpointing", "logging"
"""How every Megatron-LM flag's help starts (here and in `megatron_lm`)."""

DATA: tuple[Flag, ...] = (
    switch(
        "--no-mmap-bin-files",
        _DATA,
        f"{MEGATRON_LM}: read the .bin token files with file reads instead of a memory map (megatron-core's "
        "mmap_bin_files); the same tokens",
        "data.mmap_bin_files",
        stores=False,
        dest="mmap_bin_files",
        default=True,
    ),
    no_op(
        "--no-create-attention-mask-in-dataloader",
        _DATA,
        f"{MEGATRON_LM}: the loader never builds an attention mask here (attention is causal inside the model; "
        "--reset-attention-mask's mask is built in each layer from document ids); refused with "
        "--reset-attention-mask, which Megatron-LM then ignores",
    ),
    accepted(
        "--null-tokenizer-eod-id",
        _DATA,
        f"{MEGATRON_LM}: the NullTokenizer's end-of-document id (its last id, --vocab-size - 1, when not given)",
        "data.null_tokenizer_eod_id",
        type=int,
    ),
    accepted(
        "--null-tokenizer-pad-id",
        _DATA,
        f"{MEGATRON_LM}: the NullTokenizer's padding id, masked out of the loss (-1: none)",
        "data.null_tokenizer_pad_id",
        type=int,
        default=-1,
    ),
    accepted(
        "--data-args-path",
        _DATA,
        f"{MEGATRON_LM}: a file holding --data-path's value (a prefix or a weighted blend, whitespace-separated), for "
        "blends too long for a command line; instead of --data-path",
        fields=("data.data_path",),
        derived=True,
    ),
    accepted(
        "--per-split-data-args-path",
        _DATA,
        f'{MEGATRON_LM}: a JSON file {{"train": ..., "valid": ..., "test": ...}} holding each split\'s --train-data-path, '
        "--valid-data-path and --test-data-path value (a string or a list; null: no such split); instead of them",
        fields=("data.train_data_path", "data.valid_data_path", "data.test_data_path"),
        derived=True,
    ),
    no_op(
        "--tiktoken-pattern",
        _DATA,
        f"{MEGATRON_LM}: the split pattern of its TikTokenizer, which is not provided; other tokenizers ignore it there too",
        takes=VALUE,
    ),
)

CHECKPOINTING: tuple[Flag, ...] = (
    accepted(
        "--ckpt-format",
        _CKPT,
        f"{MEGATRON_LM}: accepted, and a NOTICE says that checkpoints are DeepSpeed's here (docs/checkpoints.md); like "
        "torch_dist they resume under any P, T, DP and layout; Megatron-LM's own torch_dist and torch checkpoints "
        "convert with tools/convert_checkpoint.py --from megatron-lm",
        choices=("torch", "torch_dist", "torch_dcp", "fsdp_dtensor", "zarr"),
    ),
    accepted(
        "--save-retain-interval",
        _CKPT,
        f"{MEGATRON_LM}: after each save the checkpoint saved before it is deleted, unless its iteration is a multiple of "
        "this (a multiple of --save-interval) or it is a symbolic link; deleted only once the new checkpoint is "
        "complete and `latest` names it",
        "checkpoint.save_retain_interval",
        type=int,
    ),
    switch(
        "--no-use-tokenizer-model-from-checkpoint-args",
        _CKPT,
        f"{MEGATRON_LM}: with --use-checkpoint-args, take the architecture but not the tokenizer from the checkpoint (the "
        "tokenizer flags of the line, or none, hold)",
        stores=False,
        dest="use_tokenizer_model_from_checkpoint_args",
        default=True,
    ),
    no_op(
        "--async-save",
        _CKPT,
        f"{MEGATRON_LM}: writes torch_dist checkpoints in the background; here every rank writes its files and the "
        "directory is renamed into place before training goes on (atomic, docs/checkpoints.md)",
    ),
    no_op(
        "--ckpt-fully-parallel-save",
        _CKPT,
        f"{MEGATRON_LM} (deprecated there): spreads torch_dist's writing over data-parallel ranks; DeepSpeed's format "
        "is written here",
    ),
    no_op(
        "--ckpt-fully-parallel-load",
        _CKPT,
        f"{MEGATRON_LM}: spreads torch_dist's reading over data-parallel ranks; DeepSpeed's format is read here",
    ),
    no_op("--no-ckpt-fully-parallel-save", _CKPT, f"{MEGATRON_LM}: as --ckpt-fully-parallel-save"),
    no_op(
        "--dist-ckpt-strictness",
        _CKPT,
        f"{MEGATRON_LM}: how torch_dist loading treats missing or unexpected keys; DeepSpeed's checkpoints are loaded "
        "here, and another architecture is a one-line error at --load",
        takes=VALUE,
    ),
    no_op(
        "--dist-ckpt-optim-fully-reshardable",
        _CKPT,
        f"{MEGATRON_LM}: torch_dist's optimizer layout that reshards to any parallelism; every checkpoint here resumes "
        "under any P, T, DP and layout (docs/checkpoints.md)",
    ),
    no_op(
        "--use-persistent-ckpt-worker", _CKPT, f"{MEGATRON_LM}: a persistent process for --async-save; as --async-save"
    ),
    no_op("--ckpt-assume-constant-structure", _CKPT, f"{MEGATRON_LM}: a torch_dist save shortcut; as --ckpt-format"),
    no_op(
        "--auto-detect-ckpt-format",
        _CKPT,
        f"{MEGATRON_LM}: one format is read here (DeepSpeed's, ours); a Megatron-DeepSpeed or Megatron-LM checkpoint at "
        "--load is named with the command that converts it",
    ),
)

LOGGING: tuple[Flag, ...] = (
    accepted(
        "--wandb-entity",
        _LOG,
        f"{MEGATRON_LM}: the wandb team or user that owns --wandb-project; ignored, with a warning, without it",
        "logging.wandb_entity",
    ),
    switch(
        "--log-progress",
        _LOG,
        f"{MEGATRON_LM}: append each job start and saved checkpoint, with the job's and the cumulative TFLOP/s per GPU, "
        "the FLOPs and tokens so far, to <--save>/progress.txt in Megatron-LM's format; ignored, with a warning, "
        "without --save",
        "logging.log_progress",
    ),
    no_op(
        "--log-throughput",
        _LOG,
        f"{MEGATRON_LM}: the TFLOP/s per GPU in the log line; every line here shows it already",
    ),
    accepted(
        "--profile",
        _LOG,
        "bare, Megatron-LM's: profile training steps --profile-step-start+1 .. --profile-step-end with torch's "
        "profiler (a Chrome trace per rank in <--tensorboard-dir>/../torch_profile, else ./torch_profile); on CUDA the "
        "range is also marked for nsys (cudaProfilerStart/Stop) as Megatron-LM does without --use-pytorch-profiler. "
        "`pt` or `pt-full`, Megatron-DeepSpeed's: profile this process's steps --profile_steps S..E with torch's "
        "profiler, a gzipped Chrome trace per rank in --tensorboard-dir named as torch's tensorboard_trace_handler "
        "names it (`<host>_<pid>.<ns>.pt.trace.json.gz`); pt-full adds each op's Python stack",
        fields=("logging.profile", "logging.profile_pt"),
        nargs="?",  # Megatron-LM's is a switch, Megatron-DeepSpeed's takes a value: flags.profiler_flags tells them
        choices=PROFILER_MODES,
        derived=True,
    ),
    accepted(
        "--profile-step-start",
        _LOG,
        f"{MEGATRON_LM}: iterations done when profiling starts",
        "logging.profile_step_start",
        type=int,
    ),
    accepted(
        "--profile-step-end",
        _LOG,
        f"{MEGATRON_LM}: iterations done when profiling stops",
        "logging.profile_step_end",
        type=int,
    ),
    switch(
        "--use-pytorch-profiler",
        _LOG,
        f"{MEGATRON_LM}: the torch profiler's trace only (no nsys range)",
        "logging.use_pytorch_profiler",
    ),
)
