#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for the cluster tests (make test-slurm): Debian's
# slurm-wlm, munge and slurmdbd with MariaDB, every daemon started by hand (no systemd, no
# cgroups), as root. Run from the repository root:
#
#   tests/slurm/cluster.sh install          # apt packages (once)
#   tests/slurm/cluster.sh start [accounting|none] [affinity|none] [MEMORY_MB]
#   tests/slurm/cluster.sh stop
#
# `start` writes /etc/slurm/slurm.conf for a node named after this host with its CPUs and
# MEMORY_MB of memory (default: what the machine has, less 2 GB), accounting through slurmdbd
# (or none: AccountingStorageType=accounting_storage/none, as on clusters without
# accounting), and CPU binding by task/affinity (or none: TaskPlugin=task/none). A job's time
# limit ends with SIGTERM, then SIGKILL 20 s later (KillWait), as on most clusters.
set -euo pipefail

STATE=/var/lib/eaglet-slurm
LOGS=/var/log/eaglet-slurm

install() {
    command -v slurmctld >/dev/null && command -v slurmdbd >/dev/null && \
        command -v munged >/dev/null && command -v mariadbd >/dev/null && return 0
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm slurmdbd munge mariadb-server
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local seconds=$1 what=$2
    shift 2
    for _ in $(seq "$seconds"); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 1
    done
    echo "cluster.sh: $what did not come up within ${seconds}s" >&2
    return 1
}

start() {
    local accounting=${1:-accounting} binding=${2:-affinity}
    local host cpus memory
    host=$(hostname -s)
    cpus=$(nproc)
    memory=${3:-$(( $(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) - 2048 ))}
    mkdir -p "$STATE"/{ctld,d} "$LOGS" /run/munge /etc/slurm
    chown slurm:slurm "$STATE"/ctld "$LOGS"
    chown munge:munge /run/munge

    # munge: every daemon and client authenticates through it
    if [ ! -s /etc/munge/munge.key ]; then
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
    pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
    wait_for 20 munged munge -n

    local accounting_lines="AccountingStorageType=accounting_storage/none"
    if [ "$accounting" = accounting ]; then
        pgrep -x mariadbd >/dev/null || (runuser -u mysql -- /usr/sbin/mariadbd \
            --socket=/run/mysqld/mysqld.sock >"$LOGS/mariadb.log" 2>&1 &)
        mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
        wait_for 60 MariaDB mysqladmin --socket=/run/mysqld/mysqld.sock ping
        mysql --socket=/run/mysqld/mysqld.sock -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' \
            IDENTIFIED BY 'eaglet'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
        cat >/etc/slurm/slurmdbd.conf <<CONF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=slurm
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=slurm_acct_db
StorageUser=slurm
StoragePass=eaglet
LogFile=$LOGS/slurmdbd.log
PidFile=$STATE/slurmdbd.pid
CONF
        chown slurm:slurm /etc/slurm/slurmdbd.conf
        chmod 600 /etc/slurm/slurmdbd.conf
        accounting_lines="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/linux"
    fi
    cat >/etc/slurm/slurm.conf <<CONF
ClusterName=eaglet
SlurmctldHost=$host
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/$binding
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MpiDefault=none
ReturnToService=2
KillWait=20
MinJobAge=600
$accounting_lines
NodeName=$host CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=main Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
    if [ "$accounting" = accounting ]; then
        pgrep -x slurmdbd >/dev/null || /usr/sbin/slurmdbd
        wait_for 30 slurmdbd sacctmgr -n show cluster
    fi

    if [ "$accounting" = accounting ]; then
        sacctmgr -i add cluster eaglet >/dev/null 2>&1 || true
        sacctmgr -i add account eaglet Cluster=eaglet >/dev/null 2>&1 || true
        sacctmgr -i add user root Account=eaglet >/dev/null 2>&1 || true
    fi
    /usr/sbin/slurmctld
    /usr/sbin/slurmd
    wait_for 60 "the node" sh -c "sinfo -h -o %T | grep -qE '^(idle|mixed|allocated)'"
    sinfo
}

ended() {  # ended NAME: no process of that name runs
    ! pgrep -x "$1" >/dev/null
}

stop() {
    for daemon in slurmd slurmctld slurmdbd; do
        pkill -x "$daemon" 2>/dev/null || true
        wait_for 30 "the end of $daemon" ended "$daemon"
    done
    mysqladmin --socket=/run/mysqld/mysqld.sock shutdown 2>/dev/null || true
    wait_for 30 "the end of mariadbd" ended mariadbd
    pkill -x munged 2>/dev/null || true
    wait_for 30 "the end of munged" ended munged
    # the controller's saved state: the next start's config is its own
    rm -rf "${STATE:?}"/ctld/*
}

case "${1:-}" in
    install) install ;;
    start) shift; start "$@" ;;
    stop) stop ;;
    *) echo "usage: $0 install | start [accounting|none] [affinity|none] [MEMORY_MB] | stop" >&2
       exit 2 ;;
esac
