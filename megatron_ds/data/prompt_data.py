"""finetune_llama.py's data: Megatron-DeepSpeed's supervised fine-tuning samples from a JSON list of
Alpaca-style examples ({"instruction", "input", "output"}), sample for sample as its `finetune_llama.py`
makes them (`megatron/data/prompt_dataset.py` and `get_batch_pipe` at 4efb479; the reference is
tests/fixtures/megatron_deepspeed_sft/, written by upstream's own code).

Each example becomes one sample of `seq_length + 1` ids:
  prompt    Stanford Alpaca's template, with the "input" paragraph when the example's input is not empty;
  response  the output, then the tokenizer's eos token as text;
  ids       `tokenizer(prompt + response, padding="max_length", max_length=seq_length + 1, truncation=True)`
            (HFTokenizer: right padding with its pad id);
  labels    the ids with the first n set to the pad id, n = the prompt's own ids that are not pad (the same
            call on the prompt alone), so the prompt is not trained on;
then tokens = ids[:-1], labels = labels[1:], and the loss mask is `labels != pad`.

One difference, which changes no loss and no gradient: a pad id outside the model's vocabulary (the
`[PAD]` that HFTokenizer adds to Llama's tokenizer is id 32000 of a 32000-row embedding) is fed to the model
as the eos id. Padding follows the example's last token, so only padding positions read it (causal
attention), and the labels there are masked. Megatron-DeepSpeed feeds the out-of-range id itself: its
tensor-parallel embedding zeroes it at T > 1, and at T = 1 the lookup fails.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import torch

from megatron_ds.config import DataConfig
from megatron_ds.data import DataError
from megatron_ds.files import read_json

PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
PROMPT_WITHOUT_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)
"""Stanford Alpaca's prompt templates, as Megatron-DeepSpeed's `prompt_dataset.PROMPT_DICT` holds them."""


def read_examples(path: str) -> list[tuple[str, str]]:
    """(prompt, output) of each example in the JSON file at `path`; one-line errors name the file and the
    example."""
    if not os.path.isfile(path):
        what = "a directory, not a file" if os.path.isdir(path) else "no such file"
        raise DataError(f"--data-path {path}: {what}; finetune_llama.py reads a JSON list of examples")
    examples = read_json(path, "--data-path", DataError, ("give a readable JSON file", "fix the file"))
    if not isinstance(examples, list) or not examples:
        raise DataError(f"--data-path {path}: expected a non-empty JSON list of {{instruction, input, output}} objects")
    return [_prompt_and_output(path, k, example) for k, example in enumerate(examples)]


def _prompt_and_output(path: str, k: int, example: Any) -> tuple[str, str]:
    where = f"--data-path {path}: example {k}"
    if not isinstance(example, dict):
        raise DataError(f"{where} is a {type(example).__name__}, not an object with instruction, input and output")
    for key in ("instruction", "output"):
        if not isinstance(example.get(key), str):
            raise DataError(f'{where} has no "{key}" string; each example needs "instruction" and "output"')
    given = example.get("input", "")
    if not isinstance(given, str):
        raise DataError(f'{where}: "input" is a {type(given).__name__}, not a string')
    template = PROMPT_WITH_INPUT if given != "" else PROMPT_WITHOUT_INPUT
    return template.format(instruction=example["instruction"], input=given), example["output"]


def _padded_ids(hf: Any, texts: Sequence[str], length: int) -> list[list[int]]:
    """Each text as `length` ids, right-padded or truncated, as upstream calls the tokenizer (one text at a time
    there; one batched call here gives the same ids, since every text is padded to `length` alone)."""
    return [list(ids) for ids in hf(list(texts), padding="max_length", max_length=length, truncation=True).input_ids]


class PromptData(torch.utils.data.Dataset):
    """The samples of one JSON file (every example, in file order), tokenized once."""

    def __init__(self, path: str, tokenizer: Any, seq_length: int, vocab_size: int) -> None:
        hf = tokenizer.hf_tokenizer
        pairs = read_examples(path)
        eos = hf.eos_token
        ids = _padded_ids(hf, [prompt + output + eos for prompt, output in pairs], seq_length + 1)
        prompts = _padded_ids(hf, [prompt for prompt, _ in pairs], seq_length + 1)
        pad = tokenizer.pad
        self.ids = torch.tensor(ids, dtype=torch.int32)  # half of int64's memory on every reading rank
        labels = self.ids.clone()
        self.prompt_lengths = [sum(i != pad for i in p) for p in prompts]
        for row, n in zip(labels, self.prompt_lengths):
            row[:n] = pad
        self.labels = labels
        self.pad, self.eod, self.vocab_size, self.path = pad, tokenizer.eod, vocab_size, path
        self._check_vocabulary(hf)

    def _check_vocabulary(self, hf: Any) -> None:
        """Every id the model reads or is trained on lies in its vocabulary; an out-of-range pad only as padding."""
        out_of_range = self.ids >= self.vocab_size
        if self.pad >= self.vocab_size:
            padding = self.ids == self.pad
            trailing = padding.flip(1).cumprod(1).flip(1).bool()  # the run of pad ids that ends the sample
            if bool((padding & ~trailing).any()):
                k = int((padding & ~trailing).any(1).nonzero()[0])
                raise DataError(
                    f"--data-path {self.path}: example {k} contains the pad token {hf.pad_token!r} (id {self.pad}, "
                    f"outside the model's {self.vocab_size} ids) in its text; remove it from the example"
                )
            out_of_range &= ~trailing
        if bool(out_of_range.any()):
            k, j = (int(x) for x in out_of_range.nonzero()[0])
            token = int(self.ids[k, j])
            raise DataError(
                f"--data-path {self.path}: example {k} has token {hf.convert_ids_to_tokens(token)!r} (id {token}), "
                f"outside the model's {self.vocab_size} ids (a special token HFTokenizer added to --tokenizer-model?); "
                f"use a tokenizer whose eos, bos and unk tokens are in its vocabulary"
            )

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, labels = self.ids[index].long(), self.labels[index, 1:].long()
        tokens = ids[:-1]
        if self.pad >= self.vocab_size:
            tokens = torch.where(tokens == self.pad, torch.full_like(tokens, self.eod), tokens)
        loss_mask = (labels != self.pad).float()
        return {
            "tokens": tokens.clone(),
            "labels": torch.where(loss_mask.bool(), labels, torch.zeros_like(labels)),  # a masked label is not read
            "loss_mask": loss_mask,
            "position_ids": torch.arange(len(tokens)),
        }

    def untrained(self) -> list[int]:
        """The examples whose response lies wholly beyond `seq_length` (no label is trained on)."""
        return ((self.labels[:, 1:] != self.pad).sum(1) == 0).nonzero().flatten().tolist()


@functools.lru_cache(maxsize=1)
def build_prompt_data(data: DataConfig, seq_length: int, vocab_size: int) -> PromptData:
    """The run's prompt data, tokenized once per process: the launch check builds it on every rank before any
    process group (a bad example fails every rank alike), and the run reads the same object."""
    from megatron_ds.data.tokenizer import build_tokenizer

    if data.tokenizer_type is None:
        raise DataError("finetune_llama.py needs --tokenizer-type HFTokenizer --tokenizer-model DIR")
    tokenizer = build_tokenizer(data.tokenizer_type, tokenizer_model=data.tokenizer_model)
    return PromptData(data.data_path[0], tokenizer, seq_length, vocab_size)


def check_one_pass(path: str, num_examples: int, per_pass: int) -> None:
    """A one-line error when the examples do not fill one micro-batch on every data-parallel rank
    (`per_pass`: `batches.samples_per_pass`)."""
    if per_pass == 0:
        raise DataError(
            f"--data-path {path} holds {num_examples} examples, fewer than one micro-batch on every data-parallel "
            f"rank; add examples or lower --micro-batch-size"
        )


def check_length(path: str, num_examples: int, per_pass: int, wanted: int, global_batch: int, repeated: bool) -> str:
    """The line printed at launch; a one-line error when the examples cannot feed `wanted` training samples."""
    check_one_pass(path, num_examples, per_pass)
    if wanted > per_pass and not repeated:
        raise DataError(
            f"--data-path {path} gives {per_pass} samples per pass, the run trains on {wanted}; add "
            f"--repeated-dataloader (as finetune_llama.sh does) or lower --train-iters to {per_pass // global_batch}"
        )
    passes = wanted / per_pass
    return (
        f"prompt data: {num_examples} examples in {path}, {per_pass} samples per pass; the run trains on {wanted} "
        f"({passes:.2f} passes)"
    )


def untrained_notice(path: str, examples: list[int], seq_length: int) -> str:
    """The launch's line naming the examples whose prompt fills the sequence (the first five, then a count)."""
    shown = ", ".join(str(k) for k in examples[:5]) + (f" and {len(examples) - 5} more" if len(examples) > 5 else "")
    many = len(examples) > 1
    return (
        f"NOTICE: --data-path {path}: {'examples' if many else 'example'} {shown} (counting from 0) "
        f"{'have' if many else 'has'} no response token within --seq-length {seq_length}: the prompt fills it, "
        "nothing is trained on"
    )
