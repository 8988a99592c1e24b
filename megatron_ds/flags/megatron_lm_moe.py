"""Megatron-LM's mixture-of-experts flags (its `examples/mixtral/train_mixtral_8x7b_distributed.sh` uses them) and the
router they choose.

Megatron-LM routes with its top-k router: softmax over the k largest logits (with `--moe-router-pre-softmax` the k
largest of the softmax over all experts, not renormalized), every token routed (no capacity unless
`--moe-expert-capacity-factor`), the load-balancing loss E / k x sum_e(mean probability_e x routed share_e)
(`ModelConfig.moe_router` "megatron", `model.moe.megatron_router`); `--moe-shared-expert-intermediate-size` adds a
shared expert beside the routed ones (`model.moe.SharedExpert`). Megatron-DeepSpeed's `--topk` gates are
DeepSpeed's top-1 and top-2 functions, which weigh and balance otherwise. So any accepted flag of the table selects
Megatron-LM's router and its defaults (top-2, coefficient 0, experts on every layer), and is refused beside the
flags of DeepSpeed's gates (`_DEEPSPEED_GATE`): one launch line routes one way. Each flag means what it means in
Megatron-LM, changes nothing here (the help says why), or is refused; the table, `MIXTURE_OF_EXPERTS`, is declared in
`megatron_lm_moe_table` (and read from here).
"""

from __future__ import annotations

import argparse
from typing import Any

import megatron_ds.flags.model as ds_model
import megatron_ds.flags.window_flags as window_flags
from megatron_ds.errors import ConfigError
from megatron_ds.flags.declare import ACCEPTED, REFUSED, Flag, field_default
from megatron_ds.flags.megatron_lm_moe_table import MIXTURE_OF_EXPERTS
from megatron_ds.flags.notices import notice

_DEFAULT_TOP_K, _DEFAULT_COEFF = 2, 0.0
"""Megatron-LM's defaults of --moe-router-topk and --moe-aux-loss-coeff."""

_DEEPSPEED_GATE = tuple(
    f
    for f in ds_model.MIXTURE_OF_EXPERTS
    if f.status == ACCEPTED and f.name not in ("--moe-expert-parallel-size", "--create-moe-param-group")
)
"""Megatron-DeepSpeed's routing flags (DeepSpeed's gates), refused beside this table's."""


def _given(flags: tuple[Flag, ...], args: argparse.Namespace) -> list[str]:
    """Those of `flags` on the line (a value flag at its default value is not seen)."""
    return [f.name for f in flags if f.status != REFUSED and getattr(args, f.attr) != f.resolved_default()]


def model_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The routing fields of the model section: Megatron-LM's router when a flag of this table is given (refused
    beside a flag of DeepSpeed's gates, and where Megatron-LM would compute otherwise), else DeepSpeed's gates."""
    ours = _given(MIXTURE_OF_EXPERTS, args)
    if not ours:
        return {
            name: getattr(args, dest) if getattr(args, dest) is not None else field_default(f"model.{name}")
            for dest, name in (
                ("topk", "moe_top_k"),
                ("expert_interval", "expert_interval"),
                ("moe_loss_coeff", "moe_loss_coeff"),
            )
        }
    theirs = _given(_DEEPSPEED_GATE, args)
    if theirs:
        raise ConfigError(
            f"{theirs[0]} (Megatron-DeepSpeed's, for DeepSpeed's gates) with {ours[0]} (Megatron-LM's, for its top-k "
            "router): they route differently; keep one family of flags"
        )
    if not any(n > 1 for n in args.num_experts or ()):  # a dense model: Megatron-LM ignores them too
        return {"moe_router": "megatron"}
    _check_values(args)
    coeff = _one("--moe-aux-loss-coeff", args.moe_aux_loss_coeff, _DEFAULT_COEFF)
    kind = _one("--moe-router-load-balancing-type", args.moe_router_load_balancing_type, "aux_loss")
    return {
        "moe_router": "megatron",
        "moe_top_k": _DEFAULT_TOP_K if args.moe_router_topk is None else args.moe_router_topk,
        "moe_router_pre_softmax": bool(args.moe_router_pre_softmax),
        "moe_shared_expert_size": args.moe_shared_expert_intermediate_size or 0,
        "moe_shared_expert_gate": bool(args.moe_shared_expert_gate),
        "expert_interval": expert_interval(args.moe_layer_freq, args.num_layers),
        "moe_loss_coeff": 0.0 if kind == "none" else coeff,
    }


def _one(flag: str, value: Any, default: Any) -> Any:
    """A flag Megatron-LM takes as a list (one entry per load-balancing type) as its one value; several refused."""
    if value is None:
        return default
    if not isinstance(value, list):  # a checkpoint's value (`--use-checkpoint-args`)
        return value
    if len(value) != 1:
        raise ConfigError(
            f"{flag} {' '.join(map(str, value))}: several load-balancing losses together are not built; give one value"
        )
    return value[0]


def expert_parallel(args: argparse.Namespace, ours: int | None) -> dict[str, int]:
    """{"expert_parallel_size": --expert-model-parallel-size} when given ({} otherwise); refused beside a different
    --moe-expert-parallel-size (`ours`, its value)."""
    size = args.expert_model_parallel_size
    if size is None:
        return {}
    if ours not in (None, 1, size):
        raise ConfigError(
            f"--expert-model-parallel-size {size} with --moe-expert-parallel-size {ours}: the same size by two names; "
            "keep one"
        )
    return {"expert_parallel_size": size}


def _routes(model: Any) -> bool:
    """`model` (a ModelConfig) has experts routed by Megatron-LM's router (`model_fields` chose it)."""
    return bool(model.is_moe and model.moe_router == "megatron")


def optimizer_fields(model: Any, direct: dict[str, Any]) -> dict[str, Any]:
    """The optimizer section's directly copied values (`direct["optimizer"]`), with Megatron-LM's router the experts in
    optimizer groups of their own (`--create-moe-param-group`, which ZeRO 1/2 needs here): Megatron-LM's optimizers
    always keep them apart, and the update is the same."""
    fields = dict(direct.get("optimizer", {}))
    if _routes(model):
        fields["create_moe_param_group"] = True
    return fields


def as_given(err: ConfigError, args: argparse.Namespace) -> ConfigError:
    """`err` naming --expert-model-parallel-size where the line gave it for --moe-expert-parallel-size."""
    text = str(err)
    if args.expert_model_parallel_size is None or "--expert-model-parallel-size" in text:  # both named already
        return err
    return type(err)(text.replace("--moe-expert-parallel-size", "--expert-model-parallel-size"))


def _check_values(args: argparse.Namespace) -> None:
    coeff = _one("--moe-aux-loss-coeff", args.moe_aux_loss_coeff, _DEFAULT_COEFF)
    if coeff < 0:
        raise ConfigError(f"--moe-aux-loss-coeff {coeff:g} must be >= 0")
    size = args.moe_shared_expert_intermediate_size
    if size is not None and size <= 0:
        raise ConfigError(f"--moe-shared-expert-intermediate-size {size} must be > 0 (the shared expert's FFN width)")
    if args.expert_tensor_parallel_size not in (None, 1):
        raise ConfigError(
            f"--expert-tensor-parallel-size {args.expert_tensor_parallel_size} is not supported: experts are not split "
            "over tensor ranks here; use 1"
        )


def checkpoint_dests(model: Any) -> tuple[set[str], dict[str, Any]]:
    """For `--use-checkpoint-args`: the argparse dests of a mixture-of-experts `model`'s routing to leave unset, and
    those to set, in the family of flags of its router."""
    if not model.is_moe:
        return {f.attr for f in _DEEPSPEED_GATE}, {}
    if model.moe_router != "megatron":
        return set(), {
            "topk": model.moe_top_k,
            "expert_interval": model.expert_interval,
            "moe_loss_coeff": model.moe_loss_coeff,
        }
    n, layers = model.expert_interval, model.num_layers
    freq = "1" if n == 1 else f"([0]*{n - 1}+[1])*{layers // n}" + (f"+[0]*{layers % n}" if layers % n else "")
    return {f.attr for f in _DEEPSPEED_GATE}, {
        "moe_router_topk": model.moe_top_k,
        "moe_router_pre_softmax": True if model.moe_router_pre_softmax else None,
        "moe_shared_expert_intermediate_size": model.moe_shared_expert_size or None,
        "moe_shared_expert_gate": True if model.moe_shared_expert_gate else None,
        "moe_aux_loss_coeff": model.moe_loss_coeff,
        "moe_layer_freq": freq,
    }


def experts_ffn_size(args: argparse.Namespace) -> int | None:
    """--moe-ffn-hidden-size as the model's FFN size when every layer has experts (None otherwise): the dense
    --ffn-hidden-size, which Qwen- and DeepSeek-style lines set apart, shapes no tensor then (our experts are the MLP's
    width). With dense layers too the two must agree (`check_model`)."""
    experts = [n for n in args.num_experts or () if n > 1]
    if args.moe_ffn_hidden_size is None or not experts or len(experts) != len(args.num_experts):
        return None
    if "[" not in str(args.moe_layer_freq or 1) and str(args.moe_layer_freq or 1).strip() != "1":
        return None  # Megatron-LM's integer N > 1: refused by `expert_interval`
    try:
        every_layer = expert_interval(args.moe_layer_freq, args.num_layers) == 1
    except ConfigError:
        return None  # refused where the routing fields are read
    return args.moe_ffn_hidden_size if every_layer else None


def check_model(args: argparse.Namespace, model: Any) -> None:
    """What the built model must be for Megatron-LM's router (a mixture-of-experts model given this table's flags):
    no biases (megatron-core's router has a learned bias with --add-bias-linear, DeepSpeed's gate none) and
    --moe-ffn-hidden-size the FFN size (each expert is the MLP's width)."""
    if not _routes(model):
        return
    if model.add_bias_linear:
        raise ConfigError(
            f"{_given(MIXTURE_OF_EXPERTS, args)[0]} (Megatron-LM's router) with biases on: megatron-core's router "
            "learns a bias then, which DeepSpeed's gate here has not; add --disable-bias-linear (as Megatron-LM's "
            "Mixtral line does)"
        )
    if args.moe_ffn_hidden_size is not None and args.moe_ffn_hidden_size != model.ffn_hidden_size:
        raise ConfigError(
            f"--moe-ffn-hidden-size {args.moe_ffn_hidden_size} differs from the FFN size {model.ffn_hidden_size}: each "
            "expert here is the MLP's width; give the experts' size as --ffn-hidden-size"
        )


def expert_interval(freq: Any, num_layers: int) -> int:
    """--moe-layer-freq as Megatron-DeepSpeed's expert interval N (experts on layers N, 2N, ... from 1): 1, or a
    pattern of 0s and 1s that is N - 1 zeros and a one, repeated. Megatron-LM's integer N > 1 puts experts on layers
    1, N + 1, ... from 1, which no interval gives."""
    if freq is None:
        return 1
    text = str(freq).strip()
    if "[" not in text and not text.isdigit():
        raise ConfigError(f"--moe-layer-freq {text} must be an integer or a list pattern such as ([0]+[1])*16")
    if "[" not in text:
        if text != "1":
            n = max(int(text), 2)
            raise ConfigError(
                f"--moe-layer-freq {text}: Megatron-LM puts experts on layers 1, {n + 1}, ... (from 1), which is not "
                f"built; use 1, or a pattern that ends each group of layers with experts, e.g. "
                f"([0]*{n - 1}+[1])*{max(num_layers // n, 1)} (Megatron-DeepSpeed's --expert-interval {n})"
            )
        return 1
    pattern = window_flags.pattern(text, "--moe-layer-freq")
    n = pattern.index(1) + 1 if 1 in pattern else 0
    expected = [1 if layer % n == 0 else 0 for layer in range(1, num_layers + 1)] if n else []
    if list(pattern) != expected:
        raise ConfigError(
            f"--moe-layer-freq {text} gives {list(pattern)}: only experts on every N-th layer (layers N, 2N, ... from "
            f"1, for all {num_layers} layers) are built; use such a pattern"
        )
    return n


def router_notices(args: argparse.Namespace, model: Any, precision: str) -> None:
    """What Megatron-LM's router computes otherwise here, or what megatron-core refuses and trains here, printed once
    per launch. Top-1 routing without --moe-router-pre-softmax is not refused: a Hugging Face Mixtral or Qwen3-MoE
    (`norm_topk_prob` true) at `num_experts_per_tok` 1 means exactly that (the import passes these flags, muted)."""
    if not _routes(model):
        return
    if precision != "fp32" and args.moe_router_dtype is None:
        notice(
            f"Megatron-LM's router computes its logits in {precision} unless --moe-router-dtype fp32; here DeepSpeed's "
            "gate computes them in fp32 (add --moe-router-dtype fp32 to say so)"
        )
    if model.moe_top_k == 1 and not model.moe_router_pre_softmax:
        notice(
            "--moe-router-topk 1 without --moe-router-pre-softmax: megatron-core refuses this combination (its "
            "TransformerConfig asks for --moe-router-pre-softmax when topk is 1); here the softmax over the one chosen "
            "logit weighs each token's expert 1, so the router learns from the load-balancing loss alone (as Mixtral's "
            "and Qwen3-MoE's norm_topk_prob routers do at one expert per token); add --moe-router-pre-softmax to weigh "
            "it by its probability among all experts"
        )
