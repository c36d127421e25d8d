#!/usr/bin/env python3
"""Golden fixtures for crates/model/tests/golden.rs: Flotilla's decoder
re-implemented in plain PyTorch, run forward and backward on two tiny
configs, saved as safetensors.

Run with a PyTorch venv that has `safetensors`:

    python scripts/golden/make_fixtures.py [--out crates/model/tests/fixtures]

It writes golden_gpt2.safetensors and golden_llama.safetensors, each holding

  <name>          every parameter under Flotilla's name, in Flotilla's layout
                  (float32; linear weights (out, in) like nn.Linear; the fused
                  qkv weight's rows [q heads | k heads | v heads], the SwiGLU
                  fc weight's rows [gate | up])
  grad.<name>     d(mean loss)/d(parameter), same shape (float32)
  tokens, targets (B, T) int64
  logits          (B*T, V) float32
  loss            (1,) float32, the mean cross-entropy over the B*T positions

and in the metadata the model config under `flotilla.*` keys (the format
`model::interop::config_to_metadata` writes), plus `golden.*` notes.

Precision: the parameters are drawn as float32 (torch.manual_seed, fixed per
fixture); the forward and backward are then evaluated in float64 on those
exact values and the results rounded to float32, so the stored outputs are
the correctly rounded answer for the stored inputs (within float64 error) and
the Rust test measures only Flotilla's own float32 error. The script also
runs the same model in float32 PyTorch and prints how far that lands from the
float64 answer: PyTorch's own float32 noise floor, for scale.

The architecture (pre-norm decoder, see crates/model/src/block.rs):
  x = wte[tokens] (+ wpe[:T])
  per block: x += proj(attn(rope(qkv(norm1(x))))); x += fcp(act(fc(norm2(x))))
  logits = norm_f(x) @ (lm_head or wte)^T
with F.scaled_dot_product_attention(is_causal=True) (kv heads repeated for
grouped-query attention, query head j reading kv head j // (H/K)), RoPE in
Hugging Face Llama's rotate_half convention, exact GELU via F.gelu, SwiGLU as
silu(gate) * up.
"""
import argparse
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

B, T = 2, 16

GPT2 = dict(
    layers=2, d_model=32, heads=4, kv_heads=4, ffn=128, vocab=64, seq_len=16,
    norm="layernorm", activation="gelu", positions="learned", rope_theta=None,
    tied_embeddings=True, bias=True, norm_eps=1e-5, dropout=0.0,
)
LLAMA = dict(
    layers=2, d_model=32, heads=4, kv_heads=2, ffn=48, vocab=64, seq_len=16,
    norm="rmsnorm", activation="swiglu", positions="rope", rope_theta=10000.0,
    tied_embeddings=False, bias=False, norm_eps=1e-5, dropout=0.0,
)


def head_dim(c):
    return c["d_model"] // c["heads"]


def layout(c):
    """Flotilla's parameter table, in buffer order: [(name, shape, kind)]
    (crates/model/src/layout.rs)."""
    C, V, D = c["d_model"], c["vocab"], head_dim(c)
    qkv = (c["heads"] + 2 * c["kv_heads"]) * D
    fin = 2 * c["ffn"] if c["activation"] == "swiglu" else c["ffn"]
    ln_bias = c["bias"] and c["norm"] == "layernorm"
    out = [("wte", (V, C), "emb")]
    if c["positions"] == "learned":
        out.append(("wpe", (c["seq_len"], C), "pos"))
    for l in range(c["layers"]):
        p = f"h.{l}."
        out.append((p + "ln1.weight", (C,), "gain"))
        if ln_bias:
            out.append((p + "ln1.bias", (C,), "bias"))
        out.append((p + "attn.qkv.weight", (qkv, C), "matrix"))
        if c["bias"]:
            out.append((p + "attn.qkv.bias", (qkv,), "bias"))
        out.append((p + "attn.proj.weight", (C, c["heads"] * D), "resid"))
        if c["bias"]:
            out.append((p + "attn.proj.bias", (C,), "bias"))
        out.append((p + "ln2.weight", (C,), "gain"))
        if ln_bias:
            out.append((p + "ln2.bias", (C,), "bias"))
        out.append((p + "mlp.fc.weight", (fin, C), "matrix"))
        if c["bias"]:
            out.append((p + "mlp.fc.bias", (fin,), "bias"))
        out.append((p + "mlp.proj.weight", (C, c["ffn"]), "resid"))
        if c["bias"]:
            out.append((p + "mlp.proj.bias", (C,), "bias"))
    out.append(("ln_f.weight", (C,), "gain"))
    if ln_bias:
        out.append(("ln_f.bias", (C,), "bias"))
    if not c["tied_embeddings"]:
        out.append(("lm_head.weight", (V, C), "matrix"))
    return out


# Standard deviations: large enough that attention is far from uniform,
# norms are not near identity and the GELU/SiLU curvature matters.
SCALE = dict(emb=0.3, pos=0.1, matrix=0.2, resid=0.1, bias=0.05)


def init(c, seed):
    g = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape, kind in layout(c):
        r = torch.randn(shape, generator=g, dtype=torch.float32)
        params[name] = 1.0 + 0.1 * r if kind == "gain" else SCALE[kind] * r
    return params


def norm(c, x, w, b):
    if c["norm"] == "layernorm":
        return F.layer_norm(x, (x.shape[-1],), w, b, c["norm_eps"])
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c["norm_eps"]) * w


def rope_tables(c, t, dtype):
    """cos, sin of shape (t, D/2): pos * theta^(-2i/D), computed in float64."""
    D = head_dim(c)
    i = torch.arange(D // 2, dtype=torch.float64)
    inv_freq = c["rope_theta"] ** (-(2.0 * i) / D)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rope(x, cos, sin):
    """rotate_half on x (B, heads, T, D)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def linear(x, p, name):
    return F.linear(x, p[name + ".weight"], p.get(name + ".bias"))


def forward(c, p, tokens):
    """Logits (B*T, V) of Flotilla's decoder with parameters p."""
    Bn, Tn = tokens.shape
    H, K, D = c["heads"], c["kv_heads"], head_dim(c)
    x = p["wte"][tokens]
    if c["positions"] == "learned":
        x = x + p["wpe"][:Tn]
    tables = rope_tables(c, Tn, x.dtype) if c["positions"] == "rope" else None
    for l in range(c["layers"]):
        pre = f"h.{l}."
        h = norm(c, x, p[pre + "ln1.weight"], p.get(pre + "ln1.bias"))
        qkv = linear(h, p, pre + "attn.qkv")
        q, k, v = qkv.split([H * D, K * D, K * D], dim=-1)
        q = q.view(Bn, Tn, H, D).transpose(1, 2)
        k = k.view(Bn, Tn, K, D).transpose(1, 2)
        v = v.view(Bn, Tn, K, D).transpose(1, 2)
        if tables is not None:
            q, k = rope(q, *tables), rope(k, *tables)
        k = k.repeat_interleave(H // K, dim=1)
        v = v.repeat_interleave(H // K, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(Bn, Tn, H * D)
        x = x + linear(y, p, pre + "attn.proj")
        h = norm(c, x, p[pre + "ln2.weight"], p.get(pre + "ln2.bias"))
        f = linear(h, p, pre + "mlp.fc")
        if c["activation"] == "gelu":
            a = F.gelu(f)
        elif c["activation"] == "gelu_tanh":
            a = F.gelu(f, approximate="tanh")
        else:
            gate, up = f.split(c["ffn"], dim=-1)
            a = F.silu(gate) * up
        x = x + linear(a, p, pre + "mlp.proj")
    x = norm(c, x, p["ln_f.weight"], p.get("ln_f.bias"))
    head = p["wte"] if c["tied_embeddings"] else p["lm_head.weight"]
    return (x @ head.T).reshape(Bn * Tn, -1)


def run(c, params32, tokens, targets, dtype):
    p = {k: v.to(dtype).clone().requires_grad_(True) for k, v in params32.items()}
    logits = forward(c, p, tokens)
    loss = F.cross_entropy(logits, targets.reshape(-1))
    loss.backward()
    return logits.detach(), loss.detach(), {k: v.grad for k, v in p.items()}


def metadata(c, seed):
    m = {
        "format": "pt",
        "golden.seed": str(seed),
        "golden.batch": str(B),
        "golden.seq_len": str(T),
        "golden.precision": "float32 inputs, float64 forward/backward, outputs rounded to float32",
    }
    for k, v in c.items():
        if v is None:
            continue
        m["flotilla." + k] = (
            ("true" if v else "false") if isinstance(v, bool) else repr(float(v)) if isinstance(v, float) else str(v)
        )
    return m


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)).item()


def make(name, c, seed, out_dir):
    torch.manual_seed(seed)
    params = init(c, seed)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, c["vocab"], (B, T), generator=g)
    targets = torch.randint(0, c["vocab"], (B, T), generator=g)

    logits, loss, grads = run(c, params, tokens, targets, torch.float64)
    l32, loss32, g32 = run(c, params, tokens, targets, torch.float32)

    floor = {"logits": rel(l32, logits), "loss": rel(loss32, loss)}
    floor.update({"grad." + k: rel(g32[k], grads[k]) for k in grads})
    worst = max(floor, key=floor.get)
    print(f"{name}: loss {loss.item():.6f}; float32 PyTorch vs float64: worst {worst} {floor[worst]:.2e}, "
          f"logits {floor['logits']:.2e}, loss {floor['loss']:.2e}")

    tensors = {k: v.contiguous() for k, v in params.items()}
    tensors.update({"grad." + k: v.to(torch.float32).contiguous() for k, v in grads.items()})
    tensors["tokens"] = tokens.to(torch.int64).contiguous()
    tensors["targets"] = targets.to(torch.int64).contiguous()
    tensors["logits"] = logits.to(torch.float32).contiguous()
    tensors["loss"] = loss.reshape(1).to(torch.float32)
    path = os.path.join(out_dir, f"golden_{name}.safetensors")
    save_file(tensors, path, metadata=metadata(c, seed))
    os.chmod(path, 0o644)
    print(f"  wrote {path} ({os.path.getsize(path)} bytes, {len(tensors)} tensors)")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    default_out = os.path.normpath(os.path.join(here, "..", "..", "crates", "model", "tests", "fixtures"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=default_out, help="output directory (default: %(default)s)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    make("gpt2", GPT2, 1234, args.out)
    make("llama", LLAMA, 5678, args.out)


if __name__ == "__main__":
    main()
