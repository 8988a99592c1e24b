"""A small, deterministic training run used by the multi-rank tests and benchmarks.

`python -m megatron_ds.testing.scenario SPEC.json OUT_DIR` (one process per rank) runs each
scenario in SPEC in sequence inside one process group (start-up is paid once), training a tiny
GPT on seeded synthetic tokens, and writes per-rank results to OUT_DIR/rank<r>.json: per-step
losses and gradient norms, and the word-embedding matrix's checksum on the ranks that hold it.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import torch

from megatron_ds.config import Config, ModelConfig, OptimizerConfig, ParallelConfig, TrainingConfig
from megatron_ds.model import naming


def tiny_config(**overrides: Any) -> Config:
    """A GPT small enough for CPU tests; `section__field=value` overrides."""
    model = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                        seq_length=16, max_position_embeddings=16, vocab_size=128,
                        hidden_dropout=0.0, attention_dropout=0.0)
    cfg = Config(model=model, parallel=ParallelConfig(),
                 optimizer=OptimizerConfig(lr=1e-2, clip_grad=0.05, weight_decay=0.1),
                 training=TrainingConfig(micro_batch_size=2, global_batch_size=8, seed=1234))
    return cfg.replace(**overrides)


def synthetic_sample(seed: int, index: int, seq_length: int, vocab_size: int) -> torch.Tensor:
    """Sample `index` of a seeded token stream: seq_length + 1 token ids (input + shifted labels)."""
    gen = torch.Generator().manual_seed(seed * 7919 + index)
    return torch.randint(0, vocab_size, (seq_length + 1,), generator=gen)


def micro_batches(config: Config, step: int, dp_rank: int):
    """Yield ((tokens,), (labels, loss_mask)) micro-batches of `step` for data-parallel rank `dp_rank`.

    Megatron's sampler order: micro-batch j of rank d holds samples (j * dp + d) * mbs + [0, mbs).
    """
    t, m = config.training, config.model
    dp = config.parallel.data_parallel_size
    base = step * t.global_batch_size
    for j in range(config.grad_accumulation_steps):
        first = base + (j * dp + dp_rank) * t.micro_batch_size
        rows = torch.stack([synthetic_sample(t.seed, first + i, m.seq_length, m.vocab_size)
                            for i in range(t.micro_batch_size)])
        yield rows[:, :-1].contiguous(), (rows[:, 1:].contiguous(), torch.ones(rows.shape[0], m.seq_length))


def checksum(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def run_one(config: Config, num_steps: int, layout_kwargs: dict[str, Any], fixes: bool = True,
            preflight: bool = True) -> dict[str, Any]:
    """Train `num_steps` steps; return what the tests compare."""
    import torch.distributed as dist

    from megatron_ds.pipeline.layout import build_layout
    from megatron_ds.training.engine import build_engine, grad_norm
    from megatron_ds.training.preflight import Watchdog

    groups = naming.gpt_spec_groups(config.model)
    layout = build_layout(groups, config.parallel.pipeline_model_parallel_size, **layout_kwargs)
    bundle = build_engine(config, layout, preflight=preflight, fixes=fixes)
    engine = bundle.engine
    watchdog = Watchdog(config.parallel.distributed_timeout_minutes * 60, dist.get_rank(), engine.stage_id)
    emb_before = _embedding(bundle.model)
    losses, norms = [], []
    dp_rank = engine.grid.get_data_parallel_rank()
    for step in range(num_steps):
        with watchdog.watch(f"train_batch of step {step}"):
            loss = engine.train_batch(data_iter=iter(list(micro_batches(config, step, dp_rank))))
        losses.append(float(loss.item()))
        norms.append(grad_norm(engine))
    emb_after = _embedding(bundle.model)
    result = {"rank": dist.get_rank(), "stage": engine.stage_id, "losses": losses, "grad_norms": norms,
              "layout": layout.to_string()}
    if emb_after is not None:
        result["embedding_checksum"] = checksum(emb_after)
        result["embedding_changed"] = bool(not torch.equal(emb_before, emb_after))
    return result


def _embedding(model: torch.nn.Module) -> torch.Tensor | None:
    tied = getattr(model, "tied_modules", {})
    if naming.TIED_EMBEDDING_KEY in tied:
        return tied[naming.TIED_EMBEDDING_KEY].weight.detach().float().clone()
    return None


def main(spec_path: str, out_dir: str) -> None:
    from megatron_ds.distributed import env_world_size, init_distributed
    from megatron_ds.training.preflight import install_stack_dump_handler

    install_stack_dump_handler()
    with open(spec_path) as f:
        spec = json.load(f)
    results = []
    for sc in spec["scenarios"]:
        overrides = dict(sc.get("overrides", {}))
        cfg = tiny_config(**overrides)
        p, tp = cfg.parallel.pipeline_model_parallel_size, cfg.parallel.tensor_model_parallel_size
        cfg = cfg.replace(parallel__data_parallel_size=env_world_size() // (p * tp))
        init_distributed(cfg.parallel)
        results.append(run_one(cfg, sc.get("steps", 3), sc.get("layout", {}), fixes=sc.get("fixes", True),
                               preflight=sc.get("preflight", True)))
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
