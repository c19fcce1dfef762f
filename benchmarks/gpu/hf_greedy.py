"""Greedy tokens of `pdserve up --device cuda` against transformers' on the same GPU, for a
realistic model in each dtype given: prompts of mixed lengths sent together (chunked prefill,
batched decode replayed from CUDA graphs, KV moved between the workers), then the same prompts
through `generate` one at a time.

    python3 benchmarks/gpu/hf_greedy.py --model /tmp/m1b --dtypes float32 bfloat16

float32 must match token for token. In 16-bit types two correct implementations round
differently and can part at a near tie; there a prompt passes as vLLM's HF comparisons do: at the
first token where the two part, the served token is among transformers' five most likely. The
table gives, for each prompt, where they part, the served token's rank in transformers' logits
there and its logit gap to the top one. Exit status 1 when a prompt fails."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
import transformers

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after the repo: its kernels package
from loadgen import launch, stop  # noqa: E402

TOP_K = 5  # a 16-bit divergence passes when the served token is among transformers' top five


async def served_tokens(url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        name = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(prompt: list[int]) -> list[int]:
            r = await client.post("/v1/completions", json={
                "model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            r.raise_for_status()
            return r.json()["choices"][0]["token_ids"]

        return list(await asyncio.gather(*map(one, prompts)))


def compare(model: str, device: str, dtype: str, prompts: list[list[int]],
            served: dict[str, list[list[int]]], max_tokens: int) -> dict[str, list[dict]]:
    """Each transport's tokens against transformers' greedy ones: one row per prompt."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model, dtype=getattr(torch, dtype)).to(device).eval()
    rows: dict[str, list[dict]] = {t: [] for t in served}
    for i, prompt in enumerate(prompts):
        out = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=max_tokens,
                          min_new_tokens=max_tokens, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
        want = out.sequences[0, len(prompt):].tolist()
        for transport, tokens in served.items():
            got = tokens[i]
            row = {"prompt_tokens": len(prompt), "equal": got == want, "parted_at": None}
            if got != want:
                k = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b),
                         min(len(got), len(want)))
                row["parted_at"] = k
                if k < min(len(got), len(want)):
                    logits = out.logits[k][0].float()
                    row["rank"] = int((logits > logits[got[k]]).sum())
                    row["gap"] = float(logits.max() - logits[got[k]])
            rows[transport].append(row)
    del hf
    if device != "cpu":
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda", help="cuda, or cpu to try the check here")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--lengths", type=int, nargs="+", default=[1, 17, 123, 600, 1500, 2900],
                   help="prompt lengths in tokens, one prompt each")
    p.add_argument("--transports", nargs="+", default=["cuda_ipc"],
                   help="KV transports between the workers, one stack each")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--up-args", default="", help="more `pdserve up` flags")
    p.add_argument("--out", type=Path, help="a JSON file for the rows")
    args = p.parse_args()
    vocab = transformers.AutoConfig.from_pretrained(args.model).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(min(vocab, 2000)) for _ in range(n)] for n in args.lengths]
    results, failed = {}, False
    for dtype in args.dtypes:
        served = {}
        for transport in args.transports:
            log = Path(tempfile.gettempdir()) / f"pdserve-hf-greedy-{dtype}-{transport}.log"
            t0 = time.monotonic()
            proc, url, _ = launch(args.model, [
                "--device", args.device, "--dtype", dtype,
                "--prefill-worker-args", f"--kv-transports {transport}",
                "--decode-worker-args", f"--kv-transports {transport}",
                *args.up_args.split()], log)
            try:
                served[transport] = asyncio.run(served_tokens(url, prompts, args.max_tokens))
            finally:
                stop([proc])
            print(f"{dtype} over {transport}: served in {time.monotonic() - t0:.0f} s")
        for transport, rows in compare(args.model, args.device, dtype, prompts, served,
                                       args.max_tokens).items():
            results[f"{dtype} {transport}"] = rows
            print(f"{dtype} over {transport}: prompt tokens, equal, verdict, parted at, "
                  "served token's rank and logit gap in transformers")
            for r in rows:
                ok = r["equal"] or (dtype != "float32" and r.get("rank", TOP_K) < TOP_K)
                failed |= not ok
                parted = "" if r["equal"] else f"{r['parted_at']:4d}  {r.get('rank', '-')!s:>4}  " \
                    + (f"{r['gap']:.4f}" if "gap" in r else "")
                print(f"  {r['prompt_tokens']:5d}  {'yes' if r['equal'] else 'no ':3s}  "
                      f"{'ok  ' if ok else 'FAIL'}  {parted}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
