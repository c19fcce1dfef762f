#!/bin/bash
# startup.sh NAME DIR DTYPE: `pdserve up` of DIR's build alone on :8400, launch to /v1/models answering
set -u
N=$1; R=$2; D=$3
cd $R
if [ "$N" = old ]; then
  if [ "$D" = float32 ]; then A=(); else A=(--prefill-worker-args="--dtype $D" --decode-worker-args="--dtype $D"); fi
else A=(--dtype $D); fi
t0=$(date +%s.%N)
.venv/bin/pdserve up --model /tmp/m56 --port 8400 "${A[@]}" > /tmp/s46/st_${N}_${D}.log 2>&1 &
P=$!
for i in $(seq 1 600); do curl -sf http://127.0.0.1:8400/v1/models > /dev/null && break; sleep 0.1; done
echo "$N $D: up in $(echo "$(date +%s.%N) - $t0" | bc) s"
kill -TERM $P
for i in $(seq 1 100); do kill -0 $P 2>/dev/null || break; sleep 0.2; done
