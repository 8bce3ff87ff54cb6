#!/usr/bin/env python3
"""PyTorch + transformers side of `ragen-lab bench policy`: the same measurements, the same JSON.

Measures, for a causal LM on CPU with a fixed thread count (default 2, to match candle's two cores):
- generation tokens/s at batch 1, 8 and 32: greedy, the same ChatML prompt in every row, up to
  `--new-tokens` new tokens, stopping at EOS; tokens counted are the ones actually generated, time
  is the whole call (prefill and a KV-cache decode loop), the best of `--repeats`;
- training tokens/s at batch 8 x 256: random token ids (fixed seed), next-token cross-entropy over
  every position, backward, one AdamW step (lr 1e-5); step 0 is a warm-up and not counted.

Writes the JSON that `ragen-lab bench policy --compare FILE` reads (keys documented in
src/starpo/policy_bench.rs). Needs torch, transformers, accelerate and gguf (for a .gguf model):

    python3 -m venv /tmp/torchenv && /tmp/torchenv/bin/pip install torch transformers accelerate gguf
    /tmp/torchenv/bin/python tools/bench_pytorch.py --model ~/.cache/ragen-lab/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf \
        --out bench-pytorch.json
"""
import argparse
import json
import os
import platform
import resource
import time

PROMPT = "Which is bigger, 3 or 7? Answer in <answer></answer>."


def load(model_path, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_path.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(model_path))
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    else:
        tok = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return tok, model


def greedy(torch, model, input_ids, mask, new_tokens, eos):
    """Greedy decoding with the KV cache, one token per live row per step; a row stops after EOS.

    A plain loop rather than `generate` so both engines do the same work: prefill once, then
    one forward of [B, 1] per step until every row is done or the budget is spent.
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    rows = [[] for _ in range(input_ids.shape[0])]
    live = [True] * len(rows)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
        for _ in range(new_tokens):
            nxt = logits[:, -1].argmax(-1)  # [B]
            for b, tok in enumerate(nxt.tolist()):
                if live[b]:
                    rows[b].append(tok)
                    live[b] = tok != eos
            if not any(live):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            logits = model(input_ids=nxt[:, None], attention_mask=mask, past_key_values=cache, use_cache=True).logits
    return rows


def bench_generation(torch, tok, model, batches, new_tokens, repeats):
    messages = [{"role": "user", "content": PROMPT}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = prompt["input_ids"]
    eos = tok.eos_token_id
    results = []
    model.eval()
    first_reply = None
    for batch in batches:
        input_ids = ids.repeat(batch, 1)
        mask = torch.ones_like(input_ids)
        best = None
        for _ in range(repeats):
            start = time.perf_counter()
            new = greedy(torch, model, input_ids, mask, new_tokens, eos)
            secs = time.perf_counter() - start
            generated = sum(len(row) for row in new)
            if best is None or secs < best[0]:
                best = (secs, generated)
            if first_reply is None:
                first_reply = tok.decode(new[0], skip_special_tokens=False)
        secs, generated = best
        results.append({"batch": batch, "prompt_tokens": int(ids.shape[1]), "generated_tokens": generated,
                        "seconds": secs, "tokens_per_s": generated / secs})
        print(f"generation  batch {batch:>2}: {generated:>5} tokens in {secs:7.2f} s = {generated / secs:8.1f} tok/s",
              flush=True)
    return results, first_reply


def bench_training(torch, model, vocab, batch, seq_len, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=gen)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    timings = []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        logits = model(input_ids=ids).logits  # [B, T, V]
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        del logits
        print(f"training step {step}: forward {t1 - t0:.2f} s, backward {t2 - t1:.2f} s, "
              f"optimizer {t3 - t2:.2f} s, loss {loss.item():.4f}" + (" (warm-up)" if step == 0 else ""), flush=True)
        if step > 0:
            timings.append((t1 - t0, t2 - t1, t3 - t2))
    n = len(timings)
    fwd, bwd, opt_s = (sum(t[i] for t in timings) / n for i in range(3))
    step_s = fwd + bwd + opt_s
    return {"batch": batch, "seq_len": seq_len, "steps": n, "forward_s": fwd, "backward_s": bwd,
            "optimizer_s": opt_s, "step_s": step_s, "tokens_per_s": batch * seq_len / step_s}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a .gguf file or a Hugging Face model folder")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (match candle's)")
    ap.add_argument("--batches", default="1,8,32", help="generation batch sizes, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=64, help="new tokens per generated row")
    ap.add_argument("--repeats", type=int, default=2, help="generation runs per batch size; the best counts")
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--train-seq", type=int, default=256)
    ap.add_argument("--train-steps", type=int, default=2, help="measured training steps after one warm-up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-training", action="store_true")
    ap.add_argument("--out", help="write the results JSON here")
    args = ap.parse_args()

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    tok, model = load(args.model, torch.float32)
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f} s "
          f"({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {args.threads} threads)", flush=True)

    batches = [int(b) for b in args.batches.split(",") if b]
    generation, reply = bench_generation(torch, tok, model, batches, args.new_tokens, args.repeats)
    print(f"greedy reply (batch row 0): {reply!r}", flush=True)
    training = None
    if not args.skip_training:
        training = bench_training(torch, model, model.config.vocab_size, args.train_batch, args.train_seq,
                                  args.train_steps, args.seed)
        print(f"training {args.train_batch}x{args.train_seq}: {training['step_s']:.2f} s/step = "
              f"{training['tokens_per_s']:.1f} tok/s", flush=True)
    result = {
        "engine": f"pytorch {torch.__version__} + transformers {transformers.__version__}",
        "model": args.model,
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "new_tokens": args.new_tokens,
        "generation": generation,
        "training": training,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "greedy_reply": reply,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
