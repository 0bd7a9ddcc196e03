"""kvoffload's HTTP face. Knows ``manager/`` and ``transfer/``; nothing imports it back.

- ``settings``: every knob (defaults < config file < ``KVOFFLOAD_*`` env < flags).
- ``service``: the one ``Service`` both listeners share (manager, host pool, KV-cache registry,
  transfer worker, job tracker, event buffer, background tasks).
- ``main``: ``create_app`` (engine API) and ``create_admin_app`` (admin API) factories.
- ``operations``: the request-scoped ops, shared by the single routes and ``/v1/batch``.
- ``routes/``: engine, admin and health routes; ``raw`` holds the raw-body route machinery.
- ``schemas``: strict request bodies and documented answers. ``errors``: domain errors to HTTP,
  in one place. ``middleware``: pure ASGI (call context, body guard). ``openapi``: the spec.
- ``events``: the bounded KV-event buffer. ``logging``: JSON lines and the audit trail.
- ``server``: one process, one loop, two uvicorn listeners. ``cli``: ``kvoffload``.
- ``client``: typed engine and admin clients (httpx; TCP or Unix socket).
- ``pool_share``: the host pool's descriptor handed to engines over a Unix socket (standard
  library only: engines import it).
"""
