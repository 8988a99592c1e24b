"""Sampling: greedy, temperature, top-k, top-p, seeded; with a KV cache by default."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from megatron_ds.errors import UserError
from megatron_ds.inference.model import GPTModel, KVCache


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Next ids (b,) from last-position logits (b, v). temperature 0: greedy (argmax)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass of the better tokens
        sorted_logits = sorted_logits.masked_fill(before >= top_p, float("-inf"))  # the best always stays
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.float().softmax(dim=-1).cpu()  # the seeded generator is a CPU one
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """One-line errors for impossible sampling settings."""
    if not temperature >= 0 or temperature == math.inf:  # NaN fails the first test
        raise UserError(f"--temperature {temperature} must be a finite number >= 0 (0 means greedy)")
    if top_k < 0:
        raise UserError(f"--top-k {top_k} must be >= 0 (0 keeps every token)")
    if not 0.0 < top_p <= 1.0:
        raise UserError(f"--top-p {top_p} must be in (0, 1]")


@torch.no_grad()
def generate(
    model: GPTModel,
    prompt: Sequence[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_id: int | None = None,
    use_cache: bool = True,
    vocab_limit: int | None = None,
) -> list[int]:
    """The new token ids after `prompt` (stops after `eos_id`); temperature 0 is greedy decoding. `vocab_limit`:
    only ids below it are drawn (a tokenizer smaller than the model's vocabulary has no text for the rest: padding
    rows, as Megatron-LM's sampling keeps to the tokenizer's ids)."""
    check_sampling(temperature, top_k, top_p)
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {max_new_tokens} must be >= 1")
    vocab = model.config.vocab_size
    if not prompt:
        raise UserError("prompt: empty; give at least one token (--prompt TEXT or --prompt-ids IDS)")
    bad = next((int(i) for i in prompt if not 0 <= int(i) < vocab), None)
    if bad is not None:
        raise UserError(f"prompt: token id {bad} is not in the model's vocabulary [0, {vocab}); fix the prompt")
    limit = model.config.max_position_embeddings if model.config.add_position_embedding else None
    if limit is not None and len(prompt) + max_new_tokens > limit:
        raise UserError(
            f"--max-new-tokens {max_new_tokens}: prompt ({len(prompt)} tokens) plus new tokens exceed the "
            f"{limit} learned positions; generate at most {max(limit - len(prompt), 0)} tokens"
        )
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    device = next(model.parameters()).device
    tokens = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    cache = KVCache() if use_cache else None
    step_input, out = tokens, []
    for _ in range(max_new_tokens):
        logits = model(step_input, cache) if cache is not None else model(tokens)
        last = logits[:, -1] if vocab_limit is None else logits[:, -1, :vocab_limit]
        nxt = sample_next(last, temperature, top_k, top_p, generator)
        out.append(int(nxt.item()))
        if eos_id is not None and out[-1] == eos_id:
            break
        step_input = nxt.view(1, 1)
        tokens = torch.cat((tokens, step_input), dim=1)
    return out
