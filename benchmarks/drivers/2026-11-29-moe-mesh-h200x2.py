"""A Qwen3-MoE-like QLoRA step (loss + LoRA gradients) on 1 GPU vs 2 GPUs (data=2), Pallas kernels: does each GPU
run the expert GEMMs on its own rows? Prints the grouped kernel's row count per device, the step time and the
loss/gradient agreement with the single-GPU step on the same global batch."""
import json, re, sys, time
import jax, jax.numpy as jnp, numpy as np
import jaxtune, jaxtune.parallel.sharding as sharding
from jaxtune.models.config import ModelConfig
from jaxtune.models.causal_lm import init_model, segment_positions
from jaxtune.qlora import get_peft_model, quantize_layers
from jaxtune.training.step import loss_and_grads, split_model
from flax import nnx

label = sys.argv[1]
cfg = ModelConfig(model_type="qwen3_moe", vocab_size=32000, hidden_size=1024, intermediate_size=2048, num_layers=4,
                  num_heads=16, num_kv_heads=4, head_dim=64, eos_token_id=0, qk_norm=True, num_experts=64,
                  num_experts_per_tok=8, moe_intermediate_size=512)
m = get_peft_model(quantize_layers(init_model(cfg, dtype="bfloat16", seed=0)), r=16, seed=1)
lora = nnx.state(m, nnx.LoRAParam)
nnx.update(m, jax.tree.map(lambda p: p + 0.02 * jax.random.normal(jax.random.key(2), p.shape, p.dtype), lora))
graphdef, lora, frozen = split_model(m)
jaxtune.set_kernels("pallas")
T, B = 2048, 8
rng = np.random.default_rng(0)
ids = rng.integers(0, cfg.vocab_size, (1, B, T)).astype(np.int32)
seg = np.ones_like(ids)
pos = np.asarray(segment_positions(jnp.asarray(seg.reshape(-1, T)))).reshape(ids.shape)
batch = {"input_ids": ids, "labels": ids, "segment_ids": seg, "positions": pos}

def timed(fn, *args, n=10):
    out = fn(*args); jax.block_until_ready(out)
    for _ in range(2): jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(n): out = fn(*args)
    jax.block_until_ready(out)
    return out, (time.perf_counter() - t) / n

fn1 = jax.jit(lambda l, f, b: loss_and_grads(graphdef, l, f, b, None, 1024)[:2])
(ref_loss, ref_grads), t1 = timed(fn1, lora, frozen, {k: jnp.asarray(v) for k, v in batch.items()})
half = {k: jnp.asarray(v[:, :B // 2]) for k, v in batch.items()}
_, t1_half = timed(fn1, lora, frozen, half)
mesh = sharding.make_mesh("data=2", jax.devices()[:2])
l, f = sharding.shard_state(mesh, lora), sharding.shard_state(mesh, frozen)
with jax.set_mesh(mesh):
    fn2 = jax.jit(lambda l, f, b: loss_and_grads(graphdef, l, f, b, None, 1024)[:2])
    gb = sharding.global_batch(mesh, batch)
    hlo = fn2.lower(l, f, gb).compile().as_text()
    (loss, grads), t2 = timed(fn2, l, f, gb)
rows = sorted({int(m.group(1)) for m in re.finditer(r"= bf16\[(\d+),\d+\]\{1,0\} custom-call\(", hlo)})
diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
           for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)))
scale = max(float(jnp.max(jnp.abs(b.astype(jnp.float32)))) for b in jax.tree.leaves(ref_grads))
print(json.dumps({"tree": label, "device": jax.devices()[0].device_kind, "tokens": B * T,
                  "one_gpu_all_rows_ms": round(t1 * 1e3, 1), "one_gpu_half_rows_ms": round(t1_half * 1e3, 1),
                  "two_gpus_data2_ms": round(t2 * 1e3, 1), "loss": float(loss), "ref_loss": float(ref_loss),
                  "grad_max_abs_diff": diff, "grad_scale": scale, "custom_call_row_counts_per_device": rows}))
