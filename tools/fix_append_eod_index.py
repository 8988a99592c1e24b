#!/usr/bin/env python
"""Rewrite the index of a Megatron-DeepSpeed `--append-eod` pair so that it counts each EOD.

    python tools/fix_append_eod_index.py --input data/corpus_text_document \\
        --output-prefix data/corpus_eod_text_document

Megatron-DeepSpeed's tools/preprocess_data.py --append-eod writes each document's end-of-document
token to the `.bin` but leaves it out of the `.idx` lengths. Training reads such pairs with each
EOD included anyway (holding the corrected index in memory); this writes the corrected index once,
next to the original: `<output-prefix>.idx` (atomically) and `<output-prefix>.bin`, a hard link to
the original `.bin` (a symbolic link where the file system has none), so no token is copied. The
original pair is never changed; the new one is what our tools/preprocess_data.py writes for the
same corpus. Bad input: one `error:` line, exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_ds.data import DataError
from megatron_ds.data.append_eod import rewrite_index
from megatron_ds.errors import OneLineArgumentParser, UserError, interrupted, stop_cleanly_on_sigterm


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(
        description=__doc__.splitlines()[0], allow_abbrev=False, command="python tools/fix_append_eod_index.py"
    )
    p.add_argument("--input", required=True, help="prefix of the pair (without .bin/.idx)")
    p.add_argument("--output-prefix", help="prefix of the corrected pair (default: <input>_eod)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    output = f"{args.input}_eod" if args.output_prefix is None else args.output_prefix
    if not os.path.basename(output):  # "" or a directory: no file name for the pair
        print(
            f"error: --output-prefix {output!r}: names no file; give a prefix such as data/corpus_eod", file=sys.stderr
        )
        return 2
    try:
        info = rewrite_index(args.input, output)
    except (DataError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return interrupted()
    print(
        f"wrote {output}.idx ({info.num_documents} documents, {info.num_tokens} tokens, each EOD counted) and "
        f"{output}.bin (linked to {args.input}.bin); train with --data-path {output}"
    )
    return 0


if __name__ == "__main__":
    stop_cleanly_on_sigterm()
    sys.exit(main())
