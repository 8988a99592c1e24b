"""Flags of Megatron's groups "distributed" and "DeepSpeed, ZeRO, recompute", Megatron-LM's pipeline-layout
flags (megatron-core's meaning: `megatron_ds.pipeline.megatron_lm`), and our pipeline-layout flags."""

from __future__ import annotations

from megatron_ds.config import BACKENDS, DEDICATED_CHOICES
from megatron_ds.estimate import pipeline_schedules
from megatron_ds.flags.checkpointing_flags import FLAGS as CHECKPOINTING_FLAGS
from megatron_ds.flags.declare import MEGATRON_LM, VALUE, Flag, Refusal, accepted, no_op, refused, switch
from megatron_ds.pipeline.methods import partition_method_help

_DIST, _DS = "distributed", "DeepSpeed, ZeRO, recompute"
_DS_DP = "DeepSpeed's engine does the data-parallel gradient reduction; Megatron's DDP options do not apply"
_ZERO_JSON = "ZeRO tuning lives in the DeepSpeed JSON; set the matching zero_optimization key in --deepspeed_config"
_ZERO3 = "zero.Init's initial device; parameter offload is DeepSpeed's offload_param"
_ZERO3_FIX = "use --offload-param cpu|nvme (with --zero-stage 3), which sets offload_param and partitions there"
_TILING = "memory-centric tiling is not implemented"
_BACKEND_FIX = ("only nccl and gloo are set up", "use nccl (GPU) or gloo (CPU)")
_MLM = f"{MEGATRON_LM}, megatron-core's meaning"
_OFFLOAD = ("none", "cpu", "nvme")

DISTRIBUTED: tuple[Flag, ...] = (
    accepted(
        "--tensor-model-parallel-size",
        _DIST,
        "tensor-parallel ranks T (megatron-core layers)",
        "parallel.tensor_model_parallel_size",
        type=int,
    ),
    accepted(
        "--pipeline-model-parallel-size",
        _DIST,
        "pipeline stages P",
        "parallel.pipeline_model_parallel_size",
        type=int,
    ),
    switch(
        "--standalone-embedding-stage",
        _DIST,
        "the input embedding on a stage of its own: our --pp-dedicated-embedding-stages pre (both with post)",
        "parallel.pp_dedicated_embedding_stages",
        derived=True,
    ),
    accepted(
        "--pp-dedicated-embedding-stages",
        _DIST,
        "reserve the first (pre), last (post) or both stages for the embedding / LM head groups; the bare flag "
        "means both",
        "parallel.pp_dedicated_embedding_stages",
        nargs="?",
        const="both",
        default="none",
        choices=DEDICATED_CHOICES,
        derived=True,  # --standalone-embedding-stage folds in
        megatron=False,
    ),
    accepted(
        "--pp-layout",
        _DIST,
        "explicit layout in Megatron-LM's grammar, e.g. 'E|t*3|t*3|L' (E embedding, t layer, L loss head, | stage "
        "boundary, x*N and (...)*N repeat), or auto: the memory-balanced layout (as --pp-partition-method memory)",
        "parallel.pp_layout",
        megatron=False,
    ),
    accepted(
        "--pp-partition-method",
        _DIST,
        partition_method_help(),  # drawn from the partition-method registry
        "parallel.pp_partition_method",
        megatron=False,
    ),
    accepted(
        "--pp-schedule",
        _DIST,
        "the pipeline schedule (default 1f1b; --enable-zbh1-pipeline and virtual stages select theirs): "
        + "; ".join(f"{s.name}: {s.summary}" for s in pipeline_schedules.REGISTRY.values()),
        "parallel.pipeline_schedule",
        choices=tuple(pipeline_schedules.REGISTRY),
        default=None,
        derived=True,  # --enable-zbh1-pipeline and the virtual-stage flags fold in (flags/schedule_flags.py)
        megatron=False,
    ),
    accepted(
        "--pipeline-model-parallel-layout",
        _DIST,
        f"{_MLM}: a layout string (the --pp-layout grammar, commas cosmetic); k x P stages are megatron-core's k "
        "virtual stages per rank (the interleaved schedule, flat stage i on rank i mod P); an empty stage and 'm' "
        "(multi-token prediction) are refused",
        "parallel.pipeline_model_parallel_layout",
    ),
    accepted(
        "--decoder-first-pipeline-num-layers",
        _DIST,
        f"{_MLM}: transformer layers on the first stage; the rest split evenly over the stages in between "
        "(first + last above --num-layers, which megatron-core turns into negative stages, is refused)",
        "parallel.decoder_first_pipeline_num_layers",
        type=int,
    ),
    accepted(
        "--decoder-last-pipeline-num-layers",
        _DIST,
        f"{_MLM}: transformer layers on the last stage",
        "parallel.decoder_last_pipeline_num_layers",
        type=int,
    ),
    switch(
        "--account-for-embedding-in-pipeline-split",
        _DIST,
        f"{_MLM}: the embedding counts as one layer when the layers are split evenly over the stages",
        "parallel.account_for_embedding_in_pipeline_split",
    ),
    switch(
        "--account-for-loss-in-pipeline-split",
        _DIST,
        f"{_MLM}: the loss head counts as one layer when the layers are split evenly over the stages",
        "parallel.account_for_loss_in_pipeline_split",
    ),
    accepted(
        "--num-virtual-stages-per-pipeline-rank",
        _DIST,
        f"{_MLM}: V model chunks per rank, run by the interleaved schedule (--pp-schedule interleaved: torch's "
        "interleaved 1F1B order on DeepSpeed's engine); 1 is one stage per rank",
        "parallel.virtual_stages",
        type=int,
        derived=True,
    ),
    accepted(
        "--pp-memory-limit",
        _DIST,
        "bytes per device for --pp-partition-method fastest/profile, e.g. 80GiB or 500MB (default: the GPU's "
        "memory; required on CPU)",
        "parallel.pp_memory_limit",
        megatron=False,
    ),
    accepted(
        "--pp-device",
        _DIST,
        "the GPU the layout and its predicted memory are for, by the planner's name (H100, A100-80GB, ...: "
        "estimate/devices.py) or cpu; its memory is the default --pp-memory-limit. Default: this machine's device. "
        "Where the run executes does not change",
        "parallel.pp_device",
        megatron=False,
    ),
    switch(
        "--print-layout",
        _DIST,
        "a dry run on any machine: run every check a launch runs (flags, data, --load, --save, the merged DeepSpeed "
        "JSON, optional packages), print the stage layout and exit without starting any process group",
        megatron=False,
    ),
    accepted(
        "--world-size",
        _DIST,
        "total ranks for --print-layout/validation (default: WORLD_SIZE or P x T)",
        "parallel.world_size",
        type=int,
        default=None,
        derived=True,  # else the launcher's WORLD_SIZE
        megatron=False,
    ),
    accepted(
        "--distributed-backend",
        _DIST,
        "`nccl` or `gloo`; gloo by default on CPU",
        "parallel.distributed_backend",
        choices=BACKENDS,
        refused_values=(Refusal("ccl", *_BACKEND_FIX), Refusal("hccl", *_BACKEND_FIX)),
    ),
    accepted(
        "--distributed-timeout-minutes",
        _DIST,
        "process-group timeout, and our stall watchdog",
        "parallel.distributed_timeout_minutes",
        type=float,
    ),
    accepted(
        "--local_rank",
        _DIST,
        "set by the deepspeed launcher; the environment is used",
        type=int,
        aliases=("--local-rank",),
        hidden=True,
    ),
    no_op("--DDP-impl", _DIST, _DS_DP, takes=VALUE),
    no_op("--use-contiguous-buffers-in-local-ddp", _DIST, _DS_DP),
    no_op("--no-contiguous-buffers-in-local-ddp", _DIST, _DS_DP),
    no_op(
        "--overlap-p2p-communication",
        _DIST,
        "overlaps pipeline sends and receives with compute under the interleaved schedule; the interleaved engine "
        "here posts its sends (docs/training.md), the values are the same",
    ),
    no_op("--no-scatter-gather-tensors-in-pipeline", _DIST, "DeepSpeed's pipeline sends whole activations"),
    no_op("--use-cpu-initialization", _DIST, "weights are always drawn on CPU from per-spec generators"),
    no_op("--empty-unused-memory-level", _DIST, "a CUDA cache housekeeping switch; numerics unchanged", takes=VALUE),
    refused("--pipeline-model-parallel-split-rank", _DIST, "encoder-decoder models are not built", takes=VALUE),
    refused("--model-parallel-size", _DIST, "Megatron's deprecated name", "use --tensor-model-parallel-size", VALUE),
    accepted(
        "--num-layers-per-virtual-pipeline-stage",
        _DIST,
        "N transformer layers per model chunk: (layers / P) / N chunks per rank, run by the interleaved schedule "
        "(Megatron-LM's rule, with --account-for-* counting the embedding and loss as layers)",
        "parallel.virtual_stages",
        type=int,
        derived=True,
    ),
    switch(
        "--use-distributed-optimizer",
        _DIST,
        "Megatron's sharded optimizer: DeepSpeed's equivalent here, ZeRO stage 1 (optimizer states sharded over "
        "data-parallel ranks; with --zero-stage 0 an error)",
        "training.zero_stage",
        derived=True,
    ),
    refused("--lazy-mpu-init", _DIST, "the process group is always initialised", takes=VALUE),
    refused("--use-ring-exchange-p2p", _DIST, "DeepSpeed's pipeline does its own point-to-point"),
)

DEEPSPEED: tuple[Flag, ...] = (
    switch(
        "--deepspeed",
        _DS,
        "always on: training runs on DeepSpeed's pipeline engine, or its plain engine for ZeRO 2/3 (at P = 1)",
    ),
    accepted(
        "--deepspeed_config",
        _DS,
        "merged into the JSON generated from the flags; a contradiction is an error (keys no flag sets, e.g. "
        "steps_per_print or fp16 keys whose flag is not given, are taken); its legacy curriculum_learning section "
        "is run by the training loop",
        fields=("training.deepspeed_config", "training.curriculum"),
        derived=True,
        aliases=("--deepspeed-config",),
    ),
    refused(
        "--deepscale",
        _DS,
        "DeepSpeed's deprecated spelling of --deepspeed, which Megatron-DeepSpeed never reads (without --deepspeed it "
        "trains without DeepSpeed)",
        "use --deepspeed",
    ),
    refused(
        "--deepscale_config",
        _DS,
        "DeepSpeed's deprecated spelling of --deepspeed_config",
        "use --deepspeed_config",
        VALUE,
    ),
    accepted(
        "--zero-stage",
        _DS,
        "written into the JSON: 0 and 1 on DeepSpeed's pipeline engine at any P; 2 and 3 on its plain engine, at "
        "--pipeline-model-parallel-size 1 (the same GPT, specs and initialisation; ZeRO-3 partitions each spec as "
        "it is built). Absent: the stage --deepspeed_config's zero_optimization names (Megatron-DeepSpeed reads "
        "the JSON), else 0",
        "training.zero_stage",
        type=int,
        default=None,
        derived=True,  # absent: the JSON's stage, else 0; --use-distributed-optimizer is 1
        choices=(0, 1, 2, 3),
    ),
    switch(
        "--deepspeed-activation-checkpointing",
        _DS,
        "recomputation always goes through deepspeed.checkpointing; this flag, as in Megatron-DeepSpeed, makes the "
        "five options below configure it. Recomputation itself is --checkpoint-activations or "
        "--recompute-granularity full (a warning says so when neither is given)",
    ),
    *CHECKPOINTING_FLAGS,
    refused("--zero-reduce-scatter", _DS, _ZERO_JSON),
    refused("--zero-contigious-gradients", _DS, _ZERO_JSON),
    refused("--zero-reduce-bucket-size", _DS, _ZERO_JSON, takes=VALUE),
    refused("--zero-allgather-bucket-size", _DS, _ZERO_JSON, takes=VALUE),
    refused("--remote-device", _DS, _ZERO3, _ZERO3_FIX, takes=VALUE),
    no_op("--use-pin-memory", _DS, "offloaded tensors are pinned already (the generated JSON's pin_memory true)"),
    refused("--scattered-embeddings", _DS, _TILING),
    refused("--split-transformers", _DS, _TILING),
    refused("--memory-centric-tiled-linear", _DS, _TILING),
    refused("--tile-factor", _DS, _TILING, takes=VALUE),
    accepted(
        "--offload-optimizer",
        _DS,
        "ZeRO's offload_optimizer.device: cpu or nvme keep the fp32 master weights, gradient partition and "
        "optimizer states on the host or an NVMe drive (needs --zero-stage >= 1; --cpu-optimizer alone means cpu)",
        "training.offload_optimizer",
        choices=_OFFLOAD,
        megatron=False,
    ),
    accepted(
        "--offload-param",
        _DS,
        "ZeRO-3's offload_param.device: cpu or nvme keep the parameter partitions there between uses (needs "
        "--zero-stage 3)",
        "training.offload_param",
        choices=_OFFLOAD,
        megatron=False,
    ),
    accepted(
        "--offload-nvme-path",
        _DS,
        "the nvme_path of NVMe offload: a directory on a local NVMe drive",
        "training.offload_nvme_path",
        megatron=False,
    ),
)
