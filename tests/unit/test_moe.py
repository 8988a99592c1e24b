"""Mixture-of-experts without a process group: which layers get experts, parameter counts per rank against the
built model, the memory model's per-rank expert parameters, and the one-line refusals."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from deepspeed.pipe import LayerSpec

from megatron_ds.config import RegularizationConfig
from megatron_ds.config.experts import experts_per_layer
from megatron_ds.errors import ConfigError
from megatron_ds.estimate.memory_inputs import MemoryInputs
from megatron_ds.estimate.spec_memory import spec_memory
from megatron_ds.flags.parser import parse_config
from megatron_ds.model import naming, shapes
from megatron_ds.model.gpt_pipe import build_layer_specs
from megatron_ds.testing.scenario import tiny_config
from megatron_ds.training.checkpoint.rules import moe_refusal, universal_refusal

MODEL = dataclasses.replace(tiny_config().model, num_experts=(4,))  # tiny_config's 4 layers, h 32; 4 experts
BASE = "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 128 --lr 1e-3"
BASE += " --train-iters 2 --mock-data --micro-batch-size 2 --global-batch-size 4"


def test_experts_go_on_every_interval_th_layer_as_megatron_deepspeed_puts_them() -> None:
    # Megatron-DeepSpeed's get_num_experts_per_layer: layer i (from 1) has experts when i % interval == 0
    assert experts_per_layer((4,), 4, 2) == (1, 4, 1, 4)
    assert experts_per_layer((8, 16), 4, 2) == (1, 8, 1, 16)
    assert experts_per_layer((2,), 3, 1) == (2, 2, 2)
    assert experts_per_layer((4,), 1, 2) == (1,)
    assert not dataclasses.replace(MODEL, num_layers=1).is_moe  # no layer reaches the interval: a dense model
    assert dataclasses.replace(MODEL, num_layers=1).num_experts == (1,)  # stored as one


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"mlp_type": "residual"},
        {"activation": "swiglu", "add_bias_linear": False},
        {"num_experts": (2, 4)},
        {"qk_layernorm": True},
        {"activation": "swiglu", "add_bias_linear": False, "moe_router": "megatron", "moe_top_k": 2,
         "moe_shared_expert_size": 24, "moe_shared_expert_gate": True},
    ],
    ids=["standard", "residual", "swiglu-no-bias", "list", "qk-layernorm", "shared-expert"],
)  # fmt: skip
def test_parameter_counts_per_rank_are_the_built_models(ep: int, variant: dict) -> None:
    model = dataclasses.replace(MODEL, **variant)
    reg = RegularizationConfig()
    specs = build_layer_specs(model, reg, 1234, expert_parallel_size=ep)
    built = [s.build() if isinstance(s, LayerSpec) else None for s in specs]
    counted = shapes.gpt_spec_params(model, 1, ep)
    for module, sp in zip(built, counted, strict=True):
        params = list(module.parameters()) if module is not None else []
        assert sp.num_params == sum(p.numel() for p in params)
        assert sp.no_decay == sum(p.numel() for p in params if p.dim() == 1)
    layers = [m for m in built if getattr(m, "moe", None) is not None]
    assert [m.moe.num_local_experts for m in layers] == [n // ep for n in model.experts_per_layer if n > 1]


def test_every_expert_starts_as_a_copy_of_the_dense_mlp_of_its_layer() -> None:
    """DeepSpeed deep-copies the expert it is given (as upstream); ours is the MLP the dense layer would draw."""
    reg = RegularizationConfig()
    dense = dataclasses.replace(MODEL, num_experts=(1,))
    moe_layer = build_layer_specs(MODEL, reg, 1234)[4].build()
    dense_layer = build_layer_specs(dense, reg, 1234)[4].build()
    for expert in moe_layer.moe.deepspeed_moe.experts.deepspeed_experts:
        assert expert.fc1.weight.equal(dense_layer.fc1.weight) and expert.fc2.weight.equal(dense_layer.fc2.weight)
    assert moe_layer.qkv.weight.equal(dense_layer.qkv.weight)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_partitions_the_experts_state_over_the_expert_data_parallel_group(zero: int) -> None:
    """DeepSpeed's ZeRO 1/2 partitions an expert's optimizer state over its expert-data-parallel group (DP / E ranks):
    at DP = 4 a rank keeps 4 experts' state / 4 at E = 1 and 2 experts' / 2 at E = 2, the same bytes; its weights
    (not partitioned) halve."""

    def moe_layer(ep: int) -> Any:
        inputs = MemoryInputs(
            model=MODEL,
            micro_batch_size=2,
            num_micro_batches=1,
            expert_parallel_size=ep,
            data_parallel_size=4,
            zero_stage=zero,
        )
        return [s for s in spec_memory(inputs) if s.name == naming.TRANSFORMER_LAYER][1]

    one, two = moe_layer(1), moe_layer(2)
    assert two.num_params < one.num_params and two.params < one.params
    assert two.optimizer == pytest.approx(one.optimizer) and one.optimizer > 0


def test_the_memory_model_holds_each_ranks_share_of_the_experts() -> None:
    def layer_params(ep: int) -> list[int]:
        inputs = MemoryInputs(model=MODEL, micro_batch_size=2, num_micro_batches=1, expert_parallel_size=ep)
        return [s.num_params for s in spec_memory(inputs) if s.name == naming.TRANSFORMER_LAYER]

    one, two = layer_params(1), layer_params(2)
    assert one[0] == two[0] and one[2] == two[2]  # dense layers
    h, ffn = MODEL.hidden_size, MODEL.ffn_hidden_size
    expert = 2 * h * ffn + ffn + h  # fc1 and fc2 with their biases (Megatron-DeepSpeed 4efb479's ParallelMLP)
    assert one[1] - two[1] == 2 * expert  # 4 experts vs 2 per rank
    assert shapes.total_params(MODEL) == shapes.total_params(dataclasses.replace(MODEL, num_experts=(1,))) + 2 * (
        3 * expert + h * 4  # three more experts, the gate
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            "--num-experts 4 --pipeline-model-parallel-size 2 --checkpoint-activations",
            "--num-experts 4 with --checkpoint-activations (--recompute-granularity full) at --pipeline-model-parallel",
        ),
        ("--num-experts 4 --zero-stage 3 --create-moe-param-group", "--num-experts 4 with --zero-stage 3:"),
        ("--num-experts 4 --zero-stage 2", "with --zero-stage 2 without --create-moe-param-group: "),
        ("--num-experts 4 --moe-expert-parallel-size 2", "--moe-expert-parallel-size 2 does not divide the data-"),
        ("--num-experts 3 --moe-expert-parallel-size 2 --world-size 2", "does not divide 3 experts"),
        ("--num-experts 4 --topk 3", "--topk 3 is not one of 1, 2"),
        ("--num-experts 4 4 4", "--num-experts 4 4 4 gives 3 counts"),
        ("--num-experts 2 --mlp-type dense", "invalid choice: 'dense'"),
    ],
)
def test_what_is_not_built_is_one_line(argv: str, message: str) -> None:
    world = 2 if "--world-size 2" in argv or "pipeline-model-parallel-size 2" in argv else 1
    argv = argv.replace("--world-size 2", "")
    with pytest.raises(ConfigError) as err:
        parse_config([*BASE.split(), *argv.split()], world_size=world)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_flags_build_the_model_and_a_dense_model_ignores_the_moe_switches() -> None:
    config = parse_config([*BASE.split(), *"--num-experts 2 4 --topk 2 --mlp-type residual".split()])[0]
    assert config.model.experts_per_layer == (1, 2, 1, 4) and config.model.moe_top_k == 2
    assert config.engine_kind == "plain"
    dense = parse_config([*BASE.split(), "--create-moe-param-group", "--topk", "2"])[0]
    assert dense == parse_config(BASE.split())[0]


def test_a_moe_checkpoint_has_a_universal_form_and_the_per_spec_readers_refuse_it_in_one_line() -> None:
    config = parse_config([*BASE.split(), "--num-experts", "4"])[0]
    meta = {"config": config.to_dict(), "optimizer_state": True}
    assert universal_refusal(meta, "ck") is None  # its reader (universal/moe_source.py) refuses what it does not read
    line = moe_refusal(meta, "ck")
    assert line.startswith("ck: a mixture-of-experts checkpoint (--num-experts 4)") and "\n" not in line
    assert "whose experts are in DeepSpeed's files" in line and "--to hf writes it as Mixtral" in line
    assert "tools/generate.py and inference.load_model read it (a --kd teacher too)" in line
    assert (
        "resumes it under any pipeline size, layout, world size, --moe-expert-parallel-size and ZeRO stage 0-2" in line
    )
    assert "--no-load-optim" in line and "--to universal" in line
    assert moe_refusal({"config": parse_config(BASE.split())[0].to_dict()}, "ck") is None


@pytest.mark.parametrize(
    ("argv", "notice"),
    [
        ("--zero-stage 2 --create-moe-param-group --bf16", None),  # DeepSpeed's ZeRO clip counts the experts
        ("--zero-stage 1 --create-moe-param-group --fp16", None),
        ("--bf16", None),  # `install_mixed_precision_expert_norm`: counted as upstream's fused FP16_Optimizer does
        ("", None),  # fp32 at DP = 1: the one-process norm, as upstream's
        ("--world-size 2", "--clip-grad 1 with --num-experts: the norm clipped here is the whole model's"),
        ("--world-size 2 --clip-grad 0", None),
        ("--world-size 2 --fp16", None),
    ],
)
def test_mixed_precision_and_zero_1_2_are_accepted_and_a_clip_that_differs_is_a_notice(
    argv: str, notice: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    world = 2 if "--world-size 2" in argv else 1
    argv = argv.replace("--world-size 2", "")
    config = parse_config([*BASE.split(), "--num-experts", "4", *argv.split()], world_size=world)[0]
    assert config.engine_kind == "plain" and config.parallel.data_parallel_size == world
    printed = [line for line in capsys.readouterr().out.splitlines() if "--num-experts" in line]
    assert (printed == []) if notice is None else (len(printed) == 1 and notice in printed[0]), printed


def test_the_gate_runs_in_fp32_when_the_engine_casts_the_layer_to_bf16() -> None:
    """DeepSpeed's engine casts the module to bf16/fp16; its TopKGate computes the logits from fp32 copies of the
    tokens and of its weight (as upstream, which uses the same gate): the load-balancing loss is bit for bit that of
    an fp32 gate on the same bf16 values, and it is fp32."""
    import copy

    import torch

    from megatron_ds.model import moe

    layer = build_layer_specs(MODEL, RegularizationConfig(), 1234)[4].build().moe.to(torch.bfloat16)
    x = torch.randn(2, 8, MODEL.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out, l_aux = moe.run(layer, x)
    gate = layer.deepspeed_moe.gate
    assert gate.wg.weight.dtype == torch.bfloat16 and out.dtype == torch.bfloat16 and l_aux.dtype == torch.float32
    fp32_gate = copy.deepcopy(gate).float()
    tokens = x.float().transpose(0, 1).reshape(-1, MODEL.hidden_size)  # (s x b, h), as moe.run hands them over
    assert torch.equal(fp32_gate(tokens)[0], l_aux)


def test_the_log_line_gives_the_moe_loss_as_upstreams_loss_dict() -> None:
    """Megatron-DeepSpeed's pretrain_gpt.py: {'lm loss', 'moe loss'} with experts; under --kd (its mos/kd path)
    {'total loss', 'lm loss', 'moe loss', 'kd loss'}; TensorBoard gets `lm-loss-training/<key>` for each."""
    from megatron_ds.training import logger

    assert logger.losses_text(2.0, {"moe loss": 0.125}) == ["lm loss: 2.000000E+00", "moe loss: 1.250000E-01"]
    assert logger.losses_text(2.0, {"moe loss": 0.125, "kd loss": 0.25}) == [
        "total loss: 2.375000E+00",
        "lm loss: 2.000000E+00",
        "moe loss: 1.250000E-01",
        "kd loss: 2.500000E-01",
    ]
    written: list[str] = []

    class Writer:
        def add_scalar(self, name: str, value: float, step: int) -> None:
            written.append(name)

    stats = logger.IterationStats(1, 1e-3, 4, 2.0, None, None, other_losses={"moe loss": 0.125})
    logger.Scalars(Writer(), parse_config(BASE.split())[0].logging).iteration(stats)
    assert written[:2] == ["lm-loss-training/lm loss", "lm-loss-training/moe loss"]
