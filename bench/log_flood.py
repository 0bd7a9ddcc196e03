"""Issue #21, item 3: how much log one ``POST /v1/batch`` of refused ops writes.

A tenant's namespace of ``--blocks`` blocks is filled with pinned blocks; then one batch of
``--ops`` ``prepare_store`` ops (one new key each) is sent: every op is refused with the
documented 507 (``quota_exceeded``, blocks). The service's logging is configured as ``serve``
configures it (JSON lines, level info) on a buffer, and the bytes and records written while
the batch ran are counted, with the tracebacks among them.

``--src DIR`` imports the service from another source tree (e.g. the commit before the fix:
``git archive BASE | tar -x -C /tmp/base`` then ``--src /tmp/base``), so both figures come from
the same script. Prints a table; writes ``bench/results/log_flood.json`` (or ``--out``).
Run from the repository root: ``.venv/bin/python bench/log_flood.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

TOKEN = "flood-token-0123456789abcdef"


async def measure(blocks: int, n_ops: int) -> dict[str, Any]:
    """Fill a namespace, send the batch; what was logged while it ran."""
    import httpx

    from app.core.tenancy import Tenancy
    from app.core.tenants import Credentials
    from app.http.apps import create_app
    from app.settings import Settings
    from app.telemetry.logging import configure_logging, flush_logs, unconfigure_logging

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tenants.toml"
        path.write_text(f'[tenants.t]\ntokens = ["{TOKEN}"]\nnamespaces = {{ ns = {blocks} }}\n')
        os.chmod(path, 0o600)
        settings = Settings(
            num_blocks=blocks,
            block_bytes=4096,
            device="cpu",
            max_keys_per_call=8192,
            max_batch_ops=max(n_ops, 1024),
            max_body_bytes=8 << 20,
            shadow_enabled=False,
        )
        tenancy = Tenancy(settings, credentials=Credentials(path))
        app = create_app(settings, tenancy=tenancy)
        buffer = io.StringIO()
        configure_logging("info", stream=buffer, fmt="json")
        headers = {"Authorization": f"Bearer {TOKEN}"}
        try:
            async with (
                app.router.lifespan_context(app),
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app), base_url="http://e", headers=headers
                ) as client,
            ):
                keys = [f"{i:016x}" for i in range(blocks)]
                await client.put("/v1/requests/w", json={})
                await client.post("/v1/requests/w/prepare-store", json={"keys": keys})
                await client.post("/v1/requests/w/complete-store", json={"keys": keys})
                await client.post("/v1/requests/w/prepare-load", json={"keys": keys})  # all pinned
                await client.put("/v1/requests/s", json={})
                ops = [
                    {"op": "prepare_store", "req_id": "s", "keys": [f"{blocks + i:016x}"]}
                    for i in range(n_ops)
                ]
                body = json.dumps({"ops": ops}).encode()
                flush_logs()
                before = len(buffer.getvalue().encode())
                r = await client.post(
                    "/v1/batch", content=body, headers={"content-type": "application/json"}
                )
                flush_logs()
                written = buffer.getvalue().encode()[before:].decode()
        finally:
            unconfigure_logging()
    statuses: dict[str, int] = {}
    for result in r.json()["results"]:
        code = f"{result['status']} {result.get('error', {}).get('code', '')}".strip()
        statuses[code] = statuses.get(code, 0) + 1
    records = [json.loads(line) for line in written.splitlines() if line.strip()]
    levels: dict[str, int] = {}
    for rec in records:
        levels[rec.get("level", "?")] = levels.get(rec.get("level", "?"), 0) + 1
    return {
        "ops": n_ops,
        "request_bytes": len(body),
        "answers": statuses,
        "log_bytes": len(written.encode()),
        "log_records": len(records),
        "records_by_level": levels,
        "tracebacks": sum(1 for rec in records if "exception" in rec or "exc_info" in rec),
    }


def main() -> None:
    """Parse the flags, measure, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--ops", type=int, default=1024)
    parser.add_argument("--src", type=Path, default=None, help="import the service from here")
    parser.add_argument("--label", default=None, help="the run's name in the table and JSON")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    root = (args.src or Path(__file__).resolve().parent.parent).resolve()
    sys.path.insert(0, str(root))
    result = asyncio.run(measure(args.blocks, args.ops))
    result["src"] = str(root)
    result["label"] = args.label or ("this tree" if args.src is None else str(args.src))
    print(
        f"{'run':<12} {'ops':>5} {'request':>9} {'log bytes':>10} {'records':>8} {'tracebacks':>10}"
    )
    print(
        f"{result['label']:<12} {result['ops']:>5} {result['request_bytes']:>9} "
        f"{result['log_bytes']:>10} {result['log_records']:>8} {result['tracebacks']:>10}"
    )
    print(f"answers: {result['answers']}; records by level: {result['records_by_level']}")
    out = args.out or Path(__file__).resolve().parent / "results" / "log_flood.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
