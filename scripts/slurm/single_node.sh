#!/usr/bin/env bash
# A one-machine Slurm (munged, slurmctld, slurmd on localhost) in a directory of its own, for
# trying the SLURMCluster recipe (docs/cluster.md, "Slurm") and for its test. Needs root.
#
#   scripts/slurm/single_node.sh install      # apt-get install slurm-wlm munge (retried)
#   scripts/slurm/single_node.sh start DIR    # DIR must not exist; prints `export SLURM_CONF=...`
#   export SLURM_CONF=DIR/slurm.conf          # then sinfo, sbatch, squeue, scancel use it
#   scripts/slurm/single_node.sh stop DIR     # cancels every job, stops the daemons, removes DIR
#
# Nothing outside DIR is written or read: its own munge key and socket (not /etc/munge), its own
# ports (free ones, so two runs on one machine do not collide), state and spool in DIR. CPUs and
# RealMemory are this machine's.
set -euo pipefail

die() { echo "single_node.sh: $*" >&2; exit 1; }

install() {
  local sudo="" log
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 || die "not root and no sudo"
    sudo="sudo -n"
  fi
  command -v apt-get >/dev/null 2>&1 || die "no apt-get to install slurm-wlm and munge"
  log="$(mktemp)"
  for attempt in 1 2 3; do  # mirrors time out now and then: retry with a pause
    if $sudo apt-get update -qq >"$log" 2>&1 \
       && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            slurm-wlm munge >>"$log" 2>&1; then
      rm -f "$log"
      return 0
    fi
    echo "apt-get install slurm-wlm munge failed (attempt $attempt/3):" >&2
    tail -n 5 "$log" >&2
    sleep $((attempt * 5))
  done
  rm -f "$log"
  return 1
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

write_conf() {  # DIR
  local dir="$1" cpus mem_mb
  cpus="$(getconf _NPROCESSORS_ONLN)"  # not nproc: it follows OMP_NUM_THREADS (1 under the suite)
  # RealMemory a little under MemTotal: slurmd drains a node that reports less than configured.
  mem_mb="$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)"
  cat >"$dir/slurm.conf" <<EOF
ClusterName=single
SlurmctldHost=localhost
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
# A cancelled job's processes get SIGTERM, then SIGKILL after KillWait seconds.
KillWait=5
InactiveLimit=0
MinJobAge=30
NodeName=localhost CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {  # DIR
  local dir="$1"
  [ "$(id -u)" = 0 ] || die "needs root (slurmd starts jobs as their users)"
  for tool in munged mungekey slurmctld slurmd sinfo; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool not found (scripts/slurm/single_node.sh install)"
  done
  [ ! -e "$dir" ] || die "$dir exists: give a new directory"
  mkdir -p "$dir/munge" "$dir/state" "$dir/spool"
  dir="$(cd "$dir" && pwd)"
  chmod 700 "$dir" "$dir/munge"
  mungekey --create --keyfile="$dir/munge/munge.key" >/dev/null
  chmod 600 "$dir/munge/munge.key"
  write_conf "$dir"
  export SLURM_CONF="$dir/slurm.conf"
  # --force: munged refuses to run as root without it
  munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" \
    --seed-file="$dir/munge/munged.seed" || die "munged did not start: $(tail -n 3 "$dir/munge/munged.log" 2>/dev/null)"
  slurmctld -f "$SLURM_CONF" || die "slurmctld did not start: $(tail -n 5 "$dir/slurmctld.log" 2>/dev/null)"
  slurmd -f "$SLURM_CONF" -N localhost || die "slurmd did not start: $(tail -n 5 "$dir/slurmd.log" 2>/dev/null)"
  local state=""
  for _ in $(seq 60); do  # ~30 s: slurmd registers within a few seconds
    state="$(sinfo -h -n localhost -o %T 2>/dev/null || true)"
    [ "$state" = idle ] && { echo "export SLURM_CONF=$SLURM_CONF"; return 0; }
    sleep 0.5
  done
  echo "single_node.sh: the node is '${state:-not listed}', not idle, after 30 s" >&2
  tail -n 5 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
  return 1
}

stop_pid() {  # PIDFILE
  local pid
  [ -f "$1" ] || return 0
  pid="$(cat "$1")"
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
}

stop() {  # DIR: safe to run twice, and after a failed start
  local dir="$1"
  [ -d "$dir" ] || return 0
  dir="$(cd "$dir" && pwd)"
  export SLURM_CONF="$dir/slurm.conf"
  if [ -f "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
    scancel --full --partition=debug 2>/dev/null || true
    for _ in $(seq 40); do  # a job's processes leave within KillWait (5 s) of the cancel
      [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.5
    done
  fi
  stop_pid "$dir/slurmd.pid"
  stop_pid "$dir/slurmctld.pid"
  # Whatever a job left (its processes carry this SLURM_CONF and a SLURM_JOB_ID): gone too.
  local env pid vars
  for env in /proc/[0-9]*/environ; do
    vars="$( { tr '\0' '\n' <"$env"; } 2>/dev/null || true)"
    if grep -qx "SLURM_CONF=$dir/slurm.conf" <<<"$vars" && grep -q '^SLURM_JOB_ID=' <<<"$vars"; then
      pid="${env#/proc/}"; kill -9 "${pid%/environ}" 2>/dev/null || true
    fi
  done
  stop_pid "$dir/munge/munged.pid"
  rm -rf "$dir"
}

case "${1:-}" in
  install) install ;;
  start) [ $# = 2 ] || die "usage: $0 start DIR"; start "$2" ;;
  stop) [ $# = 2 ] || die "usage: $0 stop DIR"; stop "$2" ;;
  *) die "usage: $0 install | start DIR | stop DIR" ;;
esac
