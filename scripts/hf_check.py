#!/usr/bin/env python3
"""Check a Hugging Face directory written by Flotilla's `export_hf` against
Flotilla's own logits.

    python scripts/hf_check.py DIR [--tol 1e-4]

DIR holds config.json and model.safetensors (from
`model::interop::export_hf`) and flotilla_reference.safetensors (from
`model::interop::write_reference`: `tokens` (B, T) and Flotilla's `logits`
(B*T, V)). The model is loaded with transformers' GPT2LMHeadModel or
LlamaForCausalLM (per config.json's model_type) in float32 on the CPU, with
the eager attention implementation; loading must report no missing,
unexpected or mismatched tensors. It runs the tokens through the model and
prints the max absolute difference and the relative difference
max|hf - flotilla| / max|flotilla|; the exit status is 1 when the relative
difference exceeds --tol (or anything fails to load), 0 otherwise.
"""
import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file


def main():
    ap = argparse.ArgumentParser(description="compare a Flotilla HF export's logits with Flotilla's")
    ap.add_argument("dir", help="directory written by export_hf + write_reference")
    ap.add_argument("--tol", type=float, default=1e-4, help="max relative difference (default %(default)s)")
    args = ap.parse_args()

    import transformers
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    with open(os.path.join(args.dir, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    classes = {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM}
    if model_type not in classes:
        print(f"hf_check: unsupported model_type {model_type!r} in {args.dir}/config.json", file=sys.stderr)
        return 1
    cls = classes[model_type]

    torch.manual_seed(0)
    model, info = cls.from_pretrained(
        args.dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    problems = {k: v for k, v in info.items() if v}
    if problems:
        print(f"hf_check: loading {args.dir} with {cls.__name__} reported {problems}", file=sys.stderr)
        return 1
    model.eval()

    ref = load_file(os.path.join(args.dir, "flotilla_reference.safetensors"))
    tokens = ref["tokens"].to(torch.long)
    flotilla = ref["logits"].to(torch.float64)
    with torch.no_grad():
        hf = model(input_ids=tokens, use_cache=False).logits
    hf = hf.reshape(-1, hf.shape[-1]).to(torch.float64)
    if hf.shape != flotilla.shape:
        print(f"hf_check: HF logits {tuple(hf.shape)} vs Flotilla's {tuple(flotilla.shape)}", file=sys.stderr)
        return 1

    max_abs = (hf - flotilla).abs().max().item()
    scale = flotilla.abs().max().item()
    rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    ok = rel <= args.tol
    print(
        f"hf_check: {cls.__name__} (transformers {transformers.__version__}, torch {torch.__version__}) "
        f"on {tuple(tokens.shape)} tokens: max abs diff {max_abs:.3e}, max |logit| {scale:.3e}, "
        f"relative {rel:.3e} (tol {args.tol:g}): {'OK' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
