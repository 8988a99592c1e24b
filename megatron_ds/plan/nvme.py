"""`nvme`: DeepNVMe guidance: which handle, the `aio` config block, an example script, and tuning.

The `aio` keys are those of the installed DeepSpeed (`deepspeed/runtime/swap_tensor/constants.py`,
kept equal by a test); the handle methods are those its pybind module defines
(`deepspeed/ops/csrc/aio/py_lib/py_ds_aio.cpp`, `.../gds/py_lib/py_ds_gds.cpp`), also checked by a test.
"""

from __future__ import annotations

from megatron_ds.plan.context import Context
from megatron_ds.plan.report import Section

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

EXAMPLE_SCRIPT = '''\
"""Write and read a tensor with DeepNVMe (DeepSpeed async I/O). Usage: python deepnvme_example.py /mnt/nvme"""
import os
import sys

import torch
from deepspeed.ops.op_builder import AsyncIOBuilder, GDSBuilder

FOLDER = sys.argv[1] if len(sys.argv) > 1 else "/local_nvme"
NUM_ELEMENTS = 16 * 1024 * 1024  # fp32 elements: 64 MiB
HANDLE_ARGS = dict(block_size=1024 * 1024, queue_depth=32, single_submit=False, overlap_events=True,
                   intra_op_parallelism=8)


def cpu_tensors_with_aio_handle():
    handle = AsyncIOBuilder().load().aio_handle(**HANDLE_ARGS)
    # Page-locked (pinned) buffers: the kernel DMAs straight from them; unpinned tensors cost an extra copy.
    src = handle.new_cpu_locked_tensor(NUM_ELEMENTS, torch.empty(0, dtype=torch.float32))
    dst = handle.new_cpu_locked_tensor(NUM_ELEMENTS, torch.empty(0, dtype=torch.float32))
    src.copy_(torch.randn(NUM_ELEMENTS))
    path = os.path.join(FOLDER, "aio_tensor.bin")

    assert handle.sync_pwrite(src, path) == 1        # blocking: returns the completed operations
    assert handle.sync_pread(dst, path) == 1
    assert torch.equal(src, dst)

    dst.zero_()
    assert handle.async_pwrite(src, path) == 0       # non-blocking: returns at once
    # ... overlap other work here; do not modify `src` until wait() returns ...
    assert handle.wait() == 1                        # completes every submitted operation
    assert handle.async_pread(dst, path) == 0
    assert handle.wait() == 1                        # `dst` is valid only after wait()
    assert torch.equal(src, dst)

    handle.free_cpu_locked_tensor(src)
    handle.free_cpu_locked_tensor(dst)


def cuda_tensors_with_gds_handle():
    handle = GDSBuilder().load().gds_handle(**HANDLE_ARGS)
    src = torch.randn(NUM_ELEMENTS, device="cuda")
    dst = torch.empty_like(src)
    handle.pin_device_tensor(src)                    # register GPU buffers with cuFile
    handle.pin_device_tensor(dst)
    path = os.path.join(FOLDER, "gds_tensor.bin")

    assert handle.async_pwrite(src, path) == 0       # GPU memory -> NVMe, no bounce through host memory
    assert handle.wait() == 1
    assert handle.sync_pread(dst, path) == 1
    assert torch.equal(src, dst)

    handle.unpin_device_tensor(src)
    handle.unpin_device_tensor(dst)


if __name__ == "__main__":
    cpu_tensors_with_aio_handle()
    if torch.cuda.is_available() and os.environ.get("USE_GDS") == "1":
        cuda_tensors_with_gds_handle()
    print("DeepNVMe round trip ok")
'''


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
    sec.add(
        "Pinned tensors: the handle DMAs from page-locked memory; allocate with handle.new_cpu_locked_tensor() "
        "(or torch's pin_memory() on CUDA machines). Unpinned tensors are accepted but staged through a copy.",
        "Blocking calls (sync_pwrite/sync_pread) return the completed operation count. Non-blocking calls "
        "(async_pwrite/async_pread) return 0 at once; handle.wait() completes all of them and returns how many; "
        "do not read a destination or modify a source tensor before wait() returns.",
        "Check the ops: run `ds_report` and look for `async_io` and `gds` rows marked [OKAY] (compatible); "
        "the DeepNVMe handle API described here needs DeepSpeed >= 0.15.0. async_io needs the libaio "
        "development files: `apt install libaio-dev` (Debian/Ubuntu) or `yum install libaio-devel`; if installed "
        "elsewhere set CFLAGS/LDFLAGS to its include/lib directories.",
        "Tuning (the `aio` block for ZeRO-Infinity offload, or the handle's constructor arguments): "
        "intra_op_parallelism splits each request over that many threads (raise it first when one file is "
        "slow); queue_depth is the number of in-flight requests per thread (8-32 for NVMe); block_size is the "
        "request size (128 KiB-8 MiB; larger for big sequential tensors); single_submit submits requests one by "
        "one; overlap_events overlaps submission with completion. Measure with DeepSpeed's ds_nvme_tune / "
        "ds_io tools on your drive before fixing values.",
    )
    sec.snippets["DeepSpeed aio block (installed version's keys and defaults)"] = AIO_BLOCK
    sec.snippets["deepnvme_example.py"] = EXAMPLE_SCRIPT
    sec.data = {
        "handle": "gds_handle" if (device == "cuda" and storage == "nvme") else "aio_handle" if device else None
    }
    if storage is None or device is None:
        sec.check(None, "handle choice: storage type (--storage) and tensor device (--tensor-device) not given")
    sec.check(None, "async_io/gds availability on your machines: not inspected; run ds_report there")
    return sec
