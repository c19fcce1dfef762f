#!/usr/bin/env bash
# The GPU checks of one device session, in order of importance, each under its own time limit;
# every step's output lands in $OUT (or benchmarks/results/gpu) as it finishes.
#
#   bash benchmarks/gpu/checks.sh [STEP ...]
#   steps: tests greedy decode kernels kv idle serve sweep suite triton spans variants hostcpu
#
# The GPU image's python3 has torch, triton and transformers; what pdserve needs beside them
# travels as wheels in .whl (benchmarks/gpu/wheels.sh fetches them here; installed to /tmp/site
# there; the call carries .whl). Figures go to the README by hand, with the
# device named (nvidia-smi's line is the first thing written).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
if [ -d .whl ]; then  # afresh each time: a warm machine may hold an older set
  rm -rf /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
bin=$(dirname "$(python3 -c 'import sys; print(sys.executable)')")
if [ ! -x "$bin/pdserve" ]; then  # the console script the tests and benchmarks start
  printf '#!%s\nimport sys\nfrom services.cli import main\nsys.exit(main())\n' \
    "$bin/python3" > "$bin/pdserve" && chmod +x "$bin/pdserve"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton, transformers, grpc; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "grpc", grpc.__version__)'
} 2>&1 | tee -a "$OUT/device.txt"

step() {  # step NAME SECONDS COMMAND...: the command's output in $OUT/NAME.txt
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s) $(date +%T)"
  local start=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "== $name: exit $? after $((SECONDS - start))s"
  tail -n 25 "$OUT/$name.txt"
}

model() {  # the 1.1B bf16 bench Llama, made once
  [ -f /tmp/m1b/config.json ] || python3 benchmarks/make_bench_model.py /tmp/m1b --size 1b \
    --dtype bfloat16 > /dev/null
}

for s in "${@:-tests greedy decode kernels kv idle serve sweep}"; do
  for s in $s; do
    case $s in
      tests) step tests 200 python3 -m pytest -q -p no:cacheprovider -m cuda -rfEs \
               tests/kernels tests/unit/test_worker_memory.py tests/unit/test_cuda_ipc.py \
               tests/e2e/test_gpu.py ;;
      greedy) model; step greedy 300 python3 benchmarks/gpu/hf_greedy.py --model /tmp/m1b \
                --dtypes float32 bfloat16 --transports cuda_ipc tcp --out "$OUT/hf_greedy.json" ;;
      triton) step triton 150 python3 -m pytest -q -p no:cacheprovider -rfE \
                tests/kernels/test_triton_backend.py ;;
      suite) step suite 300 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels ;;
      decode) model; step decode 180 python3 benchmarks/decode_step.py --model /tmp/m1b \
                --out "$OUT/decode_step" ;;
      kernels) step kernels 90 python3 benchmarks/kernels.py ;;
      sweep) step sweep 300 python3 benchmarks/kernels.py --sweep ;;
      kv) step kv 60 python3 benchmarks/kv_transfer.py --device cuda --sizes-mib 4 64 512 ;;
      idle) model; step idle 200 python3 benchmarks/serve.py --model /tmp/m1b --workload idle \
              --num-requests 12 --max-tokens 128 --shapes default eager \
              --up-args "--device cuda" --out "$OUT/serve_idle" ;;
      serve) model; step serve 200 python3 benchmarks/serve.py --model /tmp/m1b \
               --workload random --rate 0 --num-requests 200 --max-tokens 128 \
               --shapes default eager --up-args "--device cuda" \
               --out "$OUT/serve_random" ;;
      spans) model; step spans 330 bash -c 'e=--enforce-eager n="--num-kv-blocks 4096"
               for shape in "" "--prefill-worker-args=$e --decode-worker-args=$e" \
                   "--prefill-worker-args=\"$e $n\" --decode-worker-args=\"$e $n\""; do
                 name=spans; case $shape in *num-kv*) name+=_eager_blocks;; ?*) name+=_eager;; esac
                 echo "== --device cuda $shape"; python3 benchmarks/request_spans.py \
                   --model /tmp/m1b --up-args "--device cuda $shape" \
                   --out "$1/$name.json" || exit; done' _ "$OUT" ;;
      variants) step variants 120 python3 -m pytest -q -p no:cacheprovider -rfE \
                  tests/kernels/test_kernel_variants.py ;;
      hostcpu) step hostcpu 560 bash benchmarks/gpu/host_cpu.sh "$OUT" ;;
      *) echo "unknown step $s"; exit 2 ;;
    esac
  done
done
