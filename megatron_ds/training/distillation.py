"""The teacher of knowledge distillation (`--kd`): its checkpoint checked before launch, loaded on every rank.

As Megatron-DeepSpeed 4efb479 builds it (`setup_teacher_model`): the student's model flags with the teacher's
layers, width and heads swapped in, weights only from `--load-teacher`. Here the teacher's sizes (layers, width,
heads, MLP width) are read from the checkpoint's own saved config, the `--*-teacher` flags must agree with it, and
every other field that shapes a weight (norm, activation, vocabulary, position table, biases...) must equal the
student's, since upstream takes them from the student's flags. Fields that shape no weight (sequence length,
rotary base, norm epsilon) are the student's, as upstream.

At T > 1 the teacher is tensor-parallel like the student (the training `GPTModel` on the student's tensor group,
each rank holding its shards, cut from the checkpoint's full tensors whatever T it was saved with, as a weights-only
`--load` at another T is), so its logits come out vocabulary-parallel beside the student's and the kd loss is the
full vocabulary's KL divergence (`model.distillation.vocab_parallel_kd_loss`).

A mixture-of-experts teacher (its checkpoint's `--num-experts`; `--num-experts-teacher` must agree) is the training
`GPTModel` too, its DeepSpeed MoE layers on the student's expert-parallel groups (`--moe-expert-parallel-size` E, which
must divide its expert counts: `check_experts`), each rank holding experts / E of each MoE layer, read by global index
(`moe_weights`: our per-expert files whatever E they were saved with, or a converted Megatron-DeepSpeed checkpoint's
universal form; another rank's experts are not read, so a damaged expert file fails the rank reading it, and every
rank then stops with its one line: `rank_agreement.fail_together`); its load-balancing losses are not added (as upstream's
`calculate_mos_loss` drops them). In eval mode DeepSpeed's gate takes its eval capacity factor; the teacher's is set
to its train one, the capacity upstream's train-mode teacher routes with.

No initial weight is drawn for a teacher: each is built on the meta device, materialised in the training precision
on the student's device and filled from the checkpoint alone, so building it moves no generator the student reads on
(`_training_model`).

Differences from upstream, printed as NOTICEs: the teacher runs in eval mode (upstream never calls `.eval()` on
it, so its dropout is on: `flags.distillation_flags`); at T > 1 the KL divergence is the full vocabulary's, not
upstream's sum of per-shard ones (`flags.distillation_flags`); and a teacher whose MLP width, head size or head count
differ from the student's loads (upstream builds it with the student's --ffn-hidden-size, kv channels and
key/value heads, which cannot load such a checkpoint: `check_teacher`); a mixture-of-experts teacher routes as its
checkpoint was trained (top-k, capacity, token dropping), upstream's with the student's MoE flags (`routing_notice`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_ds.config import Config, ModelConfig
from megatron_ds.inference.model import GPTModel, module_name
from megatron_ds.model import naming, sharding
from megatron_ds.model.distillation import kd_loss, vocab_parallel_kd_loss
from megatron_ds.model.tensor_parallel_rank import TensorParallel
from megatron_ds.pipeline.layout import build_layout
from megatron_ds.training.checkpoint import reader
from megatron_ds.training.checkpoint.directory import CheckpointError
from megatron_ds.training.checkpoint.rules import WEIGHT_FREE_FIELDS
from megatron_ds.training.checkpoint.teacher import (
    check_experts,
    check_sharding,
    open_teacher,
    routing_notice,
    teacher_model,
)
from megatron_ds.training.checkpoint.universal import names
from megatron_ds.training.rank_agreement import fail_together


def check_teacher(config: Config) -> list[str]:
    """Before any process group: the teacher's checkpoint is readable and fits the student (`teacher_model`).
    Returns the NOTICE lines to print."""
    if not config.distillation.distils:
        return []
    ckpt = open_teacher(config)
    teacher = teacher_model(config, ckpt)
    student = config.model
    where = f"--load-teacher {config.distillation.load_teacher}"
    check_sharding(config, teacher)
    check_experts(config, teacher)
    notices = []
    stale = [
        f"{name} {mine} (student) vs {theirs} (teacher)"
        for name, mine, theirs in (
            ("MLP width", student.ffn_hidden_size, teacher.ffn_hidden_size),
            ("head size", student.head_dim, teacher.head_dim),
            ("key/value heads", student.kv_heads, teacher.kv_heads),
        )
        if mine != theirs
    ]
    if stale:
        notices.append(
            f"NOTICE: {where}: the teacher is built with its own {'; '.join(stale)}; Megatron-DeepSpeed would build "
            "it with the student's --ffn-hidden-size, kv channels and key/value heads, which cannot load this "
            "checkpoint"
        )
    saved = ckpt.config.model
    changed = [
        f"{k} {getattr(saved, k)!r} -> {getattr(teacher, k)!r}"
        for k in WEIGHT_FREE_FIELDS
        if getattr(saved, k) != getattr(teacher, k)
    ]
    if changed:
        notices.append(
            f"NOTICE: {where}: {'; '.join(changed)}: the teacher runs with the student's values (they shape no "
            "weight), as Megatron-DeepSpeed builds it from the student's flags"
        )
    routing = routing_notice(config, teacher)
    return notices + ([routing] if routing else [])


class Teacher:
    """The teacher on this rank and the kd loss it gives a student's logits."""

    def __init__(self, config: Config, model: torch.nn.Module, tp: TensorParallel | None = None) -> None:
        self.model = model
        self.tp = tp
        """The tensor group at T > 1: the teacher's logits are vocabulary-parallel as the student's."""
        self.temperature = config.distillation.kd_temp
        self.beta = config.distillation.kd_beta_ce
        self.seq_length = config.model.seq_length
        self.loss_name = config.distillation.loss_name
        """`kd loss`, or `mos loss` under --mos."""

    def loss(self, tokens: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
        """kd loss of one micro-batch: tokens (b, s) as the student saw them (a curriculum's cut included),
        student_logits (b, s, v) fp32 (at T > 1 this rank's vocabulary shard (b, s, v/T), or (s, b, v/T) under
        sequence parallelism); the teacher's forward keeps no graph."""
        with torch.no_grad():
            teacher_logits = self.model(tokens)
        if self.tp is None:
            return kd_loss(student_logits, teacher_logits, self.temperature, self.beta, self.seq_length)
        return vocab_parallel_kd_loss(
            student_logits, teacher_logits, self.temperature, self.beta, self.seq_length, tokens.shape[0], self.tp.group
        )


def load_teacher(
    config: Config, device: Any, student: Any = None, data_before_expert_parallel: bool = False
) -> Teacher:
    """The teacher of `--load-teacher` on `device`, in the training precision, frozen and in eval mode
    (the checkpoint was checked at launch: `check_teacher`). At T = 1 a dense one is one whole model, needing no
    process group; at T > 1, or with experts, `student` (the training `GPTModel`) gives the tensor group, topology and
    grid the teacher shares (with experts: the expert-parallel groups DeepSpeed's engine made, or makes here as it
    would, `data_before_expert_parallel` being the DeepSpeed JSON's use_data_before_expert_parallelism)."""
    ckpt = open_teacher(config)
    model_config = teacher_model(config, ckpt)
    check_experts(config, model_config)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.training.precision, torch.float32)
    if model_config.is_moe:
        assert student is not None, "a mixture-of-experts teacher shares the student's expert-parallel groups"
        return _expert_parallel_teacher(config, ckpt, model_config, dtype, device, student, data_before_expert_parallel)
    if config.parallel.tensor_model_parallel_size > 1:
        assert student is not None, "a tensor-parallel teacher shares the student's tensor group"
        return _tensor_parallel_teacher(config, ckpt, model_config, dtype, device, student)
    with torch.device("meta"):  # no initial weights are drawn: the checkpoint's replace them
        model = GPTModel(model_config)
    with fail_together():  # every rank reads the files: one that fails stops them all
        state = {module_name(t.spec, t.key, t.layer): t.tensor.to(dtype) for t in _tensors(ckpt)}
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device).requires_grad_(False).eval()
    return Teacher(config, model)


def _tensor_parallel_teacher(
    config: Config, ckpt: reader.Checkpoint, model_config: ModelConfig, dtype: torch.dtype, device: Any, student: Any
) -> Teacher:
    """The training `GPTModel` of the teacher's architecture on the student's tensor group, this rank's shards of
    the checkpoint's full tensors copied in (`sharding.split`, as `--load` reshards weights for another T)."""
    model = _training_model(config, model_config, student)
    _materialise(model, dtype, device)
    with fail_together():
        copy_shards(model, ckpt, model_config)
    return Teacher(config, model.eval(), student.tensor_parallel)


def copy_shards(model: Any, ckpt: reader.Checkpoint, model_config: ModelConfig) -> None:
    """Every parameter of the tensor-parallel teacher `model`: this rank's shard of its checkpoint tensor."""
    tp = model.tensor_parallel
    live = dict(model.named_parameters())
    where = {
        (p.tensor.spec_index, p.tensor.key): p.module_name
        for p in names.stage_parameters(model_config, model.layout, 0)
        if p.tensor is not None
    }
    loaded = set()
    with torch.no_grad():
        for t in _tensors(ckpt):
            name = where[(t.index, t.key)]
            live[name].copy_(sharding.split(t.rule, t.tensor, tp.size)[tp.rank])
            loaded.add(name)
    assert loaded == set(live), sorted(set(live) - loaded)


def teacher_training_config(config: Config, model_config: ModelConfig) -> Config:
    """The student's run with the teacher's model: the config the teacher's training `GPTModel` is built from."""
    # the student's optimizer and checkpoint settings are the student's own: none refuses the teacher's experts
    return config.replace(
        model=model_config,
        optimizer=dataclasses.replace(config.optimizer, create_moe_param_group=model_config.is_moe, decoupled_lr=None),
        checkpoint=dataclasses.replace(config.checkpoint, no_save_optim=False),
    )


def _training_model(config: Config, model_config: ModelConfig, student: Any) -> Any:
    """The training `GPTModel` of the teacher's architecture on the student's tensor group and grid, no activation
    checkpointing, on the meta device: no initial weight is drawn, the checkpoint's fill it (`_materialise`). Torch's
    default generator stays where the student left it (a CPU build would advance it by its `nn.Linear` and
    DeepSpeed gate initialisers, by how many experts this rank holds); the dropout streams are forgotten as every
    model build forgets them (the student's restart from their seeds, as no forward has run yet)."""
    from megatron_ds.model.gpt_model import GPTModel as ShardedGPTModel

    layout = build_layout(naming.gpt_spec_groups(model_config), 1)
    with torch.device("meta"):
        teacher_config = teacher_training_config(config, model_config)
        model = ShardedGPTModel(teacher_config, layout, tp=student.tensor_parallel, grid=student.mpu())
    model.activation_checkpoint_interval = 0  # no graph to save memory on
    return model


def _materialise(model: torch.nn.Module, dtype: torch.dtype, device: Any) -> None:
    """A model built on the meta device, in place: frozen, in `dtype` (its floating-point parameters, as
    `Module.to` casts them) on `device`, its storage uninitialised until the checkpoint's tensors are copied in. Each
    parameter keeps its attributes (megatron-core's tensor-parallel marks, DeepSpeed's expert flags)."""
    marks = {name: dict(vars(p)) for name, p in model.named_parameters()}
    model.requires_grad_(False).to(dtype=dtype).to_empty(device=device)
    for name, p in model.named_parameters():
        vars(p).update(marks[name])
    # what no checkpoint tensor fills: a buffer (to_empty leaves it uninitialised), a plain tensor left on the meta
    # device (a rotary table would be either); the model has none
    unfilled = [name for name, _ in model.named_buffers()] + [
        f"{m}.{k}" for m, module in model.named_modules() for k, v in vars(module).items() if _is_meta(v)
    ]
    assert not unfilled, unfilled


def _is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta


def _expert_parallel_teacher(
    config: Config,
    ckpt: reader.Checkpoint,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: Any,
    student: Any,
    data_before_expert_parallel: bool,
) -> Teacher:
    """The mixture-of-experts teacher: the training `GPTModel` (its gates at the train capacity factor in eval mode),
    its MoE layers on the student's expert-parallel groups (made here by DeepSpeed, as its engine makes them, when the
    student is dense), this rank's experts and every other weight copied in by their one-process names."""
    routed = dataclasses.replace(model_config, moe_eval_capacity_factor=model_config.moe_train_capacity_factor)
    model = _training_model(config, routed, student)
    for module in model.modules():
        if hasattr(module, "set_deepspeed_parallelism"):  # DeepSpeed's MoE layer: the "ep_size_E" groups
            module.set_deepspeed_parallelism(data_before_expert_parallel)
    _materialise(model, dtype, device)
    with fail_together():  # each rank reads its own experts' files: a damaged one fails its reader alone
        copy_experts(model, ckpt)
    return Teacher(config, model.eval())


def copy_experts(model: Any, ckpt: reader.Checkpoint) -> None:
    """Every parameter of the mixture-of-experts teacher `model` (its expert-parallel groups made): its checkpoint
    tensor by one-process name, this rank's experts by their global index; another rank's experts are not read
    (`moe_weights`: ours at any expert-parallel size, or a converted Megatron-DeepSpeed one's universal form)."""
    from megatron_ds.model.moe import global_named_parameters
    from megatron_ds.training.checkpoint import moe_weights

    live = global_named_parameters(model)  # local experts under their global index
    saved = ckpt.config.model
    loaded = set()
    try:
        with torch.no_grad():
            for tensor, value in moe_weights.iter_weights(ckpt, lambda t: names.module_name(saved, t) in live):
                name = names.module_name(saved, tensor)
                live[name].copy_(value)
                loaded.add(name)
    except CheckpointError as err:
        raise CheckpointError(f"--load-teacher: {err}") from None
    assert loaded == set(live), sorted(set(live) - loaded)


def _tensors(ckpt: reader.Checkpoint) -> Any:
    try:
        yield from reader.iter_tensors(ckpt)
    except CheckpointError as err:
        raise CheckpointError(f"--load-teacher: {err}") from None
