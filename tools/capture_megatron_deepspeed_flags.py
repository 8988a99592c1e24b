#!/usr/bin/env python
"""List every command-line option of Megatron-DeepSpeed's pretrain_gpt.py, by argument group: the options its
`megatron/arguments.py` declares (read as source, nothing of it is imported) and those DeepSpeed's
`add_config_arguments` adds to its parser.

    python tools/capture_megatron_deepspeed_flags.py --megatron-deepspeed PATH --commit 4efb479 \
        --out tests/data/megatron_deepspeed_flags.json

PATH is a checkout (or `git archive` export) of Megatron-DeepSpeed. `tests/unit/test_compat.py` checks that each
option is declared here (accepted, a no-op or refused with the reason: docs/compatibility.md's table).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path


def arguments_py_options(source: str) -> dict[str, list[str]]:
    """{the `_add_*_args` function: its option strings, in order} of a Megatron arguments.py."""
    groups: dict[str, list[str]] = {}
    for fn in ast.parse(source).body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                names = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
                groups.setdefault(fn.name, []).extend(names)
    return groups


def deepspeed_options() -> list[str]:
    """The options `deepspeed.add_config_arguments` adds (Megatron-DeepSpeed's parse_args calls it)."""
    import deepspeed

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser(add_help=False))
    return [s for a in parser._actions for s in a.option_strings]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron-deepspeed", required=True, help="a Megatron-DeepSpeed checkout")
    p.add_argument("--commit", required=True, help="its commit, recorded in the output")
    p.add_argument("--out", required=True, help="the JSON file to write")
    args = p.parse_args(argv)
    source = Path(args.megatron_deepspeed, "megatron", "arguments.py")
    if not source.is_file():
        print(f"error: --megatron-deepspeed {args.megatron_deepspeed}: no megatron/arguments.py", file=sys.stderr)
        return 2
    groups = arguments_py_options(source.read_text())
    groups["deepspeed.add_config_arguments"] = deepspeed_options()
    out = {"upstream": "deepspeedai/Megatron-DeepSpeed", "commit": args.commit, "groups": groups}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{sum(map(len, groups.values()))} options in {len(groups)} groups -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
