"""Which KV-cache handles a caller may name, and which it must pass: no confused deputy.

A registration tells the service where a KV cache's memory is. A handle the caller *names*
(``{"kind": "shm", "path"}``, a ``cuda_ipc`` handle, whose ``ref_counter_handle`` is a
``/dev/shm`` name torch opens) is opened by the service with its own rights: any caller could
name memory of another tenant (or any file the service can open) and read or write it through
offloads and onloads, and a refusal would tell whether the file exists and how big it is.
A handle the caller *passes* (``{"kind": "shm", "fd": K}``: a descriptor sent over the pool
socket with ``SCM_RIGHTS``) proves the caller holds the file, open read-write.

``check_registration`` applies the rule: with tenants, only passed handles, unless the operator
said every caller is trusted (``--registration-by-name``); without tenants (one trust domain,
loopback or a socket of the service's user) named handles are accepted as before. It reads the
registration's JSON only, before anything is opened, so a refusal depends on nothing but what
the caller sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.core.errors import HandleNotHeldError


def check_registration(spec: Any, *, tenants: bool, trusted: bool) -> None:
    """Refuse (``HandleNotHeldError``) a registration ``spec`` (the JSON body) that names a
    path or a CUDA IPC handle when ``tenants`` is on and the callers are not ``trusted``.
    Anything else about ``spec`` is left to the registry's own checks."""
    if not tenants or trusted or not isinstance(spec, Mapping):
        return
    tensors = spec.get("tensors")
    if not isinstance(tensors, list):
        return
    for i, tensor in enumerate(tensors):
        handle = tensor.get("handle") if isinstance(tensor, Mapping) else None
        if not isinstance(handle, Mapping):
            continue
        kind = handle.get("kind")
        if kind == "shm" and "fd" not in handle:
            raise HandleNotHeldError(f"tensors[{i}].handle", "path")
        if kind == "cuda_ipc":
            raise HandleNotHeldError(f"tensors[{i}].handle", "CUDA IPC handle")
