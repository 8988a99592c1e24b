"""The Hugging Face packages stay an optional extra, and inference needs no distributed stack."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HF_PACKAGES = {"transformers", "safetensors", "tokenizers", "huggingface_hub"}


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


LAZY_TOKENIZER = ROOT / "megatron_ds" / "data" / "huggingface_tokenizer.py"
"""Megatron-LM's `--tokenizer-type HuggingFaceTokenizer`, which the data layer builds (below interop):
it imports transformers inside a function, only when that tokenizer is asked for (checked below)."""


def test_only_interop_imports_hugging_face_packages() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "megatron_ds").rglob("*.py")
        if "interop" not in p.parts and p != LAZY_TOKENIZER and _imported_roots(p) & HF_PACKAGES
    ]
    top_level = {
        node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
        for node in ast.parse(LAZY_TOKENIZER.read_text()).body
        if isinstance(node, (ast.Import, ast.ImportFrom))
    }
    assert not {m.split(".")[0] for m in top_level if m} & HF_PACKAGES, "import transformers lazily there"
    offenders += [str(p) for p in (ROOT / "pretrain_gpt.py",) if _imported_roots(p) & HF_PACKAGES]
    assert offenders == []


def test_trainer_and_inference_load_without_hugging_face_or_deepspeed() -> None:
    code = (
        "import sys, torch\n"
        "from megatron_ds.inference import GPTModel, generate, load_model\n"
        "from megatron_ds.config import ModelConfig\n"
        "m = GPTModel(ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=8, "
        "seq_length=4, max_position_embeddings=8, vocab_size=16))\n"
        "generate(m, [1, 2], 3, temperature=0.0)\n"
        "inference = ('deepspeed' in sys.modules, torch.distributed.is_initialized())\n"
        "import megatron_ds.training.loop, megatron_ds.flags.parser\n"
        f"hf = [m for m in {sorted(HF_PACKAGES)!r} if m in sys.modules]\n"
        "print('RESULT', inference, hf)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "RESULT (False, False) []" in out.stdout.splitlines()
