"""KV-cache registration: every validation error, all-or-nothing, geometry, lookup."""

from __future__ import annotations

import base64
import copy
import ctypes
import fcntl
import gc
import logging
import os
from typing import Any

import pytest
import torch
from kvoffload_client.pool_socket import sealed_memfd

from tests.transfer.helpers import write_shm_tensors
from testsupport.shm_device import shm_spec
from transfer import (
    KVCacheRegistry,
    KVCacheSpec,
    RegistrationError,
    RegistrationLimitError,
    TensorSpec,
    UnknownCacheError,
    export_cuda_ipc_handle,
)

# Two tensors, per block: 2*4*8*2 = 128 bytes (block_dim 1, outer 2) + 16*4 = 64 bytes.
LAYOUT = [([2, 10, 4, 8], "float16", 1), ([10, 16], "float32", 0)]
BLOCK_BYTES = 192


@pytest.fixture
def files(shm_prefix) -> list[str]:
    paths, _flats = write_shm_tensors(shm_prefix, LAYOUT)
    return paths


@pytest.fixture
def registry(make_pool) -> KVCacheRegistry:
    return KVCacheRegistry(make_pool(16, BLOCK_BYTES, pin=False))


def body(paths: list[str]) -> dict[str, Any]:
    return shm_spec("engine0", paths, LAYOUT)


def mapped_paths(paths: list[str]) -> set[str]:
    with open("/proc/self/maps") as f:
        maps = f.read()
    return {p for p in paths if p in maps}


def test_register_round_trip(registry, files) -> None:
    spec = KVCacheSpec.from_dict(body(files))
    assert spec.bytes_per_block == BLOCK_BYTES
    cache = registry.register(spec)
    assert cache.cache_id.startswith("kvc-")
    assert (cache.name, cache.device, cache.block_bytes, cache.num_blocks) == (
        "engine0",
        "cpu",
        BLOCK_BYTES,
        10,
    )
    assert [(lay.outer, lay.inner_bytes, lay.host_offset) for lay in cache.layouts] == [
        (2, 64, 0),
        (1, 64, 128),
    ]
    assert registry.get(cache.cache_id) is cache
    assert registry.list() == [cache]
    assert cache.describe()["num_tensors"] == 2
    assert mapped_paths(files) == set(files)
    registry.unregister(cache.cache_id)
    with pytest.raises(UnknownCacheError, match=cache.cache_id):
        registry.get(cache.cache_id)
    with pytest.raises(UnknownCacheError):
        registry.unregister(cache.cache_id)
    assert registry.list() == []


def test_mapping_is_shared_with_the_engine(registry, files) -> None:
    cache = registry.register(KVCacheSpec.from_dict(body(files)))
    cache.tensors[1][5] = 42
    with open(files[1], "rb") as f:
        f.seek(5)
        assert f.read(1) == b"\x2a"


def test_registering_a_name_again_replaces_it(registry, files) -> None:
    first = registry.register(KVCacheSpec.from_dict(body(files)))
    second = registry.register(KVCacheSpec.from_dict(body(files)))
    assert first.cache_id != second.cache_id
    assert registry.list() == [second]
    with pytest.raises(UnknownCacheError):
        registry.get(first.cache_id)


def test_registry_close_forgets_everything(registry, files) -> None:
    registry.register(KVCacheSpec.from_dict(body(files)))
    registry.close()
    assert len(registry) == 0


def test_unknown_cache_error_is_a_lookup_error(registry) -> None:
    with pytest.raises(LookupError):
        registry.get("kvc-nope")


def mutate(d: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """Set (or, with value ``...``, delete) a dotted path like ``tensors.0.handle.kind``."""
    d = copy.deepcopy(d)
    parts = path.split(".")
    target: Any = d
    for part in parts[:-1]:
        target = target[int(part)] if isinstance(target, list) else target[part]
    last: Any = int(parts[-1]) if isinstance(target, list) else parts[-1]
    if value is ...:
        del target[last]
    else:
        target[last] = value
    return d


PARSE_ERRORS = [
    ("name", ..., "missing 'name'"),
    ("name", "", "name must be a string of 1..128"),
    ("name", "x" * 129, "name must be a string of 1..128"),
    ("name", "bad\nname", "printable ASCII"),
    ("device", "gpu", "device must be 'cpu', 'cuda' or 'cuda:N'"),
    ("tensors", [], "tensors must list 1..4096"),
    ("tensors", "t", "tensors must be a list"),
    ("extra", 1, "unknown field"),
    ("tensors.0.extra", 1, r"tensors\[0\] has unknown field"),
    ("tensors.0.shape", ..., r"tensors\[0\] is missing 'shape'"),
    ("tensors.0.shape", [], r"tensors\[0\].shape must be a list of 1..8"),
    ("tensors.0.shape", [2, 10, 0, 8], r"tensors\[0\].shape\[2\] must be a positive integer"),
    ("tensors.0.shape", [2, 10, -4, 8], r"shape\[2\] must be a positive integer, got -4"),
    ("tensors.0.shape", [2, 10, 4.0, 8], r"shape\[2\] must be a positive integer"),
    ("tensors.0.shape", [2, True, 4, 8], r"shape\[1\] must be a positive integer"),
    ("tensors.0.dtype", "float128", r"dtype 'float128' is not supported; use one of float16"),
    ("tensors.0.dtype", 3, r"dtype 3 is not supported"),
    ("tensors.0.block_dim", 4, r"block_dim must be an integer in \[0, 3\] for a 4-d shape, got 4"),
    ("tensors.0.block_dim", -1, r"block_dim must be an integer in \[0, 3\]"),
    ("tensors.0.block_dim", "1", r"block_dim must be an integer"),
    ("tensors.1.shape", [11, 16], r"same number of blocks; got tensors\[0\]: 10, tensors\[1\]: 11"),
    ("tensors.0.handle", "shm", r"handle must be an object"),
    ("tensors.0.handle.kind", "nfs", r"handle.kind must be 'shm' or 'cuda_ipc', got 'nfs'"),
    ("tensors.0.handle.path", "", r"handle.path must be a file path"),
    ("tensors.0.handle.path", 5, r"handle.path must be a file path"),
    ("tensors.0.handle.size", 5, r"handle has unknown field"),
    ("tensors.0.device", "cuda:0", r"a 'shm' handle needs device 'cpu', got 'cuda:0'"),
    ("tensors.0.device", "tpu", r"tensors\[0\].device must be 'cpu', 'cuda' or 'cuda:N'"),
]


@pytest.mark.parametrize(("path", "value", "message"), PARSE_ERRORS)
def test_from_dict_rejects(files, path, value, message) -> None:
    with pytest.raises(RegistrationError, match=message):
        KVCacheSpec.from_dict(mutate(body(files), path, value))


def test_from_dict_rejects_non_objects() -> None:
    with pytest.raises(RegistrationError, match="registration must be an object"):
        KVCacheSpec.from_dict([])  # type: ignore[arg-type]
    with pytest.raises(RegistrationError, match=r"tensors\[0\] must be an object"):
        KVCacheSpec.from_dict({"name": "e", "device": "cpu", "tensors": [3]})


def test_registration_error_is_a_value_error(files) -> None:
    with pytest.raises(ValueError, match="unknown field"):
        KVCacheSpec.from_dict(mutate(body(files), "bogus", 1))


def test_bytes_per_block_must_equal_the_pool_block_bytes(make_pool, files) -> None:
    registry = KVCacheRegistry(make_pool(16, 256, pin=False))
    with pytest.raises(
        RegistrationError,
        match=r"summed over the tensors is 192 \(128 \+ 64\), but the host pool's block_bytes "
        r"is 256",
    ):
        registry.register(KVCacheSpec.from_dict(body(files)))
    assert registry.list() == []


def test_shm_path_must_stay_inside_dev_shm(registry, files, tmp_path) -> None:
    outside = tmp_path / "kv.bin"
    outside.write_bytes(b"\0" * 4096)
    cases = [
        str(outside),
        f"/dev/shm/../../{outside}",
        "/dev/shm/../etc/passwd",
        "/dev/shm",
    ]
    for path in cases:
        with pytest.raises(RegistrationError, match="outside /dev/shm"):
            registry.register(
                KVCacheSpec.from_dict(mutate(body(files), "tensors.1.handle.path", path))
            )
    link = f"{files[1]}-link"
    os.symlink(outside, link)
    try:
        with pytest.raises(RegistrationError) as info:
            registry.register(
                KVCacheSpec.from_dict(mutate(body(files), "tensors.1.handle.path", link))
            )
    finally:
        os.unlink(link)
    # The path as sent and the rule; never where the link leads.
    assert str(info.value) == (
        f"tensors[1].handle.path {link!r} is outside /dev/shm: it must name a file inside "
        "/dev/shm once symlinks and '..' are followed"
    )
    assert str(tmp_path) not in str(info.value)
    assert "kv.bin" not in str(info.value)
    assert registry.list() == []


def test_a_refused_path_is_repeated_cut_short_and_escaped(registry, files) -> None:
    """A caller's path of thousands of characters, or with control characters, comes back in
    the message quoted with escapes and cut to 96 characters."""
    long_path = "/tmp/" + "d/" * 2000 + "kv.bin"
    with pytest.raises(RegistrationError) as info:
        registry.register(
            KVCacheSpec.from_dict(mutate(body(files), "tensors.1.handle.path", long_path))
        )
    message = str(info.value)
    assert f"{long_path[:96]!r}..." in message
    assert len(message) < 300
    odd = "/tmp/a\nb\x1b[31m"
    with pytest.raises(RegistrationError) as info:
        registry.register(KVCacheSpec.from_dict(mutate(body(files), "tensors.1.handle.path", odd)))
    assert repr(odd) in str(info.value)
    assert "\n" not in str(info.value)
    assert "\x1b" not in str(info.value)


def test_a_symlink_inside_dev_shm_is_followed(registry, files) -> None:
    link = f"{files[0]}-alias"
    os.symlink(files[0], link)
    try:
        cache = registry.register(
            KVCacheSpec.from_dict(mutate(body(files), "tensors.0.handle.path", link))
        )
    finally:
        os.unlink(link)
    assert cache.num_blocks == 10


def test_shm_file_must_exist_be_regular_and_large_enough(registry, files, shm_prefix) -> None:
    with pytest.raises(RegistrationError, match="cannot open"):
        registry.register(
            KVCacheSpec.from_dict(mutate(body(files), "tensors.1.handle.path", files[1] + "-x"))
        )
    d = f"/dev/shm/{shm_prefix}-dir"
    os.mkdir(d)
    try:
        with pytest.raises(RegistrationError, match=r"cannot open|not a regular file"):
            registry.register(
                KVCacheSpec.from_dict(mutate(body(files), "tensors.1.handle.path", d))
            )
    finally:
        os.rmdir(d)
    os.truncate(files[1], 639)
    with pytest.raises(
        RegistrationError,
        match=r"holds 639 bytes, but shape \[10, 16\] of float32 needs 640",
    ):
        registry.register(KVCacheSpec.from_dict(body(files)))
    assert os.path.getsize(files[1]) == 639  # never extended or truncated by us


def test_failed_registration_leaves_nothing_registered_or_mapped(registry, files) -> None:
    os.truncate(files[1], 100)  # the second tensor fails after the first was mapped
    with pytest.raises(RegistrationError, match="holds 100 bytes"):
        registry.register(KVCacheSpec.from_dict(body(files)))
    assert registry.list() == []
    assert mapped_paths(files) == set()


def test_unregister_unmaps_when_nothing_else_holds_the_cache(registry, files) -> None:
    cache_id = registry.register(KVCacheSpec.from_dict(body(files))).cache_id
    assert mapped_paths(files) == set(files)
    registry.unregister(cache_id)
    assert mapped_paths(files) == set()


def test_tensor_spec_geometry() -> None:
    t = TensorSpec([3, 2, 7, 5], "bfloat16", 2, {"kind": "shm", "path": "/dev/shm/x"})
    assert (t.num_blocks, t.outer, t.inner_bytes, t.bytes_per_block, t.nbytes) == (
        7,
        6,
        10,
        60,
        420,
    )


def ipc_handle(**overrides: Any) -> dict[str, Any]:
    h = {
        "kind": "cuda_ipc",
        "storage_handle": base64.b64encode(b"h" * 64).decode(),
        "storage_size_bytes": 4096,
        "storage_offset_bytes": 0,
        "tensor_offset": 0,
        "ref_counter_handle": base64.b64encode(b"/torch_123_456").decode(),
        "ref_counter_offset": 0,
        "event_handle": base64.b64encode(b"e" * 64).decode(),
        "event_sync_required": True,
        "device_index": 0,
    }
    h.update(overrides)
    return {k: v for k, v in h.items() if v is not ...}


def ipc_body(handle: dict[str, Any], device: str = "cuda:0") -> dict[str, Any]:
    return {
        "name": "gpu-engine",
        "device": device,
        "tensors": [{"shape": [16, 64], "dtype": "float16", "block_dim": 0, "handle": handle}],
    }


def test_cuda_ipc_handle_shape_is_validated_on_cpu() -> None:
    spec = KVCacheSpec.from_dict(ipc_body(ipc_handle()))
    assert spec.tensors[0].handle["kind"] == "cuda_ipc"
    KVCacheSpec.from_dict(ipc_body(ipc_handle(event_handle=None, event_sync_required=False)))
    # What export_cuda_ipc_handle sends: the tensor's offset in bytes, not in elements.
    KVCacheSpec.from_dict(ipc_body(ipc_handle(tensor_offset=..., tensor_offset_bytes=64)))


@pytest.mark.parametrize(
    ("overrides", "device", "message"),
    [
        ({"storage_handle": ...}, "cuda:0", "missing 'storage_handle'"),
        ({"storage_handle": "not base64!"}, "cuda:0", "storage_handle is not valid base64"),
        ({"storage_handle": ""}, "cuda:0", "storage_handle must be a non-empty base64"),
        ({"ref_counter_handle": 7}, "cuda:0", "ref_counter_handle must be a non-empty base64"),
        ({"storage_size_bytes": -1}, "cuda:0", "storage_size_bytes must be a non-negative"),
        ({"storage_offset_bytes": "0"}, "cuda:0", "storage_offset_bytes must be a non-negative"),
        ({"tensor_offset": 1.5}, "cuda:0", "tensor_offset must be a non-negative"),
        ({"tensor_offset_bytes": -2}, "cuda:0", "tensor_offset_bytes must be a non-negative"),
        ({"tensor_offset_bytes": 2}, "cuda:0", "send one"),  # beside tensor_offset
        (
            {"tensor_offset": ..., "tensor_offset_bytes": 3},
            "cuda:0",
            r"tensor_offset_bytes 3 is not a whole number of float16 elements \(2 bytes\)",
        ),
        ({"ref_counter_offset": ...}, "cuda:0", "missing 'ref_counter_offset'"),
        ({"event_sync_required": "yes"}, "cuda:0", "event_sync_required must be a boolean"),
        ({"event_handle": None}, "cuda:0", "event_sync_required needs an event_handle"),
        ({"pid": 3}, "cuda:0", "unknown field"),
        ({}, "cpu", "a 'cuda_ipc' handle needs a cuda device, got 'cpu'"),
    ],
)
def test_cuda_ipc_handle_errors(overrides, device, message) -> None:
    with pytest.raises(RegistrationError, match=message):
        KVCacheSpec.from_dict(ipc_body(ipc_handle(**overrides), device))


def test_cuda_ipc_registration_needs_cuda(make_pool) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    registry = KVCacheRegistry(make_pool(4, 16 * 64 * 2 // 16, pin=False))
    spec = KVCacheSpec.from_dict(ipc_body(ipc_handle()))
    with pytest.raises(RegistrationError, match="'cuda_ipc' handles need CUDA"):
        registry.register(spec)
    assert registry.list() == []


def test_export_cuda_ipc_handle_refuses_cpu_tensors() -> None:
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        export_cuda_ipc_handle(torch.zeros(4))


def test_register_tensors_in_process(make_pool) -> None:
    registry = KVCacheRegistry(make_pool(8, BLOCK_BYTES, pin=False))
    a = torch.zeros(2, 10, 4, 8, dtype=torch.float16)
    b = torch.zeros(10, 16, dtype=torch.float32)
    cache = registry.register_tensors("local", [a, b], [1, 0])
    assert (cache.num_blocks, cache.block_bytes, cache.device) == (10, BLOCK_BYTES, "cpu")
    assert cache.tensors[0].data_ptr() == a.data_ptr()
    with pytest.raises(RegistrationError, match="same number of blocks"):
        registry.register_tensors("bad", [a, torch.zeros(11, 16)], [1, 0])
    with pytest.raises(RegistrationError, match="block_dim must be in"):
        registry.register_tensors("bad", [a, b], [4, 0])
    with pytest.raises(RegistrationError, match="contiguous"):
        registry.register_tensors("bad", [a.transpose(0, 1), b], [0, 0])
    with pytest.raises(RegistrationError, match=r"is 192, but the host pool's block_bytes"):
        KVCacheRegistry(make_pool(8, 64, pin=False)).register_tensors("bad", [a, b], [1, 0])
    assert registry.list() == [cache]


# ----------------------------------------------------------------------- leases


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_lease_lapses_unless_renewed(make_pool, files) -> None:
    clock = Clock()
    registry = KVCacheRegistry(make_pool(16, BLOCK_BYTES, pin=False), clock=clock)
    leased = registry.register(KVCacheSpec.from_dict({**body(files), "lease_s": 10}))
    forever = registry.register(KVCacheSpec.from_dict({**body(files), "name": "no-lease"}))
    assert registry.lease(leased.cache_id) == (10.0, 10.0)
    assert registry.lease(forever.cache_id) is None
    clock.now += 8
    assert registry.expire() == []
    assert registry.renew(leased.cache_id) == 10.0  # good for 10 s from now
    assert registry.renew(forever.cache_id) == 0.0
    clock.now += 8
    assert registry.expire() == []
    clock.now += 2
    assert [c.cache_id for c in registry.expire()] == [leased.cache_id]
    assert [c.cache_id for c in registry.list()] == [forever.cache_id]
    with pytest.raises(UnknownCacheError):
        registry.renew(leased.cache_id)
    with pytest.raises(UnknownCacheError):
        registry.get(leased.cache_id)


@pytest.mark.parametrize("lease", [0, -1, 1e9, "10", True])
def test_lease_s_is_validated(files, lease) -> None:
    with pytest.raises(RegistrationError, match="lease_s must be a number of seconds"):
        KVCacheSpec.from_dict({**body(files), "lease_s": lease})


# ----------------------------------------------------------------------- the right GPU

UUIDS = ["1b2c3d4e-0000-1111-2222-333344445555", "9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff"]


@pytest.fixture
def two_gpus(monkeypatch):
    """Two "visible GPUs" by UUID; rebuilding an IPC tensor gives a CPU tensor."""
    from torch.multiprocessing import reductions

    from transfer import kv_cache

    opened: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(kv_cache, "_device_uuids", lambda: list(UUIDS))

    def rebuild(*args: Any) -> torch.Tensor:
        opened.append(args[6])  # the device index the handle is opened on
        return torch.zeros(args[1], dtype=args[5])

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    return opened


def test_the_gpu_is_found_by_uuid_not_by_its_index(make_pool, two_gpus, monkeypatch) -> None:
    from transfer import kv_cache

    monkeypatch.setattr(kv_cache, "_pointer_device", lambda ptr: 1)
    registry = KVCacheRegistry(make_pool(4, 16 * 64 * 2 // 16, pin=False))
    spec = {**ipc_body(ipc_handle(), device="cuda:0"), "device_uuid": "GPU-" + UUIDS[1].upper()}
    cache = registry.register(KVCacheSpec.from_dict(spec))
    assert two_gpus == [1]  # opened on the GPU with that UUID, whatever cuda:N said
    assert cache.layouts[0].device == "cpu"  # (the fake gives CPU tensors)


def test_an_offset_in_bytes_is_opened_in_elements_of_the_registered_dtype(
    make_pool, two_gpus, monkeypatch, caplog
) -> None:
    """torch counts a tensor's offset in elements of the exported dtype; the handle carries
    bytes, so a registration naming another dtype still opens the right memory. A pointer
    whose GPU cannot be told is opened as named, with a warning."""
    from torch.multiprocessing import reductions

    from transfer import kv_cache

    offsets: list[int] = []

    def rebuild(*args: Any) -> torch.Tensor:
        offsets.append(args[3])
        return torch.zeros(args[1], dtype=args[5])

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    monkeypatch.setattr(kv_cache, "_pointer_device", lambda ptr: None)
    registry = KVCacheRegistry(make_pool(4, 16 * 64 * 2 // 16, pin=False))
    handle = ipc_handle(tensor_offset=..., tensor_offset_bytes=96)
    with caplog.at_level(logging.WARNING, logger="transfer.kv_cache"):
        registry.register(KVCacheSpec.from_dict(ipc_body(handle)))
    assert offsets == [48]  # 96 bytes of float16
    assert "cannot tell which GPU tensors[0] is on; trusting GPU 0" in caplog.text
    assert kv_cache.normalize_uuid("MIG-" + UUIDS[0].upper()) == UUIDS[0]


def test_a_registration_on_another_gpu_is_refused(make_pool, two_gpus, monkeypatch) -> None:
    from transfer import kv_cache

    monkeypatch.setattr(kv_cache, "_pointer_device", lambda ptr: 1)
    registry = KVCacheRegistry(make_pool(4, 16 * 64 * 2 // 16, pin=False))
    with pytest.raises(RegistrationError, match="on GPU 1 of this process, not on GPU 0"):
        registry.register(KVCacheSpec.from_dict(ipc_body(ipc_handle(), device="cuda:0")))
    unknown = {**ipc_body(ipc_handle()), "device_uuid": "GPU-" + "0" * 8 + UUIDS[0][8:]}
    with pytest.raises(RegistrationError, match="is not visible to the service"):
        registry.register(KVCacheSpec.from_dict(unknown))
    with pytest.raises(RegistrationError, match="device_uuid must be a GPU UUID"):
        KVCacheSpec.from_dict({**ipc_body(ipc_handle()), "device_uuid": "cuda:1"})


def memfds_like(paths: list[str]) -> list[int]:
    """Sealed memfds holding copies of the files at ``paths`` (what a tenant passes)."""
    fds = []
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        fd = sealed_memfd(len(data))
        os.pwrite(fd, data, 0)
        fds.append(fd)
    return fds


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def maps_of(name: str) -> int:
    """Mappings of this process whose file is the memfd ``name``."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if f"/memfd:{name} " in line + " ")


def test_a_passed_descriptor_is_mapped_shared_and_no_path_is_opened(registry, files) -> None:
    spec = body(files)
    fds = memfds_like(files)
    try:
        for i, tensor in enumerate(spec["tensors"]):
            tensor["handle"] = {"kind": "shm", "fd": 1 - i}  # any order
        fds.reverse()
        cache = registry.register(KVCacheSpec.from_dict(spec), fds)
        cache.tensors[1][5] = 42
        assert os.pread(fds[0], 1, 5) == b"\x2a"
    finally:
        for fd in fds:
            os.close(fd)  # the registry keeps its own mapping
    assert cache.tensors[1][5] == 42


def test_a_descriptor_must_be_a_sealed_memfd(registry, files, tmp_path) -> None:
    """A file its holder can shrink (or a sparse file on a full tmpfs) would fault the
    service's copies: only a memfd sealed against shrinking is taken, and nothing is mapped."""
    spec = body(files)
    for tensor in spec["tensors"]:
        tensor["handle"] = {"kind": "shm", "fd": 0}
    nbytes = max(os.path.getsize(p) for p in files)
    on_disk = tmp_path / "on-disk"
    on_disk.write_bytes(b"\0" * nbytes)
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, nbytes)
    grow_only = os.memfd_create("grow-only", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(grow_only, nbytes)
    fcntl.fcntl(grow_only, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW)
    candidates = {
        "a /dev/shm file": os.open(files[0], os.O_RDWR | os.O_CLOEXEC),
        "a file on disk": os.open(on_disk, os.O_RDWR | os.O_CLOEXEC),
        "an unsealed memfd": unsealed,
        "a memfd sealed against growing only": grow_only,
    }
    try:
        for what, fd in candidates.items():
            with pytest.raises(RegistrationError, match="not a memfd sealed against shrinking"):
                registry.register(KVCacheSpec.from_dict(spec), [fd])
            assert len(registry) == 0, what
    finally:
        for fd in candidates.values():
            os.close(fd)


def test_a_sealed_memfd_cannot_be_shrunk_under_the_service(registry, files) -> None:
    spec = body(files)
    fds = memfds_like(files)
    for i, tensor in enumerate(spec["tensors"]):
        tensor["handle"] = {"kind": "shm", "fd": i}
    try:
        cache = registry.register(KVCacheSpec.from_dict(spec), fds)
        with pytest.raises(PermissionError):
            os.ftruncate(fds[0], 0)
        # A hole punched in it reads as zeros and is backed again on write: no fault.
        fallocate = ctypes.CDLL(None, use_errno=True).fallocate
        fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        punch = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        assert fallocate(fds[0], punch, 0, os.fstat(fds[0]).st_size) == 0
        assert int(cache.tensors[0].sum()) == 0
        cache.tensors[0].fill_(7)
        assert os.pread(fds[0], 2, 0) == b"\x07\x07"
    finally:
        for fd in fds:
            os.close(fd)


def test_one_mapping_per_file_however_many_tensors_name_it(make_pool) -> None:
    """3,000 tensors naming one passed descriptor (the attack that held 19,966 of 20,000
    descriptors with 23 registrations) map the file once and keep no descriptor open."""
    block = 64
    registry = KVCacheRegistry(make_pool(4, 3000 * block, pin=False))
    name = "one-file-many-tensors"
    fd = sealed_memfd(4 * block, name)
    tensor = {"shape": [4, block], "dtype": "uint8", "block_dim": 0}
    spec = {
        "name": "many",
        "device": "cpu",
        "tensors": [{**tensor, "handle": {"kind": "shm", "fd": 0}} for _ in range(3000)],
    }
    try:
        before = fd_count()
        caches = [
            registry.register(KVCacheSpec.from_dict({**spec, "name": f"many-{i}"}), [fd])
            for i in range(3)
        ]
        assert fd_count() == before
        assert maps_of(name) == 3  # one per registration, not one per tensor
        assert [c.mapped_bytes for c in caches] == [4 * block] * 3
        caches[0].tensors[2999][block] = 9  # every tensor is a view of the one mapping
        assert os.pread(fd, 1, block) == b"\x09"
        for cache in caches:
            registry.unregister(cache.cache_id)
        del caches, cache
        gc.collect()
        assert maps_of(name) == 0  # the last view gone, the mapping goes
    finally:
        os.close(fd)


def test_registrations_and_mapped_bytes_are_bounded(make_pool, files) -> None:
    registry = KVCacheRegistry(make_pool(16, BLOCK_BYTES, pin=False), max_caches=2)
    spec = body(files)
    size = sum(os.path.getsize(p) for p in files)
    first = registry.register(KVCacheSpec.from_dict({**spec, "name": "a"}))
    registry.register(KVCacheSpec.from_dict({**spec, "name": "b"}))
    with pytest.raises(RegistrationLimitError, match="max_registrations limit of 2") as refused:
        registry.register(KVCacheSpec.from_dict({**spec, "name": "c"}))
    assert refused.value.limit == "max_registrations"
    assert sorted(c.name for c in registry.list()) == ["a", "b"]
    # Registering a name again replaces it: no more held.
    again = registry.register(KVCacheSpec.from_dict({**spec, "name": "a"}))
    assert again.cache_id != first.cache_id
    assert registry.mapped_bytes() == 2 * size
    registry.max_caches, registry.max_bytes = None, 2 * size + size - 1
    with pytest.raises(RegistrationLimitError, match="max_mapped_bytes"):
        registry.register(KVCacheSpec.from_dict({**spec, "name": "c"}))
    assert len(registry) == 2
    registry.max_bytes = 3 * size
    registry.register(KVCacheSpec.from_dict({**spec, "name": "c"}))
    assert registry.mapped_bytes() == 3 * size


def test_a_descriptor_handle_needs_its_descriptor(registry, files) -> None:
    spec = body(files)
    for tensor in spec["tensors"]:
        tensor["handle"] = {"kind": "shm", "fd": 0}
    with pytest.raises(RegistrationError, match="passed over the pool socket"):
        registry.register(KVCacheSpec.from_dict(spec))  # an HTTP call: none can come
    fds = memfds_like(files[:1])
    try:
        spec["tensors"][1]["handle"] = {"kind": "shm", "fd": 1}
        with pytest.raises(RegistrationError, match=r"tensors\[1\].handle.fd is 1, but 1"):
            registry.register(KVCacheSpec.from_dict(spec), fds)
    finally:
        os.close(fds[0])
    spec["tensors"][0]["handle"] = {"kind": "shm", "fd": 0, "path": files[0]}
    with pytest.raises(RegistrationError, match="path or fd, not both"):
        KVCacheSpec.from_dict(spec)
    spec["tensors"][0]["handle"] = {"kind": "shm", "fd": -1}
    with pytest.raises(RegistrationError, match="index of a passed descriptor"):
        KVCacheSpec.from_dict(spec)
