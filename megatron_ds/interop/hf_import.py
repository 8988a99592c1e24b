"""Import a Hugging Face directory (a model type of `hf_architectures.ARCHITECTURE_CLASSES`) as a checkpoint `pretrain_gpt.py --load` trains from.

    from megatron_ds.interop.hf_import import import_hf
    result = import_hf("hf/llama", "checkpoints/llama", ["--tensor-model-parallel-size", "2"])
    print(" ".join(result.train_flags))      # the model flags to train it with

The architecture flags come from `config.json` (flags given as well must agree); parallel and
other pretrain_gpt.py flags pass through. The checkpoint holds weights only, one file per spec
and tensor rank as DeepSpeed writes them, for the given T (any P and layout load it; a Mixtral's in
universal form, `hf_import_experts`, loaded at any P): training from it starts at iteration 0 with a
fresh optimizer and learning-rate schedule, no flag needed.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from megatron_ds import files
from megatron_ds.config import Config
from megatron_ds.data import DataError
from megatron_ds.data.tokenizer import build_tokenizer
from megatron_ds.interop import hf_architectures, hf_config, hf_config_read, hf_import_experts, hf_tokenizer, hf_weights
from megatron_ds.interop.hf_architectures import HFConfigError
from megatron_ds.interop.hf_config_read import HFModel
from megatron_ds.interop.hf_weights_reader import HFWeights, HFWeightsError
from megatron_ds.model import naming, sharding
from megatron_ds.training.checkpoint import reader as checkpoint_reader
from megatron_ds.training.checkpoint.directory import LATEST, META
from megatron_ds.training.resolve_layout import resolve_layout
from megatron_ds.training.state import TrainState

TAG = "global_step0"
MODULE_SPECS = (
    naming.WORD_EMBEDDING,
    naming.POSITION_EMBEDDING,
    naming.EMBEDDING_DROPOUT,
    naming.TRANSFORMER_LAYER,
    naming.FINAL_NORM,
    naming.UNTIED_LM_HEAD,
)
"""Specs that are modules: DeepSpeed loads a file for each (functions and the tied head have none)."""
TOKENIZER_DESTS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")
MOE_ROUTING_DESTS = (
    "moe_loss_coeff",
    "disable_moe_token_dropping",
    "disable_moe_top2_2nd_expert_sampling",
    "moe_aux_loss_coeff",
)
"""Routing flags an imported mixture of experts trains with (they shape no weight, so they are not architecture)."""


@dataclass
class ImportResult:
    output: str
    arch: str
    config: Config
    train_flags: list[str]
    """pretrain_gpt.py flags that rebuild this model (architecture, vocabulary, T, tokenizer)."""
    notes: list[str] = field(default_factory=list)
    """What the flags mean otherwise than config.json's fields, one line each."""


def read_hf_config(hf_dir: str) -> tuple[dict[str, Any], str]:
    path = os.path.join(os.path.abspath(hf_dir), "config.json")
    if not os.path.isdir(hf_dir):
        what = "a file, not a directory" if os.path.exists(hf_dir) else "no such directory"
        raise HFConfigError(f"{hf_dir}: {what}; give a Hugging Face model directory (config.json + weights)")
    if not os.path.isfile(path):
        raise HFConfigError(f"{path}: missing; give a Hugging Face model directory (config.json + weights)")
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise HFConfigError(f"{path}: not valid JSON ({err}); re-download or fix the file") from None
    if not isinstance(hf, dict):
        raise HFConfigError(f"{path}: expected a JSON object; re-download or fix the file")
    return hf, path


def config_from_hf(hf: HFModel, argv: Sequence[str], source: str, tokenizer: dict[str, str] | None) -> Config:
    """The Config pretrain_gpt.py builds from `argv` plus the HF-derived flags (the one place that maps
    an HF model onto our flags). An architecture flag in `argv` that disagrees is an error."""
    from megatron_ds.flags import notices
    from megatron_ds.flags.parser import build_parser, parse_config

    given, _ = build_parser().parse_known_args(list(argv))
    for flag, size in (
        ("--moe-expert-parallel-size", given.moe_expert_parallel_size),
        ("--expert-model-parallel-size", given.expert_model_parallel_size or 1),
    ):
        if size != 1:  # the import is one process writing every expert
            raise HFConfigError(
                f"{flag} {size}: the import writes every expert whatever size a run shares them out at; give it to "
                "pretrain_gpt.py"
            )
    values = {**hf.defaults, **hf.architecture, "vocab_size": hf.vocab_size}
    found = given.tokenizer_type is None and given.vocab_file is None and bool(tokenizer)
    if found:
        values.update(tokenizer)
    try:
        _check_tokenizer({k: values.get(k, getattr(given, k)) for k in TOKENIZER_DESTS}, hf, source)
    except DataError as err:
        if not found:
            raise
        # the tokenizer files came with the model, not from a flag: name them, not --tokenizer-model
        reason = str(err).split(": ", 1)[-1]
        raise HFConfigError(
            f"{os.path.dirname(source)}: its tokenizer files: {reason}; fix or remove them, or give the "
            f"tokenizer with --tokenizer-type / --tokenizer-model"
        ) from None
    if given.train_iters is None and given.train_samples is None and given.train_tokens is None:
        values["train_iters"] = 1  # required by the flag checks; a weights-only checkpoint does not use it
    if given.lr is None:
        values["lr"] = 1e-4  # likewise: the training run's own --lr applies
    positions = hf.architecture.get("max_position_embeddings")
    if hf.architecture.get("add_position_embedding", True) and given.seq_length and positions < given.seq_length:
        raise HFConfigError(
            f"--seq-length {given.seq_length} exceeds {source}'s max_position_embeddings {positions}, the size of "
            f"its learned position table; give --seq-length {positions} or less"
        )
    world = given.pipeline_model_parallel_size * given.tensor_model_parallel_size
    with notices.muted():  # the flags are the import's translation of config.json, not a launch
        config, args = parse_config([*hf_config_read.render_flags(values), *argv], world_size=max(world, 1))
    for dest, value in {**hf.architecture, "vocab_size": hf.vocab_size}.items():
        if dest == "max_position_embeddings" and not hf.architecture.get("add_position_embedding", True):
            continue  # rotary positions: no weight has this shape, so a longer --seq-length may raise it
        if getattr(args, dest) != value:
            flag = "--" + dest.replace("_", "-")
            raise HFConfigError(
                f"{flag} {_shown(getattr(args, dest))} contradicts {source} ({_shown(value)}); drop the flag: the "
                f"architecture comes from config.json"
            )
    return config


def _shown(value: Any) -> str:
    """A flag's value as it is typed (a list, --num-experts', space-separated)."""
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _check_tokenizer(fields: dict[str, str | None], hf: HFModel, source: str) -> None:
    """A tokenizer with more ids than the model has rows does not belong to it."""
    if not fields.get("tokenizer_type"):
        return
    tok = build_tokenizer(**fields)
    if tok.vocab_size > hf.vocab_size:
        raise HFConfigError(
            f"tokenizer {fields.get('tokenizer_model') or fields.get('vocab_file')} has {tok.vocab_size} tokens but "
            f"{source} has vocab_size {hf.vocab_size}: they do not belong together; give the model's own tokenizer"
        )


def import_hf(hf_dir: str, output: str, argv: Sequence[str] = (), show_progress: bool = True) -> ImportResult:
    """Convert `hf_dir` into our checkpoint `output` (created; never overwritten)."""
    hf_dir = os.path.abspath(hf_dir)
    raw, source = read_hf_config(hf_dir)
    hf = hf_config_read.from_hf_config(raw, source)
    config = config_from_hf(hf, argv, source, hf_tokenizer.find_hf_tokenizer(hf_dir))
    layout = resolve_layout(config)  # a layout error now, before anything is written
    weights = HFWeights(hf_dir)
    _check_weights(weights, hf, config, hf_dir)
    with files.atomic_directory(output, "output") as tmp:
        config = _copy_tokenizer(config, tmp, os.path.abspath(output))
        meta = _meta(config, layout.to_string(), hf, hf_dir)
        if config.model.is_moe:  # experts: the weights in universal form (hf_import_experts)
            meta |= hf_import_experts.converted_section(TAG, hf_dir, hf.vocab_size)
        os.makedirs(os.path.join(tmp, TAG))
        files.write_json(os.path.join(tmp, TAG, META), meta)  # first: the universal form records its fingerprint
        if config.model.is_moe:
            ckpt = checkpoint_reader.Checkpoint(tmp, TAG, meta, config)
            hf_import_experts.write_universal(weights, hf.arch, ckpt, hf_dir, show_progress)
        else:
            _write_specs(weights, hf, config, os.path.join(tmp, TAG), show_progress)
        with open(os.path.join(tmp, LATEST), "w") as f:
            f.write(TAG)
    flags = _train_flags(config, hf)
    notes = [hf_config.moe_loss_note(config.model)] if config.model.is_moe else []
    return ImportResult(os.path.abspath(output), hf.arch, config, flags, notes)


def _check_weights(weights: HFWeights, hf: HFModel, config: Config, hf_dir: str) -> None:
    # GPT2Model checkpoints (e.g. the original gpt2) name tensors without the "transformer." prefix.
    if (
        hf.arch == hf_architectures.GPT2
        and "transformer.wte.weight" not in weights.shapes
        and "wte.weight" in weights.shapes
    ):
        weights.add_prefix("transformer.")
    expected = hf_weights.hf_shapes(hf.arch, config.model, hf.vocab_size)
    for name, shape in expected.items():
        if name not in weights.shapes:
            raise HFWeightsError(f"{hf_dir}: no tensor {name}; the weights do not match config.json")
        if weights.shapes[name] != shape:
            raise HFWeightsError(
                f"{hf_dir}: tensor {name} has shape {list(weights.shapes[name])}, config.json implies {list(shape)}"
            )
    tied = not config.model.untie_embeddings_and_output_weights
    if tied and "lm_head.weight" in weights.shapes:
        (embedding,) = hf_weights.hf_names(hf.arch, naming.WORD_EMBEDDING, "weight", None)
        if not torch.equal(weights.get("lm_head.weight"), weights.get(embedding)):  # transformers keeps both then
            raise HFWeightsError(
                f"{hf_dir}: tensor lm_head.weight differs from {embedding}, but config.json ties them "
                f'(tie_word_embeddings); transformers then keeps the separate head: set "tie_word_embeddings": false '
                f"in config.json to import it as an untied head"
            )
    for name in weights.shapes:
        if name in expected or hf_weights.IGNORED_HF_TENSORS.search(name) or (tied and name == "lm_head.weight"):
            continue
        raise HFWeightsError(
            f"{hf_dir}: tensor {name} has no place in this model (config.json does not describe it); "
            f"it would be dropped, so the model would change"
        )


def _write_specs(weights: HFWeights, hf: HFModel, config: Config, step_dir: str, show_progress: bool) -> None:
    model, t = config.model, config.parallel.tensor_model_parallel_size
    groups = naming.gpt_spec_groups(model)
    bar = files.progress(len(groups.names), "import", show_progress)
    try:
        for index, spec in enumerate(groups.names):
            bar.update(1)
            if spec not in MODULE_SPECS:
                continue
            layer = groups.layer_of(index)
            states: list[dict[str, Any]] = [{} for _ in range(t)]
            for key, rule in sharding.spec_tensors(model, spec).items():
                full = hf_weights.read_ours(hf.arch, spec, key, layer, rule, weights.get, model.vocab_size)
                for state, piece in zip(states, sharding.split(rule, full, t)):
                    state[key] = piece
            for state in states:
                state.update(dict.fromkeys(sharding.extra_state_keys(spec, t)))
            for rank, state in enumerate(states):
                torch.save(state, checkpoint_reader.layer_file(step_dir, index, rank))
    finally:
        bar.close()


def _copy_tokenizer(config: Config, tmp: str, final_root: str) -> Config:
    """Copy the tokenizer files into `<checkpoint>/tokenizer/` and point the config at them; the Hugging Face
    tokenizer files beside them go too, for the export to write back (`hf_tokenizer.hf_files_beside`). A tokenizer
    that is a directory (HuggingFaceTokenizer, HFTokenizer) becomes `<checkpoint>/tokenizer/` itself: its Hugging
    Face tokenizer files, not the model's weights beside them."""
    data, moved = config.data, {}
    dests = [d for d in ("tokenizer_model", "vocab_file", "merge_file") if getattr(data, d)]
    paths = [getattr(data, d) for d in dests]
    file_paths = [p for p in paths if not os.path.isdir(p)]
    copied = [*file_paths, *hf_tokenizer.hf_files_beside(file_paths)]
    copied += [os.path.join(p, name) for p in paths if os.path.isdir(p) for name in hf_tokenizer.hf_directory_files(p)]
    target = os.path.join(tmp, checkpoint_reader.TOKENIZER_DIR)
    for path in dict.fromkeys(copied):
        os.makedirs(target, exist_ok=True)
        shutil.copyfile(path, os.path.join(target, os.path.basename(path)))
    final = os.path.join(final_root, checkpoint_reader.TOKENIZER_DIR)
    for dest, path in zip(dests, paths):
        moved[f"data__{dest}"] = final if os.path.isdir(path) else os.path.join(final, os.path.basename(path))
    return config.replace(**moved) if moved else config


def _meta(config: Config, layout: str, hf: HFModel, hf_dir: str) -> dict[str, Any]:
    par = config.parallel
    return {
        "config": config.to_dict(),
        "train_state": asdict(TrainState()),
        "layout": layout,
        "world_size": par.pipeline_model_parallel_size * par.tensor_model_parallel_size * par.data_parallel_size,
        "format": 1,
        "weights_only": True,
        "hf": {"arch": hf.arch, "vocab_size": hf.vocab_size, "source": hf_dir},
    }


def _train_flags(config: Config, hf: HFModel) -> list[str]:
    values = {
        **hf.architecture,
        "max_position_embeddings": config.model.max_position_embeddings,  # a rotary model's may be raised
        "vocab_size": hf.vocab_size,
        "make_vocab_size_divisible_by": config.data.make_vocab_size_divisible_by,
        "tensor_model_parallel_size": config.parallel.tensor_model_parallel_size,
    }
    if config.model.is_moe:  # the routing that computes the Hugging Face model (hf_config_experts' from_mixtral, ...)
        values.update({k: v for k, v in hf.defaults.items() if k in MOE_ROUTING_DESTS})
    values.update({k: getattr(config.data, k) for k in TOKENIZER_DESTS if getattr(config.data, k)})
    return hf_config_read.render_flags(values)
