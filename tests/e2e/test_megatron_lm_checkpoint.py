"""Megatron-LM checkpoints written by megatron-core itself (`testing.megatron_lm_checkpoints`: its GPTModel,
its dist_checkpointing, its scheduler, args from Megatron-LM core_v0.16.1's own argument code), converted
with `tools/convert_checkpoint.py --from megatron-lm`: the converted model computes megatron-core's logits,
the run continues at its iteration on its schedule under another layout, and damaged or foreign input is
one line, with nothing written and the source untouched."""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ds.errors import UserError
from megatron_ds.inference.model import load_model
from megatron_ds.interop.megatron_lm import import_megatron_lm
from megatron_ds.testing.megatron_lm_checkpoints import recorded, write_checkpoint
from megatron_ds.training.checkpoint.directory import CONVERTED, META, CheckpointError, read_meta
from megatron_ds.training.checkpoint.universal.store import Universal

ROOT = Path(__file__).resolve().parents[2]
CASES = [(name, fmt) for name in ("gpt", "llama", "gpt_pp2") for fmt in ("torch_dist", "torch")]
"""GPT-3 style at T=1 (learned positions, LayerNorm, GeLU, biases, tied); Llama style at T=2 (rotary,
RMSNorm, SwiGLU, 2 query groups, no biases, untied, bf16); the GPT on P=2 (each stage numbers its
layers from 0 in `torch`'s files; the tied output layer's copy on the last stage); each in both
checkpoint formats."""


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("megatron_lm")
    out = {}
    for name, fmt in CASES:
        path = root / f"{name}-{fmt}"
        out[name, fmt] = path, write_checkpoint(name, str(path), fmt, iteration=5)
    return out


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode() + f.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize(("name", "fmt"), CASES)
def test_converted_model_computes_megatron_cores_logits(sources, tmp_path: Path, name: str, fmt: str) -> None:
    source, reference = sources[name, fmt]
    before = _digest(source)
    result = import_megatron_lm(str(source), str(tmp_path / "out"), show_progress=False)
    assert _digest(source) == before  # only read
    model = load_model(str(tmp_path / "out"))
    with torch.no_grad():
        logits = model.float()(reference["tokens"])
    args = recorded(name)["args"]
    assert logits.shape[-1] == args["vocab_size"] + 1  # the NullTokenizer's ids; the padding rows are not tokens
    torch.testing.assert_close(logits, reference["logits"][..., : logits.shape[-1]], rtol=0, atol=1e-6)
    assert result.iteration == 5 and result.tag == "global_step5"
    assert result.config.model.vocab_size == args["padded_vocab_size"]
    assert result.config.parallel.tensor_model_parallel_size == args["tensor_model_parallel_size"]
    meta = read_meta(str(tmp_path / "out"), "global_step5")
    assert meta["train_state"]["consumed_train_samples"] == 5 * args["global_batch_size"]
    assert meta["train_state"]["floating_point_operations_so_far"] == 5.0e12
    assert meta[CONVERTED]["upstream"] == "megatron-lm" and meta[CONVERTED]["ckpt_format"] == fmt
    universal = Universal(str(tmp_path / "out" / "global_step5.universal"))
    assert universal.states == []  # weights only: the optimizer's moments are not converted


def test_tool_prints_the_flags_and_a_resume_continues_megatron_lms_schedule(sources, tmp_path: Path) -> None:
    """The T=2 bf16 checkpoint resumes on one process (T=1, vocabulary padded to the same 256 rows) at
    iteration 6, with the learning rate megatron-core's own scheduler gives after 6 and 7 steps."""
    source, _ = sources["llama", "torch_dist"]
    out = tmp_path / "converted"
    tool = [sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), "--from", "megatron-lm"]
    run = subprocess.run([*tool, str(source), str(out), "--no-progress"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "NOTICE: the optimizer state is not converted" in run.stdout
    flags = run.stdout.strip().splitlines()[-1].split()
    assert flags[:3] == ["pretrain_gpt.py", "--load", str(out)]
    assert {"--swiglu", "--group-query-attention", "--untie-embeddings-and-output-weights", "--bf16"} <= set(flags)
    extra = "--mock-data --num-workers 0 --log-interval 1 --eval-iters 0 --train-iters 7 --lr-decay-iters 20"
    extra += " --make-vocab-size-divisible-by 256"
    cmd = [sys.executable, str(ROOT / "pretrain_gpt.py"), *flags[1:], *extra.split()]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "was saved with Megatron-LM (converted" in run.stdout
    assert "resumed from" in run.stdout and "at iteration 5 (40 samples consumed)" in run.stdout
    # megatron-core's OptimizerParamScheduler(max 3e-4, min 3e-5, warm-up 16 and cosine decay over 160 samples)
    # after 6 and 7 steps of 8 samples: 2.6841599982e-4 and 2.5177632731e-4
    assert "iteration        6/       7 | consumed samples:           48" in run.stdout
    assert "learning rate: 2.684160E-04" in run.stdout
    assert "learning rate: 2.517763E-04" in run.stdout


def test_load_of_a_megatron_lm_checkpoint_says_how_to_convert_it(sources) -> None:
    source, _ = sources["gpt", "torch"]
    cmd = [
        sys.executable,
        str(ROOT / "pretrain_gpt.py"),
        *recorded("gpt")["argv"],
        "--mock-data",
        "--load",
        str(source),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert line == (
        f"error: --load {source}: a Megatron-LM checkpoint (iter_0000005: --ckpt-format torch); convert it first: "
        f"python tools/convert_checkpoint.py --from megatron-lm {source} OUT, then --load OUT"
    )


def _copy(source: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "source"
    shutil.copytree(source, copy)
    return copy


def test_a_pickled_global_in_the_metadata_is_refused(sources, tmp_path: Path) -> None:
    source = _copy(sources["gpt", "torch_dist"][0], tmp_path)

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    (source / "iter_0000005" / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match=r"\.metadata: unreadable \(holds a pickled posix\.system"):
        import_megatron_lm(str(source), str(tmp_path / "out"), show_progress=False)
    assert not (tmp_path / "ran").exists() and not (tmp_path / "out").exists()


def test_a_missing_chunk_file_is_named(sources, tmp_path: Path) -> None:
    source = _copy(sources["llama", "torch_dist"][0], tmp_path)
    (source / "iter_0000005" / "__1_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp: unreadable"):
        import_megatron_lm(str(source), str(tmp_path / "out"), show_progress=False)
    assert not (tmp_path / "out").exists()


def test_a_tensor_the_model_does_not_have_is_refused(sources, tmp_path: Path) -> None:
    """A stored weight the saved args do not account for (here a QK layer norm) is not silently dropped."""
    source = _copy(sources["gpt", "torch"][0], tmp_path)
    path = source / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)  # the test's own file: megatron-core's classes are importable
    state["model"]["decoder.layers.1.self_attention.q_layernorm.weight"] = torch.ones(8)
    torch.save(state, path)
    with pytest.raises(
        CheckpointError,
        match=r"holds 1 tensor\(s\) the model of its saved args does not have "
        r"\(0:decoder\.layers\.1\.self_attention\.q_layernorm\.weight\)",
    ):
        import_megatron_lm(str(source), str(tmp_path / "out"), show_progress=False)
    assert not (tmp_path / "out").exists()


def test_an_existing_output_is_never_overwritten(sources, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(UserError, match="already exists; choose a new directory"):
        import_megatron_lm(str(sources["gpt", "torch_dist"][0]), str(out), show_progress=False)
    assert (out / "keep").read_text() == "x" and not (out / META).exists()
