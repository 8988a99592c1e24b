"""At T = 2 each rank's matmul FLOPs (megatron-core's parallel layers) equal the compute model's, exactly.

Two gloo ranks build a transformer layer, the tied (vocabulary-parallel word embedding) and the
untied LM head for two architectures and count one forward and one backward with FlopCounterMode
(math SDPA backend, as tests/unit/test_compute_model.py explains).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from megatron_ds.estimate.compute import ComputeInputs, spec_flops
from megatron_ds.model import naming
from megatron_ds.testing.launch import run_ranks
from megatron_ds.testing.scenario import tiny_config

ARCHITECTURES = {
    "gpt": {},
    "gqa-swiglu-rotary": {
        "model__num_key_value_heads": 2,
        "model__activation": "swiglu",
        "model__use_rotary_position_embeddings": True,
        "model__add_bias_linear": False,
        "model__normalization": "rmsnorm",
    },
}
BATCH = 2

WORKER = textwrap.dedent(r"""
    import json, sys, torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    from megatron_ds.distributed import init_distributed, shutdown_distributed
    from megatron_ds.model import tensor_parallel
    from megatron_ds.model.gpt_pipe import build_topology
    from megatron_ds.model.tensor_parallel_layers import VocabParallelLMHead, VocabParallelWordEmbedding
    from megatron_ds.model.transformer import TransformerLayer
    from megatron_ds.testing.scenario import tiny_config

    def counted(fn):
        with sdpa_kernel(SDPBackend.MATH):
            with FlopCounterMode(display=False) as fwd:
                out = fn()
            with FlopCounterMode(display=False) as bwd:
                out.backward()
        return fwd.get_total_flops(), bwd.get_total_flops()

    architectures, batch = json.loads(sys.argv[1]), int(sys.argv[2])
    results = {}
    for name, overrides in architectures.items():
        config = tiny_config(parallel__tensor_model_parallel_size=2, **overrides)
        init_distributed(config.parallel)
        tp = tensor_parallel.setup(config, build_topology(config))
        m = config.model
        x = torch.randn(batch, m.seq_length, m.hidden_size, requires_grad=True)
        reg = config.regularization
        layer = TransformerLayer(m, reg, 7, tp)
        tied = VocabParallelWordEmbedding(m, reg, 7, tp)
        untied = VocabParallelLMHead(m, reg, 7, tp)
        results[name] = {
            "layer": counted(lambda: layer(x).square().mean()),
            "tied": counted(lambda: tied.lm_head_logits(x).square().mean()),
            "untied": counted(lambda: untied(x).square().mean()),
        }
    print("RESULT " + json.dumps(results), flush=True)
    shutdown_distributed()
""")


@pytest.fixture(scope="module")
def counts(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    script = tmp_path_factory.mktemp("compute_tp") / "worker.py"
    script.write_text(WORKER)
    root = str(Path(__file__).parents[2])
    results = run_ranks([str(script), json.dumps(ARCHITECTURES), str(BATCH)], 2, timeout=240, cwd=root)
    lines = [next(ln for ln in r.output.splitlines() if ln.startswith("RESULT ")) for r in results]
    return [json.loads(ln[len("RESULT ") :]) for ln in lines]


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_each_tensor_rank_does_the_predicted_matmuls(counts: list[dict], name: str) -> None:
    model = tiny_config(**ARCHITECTURES[name]).model
    specs = {sp.name: sp for sp in spec_flops(ComputeInputs(model, BATCH, tensor_parallel_size=2))}
    expected = {
        "layer": specs[naming.TRANSFORMER_LAYER],
        "tied": specs[naming.TIED_LM_HEAD],
        "untied": specs[naming.TIED_LM_HEAD],  # same matmul shape as the tied head
    }
    for rank, per_rank in enumerate(counts):
        for what, spec in expected.items():
            assert tuple(per_rank[name][what]) == (spec.matmul_forward, spec.matmul_backward), (rank, what)
