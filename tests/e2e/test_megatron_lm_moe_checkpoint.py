"""A Megatron-LM mixture-of-experts checkpoint written by megatron-core itself (`testing.megatron_lm_checkpoints`'s
"mixtral" line: 4 SwiGLU experts on both layers, top-2, expert-parallel size 2 on two ranks; SequentialMLP with the
allgather dispatcher), converted with `tools/convert_checkpoint.py --from megatron-lm`: the converted model routes
with Megatron-LM's router and computes megatron-core's logits from both checkpoint formats, and training goes on
from it at its iteration."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch

from megatron_ds.inference.model import load_model
from megatron_ds.interop.megatron_lm import import_megatron_lm
from megatron_ds.model.moe import EXPERT_PREFIX, GATE_WEIGHT
from megatron_ds.testing.megatron_lm_checkpoints import recorded, write_checkpoints
from megatron_ds.testing.script_runs import run_python
from megatron_ds.training.checkpoint.directory import CheckpointError
from megatron_ds.training.checkpoint.universal.convert import SUFFIX
from megatron_ds.training.checkpoint.universal.store import Universal

ROOT = Path(__file__).resolve().parents[2]
NAME, ITERATION = "mixtral", 3
FORMATS = ("torch_dist", "torch")
SHARED = "mixtral_shared"
"""The line with Qwen2-MoE's routing: a gated shared expert (--moe-shared-expert-intermediate-size 40
--moe-shared-expert-gate) and --moe-router-pre-softmax; trained two steps without the distributed optimizer."""
TP2 = "mixtral_tp2"
"""The line at --tensor-model-parallel-size 2 (experts split over the tensor ranks too, Megatron-LM's default
--expert-tensor-parallel-size), --sequence-parallel, --bf16 with --moe-router-dtype fp32, on 4 ranks."""


TRAINED = ("local", "local_pre_mcore_014", "fully_reshardable", "dp_reshardable")
"""Two steps of megatron-core's ChainedOptimizer (Adam for the dense parameters, Adam for the experts) on fixed
tokens, torch_dist saved after each: without the distributed optimizer (also `torch` at the end; again saved with
--dist-ckpt-save-pre-mcore-014, its states under `chained_<i>.optimizer.state...`), with it saved
--dist-ckpt-optim-fully-reshardable, and in its default dp_reshardable buffers (also `torch`, with
distrib_optim.pt)."""


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], dict]:
    """format -> the --save directory of the untrained line at ITERATION, and megatron-core's logits; (optimizer,
    format) -> a trained run's --save directory, with its logits after two steps (one launch each)."""
    root = tmp_path_factory.mktemp("megatron_lm_moe")
    paths: dict = {fmt: root / fmt for fmt in FORMATS}
    reference = write_checkpoints(NAME, {f: str(p) for f, p in paths.items()}, ITERATION)
    for optimizer in TRAINED:
        formats = FORMATS if optimizer in ("local", "dp_reshardable") else ("torch_dist",)
        trained = {fmt: root / f"{optimizer}-{fmt}" for fmt in formats}
        logits = write_checkpoints(NAME, {f: str(p) for f, p in trained.items()}, 2, optimizer=optimizer)
        paths |= {(optimizer, fmt): (path, logits) for fmt, path in trained.items()}
    shared = {fmt: root / f"{SHARED}-{fmt}" for fmt in FORMATS}
    logits = write_checkpoints(SHARED, {f: str(p) for f, p in shared.items()}, 2, optimizer="local")
    paths |= {(SHARED, fmt): (path, logits) for fmt, path in shared.items()}
    wide = {fmt: root / f"{TP2}-{fmt}" for fmt in FORMATS}
    logits = write_checkpoints(TP2, {f: str(p) for f, p in wide.items()}, ITERATION)
    paths |= {(TP2, fmt): (path, logits) for fmt, path in wide.items()}
    return paths, reference


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode() + f.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize(("name", "fmt"), [(NAME, "torch_dist"), (NAME, "torch"), (TP2, "torch_dist")])
def test_converted_experts_compute_megatron_cores_logits(sources, tmp_path: Path, name: str, fmt: str) -> None:
    """Also at T = 2 in bf16: converted at T = 1 (the universal form holds whole tensors) with the run's padding."""
    paths, reference = sources
    source = paths[fmt] if name == NAME else paths[name, fmt][0]
    reference = reference if name == NAME else paths[name, fmt][1]
    before = _digest(source)
    result = import_megatron_lm(str(source), str(tmp_path / "out"), show_progress=False)
    assert _digest(source) == before  # only read
    assert result.config.parallel.tensor_model_parallel_size == 1
    assert result.config.model.vocab_size == recorded(name)["args"]["padded_vocab_size"]  # 128 x T
    m = result.config.model
    assert m.moe_router == "megatron" and m.experts_per_layer == (4, 4)
    assert (m.moe_top_k, m.moe_loss_coeff) == (2, 0.01)
    assert result.states == [] and any("holds no optimizer state" in n for n in result.notes)
    universal = Universal(str(tmp_path / "out" / f"global_step{ITERATION}{SUFFIX}"))
    experts = [n for n in universal.tensors if EXPERT_PREFIX in n]
    assert len(experts) == 2 * 4 * 2 and sum(GATE_WEIGHT in n for n in universal.tensors) == 2  # fc1, fc2 per expert
    model = load_model(str(tmp_path / "out"))
    with torch.no_grad():
        logits = model.float()(reference["tokens"])
    assert logits.shape[-1] == recorded(NAME)["args"]["vocab_size"] + 1  # the NullTokenizer's ids
    torch.testing.assert_close(logits, reference["logits"][..., : logits.shape[-1]], rtol=0, atol=1e-6)


def test_experts_split_over_tensor_ranks_in_torch_files_are_one_line(sources, tmp_path: Path) -> None:
    paths, _ = sources
    source = paths[TP2, "torch"][0]
    with pytest.raises(CheckpointError) as err:
        import_megatron_lm(str(source), str(tmp_path / "out"), show_progress=False)
    assert str(err.value) == (
        f"{source}/iter_0000003: a mixture-of-experts run at --tensor-model-parallel-size 2 in --ckpt-format torch: "
        "its experts' tensor-parallel shards are read here only from torch_dist; load it in Megatron-LM and save it "
        "with --ckpt-format torch_dist"
    )
    assert not (tmp_path / "out").exists()


def test_the_tools_flags_train_on_from_its_iteration(sources, tmp_path: Path) -> None:
    """The printed flags choose Megatron-LM's router (`--moe-router-topk`) and its loss coefficient; a run from them
    resumes at the checkpoint's iteration with its weights (one process: the experts at expert-parallel size 1)."""
    paths, _ = sources
    out = tmp_path / "converted"
    tool = [str(ROOT / "tools" / "convert_checkpoint.py"), "--from", "megatron-lm"]
    run = run_python([*tool, str(paths["torch_dist"]), str(out), "--no-progress"], timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    flags = run.stdout.strip().splitlines()[-1].split()
    assert flags[:3] == ["pretrain_gpt.py", "--load", str(out)]
    text = " ".join(flags)
    assert "--num-experts 4 " in text and "--moe-router-topk 2 --moe-aux-loss-coeff 0.01 " in text
    assert "--expert-model-parallel-size" not in text  # free on resume, as the pipeline split
    extra = (
        f"--mock-data --num-workers 0 --log-interval 1 --eval-iters 0 --train-iters {ITERATION + 1} --lr-decay-iters 20"
    )
    run = run_python([str(ROOT / "pretrain_gpt.py"), *flags[1:], *extra.split()], timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"at iteration {ITERATION}" in run.stdout
    assert f"iteration        {ITERATION + 1}/       {ITERATION + 1}" in run.stdout


def test_megatron_lm_experts_to_hugging_face_mixtral(sources, tmp_path: Path) -> None:
    """Megatron-LM -> ours -> Hugging Face: the converted model exports as Mixtral (router `gate`, experts' w1/w3/w2)
    and transformers computes megatron-core's logits."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from megatron_ds.interop.hf_export import export_hf

    paths, reference = sources
    import_megatron_lm(str(paths["torch"]), str(tmp_path / "ours"), show_progress=False)
    result = export_hf(str(tmp_path / "ours"), str(tmp_path / "hf"), dtype="float32", show_progress=False)
    assert result.arch == "mixtral"
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        logits = hf(reference["tokens"]).logits
    vocab = recorded(NAME)["args"]["vocab_size"] + 1
    assert logits.shape[-1] == vocab
    torch.testing.assert_close(logits, reference["logits"][..., :vocab], rtol=0, atol=1e-6)


LR, WD, B1, B2, EPS = 3e-4, 0.1, 0.9, 0.999, 1e-8  # the recorded launch line's Adam
LR_AFTER_ONE_STEP = 0.00015
"""megatron-core's OptimizerParamScheduler of the line after one step of 8 samples (warm-up of 16: half of --lr)."""


@pytest.mark.parametrize("optimizer", ["local", "local_pre_mcore_014", "fully_reshardable"])
def test_the_experts_adam_state_is_the_runs(sources, tmp_path: Path, optimizer: str) -> None:
    """Named by tensor in torch_dist (each expert's moments stacked as its weight), the state of megatron-core's
    dense and expert optimizers converts: upstream's second AdamW step, w2 = w1 (1 - lr wd) - lr/(1-b1^2) m /
    (sqrt(v)/sqrt(1-b2^2) + eps), holds for every tensor, each expert's and the router's included."""
    paths, _ = sources
    source, reference = paths[optimizer, "torch_dist"]
    first = import_megatron_lm(str(source / "iter_0000001"), str(tmp_path / "one"), show_progress=False)
    second = import_megatron_lm(str(source / "iter_0000002"), str(tmp_path / "two"), show_progress=False)
    assert first.states == second.states == ["exp_avg", "exp_avg_sq"] and second.notes == []
    u1 = Universal(str(tmp_path / "one" / f"global_step1{SUFFIX}"))
    u2 = Universal(str(tmp_path / "two" / f"global_step2{SUFFIX}"))
    assert sum(EXPERT_PREFIX in name for name in u2.tensors) == 2 * 4 * 2
    for name, entry in u2.tensors.items():
        assert entry["step"] == 2
        m, v = u2.read(name, "exp_avg"), u2.read(name, "exp_avg_sq")
        assert m.abs().sum() > 0, name  # every expert was routed to: a trained state
        decay = WD if len(entry["shape"]) >= 2 else 0.0
        predicted = u1.read(name, "fp32") * (1 - LR_AFTER_ONE_STEP * decay) - (LR_AFTER_ONE_STEP / (1 - B1**2)) * m / (
            v.sqrt() / math.sqrt(1 - B2**2) + EPS
        )
        torch.testing.assert_close(u2.read(name, "fp32"), predicted, rtol=0, atol=1e-7, msg=name)
    with torch.no_grad():
        logits = load_model(str(tmp_path / "two")).float()(reference["tokens"])
    torch.testing.assert_close(logits, reference["logits"][..., : logits.shape[-1]], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("case", "where"),
    [(("dp_reshardable", "torch_dist"), "dp_reshardable buffers"), (("local", "torch"), "--ckpt-format torch files")],
)
def test_chained_optimizers_in_buffers_or_torch_files_are_left_out_saying_why(sources, tmp_path, case, where) -> None:
    paths, _ = sources
    source, reference = paths[case]
    result = import_megatron_lm(str(source), str(tmp_path / "out"), show_progress=False)
    assert result.states == [] and result.notes == [
        f"its optimizer state is megatron-core's ChainedOptimizer's (several optimizers, e.g. a mixture of experts' "
        f"dense and expert parameters apart) in {where}, which are not read here; to keep it, load the checkpoint in "
        f"Megatron-LM and save it as torch_dist (with --dist-ckpt-optim-fully-reshardable if it uses the distributed "
        f"optimizer): a resume from it starts Adam's moments at zero, with the model's weights as the fp32 master "
        f"weights"
    ]
    with torch.no_grad():
        logits = load_model(str(tmp_path / "out")).float()(reference["tokens"])
    torch.testing.assert_close(logits, reference["logits"][..., : logits.shape[-1]], rtol=0, atol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_shared_expert_and_pre_softmax_routing_convert(sources, tmp_path: Path, fmt: str) -> None:
    """megatron-core's SharedExpertMLP (`mlp.shared_experts.linear_fc1/linear_fc2.weight`, `gate_weight`) and its
    pre-softmax router convert to ours: the same logits after two trained steps (the shared expert and its gate no
    longer as drawn), and from torch_dist Adam's state with them."""
    paths, _ = sources
    source, reference = paths[SHARED, fmt]
    result = import_megatron_lm(str(source), str(tmp_path / "out"), show_progress=False)
    m = result.config.model
    assert (m.moe_shared_expert_size, m.moe_shared_expert_gate, m.moe_router_pre_softmax) == (40, True, True)
    assert result.states == (["exp_avg", "exp_avg_sq"] if fmt == "torch_dist" else [])
    with torch.no_grad():
        logits = load_model(str(tmp_path / "out")).float()(reference["tokens"])
    torch.testing.assert_close(logits, reference["logits"][..., : logits.shape[-1]], rtol=0, atol=1e-6)
