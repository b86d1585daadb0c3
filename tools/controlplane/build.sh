#!/usr/bin/env bash
# Build (or reuse) the Kubernetes binaries the tests run, all from the Go module proxy:
# the control plane on loopback (etcd, kube-apiserver, kube-controller-manager, helm) and, for
# the deploy tier's one-node cluster, the node and client side (kubelet, kube-scheduler,
# kube-proxy, kubectl, and coredns for cluster DNS); versitygw, the S3 gateway whose bucket
# policies give receivers a read-only key; for the chart's monitoring, promtool (tests the
# alert rules) and prometheus-operator's CRDs (monitoring-crds: a directory of the
# ServiceMonitor, PodMonitor and PrometheusRule CRDs); LeaderWorkerSet's CRD (lws-crds),
# which the multi-node rollout example is checked against; the image registry
# (registry, from distribution) the deploy tier's node pulls from; and toxiproxy, the TCP
# fault-injecting proxy the fault campaign (bench/faults.py) puts in front of the S3 store.
#
# Binaries land outside the repository, one directory per component and version:
#   ${DCR_INFRA_CACHE:-$HOME/.cache/dcr-infra}/<component>-<version>/<component>
# A binary that exists and answers --version is reused. How long a cold and a warm run take:
# DEVELOPMENT.md (the k8s tier).
#
# Usage: tools/controlplane/build.sh [component ...]   (default: the control plane's four;
#        `node` names the node's five, `monitoring` promtool and monitoring-crds, `all` all
#        fifteen)
# Prints one line per component: "built|reused <component> <version> <path> ...".
set -euo pipefail

readonly KUBE_VERSION=v1.37.2   # k8s.io/kubernetes; staging modules pinned to v0.37.2 in kube/go.mod
readonly ETCD_VERSION=v3.5.35   # go.etcd.io/etcd/server/v3; pinned in etcd/go.mod
readonly HELM_VERSION=v3.22.0   # helm.sh/helm/v3
readonly VERSITYGW_VERSION=v1.8.0  # github.com/versity/versitygw
readonly PROMETHEUS_VERSION=v0.316.0  # github.com/prometheus/prometheus (cmd/promtool)
# github.com/prometheus-operator/prometheus-operator: its example/prometheus-operator-crd
readonly PROMETHEUS_OPERATOR_VERSION=v0.85.0
readonly MONITORING_CRDS=(servicemonitors podmonitors prometheusrules)
readonly LWS_VERSION=v0.8.0  # sigs.k8s.io/lws: its config/crd/bases
readonly REGISTRY_VERSION=v3.0.0  # github.com/distribution/distribution/v3 (cmd/registry)
readonly COREDNS_VERSION=v1.13.1  # github.com/coredns/coredns: the node's cluster DNS
readonly TOXIPROXY_VERSION=v2.5.0  # github.com/Shopify/toxiproxy/v2 (cmd/server)
readonly LWS_CRD=leaderworkerset.x-k8s.io_leaderworkersets.yaml

readonly HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly CACHE="${DCR_INFRA_CACHE:-$HOME/.cache/dcr-infra}"
readonly CONTROL_PLANE=(etcd kube-apiserver kube-controller-manager helm)
readonly NODE=(kubelet kube-scheduler kube-proxy kubectl coredns)
readonly MONITORING=(promtool monitoring-crds)
readonly ALL_COMPONENTS=("${CONTROL_PLANE[@]}" "${NODE[@]}" versitygw "${MONITORING[@]}" lws-crds registry
    toxiproxy)

GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"
# Never fetch a different Go toolchain behind our back; static binaries, no cgo.
export GOTOOLCHAIN=local CGO_ENABLED=0 GOWORK=off

die() { echo "build.sh: $*" >&2; exit 1; }

# The wrapper go.mod must pin what this script says it builds (go mod tidy may mark it indirect).
check_pin() {
    local gomod="$1" module="$2" version="$3"
    grep -Eq "^[[:space:]]*(require )?${module//./\\.} ${version//./\\.}( //.*)?\$" "$gomod" ||
        die "$gomod does not require $module $version; update the pin in one place and the other"
}

version_of() {
    case "$1" in
        etcd) echo "$ETCD_VERSION" ;;
        kube-apiserver | kube-controller-manager | kubelet | kube-scheduler | kube-proxy | kubectl)
            echo "$KUBE_VERSION" ;;
        helm) echo "$HELM_VERSION" ;;
        versitygw) echo "$VERSITYGW_VERSION" ;;
        promtool) echo "$PROMETHEUS_VERSION" ;;
        monitoring-crds) echo "$PROMETHEUS_OPERATOR_VERSION" ;;
        lws-crds) echo "$LWS_VERSION" ;;
        registry) echo "$REGISTRY_VERSION" ;;
        coredns) echo "$COREDNS_VERSION" ;;
        toxiproxy) echo "$TOXIPROXY_VERSION" ;;
        *) die "unknown component '$1' (known: ${ALL_COMPONENTS[*]})" ;;
    esac
}

bin_path() { echo "$CACHE/$1-$(version_of "$1")/$1"; }

# A cached binary counts only if it runs; a half-written or foreign one is rebuilt.
usable() {
    local bin="$1" component="$2"
    local crd
    case "$component" in
        monitoring-crds)  # a directory of YAML files, not a binary
            for crd in "${MONITORING_CRDS[@]}"; do
                [[ -s "$bin/monitoring.coreos.com_$crd.yaml" ]] || return 1
            done
            return 0 ;;
        lws-crds) [[ -s "$bin/$LWS_CRD" ]]; return ;;
    esac
    [[ -x "$bin" ]] || return 1
    case "$component" in
        helm) "$bin" version --short >/dev/null 2>&1 ;;
        kubectl) "$bin" version --client >/dev/null 2>&1 ;;
        *) "$bin" --version >/dev/null 2>&1 ;;
    esac
}

kube_ldflags() {
    local minor="${KUBE_VERSION#v1.}"
    minor="${minor%%.*}"
    local flags="-s -w" key val pkg
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        for key in gitVersion=$KUBE_VERSION gitMajor=1 gitMinor=$minor gitTreeState=clean \
            buildDate=1970-01-01T00:00:00Z; do
            val="${key#*=}"
            flags+=" -X $pkg.${key%%=*}=$val"
        done
    done
    echo "$flags"
}

helm_ldflags() {
    # Helm's Makefile stamps its version and the Kubernetes version its client-go speaks
    # (`helm template` reports it as .Capabilities.KubeVersion); go install alone would not.
    local dir client_go major minor
    dir="$(cd "$CACHE" && "$GO" mod download -json "helm.sh/helm/v3@$HELM_VERSION" |
        sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
    [[ -n "$dir" ]] || die "could not download helm.sh/helm/v3@$HELM_VERSION"
    client_go="$(awk '$1 == "k8s.io/client-go" {print $2; exit}' "$dir/go.mod")"
    [[ "$client_go" =~ ^v0\.([0-9]+)\. ]] || die "helm $HELM_VERSION: no k8s.io/client-go v0.Y.Z in go.mod"
    major=1
    minor="${BASH_REMATCH[1]}"
    echo "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
        "-X helm.sh/helm/v3/internal/version.gitTreeState=clean" \
        "-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=$major" \
        "-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$minor" \
        "-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=$major" \
        "-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$minor"
}

# `go install pkg@version` builds outside any module, with the tool's own go.mod.
go_install() {
    local pkg="$1" ldflags="$2" out="$3" gobin
    gobin="$(dirname "$out")/gobin.$$"
    (cd "$CACHE" && GOBIN="$gobin" nice -n 10 "$GO" install -trimpath -ldflags="$ldflags" \
        "$pkg") || return
    mv -f "$gobin/$(basename "${pkg%@*}")" "$out" && rmdir "$gobin"
}

# go build writes to a temporary name in the target directory, then renames: a reader never
# sees a partial binary, and an interrupted build leaves nothing that passes `usable`.
# (Called as `build_one ... || die`, where bash ignores set -e: every step checks itself.)
build_one() {
    local component="$1" out="$2" tmp="$2.tmp.$$"
    case "$component" in
        etcd)
            check_pin "$HERE/etcd/go.mod" go.etcd.io/etcd/server/v3 "$ETCD_VERSION" || return
            (cd "$HERE/etcd" && nice -n 10 "$GO" build -mod=readonly -trimpath -ldflags="-s -w" \
                -o "$tmp" go.etcd.io/etcd/server/v3) || return
            ;;
        kube-apiserver | kube-controller-manager | kubelet | kube-scheduler | kube-proxy | kubectl)
            check_pin "$HERE/kube/go.mod" k8s.io/kubernetes "$KUBE_VERSION" || return
            (cd "$HERE/kube" && nice -n 10 "$GO" build -mod=readonly -trimpath \
                -ldflags="$(kube_ldflags)" -o "$tmp" "k8s.io/kubernetes/cmd/$component") || return
            ;;
        helm)
            local ldflags
            ldflags="$(helm_ldflags)" || return
            go_install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" "$ldflags" "$tmp" || return
            ;;
        versitygw)
            go_install "github.com/versity/versitygw/cmd/versitygw@$VERSITYGW_VERSION" \
                "-s -w" "$tmp" || return
            ;;
        coredns)
            go_install "github.com/coredns/coredns@$COREDNS_VERSION" "-s -w" "$tmp" || return
            ;;
        toxiproxy)
            go_install "github.com/Shopify/toxiproxy/v2/cmd/server@$TOXIPROXY_VERSION" "-s -w" \
                "$tmp" || return
            ;;
        registry)
            go_install "github.com/distribution/distribution/v3/cmd/registry@$REGISTRY_VERSION" \
                "-s -w" "$tmp" || return
            ;;
        promtool)
            go_install "github.com/prometheus/prometheus/cmd/promtool@$PROMETHEUS_VERSION" \
                "-s -w" "$tmp" || return
            ;;
        monitoring-crds)
            local dir crd
            dir="$(cd "$CACHE" && "$GO" mod download -json \
                "github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR_VERSION" |
                sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
            [[ -n "$dir" ]] || return 1
            mkdir -p "$tmp" || return
            for crd in "${MONITORING_CRDS[@]}"; do
                cp "$dir/example/prometheus-operator-crd/monitoring.coreos.com_$crd.yaml" \
                    "$tmp/" || return
            done
            rm -rf "$out" || return  # a directory: mv would move tmp into a stale one
            ;;
        lws-crds)
            local dir
            dir="$(cd "$CACHE" && "$GO" mod download -json "sigs.k8s.io/lws@$LWS_VERSION" |
                sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
            [[ -n "$dir" ]] || return 1
            mkdir -p "$tmp" && cp "$dir/config/crd/bases/$LWS_CRD" "$tmp/" || return
            rm -rf "$out" || return
            ;;
    esac
    mv -f "$tmp" "$out"
}

main() {
    local components=() arg
    for arg in "${@:-control-plane}"; do
        case "$arg" in
            control-plane) components+=("${CONTROL_PLANE[@]}") ;;
            node) components+=("${NODE[@]}") ;;
            monitoring) components+=("${MONITORING[@]}") ;;
            all) components+=("${ALL_COMPONENTS[@]}") ;;
            *) components+=("$arg") ;;
        esac
    done
    local component bin missing=()
    for component in "${components[@]}"; do
        version_of "$component" >/dev/null # dies here, in this shell, on an unknown name
    done
    for component in "${components[@]}"; do
        bin="$(bin_path "$component")"
        if usable "$bin" "$component"; then
            echo "reused $component $(version_of "$component") $bin"
        else
            missing+=("$component")
        fi
    done
    [[ ${#missing[@]} -gt 0 ]] || return 0

    [[ -x "$GO" ]] || die "no Go toolchain (looked for 'go' on PATH and /usr/local/go/bin/go)"
    mkdir -p "$CACHE"
    # One builder at a time (two pytest sessions may start together); the loser reuses.
    exec 9>"$CACHE/.build.lock"
    flock 9
    local start
    for component in "${missing[@]}"; do
        bin="$(bin_path "$component")"
        if usable "$bin" "$component"; then
            echo "reused $component $(version_of "$component") $bin"
            continue
        fi
        mkdir -p "$(dirname "$bin")"
        # A cold build takes minutes per component: say so on stderr (stdout is parsed).
        echo "build.sh: building $component $(version_of "$component") (cold: several minutes on 2 cores)..." >&2
        start=$SECONDS
        build_one "$component" "$bin" || die "building $component $(version_of "$component") failed"
        usable "$bin" "$component" || die "built $bin but it does not run with --version"
        echo "built $component $(version_of "$component") $bin in $((SECONDS - start)) s" \
            "($(du -h "$bin" | cut -f1))"
    done
}

main "$@"
