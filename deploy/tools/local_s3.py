"""A local S3 endpoint with a bucket, for trying the object tier on one machine (``make
object-local``): a one-node Ceph cluster with its RADOS Gateway on 127.0.0.1, the one that
``make test-object`` runs the tier against (``testsupport/rgw.py``, so this works from a
checkout), plus the bucket and a credentials file.

It prints the ``kvoffload serve`` command that uses it, runs until Ctrl-C (SIGINT) or SIGTERM,
then stops the daemons and removes everything it made: objects included, the gateway keeps
them in the OSD's memory. Exit 0 after a clean stop; 1 when Ceph is missing (the line names the
Debian packages), the cluster fails to start or a daemon dies; 2 for a bad argument.

The S3 user's keys are the helper's fixed test keys (anyone on this machine who can reach
127.0.0.1 could use them anyway): they go to a credentials file of mode 0600 in a private
directory, never on a command line.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The cluster helper is test support (testsupport/, never installed): import it from this checkout.
sys.path.insert(0, str(ROOT))

from testsupport.rgw import (  # noqa: E402
    CephNotInstalled,
    RadosGateway,
    RgwError,
    install_hint,
    missing_binaries,
)

#: S3's bucket names (3-63 lowercase letters, digits, '.', '-'), the subset every store takes.
BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def private_dir() -> Path:
    """A new directory of mode 0700 under ``$XDG_RUNTIME_DIR``, else ``$TMPDIR``, else /tmp."""
    parent = os.environ.get("XDG_RUNTIME_DIR") or None  # None: tempfile's TMPDIR, /tmp
    return Path(tempfile.mkdtemp(prefix="kvoffload-s3.", dir=parent))


def write_credentials(path: Path, gateway: RadosGateway) -> None:
    """An AWS shared credentials file (profile ``default``) with the gateway user's keys,
    created with mode 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(
            "[default]\n"
            f"aws_access_key_id = {gateway.access_key}\n"
            f"aws_secret_access_key = {gateway.secret_key}\n"
        )


def serve_command(gateway: RadosGateway, bucket: str, credentials: Path) -> str:
    """The ``kvoffload serve`` command line for the object tier on ``gateway``."""
    return (
        f"AWS_SHARED_CREDENTIALS_FILE={credentials} kvoffload serve --tiers object \\\n"
        f"    --object-bucket {bucket} --object-endpoint {gateway.endpoint} "
        f"--object-region {gateway.region}"
    )


def main(argv: list[str] | None = None) -> int:
    """Parse, start, make the bucket, print, wait for a signal, tear down."""
    parser = argparse.ArgumentParser(
        prog="make object-local",
        description="A local S3 endpoint (one-node Ceph RGW on 127.0.0.1) with a bucket, for "
        "the object tier; runs until Ctrl-C, then removes everything.",
    )
    parser.add_argument(
        "--bucket", default="kv-cache", help="the bucket to make (default: kv-cache)"
    )
    parser.add_argument(
        "--store",
        choices=["memstore", "bluestore"],
        default="memstore",
        help="the OSD's store: memstore (objects in its memory; default) or bluestore (a sparse "
        "file in the directory)",
    )
    args = parser.parse_args(argv)
    if not BUCKET_NAME.fullmatch(args.bucket) or ".." in args.bucket:
        parser.error(
            f"--bucket {args.bucket!r}: accepted: 3 to 63 lowercase letters, digits, '.' "
            "and '-', starting and ending with a letter or digit"
        )
    missing = missing_binaries()
    if missing:
        print(f"object-local: {install_hint(missing)}", file=sys.stderr)
        return 1

    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    # Handlers, not a blocked signal mask: a mask would be inherited by the daemons.
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    home = private_dir()
    gateway = RadosGateway(home / "ceph", store=args.store)
    status = 0
    try:
        gateway.start()
        made, body = gateway.s3_request("PUT", f"/{args.bucket}")
        if made != 200:
            print(
                f"object-local: making bucket {args.bucket} answered {made}: "
                f"{body.decode(errors='replace')[:200]}",
                file=sys.stderr,
            )
            status = 1
        else:
            credentials = home / "credentials"
            write_credentials(credentials, gateway)
            print(
                f"object-local: S3 at {gateway.endpoint} (Ceph RGW, path-style), bucket "
                f"{args.bucket}, keys in {credentials}; Ctrl-C stops it and removes {home}.\n"
                "Serve with the object tier (in another shell; AWS_* keys set in that "
                "environment would win over the file):\n\n"
                f"{serve_command(gateway, args.bucket, credentials)}\n",
                flush=True,
            )
            while not stop.wait(1.0):
                crashed = gateway._crashed()
                if crashed:
                    print(f"object-local: daemons died: {crashed}", file=sys.stderr)
                    status = 1
                    break
    except (CephNotInstalled, RgwError) as exc:
        print(f"object-local: {exc}", file=sys.stderr)
        status = 1
    finally:
        try:
            gateway.close()
        except RgwError as exc:
            print(f"object-local: {exc}", file=sys.stderr)
            status = 1
        shutil.rmtree(home, ignore_errors=True)  # the credentials file; the cluster's is gone
    print("object-local: stopped", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
