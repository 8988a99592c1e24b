"""Ctrl-C in a tool is one line and exit status 130, not a KeyboardInterrupt traceback (each tool writes its
outputs to temporary names and moves them into place when complete, so the line can say none is half-written)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ds.data.demo_corpus import _load_tool
from megatron_ds.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, INTERRUPTED, TERMINATED, Terminated

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


def _terminate(*args, **kwargs):
    raise Terminated


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_sigterm_is_one_line_and_exit_143(name: str, monkeypatch, capsys) -> None:
    """SIGTERM (`timeout`, SLURM, `docker stop`) stops a tool as Ctrl-C does once `stop_cleanly_on_sigterm` ran (each
    tool's `__main__`): the clean-up runs, one line, 128 + 15."""
    tool = _load_tool(name)
    inner, argv = TOOLS[name]
    monkeypatch.setattr(tool, inner, _terminate)
    if name in ("preprocess_data", "train_tokenizer", "fix_append_eod_index"):
        monkeypatch.setattr(tool, "parse_args", lambda argv: _Args())
    assert tool.main(argv) == EXIT_TERMINATED
    assert capsys.readouterr().err == f"error: {TERMINATED}\n"


def test_sigterm_removes_the_temporary_output_and_a_rerun_the_leftovers_of_a_kill(tmp_path) -> None:
    import os
    import signal

    from megatron_ds import files
    from megatron_ds.errors import stop_cleanly_on_sigterm

    previous = signal.getsignal(signal.SIGTERM)
    try:
        stop_cleanly_on_sigterm()
        with pytest.raises(Terminated):
            with files.atomic_directory(str(tmp_path / "out"), "output") as tmp:
                (tmp_path / "seen").write_text(tmp)
                os.kill(os.getpid(), signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert os.listdir(tmp_path) == ["seen"]  # the temporary directory went with the signal
    killed = tmp_path / ".out.incomplete.k1ll3d"  # what SIGKILL leaves: nothing ran
    killed.mkdir()
    (killed / "part").write_text("x")
    other = tmp_path / ".other.incomplete.k1ll3d"  # another output's: not ours to remove
    other.mkdir()
    with files.atomic_directory(str(tmp_path / "out"), "output") as tmp:
        (tmp_path / "out_tmp").write_text(tmp)
    assert sorted(os.listdir(tmp_path)) == [".other.incomplete.k1ll3d", "out", "out_tmp", "seen"]


class _Args:
    """What the tools' main reads before the interrupted call."""

    input = "x"
    output_prefix = "y"


@pytest.mark.parametrize(
    "error,said",
    [
        (OSError(28, "No space left on device"), "No space left on device"),
        (RuntimeError("basic_ios::clear: iostream error"), "basic_ios::clear: iostream error"),
    ],
)
def test_a_write_that_fails_is_one_line_and_leaves_nothing(tmp_path, error, said) -> None:
    # a conversion onto a full disk printed torch's C++ stream traceback; the data was safe, the message not
    from megatron_ds.errors import UserError
    from megatron_ds.files import atomic_directory

    with pytest.raises(UserError) as err:
        with atomic_directory(str(tmp_path / "out"), "OUT") as tmp:
            (Path(tmp) / "layer_01.pt").write_text("half")
            raise error
    assert str(err.value).startswith(f"OUT {tmp_path / 'out'}: writing failed ({said}; ")
    assert "nothing was written and the source is untouched" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    with pytest.raises(ValueError):  # any other error is not a write failure: it propagates as it is
        with atomic_directory(str(tmp_path / "out"), "OUT"):
            raise ValueError("a bug")
