"""The engine side installed alone: a venv with vLLM 0.33 and only the ``kvoffload-client``
distribution (``pip install ./client``) loads the tier from a kv-transfer config, moves bytes
through a real ``kvoffload serve``, and has none of the server: ``import app`` fails there.

The venv is made here: ``python -m venv`` without pip, vLLM and its dependencies seen through a
``.pth`` line naming this test environment's site-packages (a directory named by a ``.pth``
line is added to ``sys.path`` as it is: its own ``.pth`` files, the editable installs of this
checkout among them, are not run), the engine distribution built and installed into the venv
by pip from ``client/``. The engine is ``testsupport/vllm_sim.py`` copied next to the script (it
imports vLLM and ``kvoffload_client.vllm`` only); the script runs from a temporary directory,
so the checkout is not on its path.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.vllm.conftest import serve

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import importlib.metadata, importlib.util, json, sys, time
import sim_engine as sim
import kvoffload_client, kvoffload_client.vllm

config = sim.kv_transfer_config(sys.argv[1], cpu_chunks=16)
a = sim.SimEngine("dist-a", config)
b = sim.SimEngine("dist-b", config)
keys = sim.keys_of(range(7000, 7004), salt=b"engine-distribution")
try:
    a.run_request("dist-a-1", keys)
    a.settle()
    deadline = time.monotonic() + 30
    while True:
        got = b.run_request(f"dist-b-{time.monotonic()}", keys)
        b.settle()
        if got.hit_chunks == len(keys) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
finally:
    a.close()
    b.close()
print(json.dumps({
    "tier_config": config["kv_connector_extra_config"]["secondary_tiers"][0],
    "tier_class": type(a.tiers[0]).__module__ + "." + type(a.tiers[0]).__name__,
    "hit_chunks": got.hit_chunks,
    "bytes_equal": got.loaded == {k: sim.chunk_bytes(k, a.model) for k in keys},
    "client_file": kvoffload_client.__file__,
    "client_version": importlib.metadata.version("kvoffload-client"),
    "server_packages": [m for m in ("app", "manager", "transfer") if importlib.util.find_spec(m)],
}))
"""


def make_venv(where: Path) -> Path:
    """A venv that sees this environment's vLLM and has the engine distribution installed
    (built from a copy of ``client/``, so the build leaves nothing in the checkout)."""
    source = where.parent / "client-src"
    shutil.copytree(ROOT / "client", source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(site, "vllm-test-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            str(source),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return python


def test_the_engine_distribution_alone_loads_the_tier_and_moves_bytes(tmp_path: Path) -> None:
    python = make_venv(tmp_path / "venv")
    work = tmp_path / "engine"
    work.mkdir()
    shutil.copy(ROOT / "testsupport" / "vllm_sim.py", work / "sim_engine.py")
    (work / "run.py").write_text(SCRIPT)

    # None of the server in this venv, whatever the directory.
    for name in ("app", "manager", "transfer"):
        found = subprocess.run(
            [str(python), "-c", f"import {name}"], cwd=work, capture_output=True, text=True
        )
        assert found.returncode != 0, f"import {name} succeeded in the engine's venv"
        assert f"No module named '{name}'" in found.stderr

    (tmp_path / "srv").mkdir()
    with serve(tmp_path / "srv").serving() as srv:
        done = subprocess.run(
            [str(python), "run.py", f"unix://{srv.uds}"],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(result, indent=1))
    assert result["tier_config"]["module_path"] == "kvoffload_client.vllm"
    assert result["tier_class"] == "kvoffload_client.vllm.tier.KVOffloadTier"
    assert result["hit_chunks"] == 4, "B loaded what A stored through the service"
    assert result["bytes_equal"]
    assert result["client_file"].startswith(str(tmp_path / "venv")), "the installed copy"
    assert result["client_version"] == "0.1.0"
    assert result["server_packages"] == []
