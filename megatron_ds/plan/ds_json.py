"""The config tree and the `pretrain_gpt.py` command line for a planned configuration.

The planner's DeepSpeed JSON is `megatron_ds.training.deepspeed_config.generate` applied to
`plan_config` (the config tree the printed command line produces): offload is flags too
(`--cpu-optimizer`: DeepSpeed's CPU Adam with the optimizer on the host; `--offload-optimizer nvme`,
`--offload-param`, `--offload-nvme-path`), so passing the JSON as `--deepspeed_config` is never a
contradiction.
"""

from __future__ import annotations

import dataclasses
import shlex

from megatron_ds.config import Config, DistillationConfig, OptimizerConfig, ParallelConfig, TrainingConfig
from megatron_ds.config.parallel import DEFAULT_PIPELINE_SCHEDULE
from megatron_ds.plan import distillation
from megatron_ds.plan.candidate import Candidate
from megatron_ds.plan.inputs import Resolved
from megatron_ds.plan.search import layout_options
from megatron_ds.training.deepspeed_config import NVME_PATH_PLACEHOLDER

DEFAULT_LR = 1.0e-4
PLACEHOLDER_TRAIN_ITERS = 1000


def plan_config(res: Resolved, cand: Candidate) -> Config:
    """The config tree pretrain_gpt.py builds from `command_line(res, cand)`."""
    # The flags of search.layout_flag: a dedicated mode as itself, a partition method as its layout string.
    options = layout_options(cand.method)
    dedicated = options.get("dedicated", "none")
    pp_layout = cand.layout.to_string() if "partition_method" in options else None
    parallel = ParallelConfig(
        pipeline_model_parallel_size=cand.pp,
        tensor_model_parallel_size=cand.tp,
        world_size=cand.dp * cand.pp * cand.tp,
        pp_dedicated_embedding_stages=dedicated,
        pp_layout=pp_layout,
        sequence_parallel=cand.sequence_parallel,
        pipeline_schedule=cand.inputs.schedule,
        virtual_stages=cand.virtual_stages,
        expert_parallel_size=cand.expert_parallel_size,
    )
    offload, params_to = cand.offload_optimizer, cand.offload_param
    training = TrainingConfig(
        micro_batch_size=cand.micro_batch_size,
        global_batch_size=res.global_batch_size,
        train_iters=PLACEHOLDER_TRAIN_ITERS,
        precision=cand.precision,
        zero_stage=cand.zero_stage,
        checkpoint_activations=cand.checkpoint_activations,
        selective_recompute=cand.selective_recompute,
        partition_activations=cand.inputs.partition_activations,
        checkpoint_in_cpu=cand.inputs.checkpoint_in_cpu,
        # an offloaded optimizer steps as DeepSpeed's CPU Adam (torch's AdamW on the host is several times slower)
        cpu_optimizer=offload != "none",
        offload_optimizer="nvme" if offload == "nvme" else "none",
        offload_param=params_to,
        offload_nvme_path=NVME_PATH_PLACEHOLDER if "nvme" in (offload, params_to) else None,
    )
    model = res.model(cand.tp)
    # ZeRO's optimizer takes a MoE model's experts in groups of their own (Config._check_experts)
    moe_groups = model.is_moe and (cand.zero_stage > 0 or bool(res.raw.create_moe_param_group))
    return Config(
        model=model,
        parallel=parallel,
        training=training,
        optimizer=OptimizerConfig(lr=res.lr or DEFAULT_LR, create_moe_param_group=moe_groups),
        distillation=_distillation(res, cand.tp),
    )


def _distillation(res: Resolved, tp: int) -> DistillationConfig:
    """The kd section of the plan: `--kd` / `--mos`, `--load-teacher` (a placeholder when the teacher was sized by the
    flags) and the teacher's sizes and, for a mixture-of-experts teacher, its experts, which the trainer checks against
    its checkpoint."""
    teacher = res.teacher(tp)
    if teacher is None:
        return DistillationConfig()
    return dataclasses.replace(
        distillation.distillation_config(res.raw),
        num_layers_teacher=teacher.num_layers,
        hidden_size_teacher=teacher.hidden_size,
        num_attention_heads_teacher=teacher.num_attention_heads,
        num_experts_teacher=teacher.num_experts if teacher.is_moe else None,
    )


def command_flags(config: Config, vocab_size: int) -> list[str]:
    """pretrain_gpt.py flags in Megatron spelling for this config (vocab given unpadded, as users do)."""
    m, par, t = config.model, config.parallel, config.training
    flags = [
        "--num-layers",
        m.num_layers,
        "--hidden-size",
        m.hidden_size,
        "--num-attention-heads",
        m.num_attention_heads,
        "--ffn-hidden-size",
        m.ffn_hidden_size,
        "--seq-length",
        m.seq_length,
        "--max-position-embeddings",
        m.max_position_embeddings,
        "--vocab-size",
        vocab_size,
        "--micro-batch-size",
        t.micro_batch_size,
        "--global-batch-size",
        t.global_batch_size,
        "--pipeline-model-parallel-size",
        par.pipeline_model_parallel_size,
        "--tensor-model-parallel-size",
        par.tensor_model_parallel_size,
        "--zero-stage",
        t.zero_stage,
    ]
    if m.is_moe or par.expert_parallel_size > 1:  # a dense student keeps E for a mixture-of-experts teacher
        flags += ["--moe-expert-parallel-size", par.expert_parallel_size]
    if config.optimizer.create_moe_param_group:
        flags.append("--create-moe-param-group")
    kd = config.distillation
    if kd.distils:
        flags += ["--kd"] * kd.kd + ["--mos"] * kd.mos + ["--load-teacher", kd.load_teacher]
        flags += ["--num-layers-teacher", kd.num_layers_teacher, "--hidden-size-teacher", kd.hidden_size_teacher]
        flags += ["--num-attention-heads-teacher", kd.num_attention_heads_teacher]
        flags += ["--num-experts-teacher", *kd.num_experts_teacher] if kd.num_experts_teacher else []
    if t.precision != "fp32":
        flags.append(f"--{t.precision}")
    if par.pp_dedicated_embedding_stages != "none":
        flags += ["--pp-dedicated-embedding-stages", par.pp_dedicated_embedding_stages]
    if par.pp_layout is not None:
        flags += ["--pp-layout", par.pp_layout]
    if par.pipeline_schedule != DEFAULT_PIPELINE_SCHEDULE:
        flags += ["--pp-schedule", par.pipeline_schedule]
    if par.virtual_stages > 1:
        flags += ["--num-virtual-stages-per-pipeline-rank", par.virtual_stages]
    if par.sequence_parallel:
        flags.append("--sequence-parallel")
    if t.checkpoint_activations:
        flags.append("--checkpoint-activations")
    if t.partition_activations or t.checkpoint_in_cpu:
        flags.append("--deepspeed-activation-checkpointing")
        flags += ["--partition-activations"] * t.partition_activations + ["--checkpoint-in-cpu"] * t.checkpoint_in_cpu
    if t.selective_recompute:
        flags.append("--recompute-activations")
    if t.cpu_optimizer:
        flags.append("--cpu-optimizer")
    if t.offload_optimizer != "none":
        flags += ["--offload-optimizer", t.offload_optimizer]
    if t.offload_param != "none":
        flags += ["--offload-param", t.offload_param]
    if t.offload_nvme_path:
        flags += ["--offload-nvme-path", t.offload_nvme_path]
    return [str(f) for f in flags]


def command_line(res: Resolved, config: Config, ds_config_path: str | None = None) -> str:
    """A launch command: the deepspeed launcher, our flags, and clearly marked placeholders."""
    flags = command_flags(config, res.dims["vocab_size"]) + list(res.dims.get("architecture", ()))
    if ds_config_path:
        flags += ["--deepspeed_config", ds_config_path]
    flags += ["--lr", f"{config.optimizer.lr:g}", "--train-iters", str(PLACEHOLDER_TRAIN_ITERS), "--mock-data"]
    nodes = res.num_nodes or 1
    launcher = f"deepspeed --num_nodes {nodes} --num_gpus {res.gpus_per_node or res.num_gpus}"
    if nodes > 1:
        launcher += " --hostfile hostfile"
    lines = [f"{launcher} pretrain_gpt.py"]
    pairs, i = [], 0
    while i < len(flags):  # a flag and its values on one line (--num-experts 4 8 takes several)
        j = i + 1
        while j < len(flags) and not flags[j].startswith("--"):
            j += 1
        pairs.append(" ".join([flags[i], *map(shlex.quote, flags[i + 1 : j])]))
        i = j
    body = " \\\n    ".join([lines[0], *pairs])
    note = (
        "# --lr is the preset's published value (a placeholder without one); --train-iters and "
        "--mock-data are placeholders: set your length and --data-path/--tokenizer-* flags"
        + (
            f"; {NVME_PATH_PLACEHOLDER} stands for a directory on a local NVMe drive"
            if config.training.offload_nvme_path
            else ""
        )
        + (
            f"; {distillation.TEACHER_DIR_PLACEHOLDER} stands for the teacher's checkpoint (pretrain_gpt.py --save DIR)"
            if config.distillation.load_teacher == distillation.TEACHER_DIR_PLACEHOLDER
            else ""
        )
    )
    return f"{note}\n{body}"
