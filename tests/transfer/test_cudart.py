"""The raw CUDA bindings without a GPU: which ``cuMemcpyBatchAsync`` ABI is bound for which
driver, how a failed call is described and classified, and how the libraries are found."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from tests.transfer.fake_cuda import FakeRaw
from transfer import cudart
from transfer.cudart import STICKY_CODES, CudaCallError, RawCuda


class FakeDriver:
    """A driver library exporting the batch call under the names given; records the calls."""

    def __init__(self, *names: str) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        for name in names:
            setattr(self, name, self._entry(name))

    def _entry(self, name: str) -> Any:
        def call(*args: Any) -> int:
            self.calls.append((name, args))
            return 0

        return call


@pytest.mark.parametrize(
    ("version", "names", "bound", "arity"),
    [
        (12080, ("cuMemcpyBatchAsync",), "cuMemcpyBatchAsync", 9),  # with failIdx
        (12090, ("cuMemcpyBatchAsync", "cuMemcpyBatchAsync_v2"), "cuMemcpyBatchAsync", 9),
        (13000, ("cuMemcpyBatchAsync", "cuMemcpyBatchAsync_v2"), "cuMemcpyBatchAsync_v2", 8),
        (13010, ("cuMemcpyBatchAsync",), "cuMemcpyBatchAsync", 9),  # no _v2: the 12.x ABI
        (12060, ("cuMemcpyBatchAsync",), None, 0),  # too old: no batch call
    ],
)
def test_the_batch_abi_follows_the_driver_version(version, names, bound, arity) -> None:
    lib = FakeDriver(*names)
    batch = cudart._bind_batch(lib, version)
    if bound is None:
        assert batch is None
        return
    assert batch is not None
    assert batch(11, 22, 33, 4, 55) == 0
    [(name, args)] = lib.calls
    assert name == bound
    assert len(args) == arity
    assert args[:4] == (11, 22, 33, 4)  # dsts, srcs, sizes, count
    assert args[-1] == 55  # the stream, last in both ABIs
    attrs = ctypes.cast(args[4], ctypes.POINTER(ctypes.c_int * 6)).contents
    assert list(attrs) == [1, 0, 0, 0, 0, 0]  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, no hints
    assert args[6] == 1  # one attribute for every copy


def test_a_failed_call_is_named_cleared_and_classified() -> None:
    fake = FakeRaw()
    raw = RawCuda(fake.memcpy, None, None, fake.get_last_error, lambda code: f"cudaError{code}")
    error = raw.failed("cudaMemcpy2DAsync", 700)
    assert isinstance(error, RuntimeError)
    assert error.sticky
    assert error.code == 700
    assert str(error) == ("cudaMemcpy2DAsync returned 700 (cudaError700): the CUDA context is lost")
    assert fake.last_error_resets == 1
    plain = raw.failed("cudaMemcpyAsync", 1)
    assert not plain.sticky
    assert str(plain) == "cudaMemcpyAsync returned 1 (cudaError1)"
    assert str(CudaCallError("cuMemcpyBatchAsync", 801)) == "cuMemcpyBatchAsync returned 801"
    # A driver call's CUresult is named by the driver: the runtime's names differ for a code.
    both = RawCuda(
        fake.memcpy,
        None,
        None,
        fake.get_last_error,
        lambda code: "cudaErrorDeviceUninitialized",
        driver_error_name=lambda code: "CUDA_ERROR_INVALID_CONTEXT",
    )
    assert "(CUDA_ERROR_INVALID_CONTEXT)" in str(
        both.failed("cuMemcpyBatchAsync", 201, driver=True)
    )
    assert "(cudaErrorDeviceUninitialized)" in str(both.failed("cudaMemcpyAsync", 201))


def test_the_sticky_codes_are_the_context_losing_ones() -> None:
    # cudaErrorIllegalAddress, LaunchTimeout, Assert, LaunchFailure, ECCUncorrectable
    assert {700, 702, 710, 719, 214} <= STICKY_CODES
    # out of memory, invalid value, host memory already registered, peer access, and 709
    # (also "this thread's primary context was never made current"): recoverable
    assert not {2, 1, 712, 704, 801, 709} & STICKY_CODES


def test_bind_thread_sets_the_device_and_raises_on_refusal() -> None:
    fake = FakeRaw()
    devices: list[int] = []

    def set_device(index: int) -> int:
        devices.append(index)
        return 101 if index == 9 else 0  # cudaErrorInvalidDevice

    raw = RawCuda(fake.memcpy, None, None, fake.get_last_error, None, set_device)
    raw.bind_thread(1)
    assert devices == [1]
    with pytest.raises(CudaCallError, match=r"cudaSetDevice\(9\) returned 101"):
        raw.bind_thread(9)
    RawCuda(fake.memcpy, None, None, fake.get_last_error).bind_thread(3)  # no entry: no-op


def test_maps_paths_keep_spaces_and_drop_the_deleted_mark(monkeypatch, tmp_path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 12 /opt/my libs/libcudart.so.12.8.90\n"
        "7f01-7f02 r-xp 00000000 08:01 13 /usr/lib/libcuda.so.580.1 (deleted)\n"
        "7f02-7f03 rw-p 00000000 00:00 0 \n"
        "7f03-7f04 r-xp 00000000 08:01 14 /usr/lib/libcudart_static_helper.so\n"
    )
    real_open = open

    def fake_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        return real_open(maps if path == "/proc/self/maps" else path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    assert cudart._maps_paths("libcudart.so") == ["/opt/my libs/libcudart.so.12.8.90"]
    assert cudart._maps_paths("libcuda.so") == ["/usr/lib/libcuda.so.580.1"]


def test_no_runtime_without_cuda(monkeypatch) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert cudart.runtime_library() is None
    assert cudart.find_raw_cuda() is None
    assert cudart.driver_libraries() == []
    monkeypatch.setenv("KVOFFLOAD_CUDA_RAW_MEMCPY", "0")
    assert cudart.find_raw_cuda() is None
