"""One remote-tier test host: a host pool and a ``MooncakeTier``, driven over stdin/stdout.

Run as ``python -m tests.remote.node CONFIG_JSON`` (``tests.remote.hosts.Node`` does). It
answers one JSON line when the tier is built (``{"ready": true, "health": ...}``), then one per
command line:

- ``{"op": "put", "keys": [hex], "slots": [int], "data": [base64]}``: write each block into its
  slot, then ``put_from`` -> ``{"ok": [bool]}``
- ``{"op": "get", "keys": [hex], "slots": [int]}``: zero the slots, ``get_into`` ->
  ``{"ok": [bool], "data": [base64 | null]}`` (a slot's bytes only where it was reported read)
- ``{"op": "exists", "keys": [hex]}`` -> ``{"found": [bool]}``
- ``{"op": "health"}`` -> the tier's ``RemoteHealth.as_dict()`` plus ``held_slots``
- ``{"op": "close"}``: close the tier and the pool, answer ``{"closed": true}``, exit.
"""

from __future__ import annotations

import base64
import json
import logging
import sys
from typing import Any

import torch

from transfer.host_pool import HostPool
from transfer.mooncake import MooncakeConfig, MooncakeTier


def health(tier: MooncakeTier) -> dict[str, Any]:
    return {**tier.health().as_dict(), "held_slots": sorted(tier.held_slots())}


def serve(config: dict[str, Any]) -> None:
    pool = HostPool.create(config["num_blocks"], config["block_bytes"], pin=False)
    tier = MooncakeTier(
        pool,
        config["namespace"],
        MooncakeConfig(
            master=config["master"],
            metadata_url=config["metadata_url"],
            local_hostname=config["local_hostname"],
            segment_bytes=config["segment_bytes"],
            local_buffer_bytes=0,
            replicas=config["replicas"],
            timeout_s=config["timeout_s"],
            probe_interval_s=0.5,
        ),
    )

    def answer(reply: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()

    answer({"ready": True, "health": health(tier)})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        keys = [bytes.fromhex(k) for k in cmd.get("keys", [])]
        slots = cmd.get("slots", [])
        if op == "put":
            for slot, data in zip(slots, cmd["data"], strict=True):
                block = torch.frombuffer(bytearray(base64.b64decode(data)), dtype=torch.uint8)
                pool.tensor[slot].copy_(block)
            answer({"ok": tier.put_from(keys, slots)})
        elif op == "get":
            for slot in slots:
                pool.tensor[slot].zero_()
            ok = tier.get_into(keys, slots)
            data = [
                base64.b64encode(pool.tensor[s].numpy().tobytes()).decode() if r else None
                for s, r in zip(slots, ok, strict=True)
            ]
            answer({"ok": ok, "data": data})
        elif op == "exists":
            answer({"found": tier.exists(keys)})
        elif op == "health":
            answer(health(tier))
        elif op == "close":
            tier.close()
            pool.close()
            answer({"closed": True})
            return
        else:
            answer({"error": f"unknown op {op!r}"})


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    serve(json.loads(sys.argv[1]))
