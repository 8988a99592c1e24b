"""Bad input the entry-point audit found mishandled: each is now one `error:` line naming the flag or file, exit
status 2, no traceback, nothing written. In-process through each tool's `main` (an exception escaping it is the
traceback a user saw); one subprocess where the interpreter's own exit is the point."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ds.data.demo_corpus import _load_tool
from megatron_ds.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "megatron_deepspeed"
PAIR = "mds_gpt2_a_eod_text_document"
GPT2_TOKENIZER = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(FIXTURES / "vocab.json")]
GPT2_TOKENIZER += ["--merge-file", str(FIXTURES / "merges.txt")]
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]


def one_error_line(capsys: pytest.CaptureFixture, rc: int) -> str:
    """The single `error:` line of a failed run (its status 2), without the prefix."""
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0].removeprefix("error: ")


@pytest.fixture(scope="module")
def padded_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GPT-2 of 400 vocabulary rows imported with a tokenizer of 377 tokens (rows 377-399 have no text)."""
    import transformers

    from megatron_ds.interop.hf_import import import_hf

    root = tmp_path_factory.mktemp("padded")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, n_positions=64, vocab_size=400)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(root / "hf")
    import_hf(str(root / "hf"), str(root / "ours"), GPT2_TOKENIZER, show_progress=False)
    return root


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--vocab-size", "100", "--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size 0 must be >= 1"),
        (["--max-position-embeddings", "0"], "--max-position-embeddings 0 must be >= 1"),
        (["--group-query-attention", "--num-query-groups", "0"], "--num-query-groups 0 must be >= 1"),
    ],
    ids=["tp-0-was-ZeroDivisionError", "max-positions-0-was-seq-length", "query-groups-0-was-1"],
)
def test_pretrain_gpt_numeric_flags(extra: list[str], said: str, capsys: pytest.CaptureFixture) -> None:
    import pretrain_gpt

    assert one_error_line(capsys, pretrain_gpt.main([*MODEL, *extra, "--print-layout"])).startswith(said)


def test_a_file_as_tensorboard_dir_is_refused_before_any_process_group(tmp_path: Path) -> None:
    from megatron_ds.flags.parser import parse_config
    from megatron_ds.training.launch_checks import check_launch

    blocker = tmp_path / "tb"
    blocker.write_text("a file")
    line = [*MODEL, "--vocab-size", "100", "--lr", "1e-3", "--train-iters", "2", "--micro-batch-size", "1"]
    config, _ = parse_config([*line, "--mock-data", "--tensorboard-dir", str(blocker / "run")])
    for dry_run in (True, False):  # the logging rank's os.makedirs raised FileExistsError after start-up
        with pytest.raises(UserError, match=f"^--tensorboard-dir {blocker / 'run'}: {blocker} is a file, not a dir"):
            check_launch(config, dry_run=dry_run)
    assert blocker.read_text() == "a file"


def _corpus(tmp_path: Path) -> str:
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "one document"}\n{"text": "another one"}\n')
    return str(path)


@pytest.mark.parametrize(
    ("tool", "argv", "said"),
    [
        (
            "preprocess_data",
            ["--input", "{corpus}", "--output-prefix", "{tmp}/p", "--workers", "two", *GPT2_TOKENIZER],
            "argument --workers: invalid int value: 'two'; see `python tools/preprocess_data.py --help`",
        ),
        (
            "preprocess_data",
            ["--input", "{corpus}", "--output-prefix", "{corpus}/p", *GPT2_TOKENIZER],
            "--output-prefix {corpus}/p: {corpus} is a file, not a directory; choose a directory",
        ),
        (
            "preprocess_data",
            ["--input", "{corpus}", "--output-prefix", "{tmp}/taken", *GPT2_TOKENIZER],
            "{tmp}/taken_text_document.idx: a directory; remove it or give another --output-prefix",
        ),
        (
            "preprocess_data",
            ["--input", "{tmp}/corpus_text_document.idx", "--output-prefix", "{tmp}/corpus", *GPT2_TOKENIZER],
            "--output-prefix {tmp}/corpus: would write {tmp}/corpus_text_document.idx, which is an --input; give",
        ),
        (
            "train_tokenizer",
            ["--input", "{corpus}", "--model-prefix", "{tmp}/", "--vocab-size", "16"],
            "--model-prefix {tmp}/: ends in a directory; add a file name prefix",
        ),
        (
            "train_tokenizer",
            ["--input", "{corpus}", "--model-prefix", "{tmp}/taken", "--vocab-size", "16"],
            "{tmp}/taken.model: a directory; remove it or give another --model-prefix",
        ),
        (
            "fix_append_eod_index",
            [],
            "the following arguments are required: --input; see `python tools/fix_append_eod_index.py --help`",
        ),
        (
            "fix_append_eod_index",
            ["--input", "{data}", "--output-prefix", "{corpus}/eod"],
            "--output-prefix {corpus}/eod: {corpus} is a file, not a directory; choose a directory",
        ),
        (
            "show_samples",
            ["--data-path", "{data}", "--seq-length", "8", "--train-iters", "2", "--tokenizer-type"]
            + ["SentencePieceTokenizer", "--tokenizer-model", str(FIXTURES / "sp.model")],
            "{data}: train sample 0 holds token id 376, outside the vocabulary's 120 ids",
        ),
    ],
    ids=[
        "usage-error-was-usage-text",
        "output-under-a-file-was-errno",
        "output-is-a-directory-was-after-the-work",
        "output-is-the-input-was-replaced",
        "model-prefix-dir-wrote-.model",
        "model-path-is-a-directory-was-errno-after-training",
        "usage-error-was-usage-text-eod",
        "eod-output-under-a-file-was-errno",
        "other-tokenizer-was-IndexError",
    ],
)
def test_tools(
    tool: str, argv: list[str], said: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, capsys
) -> None:
    data = tmp_path_factory.mktemp("data")  # megatron-core writes its index cache beside the pair
    for ext in (".bin", ".idx"):
        (data / f"{PAIR}{ext}").write_bytes((FIXTURES / f"{PAIR}{ext}").read_bytes())
    corpus = _corpus(tmp_path)
    (tmp_path / "corpus_text_document.idx").write_text(Path(corpus).read_text())  # text, named like an output
    (tmp_path / "taken_text_document.idx").mkdir()
    (tmp_path / "taken.model").mkdir()
    before = sorted(os.listdir(tmp_path))
    fill = {"corpus": corpus, "tmp": str(tmp_path), "data": str(data / PAIR)}
    line = one_error_line(capsys, _load_tool(tool).main([a.format(**fill) for a in argv]))
    assert line.startswith(said.format(**fill))
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, no temporary file left
    assert (tmp_path / "corpus_text_document.idx").read_text() == Path(corpus).read_text()  # no input replaced


def test_generate_draws_no_id_the_tokenizer_lacks(padded_checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    generate = _load_tool("generate")
    ours = str(padded_checkpoint / "ours")
    # seed 1: rows 377-399 were drawn and the text printout raised KeyError
    assert generate.main(["--load", ours, "--prompt-ids", "1 2", "--max-new-tokens", "60", "--seed", "1"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    line = one_error_line(capsys, generate.main(["--load", ours, "--prompt-ids", "1 390"]))
    assert line == (
        "--prompt-ids '1 390': id 390 is not in the tokenizer's 377 tokens (the model's rows from 377 on are "
        "padding); give ids below 377"
    )


def test_generate_keeps_to_the_vocabulary_limit() -> None:
    from megatron_ds.inference import generate

    class Uniform(torch.nn.Module):  # every id equally likely, the padding rows the most likely under greedy
        config = type("C", (), {"vocab_size": 8, "max_position_embeddings": 64, "add_position_embedding": False})

        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))  # generate reads the device from it

        def forward(self, tokens: torch.Tensor, cache: object = None) -> torch.Tensor:
            return torch.arange(8.0).expand(*tokens.shape, 8) * 0.01

    sampled = generate(Uniform(), [1], 50, seed=0, vocab_limit=5)  # type: ignore[arg-type]
    assert max(sampled) <= 4 and len(set(sampled)) > 1
    assert generate(Uniform(), [1], 3, temperature=0.0, vocab_limit=5) == [4, 4, 4]  # type: ignore[arg-type]
    assert generate(Uniform(), [1], 3, temperature=0.0) == [7, 7, 7]  # type: ignore[arg-type]


def test_damaged_checkpoint_files_are_named_once(padded_checkpoint: Path, tmp_path: Path, capsys) -> None:
    convert = _load_tool("convert_checkpoint")
    ours = padded_checkpoint / "ours"
    broken = tmp_path / "broken"
    subprocess.run(["cp", "-r", str(ours), str(broken)], check=True)
    step = broken / (ours / "latest").read_text().strip()
    (step / "megatron_ds.json").write_text('{"config": ')
    line = one_error_line(capsys, convert.main(["--to", "hf", str(broken), str(tmp_path / "out")]))
    assert (
        line.startswith(f"{step / 'megatron_ds.json'}: unreadable (Expecting value") and line.count("unreadable") == 1
    )
    (step / "megatron_ds.json").write_text((ours / step.name / "megatron_ds.json").read_text())
    layer = sorted(step.glob("layer_*.pt"))[0]
    layer.write_bytes(b"")  # torch's own text advised re-saving with _use_new_zipfile_serialization
    line = one_error_line(capsys, convert.main(["--to", "hf", str(broken), str(tmp_path / "out")]))
    assert line == f"{layer}: unreadable (empty, 0 bytes); the checkpoint is damaged or truncated"
    layer.write_bytes(b"not a zip" * 100)
    line = one_error_line(capsys, convert.main(["--to", "hf", str(broken), str(tmp_path / "out")]))
    assert (
        line == f"{layer}: unreadable (not a zip archive, as torch.save writes); the checkpoint is damaged or truncated"
    )
    assert not (tmp_path / "out").exists()


def test_a_config_json_size_below_one_is_named_as_its_field(padded_checkpoint: Path, tmp_path: Path, capsys) -> None:
    hf = tmp_path / "hf"
    subprocess.run(["cp", "-r", str(padded_checkpoint / "hf"), str(hf)], check=True)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "n_embd": -32}))  # was: --hidden-size -32 must be >= 1
    line = one_error_line(capsys, _load_tool("convert_checkpoint").main(["--from", "hf", str(hf), str(tmp_path / "o")]))
    assert line == f"{hf / 'config.json'}: n_embd -32 must be >= 1; fix the config.json"
    assert not (tmp_path / "o").exists()


def test_the_process_exits_with_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_gpt.py"), *MODEL, "--vocab-size", "100", "--print-layout"]
        + ["--tensor-model-parallel-size", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["error: --tensor-model-parallel-size 0 must be >= 1"], proc.stderr


@pytest.mark.parametrize("section", ['"zero_optimization": []', '"fp16": true', '"bfloat16": 1'])
def test_a_deepspeed_json_section_that_is_not_an_object(section: str, tmp_path: Path) -> None:
    from megatron_ds.training.deepspeed_config import load_user_config

    path = tmp_path / "ds.json"
    path.write_text("{" + section + "}")  # was DeepSpeed's TypeError traceback on every rank at start-up
    name, value = (part.strip().strip('"') for part in section.split(":"))
    said = f"--deepspeed_config {path}: {name} is {value}, not a JSON object; write it"
    with pytest.raises(UserError, match="^" + re.escape(said)):
        load_user_config(str(path))


def test_tokenizer_files_without_a_type_for_an_upstream_conversion(tmp_path: Path, capsys) -> None:
    source = ROOT / "tests" / "fixtures" / "megatron_deepspeed_checkpoints" / "tp1_pp2_tied"
    convert = _load_tool("convert_checkpoint")
    argv = ["--from", "megatron-deepspeed", str(source), str(tmp_path / "out"), "--vocab-file", str(tmp_path / "v")]
    line = one_error_line(capsys, convert.main(argv))  # was ValueError: '--tokenizer-type' is not in list
    assert line == (
        f"--vocab-file {tmp_path / 'v'}: the checkpoint's tokenizer NullTokenizer takes no such file; give "
        "--tokenizer-type too"
    )
    assert os.listdir(tmp_path) == []


def test_a_megatron_deepspeed_pointer_to_a_missing_step(tmp_path: Path, capsys) -> None:
    source = tmp_path / "mds"
    fixture = ROOT / "tests" / "fixtures" / "megatron_deepspeed_checkpoints" / "tp1_pp2_tied"
    subprocess.run(["cp", "-r", str(fixture), str(source)], check=True)
    (source / "latest").write_text("global_step7")  # was: "not a Megatron-DeepSpeed checkpoint"
    line = one_error_line(
        capsys,
        _load_tool("convert_checkpoint").main(["--from", "megatron-deepspeed", str(source), str(tmp_path / "o")]),
    )
    assert line == (
        f"{source}: its pointer names 'global_step7', which holds no mp_rank_00_model_states.pt; give one of its "
        f"complete steps as the source, e.g. {source / 'global_step2'}"
    )


def test_a_memory_report_given_to_another_planner_command(capsys) -> None:
    from megatron_ds.plan.__main__ import main

    argv = ["pipeline", "--model", "1.3b", "--num-gpus", "8", "--gpu", "A100-80GB", "--oom-stage", "1"]
    assert one_error_line(capsys, main(argv)) == (  # was ignored: the plan printed as if it were not given
        "--oom-stage: read by the memory command only, not by pipeline; run `python -m megatron_ds.plan memory` (or "
        "no command), or drop the flag"
    )


def test_a_failed_eod_rewrite_leaves_no_half_pair(tmp_path: Path, monkeypatch) -> None:
    from megatron_ds.data import append_eod

    for ext in (".bin", ".idx"):
        (tmp_path / f"{PAIR}{ext}").write_bytes((FIXTURES / f"{PAIR}{ext}").read_bytes())
    before = sorted(os.listdir(tmp_path))

    def full_disk(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(append_eod.os, "replace", full_disk)  # after the .bin link, before the .idx is in place
    with pytest.raises(OSError):
        append_eod.rewrite_index(str(tmp_path / PAIR), str(tmp_path / "eod"))
    assert sorted(os.listdir(tmp_path)) == before  # the lone eod.bin link blocked every rerun ("exists")


def test_a_long_data_path_value_is_shortened_in_its_message() -> None:
    from megatron_ds.data.gpt_data import parse_data_path

    corpus = [json.dumps({"text": f"document {k} with 42 in it"}) for k in range(100)]  # a JSONL as --data-args-path
    with pytest.raises(UserError) as err:
        parse_data_path(" ".join(corpus).split())
    assert len(str(err.value)) < 300 and "(700 items)" in str(err.value)


def test_quantized_hugging_face_weights_are_refused(padded_checkpoint: Path, tmp_path: Path, capsys) -> None:
    from safetensors.torch import load_file, save_file

    convert = _load_tool("convert_checkpoint")
    hf = tmp_path / "hf"
    subprocess.run(["cp", "-r", str(padded_checkpoint / "hf"), str(hf)], check=True)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    line = one_error_line(capsys, convert.main(["--from", "hf", str(hf), str(tmp_path / "o")]))  # was imported
    assert line.startswith(f"{hf / 'config.json'}: quantization_config (gptq): a quantized model does not convert")
    (hf / "config.json").write_text(json.dumps(config))
    tensors = load_file(hf / "model.safetensors")
    name = "transformer.h.0.attn.c_attn.weight"
    tensors[name] = tensors[name].to(torch.int8)  # was cast to float: the integers became the weights
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    line = one_error_line(capsys, convert.main(["--from", "hf", str(hf), str(tmp_path / "o"), "--no-progress"]))
    assert line == (
        f"{hf / 'model.safetensors'}: tensor {name} is int8, not floating point (quantized weights?); give the "
        "model's unquantized weights"
    )
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_damaged_tokenizer_files_of_a_hugging_face_model_are_named_as_its_files(
    padded_checkpoint: Path, tmp_path: Path, capsys
) -> None:
    hf = tmp_path / "hf"
    subprocess.run(["cp", "-r", str(padded_checkpoint / "hf"), str(hf)], check=True)
    (hf / "tokenizer.json").write_text("{not json")
    line = one_error_line(capsys, _load_tool("convert_checkpoint").main(["--from", "hf", str(hf), str(tmp_path / "o")]))
    # was: "--tokenizer-model <dir>: ...", a flag the user never gave
    assert line.startswith(f"{hf}: its tokenizer files: not a Hugging Face tokenizer ("), line
    assert line.endswith("fix or remove them, or give the tokenizer with --tokenizer-type / --tokenizer-model"), line
    assert sorted(os.listdir(tmp_path)) == ["hf"]
