#!/usr/bin/env python
"""Capture the training command lines that Megatron-DeepSpeed's and Megatron-LM's own example
scripts build, with the DeepSpeed JSON each one writes, by running every script with stub
launchers.

    python tools/capture_launch_lines.py --megatron-deepspeed PATH --megatron-lm PATH \
        --out tests/data/launch_lines.json

PATH is a checkout (or `git archive` export) of each upstream repository; it is copied to a
scratch directory first, so the scripts' own output directories and JSON templates land there.
Every script runs under `bash` with `deepspeed`, `torchrun`, `python`/`python3` (for the training
entry points only; other uses run the real interpreter), `srun`, `mpirun`, `wget`, `ds_ssh` and
`nvidia-smi` replaced by stubs: a launcher stub records its arguments, the entry point and its
arguments, the DeepSpeed JSON named by `--deepspeed_config`, and which path arguments were
existing directories (the scripts `mkdir -p` their checkpoint directories); `nvidia-smi` reports
8 GPUs of `--gpu-name` per node. Nothing is downloaded and nothing trains. The result is the input
of `python -m megatron_ds.testing.launch_lines` (docs/compatibility.md's per-script table).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

ENTRY_POINTS = ("pretrain_gpt.py", "finetune_llama.py", "pretrain_gpt_core.py")
"""Training scripts whose command lines are captured (any other python use runs for real)."""
LAUNCHERS = ("deepspeed", "torchrun", "srun", "mpirun")
SCRIPT_TIMEOUT_S = 30
MEGATRON_LM_SCRIPTS = (
    "examples/gpt3/train_gpt3_175b_distributed.sh",
    "examples/llama/train_llama3_8b_h100_fp8.sh",
    "examples/mixtral/train_mixtral_8x7b_distributed.sh",
)
"""Megatron-LM's GPT, Llama and Mixtral example lines (its other examples are DeepSeek-style MoE, FSDP or
post-training)."""
SCRIPT_ARGS = {
    "examples/gpt3/train_gpt3_175b_distributed.sh": [
        "checkpoints/gpt3_175b",
        "tensorboard_logs/gpt3_175b",
        "gpt2-vocab.json",
        "gpt2-merges.txt",
        "data/gpt3_text_document",
    ],
    "examples/mixtral/train_mixtral_8x7b_distributed.sh": ["checkpoints/mixtral", "tokenizer.model", "data/mixtral"],
    # the base script's first block in ds_pretrain_gpt_1.3B_dense_run.sh (its baseline: lr, train tokens in billions)
    "examples_deepspeed/data_efficiency/gpt/pretrain/ds_pretrain_gpt_1.3B_dense_base_script.sh": ["2.0e-4", "300"],
}
"""Positional arguments a script requires (its usage comment, or the caller script that passes them)."""
PATH_FLAGS = ("--load", "--save", "--tensorboard-dir", "--data-cache-path")

_RECORDER = r"""
import json, os, sys
entry_points = {entry_points!r}
launcher, argv = sys.argv[1], sys.argv[2:]
i = next((k for k, a in enumerate(argv) if os.path.basename(a) in entry_points), None)
if i is None:
    if launcher in ("python", "python3"):
        os.execv({python!r}, [{python!r}, *argv])
    shell = next((k for k, a in enumerate(argv) if a in ("sh", "bash")), None)
    if launcher in ("srun", "mpirun") and shell is not None:  # `srun ... sh -c "python ... pretrain_gpt.py ..."`
        os.execvp(argv[shell], argv[shell:])
    sys.exit(0)  # a launcher used for something else (e.g. ds_ssh): nothing to record
args = argv[i + 1:]
record = {{"launcher": launcher, "launcher_args": argv[:i], "entry": os.path.basename(argv[i]), "argv": args}}
for k, a in enumerate(args):
    name, _, value = a.partition("=")
    if name in ("--deepspeed_config", "--deepspeed-config"):
        path = value or (args[k + 1] if k + 1 < len(args) else "")
        try:
            with open(path) as f:
                record["ds_config"] = json.load(f)
        except (OSError, ValueError) as e:
            record["ds_config_error"] = f"{{path}}: {{e}}"
record["existing_dirs"] = [
    a for k, a in enumerate(args) if k and args[k - 1] in {path_flags!r} and os.path.isdir(a)
]
with open(os.environ["CAPTURE_FILE"], "a") as f:
    f.write(json.dumps(record) + "\n")
"""


def _write_stub(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def make_stubs(directory: Path, gpu_name: str) -> None:
    """The stub commands the scripts find first on PATH."""
    recorder = directory / "_record.py"
    recorder.write_text(_RECORDER.format(entry_points=ENTRY_POINTS, python=sys.executable, path_flags=PATH_FLAGS))
    for name in (*LAUNCHERS, "python", "python3"):
        _write_stub(directory, name, f'#!/bin/sh\nexec {sys.executable} {recorder} {name} "$@"\n')
    gpus = "\n".join([gpu_name] * 8)
    _write_stub(directory, "nvidia-smi", f"#!/bin/sh\nprintf '%s\\n' '{gpus}'\n")
    _write_stub(directory, "ds_ssh", '#!/bin/sh\n"$@"\n')
    _write_stub(directory, "wget", "#!/bin/sh\nexit 0\n")


def scripts_of(root: Path, only: tuple[str, ...] = ()) -> list[Path]:
    """Every example shell script that builds a training command line (by text), or just `only`."""
    if only:
        return [root / s for s in only]
    found = []
    for sub in ("examples", "examples_deepspeed"):
        for path in sorted((root / sub).rglob("*.sh")):
            text = path.read_text(errors="replace")
            if any(e in text for e in ENTRY_POINTS):
                found.append(path)
    return found


PLACEHOLDER = re.compile(r"(?<![<\w])<([A-Za-z][A-Za-z0-9 ._/-]*[A-Za-z0-9.])>")
"""`<Specify path>`, `<PATH TO CHECKPOINTS DIRECTORY>`: values the scripts leave for the user to fill."""
SCRATCH_DIRS = ("tmp", "dataset")
"""Directories some scripts write their DeepSpeed JSON into without creating them."""


def fill_placeholders(script: Path) -> bool:
    """Replace the user-to-fill placeholders by paths (bash reads `X=<...>` as a redirection)."""
    text = script.read_text(errors="replace")
    filled = PLACEHOLDER.sub(lambda m: "/placeholder/" + re.sub(r"[^A-Za-z0-9]+", "_", m.group(1)).lower(), text)
    script.write_text(filled)
    return filled != text


def capture_one(script: Path, root: Path, stubs: Path, args: list[str]) -> tuple[list[dict], str]:
    """Run `script` from its own directory, then (if that captured no readable JSON) from the
    repository root, as some scripts expect; (records, what bash said when it captured nothing)."""
    tries = []
    for cwd in (script.parent, root):
        for d in SCRATCH_DIRS:
            (cwd / d).mkdir(exist_ok=True)
        tries.append(_run(script, cwd, stubs, args))
        records = tries[-1][0]
        if records and all("ds_config_error" not in r for r in records):
            return tries[-1]
    return next((t for t in tries if t[0]), tries[0])


def _run(script: Path, cwd: Path, stubs: Path, args: list[str]) -> tuple[list[dict], str]:
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as out:
        env = {
            **os.environ,
            "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
            "CAPTURE_FILE": out.name,
            "HOSTNAME": "node0",
        }
        try:
            done = subprocess.run(
                ["bash", str(script), *args],
                cwd=cwd,
                env=env,
                capture_output=True,
                text=True,
                timeout=SCRIPT_TIMEOUT_S,
            )
            said = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        except subprocess.TimeoutExpired:
            said = [f"timed out after {SCRIPT_TIMEOUT_S} s"]
        records = [json.loads(line) for line in Path(out.name).read_text().splitlines() if line]
    return records, said[0]


def capture(upstream: str, name: str, gpu_name: str, only: tuple[str, ...] = ()) -> list[dict]:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch) / name
        shutil.copytree(upstream, root, ignore=shutil.ignore_patterns(".git"))
        stubs = Path(scratch) / "stubs"
        stubs.mkdir()
        make_stubs(stubs, gpu_name)
        lines = []
        for script in scripts_of(root, only):
            filled = fill_placeholders(script)
            rel = str(script.relative_to(root))
            records, said = capture_one(script, root, stubs, SCRIPT_ARGS.get(rel, []))
            records = json.loads(json.dumps(records).replace(str(root), "<repo>"))  # no scratch paths
            if not records:
                records = [{"not_captured": said}]
            lines += [{"upstream": name, "script": rel, "placeholders_filled": filled, **r} for r in records]
        return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron-deepspeed", required=True, help="a Megatron-DeepSpeed checkout")
    p.add_argument("--megatron-lm", help="a Megatron-LM checkout")
    p.add_argument("--gpu-name", default="NVIDIA A100-SXM4-80GB", help="what the nvidia-smi stub reports")
    p.add_argument("--out", required=True, help="the JSON file to write")
    args = p.parse_args(argv)
    for flag, checkout in (("--megatron-deepspeed", args.megatron_deepspeed), ("--megatron-lm", args.megatron_lm)):
        if checkout and not os.path.isdir(checkout):
            print(f"error: {flag} {checkout}: no such directory; give a checkout of it", file=sys.stderr)
            return 2
    lines = capture(args.megatron_deepspeed, "Megatron-DeepSpeed", args.gpu_name)
    if args.megatron_lm:
        lines += capture(args.megatron_lm, "Megatron-LM", args.gpu_name, MEGATRON_LM_SCRIPTS)
    Path(args.out).write_text(json.dumps({"gpu_name": args.gpu_name, "lines": lines}, indent=1) + "\n")
    captured = sum(1 for x in lines if "argv" in x)
    print(f"{captured} command lines from {len({x['script'] for x in lines})} scripts -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
