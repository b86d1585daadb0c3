#!/usr/bin/env bash
# Push what a cluster takes from a registry, under the names the chart and the examples use:
#   <registry>/dcr:<version>           image, from localhost/dcr:<version>        (make image)
#   <registry>/dcr-serve:<version>     image, from localhost/dcr-serve:<version>  (make image)
#   <registry>/charts/dcr:<version>    the Helm chart as an OCI artifact (helm package, helm push)
#   <registry>/dcr-vllm:<version>, <registry>/dcr-vllm-cpu:<version>
#                                      the rollout engine images, only when named
# e.g. `tools/image/push.sh ghcr.io/dcr-dev` gives the chart's default image.repository, and
# `helm install dcr oci://ghcr.io/dcr-dev/charts/dcr --version <version>` installs the chart.
# <version> is pyproject.toml's; the chart's version and appVersion must be the same (a test
# holds them equal, and this script refuses to push a chart whose version is not).
#
# Usage: tools/image/push.sh REGISTRY [ROLE ...]
#   roles: dcr, serve, chart (the default: all three), vllm, vllm-cpu
# Credentials come from the auth file (REGISTRY_AUTH_FILE, else the one `podman login`
# wrote; helm reads the same file), never from the command line. A registry whose
# certificate a private CA signed: DCR_PUSH_CERT_DIR names a directory holding that CA's
# ca.crt (podman's --cert-dir, helm's --ca-file). HELM names the helm binary (default helm).
# Stdout, one line per image or chart and nothing else:  pushed <role> <ref> <digest>
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
readonly HERE ROOT PYTHON="${PYTHON:-python3}" HELM="${HELM:-helm}"
declare -rA IMAGE_NAME=([dcr]=dcr [serve]=dcr-serve [vllm]=dcr-vllm [vllm-cpu]=dcr-vllm-cpu)
readonly CHART_PATH=charts  # the chart's repository under the registry: not the images'

die() { echo "push.sh: $*" >&2; exit 1; }

# The version in pyproject.toml, and a top-level field of charts/dcr/Chart.yaml.
project_version() {
    "$PYTHON" -c 'import sys, tomllib
print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$ROOT/pyproject.toml"
}

chart_field() {
    "$PYTHON" -c 'import sys, yaml
print(yaml.safe_load(open(sys.argv[1]))[sys.argv[2]])' "$ROOT/charts/dcr/Chart.yaml" "$1"
}

push_image() {
    local registry="$1" version="$2" role="$3" source ref
    command -v podman >/dev/null || die "'podman' is not installed (make image needs it too)"
    source="localhost/${IMAGE_NAME[$role]}:$version"
    ref="$registry/${IMAGE_NAME[$role]}:$version"
    podman image exists "$source" || die "no image $source: run make image first"
    echo "push.sh: pushing $source to $ref" >&2
    podman push --quiet "${TLS[@]}" --digestfile "$SCRATCH/digest" "$source" "docker://$ref" >&2 ||
        die "podman push of $source to $ref failed (its output is above)"
    echo "pushed $role $ref $(cat "$SCRATCH/digest")"
}

push_chart() {
    local registry="$1" version="$2" field out digest
    command -v "$HELM" >/dev/null || die "'$HELM' is not installed (HELM names the helm binary)"
    for field in version appVersion; do
        [[ "$(chart_field "$field")" == "$version" ]] || die "charts/dcr/Chart.yaml's" \
            "$field is $(chart_field "$field"), not the project's version $version (pyproject.toml)"
    done
    "$HELM" package "$ROOT/charts/dcr" --destination "$SCRATCH" >&2 ||
        die "helm package of charts/dcr failed (its output is above)"
    local args=()
    [[ -z "${REGISTRY_AUTH_FILE:-}" ]] || args+=(--registry-config "$REGISTRY_AUTH_FILE")
    [[ -z "${DCR_PUSH_CERT_DIR:-}" ]] || args+=(--ca-file "$DCR_PUSH_CERT_DIR/ca.crt")
    echo "push.sh: pushing the chart to oci://$registry/$CHART_PATH" >&2
    out="$("$HELM" push "$SCRATCH/dcr-$version.tgz" "oci://$registry/$CHART_PATH" "${args[@]}" 2>&1)" ||
        die "helm push to oci://$registry/$CHART_PATH failed: $out"
    echo "$out" >&2
    digest="$(sed -n 's/^Digest: *//p' <<<"$out")"
    [[ "$digest" == sha256:* ]] || die "helm push named no digest: $out"
    echo "pushed chart oci://$registry/$CHART_PATH/dcr:$version $digest"
}

main() {
    (($# >= 1)) || die "usage: $0 REGISTRY [ROLE ...] (see its header)"
    local registry="${1%/}" roles=("${@:2}") role version
    ((${#roles[@]})) || roles=(dcr serve chart)
    [[ "$registry" =~ ^[A-Za-z0-9.-]+(:[0-9]+)?(/[a-z0-9._/-]+)?$ ]] ||
        die "'$registry' is not a registry host[:port][/path]"
    for role in "${roles[@]}"; do
        [[ "$role" == chart || -n "${IMAGE_NAME[$role]:-}" ]] ||
            die "unknown role '$role' (known: dcr serve chart vllm vllm-cpu)"
    done
    version="$(project_version)"
    TLS=()
    [[ -z "${DCR_PUSH_CERT_DIR:-}" ]] || TLS=(--cert-dir "$DCR_PUSH_CERT_DIR")
    SCRATCH="$(mktemp -d)"
    trap 'rm -rf "$SCRATCH"' EXIT
    for role in "${roles[@]}"; do
        if [[ "$role" == chart ]]; then
            push_chart "$registry" "$version"
        else
            push_image "$registry" "$version" "$role"
        fi
    done
}

main "$@"
