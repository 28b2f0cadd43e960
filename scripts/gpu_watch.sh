#!/usr/bin/env bash
# usage: scripts/gpu_watch.sh LOG LIMIT_S cmd...
# Runs cmd in its own process group with its output in LOG. Whenever LOG stays silent for
# 60 s, every Python process of the group appends its stacks to LOG (faulthandler on
# SIGUSR1, registered by /tmp/fh/sitecustomize.py): where a stalled engine start waits.
# Past LIMIT_S the group is killed. Exits with cmd's status (143 when killed).
log=$1; lim=$2; shift 2
mkdir -p /tmp/fh
printf 'import faulthandler, signal\nfaulthandler.register(signal.SIGUSR1, all_threads=True)\n' > /tmp/fh/sitecustomize.py
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/fh
setsid "$@" > "$log" 2>&1 &
pid=$!; start=$(date +%s); last=0; quiet_since=$start
while kill -0 $pid 2>/dev/null; do
  sleep 5; now=$(date +%s); size=$(stat -c %s "$log")
  [ "$size" != "$last" ] && { last=$size; quiet_since=$now; }
  if [ $((now - quiet_since)) -ge 60 ]; then
    echo "=== watch: silent 60 s at +$((now - start)) s; stacks of the group's Python processes" >> "$log"
    for p in $(pgrep -g $pid); do  # Python processes only: SIGUSR1 kills others (ptxas)
      exe=$(readlink /proc/$p/exe 2>/dev/null); c=$(tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null)
      case "${exe##*/}" in python*) echo "=== pid $p: ${c:0:150}" >> "$log"; kill -USR1 $p;; esac
    done
    quiet_since=$now
  fi
  if [ $((now - start)) -ge $lim ]; then
    echo "=== watch: limit $lim s reached, killing" >> "$log"
    kill -TERM -- -$pid; sleep 5; kill -KILL -- -$pid 2>/dev/null; break
  fi
done
wait $pid; rc=$?
echo "=== watch: rc $rc after $(( $(date +%s) - start )) s" >> "$log"
exit $rc
