#!/usr/bin/env python3
"""Reference values for crates/model/tests/optim.rs (AdamW against PyTorch).

Run with a PyTorch venv:  python scripts/golden/adamw_reference.py

Prints, for each case, the parameters and both moments (exp_avg, exp_avg_sq)
after a few torch.optim.AdamW steps (single-tensor path: foreach=False,
fused=False, on CPU) as Rust constants to paste into the test. The inputs
use all 24 mantissa bits yet are exact in f32 (a 24-bit integer times a power
of two); the Rust test rebuilds them from the same integer formulas.

Every tensor has 32 elements (a multiple of twice the AVX2 and AVX512 vector
widths), so PyTorch's CPU kernels run their vectorised loops on every element
(the scalar tail loops may round differently). On an AVX2/AVX512 build those
loops use fused multiply-adds for `lerp_` and `addcmul_`, which the Rust
implementation reproduces bit for bit: the moments must match exactly.

The parameters match to about one ulp only: x86 PyTorch builds compute
`Tensor.sqrt()` with MKL's vsSqrt (VML_HA), which returns the value one ulp
below the correctly rounded square root for about 0.6% of inputs; Rust (and
PyTorch on CUDA or non-MKL builds) use the IEEE square root.

The learning rates are f32 values, since the Rust API takes `lr: f32`.
"""
import numpy as np
import torch

N = 32
STEPS = 3


def mix(j, step):
    """A 24-bit integer from element index `j` and `step`."""
    return ((j * 2654435761 + step * 40503) % 2**32) >> 8


def param0(j):
    """Initial parameter of flat element `j`: |p| in [0.25, 1), full mantissa."""
    mag = (2**22 + mix(j, 0) % (3 * 2**22)) / 2**24
    return -mag if j % 3 == 0 else mag


def grad(j, step):
    """Gradient of flat element `j` at 1-based `step`, over 12 binades."""
    return (mix(j, step) - 2**23) / 2**23 / 2 ** (j % 12)


def run(name, blocks, lr, betas, eps, groups):
    """`groups`: list of (block indices, weight_decay); block k holds flat elements k*N..(k+1)*N."""
    tensors = [
        torch.tensor([param0(k * N + i) for i in range(N)], dtype=torch.float32, requires_grad=True)
        for k in range(blocks)
    ]
    opt = torch.optim.AdamW(
        [{"params": [tensors[k] for k in ks], "weight_decay": wd} for ks, wd in groups],
        lr=lr, betas=betas, eps=eps, foreach=False, fused=False,
    )
    for step in range(1, STEPS + 1):
        for k, t in enumerate(tensors):
            t.grad = torch.tensor([grad(k * N + i, step) for i in range(N)], dtype=torch.float32)
        opt.step()
    print(f"// {name}: lr={lr!r} betas={betas} eps={eps} groups={groups} steps={STEPS}")
    for suffix, get in [("P", lambda t: t.detach()), ("M", lambda t: opt.state[t]["exp_avg"]),
                        ("V", lambda t: opt.state[t]["exp_avg_sq"])]:
        flat = torch.cat([get(t) for t in tensors]).numpy()
        vals = [np.format_float_scientific(np.float32(x), unique=True) for x in flat]
        print(f"const {name}_{suffix}: [f32; {len(flat)}] = [")
        for r in range(0, len(vals), 4):
            print("    " + ", ".join(vals[r:r + 4]) + ",")
        print("];")


def f32(x):
    return float(np.float32(x))


def main():
    print(f"// torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}")
    # torch.optim.AdamW defaults (weight_decay 0.01), every element decayed.
    run("DEFAULTS", 1, f32(1e-3), (0.9, 0.999), 1e-8, [([0], 0.01)])
    # No weight decay, other betas and eps.
    run("NO_DECAY", 1, f32(1e-2), (0.8, 0.99), 1e-6, [([0], 0.0)])
    # A decay mask as two parameter groups: blocks 0 and 2 decayed, block 1 not.
    run("MASKED", 3, f32(2e-2), (0.9, 0.95), 1e-8, [([0, 2], 0.1), ([1], 0.0)])
    # beta1 < 0.5: lerp weight 1 - beta1 >= 0.5 takes PyTorch's other lerp formula.
    run("LOW_BETA1", 1, f32(5e-3), (0.3, 0.5), 1e-8, [([0], 0.05)])


if __name__ == "__main__":
    main()
