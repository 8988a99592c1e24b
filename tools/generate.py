#!/usr/bin/env python
"""Sample text from a checkpoint in one process (no launcher), with its tokenizer.

    python tools/generate.py --load checkpoints/gpt_cpu_demo --prompt "def " --max-new-tokens 40
    python tools/generate.py --load CKPT --prompt-ids "1 2 3" --greedy      # checkpoints without a tokenizer

Greedy (`--greedy` or `--temperature 0`), or sampling with --temperature, --top-k, --top-p and
--seed; a KV cache unless --no-kv-cache. Stops after the end-of-document token. Bad input: one
`error:` line, exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

# The checkout this tool lives in comes first (as pretrain_gpt.py's own directory does for it).
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_ds.errors import OneLineArgumentParser, UserError, stop_cleanly_on_sigterm, tool_main

TOKENIZER_FLAGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        description=__doc__.splitlines()[0], allow_abbrev=False, command="python tools/generate.py"
    )
    p.add_argument("--load", required=True, help="checkpoint directory (or one of its global_step directories)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, tokenized with the checkpoint's tokenizer")
    prompt.add_argument("--prompt-ids", help="space-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--greedy", action="store_true", help="always the most likely token (= --temperature 0)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely tokens of this total mass")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence at every step")
    p.add_argument("--vocab-size", type=int, default=None, help="vocabulary rows (default: see docs/interop.md)")
    for flag in TOKENIZER_FLAGS:
        p.add_argument("--" + flag.replace("_", "-"), default=None, help="override the checkpoint's tokenizer")
    return p


def run(argv: Sequence[str] | None = None) -> list[int]:
    args = build_parser().parse_args(argv)
    from megatron_ds.inference import generate, load_model
    from megatron_ds.training.checkpoint.reader import checkpoint_tokenizer, open_checkpoint

    overrides = {k: getattr(args, k) for k in TOKENIZER_FLAGS}
    tok = checkpoint_tokenizer(open_checkpoint(args.load, moe=True), overrides)
    if args.prompt is not None and tok is None:
        raise UserError(
            f"--load {args.load}: the checkpoint has no tokenizer (mock data); give --prompt-ids or --tokenizer-*"
        )
    try:
        prompt = tok.tokenize(args.prompt) if args.prompt is not None else [int(x) for x in args.prompt_ids.split()]
    except ValueError:
        raise UserError(f"--prompt-ids {args.prompt_ids!r}: expected space-separated integers") from None
    model = load_model(args.load, vocab_size=args.vocab_size, tokenizer=overrides)
    if tok is not None and any(overrides.values()) and tok.vocab_size > model.config.vocab_size:
        given = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in overrides.items() if v)
        raise UserError(
            f"{given}: the tokenizer has {tok.vocab_size} tokens, the model {args.load} {model.config.vocab_size} "
            f"vocabulary rows; give the tokenizer the model was trained with"
        )
    limit = tok.vocab_size if tok is not None and tok.vocab_size < model.config.vocab_size else None
    if limit is not None and max(prompt, default=0) >= limit:  # a padding row: no text to print for it
        raise UserError(
            f"--prompt-ids {args.prompt_ids!r}: id {max(prompt)} is not in the tokenizer's {limit} tokens (the model's "
            f"rows from {limit} on are padding); give ids below {limit}"
        )
    t0 = time.time()
    new = generate(
        model,
        prompt,
        args.max_new_tokens,
        temperature=0.0 if args.greedy else args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_id=tok.eod if tok is not None else None,
        use_cache=not args.no_kv_cache,
        vocab_limit=limit,
    )
    seconds = time.time() - t0
    if tok is not None:
        print(tok.detokenize(prompt + [i for i in new if i != tok.eod]))
    else:
        print(" ".join(map(str, new)))
    print(f"[{len(new)} tokens in {seconds:.2f} s from {os.path.abspath(args.load)}]", file=sys.stderr)
    return new


def main(argv: Sequence[str] | None = None) -> int:
    return tool_main(lambda: run(argv))


if __name__ == "__main__":
    stop_cleanly_on_sigterm()
    sys.exit(main())
