"""`python -m megatron_ds.plan [COMMAND] [flags]`: flags -> inputs -> sections -> text or JSON.

Exit status: 0 plan produced and every check holds; 1 plan produced but a check failed (e.g. a
predicted stage does not fit); 2 bad or missing input (one line on stderr, no traceback).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from megatron_ds.errors import UserError
from megatron_ds.plan import ds_json, sections
from megatron_ds.plan.command_line import Output, parse
from megatron_ds.plan.context import Context
from megatron_ds.plan.hardware import PlanError
from megatron_ds.plan.inputs import PlanInputs, resolve
from megatron_ds.plan.profile import load_profile, save_profile
from megatron_ds.plan.report import Report, Section, render_json, render_text
from megatron_ds.plan.sections import PlannerSection
from megatron_ds.training import deepspeed_config


def _section_or_failure(entry: PlannerSection, ctx: Context) -> Section:
    """In the all-commands run one workflow that cannot answer must not hide the others."""
    try:
        return entry.build(ctx)
    except PlanError as exc:
        sec = Section(entry.name, f"{entry.name}: no answer", [f"Not produced: {exc}"])
        sec.check(False, f"{entry.name}: {exc}")
        return sec


def run(command: str, given: PlanInputs, out: Output) -> tuple[Report, int]:
    """Build the report; raises PlanError (and LayoutError) for bad or missing input."""
    from megatron_ds.plan.precision import choose_precision

    inputs = given.merged_over(load_profile(out.profile)) if out.profile else given
    res = resolve(inputs)
    res.require(sections.needs(command), f"`{command}`")
    if out.save_profile:
        save_profile(out.save_profile, inputs, [])
    ctx = Context(res, *choose_precision(res))
    chosen = sections.selected(command)
    if command == sections.ALL:
        built = [_section_or_failure(entry, ctx) for entry in chosen]
    else:
        built = [chosen[0].build(ctx)]
    report = Report(sections=built, inputs=inputs.answers())
    if out.profile and inputs.handled:
        report.notes.append(f"Profile {out.profile}: answers reused; handled before: {', '.join(inputs.handled)}.")
    extras = _outputs(ctx, report, out)
    if out.save_profile:
        save_profile(out.save_profile, inputs, [command])
    return report, extras


def _outputs(ctx: Context, report: Report, out: Output) -> int:
    """--write-config, --write-command, --plot; returns 0, or 1 if one could not be produced."""
    if not (out.write_config or out.write_command or out.plot):
        return 0
    plan = ctx.plan()
    config = ds_json.plan_config(ctx.res, plan)
    extra = Section("outputs", "Files and command")
    if out.write_config:
        try:
            with open(out.write_config, "w", encoding="utf-8") as f:
                json.dump(deepspeed_config.generate(config), f, indent=2)
                f.write("\n")
        except OSError as e:
            raise PlanError(
                f"--write-config {out.write_config}: cannot write it ({e.strerror}); choose a writable path"
            ) from None
        extra.add(
            f"DeepSpeed JSON written to {out.write_config} (pass it with --deepspeed_config; it repeats the "
            f"flags' values, so the merge finds no contradiction)."
        )
    if out.write_command:
        extra.snippets["pretrain_gpt.py command"] = ds_json.command_line(ctx.res, config, out.write_config)
    status = 0
    if out.plot:
        from megatron_ds.plan.plot import plot_stages

        written = plot_stages(plan, ctx.res.usable_bytes, out.plot)
        extra.check(
            written,
            f"plot {out.plot}: "
            + (
                "written"
                if written
                else "not written, matplotlib is not installed (pip install matplotlib, or pip install -e '.[plot]')"
            ),
        )
        status = 0 if written else 1
    report.sections.append(extra)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        command, given, out = parse(argv)
        report, status = run(command, given, out)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        print(render_json(report) if out.format == "json" else render_text(report))
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
    return max(status, 0 if report.ok else 1)
