"""Mixture-of-experts on DeepSpeed's plain engine: expert parallelism equals the one-process run.

Two ranks, data parallel 2, fp32, dropout 0, no token dropping (`--disable-moe-token-dropping`: routing is then
deterministic) and top-2's second expert by argmax: with the experts shared out over both ranks
(`--moe-expert-parallel-size 2`) or each rank holding all of them (EP=1), the losses, the clipped gradient norms
(clip 0.05, active) and every final weight (experts by their global index) are within 1e-6 of the one-process run of
the same global batch; saved and resumed at EP=2 the run goes on as the one-process run does, and under EP=1
`--no-load-optim` takes its weights (a full resume there: tests/dist/test_moe_universal_resume.py). This checks
DeepSpeed's expert-gradient scaling (an
expert's gradient is summed over its expert-data-parallel group and divided by the whole data-parallel size: equal to
the one-process gradient) and the counted norm (experts' squares summed over the expert-parallel group).
Top-1, top-2, PR-MoE's residual MLP with `--create-moe-param-group`, a per-layer expert list, Megatron-LM's
top-k router at k = 3 (`--moe-router-topk 3`), and at k = 2 with pre-softmax weights and a gated shared expert
(Qwen2-MoE's layer). PR-MoE at EP=2 also
under ZeRO-2 and with `--checkpoint-activations` (equal to the plain run within 1e-6), in bf16 (ZeRO-2 near the
one-process bf16 run; ZeRO 0 clipping by the norm that counts the experts), with exact resumes under ZeRO-2 and bf16;
the `moe loss` (averaged over the data-parallel ranks) and `--log-num-zeros-in-grad`'s count, the one-process run's on
every rank. The checkpoints saved at EP=1 (top-1, top-2, PR-MoE) and EP=2 load for generation in one process
(`inference.load_model`): every weight the trained one, the logits the training model's in eval mode within 1e-6,
KV-cached decoding equal to uncached; a missing expert file is one line naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megatron_ds.testing.scenario_runs import by_name, max_diff, run_scenarios

TOL = 1e-6
MOE = {"model__num_experts": [4], "model__moe_token_dropping": False, "model__moe_top2_2nd_expert_sampling": False}
VARIANTS = {
    "top1": {},
    "top2": {"model__moe_top_k": 2},
    "residual": {
        "model__mlp_type": "residual",
        "optimizer__create_moe_param_group": True,
        "model__num_experts": [2, 4],
    },
    "router3": {"model__moe_router": "megatron", "model__moe_top_k": 3, "model__moe_loss_coeff": 0.01},
    "shared": {  # Qwen2-MoE's layer: a gated shared expert beside the experts, weights not renormalized
        "model__moe_router": "megatron",
        "model__moe_top_k": 2,
        "model__moe_loss_coeff": 0.01,
        "model__add_bias_linear": False,
        "model__moe_router_pre_softmax": True,
        "model__moe_shared_expert_size": 24,
        "model__moe_shared_expert_gate": True,
    },
}


def sc(variant: str, ep: int = 1, world: int = 1, zeros: bool = False, **extra: Any) -> dict:
    """`zeros`: with --log-num-zeros-in-grad (its count recorded per step)."""
    overrides = {**MOE, **VARIANTS[variant], "parallel__expert_parallel_size": ep, "parallel__world_size": world}
    overrides["logging__log_num_zeros_in_grad"] = zeros
    return {"overrides": overrides, "steps": 3, "weights": True, **extra}  # `extra` may set other steps


def with_training(scenario: dict, **fields: Any) -> dict:
    """`scenario` with `training` fields set (`zero_stage`, `precision`)."""
    extra = {f"training__{k}": v for k, v in fields.items()}
    return {**scenario, "overrides": {**scenario["overrides"], **extra}}


TOKENS = [[(7 * i + 3 * j * j + 1) % 128 for j in range(16)] for i in range(2)]
"""Token ids (2 x 16) whose eval logits the trained models record, for the generation tests below."""


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moe")


@pytest.fixture(scope="module")
def runs(tmp: Path) -> dict[str, list[dict]]:
    ck = str(tmp / "ck")
    one = {f"{v}_one": sc(v, zeros=True, save=str(tmp / f"ck_{v}_one"), eval_logits=TOKENS) for v in VARIANTS}
    two = {f"{v}_ep2": sc(v, ep=2, world=2, zeros=True) for v in VARIANTS}
    two["top1_ep2"].update(save=ck, eval_logits=TOKENS)
    two["top1_ep2_resumed"] = sc("top1", ep=2, world=2, load=ck)
    two["top1_ep2_straight"] = sc("top1", ep=2, world=2, steps=6)
    two["top1_ep1"] = sc("top1", ep=1, world=2)
    one["router3_init"] = sc("router3", steps=0)  # Megatron-LM's router: the experts as drawn (`draw_experts_apart`)
    two["router3_ep2_init"] = sc("router3", ep=2, world=2, steps=0)
    tiny = sc("router3", ep=2, world=2, steps=1)  # bf16 ZeRO-2: its fp32 copies must be the drawn experts
    tiny["overrides"].update({"optimizer__lr": 1e-30, "optimizer__create_moe_param_group": True})
    two["router3_ep2_zero2_bf16"] = with_training(tiny, zero_stage=2, precision="bf16")
    weights_only = {**MOE, "parallel__world_size": 2, "checkpoint__no_load_optim": True}
    two["top1_ep1_weights_from_ep2"] = {"overrides": weights_only, "steps": 0, "weights": True, "load": ck}
    two["residual_ep2_zero2"] = with_training(sc("residual", ep=2, world=2), zero_stage=2)
    two["residual_ep2_zero2_offload"] = with_training(sc("residual", 2, 2), zero_stage=2, offload_optimizer="cpu")
    two["residual_ep2_recompute"] = with_training(sc("residual", ep=2, world=2), checkpoint_activations=True)
    for where, world, ep in (("one", 1, 1), ("ep2", 2, 2)):  # bf16: DeepSpeed's ZeRO-2 clip counts the experts
        runs_in = one if world == 1 else two
        runs_in[f"residual_bf16_{where}"] = with_training(sc("residual", ep, world), precision="bf16", zero_stage=2)
    two["residual_bf16_ep2_zero0"] = with_training(sc("residual", ep=2, world=2), precision="bf16")
    for name, fields in (("residual_ep2_zero2", {"zero_stage": 2}), ("residual_bf16_ep2_zero0", {"precision": "bf16"})):
        two[name]["save"] = str(tmp / f"ck_{name}")  # the optimizer state: ZeRO's partitions / one file per EP rank
        two[f"{name}_resumed"] = with_training(sc("residual", 2, 2, load=str(tmp / f"ck_{name}")), **fields)
        two[f"{name}_straight"] = with_training(sc("residual", 2, 2, steps=6), **fields)
    results: dict[str, list[dict]] = {}
    for name, world, scenarios in (("w1", 1, one), ("w2", 2, two)):
        per_rank = run_scenarios(tmp / name, world, list(scenarios.values()), timeout=120)
        results.update(by_name(list(scenarios), per_rank))
    return results


def assert_equal_to(
    ranks: list[dict], ref: dict, what: str, weights: bool = True, tol: float = TOL, weight_tol: float = TOL
) -> None:
    """The steps of `ref` (and its final weights when `weights`) against every rank's: losses within `tol`, norms
    within `tol` relative, weights within `weight_tol`."""
    assert min(ref["grad_norms"]) > 0.05, "clipping must be active (clip_grad 0.05)"
    for r in ranks:
        assert r["engine"] == "PlainEngine", r["engine"]
        losses = zip(r["losses"], ref["losses"], strict=True)
        assert max(abs(a - b) for a, b in losses) <= tol, (what, r["losses"], ref["losses"])
        norms = zip(r["grad_norms"], ref["grad_norms"], strict=True)
        assert max(abs(a - b) / b for a, b in norms) <= tol, (what, r["grad_norms"], ref["grad_norms"])
    if not weights:
        return
    seen: set[str] = set()
    for r in ranks:
        for name, value in r["weights"].items():
            assert name in ref["weights"], (what, name)
            assert max_diff(value, ref["weights"][name]) <= weight_tol, (what, name)
            seen.add(name)
    assert seen == set(ref["weights"]), (what, set(ref["weights"]) - seen)




@pytest.mark.parametrize("variant", list(VARIANTS))
def test_expert_parallel_two_equals_the_one_process_run(runs: dict, variant: str) -> None:
    ref = runs[f"{variant}_one"][0]
    ranks = runs[f"{variant}_ep2"]
    experts = [n for n in ref["weights"] if ".deepspeed_experts." in n]
    assert experts and all(len([n for n in r["weights"] if n in experts]) == len(experts) // 2 for r in ranks)
    assert_equal_to(ranks, ref, f"{variant} EP=2")
    # --log-params-norm: the whole model's norm on every rank (experts' squares summed over the expert-parallel group)
    assert all(abs(r["params_norm"] - ref["params_norm"]) <= TOL * ref["params_norm"] for r in ranks), (
        [r["params_norm"] for r in ranks],
        ref["params_norm"],
    )


def test_num_zeros_in_grad_counts_every_expert_once(runs: dict) -> None:
    """--log-num-zeros-in-grad at EP=2 is the one-process run's count on every rank: an expert no token reached has an
    all-zero gradient, held by one rank of the expert-parallel group, so the experts' counts are summed over it (each
    rank counted only its own experts before, and this test failed: the one-process top-1 run counts 0, 16640, 8320)."""
    counts = {v: runs[f"{v}_one"][0]["num_zeros"] for v in VARIANTS}
    assert any(any(c) for c in counts.values()), counts  # some expert got no token in some step
    for v in VARIANTS:
        assert [r["num_zeros"] for r in runs[f"{v}_ep2"]] == [counts[v]] * 2, (v, counts[v])


def test_data_parallel_two_with_every_expert_on_each_rank_equals_the_one_process_run(runs: dict) -> None:
    assert_equal_to(runs["top1_ep1"], runs["top1_one"][0], "top1 EP=1 DP=2", weights=False)


def test_a_checkpoint_resumes_at_its_expert_parallel_size(runs: dict) -> None:
    """DeepSpeed's MoE files (each expert's own, the optimizer per expert-parallel rank) resume exactly: saved after
    3 steps and resumed for 3 equals the 6-step run bit for bit, losses, norms and every weight (under another E:
    tests/dist/test_moe_universal_resume.py)."""
    for saved, resumed, straight in zip(runs["top1_ep2"], runs["top1_ep2_resumed"], runs["top1_ep2_straight"]):
        assert saved["losses"] + resumed["losses"] == straight["losses"]
        assert saved["grad_norms"] + resumed["grad_norms"] == straight["grad_norms"]
        assert resumed["weights"] == straight["weights"]


def test_its_weights_alone_load_under_another_expert_parallel_size(runs: dict) -> None:
    """--no-load-optim at EP=1: every rank holds all four experts, each exactly as the EP=2 run saved it (DeepSpeed's
    loader reads each expert's own file by its global index), and the dense weights too."""
    saved = {name: value for r in runs["top1_ep2"] for name, value in r["weights"].items()}
    for r in runs["top1_ep1_weights_from_ep2"]:
        assert set(r["weights"]) == set(saved)
        assert all(r["weights"][name] == value for name, value in saved.items())


def test_zero_2_equals_zero_0(runs: dict) -> None:
    """DeepSpeed's ZeRO-2 with the experts in optimizer groups of their own (`--create-moe-param-group`, as the
    PR-MoE example line): its expert gradients reduced over the expert-data-parallel group, its norm the whole model's
    (each expert once over the expert-parallel group), so EP=2 at DP=2 under ZeRO-2 equals the ZeRO-0 run; with the
    optimizer offloaded to the host (`--offload-optimizer cpu`, torch's AdamW) too."""
    for zero2, offload, zero0 in zip(
        runs["residual_ep2_zero2"], runs["residual_ep2_zero2_offload"], runs["residual_ep2"], strict=True
    ):
        assert_equal_to([zero2], zero0, "residual EP=2 ZeRO-2 vs ZeRO-0")
        assert_equal_to([offload], zero0, "residual EP=2 ZeRO-2, optimizer offloaded to the host, vs ZeRO-0")


def test_full_recomputation_equals_the_run_without_it(runs: dict) -> None:
    """`--checkpoint-activations`: each transformer layer recomputed in backward, its load-balancing loss carried out
    of the checkpointed chunk (else the gate would get no gradient from it): the same losses, norms and weights."""
    for recomputed, plain in zip(runs["residual_ep2_recompute"], runs["residual_ep2"], strict=True):
        assert_equal_to([recomputed], plain, "residual EP=2 --checkpoint-activations")


def test_bf16_expert_parallel_is_near_the_one_process_bf16_run(runs: dict) -> None:
    """bf16 (the engine's parameters in bf16, DeepSpeed's gate in fp32) at EP=2, DP=2, ZeRO-2 against the one-process
    bf16 run: not exact (the ranks' gradients are summed in bf16), within bf16's rounding as the other bf16 tests take
    it: losses and norms (relative) to 2e-2, weights to 2e-2 (bf16 keeps 8 bits: 2^-8 relative; the weights stay
    below 1)."""
    ranks, ref = runs["residual_bf16_ep2"], runs["residual_bf16_one"][0]
    assert_equal_to(ranks, ref, "residual bf16 EP=2 ZeRO-2", tol=2e-2, weight_tol=2e-2)
    fp32 = runs["residual_one"][0]
    assert ref["losses"] != fp32["losses"]  # the bf16 runs did run in bf16


def test_bf16_without_zero_clips_by_the_norm_that_counts_the_experts(runs: dict) -> None:
    """bf16 at ZeRO 0 (DeepSpeed's FP16_UnfusedOptimizer, whose own norm leaves the experts out) clips by the norm
    that counts them (`install_mixed_precision_expert_norm`), as ZeRO-2 does: the first step's norms (the same weights,
    the same bf16 gradients) agree to 3e-4 (6e-5 here; 9e-4 with the experts left out), the losses to bf16's 2e-2."""
    zero0, zero2 = runs["residual_bf16_ep2_zero0"], runs["residual_bf16_ep2"]
    for a, b in zip(zero0, zero2, strict=True):
        first, ref = a["grad_norms"][0], b["grad_norms"][0]
        assert abs(first - ref) / ref <= 3e-4, (a["grad_norms"], b["grad_norms"])
        assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True)) <= 2e-2


def test_the_moe_loss_is_the_mean_over_the_data_parallel_ranks(runs: dict) -> None:
    """The log line's `moe loss` (Megatron-DeepSpeed's loss dict: {'lm loss', 'moe loss'}): the weighted
    load-balancing loss averaged over the micro-batches and the data-parallel ranks, as DeepSpeed's pipeline engine
    averages it at P > 1 (tests/dist/test_moe_pipeline.py); the gate's loss of a micro-batch sees that micro-batch's
    tokens alone, so every rank's is the one-process run's (each rank's own would be off by about 1e-3 here)."""
    ref = [step["moe loss"] for step in runs["top1_one"][0]["other_losses"]]
    for r in runs["top1_ep2"]:
        assert all(set(step) == {"moe loss"} for step in r["other_losses"]), r["other_losses"]
        mine = [step["moe loss"] for step in r["other_losses"]]
        assert max(abs(a - b) for a, b in zip(mine, ref, strict=True)) <= TOL, (mine, ref)


@pytest.mark.parametrize("name", ["residual_ep2_zero2", "residual_bf16_ep2_zero0"])
def test_zero_2_and_bf16_checkpoints_resume_exactly(runs: dict, name: str) -> None:
    """Saved after 3 steps and resumed for 3, equal to the 6-step run bit for bit: under ZeRO-2 the experts' optimizer
    state is in ZeRO's partition files (no per-EP-rank optimizer file); bf16 without ZeRO (DeepSpeed's
    FP16_UnfusedOptimizer on the plain engine) reads its own state back, no universal form needed."""
    for saved, resumed, straight in zip(runs[name], runs[f"{name}_resumed"], runs[f"{name}_straight"], strict=True):
        assert saved["losses"] + resumed["losses"] == straight["losses"]
        assert saved["grad_norms"] + resumed["grad_norms"] == straight["grad_norms"]
        assert resumed["weights"] == straight["weights"]


def test_megatron_lms_router_draws_each_expert_by_its_global_index(runs: dict) -> None:
    """At step 0 the experts of a layer differ (drawn apart, not DeepSpeed's copies) and EP = 2's are the one-process
    run's, by global index; a bf16 ZeRO-2 step at a learning rate of 1e-30 keeps them (ZeRO's fp32 copies were refreshed
    after the draw: else the step would write the copies back)."""
    one = runs["router3_init"][0]["weights"]
    fc1 = sorted(n for n in one if ".deepspeed_experts." in n and n.endswith("fc1.weight"))
    layer = [n for n in fc1 if n.startswith(fc1[0].split(".")[0] + ".")]
    assert len(layer) == 4 and all(max_diff(one[a], one[b]) > 1e-3 for a in layer for b in layer if a < b)
    two = {n: v for r in runs["router3_ep2_init"] for n, v in r["weights"].items()}
    assert set(two) == set(one) and all(max_diff(two[n], one[n]) == 0.0 for n in one)
    stepped = {n: v for r in runs["router3_ep2_zero2_bf16"] for n, v in r["weights"].items()}
    assert all(max_diff(stepped[n], one[n]) <= 1e-2 * max(1.0, max_diff(one[n], 0.0)) for n in fc1)
    assert all(max_diff(stepped[a], stepped[b]) > 1e-3 for a in layer for b in layer if a < b)


def test_the_experts_train_apart(runs: dict) -> None:
    """With DeepSpeed's gates every expert starts as a copy of one MLP (its deepcopy, as upstream; Megatron-LM's router
    draws them apart: above): after training they differ, so
    the comparison above would see an expert's tokens sent to another."""
    w = runs["top1_one"][0]["weights"]
    first = [n for n in w if ".deepspeed_experts.0.fc1.weight" in n][0]
    others = [first.replace(".deepspeed_experts.0.", f".deepspeed_experts.{i}.") for i in range(1, 4)]
    assert all(max_diff(w[first], w[o]) > 1e-5 for o in others)


# --- one-process generation from these checkpoints (`megatron_ds.inference`) ---------------------------------------
GENERATED = {"top1_one": "ck_top1_one", "top2_one": "ck_top2_one", "residual_one": "ck_residual_one", "top1_ep2": "ck"}
GENERATED["router3_one"] = "ck_router3_one"
GENERATED["shared_one"] = "ck_shared_one"
"""The runs that saved a checkpoint and recorded their eval logits of TOKENS, and the checkpoint's directory."""


def _inference_name(name: str) -> str:
    """A one-process training name (`4.moe.deepspeed_moe...`, `tied_modules.word_embeddings.weight`) -> the
    inference model's (`layers.2.moe.deepspeed_moe...`, `embedding.weight`): tiny_config has 2 specs before the
    layers (token cast, embedding) and no position table outside spec 2."""
    head, rest = name.split(".", 1)
    if head == "tied_modules":
        return "embedding.weight"
    index = int(head)
    return {2: "position.", 7: "final_norm."}.get(index, f"layers.{index - 3}.") + rest


@pytest.mark.parametrize("name", list(GENERATED))
def test_a_checkpoint_loads_for_generation_as_the_training_model_computes(runs: dict, tmp: Path, name: str) -> None:
    """`inference.load_model` (one process, every expert here) of a checkpoint saved at expert-parallel size 1 (top-1,
    top-2, PR-MoE with 2 and 4 experts) or 2 (each rank wrote its own experts' files): every weight is the trained one
    (experts by their global index, exactly), and its logits are the training model's in eval mode within 1e-6 (its
    routing drops no token and takes top-2's second expert by score, as these runs do)."""
    import torch

    from megatron_ds.inference import load_model

    model = load_model(str(tmp / GENERATED[name]))
    assert [layer.moe is not None for layer in model.layers] == [False, True, False, True]
    trained = {_inference_name(n): v for r in runs[name] for n, v in r["weights"].items()}
    loaded = dict(model.named_parameters())
    assert set(loaded) == set(trained)
    assert all(torch.equal(loaded[n], torch.tensor(v)) for n, v in trained.items())
    with torch.no_grad():
        logits = model(torch.tensor(TOKENS))
    for rank in runs[name]:
        torch.testing.assert_close(logits, torch.tensor(rank["eval_logits"]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["top1_one", "top2_one", "router3_one", "shared_one"])
def test_generation_with_a_kv_cache_equals_generation_without(tmp: Path, name: str) -> None:
    """The cached forward (a prefill, then one token at a time: a MoE layer routing one token) equals the whole
    sequence's, and greedy generation is the same with and without the cache."""
    import torch

    from megatron_ds.inference import KVCache, generate, load_model

    model = load_model(str(tmp / GENERATED[name]))
    tokens = torch.tensor(TOKENS)
    with torch.no_grad():
        full, cache = model(tokens), KVCache()
        pieces = [model(tokens[:, :9], cache)] + [model(tokens[:, i : i + 1], cache) for i in range(9, 16)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-5)
    cached = generate(model, TOKENS[0][:5], 11, temperature=0.0)
    assert cached == generate(model, TOKENS[0][:5], 11, temperature=0.0, use_cache=False)


@pytest.mark.parametrize(
    ("file", "damage", "says"),
    [
        ("layer_1_expert_2_mp_rank_00_model_states.pt", "delete", "{path}: missing; the checkpoint is incomplete"),
        ("mp_rank_00_model_states.pt", "truncate", "{path}: "),
        ("experts.json", "delete", "{dir}: a mixture-of-experts checkpoint without experts.json, saved before"),
    ],
    ids=["expert-missing", "model-states-truncated", "no-record"],
)
def test_a_damaged_checkpoint_is_one_line_naming_the_file(
    tmp: Path, capsys: pytest.CaptureFixture[str], file: str, damage: str, says: str
) -> None:
    """tools/generate.py on the EP=2 checkpoint with one file gone or cut: exit status 2 and one `error:` line naming
    it (an older checkpoint without experts.json: its experts lack their fc2 bias, which the line says)."""
    import importlib.util
    import shutil

    spec = importlib.util.spec_from_file_location("generate_tool", Path(__file__).parents[2] / "tools" / "generate.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    broken = tmp / f"ck_{damage}_{file}"
    shutil.copytree(tmp / "ck", broken)
    path = next(broken.glob(f"global_step*/{file}"))
    if damage == "delete":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[:100])
    capsys.readouterr()
    assert tool.main(["--load", str(broken), "--prompt-ids", "1 2 3", "--greedy", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + says.format(path=path, dir=path.parent)), err
    assert err.count("\n") == 1, err
