#!/bin/bash
# st.sh LABEL: `pdserve up` (main, float32 defaults) on :8400, launch to /v1/models answering
set -u
cd /work/main
t0=$(date +%s.%N)
.venv/bin/pdserve up --model /tmp/m56 --port 8400 > /tmp/s47/st/$1.log 2>&1 &
P=$!
for i in $(seq 1 900); do curl -sf http://127.0.0.1:8400/v1/models > /dev/null && break; sleep 0.1; done
echo "$1: up in $(echo "$(date +%s.%N) - $t0" | bc) s"
kill -TERM $P
for i in $(seq 1 100); do kill -0 $P 2>/dev/null || break; sleep 0.2; done
