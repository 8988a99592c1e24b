"""Megatron-LM's sliding-window flags as model values: `--window-size LEFT,RIGHT` (upstream's `tuple_type`: "4095,0"
or "(4095,0)") and `--window-attn-skip-freq` (upstream's `moe_freq_type`: an integer N, or a Python list expression
of 0s and 1s such as "([1]*3+[0])*2", one entry per layer, 1 for the window). ModelConfig checks what they mean."""

from __future__ import annotations

import argparse
import ast
import operator
import re

from megatron_ds.errors import ConfigError

_PATTERN_CHARACTERS = re.compile(r"[^,\d\[\]\(\)\+\* ]")
"""Upstream's `_eval_pattern` allows only these (plus spaces here)."""
MAX_REPEAT = 100_000
"""A repeat count beyond any layer count (a larger one is a typo that would fill memory)."""


def window_size(args: argparse.Namespace) -> tuple[int, int] | None:
    """--window-size as (left, right), None when not given."""
    text = args.window_size
    if text is None or isinstance(text, (list, tuple)):  # a checkpoint's pair (`--use-checkpoint-args`)
        return None if text is None else tuple(text)
    try:
        values = tuple(int(part) for part in str(text).strip().strip("()").split(","))
    except ValueError:
        values = ()
    if len(values) != 2:
        raise ConfigError(f"--window-size {text} must be two integers LEFT,RIGHT, e.g. 4095,0 (Megatron-LM's form)")
    return values[0], values[1]


def window_layers(args: argparse.Namespace) -> tuple[int, ...] | None:
    """--window-attn-skip-freq as one 0 or 1 per layer (1: the window), None when not given: N gives 0 to the layer
    numbers (from 1) that are multiples of N, as megatron-core's `is_layer_window_attention`."""
    text = args.window_attn_skip_freq
    if text is None or isinstance(text, (list, tuple)):  # a checkpoint's pattern (`--use-checkpoint-args`)
        return None if text is None else tuple(text)
    text = str(text).strip()
    if "[" not in text:
        if not text.isdigit() or int(text) < 1:
            raise ConfigError(
                f"--window-attn-skip-freq {text} must be an integer >= 1 or a list pattern like [1,1,0]*2"
            )
        n = int(text)
        return tuple(0 if layer % n == 0 else 1 for layer in range(1, args.num_layers + 1))
    return pattern(text, "--window-attn-skip-freq")


def pattern(text: str, flag: str) -> tuple[int, ...]:
    """Upstream's `moe_freq_type` list expression (`flag`'s value) as a tuple of integers, without eval."""
    value = _evaluate(text, flag)
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise ConfigError(f"{flag} {text} must give a list of 0s and 1s, e.g. [1,1,1,0]*3")
    return tuple(value)


def _evaluate(text: str, flag: str) -> object:
    """Upstream's list expression (digits, lists, tuples, + and *) without eval."""
    bad = ConfigError(f"{flag} {text} is not a list expression of digits, [], (), + and *")
    if _PATTERN_CHARACTERS.search(text):
        raise bad
    try:
        return _value(ast.parse(text, mode="eval").body)
    except (SyntaxError, TypeError, ValueError):
        raise bad from None


def _value(node: ast.AST) -> object:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_value(x) for x in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return operator.add(_value(node.left), _value(node.right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        left, right = _value(node.left), _value(node.right)
        if max(x for x in (left, right) if isinstance(x, int)) > MAX_REPEAT:  # no int: TypeError below
            raise ValueError("too many repeats")
        return operator.mul(left, right)
    raise ValueError("not a pattern")
