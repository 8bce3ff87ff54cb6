"""Does Python `peft` load a ragen-lab LoRA adapter onto its HF base and compute what
`ragen-lab model merge` computes?

    python tools/check_peft.py RUN_DIR/checkpoints/step-000002/policy [--bin target/release/ragen-lab]

Needs torch, transformers, peft, safetensors. The base comes from the adapter's
`base_model_name_or_path` (a preset such as tiny-llama works offline): a zero adapter merged onto
it gives the base as an HF folder. Prints the largest logit difference between peft(base + adapter)
and ragen-lab's merged model, and how far the adapter moves the logits (should be well above).
"""
import argparse
import os
import shutil
import subprocess
import tempfile

import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("adapter", help="a PEFT adapter folder written by ragen-lab")
ap.add_argument("--bin", default="target/release/ragen-lab")
args = ap.parse_args()

tmp = tempfile.mkdtemp()
zero = os.path.join(tmp, "zero")
os.makedirs(zero)
shutil.copy(os.path.join(args.adapter, "adapter_config.json"), zero)
t = load_file(os.path.join(args.adapter, "adapter_model.safetensors"))
save_file({k: torch.zeros_like(v) for k, v in t.items()}, os.path.join(zero, "adapter_model.safetensors"))
base_dir, merged_dir = os.path.join(tmp, "base"), os.path.join(tmp, "merged")
subprocess.run([args.bin, "model", "merge", zero, "--out", base_dir], check=True)
subprocess.run([args.bin, "model", "merge", args.adapter, "--out", merged_dir], check=True)

load = lambda d: AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
ids = torch.tensor([[1, 5, 17, 42, 99, 3, 250, 7, 8, 9]])
with torch.no_grad():
    peft_logits = PeftModel.from_pretrained(load(base_dir), args.adapter)(ids).logits
    merged = load(merged_dir)(ids).logits
    base = load(base_dir)(ids).logits
print(f"peft(base + adapter) vs ragen-lab merge: max |diff| = {(peft_logits - merged).abs().max().item():.3g}")
print(f"the adapter's effect (peft vs base):     max |diff| = {(peft_logits - base).abs().max().item():.3g}")
