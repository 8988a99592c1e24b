#!/usr/bin/env python
"""Record what Megatron-DeepSpeed's own `get_ltor_masks_and_position_ids` (its megatron/utils.py) gives on seeded
token rows holding several end-of-document tokens, for tests/unit/test_packed_documents.py to compare ours (and
megatron-core's) with.

    python tools/record_ltor_masks.py --utils-py <(git -C MIRROR show 4efb479:megatron/utils.py) \
        --out tests/unit/fixtures/megatron_deepspeed_ltor_masks.json

Its utils.py imports the rest of Megatron-DeepSpeed (and apex on CUDA), so only the one function is taken from
the file's syntax tree and run, unchanged, with torch as its only name.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
from pathlib import Path
from typing import Any

import torch

FUNCTION = "get_ltor_masks_and_position_ids"
EOD = 7
FLAGS = ((True, False), (False, True), (True, True))
"""(--reset-position-ids, --reset-attention-mask) of each case."""


def token_rows(seed: int, rows: int = 4, seq: int = 24) -> torch.Tensor:
    """Rows over 10 ids, so that EOD occurs several times in each; one row ends with EOD, one starts with it."""
    tokens = torch.randint(0, 10, (rows, seq), generator=torch.Generator().manual_seed(seed))
    tokens[:, seq // 3] = EOD  # at least one in every row
    tokens[0, -1] = EOD
    tokens[1, 0] = EOD
    return tokens


def upstream_function(source: str) -> Any:
    """`FUNCTION` compiled from `source` alone (the rest of the module is not run)."""
    tree = ast.parse(source)
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == FUNCTION]
    if len(nodes) != 1:
        raise SystemExit(f"error: {FUNCTION} not found once in the given utils.py; give Megatron-DeepSpeed's")
    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), "megatron/utils.py", "exec"), namespace)  # noqa: S102
    return namespace[FUNCTION]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--utils-py", required=True, help="Megatron-DeepSpeed's megatron/utils.py")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if not os.path.isfile(args.utils_py):
        raise SystemExit(
            f"error: --utils-py {args.utils_py}: no such file; give Megatron-DeepSpeed's megatron/utils.py"
        )
    function = upstream_function(Path(args.utils_py).read_text())
    cases = []
    for seed in range(3):
        tokens = token_rows(seed)
        for reset_position_ids, reset_attention_mask in FLAGS:
            mask, _, positions = function(tokens, EOD, reset_position_ids, reset_attention_mask, False)
            cases.append(
                {
                    "name": f"seed{seed}-{int(reset_position_ids)}{int(reset_attention_mask)}",
                    "eod": EOD,
                    "reset_position_ids": reset_position_ids,
                    "reset_attention_mask": reset_attention_mask,
                    "tokens": tokens.tolist(),
                    "position_ids": positions.tolist(),
                    # True (masked out) as "1": per row, per query, its keys (one (1, 1, s, s) mask for all rows without the flag)
                    "attention_mask": [
                        ["".join("1" if m else "0" for m in query) for query in row[0].tolist()]
                        for row in mask.expand(tokens.shape[0], 1, -1, -1)
                    ],
                }
            )
    Path(args.out).write_text(json.dumps({"source": f"Megatron-DeepSpeed {FUNCTION}", "cases": cases}) + "\n")
    print(f"wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
