#!/usr/bin/env bash
# Push the images tools/image/build.sh built (make image) to a registry, under the names the
# chart and the examples use:
#   <registry>/dcr:<version>        from localhost/dcr:<version>
#   <registry>/dcr-serve:<version>  from localhost/dcr-serve:<version>
# e.g. `tools/image/push.sh ghcr.io/dcr-dev` gives the chart's default image.repository.
#
# Usage: tools/image/push.sh REGISTRY [ROLE ...]   (roles: dcr, serve; default both)
# Credentials come from podman's auth file (REGISTRY_AUTH_FILE, else the one `podman login`
# wrote), never from the command line. A registry whose certificate a private CA signed:
# DCR_PUSH_CERT_DIR names a directory holding that CA's ca.crt (podman's --cert-dir).
# Stdout, one line per image and nothing else:  pushed <role> <ref> <digest>
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
readonly HERE ROOT PYTHON="${PYTHON:-python3}"
declare -rA IMAGE_NAME=([dcr]=dcr [serve]=dcr-serve)

die() { echo "push.sh: $*" >&2; exit 1; }

main() {
    (($# >= 1)) || die "usage: $0 REGISTRY [ROLE ...] (see its header)"
    local registry="${1%/}" roles=("${@:2}")
    ((${#roles[@]})) || roles=(dcr serve)
    [[ "$registry" =~ ^[A-Za-z0-9.-]+(:[0-9]+)?(/[a-z0-9._/-]+)?$ ]] ||
        die "'$registry' is not a registry host[:port][/path]"
    command -v podman >/dev/null || die "'podman' is not installed (make image needs it too)"
    local version role source ref
    version="$("$PYTHON" -c 'import sys, tomllib
print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$ROOT/pyproject.toml")"
    local tls=()
    [[ -z "${DCR_PUSH_CERT_DIR:-}" ]] || tls=(--cert-dir "$DCR_PUSH_CERT_DIR")
    DIGEST_FILE="$(mktemp)"
    trap 'rm -f "$DIGEST_FILE"' EXIT
    for role in "${roles[@]}"; do
        [[ -n "${IMAGE_NAME[$role]:-}" ]] || die "unknown role '$role' (known: dcr serve)"
        source="localhost/${IMAGE_NAME[$role]}:$version"
        ref="$registry/${IMAGE_NAME[$role]}:$version"
        podman image exists "$source" || die "no image $source: run make image first"
        echo "push.sh: pushing $source to $ref" >&2
        podman push --quiet "${tls[@]}" --digestfile "$DIGEST_FILE" "$source" "docker://$ref" >&2 ||
            die "podman push of $source to $ref failed (its output is above)"
        echo "pushed $role $ref $(cat "$DIGEST_FILE")"
    done
}

main "$@"
