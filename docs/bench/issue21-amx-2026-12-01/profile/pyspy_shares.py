import sys, collections
for path in sys.argv[1:]:
    tot = collections.Counter()
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(" ")
        n = int(n)
        tot["all"] += n
        fwd = "model_runner.py" in stack and ("_forward (" in stack or "compute_logits (" in stack)
        if not fwd:
            continue
        tot["forward+logits"] += n
        if "paged_decode_attention" in stack: tot["decode attention"] += n
        if "paged_prefill_attention" in stack: tot["prefill attention"] += n
        if "write_kv" in stack: tot["write_kv"] += n
        if "common/models/attention.py" in stack: tot["attention backend (all)"] += n
        if "packed_linear" in stack: tot["packed linears"] += n
    f = tot["forward+logits"]
    print(path, f"samples {tot['all']}, forward+logits {f}")
    for k in ["decode attention", "prefill attention", "write_kv", "attention backend (all)", "packed linears"]:
        print(f"  {k:<26} {tot[k]:6d}  {100*tot[k]/max(f,1):5.1f}% of forward+logits")
