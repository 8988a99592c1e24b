"""Parsed flags -> validated `Config`. Every check runs before any process group exists."""
from __future__ import annotations

import argparse
import math
import os
from typing import Optional

import torch

from megatron_ds.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainingConfig,
)


class ConfigError(ValueError):
    """A bad flag value; the message names the flag, the value and the fix."""


def _require(args: argparse.Namespace, *names: str) -> None:
    missing = [n for n in names if getattr(args, n) is None]
    if missing:
        flags = ", ".join("--" + n.replace("_", "-") for n in missing)
        raise ConfigError(f"missing required flag(s) {flags}; give a value for each")


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Round up to a multiple of divisible_by x T, as Megatron does (keeps shards aligned)."""
    multiple = divisible_by * tensor_parallel
    return int(math.ceil(vocab_size / multiple) * multiple)


def _vocab_size(args: argparse.Namespace) -> int:
    """Padded vocabulary from --vocab-size and/or the tokenizer (0 only for --print-layout)."""
    if args.make_vocab_size_divisible_by < 1:
        raise ConfigError(f"--make-vocab-size-divisible-by {args.make_vocab_size_divisible_by} must be >= 1")
    tokenizer_vocab = None
    if args.tokenizer_type is not None:
        from megatron_ds.data.tokenizer import build_tokenizer

        tok = build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                              vocab_file=args.vocab_file, merge_file=args.merge_file)
        tokenizer_vocab = tok.vocab_size
    if args.vocab_size is not None:
        if args.vocab_size < 1:
            raise ConfigError(f"--vocab-size {args.vocab_size} must be >= 1")
        if tokenizer_vocab is not None and tokenizer_vocab > args.vocab_size:
            source = args.tokenizer_model or args.vocab_file
            raise ConfigError(f"tokenizer {source} has {tokenizer_vocab} tokens but --vocab-size is "
                              f"{args.vocab_size}; raise --vocab-size or drop it to use the tokenizer's size")
        base = args.vocab_size
    elif tokenizer_vocab is not None:
        base = tokenizer_vocab
    elif args.print_layout:
        return 0
    else:
        raise ConfigError("no vocabulary size: give --vocab-size, or --tokenizer-type with --tokenizer-model "
                          "(or --vocab-file/--merge-file)")
    return padded_vocab_size(base, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)


def _model_config(args: argparse.Namespace) -> ModelConfig:
    _require(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.hidden_size % args.num_attention_heads:
        raise ConfigError(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                          f"{args.num_attention_heads}; choose sizes whose ratio is an integer head size")
    max_pos = args.max_position_embeddings or args.seq_length
    if args.seq_length > max_pos:
        raise ConfigError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings {max_pos}; "
                          f"raise --max-position-embeddings or shorten the sequence")
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, name) < 1.0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be in [0, 1)")
    return ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size, seq_length=args.seq_length,
        max_position_embeddings=max_pos, vocab_size=_vocab_size(args), hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        layernorm_epsilon=args.layernorm_epsilon, normalization=args.normalization,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights)


def _parallel_config(args: argparse.Namespace, model: ModelConfig, world_size: Optional[int]) -> ParallelConfig:
    p, t = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    if p < 1 or t < 1:
        raise ConfigError(f"--pipeline-model-parallel-size {p} and --tensor-model-parallel-size {t} must be >= 1")
    world = world_size or args.world_size or int(os.environ.get("WORLD_SIZE", p * t))
    if world % (p * t):
        raise ConfigError(f"world size {world} is not divisible by --pipeline-model-parallel-size {p} x "
                          f"--tensor-model-parallel-size {t}; launch a multiple of {p * t} processes")
    if t > 1:
        for flag, value in (("--num-attention-heads", model.num_attention_heads),
                            ("--ffn-hidden-size", model.ffn_hidden_size)):
            if value % t:
                raise ConfigError(f"{flag} {value} is not divisible by --tensor-model-parallel-size {t}; "
                                  f"choose a size divisible by {t}")
        if model.vocab_size % t:  # padded by --make-vocab-size-divisible-by x T, so only a guard
            raise ConfigError(f"padded vocabulary size {model.vocab_size} is not divisible by "
                              f"--tensor-model-parallel-size {t}; keep --make-vocab-size-divisible-by >= 1")
    if args.distributed_timeout_minutes <= 0:
        raise ConfigError(f"--distributed-timeout-minutes {args.distributed_timeout_minutes} must be > 0")
    return ParallelConfig(
        pipeline_model_parallel_size=p, tensor_model_parallel_size=t, data_parallel_size=world // (p * t),
        pp_dedicated_embedding_stages=args.pp_dedicated_embedding_stages, pp_layout=args.pp_layout,
        pp_partition_method=args.pp_partition_method, distributed_backend=args.distributed_backend,
        distributed_timeout_minutes=args.distributed_timeout_minutes)


def _training_config(args: argparse.Namespace, parallel: ParallelConfig) -> TrainingConfig:
    mbs = args.micro_batch_size or 1
    dp = parallel.data_parallel_size
    gbs = args.global_batch_size or mbs * dp
    if mbs < 1 or gbs < 1:
        raise ConfigError(f"--micro-batch-size {mbs} and --global-batch-size {gbs} must be >= 1")
    if gbs % (mbs * dp):
        raise ConfigError(f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x "
                          f"data-parallel size {dp}; use a multiple of {mbs * dp}")
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    if precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("--fp16 needs a GPU (DeepSpeed's CPU accelerator has no fp16); use --bf16 or fp32")
    if args.zero_stage > 1:
        # pretrain_gpt.py always runs DeepSpeed's pipeline engine (a 1-stage pipeline when P=1).
        raise ConfigError(f"--zero-stage {args.zero_stage} with --pipeline-model-parallel-size "
                          f"{parallel.pipeline_model_parallel_size}: DeepSpeed's pipeline engine supports ZeRO 0 "
                          f"and 1 only; use --zero-stage 1")
    if args.checkpoint_num_layers < 1:
        raise ConfigError(f"--checkpoint-num-layers {args.checkpoint_num_layers} must be >= 1")
    return TrainingConfig(
        micro_batch_size=mbs, global_batch_size=gbs, train_iters=_train_iters(args, gbs),
        eval_interval=args.eval_interval, eval_iters=args.eval_iters, seed=args.seed, precision=precision,
        zero_stage=args.zero_stage, checkpoint_activations=args.checkpoint_activations,
        checkpoint_num_layers=args.checkpoint_num_layers, deepspeed_config=args.deepspeed_config,
        exit_interval=args.exit_interval)


def _train_iters(args: argparse.Namespace, gbs: int) -> int:
    if args.train_iters is not None and args.train_samples is not None:
        raise ConfigError("--train-iters and --train-samples were both given; keep one")
    if args.train_samples is not None:
        if args.train_samples < 1:
            raise ConfigError(f"--train-samples {args.train_samples} must be >= 1")
        return int(math.ceil(args.train_samples / gbs))
    if args.train_iters is None:
        if args.print_layout:
            return 0
        raise ConfigError("missing --train-iters (or --train-samples); say how long to train")
    if args.train_iters < 1:
        raise ConfigError(f"--train-iters {args.train_iters} must be >= 1")
    return args.train_iters


def _optimizer_config(args: argparse.Namespace, train_iters: int) -> OptimizerConfig:
    if args.lr is None and not args.print_layout:
        raise ConfigError("missing --lr; give the peak learning rate, e.g. --lr 3e-4")
    lr = args.lr if args.lr is not None else 0.0
    if args.clip_grad < 0:
        raise ConfigError(f"--clip-grad {args.clip_grad} must be >= 0 (0 disables clipping)")
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
        raise ConfigError("--lr-warmup-fraction and --lr-warmup-iters were both given; keep one")
    warmup = args.lr_warmup_iters
    decay_iters = args.lr_decay_iters or train_iters
    if args.lr_warmup_fraction is not None:
        if not 0.0 <= args.lr_warmup_fraction <= 1.0:
            raise ConfigError(f"--lr-warmup-fraction {args.lr_warmup_fraction} must be in [0, 1]")
        warmup = int(args.lr_warmup_fraction * decay_iters)
    if args.min_lr > lr and not args.print_layout:
        raise ConfigError(f"--min-lr {args.min_lr} is above --lr {lr}; lower --min-lr")
    return OptimizerConfig(
        optimizer=args.optimizer, lr=lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad, lr_decay_style=args.lr_decay_style,
        lr_decay_iters=decay_iters, lr_warmup_iters=warmup)


def _data_config(args: argparse.Namespace) -> DataConfig:
    if args.mock_data and args.data_path:
        raise ConfigError("--mock-data and --data-path were both given; keep one")
    return DataConfig(
        data_path=tuple(args.data_path), split=args.split, data_cache_path=args.data_cache_path,
        mock_data=args.mock_data, tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file, merge_file=args.merge_file,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, num_workers=args.num_workers,
        eod_mask_loss=args.eod_mask_loss)


def build_config(args: argparse.Namespace, world_size: Optional[int] = None) -> Config:
    """Validate the parsed flags and build the frozen config tree (layout checked too)."""
    model = _model_config(args)
    parallel = _parallel_config(args, model, world_size)
    training = _training_config(args, parallel)
    config = Config(
        model=model, parallel=parallel, data=_data_config(args),
        optimizer=_optimizer_config(args, training.train_iters), training=training,
        checkpoint=CheckpointConfig(save=args.save, save_interval=args.save_interval, load=args.load,
                                    load_optional=args.load_optional, no_load_optim=args.no_load_optim,
                                    no_load_rng=args.no_load_rng, finetune=args.finetune),
        logging=LoggingConfig(log_interval=args.log_interval, tensorboard_dir=args.tensorboard_dir,
                              log_memory=args.log_memory))
    build_run_layout(config)  # fail fast on impossible layouts
    return config


def memory_inputs(config: Config):
    """The memory model's inputs for this run (what `--pp-partition-method memory` balances)."""
    from megatron_ds.plan.memory_model import MemoryInputs

    t, par = config.training, config.parallel
    return MemoryInputs(model=config.model, micro_batch_size=t.micro_batch_size,
                        num_micro_batches=config.grad_accumulation_steps, precision=t.precision,
                        zero_stage=t.zero_stage, data_parallel_size=par.data_parallel_size,
                        tensor_parallel_size=par.tensor_model_parallel_size,
                        checkpoint_activations=t.checkpoint_activations,
                        checkpoint_num_layers=t.checkpoint_num_layers, optimizer=config.optimizer.optimizer,
                        device="cuda" if torch.cuda.is_available() else "cpu")


def uses_memory_model(config: Config) -> bool:
    par = config.parallel
    return par.pp_partition_method == "memory" or (par.pp_layout or "").strip().lower() == "auto"


def build_run_layout(config: Config):
    """The layout this run uses (raises LayoutError, a ValueError, on impossible options)."""
    from megatron_ds.model.naming import gpt_spec_groups, gpt_spec_param_counts
    from megatron_ds.pipeline.layout import LayoutError, build_layout

    par = config.parallel
    weights = None
    if par.pp_partition_method == "parameters":
        weights = gpt_spec_param_counts(config.model)
    mem = None
    if uses_memory_model(config):
        if config.model.vocab_size == 0:
            raise LayoutError("--pp-partition-method memory needs the vocabulary size: give --vocab-size or a "
                              "tokenizer")
        mem = memory_inputs(config)
    return build_layout(gpt_spec_groups(config.model), par.pipeline_model_parallel_size,
                        dedicated=par.pp_dedicated_embedding_stages, layout=par.pp_layout,
                        partition_method=par.pp_partition_method, spec_weights=weights, memory_inputs=mem)


def predicted_memory_table(config: Config, layout) -> str:
    """Predicted memory per stage (the memory model), printed under the layout."""
    from megatron_ds.pipeline.balance import format_memory_table
    from megatron_ds.plan.memory_model import stage_memory

    return format_memory_table(stage_memory(memory_inputs(config), layout))
