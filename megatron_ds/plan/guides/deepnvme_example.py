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
