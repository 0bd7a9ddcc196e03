"""The host pool: one shared-memory region of ``num_blocks x block_bytes`` that slots index.

Contract:

- Allocated once, as a memfd (``memfd_create``: on the kernel's internal shared-memory mount,
  which has no size limit of its own and no directory), with its whole size reserved up front
  (``posix_fallocate``), so running out of memory is a clear ``PoolError`` at creation and
  never a ``SIGBUS`` during a copy. The region is pre-faulted before it is handed out.
- The file is sealed (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``) before anyone else can
  hold it: nobody, the engines the descriptor is handed to included, can change its size (an
  ``ftruncate`` fails with ``EPERM``) or add a seal (``F_SEAL_WRITE`` would stop the service's
  own writes). A holder can still punch holes in it (``FALLOC_FL_PUNCH_HOLE``): a hole refaults
  as a fresh zero page on the next access (the mount has no limit to run into), so it loses
  that holder's bytes and never raises ``SIGBUS`` in the service. The pool belongs to one
  namespace (``app.core.tenancy``), so the bytes lost are that namespace's own.
- The file never has a name an operator could leak, nor one anybody could fill its filesystem
  through: a memfd is in no directory. The memory lives as long as the pool's descriptor or
  any mapping of it, so nothing is left behind after ``close()``, after a normal exit, or after
  the service is killed with ``SIGKILL``.
- Engines in other containers get the pool's descriptor itself (``fd``, read-write), passed
  over a Unix socket (``SCM_RIGHTS``, ``app.pool_share``): the copy they receive maps the same
  memory read-write whatever their user, PID or mount namespace. ``pool_id`` is random and new
  for every pool, so a receiver can tell that the pool it mapped is no longer the service's.
- ``path`` = ``/proc/<pid>/fd/<n>`` names the same file for processes on the same host: a link
  that exists exactly while the owning process keeps the pool open. Opening it needs the same
  user as the service (the file is mode 0600, since it holds KV data) and a shared PID
  namespace (same host, or a pod with ``shareProcessNamespace``); other containers use ``fd``.
- ``pin=None`` pins iff CUDA is available. Pinning registers the region with
  ``cudaHostRegister`` in chunks of at most 64 GiB whose boundaries fall on block boundaries
  where possible (``pin_chunk_blocks``), so a copy of a run of slots can be split to stay inside
  one registration. A failed registration unregisters the chunks already registered, logs a
  warning and leaves the pool pageable; ``pinned`` tells the truth.
- ``close()`` is idempotent: it unregisters the pinning and closes the descriptor. Workers that
  still hold ``tensor`` keep the mapping alive until they let go of it, so shut workers down
  before closing the pool (an in-flight CUDA copy must not see its memory unpinned).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import math
import os
import secrets
import weakref
from typing import Any

import torch

from transfer.cudart import runtime_library
from transfer.errors import PoolError

__all__ = ["MAX_PIN_CHUNK_BYTES", "POOL_SEALS", "HostPool", "available_memory"]

log = logging.getLogger(__name__)

MAX_PIN_CHUNK_BYTES = 64 << 30
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; older kernels answer EINVAL and we touch pages.
_CUDA_HOST_REGISTER_PORTABLE = 1  # usable from every CUDA context, not only the current one


def _cudart() -> Any:
    """The CUDA runtime torch loaded, as ctypes (``transfer.cudart.runtime_library``): it has
    ``cudaGetLastError``, which torch's own ``torch.cuda.cudart()`` module lacks. That module
    only where the runtime cannot be called directly (a static build): a failed registration
    then leaves its error set. A seam tests replace with a fake."""
    torch.cuda.init()  # type: ignore[no-untyped-call]  # loads the runtime before the lookup
    lib = runtime_library()
    if lib is None or getattr(lib, "cudaHostRegister", None) is None:
        return torch.cuda.cudart()  # type: ignore[no-untyped-call]
    return lib


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def available_memory() -> int | None:
    """Bytes a new pool may take (``_available_memory``): what ``HostPool.create`` checks."""
    return _available_memory()


def _available_memory() -> int | None:
    """Bytes this process may still fault in: MemAvailable, capped by a cgroup v2 limit.

    ``None`` when nothing can be read (non-Linux); the caller then skips the check.
    """
    avail: int | None = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        return None
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((ln.split(":", 2)[2].strip() for ln in f if ln.startswith("0::")), None)
        if rel is not None:
            base = os.path.join("/sys/fs/cgroup", rel.lstrip("/"))
            with open(os.path.join(base, "memory.max")) as f:
                limit = f.read().strip()
            if limit != "max":
                with open(os.path.join(base, "memory.current")) as f:
                    current = int(f.read().strip())
                headroom = max(0, int(limit) - current)
                avail = headroom if avail is None else min(avail, headroom)
    except (OSError, ValueError, StopIteration):
        pass
    return avail


POOL_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
"""The seals every pool carries: its size is fixed and no other seal can be added."""


def _sealed_memfd(name: str, total: int) -> int:
    """A read-write descriptor of a new memfd of ``total`` reserved bytes, mode 0600, sealed
    with ``POOL_SEALS`` (module docstring). ``OSError`` when the kernel refuses."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)  # a memfd starts 0777; /proc/<pid>/fd/<n> opens by this mode
        os.posix_fallocate(fd, 0, total)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, POOL_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _prefault(tensor: torch.Tensor) -> None:
    """Fault every page in now, so the first copies do not pay for it."""
    nbytes = tensor.numel()
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    if madvise(tensor.data_ptr(), nbytes, _MADV_POPULATE_WRITE) == 0:
        return
    # Older kernel: write one byte per page (the region is fresh, so zeros change nothing).
    tensor[::_PAGE].zero_()


def _pin_chunk_bytes(block_bytes: int, limit: int) -> int:
    """Registration chunk size: a multiple of block_bytes and of the page size if one fits."""
    unit = math.lcm(block_bytes, _PAGE)
    if unit <= limit:
        return (limit // unit) * unit
    return max(_PAGE, (limit // _PAGE) * _PAGE)


def _close_fd(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


class HostPool:
    """The shared-memory host pool. Build it with ``HostPool.create``."""

    def __init__(
        self,
        *,
        fd: int,
        tensor: torch.Tensor,
        num_blocks: int,
        block_bytes: int,
        pin_chunks: list[tuple[int, int]],
        pin_chunk_blocks: int | None,
        pin_device: int | None = None,
    ) -> None:
        self._fd = fd
        self._tensor: torch.Tensor | None = tensor
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.path = f"/proc/{os.getpid()}/fd/{fd}"
        self.pool_id = secrets.token_hex(8)
        self._pin_chunks = pin_chunks
        self._pin_device = pin_device
        self.pin_chunk_blocks = pin_chunk_blocks
        self._closed = False
        self._keep: object = None
        # A forgotten pool still closes its descriptor when collected.
        self._fd_finalizer = weakref.finalize(self, _close_fd, fd)

    @classmethod
    def create(
        cls,
        num_blocks: int,
        block_bytes: int,
        *,
        pin: bool | None = None,
        name_prefix: str = "kvoffload",
        pin_device: int | None = None,
    ) -> HostPool:
        """Allocate, seal, pre-fault and (maybe) pin a pool of ``num_blocks`` blocks of
        ``block_bytes``.

        ``name_prefix``: the memfd's name (``/proc/<pid>/fd/<n>`` reads ``/memfd:NAME
        (deleted)``). ``pin_device``: the GPU whose context registers the pool (the
        registration is usable from every GPU, but it makes a context on the calling thread's
        current device: GPU 0 unless told, hundreds of MiB there in a service that serves
        another GPU).

        Raises ``PoolError`` for a non-positive size and a pool that does not fit in available
        memory (or that the kernel refuses to reserve).
        """
        for what, value in (("num_blocks", num_blocks), ("block_bytes", block_bytes)):
            if type(value) is not int or value <= 0:
                raise PoolError(f"{what} must be a positive integer, got {value!r}")
        total = num_blocks * block_bytes
        avail = _available_memory()
        if avail is not None and total > avail:
            raise PoolError(
                f"host pool of {num_blocks} x {block_bytes} = {total} bytes does not fit in "
                f"memory ({avail} bytes available)"
            )
        try:
            fd = _sealed_memfd(name_prefix, total)
        except OSError as exc:
            raise PoolError(
                f"cannot reserve {total} bytes of shared memory: {os.strerror(exc.errno or 0)}"
            ) from exc
        try:
            flat = torch.from_file(
                f"/proc/self/fd/{fd}", shared=True, size=total, dtype=torch.uint8
            )
            _prefault(flat)
        except BaseException:
            os.close(fd)
            raise
        chunk = _pin_chunk_bytes(block_bytes, MAX_PIN_CHUNK_BYTES)
        chunk_blocks = chunk // block_bytes if chunk % block_bytes == 0 else None
        want_pin = _cuda_available() if pin is None else pin
        chunks = _register(flat, chunk, pin_device) if want_pin else []
        return cls(
            fd=fd,
            tensor=flat.view(num_blocks, block_bytes),
            num_blocks=num_blocks,
            block_bytes=block_bytes,
            pin_chunks=chunks,
            pin_chunk_blocks=chunk_blocks if chunks else None,
            pin_device=pin_device,
        )

    @property
    def tensor(self) -> torch.Tensor:
        """``uint8`` tensor of shape ``[num_blocks, block_bytes]`` over the region."""
        if self._tensor is None:
            raise PoolError("host pool is closed")
        return self._tensor

    @property
    def fd(self) -> int:
        """The pool's read-write descriptor, to pass to another process (``SCM_RIGHTS``).

        The pool owns it: never close it. A passed copy maps the same memory read-write and
        keeps it alive after ``close()``, but cannot change the file's size (``POOL_SEALS``);
        ``PoolError`` once the pool is closed.
        """
        if self._closed:
            raise PoolError("host pool is closed")
        return self._fd

    @property
    def pinned(self) -> bool:
        """True while the whole region is registered with CUDA (page-locked)."""
        return bool(self._pin_chunks)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def layout(self) -> dict[str, Any]:
        """What an engine needs to map the pool: ``{path, num_blocks, block_bytes, pinned}``."""
        return {
            "path": self.path,
            "num_blocks": self.num_blocks,
            "block_bytes": self.block_bytes,
            "pinned": self.pinned,
        }

    def close(self, *, unpin: bool = True) -> None:
        """Unpin, drop this pool's mapping and close the descriptor. Idempotent.

        ``unpin=False`` leaves the region registered (and so mapped) until the process exits:
        for a shutdown whose CUDA copies did not end in time (``TransferWorker.quiesced``),
        since unregistering memory a DMA still writes is undefined behaviour.
        """
        if self._closed:
            return
        self._closed = True
        if not unpin:
            self._keep = (self._pin_chunks, self._tensor)  # never unregistered nor unmapped
            self._pin_chunks = []
        if self._pin_chunks:
            _unregister(self._pin_chunks, self._pin_device)
            self._pin_chunks = []
        self._tensor = None
        self._fd_finalizer()

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("pinned" if self.pinned else "pageable")
        return (
            f"HostPool({self.num_blocks} x {self.block_bytes} B, {state}, "
            f"pool_id={self.pool_id}, path={self.path})"
        )


def _register(flat: torch.Tensor, chunk: int, device: int | None = None) -> list[tuple[int, int]]:
    """Register ``flat`` with cudaHostRegister in chunks, from ``device``'s context (None: the
    current one); [] (and a warning) on any failure."""
    base, total = flat.data_ptr(), flat.numel()
    done: list[tuple[int, int]] = []
    try:
        rt = _cudart()
        with _on_device(device):
            _register_chunks(rt, base, total, chunk, done)
    except Exception as exc:  # CUDA missing, driver refusal, RLIMIT: all leave it pageable
        _unregister(done, device)
        log.warning("host pool stays pageable (not pinned): %s", exc)
        return []
    return done


def _on_device(device: int | None) -> contextlib.AbstractContextManager[Any]:
    """``device`` current for the enclosed CUDA calls (None: whatever is current)."""
    return contextlib.nullcontext() if device is None else torch.cuda.device(device)


def _register_chunks(
    rt: Any, base: int, total: int, chunk: int, done: list[tuple[int, int]]
) -> None:
    """Register ``[base, base + total)`` chunk by chunk, appending each to ``done``."""
    for offset in range(0, total, chunk):
        # The mapping covers whole pages; register whole pages (chunks are page multiples,
        # the last one is rounded up inside the mapping's final page).
        size = -(-min(chunk, total - offset) // _PAGE) * _PAGE
        code = int(rt.cudaHostRegister(base + offset, size, _CUDA_HOST_REGISTER_PORTABLE))
        if code != 0:
            # The failure stays as this thread's last CUDA error and would fail the next
            # unrelated call that checks it (a torch op, a kernel launch): clear it.
            _clear_last_error(rt)
            raise RuntimeError(f"cudaHostRegister({size} bytes at +{offset}) -> error {code}")
        done.append((base + offset, size))


def _clear_last_error(rt: Any) -> None:
    clear = getattr(rt, "cudaGetLastError", None)
    if clear is None:
        log.warning("cannot clear the CUDA error left by a failed call (no cudaGetLastError)")
        return
    with contextlib.suppress(Exception):
        clear()


def _unregister(chunks: list[tuple[int, int]], device: int | None = None) -> None:
    """Unregister ``chunks``, from ``device``'s context as they were registered."""
    if not chunks:
        return
    try:
        rt = _cudart()
        guard = _on_device(device)
    except Exception as exc:
        log.warning("cannot unregister pinned host pool: %s", exc)
        return
    with guard:
        for ptr, _size in chunks:
            code = int(rt.cudaHostUnregister(ptr))
            if code != 0:
                _clear_last_error(rt)
                log.warning("cudaHostUnregister(%#x) -> error %d", ptr, code)
