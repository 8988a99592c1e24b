"""The Megatron-LM checkpoint fixture's mixture of experts (`testing.megatron_lm_checkpoints`, line "mixtral": 2 layers
of 4 SwiGLU experts, top-2, on two expert-parallel gloo ranks), written by megatron-core 0.16.1 in both formats.

* `torch`: one file per expert rank (`mp_rank_00_000`, `mp_rank_00_001`), each with its own two experts numbered
  from 0 (`local_experts.0`, `.1`), the router and the rest replicated; the experts drawn differently on each rank.
* `torch_dist`: every tensor is the `torch` files' under its global name (`decoder.layers.mlp.experts.experts.
  linear_fc1.weight` [layer, global expert, 2 x ffn, hidden], expert e = rank e // 2's local e % 2).
* The torch_dist checkpoint loads back into a fresh megatron-core model (`dist_checkpointing.load`) at EP=2 and,
  resharded, at EP=1, which compute the fixture's logits.

Run as a script, this file is the per-rank worker of the last test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatron_ds.testing.megatron_lm_checkpoints import namespace, recorded, write_checkpoints

ITERATION = 2
EXPERTS, LOCAL, LAYERS, HIDDEN, FFN = 4, 2, 2, 32, 48


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("mixtral")
    return root, write_checkpoints("mixtral", {f: str(root / f) for f in ("torch_dist", "torch")}, ITERATION)


def _torch_files(root: Path) -> list[dict[str, torch.Tensor]]:
    step = root / "torch" / f"iter_{ITERATION:07d}"
    assert sorted(p.name for p in step.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    files = [torch.load(step / f"mp_rank_00_{ep:03d}" / "model_optim_rng.pt", weights_only=False) for ep in range(2)]
    assert [f["args"].expert_model_parallel_size for f in files] == [2, 2]
    return [{k: v for k, v in f["model"].items() if torch.is_tensor(v)} for f in files]


def test_torch_files_hold_each_expert_ranks_experts_numbered_from_zero(saved) -> None:
    files = _torch_files(saved[0])
    expert = "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc{}.weight"
    for layer in range(LAYERS):
        assert files[0][f"decoder.layers.{layer}.mlp.router.weight"].shape == (EXPERTS, HIDDEN)
        assert files[0][f"decoder.layers.{layer}.pre_mlp_layernorm.weight"].shape == (HIDDEN,)
        for i in range(LOCAL):
            assert files[0][expert.format(layer, i, 1)].shape == (2 * FFN, HIDDEN)  # [gate; up] of SwiGLU
            assert files[0][expert.format(layer, i, 2)].shape == (HIDDEN, FFN)
            assert not torch.equal(files[0][expert.format(layer, i, 1)], files[1][expert.format(layer, i, 1)])
    assert set(files[0]) == set(files[1])
    assert not [k for k in files[0] if ".local_experts.2." in k]
    shared = [k for k in files[0] if "local_experts" not in k]
    assert all(torch.equal(files[0][k], files[1][k]) for k in shared)


def test_torch_dist_holds_the_same_tensors_under_global_expert_numbers(saved) -> None:
    from torch.distributed.checkpoint import FileSystemReader, load

    files = _torch_files(saved[0])
    step = saved[0] / "torch_dist" / f"iter_{ITERATION:07d}"
    metadata = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    stacked = "decoder.layers.mlp.experts.experts.linear_fc{}.weight"
    names = {
        "router": "decoder.layers.mlp.router.weight",
        "pre_mlp_norm": "decoder.layers.mlp.linear_fc1.layer_norm_weight",  # megatron-core's TE-compatible name
        "fc1": stacked.format(1),
        "fc2": stacked.format(2),
    }
    shapes = {
        "router": (LAYERS, EXPERTS, HIDDEN),
        "pre_mlp_norm": (LAYERS, HIDDEN),
        "fc1": (LAYERS, EXPERTS, 2 * FFN, HIDDEN),
        "fc2": (LAYERS, EXPERTS, HIDDEN, FFN),
    }
    assert {k: tuple(metadata[n].size) for k, n in names.items()} == shapes
    # SwiGLU's fc1 is saved in two chunks along its rows (gate, then up: each row range [0, FFN) and [FFN, 2 FFN))
    assert {c.offsets[2] for c in metadata[names["fc1"]].chunks} == {0, FFN}
    state = {n: torch.empty(shapes[k]) for k, n in names.items()}
    load(state, checkpoint_id=str(step), no_dist=True)
    for layer in range(LAYERS):
        assert torch.equal(state[names["router"]][layer], files[0][f"decoder.layers.{layer}.mlp.router.weight"])
        norm = files[0][f"decoder.layers.{layer}.pre_mlp_layernorm.weight"]
        assert torch.equal(state[names["pre_mlp_norm"]][layer], norm)
        for e in range(EXPERTS):
            for fc in (1, 2):
                local = files[e // LOCAL][
                    f"decoder.layers.{layer}.mlp.experts.local_experts.{e % LOCAL}.linear_fc{fc}.weight"
                ]
                assert torch.equal(state[stacked.format(fc)][layer, e], local), (layer, e, fc)


@pytest.mark.parametrize("ep", [2, 1])
def test_torch_dist_loads_into_a_fresh_model_that_computes_the_logits(saved, tmp_path: Path, ep: int) -> None:
    from megatron_ds.testing.launch import run_ranks
    from megatron_ds.testing.zygote import RUN_PRELOAD

    out = tmp_path / "logits.pt"
    step = saved[0] / "torch_dist" / f"iter_{ITERATION:07d}"
    run_ranks(
        [__file__, str(step), str(ep), str(out)], ep, timeout=120, preload=RUN_PRELOAD, env={"TORCHDYNAMO_DISABLE": "1"}
    )
    torch.testing.assert_close(torch.load(out, weights_only=True), saved[1]["logits"], rtol=0, atol=1e-5)


def _load_and_run(step: str, ep: int, out: str) -> None:
    """A fresh model (other seeds) at `ep` expert ranks, loaded from `step`; its logits on TOKENS into `out`."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    from megatron_ds.testing.megatron_lm_model import build_model, cpu_shims
    from megatron_ds.testing.megatron_lm_ranks import reference_logits

    dist.init_process_group("gloo")
    a = namespace(recorded("mixtral")["args"])
    a.expert_model_parallel_size, a.seed = ep, a.seed + 1
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    cpu_shims(a.seed, 0)
    torch.manual_seed(a.seed)
    model = build_model(a)
    model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, step)["model"])
    logits = reference_logits(model, a)
    if dist.get_rank() == 0:
        torch.save(logits, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    _load_and_run(sys.argv[1], int(sys.argv[2]), sys.argv[3])
