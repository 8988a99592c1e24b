"""Architecture options train with dedicated embedding stages and equal a single-process run.

One 3-rank process group (P=3, dedicated pre and post stages) runs every option in turn, one
4-rank group runs the Llama-like combination at T=2 x P=2, and one 1-rank group computes the
T=1, P=1 references; fp32 losses and gradient norms (clipping active) must agree within 1e-6.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from megatron_ds.config import ModelConfig
from megatron_ds.model import norms
from megatron_ds.testing.scenario_runs import by_name, run_scenarios

TOL = 1e-6
LLAMA = {"model__num_key_value_heads": 2, "model__activation": "swiglu", "model__use_rotary_position_embeddings": True,
         "model__add_position_embedding": False, "model__add_bias_linear": False, "model__normalization": "rmsnorm",
         "model__untie_embeddings_and_output_weights": True, "model__rotary_base": 500000.0}  # Llama-3's base
OPTIONS: dict[str, dict[str, Any]] = {
    "exact_gelu": {"model__activation": "gelu"},  # the default is the tanh GeLU (tests/dist/test_pipeline_equivalence.py)
    "swiglu": {"model__activation": "swiglu"},
    "rope": {"model__use_rotary_position_embeddings": True, "model__add_position_embedding": False},
    "partial_rope": {  # --rotary-percent 0.5: the first half of each head rotated, the rest passed through
        "model__use_rotary_position_embeddings": True,
        "model__add_position_embedding": False,
        "model__rotary_percent": 0.5,
    },
    "gqa": {"model__num_key_value_heads": 2},  # of tiny_config's 4 heads
    "no_bias": {"model__add_bias_linear": False},
    **{n: {"model__normalization": n} for n in norms.REGISTRY if n != ModelConfig.normalization},  # every other norm
    "untied": {"model__untie_embeddings_and_output_weights": True},
    "qk_layernorm": {"model__qk_layernorm": True},  # LayerNorm weights and biases over each q and k head
    "llama": LLAMA,
}
QKV_BIAS = {**LLAMA, "model__add_qkv_bias": True}  # Qwen2's layout: --disable-bias-linear --add-qkv-bias
QWEN3 = {**LLAMA, "model__qk_layernorm": True}  # Qwen3's layout: RMSNorm over each q and k head
QWEN3_SP = {**QWEN3, "parallel__sequence_parallel": True}  # the norms' gradients: partial over heads and sequence
QWEN3_KV_CHANNELS = {**QWEN3, "model__kv_channels": 12}  # --kv-channels 12, not 32 / 4: Qwen3-0.6B/4B/32B's kind
LLAMA_PARTIAL_1P = {**LLAMA, "model__rotary_percent": 0.5, "model__normalization": "rmsnorm1p"}  # Megatron-LM's forms
QK_L2_NORM = {**LLAMA, "model__qk_l2_norm": True}  # Llama 4's weightless L2 norm over each q and k head
QK_L2_NORM_SP = {**QK_L2_NORM, "parallel__sequence_parallel": True}
WINDOW = {**LLAMA, "model__seq_length": 72, "model__max_position_embeddings": 72, "model__window_size": [5, 0],
          "model__window_attn_skip_freq": [1, 0, 1, 1]}  # --window-size 5,0 on layers 1, 3, 4: three 32-row chunks
WINDOW_SP = {**WINDOW, "parallel__sequence_parallel": True}  # attention gathers the whole sequence of its heads


def scenario(options: dict[str, Any], p: int = 1, t: int = 1, dedicated: str = "none", zero: int = 0,
             **extra: Any) -> dict[str, Any]:
    overrides = {"parallel__pipeline_model_parallel_size": p, "parallel__tensor_model_parallel_size": t,
                 "training__zero_stage": zero, **options}
    return {"overrides": overrides, "layout": {"dedicated": dedicated} if dedicated != "none" else {},
            "steps": 3, **extra}


def run(out: Path, world: int, scenarios: dict[str, dict], timeout: float) -> dict[str, list[dict]]:
    """Run the scenarios in one process group of `world` ranks; per scenario name, every rank's result."""
    return by_name(list(scenarios), run_scenarios(out, world, list(scenarios.values()), timeout))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Single-process T=1, P=1 runs of every option."""
    scenarios = {name: scenario(opts, init_checksums=name == "llama") for name, opts in OPTIONS.items()}
    scenarios["llama_partial_1p"] = scenario(LLAMA_PARTIAL_1P)
    scenarios["qkv_bias"] = scenario(QKV_BIAS)
    scenarios["qwen3"] = scenario(QWEN3)
    scenarios["qwen3_kv_channels"] = scenario(QWEN3_KV_CHANNELS)
    scenarios["qk_l2_norm"] = scenario(QK_L2_NORM)
    scenarios["window"] = scenario(WINDOW)
    scenarios["window_full"] = scenario({**WINDOW, "model__window_size": None})  # the window changes the model
    scenarios[ModelConfig.normalization] = scenario({})  # tiny_config itself: the base of its norm's 1p form
    results = run(tmp_path_factory.mktemp("arch_ref") / "ref", 1, scenarios, timeout=300)
    return {name: ranks[0] for name, ranks in results.items()}


@pytest.fixture(scope="module")
def dedicated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """P=3 with dedicated pre and post stages; the Llama-like model also under ZeRO-1."""
    scenarios = {name: scenario(opts, p=3, dedicated="both") for name, opts in OPTIONS.items()}
    scenarios["llama_zero1"] = scenario(LLAMA, p=3, dedicated="both", zero=1)
    return run(tmp_path_factory.mktemp("arch_p3") / "run", 3, scenarios, timeout=420)


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """The Llama-like model at T=2 x P=2, plain and with a dedicated post stage."""
    scenarios = {"llama": scenario(LLAMA, p=2, t=2, init_checksums=True),
                 "llama_post_zero1": scenario(LLAMA, p=2, t=2, dedicated="post", zero=1),
                 "llama_partial_1p": scenario(LLAMA_PARTIAL_1P, p=2, t=2),
                 "qkv_bias": scenario(QKV_BIAS, p=2, t=2),
                 "qwen3": scenario(QWEN3, p=2, t=2),
                 "qwen3_sp": scenario(QWEN3_SP, p=2, t=2),
                 "qwen3_kv_channels": scenario(QWEN3_KV_CHANNELS, p=2, t=2),
                 "qk_l2_norm_sp": scenario(QK_L2_NORM_SP, p=2, t=2),
                 "window_sp": scenario(WINDOW_SP, p=2, t=2)}
    return run(tmp_path_factory.mktemp("arch_t2") / "run", 4, scenarios, timeout=420)


def assert_matches(ranks: list[dict], ref: dict) -> None:
    assert min(ref["grad_norms"]) > 0.05, "clipping must be active (clip_grad 0.05)"
    for r in ranks:
        where = f"rank {r['rank']} (stage {r['stage']}, tensor rank {r['tp_rank']}) {r['layout']}"
        losses = [abs(a - b) for a, b in zip(r["losses"], ref["losses"])]
        assert len(r["losses"]) == 3 and max(losses) <= TOL, f"{where}: losses {r['losses']} vs {ref['losses']}"
        norms = [abs(a - b) / b for a, b in zip(r["grad_norms"], ref["grad_norms"])]
        assert max(norms) <= TOL, f"{where}: norms {r['grad_norms']} vs {ref['grad_norms']}"


@pytest.mark.parametrize("name", [*OPTIONS, "llama_zero1"])
def test_dedicated_stages_equal_single_process(dedicated: dict, reference: dict, name: str) -> None:
    assert_matches(dedicated[name], reference[name.removesuffix("_zero1")])
    assert dedicated[name][0]["layout"] == "E|t*4|L"


ZERO_CENTERED = {n.name: n for n in norms.REGISTRY.values() if n.zero_centered_gamma}


def test_options_change_the_model(reference: dict) -> None:
    """Each option builds a different model (the comparisons above are not vacuous); a zero-centred
    norm is its base norm in another parametrisation (next test)."""
    losses = {json.dumps(r["losses"]) for name, r in reference.items() if name not in ZERO_CENTERED}
    assert len(losses) == len(reference) - len(ZERO_CENTERED)


@pytest.mark.parametrize("name", ZERO_CENTERED)
def test_zero_centered_norm_trains_as_its_base(reference: dict, name: str) -> None:
    """weight + 1 from 0 is the base norm's weight from 1, and norms have no weight decay: the same
    training, up to float rounding (Megatron's point of --apply-layernorm-1p is numerical, not a new model)."""
    base = next(n.name for n in norms.REGISTRY.values() if n.megatron_lm == ZERO_CENTERED[name].megatron_lm
                and not n.zero_centered_gamma)
    assert_matches([reference[name]], reference[base])
    assert reference[name]["losses"] != reference["gqa"]["losses"]  # the comparison can fail


@pytest.mark.parametrize("name", ["untied", "llama", "llama_zero1"])
def test_untied_head_has_no_tied_group(dedicated: dict, name: str) -> None:
    for r in dedicated[name]:
        assert r["tied_modules"] == [] and r["tied_comms"] == [], r
        assert "LMHead" in r["layout_table"] and "lm_head_logits" not in r["layout_table"], r["layout_table"]


@pytest.mark.parametrize("name", ["swiglu", "gqa", "rope"])
def test_tied_embedding_stays_in_sync(dedicated: dict, name: str) -> None:
    holders = [r for r in dedicated[name] if "embedding_checksum" in r]
    assert sorted(h["stage"] for h in holders) == [0, 2]
    assert len({h["embedding_checksum"] for h in holders}) == 1 and all(h["embedding_changed"] for h in holders)
    assert all(r["tied_comms"] == ["word_embeddings"] for r in dedicated[name] if r["stage"] in (0, 2))


def test_no_position_embedding_leaves_the_dropout_spec(dedicated: dict) -> None:
    table = dedicated["rope"][0]["layout_table"]
    assert "2: EmbeddingDropout" in table and "PositionEmbedding" not in table, table


@pytest.mark.parametrize(
    "name",
    ["llama", "llama_post_zero1", "llama_partial_1p", "qkv_bias", "qwen3", "qwen3_sp", "qwen3_kv_channels",
     "qk_l2_norm_sp", "window_sp"],
)
def test_llama_tensor_parallel_equals_single_process(tensor_parallel: dict, reference: dict, name: str) -> None:
    same = {"llama_post_zero1": "llama", "qwen3_sp": "qwen3", "qk_l2_norm_sp": "qk_l2_norm", "window_sp": "window"}
    assert_matches(tensor_parallel[name], reference[same.get(name, name)])


def test_llama_tensor_parallel_initial_weights_equal_t1(tensor_parallel: dict, reference: dict) -> None:
    merged: dict[str, str] = {}
    for r in tensor_parallel["llama"]:
        for key, value in r.get("init_checksums", {}).items():
            assert merged.setdefault(key, value) == value, key
    assert merged == reference["llama"]["init_checksums"]
