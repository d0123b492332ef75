import numpy as np, jax, jax.numpy as jnp, gguf
from jaxtune.quant import quantize_q4_0
from jaxtune.quant import q4_0 as Q
rng = np.random.default_rng(0)
w = rng.standard_normal((14336, 4096), dtype=np.float32)
ours = quantize_q4_0(w); ref = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)
ob = ours.reshape(-1, 18); rb = ref.reshape(-1, 18)
bad = np.nonzero((ob != rb).any(-1))[0]
print("blocks", len(ob), "bad", len(bad), "scale-bytes bad", int((ob[:, :2] != rb[:, :2]).any(-1).sum()))
wb = w.reshape(-1, 32)
for i in bad[:3]:
    blk = wb[i]; m = blk[np.abs(blk).argmax()]; d = np.float32(m) / np.float32(-8); inv = np.float32(1) / d
    s = blk * inv
    print(i, "ours", ob[i].tolist(), "\n ref ", rb[i].tolist())
    j = np.nonzero(ob[i] != rb[i])[0]
    print(" differing bytes", j.tolist())
# the inverse on device vs numpy
bl = jnp.asarray(wb[bad[:64]])
d = jnp.take_along_axis(bl, jnp.argmax(jnp.abs(bl), -1, keepdims=True), -1) / -8
inv_dev = np.asarray(jax.jit(lambda d: 1 / d)(d)); dn = np.asarray(d)
print("d equal", bool((dn == (wb[bad[:64]][np.arange(64), np.abs(wb[bad[:64]]).argmax(-1)][:, None] / np.float32(-8))).all()),
      "inverse equal", bool((inv_dev == np.float32(1) / dn).all()))
prod_dev = np.asarray(jax.jit(lambda b, i: b * i)(bl, jnp.asarray(np.float32(1) / dn)))
print("product equal", bool((prod_dev == wb[bad[:64]] * (np.float32(1) / dn)).all()))
