"""Megatron-DeepSpeed mixture-of-experts checkpoints -> ours (`tools/convert_checkpoint.py --from megatron-deepspeed`).

The fixtures `moe_ep2_zero0` and `moe_residual_ep2_zero2` in tests/fixtures/megatron_deepspeed_checkpoints/ were
written by upstream's own `pretrain()` (GPTModel, `--no-pipeline-parallel`, 2 ranks at expert-parallel size 2, routing
without token dropping; README.md there). Checked here: the architecture and routing flags come from the saved args;
the converted model (one process, every expert by its global index) computes upstream's logits; the optimizer state is
the run's Adam state (the step between the two saved checkpoints is the update its converted moments give); a
converted run continues under another world size, expert-parallel size and ZeRO stage; a converted checkpoint is a
`--kd` teacher computing upstream's logits, each expert-parallel rank reading its own experts; what is not built is
refused in one line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ds.config import Config
from megatron_ds.interop.megatron_deepspeed import import_megatron_deepspeed
from megatron_ds.testing.launch import forked_gloo_ranks
from megatron_ds.training.checkpoint.directory import META, CheckpointError
from megatron_ds.training.checkpoint.universal.convert import convert_checkpoint
from megatron_ds.training.checkpoint.universal.store import Universal
from megatron_ds.testing.script_runs import run_python

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "megatron_deepspeed_checkpoints"
CASES = ("moe_ep2_zero0", "moe_residual_ep2_zero2")


@pytest.fixture(scope="module")
def convert(tmp_path_factory: pytest.TempPathFactory):
    """convert(case, sub="") -> the output directory (each conversion once)."""
    done: dict[tuple[str, str], Path] = {}
    base = tmp_path_factory.mktemp("converted_moe")

    def run(case: str, sub: str = "") -> Path:
        if (case, sub) not in done:
            out = base / "-".join(k for k in (case, sub) if k)
            import_megatron_deepspeed(str(FIXTURES / case / sub), str(out), show_progress=False)
            done[(case, sub)] = out
        return done[(case, sub)]

    return run


def _config(out: Path) -> Config:
    tag = (out / "latest").read_text().strip()
    return Config.from_dict(json.loads((out / tag / META).read_text())["config"])


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("moe_ep2_zero0", dict(num_experts=(4,), expert_interval=2, mlp_type="standard", moe_top_k=1)),
        ("moe_residual_ep2_zero2", dict(num_experts=(2,), expert_interval=1, mlp_type="residual", moe_top_k=2)),
    ],
)
def test_the_architecture_and_routing_come_from_the_saved_args(convert, case: str, expected: dict) -> None:
    config = _config(convert(case))
    model = config.model
    assert {k: getattr(model, k) for k in expected} == expected
    assert not model.moe_token_dropping  # --disable-moe-token-dropping
    assert (model.moe_train_capacity_factor, model.moe_eval_capacity_factor, model.moe_min_capacity) == (1.0, 1.0, 4)
    assert model.moe_loss_coeff == 0.1
    assert model.moe_top2_2nd_expert_sampling is (case == "moe_ep2_zero0")  # the residual case disabled it
    assert config.parallel.expert_parallel_size == 2
    assert config.optimizer.create_moe_param_group is (case == "moe_residual_ep2_zero2")
    assert model.experts_per_layer == ((1, 4, 1) if case == "moe_ep2_zero0" else (2, 2, 2))


def _one_process_logits(rank: int, out: str, tokens: torch.Tensor) -> list:
    """Our model at E = 1 in one process, weights from the converted universal form, in evaluation."""
    import os

    import deepspeed

    import megatron_ds
    from megatron_ds.distributed import skip_cpu_shared_memory_allreduce
    from megatron_ds.training.checkpoint.universal import restore
    from megatron_ds.training.checkpoint.universal.deepspeed_source import FP32

    os.environ["LOCAL_RANK"] = str(rank)
    skip_cpu_shared_memory_allreduce()
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, verbose=False)  # takes over the rank's torch group
    config = _config(Path(out))
    config = dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, expert_parallel_size=1, world_size=1)
    )
    universal = Universal(str(Path(out) / f"{(Path(out) / 'latest').read_text().strip()}.universal"))
    pipe = megatron_ds.build_pipeline(config)  # the forked rank tears its group down itself
    restore.load_weights(pipe.engine, config, pipe.layout, lambda t: universal.read(t.name, FP32))
    pipe.model.eval()
    with torch.no_grad():
        return pipe.model(tokens).tolist()


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_megatron_deepspeeds(convert, tmp_path: Path, case: str) -> None:
    out = convert(case)
    reference = torch.load(FIXTURES / case / "reference.pt", weights_only=True)
    (ours,) = forked_gloo_ranks(_one_process_logits, 1, str(tmp_path / "store"), str(out), reference["tokens"])
    assert isinstance(ours, list), ours
    torch.testing.assert_close(torch.tensor(ours), reference["logits"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_optimizer_state_is_the_runs_adam_state(convert, case: str) -> None:
    """Upstream's second step, w2 = w1 - lr/(1-b1^2) m / (sqrt(v)/sqrt(1-b2^2) + eps), holds for every tensor, every
    expert by its global index, with the converted step-2 moments."""
    first = Universal(str(convert(case, "global_step1") / "global_step1.universal"))
    second = Universal(str(convert(case) / "global_step2.universal"))
    assert second.states == ["exp_avg", "exp_avg_sq"]
    lr, b1, b2, eps = 1e-3, 0.9, 0.999, 1e-8  # make_fixture.py's flags
    experts = [n for n in second.tensors if ".deepspeed_experts." in n]
    assert len(experts) == (4 * 4 if case == "moe_ep2_zero0" else 3 * 2 * 4)  # fc1 and fc2, weights and biases
    for name, entry in second.tensors.items():
        assert entry["step"] == 2
        m, v = second.read(name, "exp_avg"), second.read(name, "exp_avg_sq")
        predicted = first.read(name, "fp32") - (lr / (1 - b1**2)) * m / (v.sqrt() / math.sqrt(1 - b2**2) + eps)
        torch.testing.assert_close(second.read(name, "fp32"), predicted, rtol=0, atol=1e-7, msg=name)


def test_the_masters_are_the_models_weights(convert, tmp_path: Path) -> None:
    """ZeRO-2's fp32 partitions (dense over both ranks, each expert on its own rank) join to the weights upstream's
    files hold (a conversion without the optimizer files reads those)."""
    case = "moe_residual_ep2_zero2"
    copy = tmp_path / "weights_only" / "global_step2"
    shutil.copytree(FIXTURES / case / "global_step2", copy)
    for path in copy.glob("*_optim_states.pt"):
        path.unlink()
    result = import_megatron_deepspeed(str(copy), str(tmp_path / "out"), show_progress=False)
    assert result.states == []
    weights = Universal(str(tmp_path / "out" / "global_step2.universal"))
    masters = Universal(str(convert(case) / "global_step2.universal"))
    for name in masters.tensors:
        assert torch.equal(weights.read(name, "fp32"), masters.read(name, "fp32")), name


def _refused(tmp_path: Path, **changes: object) -> str:
    """The conversion's error for moe_ep2_zero0 with its saved args changed."""
    from megatron_ds.interop import megatron_deepspeed_args as saved_args
    from megatron_ds.interop import megatron_deepspeed_files as mds_files

    ckpt = mds_files.open_megatron_deepspeed(str(FIXTURES / "moe_ep2_zero0"))
    ckpt = dataclasses.replace(ckpt, args={**ckpt.args, **changes})
    with pytest.raises(CheckpointError) as err:
        saved_args.config_from_args(ckpt, ["--tokenizer-type", "NullTokenizer"])
    assert "\n" not in str(err.value)
    return str(err.value)


def test_what_is_not_built_is_refused_in_one_line(tmp_path: Path) -> None:
    assert "saved by GPTModelPipe" in _refused(tmp_path, no_pipeline_parallel=False)
    assert "--tensor-model-parallel-size 2" in _refused(tmp_path, tensor_model_parallel_size=2)
    assert "saved in bf16" in _refused(tmp_path, bf16=True)
    assert "--enable-expert-tensor-parallelism" in _refused(tmp_path, enable_expert_tensor_parallelism=True)
    assert "--use-tutel" in _refused(tmp_path, use_tutel=True)


def test_a_converted_run_continues_under_another_world_size_and_zero_stage(convert, tmp_path: Path) -> None:
    """PR-MoE saved by 2 ranks at E = 2 under ZeRO-2 -> one process (E = 1, ZeRO 0): a third step, Adam's from 2."""
    out = convert("moe_residual_ep2_zero2")
    result_flags = (
        "--num-layers 3 --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 16 "
        "--max-position-embeddings 16 --make-vocab-size-divisible-by 16 --vocab-size 100 --num-experts 2 "
        "--expert-interval 1 --mlp-type residual --topk 2 --disable-moe-token-dropping "
        "--disable-moe-top2-2nd-expert-sampling --create-moe-param-group --hidden-dropout 0.0 --attention-dropout 0.0 "
        "--micro-batch-size 2 --global-batch-size 4 --train-iters 3 --lr 0.001 --lr-decay-style constant "
        "--lr-decay-iters 2 --mock-data --num-workers 0 --log-interval 1 --eval-iters 0"
    ).split()
    saved = tmp_path / "saved"
    cmd = [str(ROOT / "pretrain_gpt.py"), *result_flags, "--load", str(out), "--save", str(saved)]
    run = run_python(cmd, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "was saved with Megatron-DeepSpeed (converted" in run.stdout
    assert "using its universal form" in run.stdout
    assert "iteration        3/       3" in run.stdout
    convert_checkpoint(str(saved), str(tmp_path / "universal"), show_progress=False)
    assert Universal(str(tmp_path / "universal" / "global_step3")).group_step("decay") == 3
    # its weights alone (no DeepSpeed files in a converted checkpoint: they come from its universal form)
    fresh = [*cmd[: cmd.index("--save")], "--save", str(tmp_path / "fresh"), "--no-load-optim"]
    run = run_python(fresh, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "NOTICE: --no-load-optim" in run.stdout and "iteration        3/       3" in run.stdout


def _teacher_logits(rank: int, good: str, damaged: str, tokens: torch.Tensor) -> dict:
    """A dense 2-layer student's --kd teacher from the converted checkpoint at expert-parallel size 2 (this rank holds
    2 of its 4 experts): its logits of `tokens`; and the error of loading `damaged` (a tensor of expert 3 altered), or None."""
    from types import SimpleNamespace

    import deepspeed
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    from megatron_ds.model.gpt_pipe import build_topology
    from megatron_ds.model.tensor_parallel import NO_TENSOR_PARALLEL
    from megatron_ds.distributed import skip_cpu_shared_memory_allreduce
    from megatron_ds.training import distillation

    skip_cpu_shared_memory_allreduce()  # an inference-only op: nothing here builds it
    deepspeed.init_distributed(dist_backend="gloo")
    config = _config(Path(good)).replace(
        model__num_layers=2, model__num_experts=(1,), distillation__kd=True, distillation__load_teacher=good
    )
    grid = PipelineParallelGrid(topology=build_topology(config))
    student = SimpleNamespace(tensor_parallel=NO_TENSOR_PARALLEL, mpu=lambda: grid)
    teacher = distillation.load_teacher(config, "cpu", student)
    with torch.no_grad():
        logits = teacher.model(tokens).tolist()
    try:
        distillation.load_teacher(config.replace(distillation__load_teacher=damaged), "cpu", student)
        error = None
    except CheckpointError as err:
        error = str(err)
    return {"logits": logits, "error": error}


def test_a_converted_checkpoint_is_a_kd_teacher_whose_ranks_read_their_own_experts(convert, tmp_path: Path) -> None:
    """--load-teacher of the converted top-1 run at expert-parallel size 2: each rank's teacher computes upstream's
    logits and inference's `load_model`'s (1e-6; no token dropped); each reads only the experts it holds, so one
    expert's tensor file altered in the universal form (its size kept: opening the directory checks sizes, reading a
    file its digest) fails the rank holding it, and every rank stops with its one line naming the file and the rank."""
    from megatron_ds.inference import load_model

    out = convert("moe_ep2_zero0")
    reference = torch.load(FIXTURES / "moe_ep2_zero0" / "reference.pt", weights_only=True)
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    altered = next(damaged.glob("*.universal/tensors/*deepspeed_experts.3.fc1.weight/fp32.pt"))
    data = bytearray(altered.read_bytes())
    data[-100] ^= 1
    altered.write_bytes(bytes(data))
    # 300 s: a loaded 2-core machine
    ranks = forked_gloo_ranks(
        _teacher_logits, 2, str(tmp_path / "store"), str(out), str(damaged), reference["tokens"], timeout=300
    )
    assert all(isinstance(r, dict) for r in ranks), ranks
    with torch.no_grad():
        inference = load_model(str(out), vocab_size=reference["logits"].shape[-1])(reference["tokens"])
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["logits"]), reference["logits"], rtol=0, atol=1e-6)
        torch.testing.assert_close(torch.tensor(r["logits"]), inference, rtol=0, atol=1e-6)
    # rank 0 (experts 0 and 1) read its files, rank 1 did not: both stop with rank 1's line (`fail_together`)
    error = ranks[1]["error"]
    assert ranks[0]["error"] == error, ranks
    assert error.startswith("--load-teacher: ") and "\n" not in error, error
    assert f"{altered.parent.name}/fp32.pt does not match its recorded SHA-256" in error, error
    assert error.endswith(" (on rank 1; every rank stops)"), error
