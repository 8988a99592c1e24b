"""Where samples come from and how text becomes tokens (`DataConfig`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from megatron_ds.config.checks import at_least, check, one_of

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "NullTokenizer",
    "HuggingFaceTokenizer",
    "HFTokenizer",
)
DATA_UPSTREAMS = ("megatron-deepspeed", "megatron-lm")
DEFAULT_SPLIT = "969,30,1"
SPLIT_PATH_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")


def split_fractions(split: str) -> list[float] | None:
    """`--split 969,30,1` (or `0.8/0.1/0.1`) -> normalised train/valid/test fractions; None when malformed."""
    try:
        values = [float(p) for p in re.split(r"[,/]", split.strip())]
    except ValueError:
        return None
    if not 1 <= len(values) <= 3 or any(v < 0 or not math.isfinite(v) for v in values) or sum(values) <= 0:
        return None
    values += [0.0] * (3 - len(values))
    return [v / sum(values) for v in values]


def split_message(split: str) -> str:
    return (
        f"--split {split}: expected up to three comma-separated non-negative weights with a positive sum, e.g. 969,30,1"
    )


@dataclass(frozen=True)
class DataConfig:
    """Where samples come from and how text becomes tokens."""

    data_path: tuple[str, ...] = ()
    """One prefix, or a weighted blend `0.7 a 0.3 b` of `<prefix>.bin/.idx` (`--data-path`); a list
    is stored as a tuple."""
    train_data_path: tuple[str, ...] = ()
    """The training split's own data, read whole: one prefix or a weighted blend, as `data_path`
    (`--train-data-path`); with `valid_data_path` and `test_data_path` instead of `data_path` and `split`."""
    valid_data_path: tuple[str, ...] = ()
    """The validation split's own data (`--valid-data-path`); none: no validation."""
    test_data_path: tuple[str, ...] = ()
    """The test split's own data (`--test-data-path`); none: no test evaluation."""
    split: str = DEFAULT_SPLIT
    """Train/validation/test proportions of the documents (`--split`); unused with the per-split paths."""
    data_cache_path: str | None = None
    """Where dataset index caches are written; next to the data by default (`--data-cache-path`)."""
    mock_data: bool = False
    """Deterministic synthetic tokens; no files needed (`--mock-data`)."""
    tokenizer_type: str | None = None
    """One of TOKENIZER_TYPES (`--tokenizer-type`)."""
    tokenizer_model: str | None = None
    """SentencePiece model file, or the local directory of a HuggingFaceTokenizer (`--tokenizer-model`)."""
    null_tokenizer_vocab_size: int | None = None
    """The NullTokenizer's ids (`--vocab-size` before padding; its eod is the last), None otherwise."""
    null_tokenizer_eod_id: int | None = None
    """The NullTokenizer's end-of-document id; None: its last id (`--null-tokenizer-eod-id`)."""
    null_tokenizer_pad_id: int = -1
    """The NullTokenizer's padding id, masked out of the loss; -1: none (`--null-tokenizer-pad-id`)."""
    unpadded_vocab_size: int | None = None
    """The tokens: `--vocab-size`, else the tokenizer's size; the model's rows above it are
    `--make-vocab-size-divisible-by` padding, which no sample holds (mock data draws below it; checkpoints
    record it for export and generation). None when neither is given (`--print-layout`)."""
    vocab_file: str | None = None
    """GPT-2 BPE vocabulary (`--vocab-file`)."""
    merge_file: str | None = None
    """GPT-2 BPE merges (`--merge-file`)."""
    make_vocab_size_divisible_by: int = 128
    """The padded vocabulary is a multiple of this times T (`--make-vocab-size-divisible-by`)."""
    num_workers: int = 2
    """DataLoader worker processes (`--num-workers`)."""
    eod_mask_loss: bool = False
    """Exclude end-of-document tokens from the loss (`--eod-mask-loss`)."""
    reset_position_ids: bool = False
    """Position ids restart at 0 after every end-of-document token of a sample's input tokens
    (`--reset-position-ids`; upstream's `get_ltor_masks_and_position_ids`): the learned position embedding and
    rotary embeddings see each packed document from position 0."""
    reset_attention_mask: bool = False
    """A token attends to no token at or before an end-of-document token that precedes it (`--reset-attention-mask`):
    each packed document attends only within itself; attention takes a dense (b, 1, s, s) boolean mask instead of
    SDPA's causal fast path."""
    data_upstream: str = "megatron-deepspeed"
    """Whose rules split the documents and size a blend's parts: `megatron-deepspeed` or
    `megatron-lm` (megatron-core's); `--data-upstream`, by default from the command line's flags."""
    misaligned_append_eod: bool = False
    """Read Megatron-DeepSpeed's `--append-eod` files as it reads them, each document's EOD left
    out and the offsets misaligned (`--misaligned-append-eod`); by default each EOD is included."""
    mmap_bin_files: bool = True
    """Read the `.bin` token files through a memory map; file reads with `--no-mmap-bin-files`."""
    prompt_data: bool = False
    """`--data-path` is one JSON list of Alpaca-style examples, made into supervised fine-tuning samples as
    Megatron-DeepSpeed's finetune_llama.py makes them (`data/prompt_data.py`; `--prompt-data`, which
    finetune_llama.py adds)."""
    repeated_dataloader: bool = False
    """When the training samples run out, read them again from the first (`--repeated-dataloader`); only prompt
    data can run out (the indexed datasets are built as long as the run)."""

    def __post_init__(self) -> None:
        for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        check(not (self.mock_data and self.data_path), "--mock-data and --data-path were both given; keep one")
        self._check_split_paths()
        if self.tokenizer_type is not None:
            one_of("--tokenizer-type", self.tokenizer_type, TOKENIZER_TYPES)
        one_of("--data-upstream", self.data_upstream, DATA_UPSTREAMS)
        check(split_fractions(self.split) is not None, split_message(self.split))  # before launch, mock data too
        at_least("--make-vocab-size-divisible-by", self.make_vocab_size_divisible_by, 1)
        for flag, value, default in (
            ("--null-tokenizer-eod-id", self.null_tokenizer_eod_id, None),
            ("--null-tokenizer-pad-id", self.null_tokenizer_pad_id, -1),
        ):
            check(
                value == default or self.tokenizer_type == "NullTokenizer",
                f"{flag} {value}: it sets an id of --tokenizer-type NullTokenizer, and this line's tokenizer is "
                f"{self.tokenizer_type or 'none'}; drop it",
            )
        eod, ids = self.null_tokenizer_eod_id, self.null_tokenizer_vocab_size
        if eod is not None and ids is not None:
            check(
                0 <= eod < ids,
                f"--null-tokenizer-eod-id {eod}: outside the tokenizer's ids [0, {ids}); give an id below --vocab-size, "
                "or drop it for the last one",
            )
        at_least("--null-tokenizer-pad-id", self.null_tokenizer_pad_id, -1)
        at_least("--num-workers", self.num_workers, 0)
        if self.prompt_data:
            check(not self.mock_data, "finetune_llama.py reads --data-path EXAMPLES.json; --mock-data has no prompts")
            check(
                len(self.data_path) <= 1,
                f"--data-path {' '.join(self.data_path)}: finetune_llama.py reads one JSON file of examples; give one",
            )
            check(
                self.tokenizer_type in (None, "HFTokenizer"),
                f"--tokenizer-type {self.tokenizer_type}: finetune_llama.py tokenizes its prompts with "
                "--tokenizer-type HFTokenizer (Megatron-DeepSpeed's); use it with --tokenizer-model DIR",
            )
            given = [f for f, on in (("--reset-position-ids", self.reset_position_ids),
                                     ("--reset-attention-mask", self.reset_attention_mask)) if on]  # fmt: skip
            check(
                not given,
                f"{' and '.join(given)} with finetune_llama.py's examples (--prompt-data): each example is one "
                f"sample here, with no packed documents to reset at; drop {' and '.join(given)}",
            )

    @property
    def split_paths(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        """(`--train-data-path`, `--valid-data-path`, `--test-data-path`); () for a split without one."""
        return self.train_data_path, self.valid_data_path, self.test_data_path

    @property
    def has_split_paths(self) -> bool:
        """Each split is read from its own path(s) instead of `--split`'s share of `--data-path`."""
        return any(self.split_paths)

    @property
    def has_data(self) -> bool:
        """Some data files are named (`--data-path` or a per-split path)."""
        return bool(self.data_path) or self.has_split_paths

    def _check_split_paths(self) -> None:
        given = [(flag, path) for flag, path in zip(SPLIT_PATH_FLAGS, self.split_paths) if path]
        if not given:
            return
        flag, path = given[0]
        shown = f"{flag} {' '.join(path)}"
        check(not self.mock_data, f"--mock-data and {flag} were both given; keep one")
        check(
            not self.data_path,
            f"{shown} beside --data-path {' '.join(self.data_path)}: both upstreams then read every split from "
            f"--data-path and ignore {flag}; give either --data-path (with --split) or a path per split",
        )
        check(
            not self.prompt_data,
            f"{shown}: finetune_llama.py reads its examples from --data-path EXAMPLES.json; use it",
        )
        check(
            self.data_upstream != DATA_UPSTREAMS[1] or self.split.replace(" ", "") == DEFAULT_SPLIT,
            f"--split {self.split} with {shown}: megatron-core (Megatron-LM) refuses a split beside per-split "
            "paths (each split reads its whole data); drop --split",
        )
