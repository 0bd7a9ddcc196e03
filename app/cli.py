"""``kvoffload`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvoffload", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the service")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--num-blocks", type=int, default=4096)
    serve.add_argument("--policy", default="lru")
    serve.add_argument("--store-threshold", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvoffload`` console script; returns the exit status."""
    args = _build_parser().parse_args(argv)
    if args.command == "serve":
        import uvicorn

        from app.main import create_app
        from manager import create_manager

        mgr = create_manager(
            num_blocks=args.num_blocks, policy=args.policy, store_threshold=args.store_threshold
        )
        uvicorn.run(create_app(mgr), host=args.host, port=args.port, log_level="info")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
