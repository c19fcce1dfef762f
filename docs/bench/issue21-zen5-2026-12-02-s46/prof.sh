#!/bin/bash
# prof.sh DTYPE SEEDS OUTDIR [SECONDS]: main's `pdserve up` defaults at DTYPE on :8200, the random draws of SEEDS
# ("1527", or "1529 1530 ..." in a row), py-spy on its decode worker for SECONDS (default 14, rule 3's)
set -u
D=$1; S=$2; O=$3; SECS=${4:-14}
cd /work/main
mkdir -p $O
t0=$(date +%s.%N)
nohup .venv/bin/pdserve up --model /tmp/m56 --port 8200 --dtype $D > /tmp/s46/prof_$D.log 2>&1 &
UP=$!
for i in $(seq 1 120); do grep -q 'pdserve is up' /tmp/s46/prof_$D.log && break; sleep 0.5; done
echo "up in $(echo "$(date +%s.%N) - $t0" | bc) s" > $O/startup_$D.txt
DW=$(pgrep -f 'pdserve decode-worker .*' | head -1)
echo "decode worker $DW" >> $O/startup_$D.txt
( sleep 4; .venv/bin/py-spy record -p $DW -r 100 -d $SECS --format raw -o $O/pyspy_decode_worker_$D.txt > /tmp/s46/pyspy_$D.log 2>&1 ) &
.venv/bin/python benchmarks/serve.py --model /tmp/m56 --workload random --rate 0 --baseline main=http://127.0.0.1:8200 --shapes --seeds $S --out $O/draw-$D > $O/runs_$D.txt 2>&1
wait %2 2>/dev/null
sleep 1
kill -TERM $UP
for i in $(seq 1 30); do kill -0 $UP 2>/dev/null || break; sleep 0.5; done
