"""`nvme`: DeepNVMe guidance: which handle, the `aio` config block, an example script, and tuning.

The fixed paragraphs are `guides/nvme.txt` and the example program `guides/deepnvme_example.py`.

The `aio` keys are those of the installed DeepSpeed (`deepspeed/runtime/swap_tensor/constants.py`,
kept equal by a test); the handle methods are those its pybind module defines
(`deepspeed/ops/csrc/aio/py_lib/py_ds_aio.cpp`, `.../gds/py_lib/py_ds_gds.cpp`), also checked by a test.
"""

from __future__ import annotations

from megatron_ds.plan.context import Context
from megatron_ds.plan.report import Section, guide, guide_file

AIO_BLOCK = {
    "aio": {
        "block_size": 1048576,
        "queue_depth": 8,
        "intra_op_parallelism": 1,
        "single_submit": False,
        "overlap_events": True,
        "use_gds": False,
    }
}
"""DeepSpeed's defaults for the `aio` section (AIO_DEFAULT_DICT)."""

EXAMPLE_FILE = "deepnvme_example.py"
"""The example program (`guides/deepnvme_example.py`, linted and run by the tests), printed as it is."""


def nvme_section(ctx: Context) -> Section:
    sec = Section("nvme", "DeepNVMe (async tensor I/O)")
    storage, device = ctx.res.raw.storage, ctx.res.raw.tensor_device
    if device == "cuda" and storage == "nvme":
        sec.add(
            "Use gds_handle: CUDA tensors to and from local NVMe with GPUDirect Storage (no host bounce "
            "buffer); it needs NVIDIA GDS (cuFile) and DeepSpeed's `gds` op. Without GDS, copy to a pinned CPU "
            "tensor and use aio_handle."
        )
    elif device == "cpu" or (device == "cuda" and storage not in (None, "nvme")):
        sec.add(
            "Use aio_handle (libaio): CPU tensors in pinned memory to and from files"
            + (
                "; GPUDirect Storage needs local NVMe, so CUDA tensors go through a pinned CPU copy."
                if device == "cuda"
                else "."
            )
        )
    else:
        sec.add(
            "aio_handle for CPU tensors (libaio); gds_handle for CUDA tensors on local NVMe with GPUDirect "
            "Storage. Tell us --storage and --tensor-device to pick one."
        )
    if storage in ("sata-ssd", "network", "none"):
        sec.add(
            f"Storage {storage}: DeepNVMe's gains come from NVMe queue depth and parallelism; on {storage} "
            f"expect the device's bandwidth at best."
        )
    text = guide("nvme")
    sec.add(text["pinned"], text["calls"], text["ops"], text["tuning"])
    sec.snippets["DeepSpeed aio block (installed version's keys and defaults)"] = AIO_BLOCK
    sec.snippets[EXAMPLE_FILE] = guide_file(EXAMPLE_FILE)
    sec.data = {
        "handle": "gds_handle" if (device == "cuda" and storage == "nvme") else "aio_handle" if device else None
    }
    if storage is None or device is None:
        sec.check(None, "handle choice: storage type (--storage) and tensor device (--tensor-device) not given")
    sec.check(None, "async_io/gds availability on your machines: not inspected; run ds_report there")
    return sec
