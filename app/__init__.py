"""kvoffload's service and its faces. Knows ``manager/`` and ``transfer/``; nothing imports it back.

Rooms, each importing only from the rooms below it (``tests/test_layering.py`` holds it):

- ``settings``: every knob (defaults < config file < ``KVOFFLOAD_*`` env < flags).
- ``telemetry/``: what the service reports. ``request_ids`` (the safe form of an id, one cache),
  ``logging`` (JSON lines, audit trail, live level), ``metrics`` (the Prometheus families),
  ``calls`` (the record of one HTTP call), ``observer`` (work to metrics and log lines).
- ``core/``: the service, with no HTTP in it. ``service`` (lifecycle, background tasks, the
  rooms below), ``observed`` (every manager call, observed once), ``transfers`` (pool, KV
  caches, worker, jobs), ``admin`` (operator operations, audited), ``events`` (KV-event buffer),
  ``shadow`` (shadow evaluation), ``errors`` (the core's domain errors).
- ``http/``: the edge. ``apps`` (``create_app``, ``create_admin_app``), ``routes/`` (engine,
  admin, health, metrics), ``operations`` (request-scoped ops shared by routes and batch),
  ``schemas``, ``errors`` (every domain error to a status, in one table), ``middleware`` (pure
  ASGI), ``limits`` (body caps), ``openapi``, ``deps``.
- ``server``: one process, one loop, two uvicorn listeners. ``cli``: ``kvoffload``.
  ``replay``: the policy lab's command.
- ``pool_share``: the pool socket's server (the host pool's descriptor handed to engines, KV
  caches registered by descriptor).

The engine side (typed clients, the pool socket's client, the vLLM tier) is a distribution of
its own, ``kvoffload-client`` (``client/``, import name ``kvoffload_client``), which engines
install without the server; the server depends on it for the wire types they share.
"""


def package_version() -> str:
    """The installed distribution's version (from pyproject.toml), "0+unknown" if not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvoffload")
    except PackageNotFoundError:
        return "0+unknown"
