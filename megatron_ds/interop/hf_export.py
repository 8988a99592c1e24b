"""Export one of our checkpoints (any P, T, DP and layout) as a Hugging Face model directory.

    from megatron_ds.interop.hf_export import export_hf
    export_hf("checkpoints/gpt", "hf/gpt")      # config.json, model.safetensors, tokenizer files

Tensors stream from the checkpoint (`training/checkpoint/weights.py`: the per-spec files, or a mixture of experts'
DeepSpeed files or universal form) to safetensors shards one at a time (memory: one shard, 2 GiB by default, plus one
file's memory-mapped tensors); tensor-parallel shards are joined and the vocabulary padding is removed. The directory appears only once complete and validated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from megatron_ds import files
from megatron_ds.data.tokenizer import Tokenizer
from megatron_ds.errors import UserError
from megatron_ds.interop import hf_architectures, hf_config, hf_tokenizer, hf_weights
from megatron_ds.interop.safetensors_writer import ShardWriter
from megatron_ds.training.checkpoint import reader as checkpoint_reader
from megatron_ds.training.checkpoint import weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_SHARD_BYTES = 2 * 1024**3


@dataclass
class ExportResult:
    output: str
    arch: str
    vocab_size: int
    num_tensors: int
    files: list[str]
    notes: list[str]
    """What the directory lacks that a user may expect, one line each."""


def export_hf(
    source: str,
    output: str,
    vocab_size: int | None = None,
    dtype: str | None = None,
    tokenizer: dict[str, str | None] | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    show_progress: bool = True,
    model_type: str | None = None,
) -> ExportResult:
    """Write `source` (a checkpoint directory) as a Hugging Face model directory `output`.

    `vocab_size` overrides the unpadded vocabulary (see `checkpoint_reader.unpadded_vocab_size`);
    `dtype` (float32, bfloat16, float16) converts the stored weights; `tokenizer` overrides the
    checkpoint's tokenizer flags (tokenizer_type, tokenizer_model, vocab_file, merge_file); `model_type` picks
    among the model's exact forms (`mistral` for a Llama without biases; see `hf_architectures.architecture_of`).
    """
    ckpt = checkpoint_reader.open_checkpoint(source, moe=True)  # experts: Mixtral's (hf_architectures.architecture_of)
    model = ckpt.config.model
    arch = hf_architectures.architecture_of(model, model_type)
    tok = checkpoint_reader.checkpoint_tokenizer(ckpt, tokenizer)
    vocab = checkpoint_reader.unpadded_vocab_size(ckpt, tok, vocab_size)
    if tok is not None and tok.vocab_size > vocab:
        raise UserError(
            f"--vocab-size {vocab}: smaller than the tokenizer's {tok.vocab_size} tokens; drop --vocab-size"
        )
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    expected = hf_weights.hf_shapes(arch, model, vocab)
    with files.atomic_directory(output, "output") as tmp:
        stored, written = _write_weights(ckpt, arch, vocab, dtype, tmp, max_shard_bytes, len(expected), show_progress)
        _check_written(tmp, written, expected)
        dtype_name = dtype or next(k for k, v in DTYPES.items() if v == stored)
        special = hf_tokenizer.special_ids(tok)
        files.write_json(
            os.path.join(tmp, "config.json"),
            hf_config.to_hf_config(model, ckpt.config.regularization, vocab, dtype_name, special, arch),
        )
        files.write_json(os.path.join(tmp, "generation_config.json"), {"_from_model_config": True, **special})
        names = [*written, "config.json", "generation_config.json"]
        names += hf_tokenizer.export_tokenizer(tok, tmp, model.max_position_embeddings)
    notes = [*_notes(tok), *hf_config.export_notes(arch, model)]
    return ExportResult(os.path.abspath(output), arch, vocab, len(expected), names, notes)


def _notes(tok: Tokenizer | None) -> list[str]:
    if tok is not None:
        return []
    return [
        "no tokenizer (the checkpoint records none): no tokenizer files, and config.json names no bos/eos token, so "
        "generate() stops only at its length limit; give --tokenizer-type and its file flags to add them"
    ]


def _write_weights(
    ckpt: checkpoint_reader.Checkpoint,
    arch: str,
    vocab: int,
    dtype: str | None,
    out_dir: str,
    max_shard_bytes: int,
    total: int,
    show_progress: bool,
) -> tuple[torch.dtype, list[str]]:
    writer = ShardWriter(out_dir, max_shard_bytes)
    bar = files.progress(total, f"export {os.path.basename(ckpt.root)}", show_progress)
    stored = torch.float32
    try:
        for t in weights.iter_model_tensors(ckpt):
            stored = t.tensor.dtype
            full = t.tensor[:vocab] if t.rule.vocab else t.tensor
            if dtype is not None:
                full = full.to(DTYPES[dtype])
            names = hf_weights.hf_names(arch, t.spec, t.key, t.layer)
            for name, tensor in zip(names, hf_weights.to_hf(arch, t.spec, t.key, t.rule, full)):
                writer.add(name, tensor)
                bar.update(1)
        return stored, writer.close()
    finally:
        bar.close()


def _check_written(out_dir: str, written: list[str], expected: dict[str, tuple[int, ...]]) -> None:
    # Read the headers back: every expected tensor, with its shape, and nothing else.
    from safetensors import safe_open

    found: dict[str, tuple[int, ...]] = {}
    for name in written:
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(out_dir, name), framework="pt") as f:
                for key in f.keys():
                    found[key] = tuple(f.get_slice(key).get_shape())
    assert found == expected, sorted(set(found) ^ set(expected))
