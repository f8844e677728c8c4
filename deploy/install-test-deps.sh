#!/bin/sh
# Install the system packages the deploy tests use: `docker-compose` (validates
# deploy/compose.yaml without a daemon), Slurm (slurmctld, slurmd, munge) for the sbatch
# scripts, iproute2 and util-linux (`ip netns`, `unshare`, `nsenter`: the two-node Slurm test's
# network namespaces), debootstrap (the slow image tests build their Debian base with it) and,
# where no `docker` is installed yet, Debian's Docker engine (docker.io; a docker-ce already
# there is kept). Debian/Ubuntu, as root; safe to run again (installed: no-op).
set -eu
if [ "$(id -u)" -ne 0 ]; then
    echo "install-test-deps.sh: run as root (apt-get installs system packages)" >&2
    exit 1
fi
packages="docker-compose slurm-wlm munge debootstrap iproute2 util-linux"
command -v docker >/dev/null 2>&1 || packages="$packages docker.io"
missing=""
for p in $packages; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -z "$missing" ]; then
    echo "install-test-deps.sh: already installed: $packages"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# --no-install-recommends: slurm-wlm recommends a mail server and docs the tests never use
apt-get install -y -q --no-install-recommends $missing
echo "install-test-deps.sh: installed:$missing"
