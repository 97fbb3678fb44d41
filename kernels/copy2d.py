"""Strided copies between pinned host memory and the device in one call.

The host KV tier keeps its pages layer-major, `(num_layers, 2, num_pages, ...)`, so a run of
pages is one block per layer and K/V: 64 blocks for an 8B model. Copied with torch, each block
is its own `copy_` (about 20 us of host time each, and a fixed cost on the copy engine), and a
session turn's few new pages cost more to queue than to send. The blocks are rows of one width
at one pitch on either side, which is what the CUDA driver's `cuMemcpy2DAsync` copies in one
call on a copy engine: `copy_rows` sends them so.

The driver takes pitches up to the device's maximum (2 GiB on current GPUs); a host pool
larger than that per row (the pitch is the pool's size over `2 * num_layers`) falls back to
torch's per-row copies.
"""

from __future__ import annotations

import ctypes
import functools

import torch

_UNIFIED = 4  # CU_MEMORYTYPE_UNIFIED: a unified-virtual-address pointer, host or device
_MAX_PITCH = 11  # CU_DEVICE_ATTRIBUTE_MAX_PITCH


class _Memcpy2D(ctypes.Structure):
    """The driver's CUDA_MEMCPY2D."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_uint), ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_uint), ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemcpy2DAsync_v2.argtypes = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p]
    lib.cuMemcpy2DAsync_v2.restype = ctypes.c_int
    return lib


@functools.cache
def max_pitch(device_index: int) -> int:
    """The largest pitch, in bytes, the driver copies on this device."""
    lib = _driver()
    dev, value = ctypes.c_int(), ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
    _check(lib.cuDeviceGetAttribute(ctypes.byref(value), _MAX_PITCH, dev),
           "cuDeviceGetAttribute")
    return value.value


def _check(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"{what} failed: CUresult {rc}")


def _rows(t: torch.Tensor) -> tuple[int, int]:
    """(width, pitch) in bytes of `t`'s rows (its first dimension), each contiguous."""
    if t.dim() < 2 or not t[0].is_contiguous():
        raise ValueError(f"not rows at a pitch: shape {tuple(t.shape)}, strides {t.stride()}")
    return t[0].numel() * t.element_size(), t.stride(0) * t.element_size()


def copy_rows(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """`dst.copy_(src)` queued on `stream` without waiting, for two tensors of one shape and
    dtype whose rows (entries of the first dimension) are each contiguous: one is on the CUDA
    device, the other in pinned host memory (or on the device). One driver call for all rows
    while both pitches are within the device's limit, a copy per row otherwise."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"copy_rows: {tuple(src.shape)} {src.dtype} into "
                         f"{tuple(dst.shape)} {dst.dtype}")
    (width, dst_pitch), (_, src_pitch) = _rows(dst), _rows(src)
    if width == 0 or dst.shape[0] == 0:
        return
    device = stream.device
    if max(dst_pitch, src_pitch) > max_pitch(device.index or 0):
        with torch.cuda.stream(stream):
            for d, s in zip(dst, src, strict=True):
                d.copy_(s, non_blocking=True)
        return
    p = _Memcpy2D(srcMemoryType=_UNIFIED, srcDevice=src.data_ptr(), srcPitch=src_pitch,
                  dstMemoryType=_UNIFIED, dstDevice=dst.data_ptr(), dstPitch=dst_pitch,
                  WidthInBytes=width, Height=dst.shape[0])
    _check(_driver().cuMemcpy2DAsync_v2(ctypes.byref(p), stream.cuda_stream),
           "cuMemcpy2DAsync")
