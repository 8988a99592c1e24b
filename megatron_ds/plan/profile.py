"""The planner's saved answers: `--save-profile FILE` stores the inputs given and the sub-commands already
handled, `--profile FILE` reads them back (checked field by field against `PlanInputs`), so a later run never
asks again."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from megatron_ds.files import read_json
from megatron_ds.plan.hardware import PlanError
from megatron_ds.plan.inputs import PlanInputs

PROFILE_FORMAT = "megatron_ds.plan profile v1"


def load_profile(path: str) -> PlanInputs:
    """Read a saved profile; a missing or malformed file is a one-line error."""
    data = read_json(
        path,
        "--profile",
        PlanError,
        ("give a file written by --save-profile", "fix or re-create it with --save-profile"),
    )
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise PlanError(
            f'--profile {path}: not a planner profile (no "format": "{PROFILE_FORMAT}"); '
            f"re-create it with --save-profile"
        )
    inputs, handled = data.get("inputs", {}), data.get("handled", [])
    fix = "fix or re-create it with --save-profile"
    if not isinstance(inputs, dict) or not isinstance(handled, list) or not all(isinstance(h, str) for h in handled):
        raise PlanError(f'--profile {path}: "inputs" must be an object and "handled" a list of names; {fix}')
    types = {f.name: str(f.type).split(" |")[0] for f in dataclasses.fields(PlanInputs) if f.name != "handled"}
    unknown = sorted(set(inputs) - set(types))
    if unknown:
        raise PlanError(f"--profile {path}: unknown input(s) {', '.join(unknown)}; remove them")
    for name, value in inputs.items():
        if value is not None and not _of_type(value, types[name]):
            raise PlanError(
                f"--profile {path}: input {name} is {json.dumps(value)}, not {_TYPE_NAMES[types[name]]}; {fix}"
            )
    return PlanInputs(**inputs, handled=list(handled))


_TYPE_NAMES = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false", "list": "a list"}


def _of_type(value: Any, kind: str) -> bool:
    """Whether a profile's JSON value is of a PlanInputs field's type (JSON's true is no integer here)."""
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "list":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return isinstance(value, {"str": str, "bool": bool}[kind])


def save_profile(path: str, inputs: PlanInputs, handled: list[str]) -> None:
    done = list(dict.fromkeys([*inputs.handled, *handled]))
    payload = {"format": PROFILE_FORMAT, "inputs": inputs.answers(), "handled": done}
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2, sort_keys=True)
            f.write("\n")
    except OSError as e:
        raise PlanError(f"--save-profile {path}: cannot write it ({e.strerror}); choose a writable path") from None
