"""--mos / --kd from a mixture-of-experts teacher: its experts shared out over the student's expert-parallel groups
equal the one-process run.

Launch 1 (two ranks, DP = 2, --moe-expert-parallel-size 2): a 4-layer teacher with 4 experts in layers 2 and 4 (top-1,
no token dropping: deterministic routing) trains 2 steps and saves (each rank writes its 2 experts' files); a 2-layer
student with 4 experts in its second layer distils from it under --mos, and a dense 2-layer student under --kd (the
teacher on the same expert-parallel size, its groups made for it), 3 steps each (temperature 2, beta 0.5, clipping
active). Launch 2 (one rank, E = 1: every expert of the teacher read by its global index from the files the two ranks
wrote): the same two students. kd / mos loss, lm loss, gradient norm, parameter norm and every final weight (experts
by their global index) within 1e-6 in fp32. A rank of the teacher opens only its own experts' files.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_ds.testing.scenario_runs import by_name, run_scenarios

TOL = 1e-6
ROUTING = {"model__moe_token_dropping": False}


def teacher(path: str) -> dict:
    overrides = {**ROUTING, "model__num_experts": [4], "parallel__expert_parallel_size": 2, "parallel__world_size": 2}
    return {"overrides": overrides, "steps": 2, "save": path}


def student(path: str, experts: int, ep: int) -> dict:
    overrides = {
        **ROUTING,
        "model__num_layers": 2,
        "model__num_experts": [experts],
        "parallel__expert_parallel_size": ep,
        "parallel__world_size": ep,
        "distillation__mos" if experts > 1 else "distillation__kd": True,
        "distillation__load_teacher": path,
        "distillation__kd_temp": 2.0,
        "distillation__kd_beta_ce": 0.5,
    }
    return {"overrides": overrides, "steps": 3, "weights": True}


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moe_teacher") / "teacher"


@pytest.fixture(scope="module")
def runs(teacher_dir: Path) -> tuple[dict, dict]:
    root, path = teacher_dir.parent, str(teacher_dir)
    two = run_scenarios(root / "w2", 2, [teacher(path), student(path, 4, 2), student(path, 1, 2)], timeout=150)
    one = run_scenarios(root / "w1", 1, [student(path, 4, 1), student(path, 1, 1)], timeout=150)
    return by_name(["teacher", "moe", "dense"], two), by_name(["moe", "dense"], one)


@pytest.mark.parametrize("name, loss", [("moe", "mos loss"), ("dense", "kd loss")])
def test_moe_teacher_at_expert_parallel_2_equals_one_process(runs: tuple[dict, dict], name: str, loss: str) -> None:
    two, one = runs
    (ref,) = one[name]
    assert ref["engine"] == "PlainEngine"
    keys = [loss] if name == "dense" else ["moe loss", loss]  # the teacher's load-balancing losses join nothing
    assert [sorted(o) for o in ref["other_losses"]] == [keys] * 3
    kd_ref = [o[loss] for o in ref["other_losses"]]
    assert all(k > 0 for k in kd_ref)
    assert min(ref["grad_norms"]) > 0.05, "clipping must be active (clip_grad 0.05)"
    seen = set()
    for r in two[name]:
        assert [o[loss] for o in r["other_losses"]] == pytest.approx(kd_ref, abs=TOL)
        assert r["losses"] == pytest.approx(ref["losses"], abs=TOL)
        assert r["grad_norms"] == pytest.approx(ref["grad_norms"], abs=TOL)
        assert r["params_norm"] == pytest.approx(ref["params_norm"], abs=TOL)
        for key, value in r["weights"].items():  # a MoE student's rank holds 2 of its 4 experts
            diff = (torch.tensor(value) - torch.tensor(ref["weights"][key])).abs().max().item()
            assert diff <= TOL, (key, diff)
            seen.add(key)
    assert seen == set(ref["weights"])


def test_the_teacher_was_saved_with_its_experts_shared_out(runs: tuple[dict, dict], teacher_dir: Path) -> None:
    import json

    two, _ = runs
    assert [r["engine"] for r in two["teacher"]] == ["PlainEngine"] * 2
    (tag,) = [p for p in teacher_dir.iterdir() if p.is_dir()]
    files = {p.name for p in tag.iterdir()}
    assert {f"layer_{m}_expert_{e}_mp_rank_00_model_states.pt" for m in (0, 1) for e in range(4)} <= files
    assert json.loads((tag / "experts.json").read_text())["expert_parallel_size"] == 2


def test_a_rank_opens_only_the_expert_files_it_reads(runs: tuple[dict, dict], teacher_dir: Path) -> None:
    """`moe_weights.iter_weights` with an expert-parallel rank's filter (experts 0 and 1 of each MoE layer, as the
    teacher's rank 0 at E = 2 holds): the files of experts 2 and 3 gone, it reads every wanted tensor as the whole
    read does, and no other."""
    import shutil

    from megatron_ds.training.checkpoint import moe_weights, reader
    from megatron_ds.training.checkpoint.universal.names import ModelTensor

    copy = teacher_dir.parent / "rank0_files"
    shutil.copytree(teacher_dir, copy)
    gone = {p.name for p in copy.glob("*/layer_*_expert_[23]_mp_rank_00_model_states.pt")}
    assert len(gone) == 4
    for name in gone:
        next(copy.glob(f"*/{name}")).unlink()
    ckpt = reader.open_checkpoint(str(copy), moe=True)
    model = ckpt.config.model

    def wanted(t: ModelTensor) -> bool:
        return moe_weights.expert_file(model, t) not in gone

    whole = {t.name: v for t, v in moe_weights.iter_weights(reader.open_checkpoint(str(teacher_dir), moe=True))}
    read = {t.name: v for t, v in moe_weights.iter_weights(ckpt, wanted)}
    assert set(read) == {n for n in whole if not any(f".deepspeed_experts.{e}." in n for e in (2, 3))}
    assert len(read) < len(whole) and all(torch.equal(v, whole[n]) for n, v in read.items())


STUDENT = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 64 --seq-length 16 "
    "--max-position-embeddings 16 --vocab-size 128 --micro-batch-size 2 --global-batch-size 4 --train-iters 2 "
    "--lr 1e-3 --mock-data --num-workers 0 --eval-iters 0 --log-interval 1 --no-log-memory --hidden-dropout 0 "
    "--attention-dropout 0 --moe-expert-parallel-size 2 --kd"
)


def test_a_damaged_expert_file_stops_every_rank_at_once(runs: tuple[dict, dict], teacher_dir: Path) -> None:
    """pretrain_gpt.py --kd on 2 ranks, the teacher's expert 3 of its first MoE layer cut short: rank 1, which holds
    experts 2 and 3, cannot read it; both ranks print its one line naming the file and rank 1, no traceback, and
    exit 2 within seconds of each other (before, rank 0 went on to its next collective: gloo ended it with a
    'Connection closed by peer' traceback, NCCL would have waited there until the launcher killed it)."""
    import shutil

    from megatron_ds.testing.pretrain_runs import start_pretrain_gpt

    damaged = teacher_dir.parent / "damaged_teacher"
    shutil.copytree(teacher_dir, damaged)
    cut = next(damaged.glob("*/layer_0_expert_3_mp_rank_00_model_states.pt"))
    cut.write_bytes(cut.read_bytes()[:200])
    ranks = start_pretrain_gpt(2, [*STUDENT.split(), "--load-teacher", str(damaged)])
    exited = ranks.exit_times(200)
    results = ranks.finish(5, check=False)  # kills what is left
    outputs = [r.output for r in results]
    assert [r.returncode for r in results] == [2, 2], outputs
    assert max(exited.values()) - min(exited.values()) < 5.0, (exited, outputs)
    for rank, out in enumerate(outputs):
        line = f"[rank {rank}] error: --load-teacher: {cut}: unreadable ("
        assert line in out and out.rstrip().endswith("(on rank 1; every rank stops)"), out[-3000:]
        assert "Traceback" not in out, out[-3000:]
