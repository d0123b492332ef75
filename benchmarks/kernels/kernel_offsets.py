"""Why a 2-4 GiB stack of NF4 codes is read one layer at a time (pallas_kernels/addressing.py), on the GPU:
Llama-3-70B's q_proj codes stacked over 80 layers (2.5 GiB), a layer dequantized by the Pallas kernel read in
place from the stack (the guard off) and as the wrappers now hand it over, each against the jnp reference.

    PYTHONPATH=. python3 benchmarks/kernels/kernel_offsets.py            # guarded (what jaxtune runs)
    PYTHONPATH=. python3 benchmarks/kernels/kernel_offsets.py --unguarded  # the stack read in place: may crash
One JSON line per layer: mismatched values and the largest difference.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels.nf4_dequant as kernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--unguarded", action="store_true", help="read the whole stack in place (32-bit offsets)")
    args = ap.parse_args()
    if args.unguarded:
        kernels.addressable = lambda shape, dtype: True
    n, half, layers = 8192, 4096, 80
    stack = jax.random.randint(jax.random.key(0), (layers, n, half), 0, 256, jnp.int32).astype(jnp.uint8)
    absmax = jax.random.uniform(jax.random.key(1), (n, 2 * half // 64), jnp.float32, 0.01, 0.1)
    dequant = jax.jit(lambda s, a, i: kernels.nf4_dequantize(s, a, layer=i))
    for layer in (0, 40, 79):
        want = np.asarray(kernels.nf4_dequantize_reference(stack[layer], absmax), np.float32)
        got = np.asarray(dequant(stack, absmax, jnp.int32(layer)), np.float32)
        print(json.dumps({"stack": [layers, n, half], "layer": layer, "guarded": not args.unguarded,
                          "byte_offset_of_layer": layer * n * half, "mismatched": int((got != want).sum()),
                          "max_abs_diff": float(np.abs(got - want).max())}), flush=True)


if __name__ == "__main__":
    main()
