"""A small, deterministic training run used by the multi-rank tests and benchmarks.

`python -m megatron_ds.testing.scenario SPEC.json OUT_DIR` (one process per rank) runs each
scenario in SPEC in sequence inside one process group (start-up is paid once), training a tiny
GPT on seeded synthetic tokens, and writes per-rank results to OUT_DIR/rank<r>.json: per-step
losses and gradient norms, and the word-embedding matrix's checksum on the ranks that hold it.

Optional scenario keys (all off by default):
    loss_mask       "partial" masks every fourth token out of the loss ("ones" by default)
    init_checksums  true: record checksums of every parameter's full (tensor-gathered) initial value
    layout          build_layout keyword arguments ({"dedicated": "both"}); without it, the layout
                    options of the config (`parallel__pp_partition_method`, ...) decide
    save / load     a checkpoint directory to save to after the steps / resume from before them
                    (training then continues at the checkpoint's iteration; a checkpoint saved under
                    another P, layout, T, DP, ZeRO stage or precision resumes through the universal form)
    expect_error    true: an exception while loading is recorded as "error" instead of raised
    checksums       true: record checksums of every parameter's full value after loading
                    ("checksums_loaded") and after the steps ("checksums_trained")
    unfixed         names from `megatron_ds.testing.defects.UNFIXED` ("group_placeholders",
                    "norm_marking", "counted_fp32_clip", "preflight"): build with those fixes of
                    stock DeepSpeed's defects off, to show the defects and that the guards catch them
    swapped_axes    true (T > 1): record the error the start-up group check gives for a topology
                    with the tensor and data axes swapped, as "topology_error"
    ds_config       DeepSpeed keys merged into the generated JSON (`build_pipeline(ds_config=...)`), e.g.
                    ZeRO-3's `stage3_param_persistence_threshold` 0 so that a tiny model is partitioned
    rank_overrides  {"RANK": {override: value}}: that rank alone builds with these overrides too (ranks
                    launched with different flags, which the preflight agreement check must refuse)
    expect_build_error  true: an exception while building is recorded as "build_error" (the scenario
                    ends there)
    eval            true: after every training step, an `eval_batch` over that step's micro-batches, its losses
                    recorded as "eval_losses" (evaluation forwards between training steps)
    weights         true: record every parameter's value after the steps ("weights": name -> nested lists; at T > 1
                    the full values, gathered over the tensor group), local experts under their global names (`model.moe.global_named_parameters`), and --log-params-norm's
                    "params_norm" (`training.grad_norm.params_norm`, a collective)
    eval_logits     token ids (b, s) (a plain engine's model): after the steps, the logits the model computes for them
                    in eval mode ("eval_logits"; its MoE layers' collectives run on every rank, give each the same ids)
    output_shapes   true: record the shape of what this stage's module returns in its first training
                    forward ("output_shape": what it sends on, e.g. (s/T, b, h) under sequence parallelism)
    report_new_modules  true: record the modules this rank imported since it started, as "new_modules" (what a
                    test launcher's preload, `testing.zygote.RUN_PRELOAD`, left to each rank)

Under --log-num-zeros-in-grad (`logging__log_num_zeros_in_grad`) each step's count is recorded as "num_zeros".
Under --kd (`distillation__kd` and `distillation__load_teacher` overrides) each step's "other_losses" ({"kd loss":
...}) are recorded too. Every result also records "layout_table" (the layout printout with spec names), the keys of the
model's "tied_modules" and "tied_comms" (empty for an untied head), the "engine" class, and the
model's parameter "elements" on this tensor rank with the "held_elements" this rank keeps (fewer under
ZeRO-3, which partitions them), and how deepspeed.checkpointing is configured ("checkpointing").
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import torch

from megatron_ds.config import (
    Config,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RegularizationConfig,
    TrainingConfig,
)
from megatron_ds.model import naming


def tiny_config(**overrides: Any) -> Config:
    """A GPT small enough for CPU tests; `section__field=value` overrides."""
    model = ModelConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        seq_length=16,
        max_position_embeddings=16,
        vocab_size=128,
    )
    cfg = Config(
        model=model,
        regularization=RegularizationConfig(hidden_dropout=0.0, attention_dropout=0.0),
        parallel=ParallelConfig(),
        # Adam's eps 1e-6, not 1e-8: with 1e-8 a gradient element near zero (1e-9) takes a step of a tenth of the
        # learning rate in the direction of its rounding noise, so equal runs differ by what their fp32 kernels round
        # (1.2e-6 on the third step of the Llama case at T=2 on an AVX-512 CPU, 2e-7 with 1e-6)
        optimizer=OptimizerConfig(lr=1e-2, clip_grad=0.05, weight_decay=0.1, adam_eps=1e-6),
        training=TrainingConfig(micro_batch_size=2, global_batch_size=8, seed=1234),
    )
    return cfg.replace(**overrides)


def synthetic_sample(seed: int, index: int, seq_length: int, vocab_size: int) -> torch.Tensor:
    """Sample `index` of a seeded token stream: seq_length + 1 token ids (input + shifted labels)."""
    gen = torch.Generator().manual_seed(seed * 7919 + index)
    return torch.randint(0, vocab_size, (seq_length + 1,), generator=gen)


def micro_batches(config: Config, step: int, dp_rank: int, loss_mask: str = "ones"):
    """Yield ((tokens,), (labels, loss_mask)) micro-batches of `step` for data-parallel rank `dp_rank` (with packed
    documents ((tokens, position_ids, document_ids), ...): `packed_documents`).

    Megatron's sampler order: micro-batch j of rank d holds samples (j * dp + d) * mbs + [0, mbs).
    `loss_mask="partial"` zeroes the mask on every fourth token (offset by sample).
    """
    t, m = config.training, config.model
    dp = config.parallel.data_parallel_size
    base = step * t.global_batch_size
    for j in range(config.grad_accumulation_steps):
        first = base + (j * dp + dp_rank) * t.micro_batch_size
        rows = torch.stack(
            [synthetic_sample(t.seed, first + i, m.seq_length, m.vocab_size) for i in range(t.micro_batch_size)]
        )
        mask = torch.ones(rows.shape[0], m.seq_length)
        if loss_mask == "partial":
            sample = first + torch.arange(rows.shape[0]).unsqueeze(1)
            mask[(sample + torch.arange(m.seq_length)) % 4 == 0] = 0.0
        documents = packed_documents(config)
        if documents is None:
            yield rows[:, :-1].contiguous(), (rows[:, 1:].contiguous(), mask)
            continue
        sample = first + torch.arange(rows.shape[0]).unsqueeze(1)
        rows[(sample * 3 + torch.arange(m.seq_length + 1)) % 5 == 0] = documents.eod  # documents of 5 tokens
        yield next(documents.batches(iter([(rows[:, :-1].contiguous(), (rows[:, 1:].contiguous(), mask))])))


def packed_documents(config: Config):  # noqa: ANN201 - data.packed_documents.PackedDocuments | None
    """Under the config's `--reset-position-ids` / `--reset-attention-mask`: the samples hold documents of five
    tokens (the NullTokenizer's eod, the last id, every fifth token, offset by sample), and the micro-batches carry
    (tokens, position_ids, document_ids) as the loop's data reader makes them."""
    from megatron_ds.data.packed_documents import PackedDocuments

    d = config.data
    if not (d.reset_position_ids or d.reset_attention_mask):
        return None
    return PackedDocuments(config.model.vocab_size - 1, d.reset_position_ids, d.reset_attention_mask)


def checksum(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def run_one(
    config: Config, num_steps: int, layout_kwargs: dict[str, Any], options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Train `num_steps` steps; return what the tests compare. `options`: see the module docstring."""
    import torch.distributed as dist

    from megatron_ds.pipeline.layout import build_layout
    from megatron_ds.testing.defects import unfixed
    from megatron_ds.training.builder import build_pipeline
    from megatron_ds.training.checkpoint import save_load
    from megatron_ds.training.resolve_layout import resolve_layout
    from megatron_ds.training.state import TrainState

    opts = options or {}
    groups = naming.gpt_spec_groups(config.model)
    if layout_kwargs:
        par = config.parallel
        layout = build_layout(
            groups, par.pipeline_model_parallel_size, virtual_stages=par.virtual_stages, **layout_kwargs
        )
    else:
        layout = resolve_layout(config)
    try:
        with unfixed(opts.get("unfixed", [])):
            pipeline = build_pipeline(config, layout=layout, ds_config=opts.get("ds_config"))
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge
        if not opts.get("expect_build_error"):
            raise
        return {"rank": dist.get_rank(), "build_error": f"{type(e).__name__}: {e}"}
    engine = pipeline.engine
    tp = pipeline.model.tensor_parallel
    result = _built(pipeline, layout)
    if opts.get("swapped_axes"):
        result["topology_error"] = _swapped_axes_error(config)
    if opts.get("init_checksums"):
        sums = full_parameter_checksums(pipeline.model)
        if tp.rank == 0:
            result["init_checksums"] = sums
    state = TrainState()
    if opts.get("load"):
        try:
            state = save_load.load(engine, config, layout, opts["load"]) or state
        except Exception as e:  # noqa: BLE001 - recorded for the test to judge
            if not opts.get("expect_error"):
                raise
            result["error"] = f"{type(e).__name__}: {e}"
            return result
    if opts.get("checksums"):
        _record_checksums(result, "checksums_loaded", pipeline.model)
    if opts.get("output_shapes"):
        _record_output_shape(result, pipeline.model)
    emb_before = _embedding(pipeline.model)
    _train(result, pipeline, config, range(state.iteration, state.iteration + num_steps), opts)
    if opts.get("checksums"):
        _record_checksums(result, "checksums_trained", pipeline.model)
    if opts.get("weights"):
        _record_weights(result, pipeline)
    if opts.get("eval_logits"):
        result["eval_logits"] = _eval_logits(pipeline.model, opts["eval_logits"])
    if opts.get("save"):
        done = TrainState(
            iteration=state.iteration + num_steps,
            consumed_train_samples=(state.iteration + num_steps) * config.training.global_batch_size,
        )
        save_load.save(engine, config, layout, done, opts["save"])
    emb_after = _embedding(pipeline.model)
    result["checkpointing"] = _checkpointing_state()
    store = getattr(engine, "weight_grads", None)
    result["deferred_weight_grads"] = 0 if store is None else store.deferred
    if emb_after is not None:
        result["embedding_checksum"] = checksum(emb_after)
        result["embedding_changed"] = bool(not torch.equal(emb_before, emb_after))
    return result


def _built(pipeline: Any, layout: Any) -> dict[str, Any]:
    """What the build gave this rank: its place, the layout, the tied modules and the elements it holds."""
    import torch.distributed as dist

    return {
        "rank": dist.get_rank(),
        "stage": pipeline.engine.stage_id,
        "tp_rank": pipeline.model.tensor_parallel.rank,
        "layout": layout.to_string(),
        "layout_table": layout.format(),
        "tied_modules": sorted(getattr(pipeline.model, "tied_modules", {})),
        "tied_comms": sorted(getattr(pipeline.model, "tied_comms", {})),
        "engine": type(pipeline.engine).__name__,
        **_held_elements(pipeline.model),
    }


def _train(result: dict[str, Any], pipeline: Any, config: Config, steps: range, opts: dict[str, Any]) -> None:
    """Train `steps` on the scenario's batches, recording each step's loss, gradient norm, other losses, ZeRO's
    zero count (when counted) and evaluation loss (`eval`)."""
    engine = pipeline.engine
    zeros = _zero_counter(config, engine)
    losses, norms, others, num_zeros = [], [], [], []
    dp_rank = engine.grid.get_data_parallel_rank()
    for step in steps:
        batches = list(micro_batches(config, step, dp_rank, opts.get("loss_mask", "ones")))
        loss = pipeline.train_batch(iter(batches), label=f"train_batch of step {step}")
        losses.append(float(loss.item()))
        norms.append(pipeline.grad_norm())
        others.append({k: float(v.item()) for k, v in getattr(engine, "step_losses", {}).items()})
        if zeros is not None:
            num_zeros.append(zeros.total())
        if opts.get("eval"):
            result.setdefault("eval_losses", []).append(float(engine.eval_batch(data_iter=iter(batches)).item()))
    result.update({"losses": losses, "grad_norms": norms})
    if zeros is not None:
        result["num_zeros"] = num_zeros
    if any(others):  # the losses beside the lm loss (`moe loss` with experts, `kd loss` under --kd), per step
        result["other_losses"] = others


def _record_weights(result: dict[str, Any], pipeline: Any) -> None:
    """Every parameter's full (T = 1) values by its global name, and the parameters' norm."""
    from megatron_ds.model.moe import global_named_parameters
    from megatron_ds.training.grad_norm import params_norm

    tp = pipeline.model.tensor_parallel
    named = global_named_parameters(pipeline.model).items()
    if tp.size > 1:  # gathered over the tensor group (a collective)
        from megatron_ds.model.tensor_parallel_layers import gather_full

        named = [(n, gather_full(p, tp)) for n, p in named]
    result["weights"] = {n: p.detach().float().cpu().tolist() for n, p in named}
    result["params_norm"] = params_norm(pipeline.engine)


def _eval_logits(model: torch.nn.Module, tokens: list[list[int]]) -> list:
    """The logits (b, s, v) of `tokens` from the plain engine's model in eval mode, left in train mode after."""
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor(tokens, dtype=torch.long))
    model.train()
    return logits.float().tolist()


def _zero_counter(config: Config, engine: Any) -> Any:
    """--log-num-zeros-in-grad's counter on `engine` (as the training loop's step hooks install it), or None."""
    if not config.logging.log_num_zeros_in_grad:
        return None
    from megatron_ds.training.grad_norm import ZeroCounter

    return ZeroCounter(engine)


def _checkpointing_state() -> dict[str, Any]:
    """How deepspeed.checkpointing is configured in this process (`training.activation_checkpointing`)."""
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds

    return {
        "partition_activations": ds.PARTITION_ACTIVATIONS,
        "contiguous_checkpointing": ds.CONTIGUOUS_CHECKPOINTING,
        "checkpoint_in_cpu": ds.CPU_CHECKPOINT,
        "synchronize": ds.SYNCHRONIZE,
        "profile": ds.PROFILE_TIME,
        "num_checkpoints": ds.num_layers,
        "partition_size": ds.mp_size,
    }


def _record_output_shape(result: dict[str, Any], model: torch.nn.Module) -> None:
    def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
        if "output_shape" not in result and isinstance(out, torch.Tensor):
            result["output_shape"] = list(out.shape)

    model.register_forward_hook(hook)


def _record_checksums(result: dict[str, Any], key: str, model: torch.nn.Module) -> None:
    sums = full_parameter_checksums(model)  # collective over the tensor-parallel group
    if model.tensor_parallel.rank == 0:
        result[key] = sums


def _held_elements(model: torch.nn.Module) -> dict[str, int]:
    """The model's parameter elements on this tensor rank, and those this rank holds (its ZeRO-3 partitions)."""
    from megatron_ds.model.gpt_model import is_partitioned

    params = list(model.parameters())
    full = sum(int(getattr(p, "ds_numel", p.numel())) for p in params)
    held = sum(int(p.ds_tensor.numel()) if is_partitioned(p) else p.numel() for p in params)
    return {"elements": full, "held_elements": held}


def _swapped_axes_error(config: Config) -> str:
    from deepspeed.runtime.pipe.topology import ProcessTopology

    from megatron_ds.model.tensor_parallel_layers import TensorParallelSetupError, check_groups_match

    par = config.parallel
    swapped = ProcessTopology(
        axes=["pipe", "model", "data"],
        dims=[par.pipeline_model_parallel_size, par.tensor_model_parallel_size, par.data_parallel_size],
    )
    try:
        check_groups_match(swapped)
    except TensorParallelSetupError as e:
        return str(e)
    return ""


def full_parameter_checksums(model: torch.nn.Module) -> dict[str, str]:
    """Checksum of every parameter's full value (gathered over tensor ranks), keyed by its name.

    Names hold the spec index ("3.qkv.weight"), so they compare across layouts and T.
    A collective over the tensor group at T > 1.
    """
    from megatron_ds.model.gpt_model import gathered
    from megatron_ds.training.optimizer import GROUP_PLACEHOLDER_PREFIX

    tp = model.tensor_parallel
    sums = {}
    for name, p in model.named_parameters():
        if name.startswith(GROUP_PLACEHOLDER_PREFIX):
            continue
        with gathered([p]):
            if tp.size > 1:
                from megatron_ds.model.tensor_parallel_layers import gather_full

                p = gather_full(p, tp)
            sums[name] = checksum(p)
    return sums


def _embedding(model: torch.nn.Module) -> torch.Tensor | None:
    from megatron_ds.model.gpt_model import gathered

    tied = getattr(model, "tied_modules", {})
    if naming.TIED_EMBEDDING_KEY in tied:
        with gathered(tied[naming.TIED_EMBEDDING_KEY]):
            return tied[naming.TIED_EMBEDDING_KEY].weight.detach().float().clone()
    return None


def main(spec_path: str, out_dir: str) -> None:
    from megatron_ds.distributed import env_world_size, init_distributed, shutdown_distributed
    from megatron_ds.training.preflight import install_stack_dump_handler

    install_stack_dump_handler()
    with open(spec_path) as f:
        spec = json.load(f)
    results = []
    imported_before = set(sys.modules)
    clean = False
    try:
        for sc in spec["scenarios"]:
            overrides = dict(sc.get("overrides", {}))
            overrides.update(sc.get("rank_overrides", {}).get(os.environ.get("RANK", "0"), {}))
            cfg = tiny_config(**overrides)
            cfg = cfg.replace(parallel__world_size=env_world_size())
            init_distributed(cfg.parallel)
            results.append(run_one(cfg, sc.get("steps", 3), sc.get("layout", {}), options=sc))
            if sc.get("report_new_modules"):
                results[-1]["new_modules"] = sorted(set(sys.modules) - imported_before)
        clean = True
    finally:
        shutdown_distributed(clean=clean)
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    from megatron_ds.distributed import run_and_exit

    run_and_exit(main, sys.argv[1], sys.argv[2])
