"""The tensor-parallel and mixture-of-experts teachers of --kd are built on the meta device (no initial weight drawn)
and equal what building them on the CPU with their initial weights, then copying the checkpoint over, made (what
`load_teacher` did before) in every parameter's value, dtype and attributes, the RNG tracker's streams and the logits;
torch's default generator, which the CPU build advanced (its `nn.Linear` and gate initialisers, by the experts a rank
holds) and the student's MoE routing reads on, stays where it was.

Launch (two ranks): four tiny teachers save their initial weights (seed 99, not the student's 1234, so a weight the
checkpoint did not fill would show): a GPT, a Llama-like GPT (untied head, SwiGLU, rotary, RMSNorm, no biases), a
mixture-of-experts GPT with PR-MoE's residual MLP at --moe-expert-parallel-size 2, and one with top-2 routing. Then on
two forked gloo ranks each teacher is loaded at T = 2 (the GPTs) or E = 2 (the MoE ones), in fp32 and bf16, both ways.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megatron_ds.testing.launch import forked_gloo_ranks
from megatron_ds.testing.scenario import tiny_config
from megatron_ds.testing.scenario_runs import run_scenarios

LLAMA = {
    "model__normalization": "rmsnorm",
    "model__untie_embeddings_and_output_weights": True,
    "model__activation": "swiglu",
    "model__use_rotary_position_embeddings": True,
    "model__add_position_embedding": False,
    "model__add_bias_linear": False,
}
MOE = {"model__num_experts": (4,), "model__moe_token_dropping": False, "parallel__expert_parallel_size": 2}
TEACHERS = {
    "gpt": {},
    "llama": LLAMA,
    "residual_moe": {**MOE, "model__mlp_type": "residual"},
    "top2_moe": {**MOE, "model__moe_top_k": 2},
}
CASES = [
    ("gpt", "fp32"),
    ("gpt", "bf16"),
    ("llama", "fp32"),
    ("residual_moe", "fp32"),
    ("residual_moe", "bf16"),
    ("top2_moe", "fp32"),
]


@pytest.fixture(scope="module")
def teachers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("teacher_build")
    scenarios = [
        {"overrides": {**o, "training__seed": 99, "parallel__world_size": 2}, "steps": 0, "save": str(root / name)}
        for name, o in TEACHERS.items()
    ]
    run_scenarios(root / "save", 2, scenarios, timeout=120)
    return root


def _hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _random_state() -> dict[str, Any]:
    from deepspeed.accelerator import get_accelerator

    from megatron_ds.model import rng

    states = rng.tracker().get_states()
    return {
        "default": _hash(torch.get_rng_state()),
        "accelerator": _hash(get_accelerator().get_rng_state()),
        "tracker": {k: _hash(v) for k, v in states.items()},
    }


def _todays_teacher(config: Any, student: Any, dtype: torch.dtype) -> torch.nn.Module:
    """What `load_teacher` built before: the training GPTModel on the CPU, its own initial weights drawn, the
    checkpoint's copied over, then cast."""
    import dataclasses

    from megatron_ds.model import naming
    from megatron_ds.model.gpt_model import GPTModel
    from megatron_ds.pipeline.layout import build_layout
    from megatron_ds.training import distillation

    ckpt = distillation.open_teacher(config)
    model_config = distillation.teacher_model(config, ckpt)
    if model_config.is_moe:
        model_config = dataclasses.replace(
            model_config, moe_eval_capacity_factor=model_config.moe_train_capacity_factor
        )
    layout = build_layout(naming.gpt_spec_groups(model_config), 1)
    teacher_config = distillation.teacher_training_config(config, model_config)
    model = GPTModel(teacher_config, layout, tp=student.tensor_parallel, grid=student.mpu())
    model.activation_checkpoint_interval = 0
    if model_config.is_moe:
        for module in model.modules():
            if hasattr(module, "set_deepspeed_parallelism"):
                module.set_deepspeed_parallelism(False)
        distillation.copy_experts(model, ckpt)
    else:
        distillation.copy_shards(model, ckpt, model_config)
    return model.to(dtype=dtype).requires_grad_(False).eval()


def _both_ways(rank: int, root: str) -> list[dict[str, Any]]:
    import deepspeed
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    from megatron_ds.model import rng, tensor_parallel
    from megatron_ds.model.gpt_pipe import build_topology
    from megatron_ds.model.tensor_parallel import NO_TENSOR_PARALLEL
    from megatron_ds.distributed import skip_cpu_shared_memory_allreduce
    from megatron_ds.training import distillation

    skip_cpu_shared_memory_allreduce()  # an inference-only op: nothing here builds it
    deepspeed.init_distributed(dist_backend="gloo")
    out = []
    for name, precision in CASES:
        moe = name.endswith("moe")
        config = tiny_config(
            model__num_layers=2,
            parallel__world_size=2,
            **{"parallel__expert_parallel_size" if moe else "parallel__tensor_model_parallel_size": 2},
            **{k: v for k, v in TEACHERS[name].items() if k in LLAMA},  # a student of the teacher's kind, dense
            training__precision=precision,
            distillation__kd=True,
            distillation__load_teacher=str(Path(root) / name),
        )
        topology = build_topology(config)
        tp = NO_TENSOR_PARALLEL if moe else tensor_parallel.setup(config, topology)
        grid = PipelineParallelGrid(topology=topology)
        student = SimpleNamespace(tensor_parallel=tp, mpu=lambda grid=grid: grid)
        torch.manual_seed(5 + rank)
        rng.set_stream(rng.Stream.replicated(7).name, 11)  # a dropout stream in use: every model build forgets it
        before = _random_state()
        saved = (torch.get_rng_state(), rng.tracker().get_states())
        teacher = distillation.load_teacher(config, "cpu", student)
        after = _random_state()
        torch.set_rng_state(saved[0])
        rng.tracker().set_states(saved[1])
        dtype = {"bf16": torch.bfloat16}.get(precision, torch.float32)
        today = _todays_teacher(config, student, dtype)
        todays = _random_state()
        ours, theirs = dict(teacher.model.named_parameters()), dict(today.named_parameters())
        tokens = torch.randint(0, config.model.vocab_size, (2, config.model.seq_length), generator=torch.Generator())
        logits = []
        for model in (teacher.model, today):
            torch.manual_seed(3)  # top-2's sampled second expert draws from it
            with torch.no_grad():
                logits.append(model(tokens))
        out.append(
            {
                "case": f"{name} {precision}",
                "generators_kept": (after["default"], after["accelerator"]) == (before["default"], before["accelerator"]),
                "moe_build_moved_it": todays["default"] != before["default"],
                "tracker_as_today": after["tracker"] == todays["tracker"],
                "stream_forgotten": rng.Stream.replicated(7).name not in after["tracker"],
                "names": list(ours) == list(theirs),
                "differ": sorted(
                    n for n, p in ours.items() if p.dtype != theirs[n].dtype or not torch.equal(p, theirs[n])
                ),
                "attributes": sorted(n for n, p in ours.items() if vars(p) != vars(theirs[n])),
                "frozen": not any(p.requires_grad for p in ours.values()) and not teacher.model.training,
                "dtypes": sorted({str(p.dtype) for p in ours.values()}),
                "buffers": [n for n, _ in teacher.model.named_buffers()],
                "logits_equal": torch.equal(*logits),
            }
        )
    return out


def test_teachers_built_on_meta_equal_todays_cpu_built_ones(teachers: Path, tmp_path: Path) -> None:
    # 300 s: a loaded 2-core machine
    results = forked_gloo_ranks(_both_ways, 2, str(tmp_path / "store"), str(teachers), timeout=300)
    for rank_results in results:
        assert isinstance(rank_results, list), rank_results  # else the rank's error
        for (name, precision), r in zip(CASES, rank_results, strict=True):
            assert r["generators_kept"] and r["tracker_as_today"], r["case"]
            # the CPU build drew from the default generator for a MoE teacher (nn.Linear's, the gate's initialisers)
            assert r["moe_build_moved_it"] == name.endswith("moe"), r["case"]
            assert r["stream_forgotten"] and r["names"] and r["frozen"], r
            assert r["differ"] == [] and r["attributes"] == [] and r["buffers"] == [], r
            assert r["dtypes"] == ["torch.bfloat16" if precision == "bf16" else "torch.float32"], r
            assert r["logits_equal"], r["case"]
