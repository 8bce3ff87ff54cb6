#!/usr/bin/env python3
"""Reference logits from PyTorch + transformers for the tiny fixture models in tests/fixtures/.

The fixture models are written by our own code (tests/policy_tools.rs,
`write_reference_fixture_models`, an ignored test run by hand); this script loads each one with
transformers' own Llama / Qwen2 classes, independently of our loader and model code, runs fixed
token ids through it and writes, next to the model, `reference.json`:

    {"model_sha256": sha256 of model.safetensors (the test checks it, so stale values are caught),
     "torch": ..., "transformers": ...,
     "sequences": [{"ids": [...], "logits": [[V floats] per position],
                    "logprobs": [null, log p(ids[t] | ids[<t]) for t >= 1]}]}

Regenerate (needs torch and transformers; any CPU build is fine):

    cargo test --test policy_tools -- --ignored write_reference_fixture_models
    /tmp/torchenv/bin/python tools/reference_logits.py tests/fixtures/tiny-llama-ref tests/fixtures/tiny-qwen2-ref
"""
import hashlib
import json
import sys


def token_ids(vocab, length, mult, add):
    # Spread over the vocabulary, special tokens included; deterministic and readable.
    return [(mult * i + add) % vocab for i in range(length)]


def reference(folder):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    vocab = model.config.vocab_size
    # Two lengths, so the Rust side can also score them as one right-padded batch.
    seqs = [token_ids(vocab, 12, 37, 5), token_ids(vocab, 7, 101, 3)]
    out = []
    for ids in seqs:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].double()  # [T, V]
        logp = torch.log_softmax(logits, dim=-1)
        lps = [None] + [logp[t - 1, ids[t]].item() for t in range(1, len(ids))]
        out.append({"ids": ids, "logits": [[round(x, 7) for x in row] for row in logits.tolist()], "logprobs": lps})
    with open(f"{folder}/model.safetensors", "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    result = {
        "about": "written by tools/reference_logits.py from this folder's model with transformers; do not edit",
        "model_sha256": sha,
        "architecture": model.config.architectures,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "sequences": out,
    }
    path = f"{folder}/reference.json"
    with open(path, "w") as f:
        json.dump(result, f)
        f.write("\n")
    big = max(abs(x) for s in out for row in s["logits"] for x in row)
    print(f"wrote {path} ({model.config.architectures[0]}, vocab {vocab}, max |logit| {big:.3f})")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for folder in sys.argv[1:]:
        reference(folder.rstrip("/"))
