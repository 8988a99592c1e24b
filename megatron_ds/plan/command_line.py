"""The planner's command line: `[COMMAND] [flags]` -> (command, PlanInputs, Output).

Flags that `pretrain_gpt.py` also takes (`--num-layers`, `--zero-stage`, ...) are drawn from their
declarations in `megatron_ds.flags` (type, choices, help), so the two cannot drift; what the
planner does differently with one is said after its help. Every value defaults to None, "not
given": the planner then takes it from a preset, chooses it, or asks for it. The flags only the
planner has (the hardware, `--precision`, `--layout`, the outputs) are declared here.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import megatron_ds.flags.megatron_lm_moe as megatron_lm_moe
from megatron_ds.estimate.devices import DEVICES
from megatron_ds.flags import BY_NAME
from megatron_ds.flags.declare import NO_OP
from megatron_ds.pipeline.methods import planned_methods
from megatron_ds.plan import sections
from megatron_ds.plan.hardware import PRESETS, PlanError
from megatron_ds.plan.inputs import CHOICES, PlanInputs

_CHOSEN = "the planner chooses it when not given"
TRAINING_FLAGS: dict[str, str | None] = {
    "--num-layers": None,
    "--hidden-size": None,
    "--num-attention-heads": None,
    "--seq-length": "with --model, 2048 when not given",
    "--vocab-size": "with --model, GPT-2's 50257 when not given",
    "--ffn-hidden-size": None,
    "--global-batch-size": "with --model, the preset's published value when not given",
    "--micro-batch-size": _CHOSEN,
    "--zero-stage": _CHOSEN + "; 2 and 3 plan for pipeline size 1 (DeepSpeed's plain engine)",
    "--tensor-model-parallel-size": _CHOSEN,
    "--pipeline-model-parallel-size": _CHOSEN,
    "--checkpoint-activations": "without it or --no-checkpoint-activations, the planner tries none, selective, full",
    "--recompute-activations": "without it the planner tries none, selective and full recomputation in that order",
    "--partition-activations": "applied to the plans with full recomputation (needs --no-sequence-parallel); the "
    "printed command adds --deepspeed-activation-checkpointing",
    "--checkpoint-in-cpu": "applied to the plans with full recomputation; the printed command adds "
    "--deepspeed-activation-checkpointing",
    "--sequence-parallel": "on whenever t > 1 unless --no-sequence-parallel",
    "--pp-schedule": "the planner chooses among 1F1B, ZB-H1 and interleaved 1F1B when not given",
    "--enable-zbh1-pipeline": None,
    "--num-virtual-stages-per-pipeline-rank": "with interleaving the planner tries 2, 3 and 4 when not given",
    "--moe-expert-parallel-size": _CHOSEN + " (a divisor of every expert count, a mixture-of-experts teacher's too, "
    "and of the GPUs)",
    "--expert-model-parallel-size": "the same choice as --moe-expert-parallel-size (which the printed command writes)",
    "--create-moe-param-group": "the printed command adds it wherever a mixture-of-experts plan uses ZeRO 1 or 2",
    "--kd": "the plan counts the teacher (its weights, its forward, the kd loss) at pipeline size 1",
    "--mos": "planned as --kd (the same teacher and loss)",
    "--load-teacher": "the teacher's sizes are read from its latest megatron_ds.json (no tensor is read)",
    "--num-layers-teacher": "without --load-teacher, with the other two, it sizes the teacher",
    "--hidden-size-teacher": "without --load-teacher, with the other two, it sizes the teacher",
    "--num-attention-heads-teacher": "without --load-teacher, with the other two, it sizes the teacher",
    "--num-experts-teacher": "without --load-teacher, the teacher's experts (not given or 1: dense MLPs) with the "
    "student's --expert-interval, --mlp-type and routing flags, as Megatron-DeepSpeed builds its teacher; the plan "
    "shares them out over the student's expert-parallel size",
}
"""The `pretrain_gpt.py` flags the planner takes, each with what the planner does differently."""
DISTILLATION_SIZES = (
    "--num-layers-teacher",
    "--hidden-size-teacher",
    "--num-attention-heads-teacher",
    "--num-experts-teacher",
)
MOE_ARCHITECTURE_FLAGS = (
    "--num-experts",
    "--expert-interval",
    "--mlp-type",
    "--topk",
    "--moe-train-capacity-factor",
    "--moe-eval-capacity-factor",
    "--moe-min-capacity",
    "--disable-moe-token-dropping",
    "--disable-moe-top2-2nd-expert-sampling",
    "--moe-loss-coeff",
    "--moe-router-topk",
    "--moe-aux-loss-coeff",
    "--moe-router-load-balancing-type",
    "--moe-layer-freq",
    "--moe-ffn-hidden-size",
    "--moe-router-score-function",
    "--moe-router-dtype",
    "--moe-router-pre-softmax",
    "--moe-shared-expert-intermediate-size",
    "--moe-shared-expert-gate",
    *(
        f.name
        for f in megatron_lm_moe.MIXTURE_OF_EXPERTS
        if f.status == NO_OP  # kernels and dispatchers: they change nothing but choose Megatron-LM's router, as there
    ),
)
"""Megatron-DeepSpeed's and Megatron-LM's (`flags.megatron_lm_moe`) mixture-of-experts flags that shape the model or
its routing: architecture flags here (the expert-parallel size and `--create-moe-param-group` are the planner's
choices, `TRAINING_FLAGS`)."""
ARCHITECTURE_FLAGS = (
    "--num-key-value-heads",
    "--group-query-attention",
    "--num-query-groups",
    "--kv-channels",
    "--swiglu",
    "--openai-gelu",
    "--squared-relu",
    "--normalization",
    "--layernorm-epsilon",
    "--apply-layernorm-1p",
    "--untie-embeddings-and-output-weights",
    "--use-rotary-position-embeddings",
    "--position-embedding-type",
    "--rotary-base",
    "--rotary-percent",
    "--use-rope-scaling",
    "--rope-scaling-factor",
    "--no-position-embedding",
    "--disable-bias-linear",
    "--add-qkv-bias",
    "--qk-layernorm",
    "--qk-l2-norm",
    "--window-size",
    "--window-attn-skip-freq",
    "--make-vocab-size-divisible-by",
    *MOE_ARCHITECTURE_FLAGS,
)
"""`pretrain_gpt.py`'s architecture flags: declared from `megatron_ds.flags`, passed on as given to size the model
by pretrain_gpt.py's own rules (`flags.parser.model_config`) and into the printed command."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise PlanError(f"{message}; see `python -m megatron_ds.plan --help`")


@dataclass
class Output:
    format: str
    write_config: str | None
    write_command: bool
    plot: str | None
    profile: str | None
    save_profile: str | None


def training_flag_kwargs(name: str) -> dict[str, Any]:
    """add_argument keywords for a `pretrain_gpt.py` flag from its declaration; default None (not given)."""
    flag, note = BY_NAME[name], TRAINING_FLAGS.get(name)
    text = flag.help + (f"; here: {note}" if note else "")
    kw: dict[str, Any] = {"dest": flag.attr, "default": None, "help": text.replace("%", "%%")}
    if flag.is_switch:
        return {**kw, "action": "store_const", "const": flag.const}
    nargs = {} if flag.nargs is None else {"nargs": flag.nargs}
    return {**kw, "type": flag.type, "choices": flag.argparse_choices(), **nargs}


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m megatron_ds.plan",
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keeps the one line per section
        description=f"DeepSpeed configuration advisor: python -m megatron_ds.plan [COMMAND] [flags].\n\n"
        f"{sections.help_text()}",
    )

    def training(group: argparse._ArgumentGroup, *names: str) -> None:
        for name in names:
            group.add_argument(name, **training_flag_kwargs(name))

    g = p.add_argument_group("model", "a --model preset, or the size flags; a size flag overrides the preset's value")
    g.add_argument("--model", help=f"preset: {', '.join(PRESETS)} (or 1.3b, 175b, ...)")
    training(g, "--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--vocab-size")
    training(g, "--ffn-hidden-size")
    g = p.add_argument_group(
        "architecture", "pretrain_gpt.py's flags, added to a preset's (Llama presets bring theirs)"
    )
    for name in ARCHITECTURE_FLAGS:
        flag = BY_NAME[name]
        extra = {} if flag.is_switch else {"metavar": flag.attr.upper()}
        names = (name, *flag.aliases)  # Megatron-LM's spelling too (--norm-epsilon)
        g.add_argument(*names, **{**training_flag_kwargs(name), "dest": "arch_" + flag.attr, **extra})
    g = p.add_argument_group("hardware")
    g.add_argument("--num-gpus", type=int)
    g.add_argument("--gpus-per-node", type=int)
    g.add_argument("--gpu", help=f"one of {', '.join(d.name for d in DEVICES)}")
    g.add_argument("--gpu-memory-gb", type=float)
    g.add_argument("--compute-capability", help="MAJOR.MINOR, e.g. 8.0")
    g.add_argument("--memory-headroom", type=float, help="fraction of GPU memory kept free (default 0.1)")
    g.add_argument("--cpu-memory-gb", type=float, help="host memory per node, for offload")
    g.add_argument(
        "--interconnect",
        choices=CHOICES["interconnect"],
        help="the data-parallel link (its bandwidth prices ZeRO's communication, estimate/zero_time.py)",
    )
    g.add_argument(
        "--storage", choices=CHOICES["storage"], help="local storage; nvme lets the plan offload ZeRO-3 to NVMe"
    )
    g.add_argument("--tensor-device", choices=CHOICES["tensor_device"])
    g.add_argument(
        "--kernel-profile",
        metavar="FILE",
        help="measured kernel rates (benchmarks/kernel_profile.py --write FILE) in place of the GPU table's",
    )
    g = p.add_argument_group("training and fixed choices")
    training(g, "--global-batch-size", "--micro-batch-size", "--zero-stage")
    training(g, "--tensor-model-parallel-size", "--pipeline-model-parallel-size")
    g.add_argument("--precision", choices=CHOICES["precision"])
    training(g, "--checkpoint-activations")
    g.add_argument("--no-checkpoint-activations", dest="checkpoint_activations", action="store_const", const=False)
    training(g, "--recompute-activations", "--partition-activations", "--checkpoint-in-cpu", "--sequence-parallel")
    training(g, "--pp-schedule", "--enable-zbh1-pipeline", "--num-virtual-stages-per-pipeline-rank")
    training(g, "--moe-expert-parallel-size", "--create-moe-param-group")
    training(g, "--expert-model-parallel-size")  # Megatron-LM's spelling of the same choice (its Mixtral line's)
    g2 = p.add_argument_group("knowledge distillation", "the teacher: its checkpoint, or its sizes (docs/planner.md)")
    training(g2, "--kd", "--mos", "--load-teacher", *DISTILLATION_SIZES)
    g.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_const", const=False)
    methods = ", ".join(planned_methods())
    g.add_argument(
        "--layout", choices=CHOICES["layout"], help=f"none, pre, post, both (dedicated stages) or a method: {methods}"
    )
    g.add_argument("--reported-mb", help="observed memory: first=MB,middle=MB,last=MB or one MB value per stage")
    g.add_argument("--oom-stage", type=int, help="the pipeline stage that ran out of memory")
    g = p.add_argument_group("output")
    g.add_argument("--format", choices=("text", "json"), default="text")
    g.add_argument("--write-config", metavar="FILE", help="write the DeepSpeed JSON of the plan")
    g.add_argument("--write-command", action="store_true", help="print the matching pretrain_gpt.py command")
    g.add_argument("--plot", metavar="FILE.png", help="bar chart of predicted memory per stage (matplotlib)")
    g.add_argument("--profile", metavar="FILE", help="reuse answers saved earlier")
    g.add_argument("--save-profile", metavar="FILE", help="store the answers (and what was handled) for next time")
    return p


def _expert_parallel_size(ns: argparse.Namespace) -> None:
    """Megatron-LM's --expert-model-parallel-size as --moe-expert-parallel-size (one size by two names)."""
    size, ours = ns.expert_model_parallel_size, ns.moe_expert_parallel_size
    if size is not None and ours not in (None, size):
        raise PlanError(
            f"--expert-model-parallel-size {size} with --moe-expert-parallel-size {ours}: the same size by two names; "
            "keep one"
        )
    if size is not None:
        ns.moe_expert_parallel_size = size


def parse(argv: Sequence[str]) -> tuple[str, PlanInputs, Output]:
    """(the command, the inputs given on the command line, the output options)."""
    argv = list(argv)
    command = argv.pop(0) if argv and argv[0] in (*sections.names(), sections.ALL) else sections.ALL
    ns = build_parser().parse_args(argv)
    _expert_parallel_size(ns)
    memory_only = [f for f, v in (("--reported-mb", ns.reported_mb), ("--oom-stage", ns.oom_stage)) if v is not None]
    if memory_only and command not in ("memory", sections.ALL):  # read by the memory section alone
        raise PlanError(
            f"{' and '.join(memory_only)}: read by the memory command only, not by {command}; run `python -m "
            f"megatron_ds.plan memory` (or no command), or drop the flag"
        )
    fields = {f for f in PlanInputs.__dataclass_fields__ if f != "handled"}
    given = PlanInputs(**{k: v for k, v in vars(ns).items() if k in fields}, architecture=architecture(ns) or None)
    out = Output(
        format=ns.format,
        write_config=ns.write_config,
        write_command=ns.write_command,
        plot=ns.plot,
        profile=ns.profile,
        save_profile=ns.save_profile,
    )
    return command, given, out


def architecture(ns: argparse.Namespace) -> list[str]:
    """The architecture flags given, as pretrain_gpt.py tokens (a switch alone, a value flag and its value)."""
    tokens: list[str] = []
    for name in ARCHITECTURE_FLAGS:
        flag = BY_NAME[name]
        value = getattr(ns, "arch_" + flag.attr)
        if value is not None:
            values = value if isinstance(value, list) else [value]  # --num-experts takes one count per layer group
            tokens += [name] if flag.is_switch else [name, *map(str, values)]
    return tokens
