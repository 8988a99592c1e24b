"""Megatron-DeepSpeed launch lines, unchanged except for size, through our pretrain_gpt.py.

The flag sets are those of Megatron-DeepSpeed's GPT-3 1.3B dense script
(`examples_deepspeed/MoE/ds_pretrain_gpt_1.3B_dense.sh`, with its activation checkpointing and
optimizer-state logging switched on) and of `examples_deepspeed/pretrain_llama2_distributed.sh`,
with the DeepSpeed JSON those scripts write. Changes, all forced by the CPU test machine or size:
model and batch sizes; the GPT line's `--fp16` -> `--bf16` and its JSON's precision sections to match
(no fp16 on CPU); `--distributed-backend nccl` -> `gloo`. Their `--save DIR --load DIR` on an empty
directory starts from scratch, as in Megatron-DeepSpeed, with one NOTICE.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ds.testing.pretrain_runs import run_pretrain_gpt
from megatron_ds.testing.script_runs import run_python

ROOT = Path(__file__).resolve().parents[2]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*lm loss: ([0-9.E+-]+)")
WORDS = (
    "hello world the quick brown fox jumps over a lazy dog while pipeline stages pass activations "
    "and gradients between ranks every micro batch"
).split()


def corpus(path: Path, num_docs: int = 2000) -> Path:
    """A deterministic JSONL corpus of short documents (enough for the Llama script's 949,50,1 split)."""
    lines = []
    for d in range(num_docs):
        words = [WORDS[(d * 7 + i * 3) % len(WORDS)] for i in range(8 + d % 8)]
        lines.append(json.dumps({"text": " ".join(words) + "."}))
    path.write_text("\n".join(lines) + "\n")
    return path


def gpt2_files(tmp: Path) -> tuple[str, str]:
    """A byte-level GPT-2 vocabulary (256 byte symbols, a few merges, <|endoftext|>)."""
    from megatron_ds.data.tokenizer import _bytes_to_unicode

    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "Ġ t"]
    vocab = {s: i for i, s in enumerate(_bytes_to_unicode().values())}
    for m in merges:
        vocab["".join(m.split(" "))] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (tmp / "vocab.json").write_text(json.dumps(vocab))
    (tmp / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return str(tmp / "vocab.json"), str(tmp / "merges.txt")


def preprocess(jsonl: Path, jobs: dict[Path, list[str]]) -> list[str]:
    """tools/preprocess_data.py once per (output prefix, tokenizer flags), run side by side."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tools" / "preprocess_data.py"),
                "--input",
                str(jsonl),
                "--output-prefix",
                str(prefix),
                *tokenizer,
                "--append-eod",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for prefix, tokenizer in jobs.items()
    ]
    for proc in procs:
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, out[-3000:]
    return [f"{prefix}_text_document" for prefix in jobs]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from megatron_ds.data.tokenizer_training import train_sentencepiece

    tmp = tmp_path_factory.mktemp("mds")
    jsonl = corpus(tmp / "corpus.jsonl")
    vocab_file, merge_file = gpt2_files(tmp)
    texts = [json.loads(line)["text"] for line in jsonl.read_text().splitlines()]
    sp_model = train_sentencepiece(texts, str(tmp / "llama_tok"), vocab_size=120)
    gpt2_prefix, sp_prefix = preprocess(
        jsonl,
        {
            tmp / "gpt2": [
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--vocab-file",
                vocab_file,
                "--merge-file",
                merge_file,
            ],
            tmp / "sp": ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model],
        },
    )
    return {
        "vocab": vocab_file,
        "merges": merge_file,
        "sp_model": sp_model,
        "gpt2_prefix": gpt2_prefix,
        "sp_prefix": sp_prefix,
    }


def launch(nproc: int, argv: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    out = run_pretrain_gpt(nproc, argv, timeout=timeout, cwd=str(ROOT))
    assert "killed after" not in out.stdout, out.stdout[-4000:]
    return out


def one_process(argv: list[str]) -> subprocess.CompletedProcess:
    """`pretrain_gpt.py` in one plain process (no launcher) under a hard timeout."""
    return run_python([str(ROOT / "pretrain_gpt.py"), *argv], timeout=180, cwd=ROOT)


def losses(text: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in LOSS.finditer(text)}


def gpt_1_3b_dense_line(data: dict[str, str], ckpt: str, ds_json: str, tensorboard: str) -> list[str]:
    """ds_pretrain_gpt_1.3B_dense.sh's megatron_options + data_options + deepspeed_options, scaled down."""
    seq, gbs = 16, 8
    megatron_options = [
        "--override-opt_param-scheduler",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.95",
        "--tensor-model-parallel-size",
        "1",
        "--init-method-std",
        "0.013",
        "--lr-decay-tokens",
        str(6 * gbs * seq),
        "--lr-warmup-tokens",
        str(gbs * seq),
        "--micro-batch-size",
        "2",
        "--exit-duration-in-mins",
        "30000000",
        "--global-batch-size",
        str(gbs),
        "--num-layers",
        "4",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        str(seq),
        "--max-position-embeddings",
        str(seq),
        "--train-tokens",
        str(6 * gbs * seq),
        "--train-samples",
        "100",
        "--lr",
        "2.0e-4",
        "--min-lr",
        "1.0e-6",
        "--lr-decay-style",
        "cosine",
        "--split",
        "98,2,0",
        "--log-interval",
        "1",
        "--eval-interval",
        "100",
        "--eval-iters",
        "2",
        "--save-interval",
        "100",
        "--weight-decay",
        "0.1",
        "--clip-grad",
        "1.0",
        "--hysteresis",
        "2",
        "--num-workers",
        "0",
        "--bf16",  # their --fp16
        "--load",
        ckpt,
        "--save",
        ckpt,
        "--tensorboard-queue-size",
        "1",
        "--log-timers-to-tensorboard",
        "--log-batch-size-to-tensorboard",
        "--log-validation-ppl-to-tensorboard",
        "--tensorboard-dir",
        tensorboard,
        "--checkpoint-activations",
        "--log-optimizer-states-to-tensorboard",
    ]
    data_options = [
        "--vocab-file",
        data["vocab"],
        "--merge-file",
        data["merges"],
        "--data-path",
        data["gpt2_prefix"],
        "--data-impl",
        "mmap",
    ]  # GPT2BPETokenizer by default, as theirs
    deepspeed_options = [
        "--deepspeed",
        "--deepspeed_config",
        ds_json,
        "--pipeline-model-parallel-size",
        "3",
        "--deepspeed-activation-checkpointing",
    ]
    return [*megatron_options, *data_options, *deepspeed_options]


def gpt_ds_json(path: Path) -> str:
    """Their ds_config_gpt_TEMPLATE.json, filled in as their script's sed does (bf16 instead of fp16)."""
    path.write_text(
        json.dumps(
            {
                "train_batch_size": 8,
                "train_micro_batch_size_per_gpu": 2,
                "steps_per_print": 1,
                "zero_optimization": {"stage": 0},
                "gradient_clipping": 1.0,
                "prescale_gradients": False,
                "fp16": {
                    "enabled": False,
                    "loss_scale": 0,
                    "loss_scale_window": 500,
                    "hysteresis": 2,
                    "min_loss_scale": 1,
                    "initial_scale_power": 11,
                },
                "bf16": {"enabled": True},
                "wall_clock_breakdown": False,
            }
        )
    )
    return str(path)


def test_gpt_1_3b_dense_line_trains(data: dict[str, str], tmp_path: Path) -> None:
    from megatron_ds.training.logger import tensorboard_available

    tensorboard = str(tmp_path / "tb")
    argv = gpt_1_3b_dense_line(data, str(tmp_path / "ckpt"), gpt_ds_json(tmp_path / "ds.json"), tensorboard)
    if not tensorboard_available():  # optional extra; the other logging flags stay (ignored, with a warning)
        argv = argv[: argv.index("--tensorboard-dir")] + argv[argv.index("--tensorboard-dir") + 2 :]
    out = launch(3, argv)
    assert out.returncode == 0, out.stdout[-5000:]
    got = losses(out.stdout)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]  # --train-tokens 768 = 6 iterations of 8 x 16 tokens
    assert all(0.0 < v < 20.0 for v in got.values())
    assert "transformer layers per stage: 2 1 1" in out.stdout
    assert "saved checkpoint" in out.stdout and "holds no checkpoint yet: starting from scratch" in out.stdout
    assert "validation loss at iteration 6" in out.stdout
    if tensorboard_available():
        assert list(Path(tensorboard).glob("events.out.tfevents.*"))
    else:
        assert "--log-timers-to-tensorboard, --log-batch-size-to-tensorboard" in out.stdout  # the warning
    assert "--hysteresis only apply with --fp16; ignored with bf16" in out.stdout


def test_exit_duration_saves_and_stops_without_final_evaluation(tmp_path: Path) -> None:
    """--exit-duration-in-mins on one process (P=1, --no-pipeline-parallel): the first iteration
    already passes 0.0001 minutes, so it saves and stops there."""
    ckpt = tmp_path / "ckpt"
    out = one_process(
        [
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "16",
            "--vocab-size",
            "128",
            "--mock-data",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "4",
            "--train-iters",
            "50",
            "--lr",
            "1e-3",
            "--log-interval",
            "1",
            "--eval-iters",
            "2",
            "--no-pipeline-parallel",
            "--exit-duration-in-mins",
            "0.0001",
            "--save",
            str(ckpt),
        ]
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(losses(out.stdout)) == [1] and "exiting at iteration 1 after" in out.stdout
    assert "validation loss" not in out.stdout and (ckpt / "latest").read_text() == "global_step1"


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="--tensorboard-dir needs tensorboard")
def test_profile_pt_full_writes_one_trace_of_its_steps_into_the_tensorboard_dir(tmp_path: Path) -> None:
    """Megatron-DeepSpeed's --profile pt-full --profile_steps 2,2 on one process: one gzipped trace of step 2 with
    the Python stacks, named as torch's tensorboard_trace_handler names it, beside the TensorBoard events."""
    tensorboard = tmp_path / "tb"
    out = one_process(
        [
            *"--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 128".split(),
            *"--mock-data --micro-batch-size 2 --global-batch-size 4 --train-iters 3 --lr 1e-3".split(),
            *"--log-interval 1 --eval-iters 0 --no-pipeline-parallel".split(),
            *"--profile pt-full --profile_steps 2,2 --tensorboard-dir".split(),
            str(tensorboard),
        ]
    )
    assert out.returncode == 0, out.stderr[-3000:]
    traces = list(tensorboard.glob("*.pt.trace.json.gz"))
    assert len(traces) == 1 and f"[rank 0] wrote the --profile trace {traces[0]}\n" in out.stdout
    # written at the end of step 2: before iteration 2's log line
    assert out.stdout.index("wrote the --profile trace") < out.stdout.index("iteration        2/")
    with gzip.open(traces[0], "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("cat") == "python_function" and e["name"].endswith(": train_batch") for e in events)
    assert list(tensorboard.glob("events.out.tfevents.*"))


def llama2_line(data: dict[str, str], ckpt: str, ds_json: str) -> list[str]:
    """pretrain_llama2_distributed.sh's torchrun line with its ds_args, scaled down."""
    return [
        "--tensor-model-parallel-size",
        "1",
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers",
        "4",
        "--hidden-size",
        "32",
        "--ffn-hidden-size",
        "88",
        "--num-attention-heads",
        "4",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--seq-length",
        "16",
        "--max-position-embeddings",
        "16",
        "--train-iters",
        "4",
        "--save",
        ckpt,
        "--load",
        ckpt,
        "--data-path",
        data["sp_prefix"],
        "--data-impl",
        "mmap",
        "--tokenizer-type",
        "GPTSentencePieceTokenizer",
        "--tokenizer-model",
        data["sp_model"],
        "--split",
        "949,50,1",
        "--distributed-backend",
        "gloo",  # their nccl
        "--lr",
        "3e-4",
        "--lr-decay-style",
        "cosine",
        "--min-lr",
        "3e-5",
        "--weight-decay",
        "0.1",
        "--clip-grad",
        "1",
        "--lr-warmup-iters",
        "1",
        "--optimizer",
        "adam",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.95",
        "--log-interval",
        "1",
        "--save-interval",
        "10000",
        "--eval-interval",
        "1000",
        "--eval-iters",
        "2",
        "--bf16",
        "--no-query-key-layer-scaling",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
        "--use-rotary-position-embeddings",
        "--untie-embeddings-and-output-weights",
        "--swiglu",
        "--normalization",
        "rmsnorm",
        "--disable-bias-linear",
        "--num-key-value-heads",
        "2",
        "--deepspeed",
        f"--deepspeed_config={ds_json}",
        "--zero-stage=1",
        "--deepspeed-activation-checkpointing",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
    ]


def llama_ds_json(path: Path) -> str:
    path.write_text(
        json.dumps(
            {
                "train_batch_size": 8,
                "train_micro_batch_size_per_gpu": 2,
                "steps_per_print": 1,
                "zero_optimization": {"stage": 1},
                "bf16": {"enabled": True},
            }
        )
    )
    return str(path)


def test_llama2_line_trains(data: dict[str, str], tmp_path: Path) -> None:
    out = launch(2, llama2_line(data, str(tmp_path / "ckpt"), llama_ds_json(tmp_path / "ds.json")))
    assert out.returncode == 0, out.stdout[-5000:]
    assert sorted(losses(out.stdout)) == [1, 2, 3, 4]
    assert "2: EmbeddingDropout" in out.stdout and "LMHead" in out.stdout  # rotary, untied
    assert "test loss at iteration 4" in out.stdout


ONE_STAGE_VS_PLAIN = r"""
import torch, deepspeed
from deepspeed.pipe import PipelineModule
from megatron_ds.distributed import skip_cpu_shared_memory_allreduce
skip_cpu_shared_memory_allreduce()  # an unused op whose build can stall on a stale lock
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
def layers():
    return [torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)]
first = layers()
init = [{k: v.clone() for k, v in l.state_dict().items()} for l in first]
loss_fn = torch.nn.CrossEntropyLoss()
cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
       "gradient_clipping": 0.5, "steps_per_print": 10**9}
data = [(torch.randn(2, 4), torch.randint(0, 3, (2,))) for _ in range(6)]
pipe = PipelineModule(layers=first, num_stages=1, loss_fn=loss_fn)
engine, *_ = deepspeed.initialize(model=pipe, optimizer=torch.optim.AdamW(pipe.parameters(), lr=0.1), config=cfg)
for s in range(3):
    engine.train_batch(iter(data[2 * s:2 * s + 2]))
class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.seq = torch.nn.Sequential(*layers())
        for l, sd in zip(self.seq, init):
            l.load_state_dict(sd)
    def forward(self, x, y):
        return loss_fn(self.seq(x), y)
plain = Plain()
engine2, *_ = deepspeed.initialize(model=plain, optimizer=torch.optim.AdamW(plain.parameters(), lr=0.1), config=cfg)
for x, y in data:
    engine2.backward(engine2(x, y))
    engine2.step()
same = all(torch.equal(a, b) for a, b in zip(pipe.parameters(), plain.parameters()))
print("BIT-IDENTICAL" if same else "DIFFERENT")
deepspeed.comm.destroy_process_group()
"""


def test_one_stage_pipeline_engine_equals_the_plain_engine(tmp_path: Path) -> None:
    """What --no-pipeline-parallel relies on: a 1-stage PipelineModule trains as DeepSpeed's plain engine
    (3 steps of 2 accumulated micro-batches, AdamW, gradient clipping, fp32)."""
    from megatron_ds.testing.launch import free_port

    script = tmp_path / "one_stage.py"
    script.write_text(ONE_STAGE_VS_PLAIN)
    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "DS_ACCELERATOR": "cpu",
    }
    out = run_python([str(script)], timeout=120, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "BIT-IDENTICAL" in out.stdout, out.stdout[-2000:]
