"""Megatron-LM's example lines through our pretrain_gpt.py, on CPU:
`examples/gpt3/train_gpt3_175b_distributed.sh`, `examples/llama/train_llama3_8b_h100_fp8.sh` and
`examples/mixtral/train_mixtral_8x7b_distributed.sh` (NVIDIA/Megatron-LM d98e8a64dd), each flag as the script writes
it, in the script's order. Changes,
all forced by the CPU test machine or size: model, batch and length sizes (the step batch-size
schedule's thresholds shrunk with them); T x P of the GPT-3 line 8 x 16 -> 1 x 2, and its `--fp16`
-> `--bf16` (no fp16 on CPU); the Llama line's FP8 flags dropped (with them, the third test: one line
naming FP8); `--tensorboard-dir` only when tensorboard is installed; `--load-optional` next to
`--load` until a first launch on an empty `--load` starts by itself (issue 21, item 1); the Llama
line's `--split '99,1,0'`, which its bash array passes with the quotes, as 99,1,0; the Mixtral line's P x EP 4 x 8
-> 2 x 1 on 2 ranks and its Llama 2 tokenizer -> mock data (the Llama line's data flags).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ds.testing.pretrain_runs import run_pretrain_gpt
from megatron_ds.testing.script_runs import run_python

ROOT = Path(__file__).resolve().parents[2]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*global batch size:\s+(\d+) \| lm loss: ([0-9.E+-]+)")
FP8 = [
    "--fp8-format",
    "hybrid",
    "--fp8-amax-history-len",
    "1024",
    "--fp8-amax-compute-algo",
    "max",
    "--fp8-param-gather",
]
TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A GPT-2 byte-level vocabulary, a small corpus tokenized with it, and the same tokenizer as a
    Hugging Face directory."""
    from megatron_ds.data.tokenizer import GPT2BPETokenizer, _bytes_to_unicode
    from megatron_ds.interop.hf_tokenizer import export_tokenizer

    tmp = tmp_path_factory.mktemp("mlm")
    vocab = {s: i for i, s in enumerate(_bytes_to_unicode().values())}
    merges = ["t h", "th e", "Ġ a", "Ġ s", "e r"]
    for m in merges:
        vocab["".join(m.split(" "))] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (tmp / "vocab.json").write_text(json.dumps(vocab))
    (tmp / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    words = "the quick brown fox jumps over a lazy dog while stages pass activations and gradients".split()
    docs = [" ".join(words[(d * 5 + i) % len(words)] for i in range(10 + d % 7)) for d in range(1500)]
    (tmp / "corpus.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in docs) + "\n")
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp / "vocab.json")]
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", str(tmp / "corpus.jsonl"),
         "--output-prefix", str(tmp / "gpt2"), *gpt2, "--merge-file", str(tmp / "merges.txt"), "--append-eod"],
        check=True, capture_output=True, cwd=ROOT, timeout=180,
    )  # fmt: skip
    hf = tmp / "hf_tokenizer"
    hf.mkdir()
    export_tokenizer(GPT2BPETokenizer(str(tmp / "vocab.json"), str(tmp / "merges.txt")), str(hf), 64)
    return {
        "tmp": str(tmp),
        "vocab": str(tmp / "vocab.json"),
        "merges": str(tmp / "merges.txt"),
        "prefix": str(tmp / "gpt2_text_document"),
        "hf": str(hf),
    }


def gpt3_175b_line(data: dict[str, str], ckpt: str, tensorboard: str) -> list[str]:
    """GPT_MODEL_ARGS, TRAINING_ARGS, MODEL_PARALLEL_ARGS, DATA_ARGS, EVAL_AND_LOGGING_ARGS, scaled down."""
    model = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--attention-backend", "auto"]  # fmt: skip
    training = [
        "--micro-batch-size", "1", "--global-batch-size", "8",
        "--step-batch-size-schedule", "0:2 64:4 256:8",  # tokens: 2 samples of 32 -> 4, 8 samples -> 8
        "--train-iters", "6", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0", "--bf16", "--lr", "6.0e-5", "--lr-decay-style",
        "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-iters", "10",
    ]  # fmt: skip
    parallel = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"]
    data_args = ["--data-path", data["prefix"], "--vocab-file", data["vocab"], "--merge-file", data["merges"],
                 "--split", "949,50,1"]  # fmt: skip
    logging = ["--log-interval", "1", "--save-interval", "4", "--eval-interval", "3", "--save", ckpt, "--load",
               ckpt, "--load-optional", "--eval-iters", "1"]  # fmt: skip
    logging += ["--tensorboard-dir", tensorboard] if TENSORBOARD else []
    return [*model, *training, *parallel, *data_args, *logging, "--num-workers", "0"]


def llama3_8b_line(tmp: str, data_args: list[str]) -> list[str]:
    """MODEL_ARGS, TRAINING_ARGS (with DDP_ARGS), MODEL_PARALLEL_ARGS, DATA_ARGS_LIST, EVAL_AND_LOGGING_ARGS,
    scaled down (FP8's DTYPE_ARGS are added by the caller that wants them)."""
    model = [
        "--use-mcore-models", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "96",
        "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
        "--seq-length", "32", "--max-position-embeddings", "32", "--position-embedding-type", "rope",
        "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout",
        "0.0", "--swiglu", "--normalization", "RMSNorm", "--init-method-std", "0.0134", "--attention-backend",
        "fused", "--apply-layernorm-1p", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    ]  # fmt: skip
    training = [
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-samples", "16", "--lr-decay-samples", "14",
        "--lr-warmup-samples", "4", "--lr", "0.00015", "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4",
        "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
        "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level",
        "1", "--exit-duration-in-mins", "235", "--use-distributed-optimizer", "--overlap-grad-reduce",
        "--overlap-param-gather",
    ]  # fmt: skip
    parallel = ["--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel"]
    logging = [
        "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "100", "--save-interval", "1000",
        "--log-throughput", "--profile", "--profile-step-start", "1", "--profile-step-end", "2", "--ckpt-format",
        "torch_dist", "--distributed-timeout-minutes", "60", "--save", f"{tmp}/ckpt", "--load", f"{tmp}/ckpt",
        "--load-optional",
    ]  # fmt: skip
    logging += ["--tensorboard-dir", f"{tmp}/tb"] if TENSORBOARD else []
    return [*model, *training, *parallel, *data_args, *logging]


def mock_data_args(tmp: str) -> list[str]:
    return [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--data-cache-path",
        f"{tmp}/cache", "--tiktoken-pattern", "v2", "--split", "99,1,0", "--no-create-attention-mask-in-dataloader",
        "--no-mmap-bin-files", "--num-workers", "1",
    ]  # fmt: skip


def real_data_args(tmp: str, data: dict[str, str]) -> list[str]:
    return [
        "--data-path", data["prefix"], "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", data["hf"],
        "--data-cache-path", f"{tmp}/cache", "--split", "99,1,0", "--no-create-attention-mask-in-dataloader",
        "--no-mmap-bin-files", "--num-workers", "1", "--vocab-size", "128256",
    ]  # fmt: skip


def launch(nproc: int, argv: list[str], cwd: str) -> str:
    out = run_pretrain_gpt(nproc, argv, timeout=300, cwd=cwd)
    assert "killed after" not in out.stdout and out.returncode == 0, out.stdout[-5000:]
    return out.stdout


def test_gpt3_175b_line_trains_with_its_batch_size_schedule(data: dict[str, str], tmp_path: Path) -> None:
    out = launch(2, gpt3_175b_line(data, str(tmp_path / "ckpt"), str(tmp_path / "tb")), str(tmp_path))
    got = {int(m.group(1)): (int(m.group(2)), float(m.group(3))) for m in LOSS.finditer(out)}
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    # Megatron-LM's schedule in samples (thresholds / --seq-length 32): 0:2 2:4 8:8
    assert [got[i][0] for i in range(1, 7)] == [2, 4, 4, 8, 8, 8]
    assert all(0.0 < loss < 20.0 for _, loss in got.values())
    assert "transformer layers per stage: 2 2" in out and "validation loss at iteration 3" in out
    assert "saved checkpoint" in out and (tmp_path / "ckpt" / "latest").read_text() == "global_step6"


def test_llama3_8b_line_trains_without_fp8(data: dict[str, str], tmp_path: Path) -> None:
    tmp = str(tmp_path)
    out = launch(2, llama3_8b_line(tmp, mock_data_args(tmp)), tmp)
    got = {int(m.group(1)) for m in LOSS.finditer(out)}
    assert got == {1, 2, 3, 4}  # --train-samples 16 of 4
    assert "NOTICE: --sequence-parallel changes nothing" in out and "NOTICE: --ckpt-format torch_dist" in out
    traces = sorted(p.name for p in (tmp_path / "torch_profile").glob("rank-*.json.gz"))
    assert traces == ["rank-0.json.gz", "rank-1.json.gz"]  # --profile: one trace per rank of steps 2..2
    meta = json.loads((tmp_path / "ckpt" / "global_step4" / "megatron_ds.json").read_text())
    assert (
        meta["config"]["model"]["normalization"] == "rmsnorm1p" and meta["config"]["model"]["num_key_value_heads"] == 2
    )
    assert meta["config"]["training"]["zero_stage"] == 1 and meta["config"]["optimizer"]["decoupled_lr"] == 5e-4
    # the real-data branch: --tokenizer-type HuggingFaceTokenizer on a local directory, one process
    real = run_python(
        [str(ROOT / "pretrain_gpt.py"), *llama3_8b_line(f"{tmp}/real", real_data_args(tmp, data))], timeout=240, cwd=tmp
    )
    assert real.returncode == 0, (real.stdout + real.stderr)[-4000:]
    assert {int(m.group(1)) for m in LOSS.finditer(real.stdout)} == {1, 2, 3, 4}


def test_llama3_8b_line_with_fp8_is_one_line_naming_fp8(tmp_path: Path) -> None:
    tmp = str(tmp_path)
    out = run_python([str(ROOT / "pretrain_gpt.py"), *llama3_8b_line(tmp, mock_data_args(tmp)), *FP8], 120, cwd=tmp)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: --fp8-format is not supported: FP8 training"), errors
    assert "Transformer Engine" in errors[0] and "--fp8-param-gather" in errors[0]
    assert not (tmp_path / "ckpt").exists()  # refused before anything started


def mixtral_8x7b_line(tmp: str) -> list[str]:
    """MODEL_ARGS, MOE_ARGS, DATA_ARGS, TRAINING_ARGS, MODEL_PARALLEL_ARGS, LOGGING_ARGS, scaled down."""
    model = [
        "--use-mcore-models", "--disable-bias-linear", "--seq-length", "32", "--max-position-embeddings", "64",
        "--num-layers", "4", "--hidden-size", "32", "--ffn-hidden-size", "48", "--num-attention-heads", "4",
        "--init-method-std", "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--normalization",
        "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--untie-embeddings-and-output-weights",
        "--group-query-attention", "--num-query-groups", "2", "--no-masked-softmax-fusion", "--no-position-embedding",
        "--rotary-base", "1000000",
    ]  # fmt: skip
    moe = [
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
        "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
        "--overlap-param-gather", "--overlap-grad-reduce",
    ]  # fmt: skip
    training = [
        "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-4", "--train-iters", "3",
        "--lr-decay-iters", "3", "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1",
        "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--bf16",
    ]  # fmt: skip
    parallel = [
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size",
        "1", "--use-distributed-optimizer", "--sequence-parallel",
    ]  # fmt: skip
    logging = [
        "--log-interval", "1", "--save-interval", "3", "--eval-interval", "1000", "--eval-iters", "1", "--save",
        f"{tmp}/ckpt", "--load", f"{tmp}/ckpt", "--load-optional", "--no-load-optim", "--no-load-rng",
    ]  # fmt: skip
    return [*model, *moe, *mock_data_args(tmp), *training, *parallel, *logging]


def test_mixtral_8x7b_line_trains_with_megatron_lms_router(tmp_path: Path) -> None:
    """Its MoE flags choose Megatron-LM's top-2 router (every token routed, coefficient 0.01), the experts in optimizer
    groups of their own under the distributed optimizer (ZeRO-1), at P = 2 on DeepSpeed's pipeline engine."""
    tmp = str(tmp_path)
    out = launch(2, mixtral_8x7b_line(tmp), tmp)
    assert {int(m.group(1)) for m in LOSS.finditer(out)} == {1, 2, 3}
    assert "moe loss" in out and "NOTICE: Megatron-LM's router computes its logits in bf16" in out
    meta = json.loads((tmp_path / "ckpt" / "global_step3" / "megatron_ds.json").read_text())["config"]
    model = meta["model"]
    assert (model["moe_router"], model["moe_top_k"], model["moe_loss_coeff"]) == ("megatron", 2, 0.01)
    assert model["expert_interval"] == 1 and model["num_experts"] == [4] and not model["moe_token_dropping"]
    assert meta["training"]["zero_stage"] == 1 and meta["optimizer"]["create_moe_param_group"]
