#!/usr/bin/env bash
# Makes a Debian base image without a registry: debootstrap a minimal root file system from a
# Debian mirror, then `docker import` it. It carries what deploy/Dockerfile needs of its base, so
# the image builds from it with no network at all: Python 3 with venv (its Python version must
# be the wheelhouse's, see `make wheelhouse`), the libraries Mooncake's client loads even for
# TCP, and useradd.
#
#   deploy/tools/debian_base.sh [TAG]          # default kvoffload-base:bookworm
#
# Needs root (debootstrap), debootstrap and a running Docker engine. SUITE and MIRROR choose the
# release and the mirror (bookworm, http://deb.debian.org/debian). Nothing is left behind but
# the image.
set -euo pipefail

tag=${1:-kvoffload-base:bookworm}
suite=${SUITE:-bookworm}
mirror=${MIRROR:-http://deb.debian.org/debian}
packages=python3,python3-venv,libibverbs1,librdmacm1,libnuma1,libcurl4,passwd,ca-certificates

command -v debootstrap >/dev/null || { echo "debian_base: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "debian_base: debootstrap needs root" >&2; exit 2; }
docker info >/dev/null 2>&1 || { echo "debian_base: no Docker engine answers (is dockerd running?)" >&2; exit 2; }

rootfs=$(mktemp -d /tmp/kvoffload-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror" >"$rootfs.log" 2>&1 \
  || { tail -20 "$rootfs.log" >&2; rm -f "$rootfs.log"; echo "debian_base: debootstrap failed" >&2; exit 1; }
rm -f "$rootfs.log"
# What an image does not need: downloaded packages, package lists, documentation.
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
  "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*
# The image's apt uses the same mirror, for a Dockerfile step that installs more.
echo "deb $mirror $suite main" >"$rootfs/etc/apt/sources.list"
tar -C "$rootfs" --numeric-owner -c . \
  | docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'CMD ["/bin/bash"]' - "$tag" >/dev/null
echo "debian_base: $tag ($suite from $mirror, $(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}'))"
