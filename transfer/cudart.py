"""The raw CUDA runtime and driver entry points the CUDA backend calls through ctypes.

Only the libraries torch itself loaded are used (found by soname with ``RTLD_NOLOAD``, else in
``/proc/self/maps``), so every call shares torch's contexts and the runtime's per-thread state.
torch's own ``torch.cuda.cudart()`` module binds only a few calls (register, unregister, streams,
memory info) and no ``cudaGetLastError``, so it cannot clear the error a failed call leaves.

A failed raw call is a ``CudaCallError`` carrying the code and its name (``cudaGetErrorName``).
Its ``sticky`` says whether the code is one after which the context is lost for good (an
illegal address, a launch failure, an uncorrectable ECC error, ...): CUDA documents these
as "any further CUDA work will return the same error; the process must be terminated".
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "STICKY_CODES",
    "BatchMemcpy",
    "CudaCallError",
    "Memcpy2DAsync",
    "MemcpyAsync",
    "RawCuda",
    "driver_libraries",
    "find_raw_cuda",
    "runtime_library",
]

MemcpyAsync = Callable[[int, int, int, int, int], int]
"""``cudaMemcpyAsync(dst, src, nbytes, kind, stream) -> cudaError_t``."""
Memcpy2DAsync = Callable[[int, int, int, int, int, int, int, int], int]
"""``cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream)``."""
BatchMemcpy = Callable[[int, int, int, int, int], int]
"""``(dsts_ptr, srcs_ptr, sizes_ptr, count, stream) -> CUresult``: arrays of uint64."""

STICKY_CODES = frozenset({214, 220, 700, 702, 710, 714, 715, 716, 717, 718, 719})
"""``cudaError_t`` / ``CUresult`` codes (the two agree on these) that poison the context:
ECC uncorrectable, NVLink uncorrectable, illegal address, launch timeout, device assert,
hardware stack error, illegal instruction, misaligned address, invalid address space,
invalid PC, launch failure. Not 709 (context destroyed): it also means a thread whose primary
context was never made current, which binding the thread mends."""

_MAX_PITCH_ATTR = 11  # cudaDevAttrMaxPitch: the largest pitch a 2D copy accepts


class CudaCallError(RuntimeError):
    """A raw CUDA call returned ``code``; ``sticky`` when the context is lost for good."""

    def __init__(self, call: str, code: int, name: str | None = None) -> None:
        self.call = call
        self.code = code
        self.sticky = code in STICKY_CODES
        label = f"{code} ({name})" if name else str(code)
        lost = ": the CUDA context is lost" if self.sticky else ""
        super().__init__(f"{call} returned {label}{lost}")


@dataclass
class RawCuda:
    """The raw entry points of the CUDA runtime (and driver) torch itself loaded.

    ``batch`` is None where the driver lacks ``cuMemcpyBatchAsync`` (< 12.8); the optional
    entries are None where the library lacks them (the callers then do without).
    """

    memcpy: MemcpyAsync
    memcpy2d: Memcpy2DAsync | None
    batch: BatchMemcpy | None
    get_last_error: Callable[[], int]
    error_name: Callable[[int], str | None] | None = None
    set_device: Callable[[int], int] | None = None
    max_pitch: Callable[[int], int | None] | None = None
    driver_error_name: Callable[[int], str | None] | None = None

    def clear_error(self) -> int:
        """Reset the calling thread's last CUDA error (after a failed raw call)."""
        try:
            return int(self.get_last_error())
        except Exception:  # never let the clean-up hide the original failure
            return -1

    def failed(self, call: str, code: int, *, driver: bool = False) -> CudaCallError:
        """Clear the thread's last error and describe the failure of ``call`` (a driver call,
        ``driver=True``, returns a ``CUresult``: named by ``cuGetErrorName``)."""
        self.clear_error()
        namer = self.driver_error_name if driver else self.error_name
        name = None
        if namer is not None:
            try:
                name = namer(code)
            except Exception:
                name = None
        return CudaCallError(call, code, name)

    def bind_thread(self, device: int) -> None:
        """Make ``device``'s primary context current on this thread (``cudaSetDevice``
        initializes it since CUDA 12). The driver's batch call uses the thread's current
        context, which a fresh thread lacks until some runtime call made one current."""
        if self.set_device is not None:
            code = int(self.set_device(device))
            if code != 0:
                raise self.failed(f"cudaSetDevice({device})", code)


def _maps_paths(name: str) -> list[str]:
    """Paths of mapped files whose base name starts with ``name`` (``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    paths = set()
    for ln in lines:
        parts = ln.split(maxsplit=5)  # address perms offset dev inode [path, may hold spaces]
        if len(parts) < 6:
            continue
        path = parts[5].removesuffix(" (deleted)")
        if os.path.basename(path).startswith(name):
            paths.add(path)
    return sorted(paths)


def _loaded(sonames: list[str], name: str) -> list[Any]:
    """Handles of ``name`` already loaded in this process: by soname first (the copy the
    dynamic linker gave torch), then any mapped file of that name."""
    libs = []
    for soname in sonames:
        try:
            libs.append(ctypes.CDLL(soname, mode=os.RTLD_NOLOAD | os.RTLD_LAZY))
        except OSError:
            continue
    for path in _maps_paths(name):
        try:
            libs.append(ctypes.CDLL(path))
        except OSError:
            continue
    return libs


def _sym(lib: Any, name: str, argtypes: list[Any], restype: Any = ctypes.c_int) -> Any:
    fn = getattr(lib, name, None)
    if fn is None:
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


def runtime_library() -> Any:
    """torch's CUDA runtime (``libcudart``) as a ctypes library, or None (a CPU build, a
    static runtime). Bound: ``cudaMemcpyAsync``, ``cudaMemcpy2DAsync``, ``cudaGetLastError``,
    ``cudaGetErrorName``, ``cudaSetDevice``, ``cudaDeviceGetAttribute``, ``cudaHostRegister``,
    ``cudaHostUnregister`` (each None on the library where it is missing)."""
    major = (torch.version.cuda or "").split(".")[0]
    sonames = [f"libcudart.so.{major}"] if major.isdigit() else []
    vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    for lib in _loaded(sonames, "libcudart.so"):
        if _sym(lib, "cudaMemcpyAsync", [vp, vp, sz, i, vp]) is None:
            continue
        if _sym(lib, "cudaGetLastError", []) is None:
            continue
        _sym(lib, "cudaMemcpy2DAsync", [vp, sz, vp, sz, sz, sz, i, vp])
        _sym(lib, "cudaGetErrorName", [i], ctypes.c_char_p)
        _sym(lib, "cudaSetDevice", [i])
        _sym(lib, "cudaDeviceGetAttribute", [ctypes.POINTER(i), i, i])
        _sym(lib, "cudaHostRegister", [vp, sz, ctypes.c_uint])
        _sym(lib, "cudaHostUnregister", [vp])
        return lib
    return None


def driver_libraries() -> list[Any]:
    """The CUDA driver (``libcuda``) as torch loaded it, as ctypes handles ([] without one)."""
    return _loaded(["libcuda.so.1"], "libcuda.so")


def _bind_batch(lib: Any, version: int) -> BatchMemcpy | None:
    """``cuMemcpyBatchAsync`` of ``lib`` for driver ``version``, or None. CUDA 13 exports the
    call without ``failIdx`` as ``_v2``; 12.8 and later also export it with ``failIdx`` under
    the plain name (13 keeps it for binaries built against 12.x)."""
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    # CUmemcpyAttributes: srcAccessOrder, srcLocHint{type,id}, dstLocHint{type,id}, flags.
    attrs = (ctypes.c_int * 6)(1, 0, 0, 0, 0, 0)  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    attrs_idx = (ctypes.c_size_t * 1)(0)
    v2 = _sym(lib, "cuMemcpyBatchAsync_v2", [vp, vp, vp, sz, vp, vp, sz, vp])
    if v2 is not None and version >= 13000:

        def batch_v2(dsts: int, srcs: int, sizes: int, count: int, stream: int) -> int:
            return int(v2(dsts, srcs, sizes, count, attrs, attrs_idx, 1, stream))

        return batch_v2
    v1 = _sym(lib, "cuMemcpyBatchAsync", [vp, vp, vp, sz, vp, vp, sz, vp, vp])
    if v1 is not None and version >= 12080:
        fail_idx = ctypes.c_size_t(0)

        def batch_v1(dsts: int, srcs: int, sizes: int, count: int, stream: int) -> int:
            idx = ctypes.byref(fail_idx)
            return int(v1(dsts, srcs, sizes, count, attrs, attrs_idx, 1, idx, stream))

        return batch_v1
    return None


def _find_batch() -> BatchMemcpy | None:
    """``cuMemcpyBatchAsync`` of the driver already loaded, or None (driver < 12.8, or
    ``KVOFFLOAD_CUDA_BATCH_MEMCPY=0``)."""
    if os.environ.get("KVOFFLOAD_CUDA_BATCH_MEMCPY", "1") == "0":
        return None
    for lib in driver_libraries():
        version = ctypes.c_int(0)
        get_version = _sym(lib, "cuDriverGetVersion", [ctypes.POINTER(ctypes.c_int)])
        if get_version is None or get_version(ctypes.byref(version)) != 0:
            continue
        batch = _bind_batch(lib, version.value)
        if batch is not None:
            return batch
    return None


def _driver_error_name() -> Callable[[int], str | None] | None:
    for lib in driver_libraries():
        fn = _sym(lib, "cuGetErrorName", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)])
        if fn is not None:

            def name(code: int, fn: Any = fn) -> str | None:
                out = ctypes.c_char_p()
                if fn(code, ctypes.byref(out)) != 0 or not out.value:
                    return None
                return out.value.decode(errors="replace")

            return name
    return None


def find_raw_cuda() -> RawCuda | None:
    """The raw entry points of the runtime torch loaded (``runtime_library``), or None (also
    with ``KVOFFLOAD_CUDA_RAW_MEMCPY=0``: copies then go through torch). A ctypes call costs
    about a microsecond, a torch ``copy_`` of two slices several."""
    if os.environ.get("KVOFFLOAD_CUDA_RAW_MEMCPY", "1") == "0":
        return None
    lib = runtime_library()
    if lib is None:
        return None
    get_name = getattr(lib, "cudaGetErrorName", None)
    get_attr = getattr(lib, "cudaDeviceGetAttribute", None)

    def error_name(code: int) -> str | None:
        raw = get_name(code) if get_name is not None else None
        return raw.decode(errors="replace") if raw else None

    def max_pitch(device: int) -> int | None:
        value = ctypes.c_int(0)
        if get_attr is None or get_attr(ctypes.byref(value), _MAX_PITCH_ATTR, device) != 0:
            lib.cudaGetLastError()
            return None
        return value.value

    return RawCuda(
        lib.cudaMemcpyAsync,
        getattr(lib, "cudaMemcpy2DAsync", None),
        _find_batch(),
        lib.cudaGetLastError,
        error_name,
        getattr(lib, "cudaSetDevice", None),
        max_pitch,
        _driver_error_name(),
    )
