#!/usr/bin/env bash
# pdserve and vLLM-CPU, each in float32 and bfloat16, random 256/64, 60 at once, 4 seeds, one run
set -u
cd "$(git rev-parse --show-toplevel)"  # the model: .venv/bin/python benchmarks/make_bench_model.py /tmp/m56 --size 56m
OUT=docs/bench/random-dtypes-zen4-1539-1542
mkdir -p ${LOGS:-/tmp/dtypes-logs}
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0
.peers/venv-vllm/bin/vllm serve /tmp/m56 --port 8100 --dtype float32 > ${LOGS:-/tmp/dtypes-logs}/vllm32.log 2>&1 &
echo $! > ${LOGS:-/tmp/dtypes-logs}/vllm32.pid
.peers/venv-vllm/bin/vllm serve /tmp/m56 --port 8101 --dtype bfloat16 > ${LOGS:-/tmp/dtypes-logs}/vllm16.log 2>&1 &
echo $! > ${LOGS:-/tmp/dtypes-logs}/vllm16.pid
t0=$(date +%s)
.venv/bin/pdserve up --model /tmp/m56 --dtype bfloat16 --port 8200 --scheduler-port 8250 > ${LOGS:-/tmp/dtypes-logs}/pd16.log 2>&1 &
echo $! > ${LOGS:-/tmp/dtypes-logs}/pd16.pid
for url in http://127.0.0.1:8100/v1/models http://127.0.0.1:8101/v1/models http://127.0.0.1:8200/v1/models; do
  for i in $(seq 1 300); do curl -sf $url > /dev/null && break; sleep 1; done
  echo "$url ready after $(( $(date +%s) - t0 )) s"
done
.venv/bin/python benchmarks/serve.py --model /tmp/m56 --workload random --rate 0 --num-requests 60 --max-tokens 64 \
  --baseline "vllm float32=http://127.0.0.1:8100" --baseline "vllm bfloat16=http://127.0.0.1:8101" \
  --baseline "pdserve bfloat16=http://127.0.0.1:8200" --shapes default --up-args "--dtype float32" \
  --seeds 1539 1540 1541 1542 --out $OUT
echo "serve.py rc $?"
for f in vllm32 vllm16 pd16; do kill $(cat ${LOGS:-/tmp/dtypes-logs}/$f.pid) 2>/dev/null; done
