"""Placing parameters in the distributed optimizer's dp_reshardable buckets (`interop.megatron_lm_buckets`),
on distributed checkpoints written here by torch: buckets laid out as megatron-core's buffer lays them out
(reverse order, starts padded to 64 elements, garbage in the padding), and the ways a bucket fails to place."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_ds.interop.megatron_lm_buckets import DistBuckets, Piece, PlacementError, optimizer_step, place
from megatron_ds.interop.megatron_lm_files import DistTensors

BUCKET = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0"
STATES = ("param", "exp_avg", "exp_avg_sq")


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embedding.word_embeddings.weight": torch.randn(16, 8, generator=g).bfloat16(),
        "decoder.final_layernorm.weight": (1 + 0.01 * torch.randn(8, generator=g)).bfloat16(),
        "output_layer.weight": torch.randn(16, 8, generator=g).bfloat16(),
    }


def _bucket(model: dict[str, torch.Tensor], masters: dict[str, torch.Tensor], order: list[str], tail: int = 0):
    """Each state's flat bucket: `order`'s tensors at 64-aligned starts, NaN in the padding; the
    moments are the master's index offsets so each element is identifiable."""
    starts, position = {}, 0
    for key in order:
        starts[key] = position
        position = -(-(position + model[key].numel()) // 64) * 64
    end = starts[order[-1]] + model[order[-1]].numel() + tail
    flat = {s: torch.full((end,), float("nan")) for s in STATES}
    for key in order:
        n, at = model[key].numel(), starts[key]
        flat["param"][at : at + n] = masters[key].reshape(-1)
        flat["exp_avg"][at : at + n] = torch.arange(n) + 1000.0 * order.index(key)
        flat["exp_avg_sq"][at : at + n] = torch.arange(n) * 2.0
    return flat


def _save(tmp_path: Path, model: dict[str, torch.Tensor], flat: dict[str, torch.Tensor]) -> DistTensors:
    state = dict(model) | {f"{BUCKET}.{s}": t for s, t in flat.items()}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    return DistTensors(str(tmp_path))


def _masters(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp32 masters that round to the bf16 weights (not the weights widened)."""
    return {k: v.float() + v.float().abs() * 2.0**-12 for k, v in model.items()}


def test_parameters_are_found_in_reverse_order_with_padding(tmp_path: Path) -> None:
    model = _model()
    masters = _masters(model)
    order = ["output_layer.weight", "decoder.final_layernorm.weight", "embedding.word_embeddings.weight"]
    dist = _save(tmp_path, model, _bucket(model, masters, order))
    states = DistBuckets(dist, sorted(model), swiglu=False)
    assert {p.key: w.start for p, w in states.placed.items()} == {order[0]: 0, order[1]: 128, order[2]: 192}
    for key, weight in model.items():
        torch.testing.assert_close(states.read(key, "param"), masters[key], rtol=0, atol=0)
        moment = states.read(key, "exp_avg").reshape(-1)
        assert torch.equal(moment, torch.arange(weight.numel()) + 1000.0 * order.index(key))


def test_a_master_that_is_not_its_weight_is_refused(tmp_path: Path) -> None:
    model = _model()
    masters = _masters(model)
    masters["decoder.final_layernorm.weight"] = masters["decoder.final_layernorm.weight"] + 0.5
    order = ["output_layer.weight", "decoder.final_layernorm.weight", "embedding.word_embeddings.weight"]
    dist = _save(tmp_path, model, _bucket(model, masters, order))
    with pytest.raises(
        PlacementError, match=r"bucket_idx_0: no model tensor's weights equal its fp32 master weights at element 128$"
    ):
        DistBuckets(dist, sorted(model), swiglu=False)


def test_tensors_with_equal_values_are_ambiguous(tmp_path: Path) -> None:
    model = _model()
    model["output_layer.weight"] = model["embedding.word_embeddings.weight"].clone()
    order = ["output_layer.weight", "decoder.final_layernorm.weight", "embedding.word_embeddings.weight"]
    dist = _save(tmp_path, model, _bucket(model, _masters(model), order))
    with pytest.raises(
        PlacementError, match=r"2 model tensors' \(embedding.word_embeddings.weight, output_layer.weight\)"
    ):
        DistBuckets(dist, sorted(model), swiglu=False)


def test_a_bucket_longer_than_its_parameters_is_refused(tmp_path: Path) -> None:
    model = _model()
    order = ["output_layer.weight", "decoder.final_layernorm.weight", "embedding.word_embeddings.weight"]
    dist = _save(tmp_path, model, _bucket(model, _masters(model), order, tail=64))
    with pytest.raises(PlacementError, match="no model tensor's weights equal its fp32 master weights at element 320"):
        DistBuckets(dist, sorted(model), swiglu=False)


def test_a_tensor_in_no_bucket_is_refused(tmp_path: Path) -> None:
    model = _model()
    order = ["output_layer.weight", "embedding.word_embeddings.weight"]
    dist = _save(tmp_path, model, _bucket(model, _masters(model), order))
    with pytest.raises(PlacementError, match="no buffer holds the optimizer state of decoder.final_layernorm.weight"):
        DistBuckets(dist, sorted(model), swiglu=False)


def test_swiglu_fc1_is_its_gate_and_up_chunks_together(tmp_path: Path) -> None:
    """Under T = 2 a rank's fc1 parameter is [its gate rows; its up rows], stored as two chunks of the
    [all gate; all up] tensor: each rank's bucket holds its pair, and the moments read back in stored order."""
    g = torch.Generator().manual_seed(1)
    full = torch.randn(1, 8, 4, generator=g)  # one layer; 2F = 8 rows (F = 4), H = 4; 2 rows per rank and half
    key = "decoder.layers.mlp.linear_fc1.weight"
    state: dict[str, torch.Tensor] = {}
    for rank in (0, 1):
        local = torch.cat([full[:, 2 * rank : 2 * rank + 2], full[:, 4 + 2 * rank : 6 + 2 * rank]], dim=1)
        bucket = BUCKET.replace("dp_group_idx_0", f"dp_group_idx_{rank}")
        state[f"{bucket}.param"] = local.reshape(-1).clone()
        state[f"{bucket}.exp_avg"] = torch.arange(local.numel()).float() + 100 * rank
        state[f"{bucket}.exp_avg_sq"] = torch.zeros(local.numel())
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    dist = _with_chunks(DistTensors(str(tmp_path)), key, full)
    states = DistBuckets(dist, [key], swiglu=True)
    assert sorted(tuple(o for o, _ in p.where) for p in states.placed) == [
        ((0, 0, 0), (0, 4, 0)),
        ((0, 2, 0), (0, 6, 0)),
    ]
    moments = states.read(key, "exp_avg", layer=0)
    for rank in (0, 1):
        local = (torch.arange(16).float() + 100 * rank).view(4, 4)
        assert torch.equal(moments[2 * rank : 2 * rank + 2], local[:2])  # its gate rows
        assert torch.equal(moments[4 + 2 * rank : 6 + 2 * rank], local[2:])  # its up rows
    torch.testing.assert_close(states.read(key, "param"), full, rtol=0, atol=0)


def _with_chunks(dist: DistTensors, key: str, full: torch.Tensor) -> DistTensors:
    """`dist` with model tensor `key` (`full`) stored as 2-row chunks, as megatron-core's ShardedTensors save
    it (served from memory: torch's single-process save writes a tensor as one chunk)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    offsets = [(0, row, 0) for row in range(0, full.shape[1], 2)]
    sizes = torch.Size((1, 2, full.shape[2]))
    chunks = [ChunkStorageMetadata(torch.Size(o), sizes) for o in offsets]
    dist.tensors[key] = TensorStorageMetadata(TensorProperties(dtype=full.dtype), full.shape, chunks)
    blocks = {o: full[:, o[1] : o[1] + 2].clone() for o in offsets}
    plain = dist.chunk

    def chunk(k: str, o: tuple[int, ...], s: tuple[int, ...]) -> torch.Tensor:
        return blocks[tuple(o)] if k == key else plain(k, o, s)

    dist.chunk = chunk  # type: ignore[method-assign]
    return dist


def test_the_step_is_read_from_every_ranks_param_groups(tmp_path: Path) -> None:
    import io

    model = _model()
    order = ["output_layer.weight", "decoder.final_layernorm.weight", "embedding.word_embeddings.weight"]
    dist = _save(tmp_path, model, _bucket(model, _masters(model), order))
    groups = [{"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "step": 7.0}, {"lr": 1e-3, "step": 7.0}]}]
    blob = io.BytesIO()
    torch.save(groups, blob)
    (tmp_path / "extra.bin").write_bytes(blob.getvalue())
    name = "optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"
    info = next(iter(dist.storage.values()))
    dist.objects[name] = type(info)(relative_path="extra.bin", offset=0, length=len(blob.getvalue()))
    assert optimizer_step(dist) == {7.0}


def test_a_coalesced_buffer_restarts_alignment_where_a_bucket_padding_was_cut_out() -> None:
    """`distrib_optim.pt` joins a buffer's buckets without their end padding: a bucket ending at element 32
    (not a multiple of 64) is followed by the next bucket's first parameter at 32, whose own parameters then
    align from there (32 + 64 = 96), not from 0."""
    g = torch.Generator().manual_seed(2)
    a, b, c = torch.randn(32, generator=g), torch.randn(40, generator=g), torch.randn(16, generator=g)
    flat = torch.zeros(32 + 64 + 16)
    flat[0:32], flat[32:72], flat[96:112] = a, b, c  # bucket 1 = [b, pad to 64, c], starting at 32
    pieces = {Piece(k, (0, 0), torch.float32, v.numel()): v for k, v in (("a", a), ("b", b), ("c", c))}
    placed = place({"buffer": _Memory(flat)}, list(pieces), lambda p: pieces[p])
    assert {p.key: w.start for p, w in placed.items()} == {"a": 0, "b": 32, "c": 96}


class _Memory:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.numel = tensor, tensor.numel()

    def get(self, start: int, stop: int) -> torch.Tensor:
        return self.tensor[start:stop]
