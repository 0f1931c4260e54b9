#!/usr/bin/env bash
# Debian packages the launcher tests run against: sshd (the fake hosts), pdsh and OpenMPI
# (the alternative launchers), Slurm and munge (tests/support/slurm_testbed.py starts its own private
# daemons). Installs only what is missing; never starts a system sshd, slurmd, slurmctld or munged.
set -euo pipefail
need=()
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v pdsh >/dev/null 2>&1 || need+=(pdsh)
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
command -v slurmctld >/dev/null 2>&1 || need+=(slurmctld)
command -v slurmd >/dev/null 2>&1 || need+=(slurmd)
command -v srun >/dev/null 2>&1 || need+=(slurm-client)
command -v munged >/dev/null 2>&1 || need+=(munge)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_system_deps: not root or no apt-get; tests needing ${need[*]} will be skipped" >&2
    exit 0
fi
echo "install_system_deps: installing ${need[*]}"
# Keep the packages' maintainer scripts from starting sshd on 0.0.0.0:22, or slurmd/slurmctld/munged.
made_policy=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
fi
trap '[ $made_policy = 1 ] && rm -f /usr/sbin/policy-rc.d' EXIT
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
mkdir -p /run/sshd && chmod 755 /run/sshd
# Nor at the next boot: the packages enable their units. Only those installed just now.
for pkg in "${need[@]}"; do
    case "$pkg" in slurmd | slurmctld | munge)
        if command -v systemctl >/dev/null 2>&1; then systemctl disable --quiet "$pkg.service" || true; fi ;;
    esac
done
