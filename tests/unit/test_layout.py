"""Layout engine: invariants over every P in 1..16 and N in 1..64, and every bad input by message."""

from __future__ import annotations

import itertools
import random

import pytest

from megatron_ds.config import ModelConfig
from megatron_ds.model.naming import gpt_spec_groups
from megatron_ds.model.shapes import gpt_spec_param_counts
from megatron_ds.pipeline import partition
from megatron_ds.pipeline.layout import Costs, Layout, LayoutError, SpecGroups, build_layout
from megatron_ds.pipeline.layout_string import expand

PRE = ("cast_token_ids", "WordEmbedding", "PositionEmbedding")
POST = ("FinalNorm", "WordEmbedding.lm_head_logits", "logits_to_fp32")


def groups(n: int) -> SpecGroups:
    return SpecGroups(pre=PRE, num_layers=n, post=POST)


def check_invariants(layout: Layout) -> None:
    g, parts, p = layout.groups, layout.parts, layout.num_stages
    # contiguous, starting at 0, ending at the last spec, every spec exactly once
    assert parts[0] == 0 and parts[-1] == g.num_specs and len(parts) == p + 1
    owned = [i for s in range(p) for i in layout.stage_specs(s)]
    assert owned == list(range(g.num_specs))
    # pre group whole on stage 0, post group whole on the last stage
    assert all(layout.stage_of_spec(i) == 0 for i in range(len(g.pre)))
    assert all(layout.stage_of_spec(g.num_specs - 1 - i) == p - 1 for i in range(len(g.post)))
    # no stage without a layer that has parameters (E, L or a transformer layer)
    for s in range(p):
        names = [g.names[i] for i in layout.stage_specs(s)]
        assert "WordEmbedding" in names or "TransformerLayer" in names or any("lm_head" in n for n in names)
    assert sum(layout.layers_per_stage) == g.num_layers
    # the layout string round-trips
    again = build_layout(g, p, layout=layout.to_string())
    assert again.layers_per_stage == layout.layers_per_stage


def body_counts(layout: Layout) -> list[int]:
    counts = list(layout.layers_per_stage)
    d = layout.dedicated()
    if d in ("pre", "both"):
        counts = counts[1:]
    if d in ("post", "both"):
        counts = counts[:-1]
    return counts


@pytest.mark.parametrize("num_stages", range(1, 17))
def test_dedicated_invariants_all_sizes(num_stages: int) -> None:
    for n in range(1, 65):
        for dedicated, reserved in (("none", 0), ("pre", 1), ("post", 1), ("both", 2)):
            if dedicated == "none":
                continue
            if num_stages < reserved + 1 or num_stages - reserved > n:
                with pytest.raises(LayoutError, match="--pp-dedicated-embedding-stages"):
                    build_layout(groups(n), num_stages, dedicated=dedicated)
                continue
            layout = build_layout(groups(n), num_stages, dedicated=dedicated)
            check_invariants(layout)
            body = body_counts(layout)
            assert max(body) - min(body) <= 1
            assert body == sorted(body, reverse=True), "earlier stages take the remainder"
            assert layout.dedicated() == dedicated or (dedicated in ("pre", "post") and n == 0)


@pytest.mark.parametrize("num_stages", range(1, 17))
def test_partition_methods_all_sizes(num_stages: int) -> None:
    for n in range(1, 65):
        g = groups(n)
        model = ModelConfig(
            num_layers=n,
            hidden_size=64,
            num_attention_heads=4,
            ffn_hidden_size=256,
            seq_length=32,
            max_position_embeddings=32,
            vocab_size=512,
        )
        methods = {
            "type:transformer": None,
            "uniform": None,
            "parameters": gpt_spec_param_counts(model),
            "type:embedding:2|transformer:1": None,
        }
        for method, weights in methods.items():
            try:
                layout = build_layout(g, num_stages, partition_method=method, costs=Costs(spec_weights=weights))
            except LayoutError as e:
                assert "without a transformer layer" in str(e) and num_stages > 2
                continue
            check_invariants(layout)
            if method == "type:transformer":
                # transformer counts differ by at most one across stages that hold any
                held = [k for k in layout.layers_per_stage if k]
                assert max(held) - min(held) <= 1


def test_default_matches_deepspeed_partition_balanced() -> None:
    from deepspeed.runtime import utils as ds_utils

    for p, n in itertools.product(range(1, 9), range(1, 25)):
        g = groups(n)
        weights = [1 if name == "TransformerLayer" else 0 for name in g.names]
        ds_parts = [int(x) for x in ds_utils.partition_balanced(weights, p)]
        assert partition.balanced(weights, p) == ds_parts
        try:
            layout = build_layout(g, p)
        except LayoutError:
            counts = [sum(weights[a:b]) for a, b in zip(ds_parts[:-1], ds_parts[1:])]
            assert 0 in counts[1:-1]  # stock DeepSpeed would leave a stage with no layer
            continue
        ds_counts = [sum(weights[a:b]) for a, b in zip(ds_parts[:-1], ds_parts[1:])]
        assert list(layout.layers_per_stage) == ds_counts


def test_balanced_matches_deepspeed_partition_balanced_on_any_weights() -> None:
    """Float, integer, zero and negative weights, where ties between equal costs pick the cut DeepSpeed picks."""
    from deepspeed.runtime import utils as ds_utils

    rng = random.Random(3)
    draws = (lambda: rng.random(), lambda: rng.choice([0.0, 0.5, 1.0, 2.0]), lambda: float(rng.randint(-2, 4)))
    for trial in range(150):
        n, p = rng.randint(1, 18), rng.randint(1, 8)
        weights = [draws[trial % 3]() for _ in range(n)]
        assert partition.balanced(weights, p) == [int(x) for x in ds_utils.partition_balanced(weights, p)]


def test_uniform_matches_deepspeed() -> None:
    from deepspeed.runtime import utils as ds_utils

    for items, parts in itertools.product(range(0, 40), range(1, 17)):
        assert partition.uniform(items, parts) == [int(x) for x in ds_utils.partition_uniform(items, parts)]


def test_seed_example_three_layers_five_stages() -> None:
    layout = build_layout(groups(3), 5, dedicated="both")
    assert layout.layers_per_stage == (0, 1, 1, 1, 0)
    text = layout.format()
    assert text.splitlines()[:4] == [
        "stage=0 layers=3",
        "     0: cast_token_ids",
        "     1: WordEmbedding",
        "     2: PositionEmbedding",
    ]
    assert "<lambda>" not in text
    assert "stage=4 layers=3" in text and "  loss: cross_entropy_loss" in text


@pytest.mark.parametrize(
    "text,counts",
    [
        ("E|t*3|t*3|L", [0, 3, 3, 0]),
        ("Et|tt|tL", [1, 2, 1]),
        ("E|(t|)*3L", [0, 1, 1, 1, 0]),
        ("E t | t t | L", [1, 2, 0]),
        ("(Et)|(t*2)*2|L", [1, 4, 0]),
        ("EtL", [1]),
    ],
)
def test_layout_strings(text: str, counts: list[int]) -> None:
    layout = build_layout(groups(sum(counts)), len(counts), layout=text)
    assert list(layout.layers_per_stage) == counts
    check_invariants(layout)


def test_expand_nested_repetition() -> None:
    assert expand("((t)*2|)*2") == "tt|tt|"


@pytest.mark.parametrize(
    "text,n,p,message",
    [
        ("E|tt(|L", 2, 3, "'(' is never closed"),
        ("E|tt)|L", 2, 3, "unmatched ')'"),
        ("E|t*|L", 1, 3, "not followed by a count"),
        ("*3E|t|L", 1, 3, "follows nothing"),
        ("E|t*0|tL", 1, 3, "stage 1 is empty"),
        ("E|tx|L", 1, 3, "unknown symbol 'x'"),
        ("E|tt|L", 3, 3, "has 2 't' but --num-layers is 3"),
        ("E|t|t|L", 2, 3, "has 4 stages, neither --pipeline-model-parallel-size 3 nor a multiple of it"),
        ("t|t|L", 2, 3, "'E' (embedding) is missing"),
        ("E|t|t", 2, 3, "'L' (loss head) is missing"),
        ("tE|t|L", 2, 3, "'t' comes before 'E'"),
        ("E|t|Lt", 2, 3, "'t' comes after 'L'"),
        ("EE|t|L", 1, 3, "'E' (embedding) appears 2 times"),
        ("E|tL|L", 1, 3, "'L' (loss head) appears 2 times"),
        ("E||tL", 1, 3, "stage 1 is empty"),
        ("", 1, 1, "the layout is empty"),
    ],
)
def test_layout_string_errors(text: str, n: int, p: int, message: str) -> None:
    with pytest.raises(LayoutError) as err:
        build_layout(groups(n), p, layout=text)
    msg = str(err.value)
    assert message in msg and "--pp-layout" in msg and "\n" not in msg


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_stages=2, dedicated="both"), "needs --pipeline-model-parallel-size >= 3 (got 2)"),
        (dict(num_stages=1, dedicated="pre"), "needs --pipeline-model-parallel-size >= 2 (got 1)"),
        (dict(num_stages=1, dedicated="post"), "needs --pipeline-model-parallel-size >= 2 (got 1)"),
        (dict(num_stages=6, dedicated="both"), "leaves 4 stages for --num-layers 3"),
        (dict(num_stages=3, dedicated="both", layout="E|ttt|L"), "were both given"),
        (dict(num_stages=3, layout="E|ttt|L", partition_method="uniform"), "were both given"),
        (dict(num_stages=3, partition_method="type:embedding:0|transformer:1"), "must be > 0"),
        (dict(num_stages=3, partition_method="type:embedding:-1|transformer:1"), "must be > 0"),
        (dict(num_stages=3, partition_method="type:attention"), "matches no layer"),
        (dict(num_stages=3, partition_method="type:embedding:2|mlp:1"), "'mlp' matches no layer"),
        (dict(num_stages=3, partition_method="type:(unclosed"), "not a valid regular expression"),
        (dict(num_stages=3, partition_method="random"), "not a known method"),
        (dict(num_stages=5), "without a transformer layer"),
    ],
)
def test_bad_layout_options(kwargs: dict, message: str) -> None:
    with pytest.raises(LayoutError) as err:
        build_layout(groups(3), **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_untied_groups_name_the_head() -> None:
    model = ModelConfig(
        num_layers=2,
        hidden_size=8,
        num_attention_heads=2,
        ffn_hidden_size=16,
        seq_length=4,
        max_position_embeddings=4,
        vocab_size=16,
        untie_embeddings_and_output_weights=True,
    )
    assert gpt_spec_groups(model).post[1] == "LMHead"


def test_min_max_partition_is_optimal_on_small_cases() -> None:
    for weights in ([3, 1, 1, 1, 3], [1, 2, 3, 4, 5, 6], [5, 1, 1, 1, 1, 1, 5]):
        for parts in range(1, len(weights) + 1):
            got = partition.min_max(weights, parts)
            cost = max(sum(weights[a:b]) for a, b in zip(got[:-1], got[1:]))
            best = min(
                max(sum(weights[a:b]) for a, b in zip((0, *cuts), (*cuts, len(weights))))
                for cuts in itertools.combinations(range(1, len(weights)), parts - 1)
            )
            assert cost == best


def test_stage_ranks_follow_deepspeed_topology() -> None:
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    for p, dp, tp in ((3, 2, 2), (2, 1, 4), (4, 3, 1)):
        topo = PipeModelDataParallelTopology(num_pp=p, num_mp=tp, num_dp=dp)
        layout = build_layout(groups(2 * p), p)
        for s in range(p):
            expected = [[topo.get_rank(pipe=s, data=d, model=t) for t in range(tp)] for d in range(dp)]
            assert layout.stage_ranks(s, dp, tp) == expected
    text = build_layout(groups(4), 3, dedicated="both").format(data_parallel=2, tensor_parallel=2)
    assert "  stage 2: data 0: tensor ranks -> 8,9 | data 1: tensor ranks -> 10,11" in text
    assert "ranks per stage" not in build_layout(groups(4), 3).format()


@pytest.mark.parametrize("dp,tp", [(17, 1), (64, 8), (16, 2), (8, 8), (3, 8)])
def test_rank_table_states_the_pattern_for_many_ranks(dp: int, tp: int) -> None:
    """Beyond MAX_LISTED_RANKS ranks per stage the table says which ranks a replica holds instead of
    listing them; the stated pattern must be the one stage_ranks uses."""
    import re

    from megatron_ds.pipeline.layout import MAX_LISTED_RANKS

    assert dp * tp > MAX_LISTED_RANKS
    layout = build_layout(groups(6), 3)
    lines = [ln for ln in layout.format(dp, tp).splitlines() if ln.startswith("  stage ")]
    for s, line in enumerate(lines):
        stated = re.search(r"holds (?:rank (\d+)\+d|tensor ranks (\d+)\+(\d+)d \.\. (\d+)\+\d+d)$", line)
        assert stated, line
        ranks = layout.stage_ranks(s, dp, tp)
        assert f"global ranks {ranks[0][0]}-{ranks[-1][-1]}" in line
        first = ranks[0][0]
        for d, replica in enumerate(ranks):
            if tp == 1:
                assert replica == [first + d]
            else:
                assert replica == list(range(first + tp * d, first + tp * d + tp))
        if tp == 1:
            assert int(stated.group(1)) == first
        else:
            assert [int(stated.group(i)) for i in (2, 3, 4)] == [first, tp, first + tp - 1]


def test_layer_of_numbers_the_body_specs_from_zero() -> None:
    g = groups(4)
    layers = [g.layer_of(i) for i in range(g.num_specs)]
    assert layers == [None] * len(PRE) + [0, 1, 2, 3] + [None] * len(POST)
    assert [g.names[i] == g.layer_name for i in range(g.num_specs)] == [n is not None for n in layers]
