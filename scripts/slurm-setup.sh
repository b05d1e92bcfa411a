#!/usr/bin/env bash
# A single-node Slurm cluster on this machine, for the Slurm allocator's tests
# (tests/tests/alloc.rs) and for trying `SlurmAllocator` by hand.
#
# Debian 12 (Slurm 22.05), run as root. Installs slurmctld, slurmd,
# slurm-client and munge with apt when they are missing, then starts munged,
# slurmctld and slurmd with every file (config, state, logs, pid files, the
# munge key and socket) under $REGENT_SLURM_DIR (default /tmp/regent-slurm),
# and waits until the node is idle. Nothing under /etc is changed: clients
# find the cluster through SLURM_CONF.
#
# Usage:
#   scripts/slurm-setup.sh [start]   install if needed, start (or keep running)
#   scripts/slurm-setup.sh stop      stop the daemons started here
#   scripts/slurm-setup.sh env       print the export line for clients
#
# After `start`, clients need:
#   export SLURM_CONF=$REGENT_SLURM_DIR/etc/slurm.conf
# (`start` and `env` print this line.)
#
# Adapted from shared/infra/slurm-setup.sh: the same daemons and
# configuration, plus idempotent start, a bounded stop that waits for the
# daemons to exit, and the `env` subcommand.
set -euo pipefail

BASE=${REGENT_SLURM_DIR:-/tmp/regent-slurm}
AUTH=${REGENT_SLURM_AUTH:-munge} # munge | none
CONF=$BASE/etc/slurm.conf
DAEMONS=(slurmd slurmctld munged)

say() { printf 'slurm-setup: %s\n' "$*" >&2; }

export_line() { printf 'export SLURM_CONF=%s\n' "$CONF"; }

# The pid in $BASE/run/$1.pid, if that process is alive.
alive_pid() {
  local file=$BASE/run/$1.pid pid
  [[ -f $file ]] || return 1
  pid=$(cat "$file" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

node_idle() {
  SLURM_CONF=$CONF sinfo -h -o '%T' 2>/dev/null | grep -qx idle
}

stop() {
  local name pid i
  for name in "${DAEMONS[@]}"; do
    pid=$(alive_pid "$name") || continue
    kill "$pid" 2>/dev/null || true
    # Bounded wait (10 s), then SIGKILL.
    for i in $(seq 1 100); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
      say "$name ($pid) ignored SIGTERM; killing it"
      kill -9 "$pid" 2>/dev/null || true
    fi
    say "stopped $name ($pid)"
  done
}

case "${1:-start}" in
  start) ;;
  stop) stop; exit 0 ;;
  env) export_line; exit 0 ;;
  *) say "usage: $0 [start|stop|env]"; exit 2 ;;
esac

if [[ $(id -u) != 0 ]]; then
  say "must run as root (it installs packages and starts slurmd)"
  exit 1
fi

# Already up (a second call, e.g. a rerun of CI on the same machine).
if alive_pid slurmctld >/dev/null && alive_pid slurmd >/dev/null && node_idle; then
  say "already running under $BASE"
  export_line
  exit 0
fi
stop # whatever half of it is left

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
  || ! command -v srun >/dev/null || ! command -v munged >/dev/null; then
  say "installing slurmctld slurmd slurm-client munge"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
fi

HOST=$(hostname -s)
mkdir -p "$BASE"/{etc,run,log,spool/ctld,spool/d,munge,munge-key}
chmod 755 "$BASE"

if [[ $AUTH == munge ]]; then
  # The key directory is private; the socket directory is world-x so that
  # non-root clients can authenticate too.
  rm -f "$BASE/munge-key/munge.key"
  dd if=/dev/urandom of="$BASE/munge-key/munge.key" bs=1024 count=1 status=none
  chmod 700 "$BASE/munge-key"
  chmod 400 "$BASE/munge-key/munge.key"
  chmod 755 "$BASE/munge"
  munged --force \
    --key-file="$BASE/munge-key/munge.key" \
    --socket="$BASE/munge/munge.socket" \
    --pid-file="$BASE/run/munged.pid" \
    --log-file="$BASE/log/munged.log" \
    --seed-file="$BASE/munge-key/munged.seed"
  munge -S "$BASE/munge/munge.socket" -n | unmunge -S "$BASE/munge/munge.socket" >/dev/null
  AUTHCONF="AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$BASE/munge/munge.socket"
else
  AUTHCONF="AuthType=auth/none
CredType=cred/none"
fi

MEM=$(($(awk '/MemTotal/{print $2}' /proc/meminfo) / 1024 - 256))
CPUS=$(nproc)

cat >"$CONF" <<EOF
ClusterName=regent-ci
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
$AUTHCONF
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$BASE/spool/ctld
SlurmdSpoolDir=$BASE/spool/d
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SchedulerType=sched/backfill
InactiveLimit=0
KillWait=5
MinJobAge=60
SlurmdTimeout=30
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF

export SLURM_CONF=$CONF
slurmctld -c -f "$CONF" # -c: clear previous state; daemonizes
slurmd -f "$CONF"       # daemonizes

# Up to 30 s for the node to become idle.
for i in $(seq 1 120); do
  if node_idle; then
    say "up after ~$((i / 4)).$(((i % 4) * 25))s under $BASE"
    SLURM_CONF=$CONF sinfo >&2
    export_line
    exit 0
  fi
  sleep 0.25
done
say "the node did not become idle"
tail -20 "$BASE/log/slurmctld.log" "$BASE/log/slurmd.log" >&2 || true
exit 1
