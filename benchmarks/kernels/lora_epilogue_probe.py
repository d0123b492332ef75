"""Does XLA fold the LoRA up-projection into the frozen GEMM (cuBLAS beta=1)? Gate+up with LoRA: 3-D and 2-D form,
the up-projection concatenated along K, and no LoRA (the floor); run with and without
XLA_FLAGS=--xla_gpu_enable_triton_gemm=false. Results: benchmarks/results/2026-11-23-dense-step-round3-h200.md."""
import time, re, jax, jax.numpy as jnp
B_, S, K, N, r = 4, 2048, 4096, 14336, 16
bf = jnp.bfloat16
ks = jax.random.split(jax.random.key(0), 6)
x = jax.random.normal(ks[0], (B_, S, K), bf)
Wg = jax.random.normal(ks[1], (N, K), bf) * 0.02
Wu = jax.random.normal(ks[2], (N, K), bf) * 0.02
Ag = jax.random.normal(ks[3], (r, K), bf) * 0.02
Bg = jax.random.normal(ks[4], (N, r), bf) * 0.02
Au, Bu = Ag * 1.1, Bg * 0.9

def lin(x, w):
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=bf)

def lora3(x, W, A, B):
    return lin(x, W) + lin(lin(x, A) * 0.5, B)

def lora2(x, W, A, B):
    x2 = x.reshape(-1, x.shape[-1])
    return (lin(x2, W) + lin(lin(x2, A) * 0.5, B)).reshape(*x.shape[:-1], W.shape[0])

def lora_cat(x, W, A, B):  # the up-projection rides in the frozen GEMM along K: [x | h] @ [W | B]^T
    h = lin(x, A) * 0.5
    return lin(jnp.concatenate([x, h], axis=-1), jnp.concatenate([W, B], axis=1))

def plain(x, W, A, B):  # no LoRA at all: the floor
    return lin(x, W)

for name, f in [("3d", lora3), ("2d", lora2), ("cat", lora_cat), ("plain", plain)]:
    def loss(ab, x):
        ag, bg, au, bu = ab
        g, u = f(x, Wg, ag, bg), f(x, Wu, au, bu)
        return jnp.sum((jax.nn.silu(g) * u).astype(jnp.float32))
    fwd = jax.jit(lambda ab, x: jax.nn.silu(f(x, Wg, ab[0], ab[1])) * f(x, Wu, ab[2], ab[3]))
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1)))
    for tag, fn in (("fwd", fwd), ("fwd+bwd", bwd)):
        c = fn.lower((Ag, Bg, Au, Bu), x).compile()
        text = c.as_text()
        betas = re.findall(r'"beta":(\d)', text)
        out = fn((Ag, Bg, Au, Bu), x); jax.block_until_ready(out)
        t0 = time.perf_counter()
        for _ in range(20):
            out = fn((Ag, Bg, Au, Bu), x)
        jax.block_until_ready(out)
        ms = (time.perf_counter() - t0) / 20 * 1e3
        print(f"{name:8s} {tag:8s} {ms:7.3f} ms  gemms={len(betas)} beta1={betas.count('1')}", flush=True)
