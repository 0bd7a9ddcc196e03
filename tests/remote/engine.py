"""A stand-in engine beside one ``kvoffload serve`` node, on that node's test host.

Run as ``python -m tests.remote.engine CONFIG_JSON`` inside the node's network namespace
(``tests.remote.service.ServeNode`` does), where the service's engine and admin APIs listen on
the namespace's own addresses. ``CONFIG_JSON``: ``{"url", "admin_url", "admin_token",
"pool_socket", "wait_s"}``. It waits (at most ``wait_s``) for ``/readyz`` to answer 200,
receives the host pool on the pool socket and maps it, answers one JSON line
(``{"ready": true, "num_blocks", "block_bytes"}``), then one per command line. Engine calls go
through ``KVOffloadClient``; block bytes through the mapping, as an engine's copies would.

- ``{"op": "store", "req": id, "keys": [hex], "data": [base64]}``: start the request,
  ``prepare-store``, write each planned key's block into its slot, ``complete-store``, finish
  -> ``{"stored": [hex], "slots": [int]}``
- ``{"op": "lookup", "req": id, "keys": [hex]}`` -> ``{"results": [...], "hit_prefix": n}``
- ``{"op": "prepare_load", "req": id, "keys": [hex]}`` -> ``{"slots": [int]}``
- ``{"op": "complete_load", "req": id, "keys": [hex]}`` -> ``{"completed": true}``
- ``{"op": "read", "slots": [int]}`` -> ``{"data": [base64]}``: the slots' bytes in the pool
- ``{"op": "finish", "req": id}`` -> ``{"finished": true}``
- ``{"op": "stats"}`` -> ``/admin/v1/stats``; ``{"op": "requests"}`` -> ``/admin/v1/requests``
- ``{"op": "readyz"}`` -> ``{"status", "body"}``
- ``{"op": "events", "after": n}`` -> ``{"events": [{"type", "medium", "keys": [hex]}], "next"}``
- ``{"op": "close"}``: unmap, answer ``{"closed": true}``, exit.

A call the service refuses answers ``{"error": {"status", "code"}}``; one that cannot reach it
``{"error": {"transport": "..."}}``. Requests are started on their first use.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time
from typing import Any

import httpx
from kvoffload_client.client import KVOffloadAdminClient, KVOffloadClient, KVOffloadError
from kvoffload_client.pool_socket import receive_pool


def _wait_ready(url: str, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url}/readyz not 200 within {wait_s} s")
        time.sleep(0.1)


def serve(config: dict[str, Any]) -> None:
    _wait_ready(config["url"], config["wait_s"])
    shared = receive_pool(config["pool_socket"], timeout_s=10)
    mapped = shared.map()
    os.close(shared.fd)
    block = shared.block_bytes
    engine = KVOffloadClient(config["url"], timeout=30)
    admin = KVOffloadAdminClient(config["admin_url"], token=config["admin_token"], timeout=30)
    started: set[str] = set()

    def answer(reply: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()

    def begin(req: str) -> None:
        if req not in started:
            engine.start_request(req)
            started.add(req)

    def slot_bytes(slot: int) -> memoryview:
        start = shared.offset + slot * block
        return memoryview(mapped)[start : start + block]

    def run(cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        keys = [bytes.fromhex(k) for k in cmd.get("keys", [])]
        req = cmd.get("req", "")
        if op == "store":
            begin(req)
            data = dict(zip(keys, cmd["data"], strict=True))
            plan = engine.prepare_store(req, keys)
            for key, slot in zip(plan.keys_to_store, plan.slots, strict=True):
                slot_bytes(slot)[:] = base64.b64decode(data[key])
            engine.complete_store(req, plan.keys_to_store, success=True)
            engine.finish_request(req)
            started.discard(req)
            return {"stored": [k.hex() for k in plan.keys_to_store], "slots": plan.slots}
        if op == "lookup":
            begin(req)
            found = engine.lookup(req, keys)
            return {"results": found.results, "hit_prefix": found.hit_prefix}
        if op == "prepare_load":
            begin(req)
            return {"slots": engine.prepare_load(req, keys)}
        if op == "complete_load":
            engine.complete_load(req, keys)
            return {"completed": True}
        if op == "read":
            return {"data": [base64.b64encode(slot_bytes(s)).decode() for s in cmd["slots"]]}
        if op == "finish":
            engine.finish_request(req)
            started.discard(req)
            return {"finished": True}
        if op == "stats":
            return admin.stats()
        if op == "requests":
            return admin.requests()
        if op == "readyz":
            r = httpx.get(f"{config['url']}/readyz", timeout=10)
            return {"status": r.status_code, "body": r.json()}
        if op == "events":
            page = engine.events(after=int(cmd["after"]))
            events = [
                {"type": e.type, "medium": e.medium, "keys": [k.hex() for k in e.block_hashes]}
                for e in page.events
            ]
            return {"events": events, "next": page.next_after}
        raise ValueError(f"unknown op {op!r}")

    answer({"ready": True, "num_blocks": shared.num_blocks, "block_bytes": block})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "close":
            engine.close()
            admin.close()
            mapped.close()
            answer({"closed": True})
            return
        try:
            answer(run(cmd))
        except KVOffloadError as exc:
            answer({"error": {"status": exc.status, "code": exc.code}})
        except httpx.TransportError as exc:
            answer({"error": {"transport": f"{type(exc).__name__}: {exc}"}})


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
