#!/usr/bin/env bash
# A two-node Slurm cluster on this one machine, for tests and for trying the
# Slurm recipes of docs/clusters-and-slurm.md (Debian 12, Slurm 22.05; needs root).
#
#   scripts/test-cluster.sh up      build it; returns when sinfo shows both nodes idle
#   scripts/test-cluster.sh down    stop every daemon, remove every namespace, link and file
#   scripts/test-cluster.sh status  sinfo, or "down"
#   scripts/test-cluster.sh env     the line to source before sinfo/sbatch/srun/sacct:
#                                   eval "$(scripts/test-cluster.sh env)"
#   scripts/test-cluster.sh check   exit 0 if the packages below are in, else name them (no root needed)
#   scripts/test-cluster.sh install apt-get install them if any is missing (root, Debian)
#
# Layout: a bridge rtc-br0 (10.213.0.1/24, the controller's address) in this namespace;
# two network namespaces rtc-node1 (10.213.0.11) and rtc-node2 (10.213.0.12), each joined
# to the bridge by a veth pair, each running one slurmd under its own hostname. munged,
# MariaDB (socket only), slurmdbd and slurmctld run here under the hostname rtc-ctl. All
# traffic stays on the bridge and loopback. Every file lives under $RTC_STATE, except the
# tagged lines added to /etc/hosts and the socket folders /run/munge and /run/mysqld
# (removed by down when up made them).
# Needs: apt-get install -y slurm-wlm munge slurmdbd mariadb-server
set -euo pipefail

PACKAGES=(slurm-wlm munge slurmdbd mariadb-server)
# What up runs from them; the daemons are in sbin, which a user's PATH may lack.
TOOLS=(munged slurmctld slurmd slurmdbd mariadbd mariadb-install-db sinfo)
PATH=$PATH:/usr/sbin:/sbin

STATE=${RTC_STATE:-/run/runner-test-cluster}
SUBNET=10.213.0
BRIDGE=rtc-br0
CTL=rtc-ctl
NODES=(rtc-node1 rtc-node2)
TAG="# runner-test-cluster"
export SLURM_CONF=$STATE/slurm.conf  # never the machine's own config (or a DNS lookup for one)

say() { echo "test-cluster: $*" >&2; }
die() { say "$*"; exit 1; }

need_root() {
    [ "$(id -u)" = 0 ] || die "needs root (it creates network namespaces, a bridge and daemons): run it with sudo."
}

# check: say what is missing and how to install it; false if anything is.
check() {
    local missing=() tool
    for tool in "${TOOLS[@]}"; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    [ ${#missing[@]} -eq 0 ] || { say "missing ${missing[*]}: apt-get update && apt-get install -y ${PACKAGES[*]}"; return 1; }
}

need_packages() {
    check || exit 1
}

install_packages() {
    check 2>/dev/null && return 0
    need_root
    command -v apt-get >/dev/null || die "no apt-get here: install the equivalents of ${PACKAGES[*]} (Debian names)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${PACKAGES[@]}" >/dev/null
    check
}

node_ip() { echo "$SUBNET.$((11 + $1))"; }

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# wait_for SECONDS DESCRIPTION COMMAND...: poll once a second, at most SECONDS times.
wait_for() {
    local seconds=$1 what=$2
    shift 2
    for _ in $(seq "$seconds"); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 1
    done
    die "$what did not happen within ${seconds}s (logs in $STATE/log)"
}

# start NAME COMMAND...: run a daemon in the foreground of a new session, remember its PID.
start() {
    local name=$1
    shift
    alive "$STATE/pid/$name" && return 0
    setsid "$@" >>"$STATE/log/$name.out" 2>&1 </dev/null &
    echo $! >"$STATE/pid/$name"
}

# `"${AS_HOST[@]}" HOSTNAME COMMAND...`: a command under its own hostname (a new UTS namespace).
AS_HOST=(unshare --uts sh -c 'hostname "$1" && shift && exec "$@"' as-host)

write_configs() {
    mkdir -p "$STATE"/{pid,log,ctld,munge,mysql}
    local nodes="" i
    for i in "${!NODES[@]}"; do
        nodes+="NodeName=${NODES[$i]} NodeAddr=$(node_ip "$i") CPUs=$(nproc) State=UNKNOWN"$'\n'
    done
    cat >"$STATE/slurm.conf" <<EOF
# Written by scripts/test-cluster.sh; removed by its "down".
ClusterName=rtc
SlurmctldHost=$CTL($SUBNET.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire+1 s before it may start again (default 120).
AuthInfo=cred_expire=10
CredType=cred/munge
MpiDefault=none
# No cgroups here: plain process tracking, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
MailProg=/bin/true
StateSaveLocation=$STATE/ctld
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
# %n: one spool, pid file and log per slurmd.
SlurmdSpoolDir=$STATE/slurmd-%n
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Jobs may share a node's cores (two CPU jobs on one 2-core node in a sweep).
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$CTL
JobRequeue=1
KillWait=30
$nodes
EOF
    cat >"$STATE/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=$CTL
SlurmUser=root
PidFile=$STATE/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=rtc_acct_db
EOF
    chmod 600 "$STATE/slurmdbd.conf"
}

network_up() {
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge
        ip addr add "$SUBNET.1/24" dev "$BRIDGE"
    fi
    ip link set "$BRIDGE" up
    local i ns veth
    for i in "${!NODES[@]}"; do
        ns=${NODES[$i]} veth=rtc-v$((i + 1))
        [ -e "/run/netns/$ns" ] || ip netns add "$ns"
        if ! ip link show "$veth" >/dev/null 2>&1; then
            ip link add "$veth" type veth peer name eth0 netns "$ns"
            ip link set "$veth" master "$BRIDGE" up
            ip -n "$ns" addr add "$(node_ip "$i")/24" dev eth0
        fi
        ip -n "$ns" link set lo up
        ip -n "$ns" link set eth0 up
    done
    if ! grep -q "$TAG" /etc/hosts; then
        {
            echo "$SUBNET.1 $CTL $TAG"
            for i in "${!NODES[@]}"; do echo "$(node_ip "$i") ${NODES[$i]} $TAG"; done
        } >>/etc/hosts
    fi
}

munge_up() {
    # Slurm's clients (sacctmgr's link to slurmdbd too) use munge's default socket.
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0  # a munged already answers
    [ -d /run/munge ] || { mkdir -p /run/munge && touch "$STATE/made-run-munge"; }
    chown munge:munge /run/munge "$STATE/munge"
    chmod 755 /run/munge
    chmod 700 "$STATE/munge"
    [ -f "$STATE/munge/munge.key" ] || {
        dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
        chown munge:munge "$STATE/munge/munge.key"
        chmod 600 "$STATE/munge/munge.key"
    }
    runuser -u munge -- /usr/sbin/munged --key-file="$STATE/munge/munge.key" \
        --pid-file="$STATE/munge/munged.pid" --log-file="$STATE/munge/munged.log" \
        --seed-file="$STATE/munge/munged.seed"
    wait_for 20 "munged answering" sh -c 'munge -n | unmunge'
}

database_up() {
    if [ ! -d "$STATE/mysql/data/mysql" ]; then
        chown mysql:mysql "$STATE/mysql"
        mariadb-install-db --user=mysql --datadir="$STATE/mysql/data" --skip-test-db >"$STATE/log/mariadb-install.log" 2>&1
    fi
    # slurmdbd finds the server through the client's default socket, /run/mysqld.
    [ -d /run/mysqld ] || { mkdir -p /run/mysqld && touch "$STATE/made-run-mysqld"; }
    chown mysql:mysql /run/mysqld
    start mariadbd /usr/sbin/mariadbd --user=mysql --datadir="$STATE/mysql/data" --skip-networking \
        --socket=/run/mysqld/mysqld.sock --pid-file=/run/mysqld/rtc.pid --log-error="$STATE/log/mariadb.log"
    wait_for 60 "MariaDB answering" mariadb --socket=/run/mysqld/mysqld.sock -e "select 1"
    start slurmdbd "${AS_HOST[@]}" "$CTL" /usr/sbin/slurmdbd -D
    wait_for 60 "slurmdbd answering" sacctmgr -n show cluster
    sacctmgr -i -Q add cluster rtc >/dev/null 2>&1 || true  # exists already after a restart
}

slurm_up() {
    start slurmctld "${AS_HOST[@]}" "$CTL" /usr/sbin/slurmctld -D -f "$SLURM_CONF"
    wait_for 60 "slurmctld answering" scontrol ping
    local i
    for i in "${!NODES[@]}"; do
        mkdir -p "$STATE/slurmd-${NODES[$i]}"
        # nsenter, not `ip netns exec`: that remounts /sys, and slurmd then finds no
        # cgroup filesystem and exits.
        start "slurmd-${NODES[$i]}" nsenter --net="/run/netns/${NODES[$i]}" \
            "${AS_HOST[@]}" "${NODES[$i]}" /usr/sbin/slurmd -D -f "$SLURM_CONF" -N "${NODES[$i]}"
    done
    wait_for 120 "both nodes idle in sinfo" both_idle
}

both_idle() {
    [ "$(sinfo -h -N -o '%N %T' | grep -c ' idle$')" -eq ${#NODES[@]} ]
}

up() {
    need_root
    # A cluster a killed run left behind (CI stopped at its time limit mid-tier): its
    # controller's saved state holds the nodes down, and they never came back idle (seen:
    # "both nodes idle in sinfo did not happen within 120s", then passing after a down).
    if [ -d "$STATE" ]; then
        say "a cluster left here by an earlier run: taking it down first"
        down
    fi
    need_packages
    write_configs
    network_up
    munge_up
    database_up
    slurm_up
    sinfo -N
    say "up. Use it with: eval \"\$($0 env)\""
}

stop_pid() {  # stop_pid PIDFILE: TERM, then KILL after 15 s
    [ -f "$1" ] || return 0
    local pid
    pid=$(cat "$1")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 15); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$1"
}

down() {
    need_root
    local ns name
    # Job processes first (they live in the nodes' namespaces), then the daemons.
    for ns in "${NODES[@]}"; do
        [ -e "/run/netns/$ns" ] || continue
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    done
    if [ -d "$STATE/pid" ]; then
        for name in "${NODES[@]}"; do stop_pid "$STATE/pid/slurmd-$name"; done
        stop_pid "$STATE/pid/slurmctld"
        stop_pid "$STATE/pid/slurmdbd"
        stop_pid "$STATE/pid/mariadbd"
    fi
    stop_pid "$STATE/munge/munged.pid"
    for ns in "${NODES[@]}"; do [ -e "/run/netns/$ns" ] && ip netns delete "$ns"; done
    ip link show "$BRIDGE" >/dev/null 2>&1 && ip link delete "$BRIDGE"
    sed -i "/$TAG\$/d" /etc/hosts
    [ -f "$STATE/made-run-mysqld" ] && rm -rf /run/mysqld
    [ -f "$STATE/made-run-munge" ] && rm -rf /run/munge
    rm -rf "$STATE"
    say "down: daemons stopped; namespaces, bridge, host entries and $STATE removed."
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) if [ -f "$SLURM_CONF" ] && sinfo -N 2>/dev/null; then :; else echo down; fi ;;
    env) echo "export SLURM_CONF=$SLURM_CONF" ;;
    check) check ;;
    install) install_packages ;;
    *) echo "usage: $0 up|down|status|env|check|install" >&2; exit 2 ;;
esac
