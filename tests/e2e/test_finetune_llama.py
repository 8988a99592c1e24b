"""finetune_llama.py end to end on 2 CPU ranks (forked as torchrun would start them): supervised fine-tuning on a JSON of examples over more than
one pass (--repeated-dataloader), its exact resume across a pass boundary, and its launch errors as one line."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ds.testing.pretrain_runs import run_pretrain_gpt
from megatron_ds.testing.script_runs import run_python

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
GPT2 = ROOT / "tests" / "fixtures" / "megatron_deepspeed"
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*lm loss: ([0-9.E+-]+)")
WORDS = "the cat sat on a mat and ran to see what is there in this world of many things".split()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """13 short examples and a GPT-2 BPE tokenizer without a pad token (HFTokenizer adds [PAD] as id 377)."""
    root = tmp_path_factory.mktemp("finetune")
    tok = root / "tok"
    tok.mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(GPT2 / name, tok / name)
    eos = "<|endoftext|>"
    config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": eos, "eos_token": eos, "unk_token": eos}
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    examples = [
        {
            "instruction": " ".join(WORDS[k % 7 : k % 7 + 2]),
            "input": "" if k % 3 else WORDS[k % 11],
            "output": " ".join(WORDS[k : k + 1 + k % 4]),
        }
        for k in range(13)
    ]
    (root / "examples.json").write_text(json.dumps(examples))
    return {"tok": str(tok), "data": str(root / "examples.json"), "root": str(root)}


def line(inputs: dict[str, str], *extra: str) -> list[str]:
    """A tiny Llama-style line as finetune_llama.sh writes it. --make-vocab-size-divisible-by 1 keeps the model at
    the tokenizer's 377 ids, so the added [PAD] (377) lies outside it, as Llama's does."""
    return [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
        "--seq-length", "200", "--max-position-embeddings", "200", "--swiglu", "--normalization", "rmsnorm",
        "--use-rotary-position-embeddings", "--no-position-embedding", "--untie-embeddings-and-output-weights",
        "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--make-vocab-size-divisible-by", "1", "--tokenizer-type", "HFTokenizer", "--tokenizer-model", inputs["tok"],
        "--data-path", inputs["data"], "--split", "100,0,0", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "6", "--lr", "1e-3", "--lr-decay-style", "constant", "--log-interval", "1",
        "--eval-iters", "0", "--num-workers", "0", "--distributed-timeout-minutes", "2",
        "--pipeline-model-parallel-size", "2", *extra,
    ]  # fmt: skip


def finetune(inputs: dict[str, str], *extra: str) -> str:
    out = run_pretrain_gpt(2, line(inputs, *extra), timeout=300, script="finetune_llama.py")
    assert "killed after" not in out.stdout, out.stdout[-4000:]
    assert out.returncode == 0, out.stdout[-4000:]
    return out.stdout


def losses(text: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in LOSS.finditer(text)}


@pytest.fixture(scope="module")
def straight(inputs: dict[str, str]) -> str:
    """Six iterations: 24 samples of 12 per pass (the 13th example is dropped each pass), saved every 2."""
    save = str(Path(inputs["root"]) / "ck")
    return finetune(inputs, "--repeated-dataloader", "--save", save, "--save-interval", "2")


def test_finetuning_runs_two_passes_over_the_examples(straight: str, inputs: dict[str, str]) -> None:
    assert f"prompt data: 13 examples in {inputs['data']}, 12 samples per pass; the run trains on 24 (2.00 passes)" in (
        straight
    )
    assert sorted(losses(straight)) == list(range(1, 7))
    assert float(losses(straight)[6]) < float(losses(straight)[1])  # it learns the responses


def test_resume_across_the_pass_boundary_is_exact(straight: str, inputs: dict[str, str]) -> None:
    """Resumed after 2 iterations (8 samples): iterations 4-6 read the second pass as the straight run did."""
    root = Path(inputs["root"])
    second = finetune(
        inputs,
        "--repeated-dataloader",
        "--load",
        str(root / "ck"),
        "--load-tag",
        "global_step2",
        "--save",
        str(root / "ck2"),
    )
    assert "NOTICE: --repeated-dataloader: resumed after 8 samples" in second
    assert sorted(losses(second)) == [3, 4, 5, 6]
    assert losses(second) == {k: v for k, v in losses(straight).items() if k > 2}


def test_too_few_examples_without_the_repeated_loader_is_one_line(inputs: dict[str, str]) -> None:
    proc = run_python([str(ROOT / "finetune_llama.py"), *line(inputs)], timeout=120, cwd=str(ROOT))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        f"error: --data-path {inputs['data']} gives 12 samples per pass, the run trains on 24; add "
        "--repeated-dataloader (as finetune_llama.sh does) or lower --train-iters to 3"
    )


SFT = ROOT / "tests" / "fixtures" / "megatron_deepspeed_sft"


def tiny_hf_llama(directory: Path) -> Path:
    """A Llama that transformers creates with random weights (seed 0), with the fixture's 700-piece Llama-like
    tokenizer files beside it."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=700, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SFT / "tok_llama" / name, directory / name)
    return directory


def test_a_hugging_face_llama_fine_tunes_and_exports_with_its_tokenizer(tmp_path: Path) -> None:
    """transformers' Llama -> tools/convert_checkpoint.py --from hf -> finetune_llama.py --finetune with HFTokenizer on
    the same directory -> --to hf: transformers computes our logits, with the directory's own tokenizer files and
    special ids (not HFTokenizer's added [PAD], which has no embedding row)."""
    import torch
    import transformers

    from megatron_ds.inference import load_model

    sft, hf = SFT, tiny_hf_llama(tmp_path / "tiny-llama")
    tool = [str(ROOT / "tools" / "convert_checkpoint.py")]
    imported = run_python([*tool, "--from", "hf", str(hf), str(tmp_path / "ck")], timeout=300)
    assert imported.returncode == 0, imported.stderr
    flags = imported.stdout.split("pretrain_gpt.py ", 1)[1].split(" --tokenizer-type")[0].split()
    out = run_pretrain_gpt(
        2,
        [
            *flags, "--finetune", "--tokenizer-type", "HFTokenizer",
            "--tokenizer-model", str(hf), "--data-path", str(sft / "alpaca.json"), "--seq-length", "32",
            "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "2", "--lr", "1e-3", "--split", "100,0,0", "--eval-iters", "0", "--num-workers", "0",
            "--distributed-timeout-minutes", "2", "--save", str(tmp_path / "sft"),
        ],
        timeout=300,
        script="finetune_llama.py",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-4000:]
    assert "this run's HFTokenizer" in out.stdout and "has the same vocabulary" in out.stdout
    exported = run_python([*tool, "--to", "hf", str(tmp_path / "sft"), str(tmp_path / "out")], timeout=300)
    assert exported.returncode == 0, exported.stderr
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (hf / name).read_bytes()
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (saved["bos_token_id"], saved["eos_token_id"], saved.get("pad_token_id")) == (1, 2, None)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ours = load_model(str(tmp_path / "sft"), vocab_size=700)
    tokens = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")("### Response: hi", return_tensors="pt")
    with torch.no_grad():
        assert (ours(tokens.input_ids) - theirs(tokens.input_ids).logits).abs().max().item() <= 1e-4
        before = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()(tokens.input_ids).logits
        assert (before - theirs(tokens.input_ids).logits).abs().max().item() > 1e-3  # fine-tuning changed the model


def test_the_example_script_converts_and_checks_its_line(tmp_path: Path) -> None:
    """examples/finetune_llama.sh: the Hugging Face conversion, then its finetune_llama.py line (--print-layout: the
    launch's checks, the examples read, no training)."""
    import os

    sft, hf = SFT, tiny_hf_llama(tmp_path / "tiny-llama")
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "HF_DIR": str(hf),
        "DATA_PATH": str(sft / "alpaca.json"),
        "CONVERTED": str(tmp_path / "ck"),
        "SAVE_DIR": str(tmp_path / "sft"),
        "LAUNCHER": sys.executable,
        "TP": "1",
        "PP": "1",
        "SEQ_LENGTH": "64",
        "MICRO_BATCH": "2",
        "GLOBAL_BATCH": "4",
        "PRECISION": "--bf16",
    }
    out = subprocess.run(
        ["bash", str(ROOT / "examples" / "finetune_llama.sh"), "--print-layout"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"imported Hugging Face llama {hf} to {tmp_path / 'ck'}" in out.stdout
    assert f"prompt data: 13 examples in {sft / 'alpaca.json'}, 12 samples per pass; the run trains on 14000" in (
        out.stdout
    )
    assert "this run's HFTokenizer" in out.stdout and "has the same vocabulary" in out.stdout
