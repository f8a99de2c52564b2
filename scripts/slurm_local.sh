#!/usr/bin/env bash
# A real two-node Slurm cluster on this one machine, for tests and CI.
#
#   bash scripts/slurm_local.sh up       # start (idempotent); prints status
#   bash scripts/slurm_local.sh down     # stop slurmd n1/n2 and slurmctld, remove the state dir (idempotent)
#   bash scripts/slurm_local.sh status   # sinfo and the daemons' pids
#
# Run as root. Needs Slurm (Debian: slurm-wlm, tested with 22.05) and munge installed; installs nothing.
# One slurmctld and two slurmd (`slurmd -N n1`, `slurmd -N n2`) on 127.0.0.1, partition `debug` holding
# both nodes. Writes /etc/slurm/slurm.conf (so sbatch/srun/salloc/scontrol work in any shell) and refuses
# to overwrite one it did not write. State, spool, pid and log files live under $PIMM_SLURM_DIR
# (default /tmp/pimm-slurm). munged is left running by `down`.
set -euo pipefail

DIR="${PIMM_SLURM_DIR:-/tmp/pimm-slurm}"
CONF=/etc/slurm/slurm.conf
MARK="# written by pimm scripts/slurm_local.sh"
CTLD_PORT=16817
NODES=(n1 n2)
declare -A NODE_PORT=([n1]=17001 [n2]=17002)
UP_TIMEOUT="${PIMM_SLURM_UP_TIMEOUT:-60}"

die() { echo "slurm_local: $*" >&2; exit 1; }
log() { echo "slurm_local: $*"; }

# A live process (a zombie, not yet reaped by init, counts as gone).
pid_alive() {
    [[ -n "${1:-}" ]] && kill -0 "$1" 2>/dev/null || return 1
    [[ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]]
}
pid_from() { [[ -s "$1" ]] && tr -d '[:space:]' <"$1" || true; }

cluster_answers() {
    # Without a live slurmctld of ours, sinfo would spend ~9 s retrying the connection: skip it.
    [[ -f "$CONF" ]] && pid_alive "$(pid_from "$DIR/run/slurmctld.pid")" &&
        timeout 10 sinfo -h -o %T >/dev/null 2>&1
}

ensure_munge() {
    command -v munged >/dev/null || die "munged not found (apt-get install -y munge)"
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating /etc/munge/munge.key"
        install -d -o munge -g munge -m 0700 /etc/munge
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile=/etc/munge/munge.key
        else
            dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
        fi
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0
    fi
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
    log "starting munged"
    # As the munge user first (the key's owner); as root munged needs --force.
    if ! runuser -u munge -- munged 2>/dev/null; then
        munged --force || true
    fi
    local i
    for ((i = 0; i < 50; i++)); do
        if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi
        sleep 0.2
    done
    tail -n 20 /var/log/munge/munged.log >&2 2>/dev/null || true
    die "munge does not work (munge -n | unmunge fails)"
}

write_conf() {
    if [[ -e "$CONF" ]] && ! grep -qxF "$MARK" "$CONF"; then
        die "$CONF exists and was not written by this script; refusing to overwrite it (move it away first)"
    fi
    local host mem_mb node_mem
    host="$(hostname -s)"
    mem_mb=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 ))
    # Per node: a quarter of the machine's memory, at most 4 GiB (both "nodes" share this machine).
    node_mem=$(( mem_mb / 4 ))
    (( node_mem > 4096 )) && node_mem=4096
    (( node_mem < 256 )) && node_mem=256
    install -d -m 0755 /etc/slurm
    local tmp="$CONF.tmp.$$"
    cat >"$tmp" <<EOF
$MARK
# A two-node test cluster on one machine: slurmd n1 and n2 are both this host ($host) on 127.0.0.1,
# told apart by port. State under $DIR; remove with \`bash scripts/slurm_local.sh down\`.
ClusterName=pimm
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MailProg=/bin/true

StateSaveLocation=$DIR/ctld
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdSpoolDir=$DIR/spool/%n
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info

ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Use the node definitions below, not the hardware slurmd finds (CI machines differ).
SlurmdParameters=config_overrides

ReturnToService=2
# Finished jobs stay visible to \`scontrol show job ID\` for an hour.
MinJobAge=3600
KillWait=30
InactiveLimit=0
SlurmctldTimeout=120
SlurmdTimeout=300

# No slurmdbd here, so there is no accounting database and \`sacct\` cannot work;
# finished jobs are appended to the text file JobCompLoc instead.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.log

NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=${NODE_PORT[n1]} CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=$node_mem State=UNKNOWN
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.1 Port=${NODE_PORT[n2]} CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=$node_mem State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF
    mv -f "$tmp" "$CONF"
    chmod 0644 "$CONF"
}

print_logs() {
    local f
    for f in "$DIR"/log/*.log; do
        [[ -f "$f" ]] || continue
        echo "===== $f (tail) =====" >&2
        tail -n 25 "$f" >&2 || true
    done
}

start_daemons() {
    install -d -m 0755 "$DIR" "$DIR/ctld" "$DIR/run" "$DIR/log" "$DIR/spool/n1" "$DIR/spool/n2"
    if ! pid_alive "$(pid_from "$DIR/run/slurmctld.pid")"; then
        log "starting slurmctld (port $CTLD_PORT)"
        slurmctld -f "$CONF" || { print_logs; die "slurmctld failed to start"; }
    fi
    local n
    for n in "${NODES[@]}"; do
        if ! pid_alive "$(pid_from "$DIR/run/slurmd-$n.pid")"; then
            log "starting slurmd -N $n (port ${NODE_PORT[$n]})"
            slurmd -f "$CONF" -N "$n" || { print_logs; die "slurmd -N $n failed to start"; }
        fi
    done
}

wait_idle() {
    local deadline=$((SECONDS + UP_TIMEOUT)) states resumed=0
    while ((SECONDS < deadline)); do
        states="$(timeout 10 sinfo -h -N -o '%N %T' 2>/dev/null || true)"
        if [[ -n "$states" ]]; then
            # Both nodes idle (or already running something): done.
            if [[ "$(awk '$2 ~ /^(idle|mixed|allocated|completing)$/ {c++} END {print c+0}' <<<"$states")" -eq ${#NODES[@]} ]]; then
                return 0
            fi
            # Left down/drained by a previous run: resume them (once every few seconds at most).
            if grep -Eq ' (down|drain|drained|draining|fail)' <<<"$states" && ((SECONDS >= resumed)); then
                scontrol update nodename=n[1-2] state=resume >/dev/null 2>&1 || true
                resumed=$((SECONDS + 3))
            fi
        fi
        sleep 0.5
    done
    echo "slurm_local: nodes not idle after ${UP_TIMEOUT}s:" >&2
    timeout 10 sinfo -N -l >&2 2>&1 || true
    print_logs
    die "cluster did not come up"
}

cmd_status() {
    local name f pid
    if pid_alive "$(pid_from "$DIR/run/slurmctld.pid")"; then
        timeout 10 sinfo 2>&1 || echo "(sinfo: no answer)"
    else
        echo "(no slurmctld running from $DIR)"
    fi
    for name in slurmctld slurmd-n1 slurmd-n2; do
        f="$DIR/run/$name.pid"
        pid="$(pid_from "$f")"
        if pid_alive "$pid"; then echo "$name: pid $pid"; else echo "$name: not running"; fi
    done
    pid="$(pgrep -x munged | head -n1 || true)"
    echo "munged: ${pid:+pid }${pid:-not running}"
}

cmd_up() {
    [[ $EUID -eq 0 ]] || die "run as root"
    command -v slurmctld >/dev/null || die "slurmctld not found (apt-get install -y slurm-wlm munge)"
    if [[ -f "$CONF" ]] && ! grep -qxF "$MARK" "$CONF"; then
        die "$CONF exists and was not written by this script; refusing to overwrite it (move it away first)"
    fi
    if cluster_answers; then
        log "already up"
        cmd_status
        return 0
    fi
    local t0=$SECONDS
    ensure_munge
    write_conf
    start_daemons
    wait_idle
    log "up in $((SECONDS - t0))s"
    cmd_status
}

stop_pidfiles() {
    # TERM the daemons named by the pid files "$@", wait up to ~30 s for them to exit, then KILL.
    local f pid i pids=() left
    for f in "$@"; do
        pid="$(pid_from "$f")"
        if pid_alive "$pid"; then
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid")
        fi
    done
    for ((i = 0; i < 150; i++)); do
        left=()
        for pid in "${pids[@]}"; do pid_alive "$pid" && left+=("$pid"); done
        ((${#left[@]} == 0)) && return 0
        sleep 0.2
    done
    log "pids ${left[*]} did not exit after SIGTERM; killing them"
    kill -KILL "${left[@]}" 2>/dev/null || true
    for ((i = 0; i < 25; i++)); do
        left=()
        for pid in "${pids[@]}"; do pid_alive "$pid" && left+=("$pid"); done
        ((${#left[@]} == 0)) && return 0
        sleep 0.2
    done
}

cmd_down() {
    [[ $EUID -eq 0 ]] || die "run as root"
    if [[ -d "$DIR" ]]; then
        # slurmd first (they remove their pid files on exit), then slurmctld.
        stop_pidfiles "$DIR/run/slurmd-n1.pid" "$DIR/run/slurmd-n2.pid"
        stop_pidfiles "$DIR/run/slurmctld.pid"
        rm -rf "$DIR"
    fi
    log "down"
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
