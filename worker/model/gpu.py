"""Whether this machine has an NVIDIA GPU: what tells a CPU machine's expected fallback from
a GPU machine's CUDA failure.

onnxruntime-gpu lists ``CUDAExecutionProvider`` as available on every machine (it is compiled
in, GPU or not), so the runtime cannot tell; the device files can, and the CUDA driver where
there are none. Asked only after CUDA failed to start, so a GPU machine that serves on CUDA
never pays for it.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

__all__ = ["free_bytes", "present"]

_CUDA_SUCCESS = 0


def present() -> bool:
    """True when an NVIDIA GPU is visible here: a device file, or a device the driver counts."""
    return _device_files() or _driver_device_count() > 0


def _device_files() -> bool:
    """/dev/nvidia0, ... on Linux and in containers given a GPU; /dev/dxg under WSL 2."""
    return any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/dxg").exists()


def _driver_device_count() -> int:
    """The devices the CUDA driver counts; 0 without a driver (its library not loadable) or
    when it reports no device."""
    names = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1",)
    for name in names:
        try:
            driver = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        if driver.cuInit(0) != _CUDA_SUCCESS:
            return 0
        if driver.cuDeviceGetCount(ctypes.byref(count)) != _CUDA_SUCCESS:
            return 0
        return count.value
    return 0


def free_bytes(device_id: int = 0) -> int | None:
    """Free memory on CUDA device ``device_id`` now, from the driver (``cuMemGetInfo`` in the
    device's primary context, the one ONNX Runtime's sessions use); None without a driver or
    device. What the session budget checks before loading a model on the GPU."""
    try:
        driver = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    except OSError:
        return None
    device, context = ctypes.c_int(0), ctypes.c_void_p()
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    if driver.cuInit(0) != _CUDA_SUCCESS:
        return None
    if driver.cuDeviceGet(ctypes.byref(device), device_id) != _CUDA_SUCCESS:
        return None
    if driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) != _CUDA_SUCCESS:
        return None
    try:
        if driver.cuCtxPushCurrent_v2(context) != _CUDA_SUCCESS:
            return None
        try:
            if driver.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) != _CUDA_SUCCESS:
                return None
        finally:
            driver.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        driver.cuDevicePrimaryCtxRelease_v2(device)
    return int(free.value)
