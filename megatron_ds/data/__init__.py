"""The data layer: text -> token ids -> Megatron `.bin/.idx` files -> GPT samples -> micro-batches.

- `tokenizer`: SentencePiece, GPT-2 byte-level BPE and a null tokenizer for `--mock-data`.
- `indexed`: read corpora, write and validate `<prefix>.bin/.idx` (megatron-core's format).
- `gpt_data`: train/valid/test `GPTDataset`s (blends, splits, mock data) and pipeline micro-batches.
- `demo_corpus`: a built-in demo corpus made from the standard library's docstrings.

This file stays import-light (no torch, no megatron-core) so that command-line tools report bad
input in milliseconds instead of after megatron-core's ~6 s import.
"""

from megatron_ds.errors import UserError


class DataError(UserError):
    """A user-fixable data problem. The message is one line: the flag or file, the value, the fix."""
