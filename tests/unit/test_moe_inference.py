"""One-process inference of mixture-of-experts models: how its MoE layers route (every token to its top-k experts,
whatever else is in the batch, so the KV cache changes nothing), against the training layer; converted Megatron-DeepSpeed
MoE checkpoints compute upstream's logits. (Our own checkpoints, saved by the training path at EP=1 and EP=2:
tests/dist/test_moe_expert_parallel.py.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.inference import GPTModel, KVCache, generate, load_model
from megatron_ds.interop.megatron_deepspeed import import_megatron_deepspeed
from megatron_ds.model.transformer import TransformerLayer
from megatron_ds.testing.scenario import tiny_config
from megatron_ds.training.checkpoint.directory import CheckpointError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_deepspeed_checkpoints"
# on layers 2 and 4 (--expert-interval 2); routing flags at their defaults: tokens are dropped
MOE = tiny_config(model__max_position_embeddings=40, model__vocab_size=96, model__num_experts=(4,)).model
INIT = RegularizationConfig(hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3)
TOKENS = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(1))


def _model(model: ModelConfig) -> GPTModel:
    torch.manual_seed(0)  # every expert starts as the same MLP: perturb them apart (and the gates, norms, biases)
    built = GPTModel(model, INIT)
    with torch.no_grad():
        for p in built.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return built


@pytest.mark.parametrize("top_k", [1, 2])
def test_every_token_is_routed_whatever_else_is_in_the_batch(top_k: int) -> None:
    """With the checkpoint's routing flags at their defaults (token dropping, top-2's sampled second expert, minimum
    capacity 4), the inference model's cached forward (a prefill, a chunk, then single tokens: a top-1 gate of one token
    would fail DeepSpeed's minimum-capacity assertion) equals the uncached one, a sequence's logits do not depend on the
    other sequence of the batch, and greedy generation is the same with and without the cache."""
    model = _model(dataclasses.replace(MOE, moe_top_k=top_k))
    assert [layer.moe is not None for layer in model.layers] == [False, True, False, True]
    with torch.no_grad():
        full, cache = model(TOKENS), KVCache()
        pieces = [model(TOKENS[:, :9], cache), model(TOKENS[:, 9:14], cache)]
        pieces += [model(TOKENS[:, i : i + 1], cache) for i in range(14, 21)]
        alone = model(TOKENS[1:])
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-5)
    torch.testing.assert_close(alone, full[1:], rtol=0, atol=1e-5)
    cached = generate(model, [3, 1, 4], 25, temperature=0.0)
    assert cached == generate(model, [3, 1, 4], 25, temperature=0.0, use_cache=False)
    assert len(set(cached)) > 3  # a real sequence, not one repeated token


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_moe_layer_is_the_training_layer_in_eval_without_token_dropping(top_k: int) -> None:
    """The inference layer computes what the training layer (DeepSpeed's MoE layer, same weights) computes in eval mode
    with --disable-moe-token-dropping and --disable-moe-top2-2nd-expert-sampling, whatever the checkpoint's own
    flags; in eval mode with them at their defaults the training layer drops the tokens over its eval capacity
    (1.0 x 42 tokens / 4 experts) and samples top-2's second expert, so it computes something else."""
    model = dataclasses.replace(MOE, moe_top_k=top_k)
    layer = _model(model).layers[1]
    x = 0.5 * torch.randn(2, 21, 32, generator=torch.Generator().manual_seed(2))

    def training(**routing: bool) -> torch.Tensor:
        built = TransformerLayer(dataclasses.replace(model, **routing), INIT, 0, num_experts=4).eval()
        built.load_state_dict(layer.state_dict())
        return built(x)

    with torch.no_grad():
        ours = layer(x)
        undropped = training(moe_token_dropping=False, moe_top2_2nd_expert_sampling=False)
        as_flagged = training()
    torch.testing.assert_close(ours, undropped, rtol=0, atol=1e-6)
    assert (ours - as_flagged).abs().max() > 1e-2


@pytest.mark.parametrize("case", ["moe_ep2_zero0", "moe_residual_ep2_zero2"])
def test_a_converted_megatron_deepspeed_moe_checkpoint_computes_upstreams_logits(tmp_path: Path, case: str) -> None:
    """Upstream's MoE runs (top-1 with 4 experts in layer 2; PR-MoE top-2 with 2 experts in every layer; both at
    expert-parallel size 2, no token dropping) converted: `load_model` reads their universal form's fp32 weights and
    computes upstream's GPTModel eval logits; a missing tensor file of it is one line naming it."""
    out = tmp_path / "converted"
    import_megatron_deepspeed(str(FIXTURES / case), str(out), show_progress=False)
    reference = torch.load(FIXTURES / case / "reference.pt", weights_only=True)
    model = load_model(str(out), vocab_size=reference["logits"].shape[-1])  # upstream's padded columns too
    with torch.no_grad():
        torch.testing.assert_close(model(reference["tokens"]), reference["logits"], rtol=0, atol=1e-6)
    prompt = reference["tokens"][0, :4].tolist()
    assert generate(model, prompt, 8, temperature=0.0) == generate(model, prompt, 8, temperature=0.0, use_cache=False)
    gone = next(out.glob("*.universal/tensors/*deepspeed_experts.1.fc1.weight/fp32.pt"))
    gone.unlink()
    with pytest.raises(CheckpointError) as err:
        load_model(str(out))
    assert f"{gone.parent.name}/fp32.pt is missing" in str(err.value) and "\n" not in str(err.value)
