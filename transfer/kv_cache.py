"""Device KV caches an engine registers, and how their blocks map onto host-pool blocks.

Geometry. A registration lists tensors, each with a ``shape``, a ``dtype`` and a ``block_dim``.
Every tensor must have the same number of blocks ``N = shape[block_dim]``. *Device block* ``b``
is the slice at index ``b`` of ``block_dim`` in every tensor. A tensor is viewed as
``[outer, N, inner]`` bytes with ``outer = prod(shape[:block_dim])`` and
``inner = prod(shape[block_dim+1:]) * itemsize``, so one device block of it is ``outer`` pieces
of ``inner`` contiguous bytes. A *host block* is the bytes of one device block across all
tensors, concatenated in tensor order (and, inside a tensor, in ``outer`` order); its size
summed over the tensors must equal the pool's ``block_bytes``. Tensors must be contiguous.

Handles (JSON, as sent to ``POST /v1/kv-caches``):

- ``{"kind": "shm", "fd": 0}`` for a CPU "device", registered over the pool socket
  (``app.pool_share.register_kv_cache``): the K-th descriptor passed with the registration
  (``SCM_RIGHTS``): a memfd (``memfd_create`` with ``MFD_ALLOW_SEALING``, not a huge-page
  one) sealed with ``F_SEAL_SHRINK``, open read-write, holding at least
  ``prod(shape) * itemsize`` bytes. The seal is what makes a caller's memory safe to copy
  from and to: a file the caller could shrink (or a sparse file on a full tmpfs, or a hole in
  huge-page memory) turns the service's next copy into a SIGBUS that ends the process for
  every tenant, whereas a sealed memfd can never lose a page the mapping covers (a hole
  punched in it reads as zeros and is backed again on write). Every such refusal names the
  rule. The service maps that descriptor, never a path: the caller proved it holds the file,
  so a refusal may say what is wrong with it. With tenants this is the only ``shm`` handle.

Mappings. Every distinct file of a registration (tensors naming the same descriptor, or two
descriptors of one file) is mapped once, as long as its longest tensor, and the tensors are
views of that mapping. The mapping keeps no descriptor open (``mmap(2)`` directly, unmapped
when the last view of it is gone), so a registration costs the process mappings, never
descriptors.
- ``{"kind": "shm", "path": "/dev/shm/engine0-layer0"}`` for a CPU "device": a shared-memory
  file the engine owns and writes. The path must resolve (symlinks and ``..`` followed) to a
  regular file inside ``/dev/shm`` holding at least ``prod(shape) * itemsize`` bytes. The
  service maps it shared and never truncates or unlinks it. A refusal names the path as the
  caller sent it (quoted, cut short) and the rule it broke, never where the path leads: the
  resolved target would tell the caller where links point and what lies outside ``/dev/shm``.
- ``{"kind": "cuda_ipc", ...}`` on GPU nodes: what torch's CUDA IPC exports for the tensor
  (``torch.multiprocessing.reductions.reduce_tensor``), as JSON. ``export_cuda_ipc_handle``
  builds it on the engine side::

      {"kind": "cuda_ipc",
       "storage_handle": "<base64>",      # cudaIpcMemHandle of the allocation holding the storage
       "storage_size_bytes": 268435456,   # size of the storage
       "storage_offset_bytes": 0,         # offset of the storage inside that allocation
       "tensor_offset_bytes": 0,          # offset of the tensor in its storage, in bytes
       "ref_counter_handle": "<base64>",  # torch's producer-side reference counter (shm name)
       "ref_counter_offset": 0,
       "event_handle": "<base64>",        # cudaIpcEventHandle the consumer waits on, or null
       "event_sync_required": true,
       "device_index": 0}                 # exporter's device index (informational)

  ``tensor_offset`` (in elements of the registration's ``dtype``) may stand in for
  ``tensor_offset_bytes``, never beside it; torch counts its own offset in elements of the
  exported tensor's dtype, which a registration may name differently (bytes as ``uint8``), so
  the export sends bytes. The service opens the memory on the device named by the tensor's
  ``device`` (else the cache's), in *its own* numbering, because ``CUDA_VISIBLE_DEVICES`` may
  differ between the engine and the service. The engine must keep the tensor alive while it
  is registered, and must have finished writing a block before asking to store it: either
  synchronise its streams, or send a ``wait_event`` with the job (``transfer.worker``).

Devices: ``device_uuid`` (per cache, or per tensor) names the GPU by its UUID (``nvidia-smi
-L``); the service opens the handle on the GPU with that UUID in its own numbering, and refuses
the registration when the opened memory sits on another GPU. Prefer it to ``cuda:N``.

Leases: a registration with ``lease_s`` lives while the engine renews it (``renew``) at least
every ``lease_s`` seconds; ``expire`` forgets the lapsed ones, so a dead engine's IPC mappings
(which keep its GPU memory alive) close once no running job holds them.

A tensor may name its own ``device``, so one registration spans an engine's tensor-parallel
ranks; a host block then holds every rank's slice of the block.

Limits. A registry may bound the registrations it holds (``max_caches``) and the host memory
they map (``max_bytes``: the lengths of their shared-memory mappings);
a registration past either is refused with ``RegistrationLimitError`` before it is published
(one that replaces a registration of the same name counts in place of it). Both can change
while registrations are held (a reload of the tenants file); they apply to the next one.

Registration is all-or-nothing: every check runs and every tensor is mapped before the cache
is published, and a failure drops what was mapped. Registering a name that is already
registered replaces the old registration (an engine that restarts re-registers); jobs already
running on the old one keep its mappings alive until they finish.
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import errno
import fcntl
import logging
import math
import mmap
import os
import re
import secrets
import stat
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from transfer.cudart import driver_libraries
from transfer.errors import RegistrationError, RegistrationLimitError, UnknownCacheError
from transfer.host_pool import HostPool

log = logging.getLogger(__name__)

__all__ = [
    "DTYPES",
    "KVCacheRegistry",
    "KVCacheSpec",
    "RegisteredCache",
    "TensorLayout",
    "TensorSpec",
    "export_cuda_ipc_handle",
]


def _dtype_table() -> dict[str, torch.dtype]:
    names = [
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
    ]
    return {n: getattr(torch, n) for n in names if isinstance(getattr(torch, n, None), torch.dtype)}


DTYPES: dict[str, torch.dtype] = _dtype_table()
"""dtype names accepted in a registration (torch's names)."""

MAX_TENSORS = 4096
MAX_DIMS = 8
MAX_NAME_LEN = 128
SHM_ROOT = "/dev/shm"
_SHOWN_CHARS = 96  # of a caller's path repeated in an error message
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d{1,3})?)$")
_NAME_RE = re.compile(r"^[\x21-\x7e][\x20-\x7e]*$")
_UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
MAX_LEASE_S = 86400.0
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
_IPC_INT_FIELDS = ("storage_size_bytes", "storage_offset_bytes", "ref_counter_offset")
_IPC_B64_FIELDS = ("storage_handle", "ref_counter_handle")


@dataclass(slots=True)
class TensorSpec:
    """One tensor of a registration; see the module docstring for the geometry."""

    shape: list[int]
    dtype: str
    block_dim: int
    handle: dict[str, Any]
    device: str | None = None
    device_uuid: str | None = None

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def num_blocks(self) -> int:
        return self.shape[self.block_dim]

    @property
    def outer(self) -> int:
        return math.prod(self.shape[: self.block_dim])

    @property
    def inner_bytes(self) -> int:
        return math.prod(self.shape[self.block_dim + 1 :]) * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.outer * self.inner_bytes

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(slots=True)
class KVCacheSpec:
    """A registration request: a name, a default device, and the tensors in host-block order."""

    name: str
    device: str
    tensors: list[TensorSpec]
    device_uuid: str | None = None
    lease_s: float | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KVCacheSpec:
        """Parse and validate the JSON body of ``POST /v1/kv-caches``.

        Raises ``RegistrationError`` naming the offending field. Unknown fields are errors.
        """
        if not isinstance(d, Mapping):
            raise RegistrationError(f"registration must be an object, got {type(d).__name__}")
        _no_unknown(d, {"name", "device", "tensors", "device_uuid", "lease_s"}, "registration")
        for key in ("name", "device", "tensors"):
            if key not in d:
                raise RegistrationError(f"registration is missing {key!r}")
        raw = d["tensors"]
        if not isinstance(raw, list):
            raise RegistrationError(f"tensors must be a list, got {type(raw).__name__}")
        tensors = []
        for i, t in enumerate(raw):
            where = f"tensors[{i}]"
            if not isinstance(t, Mapping):
                raise RegistrationError(f"{where} must be an object, got {type(t).__name__}")
            _no_unknown(
                t, {"shape", "dtype", "block_dim", "handle", "device", "device_uuid"}, where
            )
            for key in ("shape", "dtype", "block_dim", "handle"):
                if key not in t:
                    raise RegistrationError(f"{where} is missing {key!r}")
            shape = t["shape"]
            handle = t["handle"]
            tensors.append(
                TensorSpec(
                    shape=list(shape) if isinstance(shape, list | tuple) else shape,
                    dtype=t["dtype"],
                    block_dim=t["block_dim"],
                    handle=dict(handle) if isinstance(handle, Mapping) else handle,
                    device=t.get("device"),
                    device_uuid=t.get("device_uuid"),
                )
            )
        spec = cls(
            name=d["name"],
            device=d["device"],
            tensors=tensors,
            device_uuid=d.get("device_uuid"),
            lease_s=d.get("lease_s"),
        )
        spec.validate()
        return spec

    def validate(self) -> None:
        """Check the spec on its own (no filesystem, no CUDA); raise ``RegistrationError``."""
        if not isinstance(self.name, str) or not 0 < len(self.name) <= MAX_NAME_LEN:
            raise RegistrationError(
                f"name must be a string of 1..{MAX_NAME_LEN} characters, got {self.name!r:.80}"
            )
        if not _NAME_RE.match(self.name):
            raise RegistrationError(f"name must be printable ASCII, got {self.name!r:.80}")
        _check_device(self.device, "device")
        _check_uuid(self.device_uuid, "device_uuid")
        lease = self.lease_s
        if lease is not None and (
            type(lease) not in (int, float) or not 0 < lease <= MAX_LEASE_S or lease != lease
        ):
            raise RegistrationError(
                f"lease_s must be a number of seconds in (0, {MAX_LEASE_S}], got {lease!r:.40}"
            )
        if not isinstance(self.tensors, list) or not 0 < len(self.tensors) <= MAX_TENSORS:
            count = len(self.tensors) if isinstance(self.tensors, list) else self.tensors
            raise RegistrationError(f"tensors must list 1..{MAX_TENSORS} tensors, got {count!r}")
        for i, t in enumerate(self.tensors):
            _check_tensor(t, i, self.device)
        counts = [t.num_blocks for t in self.tensors]
        if len(set(counts)) != 1:
            detail = ", ".join(f"tensors[{i}]: {c}" for i, c in enumerate(counts[:8]))
            raise RegistrationError(
                f"all tensors must have the same number of blocks; got {detail}"
                + (" ..." if len(counts) > 8 else "")
            )

    @property
    def bytes_per_block(self) -> int:
        return sum(t.bytes_per_block for t in self.tensors)


def _no_unknown(d: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(str(k) for k in d if k not in allowed)
    if unknown:
        raise RegistrationError(f"{where} has unknown field(s): {', '.join(unknown)}")


def _is_int(v: object) -> bool:
    return type(v) is int


def _check_device(device: object, where: str) -> None:
    if not isinstance(device, str) or not _DEVICE_RE.match(device):
        raise RegistrationError(f"{where} must be 'cpu', 'cuda' or 'cuda:N', got {device!r:.80}")


def _check_tensor(t: TensorSpec, i: int, cache_device: str) -> None:
    where = f"tensors[{i}]"
    shape = t.shape
    if not isinstance(shape, list) or not 0 < len(shape) <= MAX_DIMS:
        raise RegistrationError(f"{where}.shape must be a list of 1..{MAX_DIMS} integers")
    for j, n in enumerate(shape):
        if not _is_int(n) or n <= 0:
            raise RegistrationError(f"{where}.shape[{j}] must be a positive integer, got {n!r}")
    if not isinstance(t.dtype, str) or t.dtype not in DTYPES:
        raise RegistrationError(
            f"{where}.dtype {t.dtype!r:.40} is not supported; use one of {', '.join(DTYPES)}"
        )
    if not _is_int(t.block_dim) or not 0 <= t.block_dim < len(shape):
        raise RegistrationError(
            f"{where}.block_dim must be an integer in [0, {len(shape) - 1}] for a "
            f"{len(shape)}-d shape, got {t.block_dim!r}"
        )
    if t.nbytes >= 1 << 50:
        raise RegistrationError(f"{where} is implausibly large ({t.nbytes} bytes)")
    device = cache_device if t.device is None else t.device
    if t.device is not None:
        _check_device(t.device, f"{where}.device")
    _check_uuid(t.device_uuid, f"{where}.device_uuid")
    h = t.handle
    if not isinstance(h, dict):
        raise RegistrationError(f"{where}.handle must be an object")
    kind = h.get("kind")
    if kind == "shm":
        _no_unknown(h, {"kind", "path", "fd"}, f"{where}.handle")
        if "fd" in h:
            if "path" in h:
                raise RegistrationError(f"{where}.handle: give path or fd, not both")
            if not _is_int(h["fd"]) or not 0 <= h["fd"] < MAX_TENSORS:
                raise RegistrationError(
                    f"{where}.handle.fd must be the index of a passed descriptor, got "
                    f"{h['fd']!r:.40}"
                )
        else:
            path = h.get("path")
            if not isinstance(path, str) or not path or "\x00" in path or len(path) > 4096:
                raise RegistrationError(
                    f"{where}.handle.path must be a file path, got {path!r:.80}"
                )
        if device != "cpu":
            raise RegistrationError(
                f"{where}: a 'shm' handle needs device 'cpu', got {device!r} (use 'cuda_ipc')"
            )
    elif kind == "cuda_ipc":
        _check_ipc_handle(h, f"{where}.handle")
        itemsize = DTYPES[t.dtype].itemsize
        if h.get("tensor_offset_bytes", 0) % itemsize:
            raise RegistrationError(
                f"{where}.handle.tensor_offset_bytes {h['tensor_offset_bytes']} is not a whole "
                f"number of {t.dtype} elements ({itemsize} bytes)"
            )
        if not device.startswith("cuda"):
            raise RegistrationError(
                f"{where}: a 'cuda_ipc' handle needs a cuda device, got {device!r}"
            )
    else:
        raise RegistrationError(
            f"{where}.handle.kind must be 'shm' or 'cuda_ipc', got {kind!r:.40}"
        )


def normalize_uuid(uuid: str) -> str:
    """A GPU UUID as compared here: lowercase, without nvidia-smi's ``GPU-`` or ``MIG-``
    prefix."""
    u = uuid.strip().lower()
    return u[4:] if u.startswith(("gpu-", "mig-")) else u


def _check_uuid(uuid: object, where: str) -> None:
    if uuid is None:
        return
    if not isinstance(uuid, str) or not _UUID_RE.match(normalize_uuid(uuid)):
        raise RegistrationError(
            f"{where} must be a GPU UUID like 'GPU-1b2c3d4e-...' (nvidia-smi -L), got {uuid!r:.60}"
        )


def _check_ipc_handle(h: dict[str, Any], where: str) -> None:
    allowed = {
        "kind",
        "tensor_offset",
        "tensor_offset_bytes",
        "event_handle",
        "event_sync_required",
        "device_index",
        *_IPC_INT_FIELDS,
        *_IPC_B64_FIELDS,
    }
    _no_unknown(h, allowed, where)
    for key in _IPC_B64_FIELDS:
        if key not in h:
            raise RegistrationError(f"{where} is missing {key!r}")
        _b64(h[key], f"{where}.{key}")
    if h.get("event_handle") is not None:
        _b64(h["event_handle"], f"{where}.event_handle")
    for key in _IPC_INT_FIELDS:
        if key not in h:
            raise RegistrationError(f"{where} is missing {key!r}")
    for key in (*_IPC_INT_FIELDS, "tensor_offset", "tensor_offset_bytes", "device_index"):
        v = h.get(key, 0)
        if not _is_int(v) or v < 0:
            raise RegistrationError(f"{where}.{key} must be a non-negative integer, got {v!r}")
    if "tensor_offset" in h and "tensor_offset_bytes" in h:
        raise RegistrationError(
            f"{where} has both tensor_offset and tensor_offset_bytes; send one (bytes)"
        )
    sync = h.get("event_sync_required", False)
    if not isinstance(sync, bool):
        raise RegistrationError(f"{where}.event_sync_required must be a boolean")
    if sync and h.get("event_handle") is None:
        raise RegistrationError(f"{where}.event_sync_required needs an event_handle")


def _b64(value: object, where: str) -> bytes:
    if not isinstance(value, str) or not value:
        raise RegistrationError(f"{where} must be a non-empty base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RegistrationError(f"{where} is not valid base64: {exc}") from None


def export_cuda_ipc_handle(tensor: torch.Tensor) -> dict[str, Any]:
    """Engine side: the ``cuda_ipc`` handle JSON for a contiguous CUDA tensor.

    The caller must keep ``tensor`` alive while the service uses it.
    """
    if tensor.device.type != "cuda":
        raise ValueError(f"cuda_ipc needs a CUDA tensor, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("cuda_ipc needs a contiguous tensor")
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, args = reduce_tensor(tensor.detach())  # type: ignore[no-untyped-call]
    (
        _cls,
        _size,
        _stride,
        tensor_offset,
        _storage_cls,
        _dtype,
        device_index,
        storage_handle,
        storage_size_bytes,
        storage_offset_bytes,
        _requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = args

    def enc(b: bytes) -> str:
        return base64.b64encode(b).decode("ascii")

    return {
        "kind": "cuda_ipc",
        "storage_handle": enc(storage_handle),
        "storage_size_bytes": int(storage_size_bytes),
        "storage_offset_bytes": int(storage_offset_bytes),
        "tensor_offset_bytes": int(tensor_offset) * tensor.element_size(),
        "ref_counter_handle": enc(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": enc(event_handle) if event_handle else None,
        "event_sync_required": bool(event_sync_required),
        "device_index": int(device_index),
    }


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Where one registered tensor's part of a block lives, on the device and in a host block.

    Device block ``b`` of this tensor is the ``outer`` pieces at byte offsets
    ``(k * num_blocks + b) * inner_bytes`` (k < outer) of the tensor; in host slot ``s`` they
    sit at ``s * pool.block_bytes + host_offset + k * inner_bytes``.
    """

    device: str
    outer: int
    inner_bytes: int
    num_blocks: int
    host_offset: int

    @property
    def bytes_per_block(self) -> int:
        return self.outer * self.inner_bytes


@dataclass(frozen=True, slots=True)
class RegisteredCache:
    """A registered device KV cache. ``tensors`` are flat ``uint8`` views of the mapped data."""

    cache_id: str
    name: str
    block_bytes: int
    num_blocks: int
    device: str
    layouts: tuple[TensorLayout, ...] = field(repr=False)
    tensors: tuple[torch.Tensor, ...] = field(repr=False, compare=False)
    mapped_bytes: int = 0
    """What counts against ``max_bytes``: the host memory it maps (its shared-memory
    mappings' lengths; CPU tensors of ``register_tensors``). Device memory opened by CUDA IPC
    is the engine's and counts nothing."""

    @property
    def devices(self) -> list[str]:
        """Distinct devices of the tensors, in first-use order."""
        return list(dict.fromkeys(lay.device for lay in self.layouts))

    def describe(self) -> dict[str, Any]:
        """JSON-ready summary (the ``POST /v1/kv-caches`` answer plus name and device)."""
        return {
            "cache_id": self.cache_id,
            "name": self.name,
            "device": self.device,
            "block_bytes": self.block_bytes,
            "num_blocks": self.num_blocks,
            "num_tensors": len(self.layouts),
        }


class KVCacheRegistry:
    """The device KV caches registered against one host pool. Thread-safe."""

    def __init__(
        self,
        pool: HostPool,
        *,
        shm_root: str = SHM_ROOT,
        clock: Callable[[], float] = time.monotonic,
        max_caches: int | None = None,
        max_bytes: int | None = None,
    ) -> None:
        self.pool = pool
        self.max_caches = max_caches
        """Registrations held at once (None: no limit); may change while held."""
        self.max_bytes = max_bytes
        """Bytes mapped by the registrations held (None: no limit); may change while held."""
        self._clock = clock
        self._leases: dict[str, tuple[float, float]] = {}  # cache_id -> (lease_s, expires)
        self._shm_root = os.path.realpath(shm_root)
        # Messages name the root as configured: its real path is layout too.
        self._shm_name = shm_root.rstrip("/") or "/"
        self._caches: dict[str, RegisteredCache] = {}
        self._lock = threading.Lock()

    def register(self, spec: KVCacheSpec, fds: Sequence[int] | None = None) -> RegisteredCache:
        """Validate ``spec``, map every tensor, and publish the cache; all-or-nothing.

        ``fds``: the descriptors passed with the registration (``{"kind": "shm", "fd": K}``
        names the K-th); None when none could be (``POST /v1/kv-caches``): an ``fd`` handle is
        then refused. They stay the caller's to close (a mapping keeps what it needs)."""
        spec.validate()
        per_block = spec.bytes_per_block
        if per_block != self.pool.block_bytes:
            detail = " + ".join(str(t.bytes_per_block) for t in spec.tensors[:8])
            more = " + ..." if len(spec.tensors) > 8 else ""
            raise RegistrationError(
                f"bytes per block summed over the tensors is {per_block} ({detail}{more}), "
                f"but the host pool's block_bytes is {self.pool.block_bytes}"
            )
        with self._lock:  # the count now, before anything is mapped
            self._check_limits_locked(spec.name, 0)
        mapped: list[torch.Tensor] = []
        devices: list[str] = []
        files = _Files()
        passed = {
            i: _fd_file(t, i, fds)
            for i, t in enumerate(spec.tensors)
            if t.handle["kind"] == "shm" and "fd" in t.handle
        }
        for i, (_fd, st, _where) in passed.items():
            files.need(st, spec.tensors[i].nbytes)
        try:
            for i, t in enumerate(spec.tensors):
                device = spec.device if t.device is None else t.device
                if i in passed:
                    mapped.append(files.view(*passed[i], t.nbytes))
                    devices.append("cpu")
                elif t.handle["kind"] == "shm":
                    mapped.append(self._map_shm(t, i, files))
                    devices.append("cpu")
                else:
                    uuid = t.device_uuid if t.device_uuid is not None else spec.device_uuid
                    tensor = _open_cuda_ipc(t, i, device, uuid)
                    mapped.append(tensor)
                    devices.append(str(tensor.device))
        except BaseException:
            mapped.clear()  # drops the mappings now (the only references)
            raise
        finally:
            files.close()
        layouts = _layouts([(t.outer, t.inner_bytes, t.num_blocks) for t in spec.tensors], devices)
        cache = RegisteredCache(
            cache_id=_new_id(),
            name=spec.name,
            block_bytes=per_block,
            num_blocks=spec.tensors[0].num_blocks,
            device=spec.device,
            layouts=layouts,
            tensors=tuple(mapped),
            mapped_bytes=files.mapped_bytes,
        )
        self._publish(cache, spec.lease_s)
        return cache

    def register_tensors(
        self, name: str, tensors: Sequence[torch.Tensor], block_dims: Sequence[int]
    ) -> RegisteredCache:
        """Register tensors of this process directly (embedded engines, tests, benchmarks).

        Same geometry rules and checks as ``register``; the tensors must be contiguous and stay
        alive (the registry keeps references).
        """
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LEN:
            raise RegistrationError(f"name must be a string of 1..{MAX_NAME_LEN} characters")
        if not tensors or len(tensors) != len(block_dims) or len(tensors) > MAX_TENSORS:
            raise RegistrationError(
                f"need 1..{MAX_TENSORS} tensors and one block_dim each, got {len(tensors)} "
                f"tensors and {len(block_dims)} block_dims"
            )
        geometry = []
        flat = []
        for i, (t, bd) in enumerate(zip(tensors, block_dims, strict=True)):
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                raise RegistrationError(f"tensors[{i}] must be a tensor with at least one dim")
            if not _is_int(bd) or not 0 <= bd < t.dim():
                raise RegistrationError(
                    f"tensors[{i}]: block_dim must be in [0, {t.dim() - 1}], got {bd!r}"
                )
            if not t.is_contiguous():
                raise RegistrationError(f"tensors[{i}] must be contiguous")
            if t.device.type not in ("cpu", "cuda"):
                raise RegistrationError(f"tensors[{i}] is on unsupported device {t.device}")
            shape = list(t.shape)
            if min(shape) <= 0:
                raise RegistrationError(f"tensors[{i}] has an empty dimension: {shape}")
            outer = math.prod(shape[:bd])
            inner = math.prod(shape[bd + 1 :]) * t.element_size()
            geometry.append((outer, inner, shape[bd]))
            flat.append(t.detach().reshape(-1).view(torch.uint8))
        counts = [g[2] for g in geometry]
        if len(set(counts)) != 1:
            raise RegistrationError(
                f"all tensors must have the same number of blocks, got {counts}"
            )
        per_block = sum(o * n for o, n, _ in geometry)
        if per_block != self.pool.block_bytes:
            raise RegistrationError(
                f"bytes per block summed over the tensors is {per_block}, but the host pool's "
                f"block_bytes is {self.pool.block_bytes}"
            )
        devices = [str(t.device) for t in tensors]
        cache = RegisteredCache(
            cache_id=_new_id(),
            name=name,
            block_bytes=per_block,
            num_blocks=counts[0],
            device=devices[0],
            layouts=_layouts(geometry, devices),
            tensors=tuple(flat),
            mapped_bytes=sum(t.numel() for t in flat if t.device.type == "cpu"),
        )
        self._publish(cache)
        return cache

    def get(self, cache_id: str) -> RegisteredCache:
        """The cache registered under ``cache_id``; ``UnknownCacheError`` if none."""
        with self._lock:
            cache = self._caches.get(cache_id)
        if cache is None:
            raise UnknownCacheError(cache_id)
        return cache

    def renew(self, cache_id: str) -> float:
        """Extend ``cache_id``'s lease by its ``lease_s`` from now; the lease in seconds (0.0:
        the cache has no lease). ``UnknownCacheError`` if unknown (or already expired)."""
        with self._lock:
            if cache_id not in self._caches:
                raise UnknownCacheError(cache_id)
            lease = self._leases.get(cache_id)
            if lease is None:
                return 0.0
            self._leases[cache_id] = (lease[0], self._clock() + lease[0])
            return lease[0]

    def lease(self, cache_id: str) -> tuple[float, float] | None:
        """``(lease_s, seconds left)`` of ``cache_id``'s lease, or None without one."""
        with self._lock:
            lease = self._leases.get(cache_id)
        return None if lease is None else (lease[0], max(0.0, lease[1] - self._clock()))

    def expire(self) -> list[RegisteredCache]:
        """Forget every cache whose lease passed unrenewed; the caches forgotten. Their
        mappings close once no running job holds them (fail their queued jobs first:
        ``TransferWorker.drop_cache``)."""
        now = self._clock()
        with self._lock:
            gone = [cid for cid, (_l, end) in self._leases.items() if end <= now]
            out = [c for cid in gone if (c := self._caches.pop(cid, None)) is not None]
            for cid in gone:
                del self._leases[cid]
        return out

    def unregister(self, cache_id: str) -> RegisteredCache:
        """Forget a cache; its mappings go once no running job holds them."""
        with self._lock:
            self._leases.pop(cache_id, None)
            cache = self._caches.pop(cache_id, None)
        if cache is None:
            raise UnknownCacheError(cache_id)
        return cache

    def list(self) -> list[RegisteredCache]:
        """Every registered cache, oldest first."""
        with self._lock:
            return list(self._caches.values())

    def close(self) -> None:
        """Forget every cache. Idempotent."""
        with self._lock:
            self._caches.clear()
            self._leases.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._caches)

    def mapped_bytes(self) -> int:
        """Bytes mapped by the registrations held (what ``max_bytes`` bounds)."""
        with self._lock:
            return sum(c.mapped_bytes for c in self._caches.values())

    def _check_limits_locked(self, name: str, adding_bytes: int) -> None:
        """Refuse one more registration of ``adding_bytes`` under ``name`` (which replaces the
        registration of that name, if any) past ``max_caches`` or ``max_bytes``."""
        kept = [c for c in self._caches.values() if c.name != name]
        limit = self.max_caches
        if limit is not None and len(kept) + 1 > limit:
            raise RegistrationLimitError(
                "max_registrations",
                limit,
                f"{len(kept)} KV caches registered; unregister one (or let its lease lapse) "
                "first, or register under the name of one it replaces",
            )
        limit = self.max_bytes
        held = sum(c.mapped_bytes for c in kept)
        if limit is not None and held + adding_bytes > limit:
            raise RegistrationLimitError(
                "max_mapped_bytes",
                limit,
                f"{held} bytes mapped by the KV caches registered; this one maps {adding_bytes}",
            )

    def _publish(self, cache: RegisteredCache, lease_s: float | None = None) -> None:
        with self._lock:
            self._check_limits_locked(cache.name, cache.mapped_bytes)
            for old_id in [cid for cid, c in self._caches.items() if c.name == cache.name]:
                del self._caches[old_id]
                self._leases.pop(old_id, None)
            self._caches[cache.cache_id] = cache
            if lease_s is not None:
                self._leases[cache.cache_id] = (float(lease_s), self._clock() + lease_s)

    def _map_shm(self, t: TensorSpec, i: int, files: _Files) -> torch.Tensor:
        where = f"tensors[{i}].handle.path"
        path = t.handle["path"]
        shown = _shown(path)
        resolved = os.path.realpath(path)
        if not resolved.startswith(self._shm_root + os.sep):
            # ``resolved`` stays here: see the module docstring.
            raise RegistrationError(
                f"{where} {shown} is outside {self._shm_name}: it must name a file inside "
                f"{self._shm_name} once symlinks and '..' are followed"
            )
        try:
            fd = os.open(resolved, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise RegistrationError(f"{where} {shown}: cannot open: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RegistrationError(f"{where} {shown} is not a regular file")
            if st.st_size < t.nbytes:
                raise RegistrationError(
                    f"{where} {shown} holds {st.st_size} bytes, but shape {t.shape} of "
                    f"{t.dtype} needs {t.nbytes}"
                )
            # Map the descriptor we checked, not the path again (it could be swapped).
            return files.view(fd, st, where, t.nbytes)
        finally:
            os.close(fd)


TMPFS_MAGIC = 0x01021994
"""``statfs.f_type`` of shmem: memfds (and tmpfs). Huge-page memfds are ``HUGETLBFS_MAGIC``."""


def _fd_file(t: TensorSpec, i: int, fds: Sequence[int] | None) -> tuple[int, os.stat_result, str]:
    """The passed descriptor a tensor's ``fd`` handle names, checked: ``(fd, its stat, where)``.

    It must be a regular file open read-write (a read-only one proves no right to write the
    file), at least the tensor's size, on shmem and sealed against shrinking (the module
    docstring says why)."""
    where = f"tensors[{i}].handle.fd"
    k = t.handle["fd"]
    if fds is None:
        raise RegistrationError(
            f"{where}: a descriptor handle is passed over the pool socket "
            "(app.pool_share.register_kv_cache), not named in an HTTP call"
        )
    if k >= len(fds):
        raise RegistrationError(f"{where} is {k}, but {len(fds)} descriptor(s) came")
    fd = fds[k]
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise RegistrationError(f"{where}: descriptor {k} is not a regular file")
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise RegistrationError(f"{where}: descriptor {k} is not open for reading and writing")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # a file system without seals
    if _fs_type(fd) != TMPFS_MAGIC or not seals & fcntl.F_SEAL_SHRINK:
        raise RegistrationError(
            f"{where}: descriptor {k} is not a memfd sealed against shrinking; make it with "
            "kvoffload_client.pool_socket.sealed_memfd(size) (memfd_create with "
            "MFD_ALLOW_SEALING, then fcntl F_ADD_SEALS F_SEAL_SHRINK): a file its holder can "
            "shrink, or a sparse file, would make the service's copies from or to it fault"
        )
    if st.st_size < t.nbytes:
        raise RegistrationError(
            f"{where}: descriptor {k} holds {st.st_size} bytes, but shape {t.shape} of "
            f"{t.dtype} needs {t.nbytes}"
        )
    return fd, st, where


class _Files:
    """The files of one registration, each mapped once (``view``), as long as its longest
    tensor. ``close`` ends the registration's use of the table; mappings live on in the views."""

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int], torch.Tensor] = {}
        self._wanted: dict[tuple[int, int], int] = {}
        self.mapped_bytes = 0
        """The lengths of every mapping made, what the registration costs the process."""

    def need(self, st: os.stat_result, nbytes: int) -> None:
        """Say ahead that a tensor needs ``nbytes`` of the file ``st``, so that its one
        mapping is made long enough for every tensor at once."""
        key = (st.st_dev, st.st_ino)
        self._wanted[key] = max(self._wanted.get(key, 0), nbytes)

    def view(self, fd: int, st: os.stat_result, where: str, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the file open as ``fd`` (``st`` its stat), mapped shared
        read-write: a view of the file's one mapping (as long as ``need`` said, else remapped
        longer when a later tensor needs more; the earlier views keep the shorter one)."""
        key = (st.st_dev, st.st_ino)
        have = self._maps.get(key)
        if have is None or have.numel() < nbytes:
            length = max(nbytes, self._wanted.get(key, 0))
            have = self._maps[key] = _map_shared(fd, length, where)
            self.mapped_bytes += length
        return have[:nbytes]

    def close(self) -> None:
        self._maps.clear()


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.fstatfs.restype = ctypes.c_int
_libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _fs_type(fd: int) -> int:
    """``f_type`` of the file system holding ``fd`` (``fstatfs``; -1 when it fails). The field
    opens ``struct statfs`` on every Linux ABI this runs on."""
    buf = ctypes.create_string_buffer(512)  # struct statfs is 120 bytes on 64-bit Linux
    if _libc.fstatfs(fd, buf) != 0:
        return -1
    return ctypes.c_long.from_buffer(buf).value


def _map_shared(fd: int, nbytes: int, where: str) -> torch.Tensor:
    """Map the first ``nbytes`` of ``fd`` shared read-write, as a flat ``uint8`` tensor.

    ``mmap(2)`` is called directly: Python's ``mmap`` keeps a duplicate of the descriptor for
    the life of the mapping, one per tensor, which let a single caller hold every descriptor
    of the process. This mapping holds none; it is unmapped when its last view is gone (the
    tensor keeps its buffer alive, and the buffer's finalizer unmaps)."""
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    addr = _libc.mmap(None, nbytes, prot, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        code = ctypes.get_errno()
        raise RegistrationError(
            f"{where}: cannot map {nbytes} bytes: {os.strerror(code) if code else 'failed'}"
            + (" (the process is at its limit of mappings)" if code == errno.ENOMEM else "")
        )
    buf = (ctypes.c_uint8 * nbytes).from_address(addr)
    weakref.finalize(buf, _libc.munmap, addr, nbytes)
    return torch.frombuffer(buf, dtype=torch.uint8)


def _device_uuids() -> list[str]:
    """Normalized UUID of each GPU this process sees, by its index here (a seam for tests)."""
    return [
        normalize_uuid(str(torch.cuda.get_device_properties(i).uuid))
        for i in range(torch.cuda.device_count())
    ]


def _pointer_device(ptr: int) -> int | None:
    """The ordinal of the GPU whose memory ``ptr`` is (``cuPointerGetAttribute``), or None
    when the driver cannot be asked (a seam for tests)."""
    for lib in driver_libraries():
        fn = getattr(lib, "cuPointerGetAttribute", None)
        if fn is None:
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        fn.restype = ctypes.c_int
        ordinal = ctypes.c_int(-1)
        if fn(ctypes.byref(ordinal), _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr) == 0:
            return ordinal.value
    return None


def _ipc_device_index(where: str, device: str, uuid: str | None) -> int:
    """The GPU to open a handle on, in this process's numbering: by UUID when the engine sent
    one (``cuda:N`` differs between processes with different ``CUDA_VISIBLE_DEVICES``)."""
    count = torch.cuda.device_count()
    if uuid is not None:
        uuids = _device_uuids()
        want = normalize_uuid(uuid)
        if want not in uuids:
            raise RegistrationError(
                f"{where}: GPU {uuid!r:.60} is not visible to the service ({count} GPUs seen)"
            )
        return uuids.index(want)
    index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    if index >= count:
        raise RegistrationError(f"{where}: device {device!r} does not exist ({count} GPUs)")
    return index


def _open_cuda_ipc(t: TensorSpec, i: int, device: str, uuid: str | None = None) -> torch.Tensor:
    where = f"tensors[{i}]"
    if not torch.cuda.is_available():
        raise RegistrationError(f"{where}: 'cuda_ipc' handles need CUDA; this node has none")
    index = _ipc_device_index(where, device, uuid)
    h = t.handle
    dtype = DTYPES[t.dtype]
    numel = math.prod(t.shape)
    tensor_offset = int(h.get("tensor_offset", 0))
    if "tensor_offset_bytes" in h:  # a whole number of elements (checked with the spec)
        tensor_offset = int(h["tensor_offset_bytes"]) // dtype.itemsize
    need = (tensor_offset + numel) * dtype.itemsize
    if need > h["storage_size_bytes"]:
        raise RegistrationError(
            f"{where}: shape {t.shape} of {t.dtype} at element offset {tensor_offset} needs "
            f"{need} bytes, but the shared storage holds {h['storage_size_bytes']}"
        )
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    event = h.get("event_handle")
    stride = [math.prod(t.shape[k + 1 :]) for k in range(len(t.shape))]
    try:
        tensor: torch.Tensor = rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
            torch.Tensor,
            torch.Size(t.shape),
            tuple(stride),
            tensor_offset,
            torch.storage.TypedStorage,
            dtype,
            index,
            _b64(h["storage_handle"], f"{where}.handle.storage_handle"),
            h["storage_size_bytes"],
            h["storage_offset_bytes"],
            False,
            _b64(h["ref_counter_handle"], f"{where}.handle.ref_counter_handle"),
            h["ref_counter_offset"],
            _b64(event, f"{where}.handle.event_handle") if event else b"",
            bool(h.get("event_sync_required", False)),
        )
    except RegistrationError:
        raise
    except Exception as exc:  # CUDA refuses a stale or foreign handle
        reason = _shown(str(exc).partition("\n")[0])  # torch's first line, cut short
        raise RegistrationError(f"{where}: cannot open the CUDA IPC handle: {reason}") from None
    actual = _pointer_device(tensor.data_ptr())
    if actual is None:
        log.warning("cannot tell which GPU %s is on; trusting GPU %d as named", where, index)
    elif actual != index:
        raise RegistrationError(
            f"{where}: the memory is on GPU {actual} of this process, not on GPU {index} the "
            "registration names (send device_uuid, or fix the device)"
        )
    return tensor.reshape(-1).view(torch.uint8)


def _layouts(geometry: list[tuple[int, int, int]], devices: list[str]) -> tuple[TensorLayout, ...]:
    out = []
    offset = 0
    for (outer, inner, nblocks), device in zip(geometry, devices, strict=True):
        out.append(TensorLayout(device, outer, inner, nblocks, offset))
        offset += outer * inner
    return tuple(out)


def _shown(text: str) -> str:
    """``text`` as an error message may repeat it: quoted with escapes, cut to
    ``_SHOWN_CHARS`` characters (a caller's path may be 4096 long)."""
    if len(text) <= _SHOWN_CHARS:
        return repr(text)
    return f"{text[:_SHOWN_CHARS]!r}..."


def _new_id() -> str:
    return "kvc-" + secrets.token_hex(8)
