"""Megatron-LM's `--data-args-path` and `--per-split-data-args-path`: the data paths read from files as its
`get_blend_and_blend_per_split` reads them, so a line gets exactly the DataConfig (hence the samples) of the same
paths given on the command line; the pairs Megatron-LM resolves silently are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ds.config import DataConfig
from megatron_ds.errors import ConfigError
from megatron_ds.flags.dry_run import launch_gaps
from megatron_ds.flags.parser import build_parser, parse_config

BASE = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
BASE += ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3"]
BASE += ["--vocab-size", "128"]


def parse(*argv: str) -> DataConfig:
    return parse_config([*BASE, *argv], world_size=1)[0].data


def _file(tmp_path: Path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


def test_data_args_path_is_data_path_from_a_file(tmp_path: Path) -> None:
    blend = _file(tmp_path, "blend.txt", "0.7 /d/a_text_document\n  0.3\t/d/b_text_document\n")
    given = parse("--data-args-path", blend)
    assert given.data_path == ("0.7", "/d/a_text_document", "0.3", "/d/b_text_document")
    # a Megatron-LM flag: --data-upstream auto takes megatron-core's rules, as the same paths with that flag would
    assert given == parse("--data-path", *given.data_path, "--data-upstream", "megatron-lm")


def test_per_split_data_args_path_takes_strings_lists_and_null(tmp_path: Path) -> None:
    doc = {"train": "0.7 A 0.3 B", "valid": ["B"], "test": None}
    given = parse("--per-split-data-args-path", _file(tmp_path, "splits.json", json.dumps(doc)))
    assert given.split_paths == (("0.7", "A", "0.3", "B"), ("B",), ())
    same = ("--train-data-path", "0.7", "A", "0.3", "B", "--valid-data-path", "B", "--data-upstream", "megatron-lm")
    assert given == parse(*same)
    numbers = parse(
        "--per-split-data-args-path", _file(tmp_path, "n.json", '{"train": [1, "A"], "valid": null, "test": "C"}')
    )
    assert numbers.split_paths == (("1", "A"), (), ("C",))


def test_a_line_reading_its_data_from_a_file_needs_no_data_path() -> None:
    args = build_parser().parse_args([*BASE, "--data-args-path", "f"])
    assert not any("--data-path" in gap for gap in launch_gaps(args))


@pytest.mark.parametrize(
    "make, argv, message",
    [
        (
            {"b_txt": "A"},
            ["--data-args-path", "{b_txt}", "--data-path", "A"],
            "--data-args-path {b_txt} and --data-path were both given (Megatron-LM asserts); keep one",
        ),
        ({"e_txt": " \n"}, ["--data-args-path", "{e_txt}"], "--data-args-path {e_txt}: the file is empty"),
        (
            {},
            ["--data-args-path", "{missing}"],
            "--data-args-path {missing}: cannot read it (No such file or directory)",
        ),
        (
            {"s_json": '{"train": "A", "valid": null, "test": null}'},
            ["--per-split-data-args-path", "{s_json}", "--train-data-path", "A"],
            "--per-split-data-args-path {s_json} and --train-data-path were both given (Megatron-LM would read only "
            "the file); keep one",
        ),
        (
            {"s_json": '{"train": "A", "valid": null, "test": null}'},
            ["--per-split-data-args-path", "{s_json}", "--data-path", "A"],
            "--per-split-data-args-path {s_json} and --data-path were both given (Megatron-LM would read only "
            "--data-path); keep one",
        ),
        (
            {"s_json": '{"train": "A"'},
            ["--per-split-data-args-path", "{s_json}"],
            "--per-split-data-args-path {s_json}: not JSON",
        ),
        (
            {"s_json": '{"train": "A", "valid": null}'},
            ["--per-split-data-args-path", "{s_json}"],
            "--per-split-data-args-path {s_json}: no 'test' key (Megatron-LM needs all three)",
        ),
        (
            {"s_json": '{"train": {"a": 1}, "valid": null, "test": null}'},
            ["--per-split-data-args-path", "{s_json}"],
            "--per-split-data-args-path {s_json}: 'train' is {{\"a\": 1}}; give a string or a list",
        ),
        (
            {"s_json": '{"train": "A", "valid": [], "test": null}'},
            ["--per-split-data-args-path", "{s_json}"],
            "--per-split-data-args-path {s_json}: 'valid' names no data; give its prefix (or blend), or null",
        ),
    ],
)
def test_bad_files_and_pairs_are_one_line(tmp_path: Path, make: dict[str, str], argv: list[str], message: str) -> None:
    names = {name: _file(tmp_path, name.replace("_", "."), text) for name, text in make.items()}
    names["missing"] = str(tmp_path / "missing.txt")
    argv = [a.format(**names) for a in argv]
    with pytest.raises(ConfigError) as err:
        parse(*argv)
    text = str(err.value)
    assert text.startswith(message.format(**names)) and "\n" not in text
