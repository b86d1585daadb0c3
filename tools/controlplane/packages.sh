#!/usr/bin/env bash
# The Debian packages the deploy tier needs: a node (containerd, runc, the CNI plugins,
# iptables for kube-proxy) and the image build (mmdebstrap,
# podman, buildah, skopeo). Installs what is missing when run as root on Debian; otherwise
# says what is missing and exits 0, and the deploy tier skips with that reason.
#
# Usage: tools/controlplane/packages.sh        (make test runs it)
set -euo pipefail

readonly PACKAGES=(containerd runc containernetworking-plugins iptables
                   mmdebstrap podman buildah skopeo uidmap fuse-overlayfs conmon)

missing=()
for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" ||
        missing+=("$pkg")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
    echo "packages.sh: missing ${missing[*]} (not root or no apt-get): the deploy tier will skip" >&2
    exit 0
fi
echo "packages.sh: installing ${missing[*]} (about a minute)..." >&2
start=$SECONDS
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
echo "packages.sh: installed in $((SECONDS - start)) s" >&2
