"""``kvoffload`` command line.

``kvoffload serve [--FLAG VALUE ...]``: run the service. Every ``Settings`` field is a flag
(``num_blocks`` -> ``--num-blocks``) and an environment variable (``KVOFFLOAD_NUM_BLOCKS``);
flags win over the environment, which wins over ``--config FILE``, which wins over defaults.
The admin token is never a flag (it would show in ``ps``): use ``KVOFFLOAD_ADMIN_TOKEN`` or
``--admin-token-file``. Policy parameters: ``--policy-param NAME=VALUE`` (repeatable; VALUE is
JSON when it parses as JSON, else a string).

``kvoffload replay TRACE ...``: replay a request trace against the manager (``app.replay``).

``kvoffload admin ...``: talk to a running service's admin API (``--url``, default
``KVOFFLOAD_ADMIN_URL`` or ``http://127.0.0.1:8001``; token from ``KVOFFLOAD_ADMIN_TOKEN`` or
``--token-file``): ``policy get``, ``policy set NAME [--param k=v ...] [--if-match GEN]``,
``stats``, ``requests``, ``release REQ_ID``, ``clear``. Answers are printed as JSON.

Exit status: 0 success, 1 runtime failure (the service or the call failed), 2 usage or
invalid settings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from app import replay
from app.settings import Settings

_NOT_FLAGS = {"admin_token", "policy_params"}


def parse_param(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` -> (NAME, VALUE as JSON if it parses, else the string)."""
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        value: Any = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return name, value


def _flag_help(name: str) -> str:
    field = Settings.model_fields[name]
    help_text = field.description or name
    default = field.default
    if default is not None and not isinstance(default, dict) and not callable(default):
        help_text += f" (default: {default})"
    return f"{help_text}; env KVOFFLOAD_{name.upper()}"


def _add_serve_flags(parser: argparse.ArgumentParser) -> None:
    for name in Settings.model_fields:
        if name in _NOT_FLAGS:
            continue
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=argparse.SUPPRESS,
            metavar=name.upper(),
            help=_flag_help(name),
        )
    parser.add_argument(
        "--policy-param",
        dest="policy_params",
        action="append",
        type=parse_param,
        default=argparse.SUPPRESS,
        metavar="NAME=VALUE",
        help="eviction policy parameter (repeatable); env KVOFFLOAD_POLICY_PARAMS (JSON)",
    )


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvoffload",
        description="KV-cache offloading service for LLM inference engines.",
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    # No abbreviations: "--admin-token" must not silently mean "--admin-token-file".
    serve = sub.add_parser(
        "serve", help="run the service (CPU pool on loopback by default)", allow_abbrev=False
    )
    _add_serve_flags(serve)

    replay.add_parser(sub)

    admin = sub.add_parser(
        "admin", help="talk to a running service's admin API", allow_abbrev=False
    )
    admin.add_argument(
        "--url",
        default=os.environ.get("KVOFFLOAD_ADMIN_URL", "http://127.0.0.1:8001"),
        help="admin API base URL (env KVOFFLOAD_ADMIN_URL)",
    )
    admin.add_argument("--token-file", type=Path, help="file holding the admin token")
    admin.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    what = admin.add_subparsers(dest="admin_command", required=True)
    policy = what.add_parser("policy", help="get or set the eviction policy")
    policy_cmd = policy.add_subparsers(dest="policy_command", required=True)
    policy_cmd.add_parser("get", help="the active policy")
    set_policy = policy_cmd.add_parser("set", help="switch the policy live")
    set_policy.add_argument("name", help="policy name (e.g. lru, arc)")
    set_policy.add_argument(
        "--param", action="append", type=parse_param, default=[], metavar="NAME=VALUE"
    )
    set_policy.add_argument("--if-match", help="only if the generation is still this one")
    policy_cmd.add_parser("shadow", help="projected hit ratio of every policy (shadow runs)")
    log_level = what.add_parser("log-level", help="get or set the log level live")
    level_cmd = log_level.add_subparsers(dest="level_command", required=True)
    level_cmd.add_parser("get", help="the current level")
    set_level = level_cmd.add_parser("set", help="change the level (audited)")
    set_level.add_argument("level", help="e.g. debug, info, warning")
    what.add_parser("stats", help="pool, hit ratio, counters")
    what.add_parser("requests", help="tracked requests and their leases")
    release = what.add_parser("release", help="force-release a request's leases")
    release.add_argument("req_id")
    what.add_parser("clear", help="drop every unpinned block")
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    """``Settings`` from the parsed ``serve`` flags (then env, config file, defaults)."""
    overrides = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    if "policy_params" in overrides:
        overrides["policy_params"] = dict(overrides["policy_params"])
    return Settings(**overrides)


def _serve(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        for err in exc.errors(include_url=False, include_input=False):
            loc = ".".join(str(p) for p in err["loc"])
            print(f"kvoffload: {loc + ': ' if loc else ''}{err['msg']}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"kvoffload: {exc}", file=sys.stderr)
        return 2

    from app.server import run
    from app.telemetry.logging import configure_logging, flush_logs, get_logger

    configure_logging(settings.log_level, fmt=settings.log_format)
    try:
        run(settings)
    except OSError as exc:
        get_logger("cli").error("cannot start", extra={"fields": {"error": str(exc)}})
        return 1
    except Exception as exc:
        get_logger("cli").error("service failed", exc_info=exc)
        return 1
    finally:
        flush_logs()
    return 0


def _admin_token(args: argparse.Namespace) -> str | None:
    if args.token_file is not None:
        return typing.cast(Path, args.token_file).read_text(encoding="utf-8").strip()
    return os.environ.get("KVOFFLOAD_ADMIN_TOKEN") or None


def _admin(args: argparse.Namespace) -> int:
    import httpx

    from app.client import KVOffloadAdminClient, KVOffloadError

    try:
        token = _admin_token(args)
    except OSError as exc:
        print(f"kvoffload: cannot read token file: {exc.strerror}", file=sys.stderr)
        return 2
    calls: dict[str, Callable[[KVOffloadAdminClient], Any]] = {
        "stats": lambda c: c.stats(),
        "requests": lambda c: c.requests(),
        "release": lambda c: c.release(args.req_id),
        "clear": lambda c: c.clear_cache(),
    }
    call: Callable[[KVOffloadAdminClient], Any]
    if args.admin_command == "policy":
        if args.policy_command == "get":
            call = lambda c: c.policy()  # noqa: E731
        elif args.policy_command == "shadow":
            call = lambda c: c.shadow()  # noqa: E731
        else:
            call = lambda c: c.set_policy(  # noqa: E731
                args.name, dict(args.param), if_match=args.if_match
            )
    elif args.admin_command == "log-level":
        if args.level_command == "get":
            call = lambda c: c.log_level()  # noqa: E731
        else:
            call = lambda c: c.set_log_level(args.level)  # noqa: E731
    else:
        call = calls[args.admin_command]
    try:
        with KVOffloadAdminClient(args.url, token=token, timeout=args.timeout) as client:
            answer = call(client)
    except KVOffloadError as exc:
        print(f"kvoffload: {exc.status} {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    except (OSError, httpx.HTTPError) as exc:
        print(f"kvoffload: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=2, default=str))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvoffload`` console script; returns the exit status."""
    args = _build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "admin":
        return _admin(args)
    if args.command == "replay":
        return replay.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
