"""DeepSpeed's plain engine (`DeepSpeedEngine`) for the runs its pipeline engine cannot take: ZeRO 2 and 3
at pipeline size 1, with optimizer and parameter offload.

`PlainEngine` is `DeepSpeedEngine` with the pipeline engine's step interface, so the loop, the stage
timers, dropout reseeding, checkpoints and the tests drive either engine alike:

  * `train_batch(data_iter)` runs an instruction stream, as `PipelineEngine` does: per micro-batch
    LoadMicroBatch, ForwardPass, BackwardPass, then one OptimizerStep, looked up in `_INSTRUCTION_MAP`
    (the stage timers time them). Each micro-batch is DeepSpeed's own gradient accumulation:
    `loss = engine(inputs)`, `engine.backward(loss)` (scaled by 1 / accumulation steps, ZeRO-2/3 reduce
    here), `engine.step()` (which steps the optimizer at the accumulation boundary only). It reads the
    micro-batches in the pipeline engine's order and returns their mean loss averaged over data-parallel
    ranks, as `PipelineEngine.train_batch` does;
  * `eval_batch`, `grid`, `stage_id`, `num_stages`, `micro_batches`, `is_first_stage`, `is_last_stage`,
    `reset_activation_shape` (nothing to reset: a curriculum's lengths need no buffers here);
  * checkpoints keep the pipeline's per-spec weight files (`GPTModel.save_state_dict` through
    `module_state_dict`, as `PipelineEngine` overrides it) beside DeepSpeed's own model-state and ZeRO files;
  * knowledge distillation (`--kd`, Megatron-DeepSpeed's engine for it too): with a `teacher`, each training
    micro-batch's loss is lm loss + the teacher's kd loss; `train_batch` still returns the lm loss, and
    `step_losses` holds the step's other losses (`kd loss`), averaged alike. Evaluation stays the lm loss.

`build` makes it the way `deepspeed.initialize` makes a `DeepSpeedEngine` (the config object, the
optimizer flags, `zero.Init` shut off meanwhile, its garbage-collection setting); only the class differs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe import schedule

from megatron_ds.config import Config
from megatron_ds.model.gpt_model import GPTModel, Partition
from megatron_ds.model.tensor_parallel import TensorParallel
from megatron_ds.model.tensor_parallel_rank import NO_ULYSSES
from megatron_ds.model.ulysses import UlyssesGrid, group_of, local_part
from megatron_ds.pipeline.layout import Layout
from megatron_ds.training.optimizer import OptimizerFactory, add_group_placeholders, build_optimizer
from megatron_ds.training.preflight import check_structure


class PlainEngine(DeepSpeedEngine):
    """`DeepSpeedEngine` driving `GPTModel` with `PipelineEngine`'s `train_batch` / `eval_batch`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.grid = self.module.mpu()
        self.stage_id, self.num_stages = 0, 1
        self.micro_batches = self.gradient_accumulation_steps()
        self.data_iterator: Iterator[Any] | None = None
        self._spec_dir: str | None = None
        self._micro: dict[str, Any] = {}
        self.total_loss: torch.Tensor | None = None
        self.teacher: Any = None
        """`training.distillation.Teacher` under --kd: its kd loss joins each training micro-batch's loss."""
        self.kd_total: torch.Tensor | None = None
        self.step_losses: dict[str, torch.Tensor] = {}
        """The last step's losses beside the lm loss: `moe loss` (a mixture-of-experts model's weighted load-balancing
        loss) and `kd loss` under --kd, averaged as `train_batch`'s (over the micro-batches and the data-parallel
        ranks: the moe loss as DeepSpeed's pipeline engine averages it at P > 1, `training/moe_pipeline.py`)."""
        self.moe_loss_sum: torch.Tensor | None = None

    def is_first_stage(self) -> bool:
        return True

    def is_last_stage(self) -> bool:
        return True

    def reset_activation_shape(self) -> None:
        """What a curriculum's new sequence length asks of `PipelineEngine` (`step_plan`): this engine keeps no
        pipe buffers sized for it, so nothing."""

    # --- steps -------------------------------------------------------------------------------
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over `micro_batches` micro-batches of `data_iter`; the mean loss (all ranks)."""
        if data_iter is not None:
            self.data_iterator = data_iter
        self.module.train()
        self.total_loss = self.kd_total = self.moe_loss_sum = None
        for cmd in self.train_instructions():
            self._INSTRUCTION_MAP[type(cmd)](self, **cmd.kwargs)
        sums = {"lm loss": self.total_loss}  # in the order of Megatron-DeepSpeed's loss dict: lm, moe, kd loss
        if self.moe_loss_sum is not None:
            sums["moe loss"] = self.moe_loss_sum
        if self.teacher is not None:
            sums[self.teacher.loss_name] = self.kd_total
        # one all-reduce for them all, as DeepSpeed's pipeline engine reduces the loss and the additional losses
        means = self._mean_over_data_parallel(torch.stack(list(sums.values())) / self.micro_batches)
        self.step_losses = dict(zip(list(sums)[1:], means[1:].unbind(), strict=True))
        return means[0]

    def train_instructions(self) -> list[schedule.PipeInstruction]:
        """The step as instructions (DeepSpeed's classes): what the stage timers see."""
        per_micro_batch = [schedule.LoadMicroBatch(0), schedule.ForwardPass(0), schedule.BackwardPass(0)]
        return per_micro_batch * self.micro_batches + [schedule.OptimizerStep()]

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator[Any], num_micro_batches: int | None = None) -> torch.Tensor:
        """The mean loss of `micro_batches` (or `num_micro_batches`) micro-batches of `data_iter`, forward
        only, averaged over data-parallel ranks (`PipelineEngine.eval_batch`'s defaults: loss, averaged)."""
        self.module.eval()
        total = torch.zeros((), device=self.device)
        count = num_micro_batches or self.micro_batches
        for _ in range(count):
            inputs, labels = self._to_device(next(data_iter))
            total += self.module.loss_fn(self(inputs), labels).detach().float()
        return self._mean_over_data_parallel(total / count)

    def _exec_load_micro_batch(self, buffer_id: int) -> None:
        del buffer_id
        assert self.data_iterator is not None, "train_batch needs a data iterator"
        self._micro["inputs"], self._micro["labels"] = self._to_device(next(self.data_iterator))

    def _exec_forward_pass(self, buffer_id: int) -> None:
        del buffer_id
        inputs = self._micro.pop("inputs")
        outputs = self(inputs)
        kd = None
        if self.teacher is not None:  # the teacher sees the student's tokens (b, s): a curriculum's cut too
            tokens = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
            # before the lm loss: at T > 1 megatron-core's cross entropy shifts the logits in place
            kd = self.teacher.loss(tokens, outputs)
            self._micro["kd"] = kd.detach().float()
        loss = self.module.loss_fn(outputs, self._micro.pop("labels"))
        self._micro["lm"] = loss.detach().float()
        if kd is not None:
            loss = loss + kd
        self._micro["loss"] = loss
        self._micro["moe_loss"] = self.module.moe_loss()

    def _exec_backward_pass(self, buffer_id: int) -> None:
        del buffer_id
        loss, moe_loss = self._micro.pop("loss"), self._micro.pop("moe_loss")
        # MoE: lm loss + the weighted load-balancing losses is what trains; the lm loss alone is reported (upstream's
        # "lm loss"; `step_losses` keeps the other as its "moe loss")
        self.backward(loss if moe_loss is None else loss + moe_loss)
        if moe_loss is not None:
            self.moe_loss_sum = moe_loss.detach().float() + (self.moe_loss_sum if self.moe_loss_sum is not None else 0)
        lm = self._micro.pop("lm")
        self.total_loss = lm if self.total_loss is None else self.total_loss + lm
        if self.teacher is not None:
            kd = self._micro.pop("kd")
            self.kd_total = kd if self.kd_total is None else self.kd_total + kd
        if not self.is_gradient_accumulation_boundary():
            self.step()  # DeepSpeed's accumulation: counts the micro-batch, steps nothing

    def _exec_optimizer_step(self) -> None:
        assert self.is_gradient_accumulation_boundary()
        self.step()

    _INSTRUCTION_MAP = {
        schedule.LoadMicroBatch: _exec_load_micro_batch,
        schedule.ForwardPass: _exec_forward_pass,
        schedule.BackwardPass: _exec_backward_pass,
        schedule.OptimizerStep: _exec_optimizer_step,
    }

    def _to_device(self, batch: Any) -> tuple[Any, Any]:
        """((tokens,), (labels, loss_mask)) on this engine's device, as the pipeline engine loads them (under
        Ulysses this rank's part of the sequence: `ulysses.local_part`)."""
        if self.module.ulysses.size > 1:
            batch = local_part(batch, self.module.ulysses)
        inputs, labels = batch

        def move(x: Any) -> Any:
            return tuple(move(t) for t in x) if isinstance(x, (tuple, list)) else x.to(self.device)

        return move(inputs), move(labels)

    def _mean_over_data_parallel(self, loss: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        loss = loss.detach().clone()
        if self.dp_world_size > 1:
            dist.all_reduce(loss, group=self.grid.get_data_parallel_group())
            loss /= self.dp_world_size
        return loss

    # --- checkpoints: the pipeline's per-spec weight files ---------------------------------------
    def module_state_dict(
        self,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> None:
        """Called by `save_checkpoint`: the weights go to per-spec files (as `PipelineEngine` does); None
        is stored as the model-state file's `module`. (A mixture-of-experts model is saved by DeepSpeed's
        `_save_moe_checkpoint`, which reads `DeepSpeedEngine.module_state_dict` itself: the model-state file holds
        the other weights, each expert has its file, the optimizer one file per expert-parallel rank.)"""
        del destination, prefix, keep_vars
        assert self._curr_ckpt_path is not None, "module_state_dict is called by save_checkpoint only"
        self.module.save_state_dict(self._curr_ckpt_path, self.checkpoint_engine, exclude_frozen_parameters)
        return None

    def load_checkpoint(self, load_dir: str, tag: str | None = None, **kwargs: Any) -> Any:
        assert tag is not None, "our checkpoints are loaded by their tag (save_load.load reads `latest`)"
        self._spec_dir = os.path.join(load_dir, tag)
        try:
            return super().load_checkpoint(load_dir, tag=tag, **kwargs)
        finally:
            self._spec_dir = None

    def load_module_state_dict(
        self,
        checkpoint: dict[str, Any],
        strict: bool = True,
        custom_load_fn: Any = None,
        fetch_z3_params: bool = False,
        z3_params_to_fetch: Any = None,
        allowed_missing_keys: Any = None,
    ) -> None:
        """Called by `load_checkpoint`: the weights come from the per-spec files of the checkpoint (a mixture-of-experts
        model: from `checkpoint["module"]`, its experts added by DeepSpeed's `load_moe_state_dict`)."""
        if self.module.moe_layers:
            super().load_module_state_dict(checkpoint, strict=strict)
            return
        assert custom_load_fn is None and self._spec_dir is not None, "weights load through load_checkpoint"
        self.module.load_state_dir(self._spec_dir, self.checkpoint_engine, strict=strict)


def assemble(
    config: Config,
    layout: Layout,
    ds: dict[str, Any],
    topology: Any,
    tp: TensorParallel,
    factory: OptimizerFactory | None,
    lr_scheduler: Any,
) -> tuple[PlainEngine, GPTModel, Any]:
    """The builder's steps 3-5 for the plain engine: the model (partitioned spec by spec under ZeRO-3), its
    optimizer groups, the preflight check, the engine; (engine, model, the optimizer DeepSpeed wrapped)."""
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    n = config.parallel.ds_sequence_parallel_size
    grid = UlyssesGrid(topology, n) if n > 1 else PipelineParallelGrid(topology=topology)
    ulysses = group_of(grid) if n > 1 else NO_ULYSSES
    partition = zero3_partition(config, ds, grid) if config.training.zero_stage == 3 else None
    model = GPTModel(config, layout, topology=topology, tp=tp, partition=partition, grid=grid, ulysses=ulysses)
    add_group_placeholders(model)
    optimizer = build_optimizer(model, config.optimizer, factory, config.training.cpu_optimizer)
    check_structure(model, optimizer)
    engine = build(model, optimizer, ds, lr_scheduler)
    if config.distillation.distils:
        from megatron_ds.training.distillation import load_teacher

        # at T > 1 on the student's tensor group; with experts on its expert-parallel groups
        engine.teacher = load_teacher(config, engine.device, model, engine._config.use_data_before_expert_parallel_)
    return engine, model, engine.optimizer


def build(model: GPTModel, optimizer: Any, ds: dict[str, Any], lr_scheduler: Any) -> PlainEngine:
    """A `PlainEngine` as `deepspeed.initialize` builds its `DeepSpeedEngine` (the non-pipeline branch)."""
    from deepspeed import set_optimizer_flags, zero
    from deepspeed.runtime.config import DeepSpeedConfig

    mpu = model.mpu()
    zero.partition_parameters.shutdown_init_context()
    try:
        config_class = DeepSpeedConfig(ds, mpu)
        set_optimizer_flags(config_class, model)
        engine = PlainEngine(
            args=None,
            model=model,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            mpu=mpu,
            config=ds,
            config_class=config_class,
        )
    finally:
        zero.partition_parameters.restore_init_context()
    engine._configure_python_gc()
    return engine


def zero3_partition(config: Config, ds: dict[str, Any], grid: Any) -> Partition:
    """The `GPTModel(partition=...)` of ZeRO-3: each spec partitioned over the data-parallel group as soon
    as it is built (`deepspeed.zero.Init(module=...)`, with this run's offload_param from `ds`)."""
    import deepspeed

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.training.precision)

    def partition(module: torch.nn.Module) -> None:
        if dtype is not None:  # the engine would cast the whole model; here one spec at a time
            module.to(dtype)
        if any(True for _ in module.parameters()):
            deepspeed.zero.Init(
                module=module,
                # the engine's ZeRO group: under Ulysses the DP x N ranks (DeepSpeed's sequence-data-parallel group)
                data_parallel_group=getattr(grid, "get_sequence_data_parallel_group", grid.get_data_parallel_group)(),
                config_dict_or_path=ds,
                mpu=grid,
            )

    return partition
