"""A Megatron-LM run's saved args (as Megatron-LM core_v0.16.1's own argument code produced them:
tests/data/megatron_lm_args.json) as our config and flags; what we do not build is refused in one line
naming the flag; the unpickler of its files admits only what they hold."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_ds.interop import megatron_lm_args as saved_args
from megatron_ds.interop import restricted_pickle
from megatron_ds.interop.megatron_lm_files import MegatronLMCheckpoint
from megatron_ds.testing.megatron_lm_checkpoints import namespace, recorded
from megatron_ds.training.checkpoint.directory import CheckpointError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_deepspeed"


def _ckpt(name: str, **changes: Any) -> MegatronLMCheckpoint:
    args = {**vars(namespace(recorded(name)["args"])), **changes}
    return MegatronLMCheckpoint("/ckpt/iter_0000005", 5, "torch_dist", args, {"iteration": 5})


def _config(ckpt: MegatronLMCheckpoint):
    flags, _ = saved_args.tokenizer_flags(ckpt, {})
    return saved_args.config_from_args(ckpt, flags)


def test_llama_style_args_become_our_model() -> None:
    m = _config(_ckpt("llama")).model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.kv_heads, m.ffn_hidden_size) == (3, 32, 4, 2, 48)
    assert m.activation == "swiglu" and m.use_rotary_position_embeddings and not m.add_position_embedding
    assert m.untie_embeddings_and_output_weights and not m.add_bias_linear
    assert m.normalization == "rmsnorm" and m.layernorm_epsilon == 1e-6 and m.rotary_base == 500000
    assert m.vocab_size == 256  # 101 ids padded to a multiple of 128 x T=2, as Megatron-LM padded them
    assert not m.add_qkv_bias


def test_a_qkv_bias_without_the_other_biases_is_qwen2s_layout() -> None:
    m = _config(_ckpt("llama", add_qkv_bias=True)).model
    assert m.add_qkv_bias and not m.add_bias_linear
    assert [m.has_bias(n) for n in ("qkv", "proj", "fc1", "fc2")] == [True, False, False, False]


def test_query_and_key_norms_are_qwen3s_layout() -> None:
    assert _config(_ckpt("llama", qk_layernorm=True)).model.qk_layernorm
    assert not _config(_ckpt("llama")).model.qk_layernorm


def test_gpt_style_args_become_our_model() -> None:
    config = _config(_ckpt("gpt"))
    m = config.model
    assert m.add_position_embedding and not m.use_rotary_position_embeddings
    assert m.activation == "gelu_tanh"  # Megatron-LM's default fused bias-GeLU is the tanh approximation
    assert m.add_bias_linear and not m.untie_embeddings_and_output_weights and m.normalization == "layernorm"
    assert config.training.precision == "fp32" and config.optimizer.lr_decay_style == "cosine"
    assert config.training.global_batch_size == 8 and config.training.train_iters == 20


@pytest.mark.parametrize(
    ("changes", "flag"),
    [
        ({"qk_layernorm": True, "apply_wd_to_qk_layernorm": True}, "--apply-wd-to-qk-layernorm"),
        ({"multi_latent_attention": True}, "--multi-latent-attention"),
        ({"mtp_num_layers": 1}, "--mtp-num-layers"),
        ({"rotary_interleaved": True}, "--rotary-interleaved"),
        ({"lr_decay_style": "WSD"}, "--lr-decay-style"),
        ({"lr_warmup_init": 1e-5}, "--lr-warmup-init"),
    ],
)
def test_what_is_not_built_is_refused_naming_the_flag(changes: dict[str, Any], flag: str) -> None:
    with pytest.raises(
        CheckpointError, match=f"^/ckpt/iter_0000005: its saved args, as flags, are refused here: .*{flag}"
    ):
        _config(_ckpt("llama", **changes))


_MOE = {"num_experts": 4, "moe_ffn_hidden_size": 128, "add_bias_linear": False}
"""A GPT run's args with experts (validate_args sets moe_ffn_hidden_size to the FFN size); megatron-core's router
learns a bias with the linear biases, which is refused."""


def test_a_mixture_of_experts_run_is_megatron_lms_router() -> None:
    ckpt = _ckpt("gpt", **_MOE, moe_router_topk=3, moe_aux_loss_coeff=[0.01], moe_router_dtype="fp32")
    m = _config(ckpt).model
    assert m.is_moe and m.moe_router == "megatron" and m.experts_per_layer == (4, 4)
    assert (m.moe_top_k, m.moe_loss_coeff, m.expert_interval) == (3, 0.01, 1)
    flags = saved_args.moe_flags(ckpt.args)
    assert flags == ["--moe-router-topk", "3", "--moe-aux-loss-coeff", "0.01", "--moe-router-dtype", "fp32"]
    assert saved_args.moe_flags(_ckpt("gpt").args) == []  # a dense run saves them at Megatron-LM's defaults
    # at Megatron-LM's default top-2 the flag is still given: a flag of its own chooses its router here
    assert saved_args.moe_flags(_ckpt("gpt", **_MOE).args) == ["--moe-router-topk", "2"]


def test_a_mixture_of_experts_run_at_t2_converts_at_t1_with_its_padding() -> None:
    """Our experts train at T = 1 and the converted weights are whole: Megatron-LM's T = 2 MoE line (experts split
    over both tensor ranks) becomes T = 1 with the vocabulary padded to 128 x 2, and its expert-tensor-parallel size
    is not rendered (only 1 is accepted as a flag)."""
    ckpt = _ckpt("mixtral_tp2")
    config = _config(ckpt)
    assert config.parallel.tensor_model_parallel_size == 1 and config.model.vocab_size == 256
    assert ckpt.args["expert_tensor_parallel_size"] == 2 and config.model.experts_per_layer == (4, 4)
    with pytest.raises(CheckpointError, match="read here only from torch_dist"):
        _config(MegatronLMCheckpoint("/ckpt/iter_0000005", 5, "torch", ckpt.args, {"iteration": 5}))


def test_a_qwen2_moe_style_run_keeps_its_shared_expert_and_pre_softmax_router() -> None:
    shared = {"moe_shared_expert_intermediate_size": 64, "moe_shared_expert_gate": True, "moe_router_pre_softmax": True}
    m = _config(_ckpt("gpt", **_MOE, **shared)).model
    assert (m.moe_shared_expert_size, m.moe_shared_expert_gate, m.moe_router_pre_softmax) == (64, True, True)


def test_experts_of_another_width_than_the_dense_ffn_on_every_layer_are_the_ffn_size() -> None:
    """Qwen- and DeepSeek-style lines give --moe-ffn-hidden-size apart from --ffn-hidden-size; with experts on every
    layer the dense size shapes no tensor, so the experts' is the model's FFN size; with dense layers too, refused."""
    ckpt = _ckpt("mixtral", ffn_hidden_size=128, moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=128)
    assert _config(ckpt).model.ffn_hidden_size == 64 and _config(ckpt).model.moe_shared_expert_size == 128
    assert "--moe-ffn-hidden-size" not in saved_args.moe_flags(ckpt.args)
    with pytest.raises(CheckpointError, match="--moe-ffn-hidden-size 64 differs from the FFN size 128"):
        _config(_ckpt("mixtral", ffn_hidden_size=128, moe_ffn_hidden_size=64, moe_layer_freq=[0, 1]))


def test_a_moe_layer_pattern_is_the_expert_interval() -> None:
    m = _config(_ckpt("gpt", **_MOE, moe_layer_freq=[0, 1])).model
    assert m.experts_per_layer == (1, 4) and m.expert_interval == 2


@pytest.mark.parametrize(
    ("changes", "flag"),
    [
        ({"moe_expert_capacity_factor": 1.25}, "--moe-expert-capacity-factor"),
        ({"moe_router_score_function": "sigmoid"}, "--moe-router-score-function sigmoid"),
        ({"moe_router_enable_expert_bias": True}, "--moe-router-enable-expert-bias"),
        ({"moe_layer_freq": 2}, "--moe-layer-freq 2"),
        ({"add_bias_linear": True}, "--moe-router-topk"),  # megatron-core's router's bias
    ],
)
def test_what_a_mixture_of_experts_run_has_that_is_not_built_is_refused(changes: dict[str, Any], flag: str) -> None:
    with pytest.raises(
        CheckpointError, match="^/ckpt/iter_0000005: its saved args, as flags, are refused here: "
    ) as err:
        _config(_ckpt("gpt", **{**_MOE, **changes}))
    assert flag in str(err.value) and "\n" not in str(err.value)


def test_every_moe_arg_is_saved_by_megatron_lm() -> None:
    """The saved names of `MOE_ARGS` are in the args Megatron-LM's argument code produced (no misspelled flag that
    would never be rendered)."""
    args = recorded("gpt")["args"]
    assert [a.dest for a in saved_args.MOE_ARGS if a.dest not in args] == []


def test_a_padding_that_does_not_match_is_refused() -> None:
    with pytest.raises(
        CheckpointError, match="its padded vocabulary has 512 rows, our padding of the same tokenizer gives 256"
    ):
        _config(_ckpt("llama", padded_vocab_size=512))


def test_tokenizer_flags() -> None:
    # the recorded args are Megatron-LM's before April 2026: its NullTokenizer had --vocab-size + 1 ids, eod the last
    assert saved_args.tokenizer_flags(_ckpt("gpt"), {}) == (
        ["--tokenizer-type", "NullTokenizer", "--vocab-size", "101"],
        None,
    )
    assert saved_args.tokenizer_vocab_size(_ckpt("gpt")) == 101
    newer = _ckpt("gpt", null_tokenizer_eod_id=None, null_tokenizer_pad_id=-1)  # --vocab-size ids since then
    assert saved_args.tokenizer_flags(newer, {})[0] == ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    assert saved_args.tokenizer_vocab_size(newer) == 100
    ids = _ckpt("gpt", null_tokenizer_eod_id=0, null_tokenizer_pad_id=5)
    assert saved_args.tokenizer_flags(ids, {})[0][4:] == [
        "--null-tokenizer-eod-id",
        "0",
        "--null-tokenizer-pad-id",
        "5",
    ]
    data = _config(ids).data
    assert (data.null_tokenizer_vocab_size, data.null_tokenizer_eod_id, data.null_tokenizer_pad_id) == (100, 0, 5)
    assert data.data_upstream == "megatron-lm" and _config(_ckpt("gpt")).data.null_tokenizer_vocab_size == 101
    # --vocab-size 128 padded 129 to 256 rows then: converted with 129 ids, not refused as "our padding gives 128"
    assert _config(_ckpt("gpt", vocab_size=128, padded_vocab_size=256)).model.vocab_size == 256
    flags, note = saved_args.tokenizer_flags(_ckpt("gpt", tokenizer_type="GPT2BPETokenizer", vocab_file="/gone"), {})
    assert flags == ["--vocab-size", "128"]  # the padded rows stand for the vocabulary
    assert note is not None and "GPT2BPETokenizer not recorded (its files are not here)" in note
    with pytest.raises(CheckpointError, match="^--tokenizer-model /x.model: the checkpoint's tokenizer NullTokenizer"):
        saved_args.tokenizer_flags(_ckpt("gpt"), {"tokenizer_model": "/x.model"})  # was recorded without a type
    moved = {"vocab_file": str(FIXTURES / "vocab.json"), "merge_file": str(FIXTURES / "merges.txt")}
    flags, _ = saved_args.tokenizer_flags(_ckpt("gpt", tokenizer_type="GPT2BPETokenizer", vocab_file="/gone"), moved)
    assert flags[2:4] == ["--tokenizer-type", "GPT2BPETokenizer"] and flags[-1] == moved["merge_file"]


def test_train_state_counts_megatron_lms_samples_and_flops() -> None:
    ckpt = _ckpt("gpt", consumed_train_samples=40, consumed_valid_samples=16)
    ckpt.states["num_floating_point_operations_so_far"] = 3.5e12
    state = saved_args.train_state(ckpt, _config(ckpt))
    assert state == {
        "iteration": 5,
        "consumed_train_samples": 40,
        "consumed_valid_samples": 16,
        "consumed_train_tokens": 40 * 32,
        "floating_point_operations_so_far": 3.5e12,
    }


def test_args_unpickle_with_megatrons_values_inert() -> None:
    buffer = io.BytesIO()
    torch.save({"args": namespace(recorded("llama")["args"])}, buffer)
    buffer.seek(0)
    module = restricted_pickle.pickle_module(restricted_pickle.upstream_values)
    args = torch.load(buffer, weights_only=False, pickle_module=module)["args"]
    assert args.params_dtype is torch.bfloat16 and args.num_query_groups == 2
    assert isinstance(args.attention_backend, restricted_pickle.Inert)  # megatron.core's AttnBackend, not imported
    assert isinstance(args.exit_signal, restricted_pickle.Inert)  # signal.SIGTERM


def test_dcp_metadata_admits_torchs_dataclasses_only() -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    good = pickle.dumps(Metadata(state_dict_metadata={}))
    assert isinstance(restricted_pickle.load(io.BytesIO(good), restricted_pickle.dcp_metadata), Metadata)
    bad = pickle.dumps(Metadata(state_dict_metadata={"x": torch.nn.Linear}))
    with pytest.raises(pickle.UnpicklingError, match="holds a pickled torch.nn.modules.linear.Linear"):
        restricted_pickle.load(io.BytesIO(bad), restricted_pickle.dcp_metadata)


def test_llama3_rope_scaling_and_no_positions() -> None:
    m = _config(_ckpt("llama", use_rope_scaling=True, rope_scaling_factor=32.0)).model
    assert m.use_rope_scaling and m.rope_scaling_factor == 32.0
    m = _config(_ckpt("gpt", position_embedding_type="none")).model
    assert not m.add_position_embedding and not m.use_rotary_position_embeddings
    assert "--rope-scaling-factor" not in saved_args.render(
        vars(namespace(recorded("llama")["args"])), saved_args.MODEL_ARGS
    )


def test_a_converted_models_args_get_placeholders() -> None:
    """Megatron-LM's checkpoint converter saves args without a training length or learning rate: the
    model converts, recorded with --train-iters at the iteration and --lr 1e-4 (the training run's own
    flags apply), and nothing else is invented."""
    ckpt = _ckpt("converted")
    assert saved_args.placeholders(ckpt) == ["--train-iters=5", "--lr=1e-4"]
    config = _config(ckpt)
    assert config.training.train_iters == 5 and config.optimizer.lr == 1e-4
    assert config.model.activation == "gelu" and not config.model.add_bias_linear  # no fused bias-GeLU without biases
    assert config.training.precision == "bf16" and config.model.use_rotary_position_embeddings
    assert saved_args.placeholders(_ckpt("gpt")) == []
