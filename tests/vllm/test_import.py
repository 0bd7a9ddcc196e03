"""The tier imports in an engine's environment: no FastAPI, uvicorn, Starlette or server code.

vLLM's own modules (the tiering manager the tier plugs into) may pull in FastAPI: they are
imported first, as in an engine; then every module the tier could bring in from this project's
server is blocked, and new imports of FastAPI, uvicorn and Starlette fail too.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """
import sys
import vllm.v1.kv_offload.tiering.spec  # what the engine has loaded before it loads a tier
blocked = ("uvicorn", "app.server", "app.service", "app.main", "app.routes", "app.settings",
           "manager", "transfer", "pydantic_settings", "structlog")
before = set(sys.modules)
for name in blocked:
    sys.modules[name] = None  # any import of them now raises ImportError
for name in [m for m in before if m.split(".")[0] in ("fastapi", "starlette")]:
    sys.modules[name] = None
import app.vllm_tier as tier
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
cls = SecondaryTierFactory.get_tier_class({"type": "KVOffloadTier", "module_path": "app.vllm_tier"})
assert cls is tier.KVOffloadTier
ours = ("app", "manager", "transfer")
loaded = sorted(m for m, mod in sys.modules.items() if mod and m.split(".")[0] in ours)
print(",".join(loaded))
"""


def test_tier_imports_without_server_dependencies():
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.strip().splitlines()[-1].split(",")
    assert set(loaded) == {"app", "app.block_copy", "app.client", "app.pool_share", "app.vllm_tier"}
