#!/bin/bash
# rule4.sh DTYPE OUT SEED...: 51bcb25 (old, :8300) and vLLM-CPU (:8100) launched once at DTYPE; serve.py
# launches main's `pdserve up` defaults at DTYPE itself; random 256/64, 60 at once, the order turned each draw
set -u
D=$1; O=$2; shift 2
cd /work/main
if [ "$D" = float32 ]; then WA=""; else WA="--dtype $D"; fi
t0=$(date +%s.%N)
(cd /tmp/old51 && exec .venv/bin/pdserve up --model /tmp/m56 --port 8300 --prefill-worker-args="$WA" --decode-worker-args="$WA") > /tmp/s46/old_$D.log 2>&1 &
OLD=$!
for i in $(seq 1 240); do curl -sf http://127.0.0.1:8300/v1/models > /dev/null && break; sleep 0.5; done
echo "old (51bcb25) $D: up in $(echo "$(date +%s.%N) - $t0" | bc) s" | tee /tmp/s46/startup_old_$D.txt
t0=$(date +%s.%N)
HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=4 \
VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  .peers/venv-vllm/bin/vllm serve /tmp/m56 --port 8100 --dtype $D > /tmp/s46/vllm_$D.log 2>&1 &
VL=$!
for i in $(seq 1 600); do curl -sf http://127.0.0.1:8100/v1/models > /dev/null && break; sleep 0.5; done
echo "vllm $D: up in $(echo "$(date +%s.%N) - $t0" | bc) s" | tee /tmp/s46/startup_vllm_$D.txt
.venv/bin/python benchmarks/serve.py --model /tmp/m56 --workload random --rate 0 --up-args "--dtype $D" \
  --baseline old=http://127.0.0.1:8300 --baseline vllm=http://127.0.0.1:8100 --shapes default \
  --seeds "$@" --out $O > /tmp/s46/runs_$D.txt 2>&1
echo "serve.py rc $?"
kill -TERM $OLD $VL
for i in $(seq 1 60); do kill -0 $OLD 2>/dev/null || kill -0 $VL 2>/dev/null || break; sleep 0.5; done
