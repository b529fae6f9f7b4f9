#!/usr/bin/env bash
# Build the Debian bookworm base image that CI's project image starts from.
#
# No image can be pulled on the CI machines, so the base is made from scratch:
# debootstrap (with its default mirror) writes a minimal bookworm root file
# system holding python3 and python3-venv, and `docker import` turns the tarball
# into an image. It takes a few minutes, so an existing image is reused.
#
# Usage: .ci/base-image.sh [TAG]     (default: $IPUSERVE_BASE_IMAGE or ipuserve-base:bookworm)
# Set IPUSERVE_BASE_REBUILD=1 to rebuild an image that already exists.
set -euo pipefail

readonly TAG="${1:-${IPUSERVE_BASE_IMAGE:-ipuserve-base:bookworm}}"
readonly SUITE="bookworm"
ROOTFS=""

log() {
    printf '[base-image %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2
}

cleanup() {
    if [[ -n "${ROOTFS}" && -d "${ROOTFS}" ]]; then
        rm -rf --one-file-system "${ROOTFS}" "${ROOTFS}.log"
    fi
}

image_exists() {
    docker image inspect "${TAG}" >/dev/null 2>&1
}

bootstrap_rootfs() {
    ROOTFS="$(mktemp -d "${TMPDIR:-/tmp}/ipuserve-rootfs.XXXXXX")"
    log "debootstrap ${SUITE} into ${ROOTFS} (log: ${ROOTFS}.log)"
    # debootstrap prints a line per package; keep them out of the CI log unless it fails.
    if ! debootstrap --variant=minbase --include=python3,python3-venv "${SUITE}" "${ROOTFS}" \
        >"${ROOTFS}.log" 2>&1; then
        tail -n 40 "${ROOTFS}.log" >&2
        log "debootstrap failed"
        return 1
    fi
    # The package cache and lists are not needed at run time; drop them to keep
    # the image small (the project is installed from a wheelhouse, not by apt).
    rm -rf "${ROOTFS}"/var/cache/apt/archives/*.deb "${ROOTFS}"/var/lib/apt/lists/*
}

import_rootfs() {
    log "docker import -> ${TAG}"
    tar --numeric-owner -C "${ROOTFS}" -c . | docker import \
        --change 'ENV LANG=C.UTF-8' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' \
        --message "debootstrap --variant=minbase --include=python3,python3-venv ${SUITE}" \
        - "${TAG}" >/dev/null
}

main() {
    if image_exists && [[ "${IPUSERVE_BASE_REBUILD:-0}" != "1" ]]; then
        log "reusing existing image ${TAG}"
        return 0
    fi
    local previous
    previous="$(docker image inspect --format '{{.Id}}' "${TAG}" 2>/dev/null || true)"
    trap cleanup EXIT
    bootstrap_rootfs
    import_rootfs
    if [[ -n "${previous}" ]]; then  # a rebuild: drop the image it replaced
        docker image rm "${previous}" >/dev/null 2>&1 || true
    fi
    log "built ${TAG}: $(docker image inspect --format '{{.Size}}' "${TAG}") bytes"
}

main "$@"
