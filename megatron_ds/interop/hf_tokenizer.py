"""Our tokenizers <-> Hugging Face tokenizer files.

    GPT2BPETokenizer        vocab.json + merges.txt (HF's GPT2Tokenizer reads the same files)
    SentencePieceTokenizer  tokenizer.model, plus a tokenizer.json built from it
                            (`megatron_ds.interop.sentencepiece_json`) so that `AutoTokenizer`
                            needs neither sentencepiece nor protobuf

On import, the HF directory's `tokenizer.model` or `vocab.json`/`merges.txt` become our tokenizer; a
directory with only `tokenizer.json` (a Llama 3's) becomes Megatron-LM's HuggingFaceTokenizer (transformers
reads it; without transformers it is left out). The directory's other tokenizer files travel with it (`hf_files_beside`), and an export writes them back as
they were, so a round trip keeps the source's settings (a Llama's `add_bos_token`, its chat template).
"""

from __future__ import annotations

import importlib.util
import os
import shutil

from megatron_ds.data.huggingface_tokenizer import HuggingFaceTokenizer
from megatron_ds.data.tokenizer import GPT2_EOD_TOKEN, GPT2BPETokenizer, SentencePieceTokenizer, Tokenizer
from megatron_ds.files import write_json
from megatron_ds.interop import sentencepiece_json

SP_FILE, VOCAB_FILE, MERGES_FILE, TOKENIZER_JSON = "tokenizer.model", "vocab.json", "merges.txt", "tokenizer.json"


HF_DIRECTORY_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
"""The files a Hugging Face tokenizer directory may hold; an export copies those it finds."""


def special_ids(tok: Tokenizer | None) -> dict[str, int]:
    """bos/eos/pad token ids for config.json and generation_config.json."""
    if tok is None:
        return {}
    if isinstance(tok, HuggingFaceTokenizer):
        return _directory_ids(tok)
    ids = {"eos_token_id": tok.eod}
    if isinstance(tok, SentencePieceTokenizer):
        bos = tok._sp.bos_id()
        if bos >= 0:
            ids["bos_token_id"] = bos
    else:
        ids["bos_token_id"] = tok.eod  # GPT-2 begins and ends documents with <|endoftext|>
    if tok.pad >= 0:
        ids["pad_token_id"] = tok.pad
    return ids


def _directory_ids(tok: HuggingFaceTokenizer) -> dict[str, int]:
    """A tokenizer directory's own bos/eos/pad ids: not those HFTokenizer added (a `[PAD]` after the vocabulary has
    no embedding row in the exported model)."""
    hf = tok.hf_tokenizer
    ids = {f"{role}_token_id": getattr(hf, f"{role}_token_id") for role in ("bos", "eos", "pad")}
    return {k: int(v) for k, v in ids.items() if v is not None and 0 <= int(v) < tok.vocab_size}


def hf_files_beside(paths: list[str | None]) -> list[str]:
    """The paths of the Hugging Face tokenizer files that came with our tokenizer's files `paths` (its
    tokenizer.model, or vocab.json and merges.txt): those of HF_DIRECTORY_FILES in their directory, if they are
    all one directory's files under Hugging Face's names beside its tokenizer_config.json; else none."""
    given = [os.path.abspath(p) for p in paths if p]
    directories = {os.path.dirname(p) for p in given}
    if not given or len(directories) != 1 or any(os.path.basename(p) not in HF_DIRECTORY_FILES for p in given):
        return []
    (directory,) = directories
    if not os.path.isfile(os.path.join(directory, "tokenizer_config.json")):
        return []
    return [os.path.join(directory, n) for n in hf_directory_files(directory)]


def _tokenizer_files(tok: Tokenizer) -> list[str | None]:
    if isinstance(tok, GPT2BPETokenizer):
        return [tok.vocab_file, tok.merge_file]
    return [tok.model_file] if isinstance(tok, SentencePieceTokenizer) else []


def _copy(paths: list[str], out_dir: str) -> list[str]:
    for path in paths:
        shutil.copyfile(path, os.path.join(out_dir, os.path.basename(path)))
    return [os.path.basename(p) for p in paths]


def hf_directory_files(directory: str) -> list[str]:
    """The names of HF_DIRECTORY_FILES that `directory` holds."""
    return [n for n in HF_DIRECTORY_FILES if os.path.isfile(os.path.join(directory, n))]


def export_tokenizer(tok: Tokenizer | None, out_dir: str, max_length: int) -> list[str]:
    """Write `tok` as HF tokenizer files into `out_dir`; returns the file names (none without a tokenizer). A Hugging
    Face directory's files (HFTokenizer, HuggingFaceTokenizer, or those beside our tokenizer's files: an imported
    model's) are copied as they are."""
    if isinstance(tok, HuggingFaceTokenizer):
        return _copy([os.path.join(tok.directory, n) for n in hf_directory_files(tok.directory)], out_dir)
    beside = hf_files_beside(_tokenizer_files(tok)) if tok is not None else []
    if beside:
        return _copy(beside, out_dir)
    if isinstance(tok, GPT2BPETokenizer):
        shutil.copyfile(tok.vocab_file, os.path.join(out_dir, VOCAB_FILE))
        shutil.copyfile(tok.merge_file, os.path.join(out_dir, MERGES_FILE))
        config = {
            "tokenizer_class": "GPT2Tokenizer",
            "bos_token": GPT2_EOD_TOKEN,
            "eos_token": GPT2_EOD_TOKEN,
            "unk_token": GPT2_EOD_TOKEN,
            "add_prefix_space": False,
            "model_max_length": max_length,
            "clean_up_tokenization_spaces": False,
        }
        write_json(os.path.join(out_dir, "tokenizer_config.json"), config)
        return [VOCAB_FILE, MERGES_FILE, "tokenizer_config.json"]
    if isinstance(tok, SentencePieceTokenizer):
        return _export_sentencepiece(tok, out_dir, max_length)
    return []


def _export_sentencepiece(tok: SentencePieceTokenizer, out_dir: str, max_length: int) -> list[str]:
    shutil.copyfile(tok.model_file, os.path.join(out_dir, SP_FILE))
    files = [SP_FILE, "tokenizer_config.json"]
    with open(tok.model_file, "rb") as f:
        model = sentencepiece_json.parse_model(f.read())
    sp = tok._sp
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "model_max_length": max_length,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "legacy": False,
    }
    for role, index in (
        ("unk_token", sp.unk_id()),
        ("bos_token", sp.bos_id()),
        ("eos_token", sp.eos_id()),
        ("pad_token", sp.pad_id()),
    ):
        if index >= 0:
            config[role] = sp.id_to_piece(index)
    if model.model_type == sentencepiece_json.BPE_MODEL:
        with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(sentencepiece_json.to_tokenizers_json(model))
        config["tokenizer_class"] = "PreTrainedTokenizerFast"  # reads tokenizer.json alone
        files.append("tokenizer.json")
    write_json(os.path.join(out_dir, "tokenizer_config.json"), config)
    return files


def find_hf_tokenizer(hf_dir: str) -> dict[str, str] | None:
    """pretrain_gpt.py tokenizer flags (argparse dests) for the HF directory's tokenizer files, if ours can read them:
    its tokenizer.model (SentencePiece) or vocab.json + merges.txt (GPT-2 BPE), else a tokenizer.json read through
    transformers as Megatron-LM's HuggingFaceTokenizer (a Llama 3's), when transformers is installed."""
    sp = os.path.join(hf_dir, SP_FILE)
    if os.path.isfile(sp):
        # Megatron's GPTSentencePieceTokenizer (the model's own pieces, eod its eos), which ours is; Megatron-DeepSpeed's
        # SentencePieceTokenizer would add ids the model has no rows for
        return {"tokenizer_type": "GPTSentencePieceTokenizer", "tokenizer_model": sp}
    vocab, merges = os.path.join(hf_dir, VOCAB_FILE), os.path.join(hf_dir, MERGES_FILE)
    if os.path.isfile(vocab) and os.path.isfile(merges):
        return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": vocab, "merge_file": merges}
    if os.path.isfile(os.path.join(hf_dir, TOKENIZER_JSON)) and importlib.util.find_spec("transformers") is not None:
        return {"tokenizer_type": HuggingFaceTokenizer.TYPE, "tokenizer_model": hf_dir}
    return None
