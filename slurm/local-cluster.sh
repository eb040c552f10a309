#!/usr/bin/env bash
# A real SLURM cluster on this one machine, to try slurm/train.sbatch without a cluster: munge, slurmctld
# and one `slurmd -N nX` per emulated node, all on 127.0.0.1. (The tests start their own cluster, one
# slurmd per network-namespace host: tests/systems/test_slurm.py.)
#
#   sudo slurm/local-cluster.sh up       # or: make slurm-local-up    (NODES=2 CPUS=2)
#   sudo slurm/local-cluster.sh status
#   sudo slurm/local-cluster.sh down     # or: make slurm-local-down  (stops only what `up` started)
#
# Needs root and Debian's packages: apt-get install -y --no-install-recommends slurmctld slurmd
# slurm-client munge. Emulated nodes n1..nN share this host's name and address: they resolve to
# 127.0.0.1 (a line added to /etc/hosts), each slurmd listens on its own port (17001, 17002, ...).
# No cgroups needed: proctrack/linuxproc and task/none. The config goes to /etc/slurm/slurm.conf (a
# file this script did not write is never touched); state, spool and logs to $SLURM_LOCAL_STATE.
set -euo pipefail

NODES=${NODES:-2}
CPUS=${CPUS:-2}
STATE=${SLURM_LOCAL_STATE:-/var/lib/ddp-template-slurm}
CONF=/etc/slurm/slurm.conf
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MARK="# written by ddp-template slurm/local-cluster.sh"
HOSTS_MARK="# ddp-template slurm/local-cluster.sh"

die() { echo "local-cluster: error: $*" >&2; exit 1; }
say() { echo "local-cluster: $*" >&2; }

# Alive, not a zombie (stopped daemons stay zombies where PID 1 does not reap them).
alive() { local s; s=$(ps -o stat= -p "$1" 2>/dev/null) && [[ -n $s && $s != Z* ]]; }

node_names() { local i; for ((i = 1; i <= NODES; i++)); do echo "n$i"; done; }

# Every node listed and plain idle/mixed/allocated (idle* or down: not ready).
ready() {
    local out
    out=$(timeout 10 sinfo -N -h -o '%N %t' 2>/dev/null) || return 1
    [[ -n $out ]] || return 1
    ! grep -qvE ' (idle|mix|alloc)$' <<<"$out"
}

write_conf() {
    local host last
    host=$(hostname -s)
    last=$((17000 + NODES))
    mkdir -p /etc/slurm "$STATE"/{ctld,log}
    for n in $(node_names); do mkdir -p "$STATE/spool/$n"; done
    cat >"$CONF" <<EOF
$MARK (remove with: slurm/local-cluster.sh down)
ClusterName=ddplocal
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
StateSaveLocation=$STATE/ctld
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdPidFile=$STATE/slurmd.%n.pid
SlurmdSpoolDir=$STATE/spool/%n
SlurmdLogFile=$STATE/log/slurmd.%n.log
$(grep -v "^#" "$HERE/cluster.conf")
NodeName=n[1-$NODES] NodeHostname=$host NodeAddr=127.0.0.1 Port=[17001-$last] CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

add_hosts() {
    local missing=()
    for n in $(node_names); do getent hosts "$n" >/dev/null || missing+=("$n"); done
    ((${#missing[@]})) || return 0
    # Rewritten in place, not replaced: /etc/hosts is often a bind mount in containers.
    echo "127.0.0.1 ${missing[*]} $HOSTS_MARK" >>/etc/hosts
}

remove_hosts() {
    grep -q "$HOSTS_MARK" /etc/hosts 2>/dev/null || return 0
    local kept
    kept=$(grep -v "$HOSTS_MARK" /etc/hosts)
    printf '%s\n' "$kept" >/etc/hosts
}

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi
    [[ -s /etc/munge/munge.key ]] || { mkdir -p /etc/munge; dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; }
    chown munge:munge /etc/munge/munge.key 2>/dev/null || true
    chmod 0400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
    runuser -u munge -- /usr/sbin/munged
    local i
    for ((i = 0; i < 50; i++)); do
        if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
            cat /run/munge/munged.pid >"$STATE/munged.ours" 2>/dev/null || true
            return 0
        fi
        sleep 0.1
    done
    die "munged did not start (see /var/log/munge/munged.log)"
}

stop_pid() {  # TERM, then KILL after 5 s
    local pid=$1 i
    alive "$pid" || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do alive "$pid" || return 0; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
}

up() {
    [[ $(id -u) == 0 ]] || die "run as root (sudo $0 up): it starts munge and the SLURM daemons"
    for b in slurmctld slurmd sinfo sbatch munged; do
        command -v "$b" >/dev/null || die "$b not found: apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge"
    done
    if ready; then say "a cluster already answers (sinfo); nothing started"; sinfo; return 0; fi
    if [[ -e $CONF ]] && ! grep -qF "$MARK" "$CONF"; then
        die "$CONF exists and was not written by this script: not touching a real cluster's config"
    fi
    local t0=$SECONDS
    mkdir -p "$STATE"
    write_conf
    add_hosts
    start_munge
    if ! { [[ -s $STATE/slurmctld.pid ]] && alive "$(cat "$STATE/slurmctld.pid")"; }; then
        slurmctld -c -f "$CONF"  # fresh state: no jobs, no node states of an earlier run
    fi
    for n in $(node_names); do
        if ! { [[ -s $STATE/slurmd.$n.pid ]] && alive "$(cat "$STATE/slurmd.$n.pid")"; }; then
            slurmd -N "$n" -f "$CONF"
        fi
    done
    local i
    for ((i = 0; i < 600; i++)); do
        if ready; then
            say "up in $((SECONDS - t0)) s: $NODES nodes (n1..n$NODES on 127.0.0.1), state and logs in $STATE"
            sinfo -N
            return 0
        fi
        sleep 0.1
    done
    sinfo -N >&2 || true
    die "the nodes did not become idle in 60 s; see $STATE/log/"
}

down() {
    [[ $(id -u) == 0 ]] || die "run as root (sudo $0 down)"
    local f
    for f in "$STATE"/slurmd.*.pid "$STATE/slurmctld.pid"; do
        [[ -s $f ]] && stop_pid "$(cat "$f")"
        rm -f "$f"
    done
    if [[ -s $STATE/munged.ours ]]; then stop_pid "$(cat "$STATE/munged.ours")"; fi
    rm -f "$STATE/munged.ours"
    if [[ -e $CONF ]] && grep -qF "$MARK" "$CONF"; then rm -f "$CONF"; fi
    remove_hosts
    say "down (logs kept in $STATE/log)"
}

status() {
    if ready; then sinfo -N; squeue; else echo "local-cluster: no cluster answers" >&2; return 1; fi
}

case ${1:-} in
    up) up ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up|down|status   (env: NODES=$NODES CPUS=$CPUS SLURM_LOCAL_STATE=$STATE)" >&2; exit 2 ;;
esac
