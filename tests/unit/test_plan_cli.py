"""The planner's command line: sections from one registry (`plan/sections.py`), the flags it shares
with pretrain_gpt.py from their declarations (`plan/command_line.py`, `megatron_ds.flags`)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from megatron_ds.flags import BY_NAME
from megatron_ds.plan import command_line, sections
from megatron_ds.plan.__main__ import main
from megatron_ds.plan.inputs import QUESTIONS, PlanInputs, resolve
from megatron_ds.plan.report import Section
from megatron_ds.plan.sections import PlannerSection

ROOT = Path(__file__).resolve().parents[2]
A100_1_3B = ["--model", "1.3b", "--num-gpus", "8", "--gpu", "A100-80GB"]


def _echo(ctx) -> Section:
    return Section("echo", "Echo", [f"layers {ctx.res.dims['num_layers']}"])


@pytest.fixture
def with_echo(monkeypatch):
    """The registry with one more section, as a newcomer would add it: one entry and its builder."""
    entry = PlannerSection("echo", ("model",), _echo, "repeats the model's depth")
    monkeypatch.setattr(sections, "SECTIONS", (*sections.SECTIONS, entry))
    return entry


def test_every_entry_is_complete() -> None:
    names = sections.names()
    assert len(set(names)) == len(names) and sections.ALL not in names
    for entry in sections.SECTIONS:
        assert set(entry.needs) <= set(QUESTIONS), entry.name  # each need can be asked for
        assert entry.help, entry.name
    assert max(len(line) for line in sections.help_text().splitlines()) <= 80
    assert sections.needs(sections.ALL) == list(dict.fromkeys(n for s in sections.SECTIONS for n in s.needs))


def test_one_entry_adds_a_command_its_help_its_needs_and_its_place_in_all(with_echo, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert re.search(r"^  echo +repeats the model's depth$", capsys.readouterr().out, re.M)
    assert main(["echo", "--model", "1.3b"]) == 0
    out = capsys.readouterr().out
    assert "== Echo ==\nlayers 24" in out and "== ZeRO stage ==" not in out
    assert main(["echo"]) == 2
    assert "`echo` needs more inputs: Which model?" in capsys.readouterr().err
    assert main(A100_1_3B) == 0
    assert capsys.readouterr().out.count("== Echo ==") == 1


def test_the_usage_in_docs_names_the_registry() -> None:
    doc = (ROOT / "docs" / "planner.md").read_text()
    line = next(ln for ln in doc.splitlines() if ln.startswith("COMMAND: "))
    assert line.split(":", 1)[1].split("(")[0].split() == " | ".join(sections.names()).split()


def _actions() -> dict[str, argparse.Action]:
    return {o: a for a in command_line.build_parser()._actions for o in a.option_strings}


def test_training_flags_come_from_their_declarations() -> None:
    actions, fields = _actions(), set(PlanInputs.__dataclass_fields__)
    for name in command_line.TRAINING_FLAGS:
        flag, action = BY_NAME[name], actions[name]
        assert action.help.startswith(flag.help) and action.default is None, name  # None: not given
        assert action.dest == flag.attr and action.dest in fields, name
        if flag.is_switch:
            assert action.const == flag.const and action.nargs == 0, name
        else:
            assert action.type is flag.type and action.choices == flag.argparse_choices(), name


PLANNER_OWN = {"--profile"}
"""The planner's `--profile FILE` (its saved answers) predates pretrain_gpt.py's Megatron-LM `--profile`
(a torch profiler trace): the same spelling, another meaning, never on one command line."""


def test_no_pretrain_gpt_flag_is_declared_again() -> None:
    drawn = {*command_line.TRAINING_FLAGS, *command_line.ARCHITECTURE_FLAGS}
    drawn |= {alias for name in command_line.ARCHITECTURE_FLAGS for alias in BY_NAME[name].aliases}
    again = [o for o in _actions() if o in BY_NAME and o not in drawn and o not in PLANNER_OWN]
    assert not again, f"draw these from megatron_ds.flags (command_line.TRAINING_FLAGS): {again}"
    profile = BY_NAME[
        "--profile"
    ]  # pretrain_gpt.py's turns the profiler on (bare; Megatron-DeepSpeed's values refused)
    assert profile.const is True and profile.nargs == "?" and _actions()["--profile"].metavar == "FILE"  # two meanings


def test_architecture_flags_come_from_their_declarations() -> None:
    actions = _actions()
    for name in command_line.ARCHITECTURE_FLAGS:
        flag, action = BY_NAME[name], actions[name]
        assert action.help.startswith(flag.help) and action.default is None, name
        if flag.is_switch:
            assert action.const == flag.const and action.nargs == 0, name
        else:
            assert action.type is flag.type and action.choices == flag.argparse_choices(), name


def test_a_declaration_change_reaches_the_planner(monkeypatch, capsys) -> None:
    narrowed = dataclasses.replace(BY_NAME["--zero-stage"], choices=(0,), refused_values=())
    monkeypatch.setitem(command_line.BY_NAME, "--zero-stage", narrowed)
    assert main(["zero", *A100_1_3B, "--zero-stage", "1"]) == 2
    assert "argument --zero-stage: invalid choice: 1 (choose from 0)" in capsys.readouterr().err


def test_a_value_outside_the_declared_choices_is_one_line(capsys) -> None:
    assert main(["zero", *A100_1_3B, "--zero-stage", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --zero-stage: invalid choice: 5 (choose from 0, 1, 2, 3)" in err


def test_num_experts_one_is_the_dense_model() -> None:
    model = ["memory", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]
    model += ["--vocab-size", "128"]
    _, dense, _ = command_line.parse([*model, "--num-experts", "1", "--num-gpus", "8"])
    _, plain, _ = command_line.parse([*model, "--num-gpus", "8"])
    assert resolve(dense).model() == resolve(plain).model()  # Megatron-DeepSpeed's default: a dense model
