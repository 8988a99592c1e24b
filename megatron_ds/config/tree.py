"""`Config`: the whole tree, its cross-section rules, and its JSON form (stored in checkpoints)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_ds.config.checks import check
from megatron_ds.config.data import DataConfig
from megatron_ds.config.distillation import DistillationConfig
from megatron_ds.config.model import ModelConfig, RegularizationConfig
from megatron_ds.config.optimizer import OptimizerConfig
from megatron_ds.config.output import CheckpointConfig, LoggingConfig
from megatron_ds.config.parallel import DEFAULT_PIPELINE_SCHEDULE, INTERLEAVED, ParallelConfig, pipeline_engine_only
from megatron_ds.config.training import TrainingConfig, check_global_batch


@dataclass(frozen=True)
class Config:
    """The whole configuration, passed explicitly to every component.

    Each section checks its own fields when it is built; this class checks the rules that span
    sections (tensor-parallel divisibility, the batch-size split), so a config built in Python is
    held to the same rules as one built from flags.
    """

    model: ModelConfig
    regularization: RegularizationConfig = field(default_factory=RegularizationConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)

    def __post_init__(self) -> None:
        self._check_engine()
        self._check_distillation()
        self._check_experts()
        t = self.parallel.tensor_model_parallel_size
        model = self.model
        for flag, value in (
            ("--num-attention-heads", model.num_attention_heads),
            ("--num-key-value-heads", model.kv_heads),
            ("--ffn-hidden-size", model.ffn_hidden_size),
        ):
            check(
                value % t == 0,
                f"{flag} {value} is not divisible by --tensor-model-parallel-size {t}; choose a size divisible by {t}",
            )
        check(
            model.vocab_size % t == 0,
            f"padded vocabulary size {model.vocab_size} is not divisible by --tensor-model-parallel-size {t}; "
            f"pad it to a multiple of {t} (--make-vocab-size-divisible-by pads to a multiple of that x T)",
        )
        mbs, gbs = self.training.micro_batch_size, self.training.global_batch_size
        dp = self.parallel.data_parallel_size
        check_global_batch(gbs, mbs, dp)
        uneven = [b for b in self.training.batch_sizes() if b % (mbs * dp)]
        check(
            not uneven,
            f"the batch size schedule reaches a global batch size of {uneven[0] if uneven else 0}, not divisible by "
            f"--micro-batch-size {mbs} x data-parallel size {dp} (DeepSpeed runs whole micro-batches); use sizes "
            f"that are multiples of {mbs * dp}",
        )
        self._check_sequence_split()
        self._check_partitioned_checkpoints()
        self.optimizer.check_schedule(self.training.train_iters, gbs, model.seq_length)
        curriculum = self.training.curriculum
        if curriculum is not None:
            longest = max((curriculum.max_difficulty, *curriculum.difficulty))
            check(
                longest <= model.seq_length,
                f"curriculum_learning asks for sequences of {longest} tokens, beyond --seq-length "
                f"{model.seq_length}: the curriculum cuts samples, it cannot lengthen them; lower it",
            )

    def _check_sequence_split(self) -> None:
        """Sequence parallelism cuts every sequence into equal parts; Ulysses also deals out whole heads."""
        par, model = self.parallel, self.model
        n, flag = (
            (par.tensor_model_parallel_size, "--sequence-parallel with --tensor-model-parallel-size")
            if par.sequence_parallel
            else (par.ds_sequence_parallel_size, "--ds-sequence-parallel-size")
        )
        if n == 1:
            return
        check(
            model.seq_length % n == 0,
            f"{flag} {n} splits each sequence {n} ways, but --seq-length {model.seq_length} is not divisible by "
            f"{n}; use a multiple of {n}",
        )
        if par.ds_sequence_parallel_size > 1:
            self._check_no_document_reset(n)
            for what, heads in (
                ("--num-attention-heads", model.num_attention_heads),
                ("--num-key-value-heads (--num-query-groups)", model.kv_heads),
            ):
                check(
                    heads % n == 0,
                    f"--ds-sequence-parallel-size {n} gives each rank 1/{n} of the attention heads, but {what} is "
                    f"{heads}, not divisible by {n}; choose a degree that divides {heads}",
                )
        curriculum = self.training.curriculum
        if curriculum is not None:
            bad = [x for x in curriculum.lengths_to_divide() if x % n]
            check(
                not bad,
                f"{flag} {n} needs every sequence length divisible by {n}, but curriculum_learning gives "
                f"{bad[0] if bad else 0}-token batches; make its lengths (and difficulty_step) multiples of {n}",
            )

    def _check_partitioned_checkpoints(self) -> None:
        """DeepSpeed's partitioned checkpoints assume the checkpointed input is the same on every tensor rank: each
        keeps its 1/T and the recompute all-gathers the whole. Under sequence parallelism each rank's input is its own
        part of the sequence already, so the gather would join pieces of different tensors."""
        t = self.parallel.tensor_model_parallel_size
        check(
            not (self.training.partition_activations and self.parallel.sequence_parallel and t > 1),
            f"--partition-activations with --sequence-parallel at --tensor-model-parallel-size {t}: each tensor rank's "
            f"checkpointed input is already its own 1/{t} of the sequence, and DeepSpeed's partitioning assumes inputs "
            f"equal on every tensor rank (its all-gather would join pieces of different tensors); drop one of them",
        )

    def _check_no_document_reset(self, n: int) -> None:
        """Ulysses gives each rank 1/N of the tokens before attention; the document structure would have to follow
        its all-to-all (Megatron's sequence parallelism gathers the whole sequence for attention: no limit there)."""
        d = self.data
        given = [
            f
            for f, on in (
                ("--reset-position-ids", d.reset_position_ids),
                ("--reset-attention-mask", d.reset_attention_mask),
            )
            if on
        ]
        check(
            not given,
            f"{' and '.join(given)} with --ds-sequence-parallel-size {n}: DeepSpeed-Ulysses splits each sample's "
            f"tokens over ranks, and packed documents are not carried through its all-to-all here; drop "
            f"{' and '.join(given)} or use --ds-sequence-parallel-size 1 (--sequence-parallel works with them)",
        )

    def _check_engine(self) -> None:
        """ZeRO 2/3 only where the plain engine runs; CPU Adam is an Adam."""
        z, p = self.training.zero_stage, self.parallel.pipeline_model_parallel_size
        check(
            z < 2 or p == 1,
            f"--zero-stage {z} with --pipeline-model-parallel-size {p}: DeepSpeed's pipeline engine runs ZeRO 0 and 1 "
            f"only, ZeRO 2 and 3 run on its plain engine at pipeline size 1; use --zero-stage 1, or "
            f"--pipeline-model-parallel-size 1 (--no-pipeline-parallel)",
        )
        schedule = self.parallel.pipeline_schedule
        check(
            z < 2 or schedule == DEFAULT_PIPELINE_SCHEDULE,
            pipeline_engine_only(schedule),
        )
        if schedule == INTERLEAVED:
            per_micro = self.training.micro_batch_size * self.parallel.data_parallel_size
            counts = sorted({b // per_micro for b in (self.training.global_batch_size, *self.training.batch_sizes())})
            bad = [m for m in counts if m % max(1, m // p)]
            check(
                not bad,
                f"--pp-schedule interleaved with {bad[0] if bad else 0} micro-batches per step on {p} ranks: torch's "
                f"interleaved order runs max(1, M // P) rounds, which must divide M; choose a global batch size "
                f"that gives a multiple of {p} micro-batches (or fewer than {p})",
            )
        check(
            not self.training.cpu_optimizer or self.optimizer.optimizer == "adam",
            f"--cpu-optimizer runs DeepSpeed's CPU Adam, but --optimizer is {self.optimizer.optimizer}; "
            f"use --optimizer adam or drop --cpu-optimizer",
        )

    def _check_distillation(self) -> None:
        """--kd where Megatron-DeepSpeed runs it: GPTModel on DeepSpeed's plain engine (P = 1), any tensor size (the
        full vocabulary's KL divergence here, not upstream's per-shard one: a NOTICE), no grouped-query attention
        (its own assert)."""
        if not self.distillation.distils:
            return
        par, model, data = self.parallel, self.model, self.data
        refusals = (
            (
                par.pipeline_model_parallel_size == 1,
                f"--pipeline-model-parallel-size {par.pipeline_model_parallel_size}: Megatron-DeepSpeed distils "
                "without pipeline parallelism only (its teacher cannot load into a pipeline engine); use "
                "--pipeline-model-parallel-size 1 (--no-pipeline-parallel)",
            ),
            (
                par.ds_sequence_parallel_size == 1,
                f"--ds-sequence-parallel-size {par.ds_sequence_parallel_size}: the teacher sees whole sequences here; "
                "use --ds-sequence-parallel-size 1",
            ),
            (
                model.num_key_value_heads is None,
                f"--num-key-value-heads {model.num_key_value_heads}: Megatron-DeepSpeed refuses grouped-query "
                "attention with --kd ('GQA currently does not support args.kd'); drop --num-key-value-heads",
            ),
            (
                not (data.reset_position_ids or data.reset_attention_mask),
                "--reset-position-ids / --reset-attention-mask: the teacher here runs on whole causal sequences, "
                "not on packed documents; drop them",
            ),
        )
        for ok, why in refusals:
            check(ok, f"{self.distillation.flag} with {why}")

    def _check_experts(self) -> None:
        """Mixture-of-experts runs where Megatron-DeepSpeed runs them: GPTModel on DeepSpeed's plain engine
        (`--no-pipeline-parallel`, ZeRO 0-2) or GPTModelPipe on its pipeline engine (P > 1, ZeRO 0/1), without tensor
        parallelism, ZeRO 1/2 with the experts in optimizer groups of their own, any precision; what is not built
        here is refused."""
        model, par = self.model, self.parallel
        if not model.is_moe:  # one spelling of a dense model: the MoE-only settings change nothing there
            object.__setattr__(self, "optimizer", dataclasses.replace(self.optimizer, create_moe_param_group=False))
            if not self.distillation.distils:
                object.__setattr__(self, "parallel", dataclasses.replace(par, expert_parallel_size=1))
                return
            # a mixture-of-experts teacher (known from its checkpoint: `training/checkpoint/teacher.py`) shares out its
            # experts over the student's expert-parallel groups, as upstream builds it from the student's flags
        else:
            self._check_moe_student()
        ep, dp = par.expert_parallel_size, par.data_parallel_size
        check(
            dp % ep == 0,
            f"--moe-expert-parallel-size {ep} does not divide the data-parallel size {dp}: each group of {ep} "
            f"data-parallel ranks shares out the experts; choose a divisor of {dp}",
        )
        uneven = sorted({n for n in model.experts_per_layer if n > 1 and n % ep})
        check(
            not uneven,
            f"--moe-expert-parallel-size {ep} does not divide {uneven[0] if uneven else 0} experts "
            f"(--num-experts {' '.join(map(str, model.num_experts))}): each rank of the group holds the same number "
            "of experts; choose a divisor of every expert count",
        )

    def _check_moe_student(self) -> None:
        """What a mixture-of-experts model needs of the rest of the tree (one line per refusal)."""
        model, par, train = self.model, self.parallel, self.training
        experts = " ".join(map(str, model.num_experts))
        moe = f"--num-experts {experts}"
        for ok, what, fix in (
            *self._moe_pipeline_refusals(),
            (
                par.tensor_model_parallel_size == 1,
                f"--tensor-model-parallel-size {par.tensor_model_parallel_size}",
                "use --tensor-model-parallel-size 1",
            ),
            (
                par.ds_sequence_parallel_size == 1,
                f"--ds-sequence-parallel-size {par.ds_sequence_parallel_size}",
                "drop it",
            ),
            (
                train.zero_stage < 3,
                f"--zero-stage {train.zero_stage}",
                "use --zero-stage 0, 1 or 2 (DeepSpeed refuses ZeRO-3 with MoE layers)",
            ),
            (
                train.zero_stage == 0 or self.optimizer.create_moe_param_group,
                f"--zero-stage {train.zero_stage} without --create-moe-param-group",
                "add --create-moe-param-group (DeepSpeed's ZeRO optimizer takes the experts in groups of their own, "
                "as the PR-MoE example line gives them)",
            ),
            (self.optimizer.decoupled_lr is None, "--decoupled-lr", "drop it"),
            (
                not self.checkpoint.no_save_optim,
                "--no-save-optim",
                "drop it (DeepSpeed saves each expert in its own file with the optimizer state)",
            ),
        ):
            check(ok, f"{moe} with {what}: mixture-of-experts layers are not built for that here; {fix}")

    def _moe_pipeline_refusals(self) -> list[tuple[bool, str, str]]:
        """What a mixture-of-experts model at pipeline size > 1 (DeepSpeed's pipeline engine, the aggregated
        load-balancing loss passed between stages: `model/moe_loss.py`) is not built for here."""
        par, data = self.parallel, self.data
        if par.pipeline_model_parallel_size == 1:
            return []
        p = f"at --pipeline-model-parallel-size {par.pipeline_model_parallel_size}"
        return [
            (
                par.pipeline_schedule == DEFAULT_PIPELINE_SCHEDULE and par.virtual_stages == 1,
                f"--pp-schedule {par.pipeline_schedule}"
                + (f" ({par.virtual_stages} virtual stages per rank)" if par.virtual_stages > 1 else "")
                + f" {p}",
                f"use --pp-schedule {DEFAULT_PIPELINE_SCHEDULE} (DeepSpeed's own schedule, as Megatron-DeepSpeed's "
                "GPTModelPipe runs MoE models) without virtual stages",
            ),
            (
                not self.training.checkpoint_activations,
                f"--checkpoint-activations (--recompute-granularity full) {p}",
                "use --recompute-granularity selective or no recomputation (DeepSpeed's pipeline engine runs backward "
                "once per tensor a stage sends, the activation and the aggregated load-balancing loss, and its "
                "recomputation keeps what it saved for one backward only), or --pipeline-model-parallel-size 1",
            ),
            (
                not (data.reset_position_ids or data.reset_attention_mask),
                f"--reset-position-ids / --reset-attention-mask {p}",
                "drop them, or use --pipeline-model-parallel-size 1",
            ),
        ]

    @property
    def engine_kind(self) -> str:
        """`plain` (DeepSpeed's DeepSpeedEngine: ZeRO 2/3 at P = 1, Ulysses, --kd and mixture-of-experts models at
        P = 1, as Megatron-DeepSpeed's --no-pipeline-parallel) or `pipeline` (its PipelineEngine, every other run,
        mixture-of-experts models at P > 1 as Megatron-DeepSpeed's GPTModelPipe): which DeepSpeed engine trains this
        run; ZeRO 0/1 keep the pipeline engine at P = 1 too."""
        ulysses = self.parallel.ds_sequence_parallel_size > 1  # its groups exist in the plain engine only
        moe_at_one = self.model.is_moe and self.parallel.pipeline_model_parallel_size == 1
        plain = self.training.zero_stage >= 2 or ulysses or self.distillation.distils or moe_at_one
        return "plain" if plain else "pipeline"

    @property
    def grad_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank."""
        t = self.training
        return t.global_batch_size // (t.micro_batch_size * self.parallel.data_parallel_size)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able nested dict (stored in checkpoints); the derived data-parallel size is included
        for readers of the JSON."""
        d = dataclasses.asdict(self)
        d["parallel"]["data_parallel_size"] = self.parallel.data_parallel_size
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        """Inverse of `to_dict`. Keys a section does not have (the derived `data_parallel_size`) are
        ignored; a field the dict lacks takes its default."""
        d = {name: dict(section) for name, section in d.items() if isinstance(section, dict)}
        sub = {}
        for f in dataclasses.fields(cls):
            if f.name in d:
                klass = SECTIONS[f.name]
                known = {k.name for k in dataclasses.fields(klass)}
                sub[f.name] = klass(**{k: v for k, v in d[f.name].items() if k in known})
        return cls(**sub)

    def replace(self, **sections: Any) -> Config:
        """A copy with whole sections or `section__field=value` entries replaced (checked again)."""
        updates: dict[str, Any] = {}
        fields: dict[str, dict[str, Any]] = {}
        for key, value in sections.items():
            if "__" in key:
                sec, fld = key.split("__", 1)
                fields.setdefault(sec, {})[fld] = value
            else:
                updates[key] = value
        for sec, values in fields.items():  # a section's fields together: checks see the combination
            updates[sec] = dataclasses.replace(updates.get(sec, getattr(self, sec)), **values)
        return dataclasses.replace(self, **updates)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "regularization": RegularizationConfig,
    "parallel": ParallelConfig,
    "data": DataConfig,
    "optimizer": OptimizerConfig,
    "training": TrainingConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "distillation": DistillationConfig,
}
