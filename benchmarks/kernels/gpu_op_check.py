"""Where a training run's kernel modes part ways on the GPU: each fast op and one decoder layer against XLA's float32
arithmetic, in bfloat16 and float32, at the shapes and row layout of benchmarks/accuracy/qat_random_llama.py (Llama-3.2-1B's
heads, 64-token rows packed with several samples and padding) and at Llama-3-8B's. Prints one JSON line per check
(the largest error relative to the reference's largest value, per output); it asserts nothing.

    PYTHONPATH=. python3 benchmarks/kernels/gpu_op_check.py [--model] [--quick]
--model: a four-layer model at the 1B shapes instead (the training loss, each op swapped for XLA's in turn);
--quick: bfloat16 and the 1B shapes only, two rows (a dry run on a CPU, kernels interpreted).
"""

from __future__ import annotations

import json
import traceback

import jax
import jax.numpy as jnp
import numpy as np

INTERPRET = jax.default_backend() != "gpu"  # a dry run of this script on a CPU
SHAPES = {  # hidden, MLP, heads, KV heads, head dim
    "llama3.2-1b": (2048, 8192, 32, 8, 64),
    "llama3-8b": (4096, 14336, 32, 8, 128),
}


def packed_segments(rows: int, t: int, seed: int) -> np.ndarray:
    """Rows of samples 8-24 tokens long, numbered from 1, the tail 0 (padding), as jaxtune's packing lays them out."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((rows, t), np.int32)
    for r in range(rows):
        at, sid = 0, 1
        while True:
            n = int(rng.integers(8, 25))
            if at + n > t - 4:
                break
            seg[r, at:at + n] = sid
            at, sid = at + n, sid + 1
    return seg


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def attention_check(name: str, dtype, t: int, rows: int, packed: bool) -> dict:
    from jaxtune.ops.attention import attention
    from pallas_kernels.flash_attention import flash_attention

    _, _, heads, kv_heads, d = SHAPES[name]
    keys = jax.random.split(jax.random.key(t + rows), 4)
    q = jax.random.normal(keys[0], (rows, t, heads, d), jnp.float32)
    k = jax.random.normal(keys[1], (rows, t, kv_heads, d), jnp.float32)
    v = jax.random.normal(keys[2], (rows, t, kv_heads, d), jnp.float32)
    do = jax.random.normal(keys[3], (rows, t, heads, d), jnp.float32)
    seg = jnp.asarray(packed_segments(rows, t, 0)) if packed else None

    def reference(q, k, v):
        with jax.default_matmul_precision("highest"):
            return attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg) if packed else attention(q, k, v)

    def flash(q, k, v):
        return flash_attention(q, k, v, seg, interpret=INTERPRET) if packed else \
            flash_attention(q, k, v, interpret=INTERPRET)

    import jaxtune
    jaxtune.set_kernels("xla")
    want, vjp = jax.vjp(jax.jit(reference), q, k, v)
    want_grads = vjp(do)
    jaxtune.set_kernels(None)
    cast = [a.astype(dtype) for a in (q, k, v)]
    got, vjp = jax.vjp(jax.jit(flash), *cast)
    grads = vjp(do.astype(dtype))
    if packed:  # padding rows (segment 0) are not compared: nothing reads them
        keep = np.asarray(seg > 0)[..., None, None]
        want, got = np.where(keep, want, 0), np.where(keep, np.asarray(got, np.float32), 0)
    out = {"out": rel(got, want)}
    for n, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        out[n] = rel(np.asarray(g, np.float32), w)
    return out


def layer_check(name: str, dtype: str, t: int, rows: int, modes: tuple[str, ...], layers: int = 1) -> dict:
    """One decoder layer (`layers` > 1: a model of that many, scanned as training scans them, its loss the
    next-token cross-entropy) under each mode against XLA in float32 products; a mode "a/b" runs mode a with
    dispatch's b replaced by XLA (`attention`, `nf4`, `dequant`); "perturbed" is XLA with the adapters moved by
    half a bf16 step: how far rounding alone moves the gradients at this random point."""
    from flax import nnx

    import jaxtune
    from jaxtune.models.config import ModelConfig
    from jaxtune.models.causal_lm import init_model
    from jaxtune.qlora import quantize_layers
    from jaxtune.training.step import split_model

    hidden, mlp, heads, kv_heads, d = SHAPES[name]
    cfg = ModelConfig(model_type="llama", vocab_size=512, hidden_size=hidden, intermediate_size=mlp, num_layers=layers,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=d, eos_token_id=1)
    model = quantize_layers(init_model(cfg, dtype=dtype, seed=0))
    jaxtune.get_peft_model(model, r=8, lora_alpha=16)
    lora = nnx.state(model, nnx.LoRAParam)
    nnx.update(model, jax.tree.map(lambda a: a + 0.01 * jax.random.normal(jax.random.key(1), a.shape, a.dtype), lora))
    graphdef, lora, frozen = split_model(model)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 512, (rows, t)), jnp.int32)
    seg_np = packed_segments(rows, t, 1)
    pos_np = np.zeros_like(seg_np)
    for r in range(rows):
        for s in np.unique(seg_np[r]):
            idx = np.nonzero(seg_np[r] == s)[0]
            pos_np[r, idx] = np.arange(len(idx))
    seg, pos = jnp.asarray(seg_np), jnp.asarray(pos_np)
    readout = jax.random.normal(jax.random.key(7), (hidden,), jnp.float32)
    keep = jnp.asarray(seg_np > 0, jnp.float32)

    labels = jnp.asarray(rng.integers(0, 512, (rows, t)), jnp.int32)

    def loss(lora):
        model = nnx.merge(graphdef, lora, frozen)
        if layers == 1:
            h = model.hidden_states(ids, pos, seg)
            return jnp.sum(jnp.tanh(h.astype(jnp.float32) @ readout) * keep) / jnp.sum(keep)
        logp = jax.nn.log_softmax(model(ids, pos, seg).astype(jnp.float32))
        return -jnp.sum(jnp.take_along_axis(logp, labels[..., None], -1)[..., 0] * keep) / jnp.sum(keep)

    def run(kernels: str, adapters=None):
        from jaxtune.ops import dispatch

        mode, _, replaced = kernels.partition("/")
        saved = {f: getattr(dispatch, f) for f in ("attention_impl", "nf4_impl", "nf4_dequant_impl")}
        if replaced == "attention":
            dispatch.attention_impl = lambda plain_causal: "xla"
        elif replaced == "nf4":
            dispatch.nf4_impl = lambda m: "xla"
        elif replaced == "dequant":
            dispatch.nf4_dequant_impl = lambda: "xla"
        jaxtune.set_kernels(mode)
        try:
            value, grads = jax.jit(jax.value_and_grad(loss))(lora if adapters is None else adapters)
        finally:
            jaxtune.set_kernels(None)
            for f, fn in saved.items():
                setattr(dispatch, f, fn)
        return float(value), {".".join(map(str, p)): np.asarray(g.get_value(), np.float32)
                              for p, g in nnx.to_flat_state(grads)}

    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        want_loss, want = run("xla")
    finally:
        jax.config.update("jax_default_matmul_precision", None)
    out = {"xla_loss": want_loss}
    for mode in modes:
        try:
            if mode == "perturbed":
                moved = jax.tree.map(lambda a: a * (1 + 2.0**-9 * jax.random.normal(jax.random.key(5), a.shape,
                                                                                    a.dtype)), lora)
                got_loss, got = run("xla", moved)
            else:
                got_loss, got = run(mode)
        except Exception as err:  # noqa: BLE001 - a diagnostic: record and go on
            out[mode] = {"error": str(err).splitlines()[0][:300]}
            continue
        errs = {p: rel(got[p], w) for p, w in want.items()}
        worst = sorted(errs.items(), key=lambda kv: -kv[1])[:4]
        out[mode] = {"loss": got_loss, "worst": [[p, round(e, 5)] for p, e in worst]}
    return out


def main() -> None:
    import sys

    device = jax.devices()[0].device_kind
    quick = "--quick" in sys.argv  # the 1B shapes in bfloat16 only, few rows (a CPU dry run)
    names, dtypes = (["llama3.2-1b"], [jnp.bfloat16]) if quick else (list(SHAPES), [jnp.bfloat16, jnp.float32])
    checks = []
    for name in names:
        for dtype in dtypes:
            layouts = ((64, 2 if quick else 16, True), (64, 16, False), (256, 2, True))
            for t, rows, packed in layouts[:1 if quick else 3]:
                checks.append(("attention", name, dtype, t, rows, packed))
    for name in names:
        for dtype in dtypes:
            checks.append(("layer", name, jnp.dtype(dtype).name, 64, 2 if quick else 16, None))
    if "--model" in sys.argv:  # four layers at the 1B shapes, the training loss: which op parts the modes' runs
        checks = [("model", "llama3.2-1b", jnp.dtype(dtype).name, 64, 2 if quick else 16, None) for dtype in dtypes]
    for kind, name, dtype, t, rows, packed in checks:
        record = {"check": kind, "shapes": name, "dtype": jnp.dtype(dtype).name, "t": t, "rows": rows,
                  "packed": packed, "device": device}
        try:
            if kind == "attention":
                record.update(attention_check(name, dtype, t, rows, packed))
            elif kind == "layer":
                modes = ("xla", "pallas-interpret") if INTERPRET else ("xla", "auto", "pallas")
                record.update(layer_check(name, dtype, t, rows, modes))
            else:
                modes = ("xla", "perturbed", "pallas-interpret") if INTERPRET else (
                    "xla", "perturbed", "auto", "auto/attention", "auto/dequant", "pallas", "pallas/attention",
                    "pallas/nf4")
                record.update(layer_check(name, dtype, t, rows, modes, layers=4))
        except Exception as err:  # noqa: BLE001
            record["error"] = traceback.format_exception_only(err)[-1].strip()[:300]
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
