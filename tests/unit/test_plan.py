"""The `plan` advisor: DeepSpeed accepts its JSON, its layout is --print-layout's, bad input is one line."""

from __future__ import annotations

import json
import os
import re
import shlex

import pytest

from megatron_ds.model.naming import gpt_spec_groups
from megatron_ds.pipeline.layout import build_layout
from megatron_ds.plan import hardware, nvme, onebit, search, sections
from megatron_ds.plan.__main__ import main

A100_1_3B = ["--model", "1.3b", "--num-gpus", "8", "--gpu", "A100-80GB"]
A100_175B = ["--model", "175b", "--num-gpus", "1024", "--gpus-per-node", "8", "--gpu", "A100-80GB"]
V100_PP4 = [
    "--model",
    "1.3b",
    "--num-gpus",
    "8",
    "--gpu",
    "V100-32GB",
    "--pipeline-model-parallel-size",
    "4",
    "--micro-batch-size",
    "2",
    "--layout",
    "both",
]
SCENARIOS = {
    "1.3b-a100": A100_1_3B,
    "175b-a100": A100_175B,
    "1.3b-v100-pp4": V100_PP4,
    "2.7b-a10-offload": ["--model", "2.7b", "--num-gpus", "1", "--gpu", "A10", "--global-batch-size", "16"],
    "350m-4090-memory-layout": [
        "--model",
        "350m",
        "--num-gpus",
        "8",
        "--gpu",
        "RTX-4090",
        "--layout",
        "memory",
        "--pipeline-model-parallel-size",
        "4",
        "--tensor-model-parallel-size",
        "1",
    ],
}


def run_json(argv: list[str], capsys) -> tuple[int, dict]:
    rc = main([*argv, "--format", "json"])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def snippet_configs(report: dict) -> list[tuple[str, dict, int]]:
    """Every DeepSpeed JSON (dict snippet) in the report with the data-parallel size it is meant for."""
    gpus = report["inputs"].get("num_gpus", 1)
    found = []
    for sec in report["sections"]:
        data = sec["data"]
        if "data_parallel" in data:
            dp = data["data_parallel"]
        elif isinstance(data.get("recommended"), dict):
            dp = gpus // (data["recommended"]["tp"] * data["recommended"]["pp"])
        else:
            dp = 1
        for name, snippet in sec["snippets"].items():
            if isinstance(snippet, dict):
                found.append((f"{sec['name']}: {name}", snippet, dp))
    return found


@pytest.fixture(scope="module")
def ds_parser():
    """DeepSpeed's own config parser, `deepspeed.runtime.config.DeepSpeedConfig`.

    Its constructor asks `deepspeed.comm.get_rank()` and, given an mpu, takes the data-parallel
    world size from it for the batch-size check. Initialising deepspeed.comm on CPU JIT-builds a
    shared-memory op (a minute and a half), so only that one rank query is answered here (rank 0
    of one process); everything the parser checks runs unchanged.
    """
    import deepspeed.runtime.config as ds_config

    class Mpu:
        def __init__(self, dp: int) -> None:
            self.dp = dp

        def get_data_parallel_world_size(self) -> int:
            return self.dp

    def parse(config: dict, dp: int):
        base = {"train_batch_size": dp, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
        full = config if "train_batch_size" in config else {**base, **config}
        return ds_config.DeepSpeedConfig(json.loads(json.dumps(full)), mpu=Mpu(dp))

    patch = pytest.MonkeyPatch()
    patch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    yield parse
    patch.undo()


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_generated_deepspeed_json_is_accepted_by_installed_deepspeed(scenario, capsys, ds_parser) -> None:
    rc, report = run_json(SCENARIOS[scenario], capsys)
    assert rc in (0, 1), report
    configs = snippet_configs(report)
    assert any("train_batch_size" in config for _, config, _ in configs)  # at least one full DeepSpeed JSON
    for name, config, dp in configs:
        parsed = ds_parser(config, dp)
        if "train_batch_size" in config:
            assert parsed.train_batch_size == config["train_batch_size"], name
            assert parsed.gradient_accumulation_steps == config["gradient_accumulation_steps"], name


def test_offload_json_is_accepted_and_lets_a_torch_optimizer_through(ds_parser) -> None:
    from megatron_ds.plan import ds_json, search
    from megatron_ds.plan.inputs import PlanInputs, resolve
    from megatron_ds.training import deepspeed_config

    res = resolve(PlanInputs(model="1.3b", num_gpus=8, gpu="A100-80GB"))
    cand = search.evaluate(res, 1, 1, 1, 1, "bf16", False, "none")
    config = deepspeed_config.generate(ds_json.plan_config(res, cand), offload_optimizer="cpu")
    parsed = ds_parser(config, cand.dp)
    assert parsed.zero_config.offload_optimizer.device == "cpu"
    assert parsed.zero_force_ds_cpu_optimizer is False


def test_claims_about_the_installed_deepspeed(ds_parser) -> None:
    """Sparse attention is rejected; a OneBitAdam block parses (and would fail later); aio keys match."""
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS, DeepSpeedConfigError
    from deepspeed.runtime.swap_tensor.aio_config import AIO_DEFAULT_DICT

    from megatron_ds.plan import sparse_attention

    _, block = sparse_attention.PATTERNS["fixed"]
    with pytest.raises(DeepSpeedConfigError, match="Sparse Attention has been removed"):
        ds_parser({"sparse_attention": block}, 1)
    ds_parser(json.loads(next(iter(onebit.snippets(1e-4, 10).values()))), 1)
    assert (onebit.installed_onebit() is False) == ("onebitadam" not in DEEPSPEED_OPTIMIZERS)
    assert nvme.AIO_BLOCK["aio"] == AIO_DEFAULT_DICT


def test_model_states_in_zero_section_against_deepspeed_estimators(capsys) -> None:
    """The DeepSpeed column is its estimators; our ZeRO-2 row equals it, our ZeRO-3 rows add the 16-bit gradient
    partition DeepSpeed 0.19.8 allocates and the estimator leaves out (benchmarks/zero_memory.py)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from megatron_ds.model.shapes import largest_layer_params, total_params

    capsys.readouterr()  # DeepSpeed's accelerator line, printed to stdout once per process
    rc, report = run_json(["zero", *A100_175B], capsys)
    rows = {r["label"]: r for r in next(s for s in report["sections"] if s["name"] == "zero")["data"]["rows"]}
    m = hardware.model_config(
        num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048, vocab_size=hardware.GPT2_VOCAB_SIZE
    )
    psi, big = total_params(m), largest_layer_params(m)
    z2, z3 = (
        estimate_zero2_model_states_mem_needs(psi, 8, 128, False)[1],
        estimate_zero3_model_states_mem_needs(psi, big, 8, 128, False)[1],
    )
    assert rows["ZeRO-2"]["deepspeed_gpu"] == z2 and abs(rows["ZeRO-2"]["gpu_states"] - z2) <= 1
    assert rows["ZeRO-3"]["deepspeed_gpu"] == z3
    assert 0 < rows["ZeRO-3"]["gpu_states"] - z3 - 2 * psi / 1024 < 0.01 * z3  # + persistent biases and norms
    assert {r["engine"] for r in rows.values() if r["stage"] >= 2} == {"plain, P = 1"}


@pytest.mark.parametrize("scenario", ["1.3b-a100", "1.3b-v100-pp4", "175b-a100", "350m-4090-memory-layout"])
def test_pipeline_layout_is_what_print_layout_prints(scenario, capsys) -> None:
    rc, report = run_json(["pipeline", *SCENARIOS[scenario]], capsys)
    data = next(s for s in report["sections"] if s["name"] == "pipeline")["data"]
    dims = hardware.PRESETS["gpt3-" + SCENARIOS[scenario][1]]
    model = hardware.model_config(
        dims.num_layers,
        dims.hidden_size,
        dims.num_attention_heads,
        2048,
        hardware.GPT2_VOCAB_SIZE,
        tensor_parallel_size=data["tensor_parallel"],
    )
    groups = gpt_spec_groups(model)
    options = search.layout_options(data["layout_method"])
    v = data["virtual_stages"]  # the chosen schedule's chunks per rank
    if "partition_method" in options:  # a planned partition method is passed as its layout string
        expected = build_layout(groups, data["pipeline_parallel"], layout=data["layout"], virtual_stages=v)
    else:
        expected = build_layout(groups, data["pipeline_parallel"], virtual_stages=v, **options)
    assert data["layout_text"] == expected.format(data["data_parallel"], data["tensor_parallel"])
    # and pretrain_gpt.py --print-layout with the printed command's flags prints the same table
    command = next(s for s in report["sections"] if s["name"] == "pipeline")["snippets"]["command"]
    argv = shlex.split(command.split("pretrain_gpt.py", 1)[1].replace("\\\n", " "))
    import pretrain_gpt

    argv = [a for a in argv if a != "--fp16"]  # pretrain_gpt refuses --fp16 without a GPU; the layout ignores it
    assert pretrain_gpt.main([*argv, "--print-layout", "--world-size", str(report["inputs"]["num_gpus"])]) == 0
    table, *notes = capsys.readouterr().out.strip().split("\nvocabulary: ")  # then the padding, as Megatron prints it
    assert table == data["layout_text"] and len(notes) <= 1


def test_printed_command_builds_the_planned_config(capsys) -> None:
    from megatron_ds.flags.parser import parse_config

    rc = main(["pipeline", *V100_PP4, "--precision", "fp32", "--write-command"])
    out = capsys.readouterr().out
    assert rc == 0
    command = out.split("-- pretrain_gpt.py command --\n", 1)[1].split("\n\n")[0]
    argv = shlex.split(command.split("pretrain_gpt.py", 1)[1].replace("\\\n", " "))
    config, _ = parse_config(argv, world_size=8)
    assert config.parallel.pipeline_model_parallel_size == 4 and config.parallel.data_parallel_size == 2
    assert config.parallel.pp_dedicated_embedding_stages == "both"
    assert config.training.micro_batch_size == 2 and config.training.global_batch_size == 512
    assert config.model.vocab_size == 50304


def test_write_config_matches_the_generated_json(tmp_path, capsys) -> None:
    path = tmp_path / "ds.json"
    rc = main(["pipeline", *A100_1_3B, "--write-config", str(path), "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    pipeline = next(s for s in report["sections"] if s["name"] == "pipeline")
    assert json.loads(path.read_text()) == pipeline["snippets"]["DeepSpeed JSON"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["pipeline", "--model", "1.3b", "--num-gpus", "8", "--gpu", "B200"], "--gpu 'B200' is not in the table"),
        (
            ["pipeline", *A100_1_3B, "--zero-stage", "3", "--pipeline-model-parallel-size", "2"],
            "--zero-stage 3 with --pipeline-model-parallel-size 2: DeepSpeed's pipeline engine supports ZeRO 0 and 1",
        ),
        (
            ["precision", "--gpu", "V100-32GB", "--precision", "bf16"],
            "--precision bf16 needs compute capability >= 8.0",
        ),
        (
            ["pipeline", "--model", "175b", "--num-gpus", "8", "--gpu", "A100-80GB", "--cpu-memory-gb", "1024"],
            "the model does not fit",
        ),
        (
            [
                "pipeline",
                "--model",
                "13b",
                "--num-gpus",
                "8",
                "--gpu",
                "A100-40GB",
                "--pipeline-model-parallel-size",
                "2",
                "--tensor-model-parallel-size",
                "1",
                "--no-checkpoint-activations",
            ],
            "does not fit",
        ),
        (
            ["pipeline", *A100_1_3B, "--micro-batch-size", "3"],
            "use a multiple of 3 (micro-batch 3 x data-parallel 1 at t=8, p=1), e.g. 510 or 513",
        ),
        (
            [
                "pipeline",
                *A100_1_3B,
                "--global-batch-size",
                "8",
                "--micro-batch-size",
                "2",
                "--tensor-model-parallel-size",
                "1",
                "--pipeline-model-parallel-size",
                "1",
            ],
            "use a multiple of 16 (micro-batch 2 x data-parallel 8 at t=1, p=1), e.g. 16",
        ),
        (
            ["pipeline", *A100_1_3B, "--checkpoint-activations", "--recompute-activations"],
            "were both asked for; keep one",
        ),
        (
            ["pipeline", *A100_1_3B, "--pp-schedule", "zbh1", "--num-virtual-stages-per-pipeline-rank", "2"],
            "2 virtual stages per rank run only on the interleaved schedule, not --pp-schedule zbh1",
        ),
        (
            ["pipeline", *A100_1_3B, "--enable-zbh1-pipeline", "--num-virtual-stages-per-pipeline-rank", "2"],
            "--enable-zbh1-pipeline with 2 virtual stages per rank: ZB-H1 runs one stage per rank here",
        ),  # pretrain_gpt.py's words (flags/schedule_flags.named_schedule), not a --pp-schedule the line lacks
        (["pipeline", *A100_1_3B, "--pp-schedule", "interleaved", "--pipeline-model-parallel-size", "1"], "needs"),
        (["pipeline", *A100_1_3B, "--enable-zbh1-pipeline", "--zero-stage", "3"], "runs ZeRO 0 and 1 only"),
        (
            ["pipeline", *A100_1_3B, "--num-virtual-stages-per-pipeline-rank", "5"],
            "--num-virtual-stages-per-pipeline-rank 5 runs on no configuration of --num-gpus 8 here: it needs P >= 2 "
            "pipeline ranks, ZeRO 0 or 1, the 24 layers split into 5 x P chunks",
        ),
        (["pipeline", "--num-gpus", "8"], "Which model?"),
        (["zero", "--model", "1.3b"], "How many GPUs in total? (--num-gpus)"),
        (
            ["pipeline", "--model", "1.3b", "--num-gpus", "12", "--gpus-per-node", "8", "--gpu", "H100"],
            "--num-gpus 12 is not a multiple of --gpus-per-node 8",
        ),
        (["pipeline", "--num-layers", "30", "--hidden-size", "100"], "model size is incomplete"),
        (["pipeline", "--model", "1.3b", "--hidden-size", "100"], "--hidden-size 100 is not divisible"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["memory", *A100_1_3B, "--reported-mb", "first=ten"], "--reported-mb 'first=ten'"),
        (
            ["pipeline", "--model", "llama2-7b", "--num-gpus", "8", "--gpu-memory-gb", "80"],
            "Which GPU generation (it decides bf16 or fp16)? --gpu NAME, --compute-capability MAJOR.MINOR",
        ),  # not bf16 assumed
        (
            [
                "pipeline",
                "--model",
                "llama2-7b",
                "--num-gpus",
                "8",
                "--gpu-memory-gb",
                "80",
                "--compute-capability",
                "99.0",
            ],
            "--compute-capability '99.0' is no CUDA compute capability; give the GPU's",
        ),
        (
            ["memory", *V100_PP4, "--reported-mb", "first=100,middle=0,last=50"],
            "--reported-mb 'first=100,middle=0,last=50': middle=0 is not a memory figure; give MB above 0",
        ),
        (["memory", *V100_PP4, "--reported-mb", "first=-100,middle=50,last=60"], "first=-100 is not a memory"),
        (
            ["memory", *V100_PP4, "--reported-mb", "10,20"],
            "--reported-mb '10,20': 2 values for a 4-stage pipeline; give 4 values or first=MB,middle=MB,last=MB",
        ),
        (
            ["memory", *A100_1_3B, "--pipeline-model-parallel-size", "1", "--reported-mb", "10,20"],
            "a 1-stage pipeline has no first and last stages to compare",
        ),
        (
            ["pipeline", *A100_1_3B, "--num-layers", "100000"],
            "--num-layers 100000: the planner prices models of at most 512 transformer layers",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err and "Traceback" not in err


def test_zero_without_a_batch_prints_its_table_and_asks_for_the_batch_to_recommend(tmp_path, capsys) -> None:
    """`zero` needs no batch for its table; its recommendation (the `pipeline` choice) does. It gave a TypeError
    traceback when neither --global-batch-size nor a preset gave one."""
    dims = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048"]
    argv = ["zero", *dims, "--vocab-size", "50257", "--num-gpus", "64", "--gpu", "H100-80GB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "ZeRO-1" in out and "Traceback" not in out
    assert "No recommendation: choosing a configuration needs the batch: give --global-batch-size" in out
    assert main([*argv, "--write-config", str(tmp_path / "ds.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == "error: choosing a configuration needs the batch: give --global-batch-size (samples per optimizer step)"
    )
    assert not (tmp_path / "ds.json").exists()
    assert main([*argv, "--global-batch-size", "512"]) == 0
    assert "Recommended for pretrain_gpt.py" in capsys.readouterr().out


def test_unknown_gpu_with_memory_is_accepted(capsys) -> None:
    rc, report = run_json(
        [
            "pipeline",
            "--model",
            "1.3b",
            "--num-gpus",
            "8",
            "--gpu",
            "B200",
            "--gpu-memory-gb",
            "192",
            "--compute-capability",
            "9.0",
        ],
        capsys,
    )
    assert rc == 0 and report["all_checks_pass"]


def test_sequence_parallel_at_tensor_parallel_1_is_said_to_change_nothing(capsys) -> None:
    """As pretrain_gpt.py says (and Megatron-LM does): the flag is dropped at t = 1, not silently."""
    args = ["pipeline", *A100_1_3B, "--tensor-model-parallel-size", "1"]
    for flags, said in (([], False), (["--sequence-parallel"], True)):
        rc, report = run_json([*args, *flags], capsys)
        texts = [c["text"] for s in report["sections"] for c in s["checks"] if c["ok"] is False and not c["blocking"]]
        assert rc == 0 and report["all_checks_pass"]
        assert any("--sequence-parallel changes nothing at tensor parallel 1" in t for t in texts) is said


def test_profile_round_trip_never_asks_twice(tmp_path, capsys) -> None:
    profile = tmp_path / "me.json"
    rc = main(["pipeline", *A100_1_3B, "--global-batch-size", "256", "--save-profile", str(profile)])
    first = capsys.readouterr().out
    assert rc == 0 and profile.exists()
    saved = json.loads(profile.read_text())
    assert saved["inputs"]["global_batch_size"] == 256 and saved["handled"] == ["pipeline"]
    assert main(["pipeline", "--profile", str(profile)]) == 0
    second = capsys.readouterr().out
    assert second.split("\n", 1)[1].split("Profile", 1)[-1]  # a note names the reused profile
    assert "handled before: pipeline" in second
    strip = lambda text: "\n".join(ln for ln in text.splitlines() if not ln.startswith("Profile "))  # noqa: E731
    assert strip(first) == strip(second)
    assert main(["zero", "--profile", str(profile), "--num-gpus", "16", "--save-profile", str(profile)]) == 0
    capsys.readouterr()
    again = json.loads(profile.read_text())
    assert again["inputs"]["num_gpus"] == 16 and again["handled"] == ["pipeline", "zero"]


def test_bad_profile_is_one_line(tmp_path, capsys) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    assert main(["--profile", str(path)]) == 2
    assert "--profile" in capsys.readouterr().err
    path.write_text(json.dumps({"format": "megatron_ds.plan profile v1", "inputs": {"gpus": 8}}))
    assert main(["--profile", str(path)]) == 2
    assert "unknown input(s) gpus" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("inputs", "needle"),
    [
        ({"num_gpus": "eight"}, 'input num_gpus is "eight", not an integer'),
        ({"num_gpus": True}, "input num_gpus is true, not an integer"),
        ({"num_gpus": 8.5}, "input num_gpus is 8.5, not an integer"),
        ({"model": ["llama2-7b"]}, 'input model is ["llama2-7b"], not a string'),
        ({"memory_headroom": "x"}, 'input memory_headroom is "x", not a number'),
        ({"architecture": [1]}, "input architecture is [1], not a list"),
        ([1, 2], '"inputs" must be an object and "handled" a list of names'),
        (None, '"inputs" must be an object'),
    ],
)
def test_a_profile_value_of_the_wrong_type_is_one_line(tmp_path, capsys, inputs, needle) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"format": "megatron_ds.plan profile v1", "handled": ["pipeline"], "inputs": inputs}))
    assert main(["pipeline", "--profile", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --profile {path}: ") and needle in err and "\n" not in err, err
    assert err.endswith("fix or re-create it with --save-profile")


def test_default_runs_every_workflow_and_json_has_the_same_sections(capsys) -> None:
    rc = main(A100_1_3B)
    text = capsys.readouterr().out
    rc_json, report = run_json(A100_1_3B, capsys)
    assert rc == rc_json == 0
    names = [s["name"] for s in report["sections"]]
    assert names == [s.name for s in sections.selected(sections.ALL)] == ["zero", "precision", "pipeline", "memory"]
    for sec in report["sections"]:
        assert f"== {sec['title']} ==" in text
    assert text.startswith("Every memory or time figure below is an estimate")
    assert "== Checks ==" in text and re.search(r"^\[ok\] memory: largest stage", text, re.M)
    assert "measured" not in text.replace("nothing was measured", "")


def test_precision_by_compute_capability(capsys) -> None:
    for gpu, expected in (("V100-32GB", "fp16"), ("A100-80GB", "bf16"), ("H100-80GB", "bf16"), ("P100-16GB", "fp16")):
        rc, report = run_json(["precision", "--gpu", gpu], capsys)
        data = report["sections"][0]["data"]
        assert data["recommended"] == expected
        assert data["fp8_capable"] == (gpu == "H100-80GB")
    rc, report = run_json(["precision", "--gpu", "H100"], capsys)
    assert "no fp8 switch" in " ".join(report["sections"][0]["text"])


def test_memory_advice_for_the_seed_pattern(capsys) -> None:
    rc, report = run_json(["memory", *V100_PP4[:-2], "--reported-mb", "first=10824,middle=8041,last=10980"], capsys)
    sec = report["sections"][0]
    text = " ".join(sec["text"])
    assert "word embedding" in text and "LM head" in text
    names = [c["name"] for c in sec["data"]["changes"]]
    assert names[-1].startswith("1-bit Adam") and sec["data"]["changes"][-1]["saving"] == 0
    assert any(n.startswith("rebalance stages") for n in names) and "activation recomputation" in names
    costs = [c["cost_rank"] for c in sec["data"]["changes"]]
    assert costs == sorted(costs)


def test_nvme_handle_choice(capsys) -> None:
    rc, report = run_json(["nvme", "--storage", "nvme", "--tensor-device", "cuda"], capsys)
    assert report["sections"][0]["data"]["handle"] == "gds_handle"
    rc, report = run_json(["nvme", "--storage", "nvme", "--tensor-device", "cpu"], capsys)
    assert report["sections"][0]["data"]["handle"] == "aio_handle"


def test_plot_without_matplotlib_is_reported(tmp_path, capsys, monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    rc = main(["pipeline", *A100_1_3B, "--plot", str(tmp_path / "m.png")])
    out = capsys.readouterr().out
    assert rc == 1 and "matplotlib is not installed" in out and not (tmp_path / "m.png").exists()


def test_padded_vocab_matches_pretrain_gpt() -> None:
    from megatron_ds.flags.parser import parse_config

    for v, t in ((50257, 1), (50257, 8), (32000, 4), (128, 1)):
        argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "16"]
        argv += ["--vocab-size", str(v), "--tensor-model-parallel-size", str(t), "--train-iters", "1", "--lr", "1"]
        planned = hardware.model_config(2, 64, 8, 16, v, tensor_parallel_size=t).vocab_size
        assert planned == parse_config(argv, world_size=t)[0].model.vocab_size


def test_console_entry_point_is_importable_without_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, megatron_ds.plan.__main__ as m, megatron_ds.plan.cli as c; "
        "c.run; assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.getcwd())


def test_sparse_attention_share_is_the_compute_models_and_sees_the_head_size() -> None:
    """The sparse-attention guide's attention share comes from the compute model: Narayanan et al.'s s / (6h + s)
    for a GPT layer (the softmax's few FLOPs aside), larger with a head size above h / a (`--kv-channels`)."""
    import dataclasses

    from megatron_ds.config import ModelConfig
    from megatron_ds.plan.sparse_attention import attention_share

    gpt = ModelConfig(
        num_layers=2,
        hidden_size=2048,
        num_attention_heads=16,
        ffn_hidden_size=8192,
        seq_length=2048,
        max_position_embeddings=2048,
        vocab_size=1000,
    )
    assert abs(attention_share(gpt) - 2048 / (6 * 2048 + 2048)) < 1e-3
    wide = attention_share(dataclasses.replace(gpt, kv_channels=256))  # heads x 256 = 2h of attention width
    # s / (4h + s): 8bs^2h of 16bsh^2 (q, k, v, o each 2h wide) + 16bsh^2 (MLP) + 8bs^2h
    assert abs(wide - 2048 / (4 * 2048 + 2048)) < 1e-3
