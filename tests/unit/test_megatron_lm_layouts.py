"""Megatron-LM's layout flags and layout strings, judged against megatron-core itself.

megatron-core's `PipelineParallelLayerLayout` (strings) and `TransformerConfig` with
`get_num_layers_to_build` (first/last and account-for flags) run on CPU without process groups.
Where megatron-core accepts, we give the same layers per stage or refuse for a stated reason of
our engine's (empty stages, 'm'); a string of k x P stages is megatron-core's k virtual stages per
rank, the same layers per flat stage when the run has k chunks per rank; where it refuses, we
refuse; where it is wrong (negative stage counts), we refuse. Every refusal is one line naming a flag.
"""

from __future__ import annotations

import random
import re
import warnings

import pytest
import torch

from megatron_ds.errors import LayoutError
from megatron_ds.pipeline.layout import MegatronLMFlags, SpecGroups, build_layout

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core's notes about missing Transformer Engine / Apex
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

# Every layout string in megatron-core 0.16's docstrings and Megatron-LM's docs, tests and functional
# test configs, with the pipeline size it is used with there.
MCORE_EXAMPLES = [
    ("Et*3|(tt|)*29,m|L", 16),  # TransformerConfig docstring, docs/user-guide/features/pipeline_parallel_layout.md
    ("Et*3|(tt|)*29,m|L", 8),  # tests/unit_tests/transformer/test_transformer_block.py
    ("Ettt|(tt|)*29,m|L", 8),  # parse_str_to_list docstring
    ("E|(tt|)*2,(t|)*4,mL", 4),  # TransformerConfig docstring
    ("Et|t*4|t|tL", 2),  # test_transformer_block.py
    ("E|t*6|t|L", 2),
    ("E|t|t*2|t||(t|)*2,t*2,L", 4),
    ("Et*2|(tt|)*29,t|mL", 16),
    ("E|t*3|(t|)*5mL", 4),  # tests/unit_tests/pipeline_parallel/test_pipeline_layout.py
    ("E|t*3|(t|)*4tm|L", 4),
    ("E|t*3|(t|)*3tt|m|L", 4),
    ("Et*2|(tt|)*5t|tmL", 4),  # functional test configs (deepseekv3 proxy, moe)
    ("Et*7|t*7mL", 2),
    ("Et*3|(tt|)*6tmL", 4),
    ("Et*3|(tt|)*6mL", 4),
    ("Et*3|(tt|)*6L", 4),
    ("Et|(tt|)*6mL", 4),
    # list-form layouts of megatron-core's tests, written as strings
    ("Etttt|ttttL", 2),
    ("E|t*7||L", 2),
    ("Ett|ttt||tttL", 4),
    ("E|t|tt|t||t|t|ttL", 4),
]


HELP_EXAMPLE = "E|(t|)*3,m|m||L"
"""Megatron-LM's --pipeline-model-parallel-layout help text: megatron-core refuses it at every P (its
two MTP layers sit in different stages)."""


def groups(num_layers: int) -> SpecGroups:
    return SpecGroups(pre=("embed",), num_layers=num_layers, post=("head",))


def mcore_string(text: str, num_layers: int, num_stages: int, mtp: int | None = None) -> list[int] | None:
    """Decoder layers per string stage as megatron-core reads `text`, or None if it refuses."""
    try:
        layout = PipelineParallelLayerLayout(text, num_stages)
        layout.validate_layer_layout(num_layers=num_layers, mtp_num_layers=mtp)
    except (AssertionError, ValueError, NotImplementedError, IndexError):  # IndexError: no layer at all
        return None
    return [stage.count(LayerType.decoder) for stage in PipelineParallelLayerLayout.parse_str_to_list(text)]


def ours_string(text: str, num_layers: int, num_stages: int, virtual: int = 1) -> tuple[int, ...] | str:
    """Our layers per stage for --pipeline-model-parallel-layout, or the refusal (checked to be one line)."""
    try:
        megatron = MegatronLMFlags(layout=text)
        return build_layout(groups(num_layers), num_stages, megatron=megatron, virtual_stages=virtual).layers_per_stage
    except LayoutError as err:
        message = str(err)
        assert "\n" not in message and message.startswith(f"--pipeline-model-parallel-layout {text!r}: "), message
        return message


def judge(text: str, num_layers: int, num_stages: int, mtp: int | None = None) -> str:
    """Compare with megatron-core; return which case it was (for coverage checks)."""
    theirs, ours = mcore_string(text, num_layers, num_stages, mtp), ours_string(text, num_layers, num_stages)
    if theirs is None:
        assert isinstance(ours, str), (text, num_layers, num_stages, ours)
        return "both refuse"
    stages = PipelineParallelLayerLayout.parse_str_to_list(text)
    if any(LayerType.mtp in s for s in stages):
        assert isinstance(ours, str) and "multi-token-prediction" in ours, (text, ours)
        return "mtp"
    if len(stages) > num_stages:
        assert isinstance(ours, str) and "virtual stages per rank, but the run has 1" in ours, (text, ours)
        virtual = ours_string(text, num_layers, num_stages, len(stages) // num_stages)
        if any(not s for s in stages):
            assert isinstance(virtual, str) and "is empty" in virtual, (text, virtual)
            return "empty"
        assert virtual == tuple(theirs), (text, num_layers, num_stages, virtual, theirs)  # flat stage c x P + r
        return "virtual"
    if any(not s for s in stages):
        assert isinstance(ours, str) and "is empty" in ours and "optimizer" in ours, (text, ours)
        return "empty"
    assert ours == tuple(theirs), (text, num_layers, num_stages, ours, theirs)
    return "same"


@pytest.mark.parametrize("text,num_stages", MCORE_EXAMPLES)
def test_megatron_core_examples(text: str, num_stages: int) -> None:
    stages = PipelineParallelLayerLayout.parse_str_to_list(text)
    n = sum(s.count(LayerType.decoder) for s in stages)
    mtp = sum(s.count(LayerType.mtp) for s in stages) or None
    assert mcore_string(text, n, num_stages, mtp) is not None, "megatron-core accepts its own example"
    assert judge(text, n, num_stages, mtp) != "both refuse"
    # every pipeline size the string could mean, and wrong layer counts
    for p in range(1, len(stages) + 2):
        for layers in (n - 1, n, n + 1):
            if layers >= 1:
                judge(text, layers, p, mtp)


def test_help_text_example_is_refused_by_both() -> None:
    for p in range(1, 10):
        assert judge(HELP_EXAMPLE, 3, p, mtp=2) == "both refuse"


def test_p_stage_examples_give_megatron_cores_counts() -> None:
    """The examples read as P-stage layouts (P = their stage count), without 'm' where there is one."""
    seen = 0
    for text, _ in MCORE_EXAMPLES:
        text = text.replace("m", "")
        stages = PipelineParallelLayerLayout.parse_str_to_list(text)
        n = sum(s.count(LayerType.decoder) for s in stages)
        seen += judge(text, n, len(stages)) == "same"
    assert seen >= 10


def _extension(text: str) -> bool:
    """Ours only: a nested group, or a group without a repeat count (megatron-core refuses both)."""
    depth, deepest = 0, 0
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        deepest = max(deepest, depth)
    return deepest > 1 or re.search(r"\)(?!\*\d)", text) is not None


def _artifact(text: str) -> bool:
    """Strings megatron-core's regular expressions expand by accident: `X*N` applies to any character,
    so a repeated group's last symbol is repeated again (`(tt)*2*2`: five layers) and a stray
    parenthesis, star or digit vanishes under `*0` (`Et)*0L`, `Et**0L`)."""
    flat = text.replace(",", "")
    return re.search(r"\)\*\d+\*\d", flat) is not None or re.search(r"[()*\d]\*0", flat) is not None


def random_layout(rng: random.Random) -> str:
    """A layout-like string: stages of t, repeats, groups and commas, E and L mostly in place, and
    sometimes a character inserted, dropped or replaced."""
    pieces = ["t", "t", "t*2", "t*3", "(t|)*2", "(tt)*2", "(t|t)*1", ",", "", "t*0", "t*1,0"]
    stages = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(1, 6))]
    text = ("E" if rng.random() < 0.9 else "") + "|".join(stages) + ("L" if rng.random() < 0.9 else "")
    for _ in range(rng.choice((0, 0, 1, 2))):
        i = rng.randrange(len(text) + 1)
        op, ch = rng.choice(("insert", "drop", "replace")), rng.choice("EtL|()*2,m")
        text = text[:i] + (ch if op != "drop" else "") + text[i + (op != "insert") :]
    return text or "E"


def test_random_strings_agree_with_megatron_core() -> None:
    rng = random.Random(0)
    cases: dict[str, int] = {}
    for _ in range(4000):
        text = random_layout(rng)
        try:
            stages = PipelineParallelLayerLayout.parse_str_to_list(text)
            n, num_stages = sum(s.count(LayerType.decoder) for s in stages), len(stages)
        except (AssertionError, ValueError):
            n, num_stages = rng.randint(1, 6), rng.randint(1, 6)
        n = max(1, n + rng.choice((0, 0, 0, 1, -1)))
        p = rng.choice((num_stages, num_stages, max(1, num_stages // 2), rng.randint(1, 6)))
        theirs, ours = mcore_string(text, n, p), ours_string(text, n, p)
        if theirs is None and not isinstance(ours, str):
            assert _extension(text), (text, n, p, ours)
            case = "ours only"
        elif theirs is not None and isinstance(ours, str) and _artifact(text):
            assert re.search(r"at position \d+", ours), (text, ours)  # refused as a syntax error
            case = "artifact"
        else:
            case = judge(text, n, p)
        cases[case] = cases.get(case, 0) + 1
    assert min(cases.get(c, 0) for c in ("same", "both refuse", "virtual", "empty")) >= 100, cases


@pytest.mark.parametrize(
    "text,num_layers,num_stages,message",
    [
        ("|Et|tL", 2, 3, "stage 0 is empty"),  # megatron-core accepts; an empty first stage, not a misplaced E
        ("Et||tL", 2, 3, "stage 1 is empty"),
        ("Et|t|tL|L", 3, 2, "'L' (loss head) appears 2 times"),
        ("tE|tL", 2, 2, "'t' comes before 'E'"),
        ("Et|Lt", 2, 2, "'t' comes after 'L'"),
        ("Et|t|tL", 3, 2, "has 3 stages, neither --pipeline-model-parallel-size 2 nor a multiple of it"),
        ("Et|t|t|tL", 4, 2, "megatron-core's 2 virtual stages per rank, but the run has 1"),
        ("Et|t|t|tL", 4, 2, "run it with 2 virtual stages per rank (--num-virtual-stages-per-pipeline-rank 2"),
        ("Et|tmL", 2, 2, "multi-token-prediction layer"),
        ("(tt)*2*2", 4, 1, "repeats a repeat"),
        ("E t|t L", 2, 2, ""),  # whitespace is fine here (megatron-core refuses it)
    ],
)
def test_layout_string_messages(text: str, num_layers: int, num_stages: int, message: str) -> None:
    got = ours_string(text, num_layers, num_stages)
    if message:
        assert isinstance(got, str) and message in got, got
    else:
        assert got == (1, 1)


@pytest.mark.parametrize("text,counts", [("E t | t L", (1, 1)), ("E((t|)*2)*1L", (1, 1, 0)), ("(Et)|t(t)L", (1, 2))])
def test_our_extensions_megatron_core_refuses(text: str, counts: tuple[int, ...]) -> None:
    """Whitespace, nested groups and a group without a count: ours only, with the obvious meaning."""
    assert mcore_string(text, sum(counts), len(counts)) is None
    assert ours_string(text, sum(counts), len(counts)) == counts


# --- --decoder-first/last-pipeline-num-layers and --account-for-*: TransformerConfig's rules --------


def mcore_split(
    n: int, p: int, first: int | None, last: int | None, embedding: bool = False, loss: bool = False
) -> list[int] | None:
    try:
        config = TransformerConfig(
            num_layers=n,
            hidden_size=8,
            num_attention_heads=2,
            pipeline_model_parallel_size=p,
            pipeline_dtype=torch.float32,
            num_layers_in_first_pipeline_stage=first,
            num_layers_in_last_pipeline_stage=last,
            account_for_embedding_in_pipeline_split=embedding,
            account_for_loss_in_pipeline_split=loss,
        )
        return [get_num_layers_to_build(config, vp_stage=None, pp_rank=r) for r in range(p)]
    except (AssertionError, ValueError):
        return None


def ours_split(n: int, p: int, flags: MegatronLMFlags) -> tuple[int, ...] | str:
    try:
        return build_layout(groups(n), p, megatron=flags).layers_per_stage
    except LayoutError as err:
        message = str(err)
        assert "\n" not in message and message.startswith("--"), message
        return message


def _check_suggestion(message: str, n: int, p: int, first: int | None, last: int | None) -> None:
    """A suggested value (`e.g. FLAG V`) gives a layout both sides accept."""
    found = re.search(r"e\.g\. (--decoder-(first|last)-pipeline-num-layers) (\d+)", message)
    if found:
        first, last = (int(found[3]), last) if found[2] == "first" else (first, int(found[3]))
        fixed = ours_split(n, p, MegatronLMFlags(first_stage_layers=first, last_stage_layers=last))
        assert fixed == tuple(mcore_split(n, p, first, last) or ()), (message, fixed)


def test_first_and_last_stage_layers_match_megatron_core() -> None:
    cases = {"same": 0, "both refuse": 0, "megatron-core wrong": 0}
    for n in range(1, 25):
        for p in range(2, 9):
            for first in (None, *range(0, n + 2)):
                for last in (None, *range(0, n + 2)):
                    if first is None and last is None:
                        continue
                    theirs = mcore_split(n, p, first, last)
                    ours = ours_split(n, p, MegatronLMFlags(first_stage_layers=first, last_stage_layers=last))
                    if theirs is None:
                        assert isinstance(ours, str), (n, p, first, last, ours)
                        cases["both refuse"] += 1
                        _check_suggestion(ours, n, p, first, last)
                    elif min(theirs) < 0:  # first + last > --num-layers: megatron-core gives negative stages
                        assert isinstance(ours, str) and "exceeds --num-layers" in ours, (n, p, first, last, ours)
                        cases["megatron-core wrong"] += 1
                    else:
                        assert ours == tuple(theirs), (n, p, first, last, ours, theirs)
                        cases["same"] += 1
    assert min(cases.values()) > 100, cases


def test_account_for_embedding_and_loss_match_megatron_core() -> None:
    same = refused = 0
    for n in range(1, 25):
        for p in range(1, 9):
            for embedding, loss in ((True, False), (False, True), (True, True)):
                theirs = mcore_split(n, p, None, None, embedding, loss)
                ours = ours_split(n, p, MegatronLMFlags(account_for_embedding=embedding, account_for_loss=loss))
                if theirs is None:
                    assert isinstance(ours, str) and "is not divisible by" in ours, (n, p, ours)
                    refused += 1
                else:
                    assert ours == tuple(theirs), (n, p, embedding, loss, ours, theirs)
                    same += 1
    assert same > 100 and refused > 100


def test_megatron_core_wrong_cases_are_refused_with_the_reason() -> None:
    assert mcore_split(4, 3, 3, 3) == [3, -2, 3]  # what megatron-core builds
    message = ours_split(4, 3, MegatronLMFlags(first_stage_layers=3, last_stage_layers=3))
    assert message == (
        "--decoder-first-pipeline-num-layers 3 + --decoder-last-pipeline-num-layers 3 = 6 exceeds --num-layers 4; "
        "give the end stages at most 4 layers"
    )
    assert mcore_split(4, 1, 1, 1) == [1]  # one layer built of four
    assert "the only stage is both first and last" in ours_split(
        4, 1, MegatronLMFlags(first_stage_layers=1, last_stage_layers=1)
    )


def test_one_way_to_place_boundaries() -> None:
    """megatron-core refuses first/last with account-for, and a layout with either; so do we."""
    assert mcore_split(3, 2, 2, None, loss=True) is None
    got = ours_split(3, 2, MegatronLMFlags(first_stage_layers=2, account_for_loss=True))
    assert got == (
        "--decoder-first-pipeline-num-layers and --account-for-loss-in-pipeline-split were both given; "
        "choose one way to place the stage boundaries"
    )
    got = ours_split(2, 2, MegatronLMFlags(layout="Et|tL", last_stage_layers=1))
    assert isinstance(got, str) and got.startswith("--pipeline-model-parallel-layout and --decoder-last")
    alone = ours_split(3, 2, MegatronLMFlags(account_for_embedding=True))
    assert alone == (1, 2) == tuple(mcore_split(3, 2, None, None, embedding=True))


def test_virtual_layouts_put_flat_stage_c_p_plus_r_on_rank_r() -> None:
    """megatron-core's `layout[pp_rank][vpp_rank]` is the string's stage vpp_rank * P + pp_rank."""
    text, p = "E|t*2|t|t*3|t|tL", 3
    mcore = PipelineParallelLayerLayout(text, p)
    layout = build_layout(groups(8), p, megatron=MegatronLMFlags(layout=text), virtual_stages=2)
    for s in range(layout.num_stages):
        r, c = layout.rank_of_stage(s), layout.chunk_of_stage(s)
        assert layout.layers_per_stage[s] == mcore.layout[r][c].count(LayerType.decoder)
    assert layout.rank_stages(1) == [1, 4] and layout.rank_specs(0) == [0, 4, 5, 6]


# --- the flags on pretrain_gpt.py's command line ------------------------------------------------------

BASE = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
BASE += ["--vocab-size", "128", "--train-iters", "1", "--lr", "1e-3", "--pipeline-model-parallel-size", "4"]


def cli_layout(*argv: str) -> str:
    from megatron_ds.estimate.machine import CPU
    from megatron_ds.estimate.run_layout import build_run_layout
    from megatron_ds.flags.parser import parse_config

    return build_run_layout(parse_config([*BASE, *argv], world_size=4)[0], CPU).to_string()


def cli_error(*argv: str) -> str:
    from megatron_ds.errors import UserError
    from megatron_ds.flags.parser import parse_config

    with pytest.raises(UserError) as err:
        parse_config([*BASE, *argv], world_size=4)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_megatron_lm_flags_on_the_command_line() -> None:
    first_last = ("--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1")
    assert cli_layout(*first_last) == "Et|t*3|t*3|tL"
    assert cli_layout("--decoder-first-pipeline-num-layers", "2") == "Et*2|t*2|t*2|t*2L"
    both = ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")
    assert cli_layout(*both, "--num-layers", "10") == "Et*2|t*3|t*3|t*2L"  # 12 "layers" over 4 stages
    assert cli_layout("--pipeline-model-parallel-layout", "E|(tt,t|)*2,ttL") == "E|t*3|t*3|t*2L"
    assert cli_layout("--num-virtual-stages-per-pipeline-rank", "1") == "Et*2|t*2|t*2|t*2L"  # the default split
    # v = 2: eight flat stages, stage c x 4 + r on rank r (the interleaved schedule)
    assert cli_layout("--num-virtual-stages-per-pipeline-rank", "2") == "Et|t|t|t|t|t|t|tL"
    assert cli_layout("--num-layers-per-virtual-pipeline-stage", "1") == "Et|t|t|t|t|t|t|tL"  # (8 / 4) / 1 = 2
    assert cli_layout("--pipeline-model-parallel-layout", "E|t*2|t|t|t|t|t*2|L") == "E|t*2|t|t|t|t|t*2|L"
    dedicated = cli_layout("--num-virtual-stages-per-pipeline-rank", "2", "--pp-dedicated-embedding-stages")
    assert dedicated.startswith("E|") and dedicated.endswith("|L") and dedicated.count("|") == 7


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--num-virtual-stages-per-pipeline-rank", "2", "--pp-schedule", "zbh1"],
            "2 virtual stages per rank run only on the interleaved schedule, not --pp-schedule zbh1",
        ),
        (["--num-virtual-stages-per-pipeline-rank", "2", "--enable-zbh1-pipeline"], "ZB-H1 runs one stage per rank"),
        (["--num-layers-per-virtual-pipeline-stage", "3"], "must hold a whole number of chunks of 3 layers"),
        (["--pipeline-model-parallel-layout", "Et|t|t|t|t|t|t|tL", "--pp-schedule", "1f1b"], "interleaved schedule"),
        (
            ["--pipeline-model-parallel-layout", "E|t*4|t*4|L", "--num-virtual-stages-per-pipeline-rank", "1"],
            "both given",
        ),
        (
            ["--pp-layout", "E|t*4|t*4|L", "--pipeline-model-parallel-layout", "E|t*4|t*4|L"],
            "--pp-layout and --pipeline-model-parallel-layout were both given",
        ),
        (
            ["--standalone-embedding-stage", "--decoder-first-pipeline-num-layers", "2"],
            "--standalone-embedding-stage and --decoder-first-pipeline-num-layers were both given",
        ),
        (["--decoder-first-pipeline-num-layers", "3"], "leaves 5 of --num-layers 8 layers for 3 middle stage(s)"),
        (["--pipeline-model-parallel-layout", "auto"], "unknown symbol 'a'"),
        (["--account-for-loss-in-pipeline-split"], "= 9 is not divisible by --pipeline-model-parallel-size 4"),
    ],
)
def test_megatron_lm_flag_errors(argv: list[str], message: str) -> None:
    assert message in cli_error(*argv)
