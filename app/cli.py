"""``kvoffload`` command line.

``kvoffload serve [--FLAG VALUE ...]``: run the service. Every ``Settings`` field is a flag
(``num_blocks`` -> ``--num-blocks``) and an environment variable (``KVOFFLOAD_NUM_BLOCKS``);
flags win over the environment, which wins over ``--config FILE``, which wins over defaults.
The admin token is never a flag (it would show in ``ps``): use ``KVOFFLOAD_ADMIN_TOKEN`` or
``--admin-token-file``. Policy parameters: ``--policy-param NAME=VALUE`` (repeatable; VALUE is
JSON when it parses as JSON, else a string). A setting the service cannot start with (an
invalid value, an unknown policy, a busy port, a device the machine lacks) is one line on
stderr naming its flag and variable (a value from the ``--config`` file: the file and its key),
the value and what is accepted (``ConfigError``), and exit status 2.

``kvoffload replay TRACE ...``: replay a request trace against the manager (``app.replay``).

``kvoffload admin ...``: talk to a running service's admin API (``--url``, default
``KVOFFLOAD_ADMIN_URL`` or ``http://127.0.0.1:8001``; the token from the sources the service
reads it from, ``app.settings.AdminAuth``: ``--admin-token-file``, ``KVOFFLOAD_ADMIN_TOKEN``,
``KVOFFLOAD_ADMIN_TOKEN_FILE``, the config file): ``policy get``, ``policy set NAME
[--param k=v ...] [--if-match GEN]``, ``stats``, ``requests``, ``release REQ_ID``, ``clear``,
``retentions list``, ``retentions release NAME`` (``--namespace`` names the namespace they act
on). Answers are a table on a terminal and JSON otherwise (``--json``, ``--table`` choose).

Exit status: 0 success, 1 runtime failure (the service or the call failed), 2 usage or
invalid settings; 141 (as a process killed by SIGPIPE) when the reader of stdout went away.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from app import package_version, replay
from app.settings import (
    OCTAL_SETTINGS,
    AdminAuth,
    ConfigError,
    Settings,
    flag_name,
    format_size,
    is_size,
    load_or_refuse,
    load_settings,
    policy_params_accepted,
    unknown_variables,
)
from manager import UnknownPolicyError
from manager.policies import canonical_policy_name, policy_params_help

# Exit status of a command whose reader closed stdout early (128 + SIGPIPE, as the shell
# reports a process SIGPIPE killed).
EXIT_BROKEN_PIPE = 141
EXIT_BACKEND_FAILED = 1
"""``kvoffload serve`` after a sticky CUDA error: the supervisor should start a new process."""


# Every policy's parameters and their bounds, from the registry (the one place they are
# declared), for the --help of the flags that take them.
_PARAMS_ACCEPTED = "Accepted: " + "; ".join(policy_params_help().splitlines())


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


def _flag_brief(name: str) -> str:
    """A setting's line in ``serve --help``: its description's first clause, and its default
    where that is short."""
    brief = (Settings.model_fields[name].description or name).split("; ")[0]
    default = _default(name)
    return brief + default if len(default) <= 28 and "default" not in brief else brief


def _default(name: str) -> str:
    """`` (default: X)`` for a setting with a plain default, else nothing."""
    default = Settings.model_fields[name].default
    if name in OCTAL_SETTINGS:
        return f" (default: {default:04o})"
    if is_size(Settings.model_fields[name]) and isinstance(default, int):
        return f" (default: {format_size(default)})"
    if default is not None and not isinstance(default, dict) and not callable(default):
        return f" (default: {default})"
    return ""


def _short_metavar(name: str) -> str:
    """The value's kind, for ``serve --help``'s one line (``--help-all`` names the setting)."""
    annotation = Settings.model_fields[name].annotation
    if name in OCTAL_SETTINGS:
        return "MODE"
    if name.endswith("_s"):
        return "S"
    if is_size(Settings.model_fields[name]):
        return "SIZE"
    if annotation in (int, int | None):
        return "N"
    if annotation in (float, float | None):
        return "X"
    if annotation in (Path, Path | None):
        return "PATH"
    return "VALUE"


#: Where ``serve --help`` starts each option's text (a longer option takes two spaces more).
BRIEF_COLUMN = 30


class _OneLine(argparse.HelpFormatter):
    """``serve --help``: one line per option (its ``brief`` after its ``short`` invocation),
    cut at a word to the terminal's width; ``--help-all`` prints every option's whole text, as
    ``docs/cli.md`` does."""

    def _format_action(self, action: argparse.Action) -> str:
        brief: str | None = getattr(action, "brief", None)
        if brief is None:
            return super()._format_action(action)
        short: str = getattr(action, "short", None) or ", ".join(action.option_strings)
        room = max(24, self._width - max(BRIEF_COLUMN, len(short)) - 4)
        if len(brief) > room:
            brief = brief[: room - 1].rsplit(" ", 1)[0].rstrip(",;:(") + "…"
        return f"  {short:<{BRIEF_COLUMN}}  {brief}\n"


class _HelpAll(argparse.Action):
    """``--help-all``: the parser's help with every option's whole text, then exit."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        kwargs.update(nargs=0, default=argparse.SUPPRESS)
        super().__init__(option_strings, argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        sys.stdout.write(full_help(parser))
        parser.exit()


def full_help(parser: argparse.ArgumentParser) -> str:
    """``parser``'s help with every option's whole text (``serve --help-all``, the docs'
    reference), whatever formatter its ``--help`` uses."""
    brief = parser.formatter_class
    parser.formatter_class = argparse.HelpFormatter
    try:
        return parser.format_help()
    finally:
        parser.formatter_class = brief


def _brief(action: argparse.Action, brief: str, short: str | None = None) -> None:
    """Give ``action`` its line in ``serve --help`` (``_OneLine``)."""
    action.brief = brief  # type: ignore[attr-defined]
    action.short = short  # type: ignore[attr-defined]


def _flag_help(name: str) -> str:
    help_text = Settings.model_fields[name].description or name
    return f"{help_text}{_default(name)}; env KVOFFLOAD_{name.upper()}"


class _Switch(argparse.Action):
    """An on/off setting: ``--x`` (on), ``--x BOOL`` (as written, for the settings' own
    parsing), ``--no-x`` (off)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        flag = option_strings[0]
        super().__init__([flag, f"--no-{flag[2:]}"], dest, nargs="?", **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if option_string is not None and option_string.startswith("--no-"):
            if values is not None:
                parser.error(f"argument {option_string}: takes no value")
            values = "false"
        setattr(namespace, self.dest, "true" if values is None else values)


def _is_switch(name: str) -> bool:
    return Settings.model_fields[name].annotation in (bool, bool | None)


#: ``serve --help``'s groups, each by its first setting: the settings that follow it, in their
#: declared order, belong to it (a setting added later lands in its neighbours' group).
SERVE_GROUPS = {
    "host": "listeners",
    "head_timeout_s": "connections",
    "num_blocks": "pool and policy",
    "lease_ttl_s": "leases, jobs, limits",
    "max_retained_blocks": "cache control (retentions, prefetches)",
    "remote_tier": "remote tier (Mooncake)",
    "object_bucket": "object tier (S3)",
    "disk_dir": "disk tier",
    "fault_fail_rate": "fault injection",
    "kv_events_endpoint": "KV events for routers (ZMQ)",
    "metrics_enabled": "observability",
    "shadow_enabled": "shadow evaluation",
    "shutdown_grace_s": "process",
}


#: ``serve --help``'s first group: what a newcomer sets, in this order (each leaves its own
#: group below for it).
COMMON_SETTINGS = (
    "config",
    "host",
    "port",
    "admin_port",
    "uds",
    "admin_token_file",
    "tenants",
    "num_blocks",
    "block_bytes",
    "policy",
    "device",
    "tiers",
    "disk_dir",
    "disk_bytes",
    "log_level",
)
COMMON_TITLE = "common options"


def _add_serve_flags(parser: argparse.ArgumentParser) -> None:
    common = parser.add_argument_group(
        COMMON_TITLE, "what most services set (the other options follow, by group)"
    )
    for name in COMMON_SETTINGS:
        _add_serve_flag(common, name)
    group: argparse._ActionsContainer = parser
    groups: dict[str, argparse._ActionsContainer] = {}
    for name in Settings.model_fields:
        if name in SERVE_GROUPS:
            group = groups[name] = parser.add_argument_group(SERVE_GROUPS[name])
        if name not in COMMON_SETTINGS:
            _add_serve_flag(group, name)
    action = groups.get("num_blocks", parser).add_argument(
        "--policy-param",
        dest="policy_params",
        action="append",
        type=parse_param,
        default=argparse.SUPPRESS,
        metavar="NAME=VALUE",
        help="eviction policy parameter (repeatable); env KVOFFLOAD_POLICY_PARAMS (JSON). "
        + _PARAMS_ACCEPTED,
    )
    _brief(
        action,
        "eviction policy parameter (repeatable; --help-all: each policy's)",
        "--policy-param NAME=VALUE",
    )


def _add_serve_flag(group: argparse._ActionsContainer, name: str) -> None:
    """The flag of setting ``name`` (if it has one) in ``group``."""
    flag = flag_name(name)
    if flag is None or name == "policy_params":
        return
    if _is_switch(name):
        action = group.add_argument(
            flag,
            dest=name,
            action=_Switch,
            default=argparse.SUPPRESS,
            metavar="BOOL",
            help=f"{_flag_help(name)}; {flag} alone: on, --no-{flag[2:]}: off",
        )
        _brief(action, _flag_brief(name), f"--[no-]{flag[2:]}")
        return
    action = group.add_argument(
        flag,
        dest=name,
        default=argparse.SUPPRESS,
        metavar=name.upper(),
        help=_flag_help(name),
    )
    _brief(action, _flag_brief(name), f"{flag} {_short_metavar(name)}")


class _Parser(argparse.ArgumentParser):
    """``argparse`` that answers an unknown option with the closest known one."""

    def error(self, message: str) -> NoReturn:
        unknown = message.partition("unrecognized arguments: ")[2].split()
        known = sorted({s for _, p in commands(self) for a in p._actions for s in a.option_strings})
        for word in unknown:
            close = difflib.get_close_matches(word.partition("=")[0], known, n=1, cutoff=0.6)
            if word.startswith("--") and close:
                message += f" (did you mean {close[0]}?)"
                break
        super().error(message)


def commands(
    parser: argparse.ArgumentParser, path: str = "kvoffload"
) -> list[tuple[str, argparse.ArgumentParser]]:
    """``parser`` as ``path``, and every subcommand's parser below it, each with its path
    (``kvoffload admin policy set``), depth first."""
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += commands(sub, f"{path} {name}")
    return found


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvoffload",
        description="KV-cache offloading service for LLM inference engines.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"kvoffload {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    # No abbreviations: "--admin-token" must not silently mean "--admin-token-file".
    serve = sub.add_parser(
        "serve",
        help="run the service (CPU pool on loopback by default)",
        allow_abbrev=False,
        usage="kvoffload serve [--config FILE] [OPTION ...]",
        description="The common options, then the others by group, one line each (--help-all: "
        "their whole text). Each also reads the variable KVOFFLOAD_<NAME> and the --config "
        "file's key <name>. A SIZE is bytes, or a number with a unit: K, M, G, T (powers of "
        "1000) or Ki, Mi, Gi, Ti (powers of 1024), B optional: 100M, 64KiB, 200GiB.",
        formatter_class=_OneLine,
    )
    _brief(serve._actions[0], "this help: an option a line, cut to the terminal's width")
    help_all = serve.add_argument(
        "--help-all", action=_HelpAll, help="every option's whole text (as docs/cli.md), and exit"
    )
    _brief(help_all, "every option's whole text, and exit")
    _add_serve_flags(serve)

    replay.add_parser(sub)

    admin = sub.add_parser(
        "admin",
        help="talk to a running service's admin API",
        description="Talk to a running service's admin API. The token comes from where the "
        "service reads it: --admin-token-file, else KVOFFLOAD_ADMIN_TOKEN or "
        "KVOFFLOAD_ADMIN_TOKEN_FILE, else the admin_token or admin_token_file key of the "
        "KVOFFLOAD_CONFIG file. Answers are printed as a table when stdout is a terminal and "
        "as JSON otherwise (pipes, files); --json and --table choose.",
        allow_abbrev=False,
    )
    admin.add_argument(
        "--url",
        default=os.environ.get("KVOFFLOAD_ADMIN_URL", "http://127.0.0.1:8001"),
        help="admin API base URL (env KVOFFLOAD_ADMIN_URL)",
    )
    admin.add_argument(
        "--admin-token-file",
        "--token-file",
        dest="token_file",
        type=Path,
        metavar="PATH",
        help="file holding the admin token (wins over KVOFFLOAD_ADMIN_TOKEN[_FILE])",
    )
    admin.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    admin.add_argument(
        "--namespace",
        help="the namespace to act on (required when the service has tenants; env "
        "KVOFFLOAD_ADMIN_NAMESPACE)",
        default=os.environ.get("KVOFFLOAD_ADMIN_NAMESPACE"),
    )
    output = admin.add_mutually_exclusive_group()
    output.add_argument(
        "--json", dest="output", action="store_const", const="json", help="print JSON"
    )
    output.add_argument(
        "--table", dest="output", action="store_const", const="table", help="print a table"
    )
    what = admin.add_subparsers(dest="admin_command", required=True)
    policy = what.add_parser("policy", help="get or set the eviction policy")
    policy_cmd = policy.add_subparsers(dest="policy_command", required=True)
    policy_cmd.add_parser("get", help="the active policy")
    set_policy = policy_cmd.add_parser("set", help="switch the policy live")
    set_policy.add_argument("name", help="policy name (e.g. lru, arc)")
    set_policy.add_argument(
        "--param",
        action="append",
        type=parse_param,
        default=[],
        metavar="NAME=VALUE",
        help="policy parameter (repeatable; VALUE is JSON when it parses, else a string). "
        + _PARAMS_ACCEPTED,
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
    clear = what.add_parser("clear", help="drop every block not pinned, retained or pending")
    clear.add_argument(
        "--yes", action="store_true", help="do not ask (needed where no terminal can answer)"
    )
    retentions = what.add_parser("retentions", help="list or release the namespace's retentions")
    retention_cmd = retentions.add_subparsers(dest="retentions_command", required=True)
    retention_cmd.add_parser("list", help="live retentions, retained blocks and their bound")
    release_retention = retention_cmd.add_parser(
        "release", help="end a retention now (audited): its blocks are evictable again"
    )
    release_retention.add_argument("name", help="retention name")
    what.add_parser("tenants", help="every tenant: quotas, use, namespaces")
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    """``Settings`` from the parsed ``serve`` flags (then env, config file, defaults);
    ``ConfigError`` when the service cannot start with them."""
    overrides = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    if "policy_params" in overrides:
        overrides["policy_params"] = dict(overrides["policy_params"])
    return load_settings(**overrides)


def _refuse(exc: ConfigError) -> int:
    print(f"kvoffload: {exc}", file=sys.stderr)
    return 2


def _serve(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        return _refuse(exc)

    from app.server import TransferBackendFailed, run
    from app.telemetry.logging import configure_logging, flush_logs, get_logger

    configure_logging(settings.log_level, fmt=settings.log_format)
    for name, meant in unknown_variables():
        # A typo (KVOFFLOAD_NUM_BLOCK) would leave its setting at the default without a word.
        get_logger("cli").warning(
            "unknown variable ignored",
            extra={"fields": {"variable": name, "did_you_mean": meant}},
        )
    if settings.remote_tier == "mooncake":
        # Mooncake's glog writes to descriptor 2: its lines become JSON records too.
        from app.telemetry.native_stderr import capture

        capture()
    status = 1  # also for a BaseException (a second ^C) on its way out
    try:
        run(settings)
        status = 0
    except ConfigError as exc:
        flush_logs()
        status = _refuse(exc)
    except OSError as exc:
        get_logger("cli").error("cannot start", extra={"fields": {"error": str(exc)}})
    except TransferBackendFailed as exc:
        get_logger("cli").error(
            "transfer backend failed for good; exiting for a restart",
            extra={"fields": {"reason": str(exc)}},
        )
        status = EXIT_BACKEND_FAILED
    except Exception as exc:
        get_logger("cli").error("service failed", exc_info=exc)
    finally:
        flush_logs()
        if _cuda_poisoned():
            # Whatever the way out: not through the interpreter's clean-up, which would free
            # the CUDA IPC mappings kept since the context was lost (torch aborts freeing them).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status or EXIT_BACKEND_FAILED)
    return status


def _cuda_poisoned() -> bool:
    """Whether a CUDA worker of this process saw a sticky error (never imports CUDA code)."""
    worker = sys.modules.get("transfer.cuda_worker")
    return worker is not None and bool(worker.poisoned())


def _admin_token(args: argparse.Namespace) -> str | None:
    """The token from the service's own sources; ``--admin-token-file`` wins over them all."""
    overrides: dict[str, Any] = {}
    if args.token_file is not None:
        overrides = {"admin_token_file": args.token_file, "admin_token": None}
    return load_or_refuse(AdminAuth, **overrides).admin_token_value()


def _admin(args: argparse.Namespace) -> int:
    import httpx
    from kvoffload_client.client import KVOffloadAdminClient, KVOffloadError

    try:
        token = _admin_token(args)
    except ConfigError as exc:
        return _refuse(exc)
    calls: dict[str, Callable[[KVOffloadAdminClient], Any]] = {
        "stats": lambda c: c.stats(),
        "requests": lambda c: c.requests(),
        "release": lambda c: c.release(args.req_id),
        "clear": lambda c: c.clear_cache(),
        "tenants": lambda c: c.tenants(),
    }
    call: Callable[[KVOffloadAdminClient], Any]
    if args.admin_command == "policy":
        if args.policy_command == "get":
            call = lambda c: c.policy()  # noqa: E731
        elif args.policy_command == "shadow":
            call = lambda c: c.shadow()  # noqa: E731
        else:
            # Any case and the literature's names (ARC, S3-FIFO), as serve --policy; an unknown
            # one goes as written, for the service's refusal (and its did-you-mean).
            with contextlib.suppress(UnknownPolicyError):
                args.name = canonical_policy_name(args.name)
            call = lambda c: c.set_policy(  # noqa: E731
                args.name, dict(args.param), if_match=args.if_match
            )
    elif args.admin_command == "retentions":
        if args.retentions_command == "list":
            call = lambda c: c.retentions()  # noqa: E731
        else:
            call = lambda c: c.release_retention(args.name)  # noqa: E731
    elif args.admin_command == "log-level":
        if args.level_command == "get":
            call = lambda c: c.log_level()  # noqa: E731
        else:
            call = lambda c: c.set_log_level(args.level)  # noqa: E731
    else:
        call = calls[args.admin_command]
    if args.admin_command == "clear" and not args.yes and not _confirmed(args):
        return 2
    try:
        with KVOffloadAdminClient(
            args.url, token=token, timeout=args.timeout, namespace=args.namespace
        ) as client:
            answer = call(client)
    except KVOffloadError as exc:
        message = exc.message
        # The service's message names the bound; list what the policy accepts where it did not.
        if exc.code == "invalid_policy_params" and "accepted" not in message:
            with contextlib.suppress(UnknownPolicyError):
                name = canonical_policy_name(args.name)
                message += f"; accepted for {name}: {policy_params_accepted(name)}"
        print(f"kvoffload: {exc.status} {exc.code}: {message}{_hint(exc)}", file=sys.stderr)
        return 1
    except (OSError, httpx.HTTPError) as exc:
        print(f"kvoffload: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    output = args.output or ("table" if sys.stdout.isatty() else "json")
    if output == "json":
        print(json.dumps(answer, indent=2, default=str))
    else:
        print(render_table(answer))
    return 0


def _confirmed(args: argparse.Namespace) -> bool:
    """Whether the operator confirms ``admin clear`` at the terminal (it cannot be undone);
    where no terminal can answer, the refusal says to pass ``--yes``."""
    where = f"namespace {args.namespace!r}" if args.namespace else "the service's namespace"
    question = f"drop every block of {where} not pinned, retained or pending?"
    if not sys.stdin.isatty():
        print(f"kvoffload: admin clear would {question[0].lower()}{question[1:-1]}; "
              "pass --yes to do it", file=sys.stderr)  # fmt: skip
        return False
    answer = input(f"{question[0].upper()}{question[1:]} [y/N] ").strip().lower()
    if answer not in ("y", "yes"):
        print("kvoffload: nothing cleared", file=sys.stderr)
        return False
    return True


def _hint(exc: Any) -> str:
    """What to do about an admin refusal the CLI can help with (none for the others)."""
    if exc.status in (401, 403) and exc.code in ("unauthorized", "forbidden"):
        return (
            "; give the service's admin token: --admin-token-file PATH (or "
            "KVOFFLOAD_ADMIN_TOKEN / KVOFFLOAD_ADMIN_TOKEN_FILE)"
        )
    if exc.code == "invalid_field" and "namespace: required" in exc.message:
        return "; name one with --namespace NAME (or KVOFFLOAD_ADMIN_NAMESPACE)"
    return ""


# --------------------------------------------------------------------------- tables


def render_table(answer: Any) -> str:
    """An admin answer for a terminal: its scalar fields as aligned ``name  value`` rows (nested
    objects flattened to ``a.b``), each list of objects below as a table of its own."""
    if isinstance(answer, list):
        return _grid(answer)
    if not isinstance(answer, dict):
        return _cell(answer)
    rows: list[tuple[str, str]] = []
    tables: list[tuple[str, list[Any]]] = []
    _flatten("", answer, rows, tables)
    parts = []
    if rows:
        width = max(len(name) for name, _ in rows)
        parts.append("\n".join(f"{name.ljust(width)}  {value}" for name, value in rows))
    for name, items in tables:
        parts.append(f"{name}:\n{_grid(items)}" if items else f"{name}: (none)")
    return "\n\n".join(parts)


def _flatten(
    prefix: str,
    obj: dict[str, Any],
    rows: list[tuple[str, str]],
    tables: list[tuple[str, list[Any]]],
) -> None:
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            _flatten(f"{name}.", value, rows, tables)
        elif isinstance(value, list) and any(isinstance(v, dict) for v in value):
            tables.append((name, value))
        else:
            rows.append((name, _cell(value)))


def _grid(items: list[Any]) -> str:
    if not items:
        return "(none)"
    columns: list[str] = []
    for item in items:
        for key in item if isinstance(item, dict) else ("value",):
            if key not in columns:
                columns.append(key)
    cells = [
        [_cell(item.get(c) if isinstance(item, dict) else item) for c in columns] for item in items
    ]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines += [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e6 else f"{value:.0f}"
    if isinstance(value, dict | list):
        if isinstance(value, list) and all(not isinstance(v, dict | list) for v in value):
            return ", ".join(_cell(v) for v in value) or "-"
        return json.dumps(value, separators=(", ", ": "), default=str)
    return str(value)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvoffload`` console script; returns the exit status.

    A reader that closes stdout early (``kvoffload admin requests | head``) ends the command
    quietly with ``EXIT_BROKEN_PIPE``, as it ends a Unix tool, instead of a traceback.
    """
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            status = _serve(args)
        elif args.command == "admin":
            status = _admin(args)
        elif args.command == "replay":
            status = replay.run(args)
        else:
            status = 2
        sys.stdout.flush()
    except BrokenPipeError:
        # Python would flush stdout again at exit, fail again and print a warning: point it
        # at /dev/null first.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    return status


if __name__ == "__main__":
    sys.exit(main())
