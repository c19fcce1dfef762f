#!/usr/bin/env bash
# The GPU machine's own CPU, the GPU hidden, as a two-core CPU server: the CPU figures of a
# processor with native bfloat16 (AMX or AVX512-BF16) where the machine here has none. Two
# cores on different physical cores, as the 2-core machines the CPU figures come from; the
# kernels built first on every core. Everything lands in OUT/hostcpu.tgz (the device call
# returns at most 8 files), packed again after each part so a part cut off leaves the others.
#
#   bash benchmarks/gpu/host_cpu.sh OUT
set -u
out=$1 res=/tmp/hostcpu
mkdir -p "$res"
export CUDA_VISIBLE_DEVICES= PYTHONUNBUFFERED=1
pack() { tar -czf "$out/hostcpu.tgz" -C /tmp hostcpu; }
part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "-- $name $(date +%T)"
  timeout -k 5 "$limit" "$@" > "$res/$name.txt" 2>&1
  echo "-- $name: exit $?"; tail -n 12 "$res/$name.txt"; pack
}
{ lscpu; echo; lscpu -e; } > "$res/lscpu.txt"
grep -m1 'model name' /proc/cpuinfo
grep -o -w 'avx512f\|avx512_bf16\|amx_bf16\|amx_tile' /proc/cpuinfo | sort | uniq -c
# the first logical CPU of each of the first two physical cores
cores=$(lscpu -p=CPU,CORE | grep -v '^#' | sort -t, -k2,2n -u | head -2 | cut -d, -f1 | paste -sd,)
echo "pinned to CPUs $cores"
g++ --version | head -1 || exit 1
[ -f /tmp/m56/config.json ] || python3 benchmarks/make_bench_model.py /tmp/m56 --size 56m > /dev/null
python3 -c 'import torch; from kernels.cpu_attention import load, cpu_isa
print("torch", torch.__version__, torch.backends.cpu.get_cpu_capability(), cpu_isa()); load()' || exit 1
pin="taskset -c $cores"
part attention 150 $pin python3 benchmarks/attention.py --reps 5 --out "$res/attention"
part resident 60 taskset -c "${cores%%,*}" python3 benchmarks/attention_resident.py
# bfloat16 decode: the pairwise key product (vdpbf16ps) against keys widened to float
part decode_dp 150 $pin python3 benchmarks/kernel_ab.py --new-flags -DPDSERVE_NO_DECODE_DP \
  --dtypes bfloat16 --reps 9
# where the decode kernel's time goes, when a perf bundle travels (perf_bundle.sh): a sampled
# profile of each dtype, cache-resident and scattered, and its annotated disassembly
if [ -x .exp/perf/perf ]; then
  perf="env LD_LIBRARY_PATH=$PWD/.exp/perf $PWD/.exp/perf/perf"
  for dtype in bfloat16 float32; do for case in resident scattered; do
    echo "-- decode_perf $dtype $case"
    taskset -c "${cores%%,*}" $perf record -q -e cpu-clock -F 4000 -o /tmp/decode.perf -- \
      env -u LD_LIBRARY_PATH python3 benchmarks/attention_resident.py --loop "$case" "$dtype" 5 \
      > "$res/perf_${dtype}_$case.txt" 2>&1
    dso=$($perf report -i /tmp/decode.perf --sort dso --stdio 2>/dev/null |
          grep -o 'pdserve_attention[a-z0-9_]*\.so' | head -1)
    $perf report -i /tmp/decode.perf --no-children --sort dso,symbol --stdio 2>/dev/null |
      grep '%' | head -12 >> "$res/perf_${dtype}_$case.txt"
    $perf annotate -i /tmp/decode.perf --stdio --dsos="$dso" 2>/dev/null \
      > "$res/perf_${dtype}_${case}_annotate.txt"
    tail -n 13 "$res/perf_${dtype}_$case.txt"
  done; done
  pack
fi
part step_profile 90 $pin python3 benchmarks/step_profile.py --model /tmp/m56 --reps 5 \
  --out "$res/step_profile"
for dtype in bfloat16 float32; do
  part "serve_$dtype" 150 $pin python3 benchmarks/serve.py --model /tmp/m56 --workload random \
    --rate 0 --num-requests 60 --max-tokens 64 --seeds 21 22 --shapes default torch-attention \
    --up-args "--device cpu --dtype $dtype" --out "$res/serve_$dtype"
done
