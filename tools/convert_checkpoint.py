#!/usr/bin/env python
"""Convert checkpoints to and from Hugging Face model directories and Megatron-DeepSpeed, and to the universal form.

    # ours (any P, T, DP, layout) -> a transformers / lm-eval-harness / vLLM directory
    python tools/convert_checkpoint.py --to hf checkpoints/gpt hf/gpt
    # a local Hugging Face GPT-2, Llama, Qwen2, Qwen3, Mistral or Phi-3 directory -> a checkpoint pretrain_gpt.py --load trains from
    python tools/convert_checkpoint.py --from hf hf/llama checkpoints/llama --tensor-model-parallel-size 2
    # ours -> the layout-free training state (weights, fp32 masters, Adam moments, schedule, data
    # position) that `pretrain_gpt.py --load OUT` resumes under any P, layout, T, DP or ZeRO stage
    python tools/convert_checkpoint.py --to universal checkpoints/gpt checkpoints/gpt-universal
    # a Megatron-DeepSpeed (GPTModelPipe) checkpoint, any T and P -> ours: weights, and its whole training
    # state in universal form (`pretrain_gpt.py --load OUT` continues the run under any layout)
    python tools/convert_checkpoint.py --from megatron-deepspeed mds/checkpoints checkpoints/mds
    # a Megatron-LM (megatron-core GPTModel) checkpoint, --ckpt-format torch_dist or torch, any T and P ->
    # ours: weights, Adam's state (torch_dist, when named by tensor), counters and schedule
    python tools/convert_checkpoint.py --from megatron-lm mlm/checkpoints checkpoints/mlm

With --from hf, pretrain_gpt.py flags pass through (T, sequence length, tokenizer, ...); architecture
flags come from config.json and must agree if given. With --from megatron-deepspeed everything comes
from the run's saved args (so with --from megatron-lm); its fused QKV rows are taken in current Megatron-DeepSpeed's order unless
--qkv-layout interleaved (releases before Dec 2024; see docs/interop.md). The output directory must not exist; it
appears only when complete. Bad input: one `error:` line, exit status 2, nothing written.
The Hugging Face directions need the `hf` extra (`pip install -e '.[hf]'`); see docs/interop.md.
`--load` converts to the universal form by itself when needed; see docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

# The checkout this tool lives in comes first (as pretrain_gpt.py's own directory does for it).
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_ds.errors import OneLineArgumentParser, UserError, interrupted, stop_cleanly_on_sigterm

MEGATRON_DEEPSPEED = "megatron-deepspeed"
MEGATRON_LM = "megatron-lm"
QKV_LAYOUTS = ("blocked", "interleaved")
"""`megatron_ds.interop.megatron_deepspeed_layout.QKV_LAYOUTS` (this tool imports no torch for --help)."""
HF_EXTRA = ("safetensors", "transformers", "tokenizers")
"""Packages of the `hf` extra; a missing one is reported as one line."""
TOKENIZER_FLAGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        description=__doc__.splitlines()[0], allow_abbrev=False, command="python tools/convert_checkpoint.py"
    )
    way = p.add_mutually_exclusive_group(required=True)
    way.add_argument(
        "--to",
        choices=("hf", "universal"),
        help="export our checkpoint SOURCE as a Hugging Face directory OUTPUT, or its whole training state "
        "in universal (layout-free) form",
    )
    way.add_argument(
        "--from",
        dest="from_",
        choices=("hf", MEGATRON_DEEPSPEED, MEGATRON_LM),
        help="import Hugging Face directory SOURCE, or Megatron-DeepSpeed or Megatron-LM checkpoint SOURCE, as OUTPUT",
    )
    p.add_argument("source")
    p.add_argument("output")
    p.add_argument("--vocab-size", type=int, default=None, help="export: vocabulary rows to keep (default: see docs)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="export: convert weights")
    p.add_argument("--max-shard-size-mb", type=int, default=2048, help="export: largest safetensors file")
    p.add_argument(
        "--hf-model-type",
        default=None,
        help="export: the config.json's model_type when the model has more than one exact form: `mistral` for a "
        "Llama without biases (default: gpt2, llama, qwen2, qwen3, phi3 or, with experts, mixtral, whichever the "
        "model is)",
    )
    for flag in TOKENIZER_FLAGS:
        p.add_argument("--" + flag.replace("_", "-"), default=None, help="tokenizer override (export) or flag (import)")
    p.add_argument(
        "--qkv-layout",
        choices=QKV_LAYOUTS,
        default=None,
        help="--from megatron-deepspeed: the fused QKV rows of each tensor rank, `blocked` (all q, then k, then v: "
        "Megatron-DeepSpeed since Dec 2024, the default) or `interleaved` (per head group: older releases, and the "
        "default for what its tools/hf2megads_weight_converter.py wrote)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run(argv: Sequence[str] | None = None) -> None:
    args, rest = build_parser().parse_known_args(argv)
    tokenizer = {k: getattr(args, k) for k in TOKENIZER_FLAGS}
    if args.qkv_layout is not None and args.from_ != MEGATRON_DEEPSPEED:
        raise UserError("--qkv-layout applies to --from megatron-deepspeed only; drop it")
    if args.hf_model_type is not None and args.to != "hf":
        raise UserError("--hf-model-type applies to --to hf only; drop it")
    _check_output_outside_source(args.source, args.output)
    if args.from_ == MEGATRON_DEEPSPEED:
        _from_megatron_deepspeed(args, rest, tokenizer)
    elif args.from_ == MEGATRON_LM:
        _from_megatron_lm(args, rest, tokenizer)
    elif args.to == "universal":
        _to_universal(args, rest, tokenizer)
    elif args.to:
        if rest:
            raise UserError(f"unrecognized arguments: {' '.join(rest)}; pretrain_gpt.py flags go with --from hf")
        _export(args, tokenizer)
    else:
        if args.dtype is not None or args.max_shard_size_mb != 2048:
            raise UserError("--dtype and --max-shard-size-mb apply to --to hf only; drop them")
        passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in tokenizer.items() if v is not None]
        if args.vocab_size is not None:
            passthrough.append(f"--vocab-size={args.vocab_size}")
        _import(args, [*rest, *passthrough])


def _check_output_outside_source(source: str, output: str) -> None:
    """A conversion never writes into its source: not the source itself, not a directory inside it."""
    src, out = os.path.realpath(source), os.path.realpath(output)
    if os.path.isdir(src) and os.path.commonpath([src, out]) == src:
        raise UserError(
            f"OUTPUT {output} is SOURCE {source} or inside it; a conversion never writes into its source: give "
            f"a directory outside it"
        )


def _export(args: argparse.Namespace, tokenizer: dict[str, str | None]) -> None:
    from megatron_ds.interop.hf_export import export_hf

    if args.max_shard_size_mb < 1:
        raise UserError(f"--max-shard-size-mb {args.max_shard_size_mb} must be >= 1 (default 2048)")

    result = export_hf(
        args.source,
        args.output,
        vocab_size=args.vocab_size,
        dtype=args.dtype,
        tokenizer=tokenizer,
        max_shard_bytes=args.max_shard_size_mb * 1024**2,
        show_progress=not args.no_progress,
        model_type=args.hf_model_type,
    )
    print(
        f"exported {os.path.abspath(args.source)} as Hugging Face {result.arch} "
        f"({result.num_tensors} tensors, vocabulary {result.vocab_size}) to {result.output}:"
    )
    print("  " + " ".join(result.files))
    for note in result.notes:
        print(f"note: {note}")
    print(f"load it with: AutoModelForCausalLM.from_pretrained({result.output!r})")


def _to_universal(args: argparse.Namespace, rest: list[str], tokenizer: dict[str, str | None]) -> None:
    hf_only = [k for k, v in {"--vocab-size": args.vocab_size, "--dtype": args.dtype, **tokenizer}.items() if v]
    if args.max_shard_size_mb != 2048:
        hf_only.append("--max-shard-size-mb")
    if rest or hf_only:
        raise UserError(f"--to universal takes SOURCE OUTPUT only; drop {' '.join([*rest, *hf_only])}")
    from megatron_ds.training.checkpoint.universal.convert import convert_checkpoint

    summary = convert_checkpoint(args.source, args.output, show_progress=not args.no_progress)
    print(summary.line())
    print(
        f"resume with: pretrain_gpt.py --load {summary.output} (any pipeline, tensor or data-parallel size, layout or ZeRO stage)"
    )


def _saved_args_only(args: argparse.Namespace, rest: list[str]) -> None:
    """--from megatron-deepspeed / megatron-lm take the model and run from the checkpoint's saved args."""
    others = [*rest, *(f for f, v in (("--vocab-size", args.vocab_size), ("--dtype", args.dtype)) if v is not None)]
    if args.max_shard_size_mb != 2048:
        others.append("--max-shard-size-mb")
    if others:
        raise UserError(
            f"--from {args.from_} takes the model and run from the checkpoint's saved args; drop {' '.join(others)}"
        )


def _print_continuation(notes: list[str], output: str, train_flags: list[str]) -> None:
    """After an upstream conversion: its notices and the command that continues the run."""
    for note in notes:
        print(f"NOTICE: {note}")
    print("continue the run with its flags (any parallel layout; with --finetune: a new run from its weights):")
    print(f"  pretrain_gpt.py --load {output} " + " ".join(train_flags))


def _from_megatron_deepspeed(args: argparse.Namespace, rest: list[str], tokenizer: dict[str, str | None]) -> None:
    _saved_args_only(args, rest)
    from megatron_ds.interop.megatron_deepspeed import import_megatron_deepspeed

    result = import_megatron_deepspeed(
        args.source, args.output, args.qkv_layout, tokenizer, show_progress=not args.no_progress
    )
    par = result.config.parallel
    carried = f"optimizer state ({', '.join(result.states)})" if result.states else "no optimizer state"
    print(
        f"converted Megatron-DeepSpeed {os.path.abspath(args.source)} ({result.tag}, iteration {result.iteration}, "
        f"T={par.tensor_model_parallel_size} P={par.pipeline_model_parallel_size}, QKV rows "
        f"{result.qkv_layout}) to {result.output}: weights and {carried}"
    )
    _print_continuation(result.notes, result.output, result.train_flags)


def _from_megatron_lm(args: argparse.Namespace, rest: list[str], tokenizer: dict[str, str | None]) -> None:
    _saved_args_only(args, rest)
    from megatron_ds.interop.megatron_lm import import_megatron_lm

    result = import_megatron_lm(args.source, args.output, tokenizer, show_progress=not args.no_progress)
    src = result.source
    carried = f"optimizer state ({', '.join(result.states)})" if result.states else "no optimizer state"
    print(
        f"converted Megatron-LM {os.path.abspath(args.source)} ({os.path.basename(src.directory)}, {src.format}, "
        f"iteration {result.iteration}, T={src.tensor_parallel} P={src.pipeline_parallel}) to {result.output}: weights, "
        f"{carried}, counters and learning-rate schedule"
    )
    _print_continuation(result.notes, result.output, result.train_flags)


def _import(args: argparse.Namespace, argv: list[str]) -> None:
    from megatron_ds.interop.hf_import import import_hf

    result = import_hf(args.source, args.output, argv, show_progress=not args.no_progress)
    par = result.config.parallel
    loads = (
        "in universal form: loads at any pipeline size, layout, world size and --moe-expert-parallel-size"
        if result.config.model.is_moe
        else f"tensor-parallel size {par.tensor_model_parallel_size}; loads at any pipeline size and layout"
    )
    print(
        f"imported Hugging Face {result.arch} {os.path.abspath(args.source)} to {result.output} (weights only, {loads})"
    )
    for note in result.notes:
        print(f"note: {note}")
    print("train from it with these model flags plus your own (parallelism, data, schedule):")
    print(f"  pretrain_gpt.py --load {result.output} " + " ".join(result.train_flags))


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # converting needs no accelerator (and no detection notice)
    try:
        run(argv)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return interrupted()
    except ImportError as err:
        if err.name not in HF_EXTRA:
            raise
        print(f"error: {err.name}: not installed; install the hf extra: pip install -e '.[hf]'", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    stop_cleanly_on_sigterm()
    sys.exit(main())
