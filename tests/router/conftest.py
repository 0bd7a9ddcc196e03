"""Tests against a real router's consumer of KV events: Dynamo's standalone KV indexer
(``ai-dynamo-runtime`` 1.6.1, pinned in requirements/dynamo-test.txt), run as a subprocess from
its own environment (``KVOFFLOAD_DYNAMO_PYTHON``, by default ``.venv-dynamo/bin/python``).

Without that environment this directory is not collected, unless ``KVOFFLOAD_REQUIRE_DYNAMO=1``
(set by ``make test-router``, which builds it), where its absence is an error, never a skip.
"""

from __future__ import annotations

import os

from testsupport.router_indexer import dynamo_missing

_missing = dynamo_missing()
if _missing is not None:
    if os.environ.get("KVOFFLOAD_REQUIRE_DYNAMO") == "1":
        raise RuntimeError(
            f"KVOFFLOAD_REQUIRE_DYNAMO=1 but {_missing}: run `make test-router`, which builds "
            ".venv-dynamo"
        )
    collect_ignore_glob = ["*"]
