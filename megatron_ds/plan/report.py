"""What the planner says, as data: sections with text, snippets and checks; rendered as text or JSON."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

ESTIMATE_NOTE = (
    "Every memory or time figure below is an estimate from the formula it names; nothing was "
    "measured, run or tested on your hardware."
)


@dataclass
class Check:
    """One verified constraint: ok True (holds), False (violated) or None (could not determine)."""

    ok: bool | None
    text: str
    blocking: bool = True
    """False for facts that do not stop the plan (e.g. an optional feature is unavailable)."""

    def label(self) -> str:
        if self.ok is False and not self.blocking:
            return "no"
        return {True: "ok", False: "FAIL", None: "unknown"}[self.ok]


@dataclass
class Section:
    """One sub-command's answer."""

    name: str
    title: str
    lines: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    snippets: dict[str, Any] = field(default_factory=dict)
    """Name -> a DeepSpeed JSON fragment (dict) or code/text (str)."""
    checks: list[Check] = field(default_factory=list)

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def check(self, ok: bool | None, text: str, blocking: bool = True) -> None:
        self.checks.append(Check(ok, text, blocking))


@dataclass
class Report:
    sections: list[Section]
    inputs: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    @property
    def checks(self) -> list[Check]:
        return [c for s in self.sections for c in s.checks]

    @property
    def ok(self) -> bool:
        return all(c.ok is not False or not c.blocking for c in self.checks)


def guide_file(filename: str) -> str:
    """A file of `megatron_ds/plan/guides/` (package data: the fixed prose and example programs)."""
    return (resources.files("megatron_ds.plan") / "guides" / filename).read_text(encoding="utf-8")


@functools.cache
def guide(name: str) -> dict[str, str]:
    """The paragraphs of `guides/<name>.txt` by key: a `[key]` line starts one, `#` lines are comments,
    and its lines are joined with single spaces into the one line the report prints."""
    paragraphs: dict[str, list[str]] = {}
    key = None
    for line in guide_file(f"{name}.txt").splitlines():
        if line.startswith("#") or not line.strip():
            continue
        header = re.fullmatch(r"\[([\w-]+)\]", line)
        if header:
            key = header[1]
            if key in paragraphs:
                raise ValueError(f"guides/{name}.txt: paragraph [{key}] appears twice")
            paragraphs[key] = []
        elif key is None:
            raise ValueError(f"guides/{name}.txt: text before the first [key] line")
        else:
            paragraphs[key].append(line.strip())
    return {k: " ".join(lines) for k, lines in paragraphs.items()}


def render_text(report: Report) -> str:
    out = [ESTIMATE_NOTE, *report.notes, ""]
    for sec in report.sections:
        out.append(f"== {sec.title} ==")
        out.extend(sec.lines)
        for name, snippet in sec.snippets.items():
            out.append(f"-- {name} --")
            out.append(json.dumps(snippet, indent=2) if isinstance(snippet, dict) else str(snippet).rstrip("\n"))
        out.append("")
    out.append("== Checks ==")
    out.extend(f"[{c.label()}] {c.text}" for c in report.checks)
    return "\n".join(out)


def render_json(report: Report) -> str:
    payload = {
        "note": ESTIMATE_NOTE,
        "notes": report.notes,
        "inputs": report.inputs,
        "sections": [
            {
                "name": s.name,
                "title": s.title,
                "text": s.lines,
                "data": s.data,
                "snippets": s.snippets,
                "checks": [{"ok": c.ok, "text": c.text, "blocking": c.blocking} for c in s.checks],
            }
            for s in report.sections
        ],
        "checks": [{"ok": c.ok, "text": c.text, "blocking": c.blocking} for c in report.checks],
        "all_checks_pass": report.ok,
    }
    return json.dumps(payload, indent=2, default=str)
