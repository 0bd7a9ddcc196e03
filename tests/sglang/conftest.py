"""Tests of the SGLang backend inside SGLang 0.5.23's own code (``make test-sglang``, venv
``.venv-sglang``).

Without SGLang the directory is not collected, unless ``KVOFFLOAD_REQUIRE_SGLANG=1`` (set by
``make test-sglang``), where a missing SGLang is an error, never a skip. SGLang and torch warn at
import (their own deprecations, "Triton is not supported on current platform"); under
``filterwarnings = error`` that would fail whichever test imported them first, so they are
imported here with the import-time stand-ins of ``testsupport/sglang_stubs.py``.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

_REQUIRED = os.environ.get("KVOFFLOAD_REQUIRE_SGLANG") == "1"
if importlib.util.find_spec("sglang") is None:
    if _REQUIRED:
        raise RuntimeError(
            "KVOFFLOAD_REQUIRE_SGLANG=1 but sglang is not importable: run `make test-sglang`, "
            "which installs SGLang 0.5.23 into .venv-sglang"
        )
    collect_ignore_glob = ["*"]
else:
    from testsupport import sglang_stubs as stubs

    stubs.install()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import kvoffload_client.sglang.backend  # noqa: F401
        import sglang.srt.managers.cache_controller
        import sglang.srt.mem_cache.pool_host.mha
        import sglang.srt.mem_cache.storage.backend_factory
        import sglang.test.kits.unified_radix_cache.storage  # noqa: F401
