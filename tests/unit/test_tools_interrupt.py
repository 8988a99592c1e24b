"""Ctrl-C in a tool is one line and exit status 130, not a KeyboardInterrupt traceback (each tool writes its
outputs to temporary names and moves them into place when complete, so the line can say none is half-written)."""

from __future__ import annotations

import pytest

from megatron_ds.data.demo_corpus import _load_tool
from megatron_ds.errors import EXIT_INTERRUPTED, INTERRUPTED

TOOLS = {
    "preprocess_data": ("run", ["--input", "x.jsonl", "--output-prefix", "x", "--tokenizer-type", "NullTokenizer"]),
    "train_tokenizer": ("run", ["--input", "x.jsonl", "--model-prefix", "x", "--vocab-size", "64"]),
    "fix_append_eod_index": ("rewrite_index", ["--input", "x"]),
    "generate": ("run", []),
    "convert_checkpoint": ("run", []),
    "show_samples": ("samples", ["--seq-length", "8", "--mock-data"]),
}


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_ctrl_c_is_one_line_and_exit_130(name: str, monkeypatch, capsys) -> None:
    tool = _load_tool(name)
    inner, argv = TOOLS[name]
    monkeypatch.setattr(tool, inner, _interrupt)
    if name in ("preprocess_data", "train_tokenizer", "fix_append_eod_index"):
        monkeypatch.setattr(tool, "parse_args", lambda argv: _Args())  # no files are read before the call
    assert tool.main(argv) == EXIT_INTERRUPTED
    assert capsys.readouterr().err == f"error: {INTERRUPTED}\n"


class _Args:
    """What the tools' main reads before the interrupted call."""

    input = "x"
    output_prefix = "y"
