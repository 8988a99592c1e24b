"""Flags -> model and parallel options where Megatron-LM and Megatron-DeepSpeed spell one thing two
ways, or where a value changes nothing here: the norm (`--normalization`, `--apply-layernorm-1p`),
position embeddings (`--position-embedding-type`, `--use-rotary-position-embeddings`), grouped-query
attention (`--num-key-value-heads`, `--group-query-attention --num-query-groups`), sequence and
context parallelism, recomputation (`--checkpoint-activations`, `--recompute-*`), the ZeRO stage of `--use-distributed-optimizer`, and the notices for flags whose
effect here differs in form (`--ckpt-format`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from megatron_ds.errors import ConfigError
from megatron_ds.flags.declare import flag_of
from megatron_ds.flags.notices import notice
from megatron_ds.model import norms


def normalization(args: argparse.Namespace) -> tuple[str, str | None]:
    """(the norm's registry name, a warning or None) for --normalization and --apply-layernorm-1p."""
    norm, warning = norms.from_flags(args.normalization, args.apply_layernorm_1p)
    return norm.name, warning


def position_embeddings(args: argparse.Namespace) -> tuple[bool, bool]:
    """(rotary embeddings?, learned position table?) from Megatron-DeepSpeed's and Megatron-LM's flags."""
    kind = args.position_embedding_type
    rotary = args.use_rotary_position_embeddings or kind == "rope"
    if args.use_rotary_position_embeddings and kind not in (None, "rope"):
        raise ConfigError(f"--use-rotary-position-embeddings and --position-embedding-type {kind} disagree; keep one")
    if kind == "learned_absolute" and not args.add_position_embedding:
        raise ConfigError("--position-embedding-type learned_absolute and --no-position-embedding disagree; keep one")
    # Rotary embeddings replace the learned position table (the pre group then has none).
    table = args.add_position_embedding and not rotary and kind != "none"
    return rotary, table


def key_value_heads(args: argparse.Namespace) -> int | None:
    """--num-key-value-heads, or Megatron-LM's --group-query-attention with --num-query-groups (1 when
    not given, megatron-core's default; ignored without --group-query-attention, as there)."""
    groups = (1 if args.num_query_groups is None else args.num_query_groups) if args.group_query_attention else None
    if groups is not None and groups < 1:
        raise ConfigError(f"--num-query-groups {groups} must be >= 1 (it divides --num-attention-heads)")
    if groups is not None and args.num_key_value_heads is not None and groups != args.num_key_value_heads:
        raise ConfigError(
            f"--num-key-value-heads {args.num_key_value_heads} and --num-query-groups {groups} disagree; keep one"
        )
    return args.num_key_value_heads if groups is None else groups


def zero_stage(args: argparse.Namespace, absent: Callable[[], int]) -> int:
    """--zero-stage (when not given, `absent()`: the user JSON's stage, else 0), or 1 for Megatron's
    --use-distributed-optimizer."""
    if not args.use_distributed_optimizer:
        return absent() if args.zero_stage is None else args.zero_stage
    if args.zero_stage not in (None, 1):
        raise ConfigError(
            f"--use-distributed-optimizer is ZeRO stage 1 here but --zero-stage is {args.zero_stage}; drop one"
        )
    return 1


def sequence_parallel(args: argparse.Namespace) -> bool:
    """--sequence-parallel: Megatron's meaning at T > 1; at T=1 it changes nothing (Megatron-LM turns it off)."""
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        notice("--sequence-parallel changes nothing at --tensor-model-parallel-size 1 (Megatron-LM turns it off)")
        return False
    return bool(args.sequence_parallel)


def check_parallel_modes(args: argparse.Namespace) -> None:
    """Context parallelism above 1 is not implemented."""
    if args.context_parallel_size != 1:
        raise ConfigError(
            f"--context-parallel-size {args.context_parallel_size} is not supported: context parallelism is not "
            f"implemented; use --context-parallel-size 1 (or --ds-sequence-parallel-size, DeepSpeed-Ulysses)"
        )


def _one_of(args: argparse.Namespace, *dests: str) -> object | None:
    """The value of whichever of two equivalent flags was given; both, differing, is an error."""
    given = [(d, getattr(args, d)) for d in dests if getattr(args, d) is not None]
    if len({v for _, v in given}) > 1:
        raise ConfigError(f"{' and '.join(f'{flag_of(d)} {v}' for d, v in given)} disagree; keep one")
    return given[0][1] if given else None


def recompute(args: argparse.Namespace, warn: Callable[[str], None]) -> tuple[bool, int, bool]:
    """(full recomputation?, layers per chunk, selective recomputation?) from --checkpoint-activations,
    --recompute-activations and Megatron's --recompute-* flags."""
    method = _one_of(args, "recompute_method", "activations_checkpoint_method")
    layers = _one_of(args, "recompute_num_layers", "activations_checkpoint_num_layers")
    granularity = args.recompute_granularity
    if args.recompute_activations:  # Megatron: --recompute-activations is granularity `selective`
        if granularity == "full":
            raise ConfigError("--recompute-activations (selective) and --recompute-granularity full disagree; keep one")
        granularity = "selective"
    if granularity is None and args.activations_checkpoint_method is not None:
        granularity = "full"  # the older flag alone turned recomputation on
    if granularity == "full" and method is None:
        raise ConfigError("--recompute-granularity full needs --recompute-method uniform; add it")
    if granularity != "full" and (method is not None or layers is not None):
        raise ConfigError("--recompute-method/--recompute-num-layers need --recompute-granularity full; add it")
    # Megatron-DeepSpeed's GPTModelPipe: --checkpoint-activations uses --checkpoint-num-layers, else
    # full/uniform recomputation uses --recompute-num-layers.
    ckpt_layers = args.checkpoint_num_layers
    if (
        args.checkpoint_activations
        and granularity == "full"
        and None not in (ckpt_layers, layers)
        and ckpt_layers != layers
    ):
        raise ConfigError(
            f"--checkpoint-num-layers {ckpt_layers} and --recompute-num-layers {layers} disagree; keep one"
        )
    if args.checkpoint_activations:
        chunk = 1 if ckpt_layers is None else ckpt_layers  # its default, 1, even beside --recompute-num-layers
        if layers is not None and layers != chunk:
            warn(
                f"--recompute-num-layers {layers} is not used with --checkpoint-activations: Megatron-DeepSpeed's "
                f"GPTModelPipe recomputes in chunks of --checkpoint-num-layers ({chunk}); give --checkpoint-num-layers "
                f"{layers} for chunks of {layers}"
            )
    else:
        given = layers if granularity == "full" else ckpt_layers
        chunk = 1 if given is None else given
    full = args.checkpoint_activations or granularity == "full"
    if args.deepspeed_activation_checkpointing and not full:
        warn(
            "--deepspeed-activation-checkpointing recomputes nothing by itself; add --checkpoint-activations "
            "or --recompute-granularity full --recompute-method uniform"
        )
    return full, chunk, granularity == "selective"  # chunk >= 1: TrainingConfig's check


def check_loss_options(args: argparse.Namespace) -> None:
    """--calculate-per-token-loss equals the mean of micro-batch means unless micro-batches count
    different numbers of tokens, which --eod-mask-loss makes happen (padding only at the end of a
    dataset, which the loop warns about)."""
    if args.calculate_per_token_loss and args.eod_mask_loss:
        raise ConfigError(
            "--calculate-per-token-loss with --eod-mask-loss is not supported: masked tokens make micro-batches "
            "count different numbers of tokens, and the per-token average over the global batch is not "
            "implemented; drop one of them"
        )


def check_logging_options(args: argparse.Namespace, zero_stage: int) -> None:
    """Zeros in gradients are counted in the module's reduced gradients, which ZeRO-1 keeps in its
    partitions instead."""
    if args.log_num_zeros_in_grad and zero_stage:
        raise ConfigError(
            f"--log-num-zeros-in-grad with ZeRO stage {zero_stage} is not supported: ZeRO keeps the reduced "
            f"gradients in its partitions, where they are not counted; use --zero-stage 0 or drop the flag"
        )


def format_notices(args: argparse.Namespace) -> None:
    if args.ckpt_format is not None:
        notice(
            f"--ckpt-format {args.ckpt_format}: checkpoints are written in DeepSpeed's format with our "
            f"megatron_ds.json (docs/checkpoints.md); like torch_dist they resume under any P, T, DP and layout"
        )
