"""GPU check of the training step taking the optimizer's numbers as arguments: auto batch (GPU memory planning through
the step's `lower`), a plain and an offloaded-optimizer step, and a learning-rate sweep loading one compiled step."""
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxtune
from jaxtune.models.config import ModelConfig
from jaxtune.models.causal_lm import init_model
from jaxtune.qlora import get_peft_model, quantize_layers
from jaxtune.training.autobatch import choose_micro_batch
from jaxtune.training.optimizer_offload import place_on_host
from jaxtune.training.step import make_optimizer, make_train_step, split_model

cfg_m = ModelConfig(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_layers=4,
                    num_heads=16, num_kv_heads=8, head_dim=128)
model = get_peft_model(quantize_layers(init_model(cfg_m, dtype="bfloat16", seed=0)), r=16)
graphdef, lora, frozen = split_model(model)
print(jax.devices()[0].device_kind)
cfg = jaxtune.TrainConfig(seq_len=2048, micro_batch_size="auto", max_steps=10, learning_rate=1e-4)
opt_state = make_optimizer(cfg).init(lora)
micro = choose_micro_batch(cfg, make_train_step(graphdef, cfg), lora, opt_state, frozen)
print("auto micro batch", micro)
rng = np.random.default_rng(0)
ids = rng.integers(0, 32000, (1, 2, 2048)).astype(np.int32)
batch = {"input_ids": ids, "labels": ids, "segment_ids": np.ones_like(ids),
         "positions": np.broadcast_to(np.arange(2048, dtype=np.int32), ids.shape).copy()}
for lr in (1e-4, 3e-4):  # the second lowers to the same program: a cache hit, not a compile
    c = jaxtune.TrainConfig(seq_len=2048, micro_batch_size=2, max_steps=10, learning_rate=lr)
    step = make_train_step(graphdef, c)
    t = time.perf_counter()
    l2, o2, m = step(jax.tree.map(jnp.copy, lora), jax.tree.map(jnp.copy, opt_state), frozen, batch, np.int32(1))
    print(f"lr {lr}: loss {float(m['loss']):.4f} lr metric {float(m['lr']):.3e} first call {time.perf_counter() - t:.1f} s")
c = jaxtune.TrainConfig(seq_len=2048, micro_batch_size=2, max_steps=10, offload_optimizer=True)
step = make_train_step(graphdef, c)
_, _, m = step(jax.tree.map(jnp.copy, lora), place_on_host(make_optimizer(c).init(lora)), frozen, batch, np.int32(1))
print(f"offloaded optimizer: loss {float(m['loss']):.4f}, finite {int(m['skipped']) == 0}")
print("all-done")
