set -u; T=$PWD
bash benchmarks/gpu/checks.sh variants > /dev/null 2>&1; tail -2 $OUT/variants.txt
python3 benchmarks/make_bench_model.py /tmp/m1b --size 1b --dtype bfloat16 > /dev/null 2>&1
rm -rf /tmp/before; cp -r $T /tmp/before
sed -i 's/^\( *\)warm_up_kernels(model, layout, device)$/\1pass/' /tmp/before/common/worker/service.py
grep -c "warm_up_kernels(model" /tmp/before/common/worker/service.py
e="--enforce-eager --num-kv-blocks 4096"
for v in before after; do
  d=$T; [ $v = before ] && d=/tmp/before
  cd $d; s=$SECONDS
  PYTHONPATH=/tmp/site:$d TRITON_CACHE_DIR=/tmp/tc_$v timeout 200 python3 benchmarks/request_spans.py --model /tmp/m1b --up-args "--device cuda --prefill-worker-args=\"$e\" --decode-worker-args=\"$e\"" --out $OUT/$v.json > $OUT/$v.txt 2>&1
  echo "== $v exit $? in $((SECONDS-s)) s"; grep -h "warmed\|ready\|captured" /tmp/pdserve-request-spans.log | tail -6 >> $OUT/$v.txt
  head -12 $OUT/$v.txt; grep "TTFT\|warmed\|ready" $OUT/$v.txt
done
