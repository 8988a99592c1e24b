"""Megatron-LM checkpoints written by megatron-core itself (`testing.megatron_lm_checkpoints`: its GPTModel,
its dist_checkpointing, its scheduler, args from Megatron-LM core_v0.16.1's own argument code), converted
with `tools/convert_checkpoint.py --from megatron-lm`: the converted model computes megatron-core's logits,
the run continues at its iteration on its schedule under another layout, and damaged or foreign input is
one line, with nothing written and the source untouched."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from megatron_ds.errors import UserError
from megatron_ds.inference.model import GPTModel, load_model
from megatron_ds.interop.megatron_lm import RESTART, import_megatron_lm
from megatron_ds.interop.megatron_lm_files import DistTensors
from megatron_ds.testing.megatron_lm_checkpoints import recorded, write_checkpoints
from megatron_ds.testing.script_runs import run_python
from megatron_ds.training.checkpoint.directory import CONVERTED, META, CheckpointError, read_meta
from megatron_ds.training.checkpoint.universal.convert import convert_checkpoint
from megatron_ds.training.checkpoint.universal.store import Universal

ROOT = Path(__file__).resolve().parents[2]
CASES = [(name, fmt) for name in ("gpt", "llama", "gpt_pp2") for fmt in ("torch_dist", "torch")]
"""GPT-3 style at T=1 (learned positions, LayerNorm, GeLU, biases, tied); Llama style at T=2 (rotary,
RMSNorm, SwiGLU, 2 query groups, no biases, untied, bf16); the GPT on P=2 (each stage numbers its
layers from 0 in `torch`'s files; the tied output layer's copy on the last stage); each in both
checkpoint formats."""


TRAINED = {
    "gpt": "local",
    "llama": "fully_reshardable",
    "gpt-dp": "dp_reshardable",
    "gpt-dp2": "fully_reshardable",
    "llama-dp": "dp_reshardable",
    "llama-local": "local",
    "llama-dz": "dp_zero_gather_scatter",
    "gpt-fr-buckets": "fully_reshardable",
}
"""Two steps of megatron-core's Adam on fixed tokens, torch_dist saved after each: the GPT without the
distributed optimizer, the T=2 bf16 Llama with it saved --dist-ckpt-optim-fully-reshardable (fp32 masters
beside the bf16 weights), both also in `torch` format at the end (the optimizer's state_dict; the Llama's
distributed optimizer's `distrib_optim.pt`); the GPT on two data-parallel replicas with the distributed
optimizer, saved fully reshardable (each replica saves its share of every state) in one run, and in
another with --overlap-grad-reduce buckets (`BUCKET`) in its default dp_reshardable buckets and in `torch`
format; the Llama again in dp_reshardable buckets, and without the distributed optimizer in `torch` format
(its `fp32_from_fp16_params`; megatron-core 0.16 cannot save that optimizer as torch_dist on this model),
and with it as `dp_zero_gather_scatter` (core 0.5-0.6's torch_dist default: pickled buffers per rank); the
GPT fully reshardable with `BUCKET` buckets, which megatron-core 0.16 saves under shifted names. The P=2 GPT
is saved untrained."""
BUCKET = 8513
"""Elements per DDP bucket in the gpt-dp run: the first bucket ends after a 32-element norm (not at a
multiple of 64), so `distrib_optim.pt`, which cuts out the buckets' end padding, starts the next one there."""
SAME_RUN = {
    ("gpt-dp", "torch_dist"): ("gpt-dp2", "torch_dist"),
    ("gpt-dp", "torch"): ("gpt-dp2", "torch_dist"),
    ("llama-dp", "torch_dist"): ("llama", "torch_dist"),
    ("llama", "torch"): ("llama", "torch_dist"),
    ("gpt", "torch"): ("gpt", "torch_dist"),
    ("llama-local", "torch"): ("llama", "torch_dist"),
    ("llama-dz", "torch_dist"): ("llama", "torch_dist"),
}
"""Optimizer state saved in buffers or by parameter number (torch_dist's dp_reshardable buckets, `torch`'s
distrib_optim.pt and its torch optimizer state) and the same run's (or, for the Llama without the
distributed optimizer, the same training's) states saved by tensor name."""
ITERATION = 2


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[Path, dict]]:
    """(name, format) -> (the --save directory, megatron-core's logits at its last iteration), one launch per model."""
    root = tmp_path_factory.mktemp("megatron_lm")
    out = {}
    for name in dict.fromkeys(name for name, _ in CASES):  # both formats of one model from one launch
        paths = {fmt: root / f"{name}-{fmt}" for n, fmt in CASES if n == name}
        optimizer = TRAINED.get(name)
        reference = write_checkpoints(name, {f: str(p) for f, p in paths.items()}, ITERATION, optimizer=optimizer)
        out |= {(name, fmt): (path, reference) for fmt, path in paths.items()}
    for case, replicas, formats, bucket in (
        ("gpt-dp", 2, ("torch_dist", "torch"), BUCKET),
        ("gpt-dp2", 2, ("torch_dist",), None),
        ("llama-dp", 1, ("torch_dist",), None),
        ("llama-local", 1, ("torch",), None),
        ("llama-dz", 1, ("torch_dist",), None),
        ("gpt-fr-buckets", 1, ("torch_dist",), BUCKET),
    ):  # again, with the distributed optimizer
        paths = {fmt: root / f"{case}-{fmt}" for fmt in formats}
        reference = write_checkpoints(
            case.split("-")[0],
            {f: str(p) for f, p in paths.items()},
            ITERATION,
            TRAINED[case],
            data_parallel=replicas,
            bucket_size=bucket,
        )
        out |= {(case, fmt): (path, reference) for fmt, path in paths.items()}
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
    assert result.iteration == ITERATION and result.tag == f"global_step{ITERATION}"
    assert result.config.model.vocab_size == args["padded_vocab_size"]
    assert result.config.parallel.tensor_model_parallel_size == args["tensor_model_parallel_size"]
    meta = read_meta(str(tmp_path / "out"), f"global_step{ITERATION}")
    assert meta["train_state"]["consumed_train_samples"] == ITERATION * args["global_batch_size"]
    assert meta["train_state"]["floating_point_operations_so_far"] == ITERATION * 1.0e12
    assert meta[CONVERTED]["upstream"] == "megatron-lm" and meta[CONVERTED]["ckpt_format"] == fmt
    universal = Universal(str(tmp_path / "out" / f"global_step{ITERATION}.universal"))
    if name in TRAINED:
        assert universal.states == ["exp_avg", "exp_avg_sq"] and result.notes == []
    else:  # the P=2 GPT saved none
        assert universal.states == []
        expected = "it holds no optimizer state (saved with --no-save-optim or before the first step)"
        assert any(n.startswith(expected) for n in result.notes), result.notes


LR, WD, B1, B2, EPS = 3e-4, 0.1, 0.9, 0.999, 1e-8  # the recorded launch lines' Adam


def _scheduler_lr(steps: int) -> float:
    """megatron-core's own OptimizerParamScheduler of the recorded lines after `steps` steps of 8 samples."""
    import argparse

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    group = {"lr": LR, "weight_decay": WD}
    scheduler = OptimizerParamScheduler(
        argparse.Namespace(param_groups=[group]), 0.0, LR, 3e-5, 16, 160, "cosine", WD, WD, 160, "constant"
    )
    for _ in range(steps):
        scheduler.step(8)
    return scheduler.get_lr(group)


@pytest.mark.parametrize("case", ["gpt", "llama", "gpt-dp2"])
def test_adam_state_is_the_runs(sources, tmp_path: Path, case: str) -> None:
    """Upstream's second AdamW step, w2 = w1 (1 - lr wd) - lr/(1-b1^2) m / (sqrt(v)/sqrt(1-b2^2) + eps), holds
    for every tensor with the converted moments of step 2 and the fp32 weights of steps 1 and 2 (lr: the
    scheduler's after one step; no weight decay on biases and norms)."""
    source, reference = sources[case, "torch_dist"]
    first = import_megatron_lm(str(source / "iter_0000001"), str(tmp_path / "one"), show_progress=False)
    second = import_megatron_lm(str(source / "iter_0000002"), str(tmp_path / "two"), show_progress=False)
    assert first.states == second.states == ["exp_avg", "exp_avg_sq"] and second.notes == []
    u1 = Universal(str(tmp_path / "one" / "global_step1.universal"))
    u2 = Universal(str(tmp_path / "two" / "global_step2.universal"))
    lr = _scheduler_lr(1)
    for name, entry in u2.tensors.items():
        assert entry["step"] == 2
        m, v = u2.read(name, "exp_avg"), u2.read(name, "exp_avg_sq")
        decay = WD if len(entry["shape"]) >= 2 else 0.0
        predicted = u1.read(name, "fp32") * (1 - lr * decay) - (lr / (1 - B1**2)) * m / (
            v.sqrt() / math.sqrt(1 - B2**2) + EPS
        )
        torch.testing.assert_close(u2.read(name, "fp32"), predicted, rtol=0, atol=1e-7, msg=name)
    if case.startswith("llama"):  # bf16 weights: the fp32 masters are the optimizer's, not the weights widened
        masters = [u2.read(name, "fp32") for name in u2.tensors]
        assert any(not torch.equal(x, x.bfloat16().float()) for x in masters)
    model = load_model(str(tmp_path / "two"))
    with torch.no_grad():
        logits = model.float()(reference["tokens"])
    torch.testing.assert_close(logits, reference["logits"][..., : logits.shape[-1]], rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", sorted(SAME_RUN), ids="-".join)
def test_optimizer_state_converts_to_the_same_state_as_saved_by_tensor_name(sources, tmp_path, case) -> None:
    """One run saved both ways converts to bitwise the same masters and moments: the buffers' parameters
    (two data-parallel replicas' shards of the GPT in four buckets; the T=2 Llama's SwiGLU gate and up
    chunks, bf16 weights and fp32 norms in two buffers per tensor rank) are placed where megatron-core put
    them, in torch_dist's buckets and in `torch`'s distrib_optim.pt, and torch's numbered parameters (fp32
    GPT; bf16 Llama with fp32 masters of its 16-bit tensors only) are the tensors megatron-core grouped."""
    converted = []
    for name, fmt in (case, SAME_RUN[case]):
        out = tmp_path / f"{name}-{fmt}"
        result = import_megatron_lm(str(sources[name, fmt][0]), str(out), show_progress=False)
        assert result.states == ["exp_avg", "exp_avg_sq"] and result.notes == []
        converted.append(Universal(str(out / f"global_step{ITERATION}.universal")))
    buckets, named = converted
    assert set(buckets.tensors) == set(named.tensors)
    for name, entry in buckets.tensors.items():
        assert entry["step"] == named.tensors[name]["step"] == ITERATION
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            ours = buckets.read(name, state)
            assert torch.equal(ours, named.read(name, state)), (name, state)
            assert ours.abs().sum() > 0, (name, state)  # a trained state, not zeros


def test_buckets_that_do_not_place_leave_the_state_out_saying_why(sources, tmp_path: Path) -> None:
    """After one step the tiny GPT's zero-initialised biases all moved by -lr sign(g) with the same signs: their
    fp32 masters are equal, so the values cannot tell which bias sits where in a bucket. The moments are left
    out, naming the tensors, and the weights still convert."""
    source = sources["gpt-dp", "torch_dist"][0] / "iter_0000001"
    result = import_megatron_lm(str(source), str(tmp_path / "out"), show_progress=False)
    assert result.states == [] and len(result.notes) == 1, result.notes
    note = result.notes[0]
    assert note.startswith(
        "its optimizer state is in the distributed optimizer's dp_reshardable buffers, which do not match its "
        "weights (optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0: "
    ), note
    assert "model tensors' (decoder.final_layernorm.bias, " in note
    assert note.endswith(
        "weights equal its fp32 master weights at element 0); to keep it, load the checkpoint in Megatron-LM and save "
        "it with --dist-ckpt-optim-fully-reshardable: a resume from it starts Adam's moments at zero, with the model's "
        "weights as the fp32 master weights"
    ), note
    universal = Universal(str(tmp_path / "out" / "global_step1.universal"))
    stored = DistTensors(str(source)).read("embedding.word_embeddings.weight")
    assert universal.states == []
    torch.testing.assert_close(universal.read("01.WordEmbedding.weight", "fp32"), stored, rtol=0, atol=0)


def test_tool_prints_the_flags_and_a_resume_continues_the_run(sources, tmp_path: Path) -> None:
    """The T=2 bf16 checkpoint with its Adam state resumes on one process (T=1, vocabulary padded to the same
    256 rows) at iteration 3, with the learning rates megatron-core's scheduler gives after 3 and 4 steps and
    Adam's step going on from the run's 2."""
    source, _ = sources["llama", "torch_dist"]
    out, saved = tmp_path / "converted", tmp_path / "saved"
    tool = [str(ROOT / "tools" / "convert_checkpoint.py"), "--from", "megatron-lm"]
    run = run_python([*tool, str(source), str(out), "--no-progress"], timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "weights, optimizer state (exp_avg, exp_avg_sq), counters and learning-rate schedule" in run.stdout
    flags = run.stdout.strip().splitlines()[-1].split()
    assert flags[:3] == ["pretrain_gpt.py", "--load", str(out)]
    assert {"--swiglu", "--group-query-attention", "--untie-embeddings-and-output-weights", "--bf16"} <= set(flags)
    extra = "--mock-data --num-workers 0 --log-interval 1 --eval-iters 0 --train-iters 4 --lr-decay-iters 20"
    assert flags[flags.index("--make-vocab-size-divisible-by") + 1] == "256"  # 128 x T=2: the padded size at T=1
    extra += f" --save {saved} --save-interval 100"
    cmd = [str(ROOT / "pretrain_gpt.py"), *flags[1:], *extra.split()]
    run = run_python(cmd, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "was saved with Megatron-LM (converted" in run.stdout
    assert "resumed from" in run.stdout and "at iteration 2 (16 samples consumed)" in run.stdout  # ITERATION
    assert "iteration        3/       4 | consumed samples:           24" in run.stdout
    assert f"learning rate: {_scheduler_lr(3):.6E}" in run.stdout
    assert f"learning rate: {_scheduler_lr(4):.6E}" in run.stdout
    convert_checkpoint(str(saved), str(tmp_path / "universal"), show_progress=False)
    assert Universal(str(tmp_path / "universal" / "global_step4")).group_step("decay") == 4


def test_load_of_a_megatron_lm_checkpoint_says_how_to_convert_it(sources) -> None:
    source, _ = sources["gpt", "torch"]
    cmd = [
        str(ROOT / "pretrain_gpt.py"),
        *recorded("gpt")["argv"],
        "--mock-data",
        "--load",
        str(source),
    ]
    run = run_python(cmd, timeout=300, cwd=ROOT)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert line == (
        f"error: --load {source}: a Megatron-LM checkpoint (iter_0000002: --ckpt-format torch); convert it first: "
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

    (source / "iter_0000002" / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(
        CheckpointError, match=r"\.metadata: holds a pickled posix\.system, which such a file does not hold; refused"
    ):
        import_megatron_lm(str(source), str(tmp_path / "out"), show_progress=False)
    assert not (tmp_path / "ran").exists() and not (tmp_path / "out").exists()


def test_a_missing_chunk_file_is_named(sources, tmp_path: Path) -> None:
    source = _copy(sources["llama", "torch_dist"][0], tmp_path)
    (source / "iter_0000002" / "__1_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp: unreadable"):
        import_megatron_lm(str(source), str(tmp_path / "out"), show_progress=False)
    assert not (tmp_path / "out").exists()


def test_a_tensor_the_model_does_not_have_is_refused(sources, tmp_path: Path) -> None:
    """A stored weight the saved args do not account for (here a QK layer norm) is not silently dropped."""
    source = _copy(sources["gpt", "torch"][0], tmp_path)
    path = source / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
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


def test_optimizer_state_in_another_layout_is_left_out_saying_why(sources, tmp_path: Path) -> None:
    """torch_dist moments not in their weight's shape (megatron-core's flattened fully_sharded_model_space, which
    0.16 can no longer write: emulated by editing the metadata) and a `torch` rank file whose param groups do not
    number the model's tensors: the weights convert, the state does not, and the note says why."""
    flat = _copy(sources["gpt", "torch_dist"][0], tmp_path / "flat")
    metadata = flat / "iter_0000002" / ".metadata"
    saved = pickle.loads(metadata.read_bytes())  # the test's own file
    saved.state_dict_metadata["optimizer.state.exp_avg.embedding.word_embeddings.weight"].size = torch.Size([4096])
    metadata.write_bytes(pickle.dumps(saved))
    numbered = _copy(sources["gpt", "torch"][0], tmp_path / "numbered")
    path = numbered / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["optimizer"]["param_groups"][0]["params"].pop()
    torch.save(state, path)
    expected = {
        flat: "its optimizer state (by tensor) is stored as optimizer.state.exp_avg.embedding.word_embeddings.weight "
        "of shape [4096], not its weight's [128, 32], a layout that does not convert; to keep it, load the checkpoint "
        "in Megatron-LM and save it with --dist-ckpt-optim-fully-reshardable",
        numbered: f"its optimizer state (model_optim_rng.pt) does not match its weights ({path}: param group 0 has 9 "
        f"parameters, the model 10)",
    }
    for source, reason in expected.items():
        out = tmp_path / f"{source.parent.name}-out"
        result = import_megatron_lm(str(source), str(out), show_progress=False)
        assert result.states == [] and result.notes == [f"{reason}: {RESTART}"], result.notes
        model = load_model(str(out))
        with torch.no_grad():
            logits = model.float()(sources["gpt", "torch"][1]["tokens"])
        reference = sources["gpt", "torch"][1]["logits"]
        torch.testing.assert_close(logits, reference[..., : logits.shape[-1]], rtol=0, atol=1e-6)


def test_fully_reshardable_state_under_shifted_names_is_left_out(sources, tmp_path: Path) -> None:
    """megatron-core 0.16 saves a bucketed run's --dist-ckpt-optim-fully-reshardable state sliced at bucket-padded
    positions of buffers saved without that padding: each tensor's name holds a neighbour's state. The fp32
    masters then do not round to the weights; the state is left out, saying so, and the weights convert."""
    source, reference = sources["gpt-fr-buckets", "torch_dist"]
    result = import_megatron_lm(str(source), str(tmp_path / "out"), show_progress=False)
    assert result.states == [] and len(result.notes) == 1
    assert result.notes[0].startswith(
        "its optimizer state is saved under the wrong tensor names (embedding.word_embeddings.weight's fp32 master "
        "does not round to its weight: megatron-core 0.16's --dist-ckpt-optim-fully-reshardable"
    ), result.notes
    model = load_model(str(tmp_path / "out"))
    with torch.no_grad():
        logits = model.float()(reference["tokens"])
    torch.testing.assert_close(logits, reference["logits"][..., : logits.shape[-1]], rtol=0, atol=1e-6)


def test_a_missing_distrib_optim_file_is_named(sources, tmp_path: Path) -> None:
    """A distributed-optimizer run's `torch` checkpoint without rank 0's distrib_optim.pt is incomplete (its
    saved args say --use-distributed-optimizer), as without any other rank's."""
    source = _copy(sources["llama", "torch"][0], tmp_path)
    (source / "iter_0000002" / "mp_rank_00" / "distrib_optim.pt").unlink()
    with pytest.raises(CheckpointError, match=r"mp_rank_00/distrib_optim\.pt: missing; the checkpoint is incomplete"):
        import_megatron_lm(str(source), str(tmp_path / "out"), show_progress=False)
    assert not (tmp_path / "out").exists()


def test_an_existing_output_is_never_overwritten(sources, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(UserError, match="already exists; choose a new directory"):
        import_megatron_lm(str(sources["gpt", "torch_dist"][0]), str(out), show_progress=False)
    assert (out / "keep").read_text() == "x" and not (out / META).exists()


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_megatron_lm_to_hugging_face(sources, tmp_path: Path, name: str) -> None:
    """Megatron-LM -> ours -> a Hugging Face directory: transformers computes megatron-core's logits (GPT-2
    for the GPT, Llama for the Llama-style run; the vocabulary trimmed to the tokenizer's 101 ids)."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from megatron_ds.interop.hf_export import export_hf

    source, reference = sources[name, "torch_dist"]
    import_megatron_lm(str(source), str(tmp_path / "ours"), show_progress=False)
    result = export_hf(str(tmp_path / "ours"), str(tmp_path / "hf"), dtype="float32", show_progress=False)
    assert result.arch == ("gpt2" if name == "gpt" else "llama")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        logits = hf(reference["tokens"]).logits
    assert logits.shape[-1] == 101
    torch.testing.assert_close(logits, reference["logits"][..., :101], rtol=0, atol=1e-6)


def test_transformer_engine_names_in_torch_format(sources, tmp_path: Path) -> None:
    """A `--ckpt-format torch` state dict of Transformer Engine layers names the input and pre-MLP norms after
    the fused linears (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_bias`); the same weights under
    those names convert to the same model."""
    source, reference = sources["gpt", "torch"]
    copy = _copy(source, tmp_path)
    path = copy / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)  # the test's own file
    renames = {
        "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
    }
    model = {}
    for key, value in state["model"].items():
        for old, new in renames.items():
            key = key.replace(old, new)
        model[key] = value
    assert sum("layer_norm_" in k for k in model) == 8  # 2 layers x 2 norms x (weight, bias)
    torch.save({**state, "model": model}, path)
    import_megatron_lm(str(copy), str(tmp_path / "out"), show_progress=False)
    with torch.no_grad():
        logits = load_model(str(tmp_path / "out")).float()(reference["tokens"])
    torch.testing.assert_close(logits, reference["logits"][..., : logits.shape[-1]], rtol=0, atol=1e-6)


def test_metadata_of_megatron_core_up_to_0_15(sources, tmp_path: Path) -> None:
    """megatron-core up to 0.15 pickles its own `MCoreMetadata` (a Metadata subclass) as `.metadata`: read as an
    inert record holding the same fields, never imported, and the checkpoint converts the same."""
    import dataclasses

    from torch.distributed.checkpoint.metadata import Metadata

    from megatron_ds.interop import restricted_pickle

    source, reference = sources["gpt", "torch_dist"]
    copy = _copy(source, tmp_path)
    path = copy / "iter_0000002" / ".metadata"
    with open(path, "rb") as f:
        metadata = restricted_pickle.load(f, restricted_pickle.dcp_metadata)

    @dataclasses.dataclass
    class MCoreMetadata(Metadata):
        mcore_data: dict | None = None

    MCoreMetadata.__module__ = "megatron.core.dist_checkpointing.strategies.torch"
    MCoreMetadata.__qualname__ = "MCoreMetadata"
    old = MCoreMetadata(**{f.name: getattr(metadata, f.name) for f in dataclasses.fields(Metadata)}, mcore_data={})
    import megatron.core.dist_checkpointing.strategies.torch as mcore_torch

    saved = mcore_torch.MCoreMetadata
    mcore_torch.MCoreMetadata = MCoreMetadata  # pickle finds the class by its module and name
    try:
        path.write_bytes(pickle.dumps(old))
    finally:
        mcore_torch.MCoreMetadata = saved
    assert b"MCoreMetadata" in path.read_bytes()
    import_megatron_lm(str(copy), str(tmp_path / "out"), show_progress=False)
    with torch.no_grad():
        logits = load_model(str(tmp_path / "out")).float()(reference["tokens"])
    torch.testing.assert_close(logits, reference["logits"][..., : logits.shape[-1]], rtol=0, atol=1e-6)


def test_a_qkv_bias_alone_and_the_qk_l2_norm_convert(tmp_path: Path) -> None:
    """The T=2 Llama with --add-qkv-bias (Qwen2's layout), trained two steps so the bias is not its zero init:
    megatron-core's `linear_qkv.bias`, split over the tensor ranks with the QKV rows, converts to the same logits. The
    same launch has --qk-l2-norm (megatron-core's weightless L2Norm on every layer's query and key heads, eps
    --norm-epsilon 1e-6): the flags carry it, and the same weights without it give other logits."""
    source = tmp_path / "mlm"
    reference = write_checkpoints(
        "llama_qkv_bias_qk_l2_norm", {"torch_dist": str(source)}, ITERATION, "fully_reshardable"
    )
    result = import_megatron_lm(str(source), str(tmp_path / "out"), show_progress=False)
    assert result.config.model.add_qkv_bias and not result.config.model.add_bias_linear
    assert result.config.model.qk_l2_norm and "--qk-l2-norm" in result.train_flags
    model = load_model(str(tmp_path / "out"))
    biases = {n for n, p in model.named_parameters() if n.endswith(".bias")}
    assert biases and all(n.endswith("qkv.bias") for n in biases)
    assert all(p.abs().max() > 0 for n, p in model.named_parameters() if n in biases)
    with torch.no_grad():
        logits = model.float()(reference["tokens"])
    torch.testing.assert_close(logits, reference["logits"][..., : logits.shape[-1]], rtol=0, atol=1e-6)
    plain = GPTModel(dataclasses.replace(model.config, qk_l2_norm=False))
    plain.load_state_dict(model.state_dict())  # the norm has no weights: the same tensors
    with torch.no_grad():
        assert (plain.float()(reference["tokens"]) - logits).abs().max() > 1e-3


def test_a_head_size_other_than_hidden_over_heads_and_a_sliding_window_convert(tmp_path: Path) -> None:
    """The T=2 Llama with --kv-channels 12 (hidden 32 / 4 heads is 8) and --qk-layernorm (megatron-core's
    q_layernorm/k_layernorm, Qwen3's norms), trained two steps (the norms' gradients summed over the tensor ranks, as
    Megatron-LM's step does, so they are not their init of ones): QKV of (4 + 2 x 2) x 12 rows, the output
    projection 48 -> 32 and `self_attention.q_layernorm.weight` / `k_layernorm.weight` over 12 convert to the same
    logits, and the flags carry --kv-channels and --qk-layernorm. The same launch has --window-size 3,0
    --window-attn-skip-freq 3 (layers 1 and 2 see 4 keys of the 12 tokens, attended by megatron-core's own
    sliding-window mask; layer 3 all): the flags carry the window, and the same weights without it differ."""
    source = tmp_path / "mlm"
    reference = write_checkpoints(
        "llama_kv_channels_window", {"torch_dist": str(source)}, ITERATION, "fully_reshardable"
    )
    result = import_megatron_lm(str(source), str(tmp_path / "out"), show_progress=False)
    model_config = result.config.model
    assert (model_config.head_dim, model_config.query_size, model_config.hidden_size) == (12, 48, 32)
    assert "--kv-channels" in result.train_flags
    assert model_config.qk_layernorm and "--qk-layernorm" in result.train_flags
    model = load_model(str(tmp_path / "out"))
    head_norms = {n: p for n, p in model.named_parameters() if "q_norm" in n or "k_norm" in n}
    assert len(head_norms) == 2 * model_config.num_layers
    assert all(p.shape == (12,) and (p - 1).abs().max() > 0 for p in head_norms.values())
    shapes = {n.rsplit(".", 2)[-2]: p.shape for n, p in model.named_parameters() if n.endswith("weight")}
    assert shapes["qkv"] == (96, 32) and shapes["proj"] == (32, 48) and shapes["q_norm"] == (12,)
    with torch.no_grad():
        logits = model.float()(reference["tokens"])
    torch.testing.assert_close(logits, reference["logits"][..., : logits.shape[-1]], rtol=0, atol=1e-6)
    assert model_config.layer_windows == (3, 3, None)
    assert "--window-size 3,0 --window-attn-skip-freq 3" in " ".join(result.train_flags), result.train_flags
    full = GPTModel(dataclasses.replace(model.config, window_size=None))
    full.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (full(reference["tokens"]) - logits).abs().max() > 1e-4
