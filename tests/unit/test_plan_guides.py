"""The planner's guides (`megatron_ds/plan/guides/`): every paragraph is printed, what they claim
about the installed DeepSpeed holds, and the DeepNVMe example program runs.

The example program runs here against a stand-in `aio_handle` that keeps the contract the guide
states (blocking calls return the completed count, non-blocking ones 0 and finish at `wait()`),
with files written to a temporary folder; against DeepSpeed's real async_io op when that op can be
built (it needs libaio's development files). Its GPUDirect Storage part needs CUDA and cuFile: it
is compiled and its handle methods checked against DeepSpeed's pybind module, not run.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from megatron_ds.plan import nvme, precision
from megatron_ds.plan.__main__ import main
from megatron_ds.plan.report import guide, guide_file

GUIDES = Path(nvme.__file__).parent / "guides"
CSRC = Path(importlib.util.find_spec("deepspeed").origin).parent / "ops" / "csrc"
AIO_CPP = CSRC / "aio" / "py_lib" / "py_ds_aio.cpp"
GDS_CPP = CSRC / "gds" / "py_lib" / "py_ds_gds.cpp"
RUNS = {  # a planner run that prints each guide, every paragraph of it
    "nvme": ["nvme"],
    "onebit": ["onebit"],
    "precision": ["precision", "--gpu", "A100-80GB"],  # bf16: with its accumulation note
    "zero": ["zero", "--model", "1.3b", "--num-gpus", "8", "--gpu", "A100-80GB"],
}


def _methods(cpp: Path) -> set[str]:
    return set(re.findall(r'\.def\(\s*"(\w+)"', cpp.read_text()))


def _constructor_args(cpp: Path) -> set[str]:
    init = re.search(r"py::init<[^>]*>\(\),(.*?)\)\s*\.def", cpp.read_text(), re.S)
    assert init is not None, cpp
    return set(re.findall(r'"(\w+)"_a', init[1]))


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deepnvme_example", GUIDES / nvme.EXAMPLE_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not as __main__: nothing runs yet
    return module


class StandInAioHandle:
    """DeepNVMe's `aio_handle` as the guide describes it, on plain files."""

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.pending: list = []

    def new_cpu_locked_tensor(self, num_elements: int, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(num_elements, dtype=like.dtype)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> None:
        pass

    def sync_pwrite(self, tensor: torch.Tensor, path: str) -> int:
        Path(path).write_bytes(tensor.numpy().tobytes())
        return 1

    def sync_pread(self, tensor: torch.Tensor, path: str) -> int:
        tensor.copy_(torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=tensor.dtype))
        return 1

    def async_pwrite(self, tensor: torch.Tensor, path: str) -> int:
        self.pending.append((self.sync_pwrite, tensor, path))
        return 0

    def async_pread(self, tensor: torch.Tensor, path: str) -> int:
        self.pending.append((self.sync_pread, tensor, path))
        return 0

    def wait(self) -> int:
        done, self.pending = self.pending, []
        return sum(op(tensor, path) for op, tensor, path in done)


def test_example_program_runs_on_cpu_files(tmp_path) -> None:
    example = _load_example()
    handles: list[StandInAioHandle] = []

    def aio_handle(**kwargs) -> StandInAioHandle:
        handles.append(StandInAioHandle(**kwargs))
        return handles[-1]

    example.AsyncIOBuilder = lambda: SimpleNamespace(load=lambda: SimpleNamespace(aio_handle=aio_handle))
    example.FOLDER, example.NUM_ELEMENTS = str(tmp_path), 1024  # 4 KiB instead of 64 MiB
    example.cpu_tensors_with_aio_handle()  # its own asserts check every return value and the round trips
    assert set(handles[0].kwargs) <= _constructor_args(AIO_CPP)
    assert (tmp_path / "aio_tensor.bin").stat().st_size == 1024 * 4 and not handles[0].pending


@pytest.mark.slow  # builds DeepSpeed's async_io op where libaio is installed (about 3 minutes on 2 cores)
def test_example_program_with_deepspeeds_async_io(tmp_path) -> None:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("DeepSpeed's async_io op cannot be built here (libaio development files missing)")
    example = _load_example()
    example.FOLDER, example.NUM_ELEMENTS = str(tmp_path), 1024
    example.cpu_tensors_with_aio_handle()


def test_example_program_calls_only_what_the_installed_handles_define() -> None:
    script = guide_file(nvme.EXAMPLE_FILE)
    compile(script, nvme.EXAMPLE_FILE, "exec")
    aio_part, gds_part = script.split("def cuda_tensors_with_gds_handle")
    assert set(re.findall(r"handle\.(\w+)\(", aio_part)) <= _methods(AIO_CPP)
    assert set(re.findall(r"handle\.(\w+)\(", gds_part)) <= _methods(GDS_CPP)
    assert set(_load_example().HANDLE_ARGS) <= _constructor_args(AIO_CPP) & _constructor_args(GDS_CPP)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_every_paragraph_is_printed(name, capsys) -> None:
    assert {p.stem for p in GUIDES.glob("*.txt")} == set(RUNS)
    main(RUNS[name])
    out = capsys.readouterr().out
    unused = [key for key, text in guide(name).items() if text not in out]
    assert not unused, f"guides/{name}.txt paragraphs not printed by {RUNS[name]}: {unused}"


def test_the_nvme_guide_names_what_deepspeed_defines() -> None:
    from deepspeed.runtime.swap_tensor.aio_config import AIO_DEFAULT_DICT

    text = guide("nvme")
    named = set(re.findall(r"\b((?:a?sync_p(?:read|write))|wait|new_cpu_locked_tensor)\b", " ".join(text.values())))
    assert named == {"sync_pwrite", "sync_pread", "async_pwrite", "async_pread", "wait", "new_cpu_locked_tensor"}
    assert named <= _methods(AIO_CPP)
    tuned = {key for key in AIO_DEFAULT_DICT if key in text["tuning"]}
    assert tuned == set(AIO_DEFAULT_DICT) - {"use_gds"}  # each tuning knob explained; use_gds picks the handle


def test_the_precision_lines_state_the_thresholds_the_code_uses() -> None:
    text = guide("precision")

    def cc(version: tuple[int, int]) -> str:
        return f"{version[0]}.{version[1]}"

    assert f"compute capability {cc(precision.FP16_TENSOR_CORE_CC)} (Volta)" in text["fp16"]
    assert f"needs {cc(precision.BF16_MIN_CC)} (Ampere)" in text["bf16"]
    assert f"needs {cc(precision.FP8_MIN_CC)} (Ada)" in text["fp8"]


def test_a_malformed_guide_is_refused(monkeypatch) -> None:
    from megatron_ds.plan import report

    monkeypatch.setattr(report, "guide_file", lambda name: "[a]\none\n[a]\ntwo\n")
    with pytest.raises(ValueError, match=r"\[a\] appears twice"):
        report.guide.__wrapped__("x")
    monkeypatch.setattr(report, "guide_file", lambda name: "loose text\n[a]\none\n")
    with pytest.raises(ValueError, match="before the first"):
        report.guide.__wrapped__("x")
