"""Replay the launch lines of Megatron-DeepSpeed's and Megatron-LM's own example scripts through our
command line and pre-launch checks, and render docs/compatibility.md's per-script table from it.

    python -m megatron_ds.testing.launch_lines            # the table (tests/unit/test_launch_lines.py
                                                          # keeps docs/compatibility.md's copy equal)

The lines come from `tools/capture_launch_lines.py` (tests/data/launch_lines.json: each script's
training command line and the DeepSpeed JSON it writes, captured with stub launchers). Each line is
replayed as a launch on the GPUs the capture's `nvidia-smi` stub reported: the flags parsed with the
launcher's world size, the DeepSpeed JSON merged, the `--load`/`--save` directories, optional
packages and the layout checked, exactly as `pretrain_gpt.py` does before any process group exists
(a `finetune_llama.py` line with the `--prompt-data` that entry adds).
Stand-ins, so that the line is judged and not the machine: tokenizer files of the same vocabulary
size (GPT-2's 50257, SentencePiece 32000, a Hugging Face directory of 32000 for HFTokenizer and
HuggingFaceTokenizer), fresh empty directories for the ones the script created,
optional packages (tensorboard) taken as installed, and the data files and `--load-teacher`'s checkpoint
are not opened (they are the user's).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
import sys
import tempfile
import unittest.mock
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CAPTURED = ROOT / "tests" / "data" / "launch_lines.json"
DEFAULT_GPUS_PER_NODE = 8
FILE_FLAGS = {
    "--vocab-file": "vocab.json",
    "--merge-file": "merges.txt",
    "--tokenizer-model": "tokenizer.model",
}


@dataclass
class Outcome:
    """What a launch of one captured line does here, before any process group."""

    script: str
    upstream: str
    status: str
    """`accepted`, `refused` (a one-line user error), `not captured` or `crash` (a bug here)."""
    message: str = ""
    notices: list[str] = field(default_factory=list)
    world_size: int | None = None


def world_size_of(line: dict[str, Any]) -> int | None:
    """Processes the launcher starts: deepspeed's --num_gpus x --num_nodes (8 GPUs per node, as the
    capture's nvidia-smi reported, when only one is given), torchrun's --nproc_per_node x --nnodes;
    None when the launcher says nothing (deepspeed then takes every GPU of its hostfile): the line
    is replayed with one data-parallel replica."""
    args = line.get("launcher_args", [])

    def value(*names: str) -> int | None:
        v = _flag_value(args, *names)
        return int(v) if v and v.isdigit() else None

    if line.get("launcher") == "deepspeed":
        gpus, nodes = value("--num_gpus", "--num-gpus"), value("--num_nodes")
        return None if gpus is None and nodes is None else (gpus or DEFAULT_GPUS_PER_NODE) * (nodes or 1)
    if line.get("launcher") == "torchrun":
        return (value("--nproc_per_node", "--nproc-per-node") or 1) * (value("--nnodes") or 1)
    return None


def _byte_level_files(directory: Path, size: int, first: tuple[str, ...] = (), last: tuple[str, ...] = ()) -> None:
    """vocab.json (`first`, the 256 byte symbols, placeholders, `last`: `size` tokens) and an empty merges.txt."""
    from megatron_ds.data.tokenizer import _bytes_to_unicode

    vocab = {t: i for i, t in enumerate(first)}
    for symbol in _bytes_to_unicode().values():
        vocab[symbol] = len(vocab)
    while len(vocab) < size - len(last):
        vocab[f"tok{len(vocab)}"] = len(vocab)
    for token in last:
        vocab[token] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")


def _gpt2_files(directory: Path) -> dict[str, str]:
    _byte_level_files(directory, 50257, last=("<|endoftext|>",))
    return {"--vocab-file": str(directory / "vocab.json"), "--merge-file": str(directory / "merges.txt")}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def sentencepiece_model(num_pieces: int = 32000) -> bytes:
    """A SentencePiece `ModelProto` (BPE) of `num_pieces` pieces: <unk>, <s>, </s>, then placeholders."""
    kinds = [(b"<unk>", 2), (b"<s>", 3), (b"</s>", 3)]  # UNKNOWN, CONTROL
    kinds += [(f"\u2581p{i}".encode(), 1) for i in range(num_pieces - 3)]  # NORMAL
    pieces = b"".join(
        _field(1, _field(1, p) + b"\x15" + struct.pack("<f", -float(i)) + b"\x18" + _varint(t))
        for i, (p, t) in enumerate(kinds)
    )
    trainer = b"\x18" + _varint(2) + b"\x20" + _varint(num_pieces)  # model_type BPE, vocab_size
    normalizer = _field(1, b"identity")
    return pieces + _field(2, trainer) + _field(3, normalizer)


HF_TOKENIZERS = ("HFTokenizer", "HuggingFaceTokenizer")
"""Tokenizer types whose `--tokenizer-model` is a Hugging Face tokenizer directory."""


def _hf_directory(directory: Path, size: int = 32000) -> str:
    """A Hugging Face tokenizer directory of Llama's vocabulary size (a GPT-2 format one: loads in milliseconds)."""
    directory.mkdir()
    _byte_level_files(directory, size, first=("<unk>", "<s>", "</s>"))
    config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return str(directory)


def _standins(directory: Path) -> dict[str, str]:
    files = _gpt2_files(directory)
    (directory / "tokenizer.model").write_bytes(sentencepiece_model())
    return {
        **files,
        "--tokenizer-model": str(directory / "tokenizer.model"),
        "--tokenizer-model (directory)": _hf_directory(directory / "hf_tokenizer"),
    }


def _flag_value(args: list[str], *names: str) -> str | None:
    """The value of the first of `names` in `args` (`--flag value` or `--flag=value`), or None."""
    for k, a in enumerate(args):
        flag, _, value = a.partition("=")
        if flag in names:
            return value or (args[k + 1] if k + 1 < len(args) else None)
    return None


def _rewritten(line: dict[str, Any], scratch: Path, standins: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The captured arguments with stand-in tokenizer files, the DeepSpeed JSON written to the
    scratch directory, and each directory that existed at launch recreated empty; and each
    stand-in's original (to print messages with the script's own paths)."""
    args, originals = list(line["argv"]), {}
    existing = set(line.get("existing_dirs", []))
    for k, a in enumerate(args):
        name, eq, value = a.partition("=")
        target = value if eq else (args[k + 1] if k + 1 < len(args) else None)
        if name in ("--deepspeed_config", "--deepspeed-config") and "ds_config" in line:
            path = scratch / "ds_config.json"
            path.write_text(json.dumps(line["ds_config"]))
            new = str(path)
        elif name in FILE_FLAGS and target is not None and not target.startswith("-"):
            hf = name == "--tokenizer-model" and _flag_value(args, "--tokenizer-type") in HF_TOKENIZERS
            new = standins[f"{name} (directory)" if hf else name]
        elif target in existing:
            new = str(scratch / "dirs" / str(k))
            os.makedirs(new, exist_ok=True)
        else:
            continue
        originals[new] = target or ""
        if eq:
            args[k] = f"{name}={new}"
        else:
            args[k + 1] = new
    return args, originals


def _machine(gpu_name: str) -> Any:
    from megatron_ds.estimate.devices import find_device
    from megatron_ds.estimate.machine import Machine

    device = find_device(gpu_name)
    memory = None if device is None or device.memory_gb is None else device.memory_gb * 2**30
    return Machine(device="cuda", device_memory=memory, device_name=gpu_name)


def _launch_checks(argv: list[str], world_size: int | None, machine: Any) -> None:
    """What `pretrain_gpt.py` runs before any process group, the data files aside."""
    from megatron_ds.flags.parser import parse_config
    from megatron_ds.training import deepspeed_config
    from megatron_ds.training.checkpoint.save_load import check_dirs
    from megatron_ds.training.launch_checks import check_logging

    config, _ = parse_config(argv, world_size=world_size, machine=machine)
    notices = check_dirs(config)
    with unittest.mock.patch("megatron_ds.training.logger.tensorboard_available", return_value=True):
        check_logging(config)  # as on a machine with the optional packages: the line is judged
    deepspeed_config.build(config)
    print("\n".join(notices + deepspeed_config.launch_notices(config)))  # as pretrain_gpt.py prints them


def replay(line: dict[str, Any], gpu_name: str, standins: dict[str, str] | None = None) -> Outcome:
    """One captured line as a launch (see the module docstring); `standins`: the tokenizer files `_standins`
    made (read only, so one set serves every line), else made for this line."""
    from megatron_ds.errors import UserError

    out = Outcome(line["script"], line["upstream"], "not captured", world_size=world_size_of(line))
    if "argv" not in line:
        out.message = line.get("not_captured", "")
        return out
    if "ds_config_error" in line:
        out.status, out.message = (
            "refused",
            f"its DeepSpeed JSON does not load: {line['ds_config_error'].split(': ', 1)[-1]}",
        )
        return out
    said = io.StringIO()
    with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
        scratch_dir = Path(scratch)
        argv, originals = _rewritten(line, scratch_dir, standins or _standins(scratch_dir))
        try:
            with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                prompts = ["--prompt-data"] if line.get("entry") == "finetune_llama.py" else []  # what that entry adds
                _launch_checks(argv + prompts, out.world_size, _machine(gpu_name))
            out.status = "accepted"
        except UserError as e:
            out.status, out.message = "refused", str(e)
        except Exception as e:  # noqa: BLE001 - reported as a defect of ours in the table
            out.status, out.message = "crash", f"{type(e).__name__}: {e}"
        for new, old in sorted(originals.items(), key=lambda kv: -len(kv[0])):
            out.message = out.message.replace(new, old)
            said = io.StringIO(said.getvalue().replace(new, old))
    out.notices = [ln for ln in said.getvalue().splitlines() if ln.startswith(("NOTICE", "WARNING"))]
    return out


def replay_all(path: Path = CAPTURED) -> list[Outcome]:
    data = json.loads(path.read_text())
    with tempfile.TemporaryDirectory() as shared:
        standins = _standins(Path(shared))  # ~0.6 s of CPU each: once, not once per line
        return [replay(line, data["gpu_name"], standins) for line in data["lines"]]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(outcomes: list[Outcome]) -> str:
    """One row per captured script, and a count per outcome."""
    counts = {s: sum(1 for o in outcomes if o.status == s) for s in ("accepted", "refused", "not captured", "crash")}
    lines = [
        ", ".join(f"{n} {s}" for s, n in counts.items() if n) + f" of {len(outcomes)} captured lines.",
        "",
        "| upstream | script | ranks | here | why, or what is printed |",
        "|---|---|---|---|---|",
    ]
    for o in outcomes:
        why = o.message or "; ".join(o.notices)
        lines.append(f"| {o.upstream} | `{o.script}` | {o.world_size or ''} | {o.status} | {_cell(why)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    print(markdown_table(replay_all()), end="")
    sys.exit(0)
