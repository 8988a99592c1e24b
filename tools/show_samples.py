#!/usr/bin/env python
"""Print the first training samples a pretrain_gpt.py line would read, in training order.

    python tools/show_samples.py --data-path data/corpus_text_document --split 98,2,0 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --seq-length 1024 --micro-batch-size 4 --global-batch-size 256 --train-iters 1000 --num-samples 4

Takes pretrain_gpt.py's flags (a whole launch line works; the data, tokenizer, batch, length, split
and seed flags decide the samples, with --data-upstream and --misaligned-append-eod) plus
--num-samples N, and --consumed-samples K to start after K samples (where a resumed run continues).
A finetune_llama.py line (add --prompt-data) prints its examples' samples and what each trains on.
Prints each sample's seq_length + 1 token ids (tokens, then the last label), with the decoded text
when a tokenizer is given; `--json` prints `{"samples": [[ids], ...]}` alone on stdout (the split
report goes to stderr). The global batch defaults to --micro-batch-size times the data-parallel size
of --world-size (or $WORLD_SIZE, else 1). Bad input: one `error:` line, exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_ds.config import TrainingConfig
from megatron_ds.config.checks import at_least
from megatron_ds.config.training import check_global_batch
from megatron_ds.errors import ConfigError, UserError, interrupted, stop_cleanly_on_sigterm
from megatron_ds.flags import compat, step_flags
from megatron_ds.flags.lengths import train_length
from megatron_ds.flags.parser import build_parser
from megatron_ds.flags.to_config import data_config, direct_values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = build_parser()
    p.prog, p.description = "show_samples.py", __doc__.splitlines()[0]
    g = p.add_argument_group("show_samples.py")
    g.add_argument("--num-samples", type=int, default=8, help="samples to print (default: 8)")
    g.add_argument("--consumed-samples", type=int, default=0, help="start after this many training samples")
    g.add_argument("--json", action="store_true", help='print {"samples": [[ids], ...]} only')
    args, unknown = p.parse_known_args(argv)
    if args.refused_flags:
        raise ConfigError(compat.refused_flags_message(list(args.refused_flags)))
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    for flag in ("num_samples", "consumed_samples"):
        if getattr(args, flag) < 0:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 0")
    if args.seq_length is None:
        raise ConfigError("missing --seq-length; give the training line's sequence length")
    at_least("--seq-length", args.seq_length, 1)  # pretrain_gpt.py checks it with the model, not built here
    return args


def data_parallel_size(args: argparse.Namespace) -> int:
    """The line's data-parallel size: --world-size (or $WORLD_SIZE, else 1) over T x P."""
    world = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    return max(1, world // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size))


def training_config(args: argparse.Namespace) -> TrainingConfig:
    """What decides the sample order of a line: batch sizes, training length, evaluation, seed."""
    direct = direct_values(args).get("training", {})
    mbs = 1 if args.micro_batch_size is None else args.micro_batch_size
    dp = data_parallel_size(args)
    schedule = step_flags.step_schedule(args.step_batch_size_schedule, args.seq_length)
    gbs = step_flags.global_batch_size(args, schedule, mbs * dp)
    keep = {k: direct[k] for k in ("eval_interval", "eval_iters", "seed")}
    training = TrainingConfig(  # the batch sizes that decide the training length, as pretrain_gpt.py's
        micro_batch_size=mbs,
        global_batch_size=gbs,
        rampup_batch_size=step_flags.rampup(args),
        step_batch_size_schedule=schedule,
        curriculum=step_flags.curriculum(args.deepspeed_config),
        **keep,
    )
    check_global_batch(gbs, mbs, dp)
    sizes = training if training.varies else None
    iters = train_length(args, gbs, args.seq_length, sizes)[0]
    return dataclasses.replace(training, train_iters=iters, train_samples=args.train_samples)


def samples(args: argparse.Namespace) -> tuple[list[list[int]], Any, list[list[int]] | None]:
    """The ids of samples [consumed, consumed + num_samples) of the training split, the tokenizer, and for prompt
    data (`--prompt-data`, finetune_llama.py's) the ids each sample trains on."""
    from megatron_ds.data.gpt_data import build_gpt_datasets
    from megatron_ds.data.splits import check_train_share, requested_samples
    from megatron_ds.data.tokenizer import build_tokenizer

    data = data_config(args, direct_values(args).get("data", {}))
    training = training_config(args)
    if not data.prompt_data and not data.has_split_paths:
        check_train_share(data.split, training.train_iters)
    tokenizer = None
    if data.tokenizer_type:
        tokenizer = build_tokenizer(
            data.tokenizer_type,
            data.tokenizer_model,
            data.vocab_file,
            data.merge_file,
            vocab_size=args.vocab_size,
            null_eod_id=data.null_tokenizer_eod_id,
            null_pad_id=data.null_tokenizer_pad_id,
        )
    if data.prompt_data:
        return prompt_samples(args, data, training, tokenizer)
    vocab = args.vocab_size or (tokenizer.vocab_size if tokenizer else 0)
    train, _, _ = build_gpt_datasets(
        data, args.seq_length, training.seed, requested_samples(training), tokenizer, vocab
    )
    end = args.consumed_samples + args.num_samples
    if end > len(train):
        raise ConfigError(
            f"--consumed-samples {args.consumed_samples} --num-samples {args.num_samples}: the training split "
            f"has {len(train)} samples for this line; ask for fewer"
        )
    rows = [train[i] for i in range(args.consumed_samples, end)]
    if tokenizer is not None:  # the training's check: text is printed for ids the tokenizer has
        import torch

        from megatron_ds.data.vocab_check import Vocabulary, check_sample

        files = " ".join(f for f in (data.tokenizer_model, data.vocab_file) if f)
        source = f"--tokenizer-type {data.tokenizer_type}{' ' + files if files else ''}"
        for i, r in enumerate(rows, args.consumed_samples):
            ids = torch.cat([r["tokens"], r["labels"][-1:]])
            check_sample(train, i, ids, Vocabulary(min(vocab, tokenizer.vocab_size), source))
    return [r["tokens"].tolist() + [int(r["labels"][-1])] for r in rows], tokenizer, None


def prompt_samples(
    args: argparse.Namespace, data: Any, training: TrainingConfig, tokenizer: Any
) -> tuple[list[list[int]], Any, list[list[int]]]:
    """finetune_llama.py's samples in training order: each example's seq_length + 1 ids (padded) and the ids it
    trains on (the response and its eos), pass after pass with --repeated-dataloader."""
    from megatron_ds.config import padded_vocab_size
    from megatron_ds.data.batches import samples_per_pass
    from megatron_ds.data.prompt_data import PromptData, check_one_pass

    if tokenizer is None or not data.data_path:
        raise ConfigError(
            "--prompt-data needs --data-path EXAMPLES.json and --tokenizer-type HFTokenizer --tokenizer-model DIR"
        )
    vocab = args.vocab_size or padded_vocab_size(
        tokenizer.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
    )
    dataset = PromptData(data.data_path[0], tokenizer, args.seq_length, vocab)
    per_pass = samples_per_pass(len(dataset), training.micro_batch_size, data_parallel_size(args))
    check_one_pass(data.data_path[0], len(dataset), per_pass)
    end = args.consumed_samples + args.num_samples
    if end > per_pass and not data.repeated_dataloader:
        raise ConfigError(
            f"--consumed-samples {args.consumed_samples} --num-samples {args.num_samples}: one pass over "
            f"{data.data_path[0]} gives {per_pass} samples; ask for fewer or add --repeated-dataloader"
        )
    print(f"prompt data: {len(dataset)} examples in {data.data_path[0]}, {per_pass} samples per pass")
    order = [k % per_pass for k in range(args.consumed_samples, end)]
    rows = [dataset[k] for k in order]
    ids = [dataset.ids[k].tolist() for k in order]  # the example's seq_length + 1 ids, padding included
    return ids, tokenizer, [r["labels"][r["loss_mask"].bool()].tolist() for r in rows]


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        args = parse_args(argv)
        report = sys.stderr if args.json else sys.stdout
        with contextlib.redirect_stdout(report):  # the notices and split report of the build
            ids, tokenizer, trained = samples(args)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return interrupted()
    if args.json:
        print(json.dumps({"samples": ids} if trained is None else {"samples": ids, "trained": trained}))
        return 0
    for k, row in enumerate(ids, args.consumed_samples):
        print(f"sample {k}: {' '.join(map(str, row))}")
        if tokenizer is not None:
            shown = row if trained is None else [i for i in row if i != tokenizer.pad]  # not the padding
            print(f"  text: {tokenizer.detokenize(shown)!r}")
        if trained is not None:
            print(f"  trained on: {tokenizer.detokenize(trained[k - args.consumed_samples])!r}")
    return 0


if __name__ == "__main__":
    stop_cleanly_on_sigterm()
    sys.exit(main())
