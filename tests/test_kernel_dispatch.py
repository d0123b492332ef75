"""Kernel dispatch: `JAXTUNE_KERNELS` / `set_kernels`, and the model run through the Pallas kernels
(interpret mode) giving the same logits and LoRA gradients as the XLA reference."""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxtune
from jaxtune.ops import dispatch
from jaxtune.models.config import ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.models.causal_lm import init_model
from jaxtune.qlora import get_peft_model, quantize_layers


@pytest.fixture(autouse=True)
def reset_mode(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    yield
    jaxtune.set_kernels(None)


def test_mode_from_env_and_setter(monkeypatch):
    assert jaxtune.kernel_mode() == "auto"
    monkeypatch.setenv("JAXTUNE_KERNELS", "xla")
    assert jaxtune.kernel_mode() == "xla"
    jaxtune.set_kernels("pallas-interpret")
    assert jaxtune.kernel_mode() == "pallas-interpret" and dispatch.interpret()
    jaxtune.set_kernels(None)
    assert jaxtune.kernel_mode() == "xla"
    monkeypatch.setenv("JAXTUNE_KERNELS", "triton")
    with pytest.raises(JaxtuneError, match="unknown kernel mode 'triton'.*auto, xla, pallas"):
        jaxtune.kernel_mode()
    with pytest.raises(JaxtuneError, match="set_kernels"):
        jaxtune.set_kernels("fast")


def test_auto_uses_xla_on_cpu_and_the_measured_table_on_gpu(monkeypatch):
    assert dispatch.nf4_impl(1) == "xla" and dispatch.attention_impl(True) == "xla"
    monkeypatch.setattr(dispatch, "_on_gpu", lambda: True)
    assert [dispatch.nf4_impl(m) for m in (1, 16, 64, 65, 2048)] == ["fused"] * 3 + ["dequant+dot"] * 2
    assert dispatch.attention_impl(plain_causal=True) == "cudnn"  # one sequence per row: cuDNN
    assert dispatch.attention_impl(plain_causal=False) == "pallas"  # packed segments, windows: Pallas
    jaxtune.set_kernels("cudnn")
    assert dispatch.attention_impl(True) == "cudnn" and dispatch.attention_impl(False) == "pallas"
    jaxtune.set_kernels("pallas")
    assert dispatch.attention_impl(True) == "pallas"
    jaxtune.set_kernels("xla")
    assert dispatch.nf4_impl(1) == "xla" and dispatch.attention_impl(True) == "xla"
    jaxtune.set_kernels("pallas")
    assert dispatch.nf4_impl(4096) == "fused"


def test_wide_heads_run_cudnn_on_hopper_else_the_wide_pallas_tiles(monkeypatch):
    """Heads of 256 (Qwen3.5's full layers, Gemma 4's sliding ones): cuDNN's flash attention on Hopper and later for
    plain causal rows, the Pallas kernel's wide tiles for packed rows, windows and older GPUs; heads of 512 (Gemma
    4's full layers) XLA (measured faster), the Pallas kernel only under the Pallas modes; other widths XLA."""
    monkeypatch.setattr(dispatch, "_on_gpu", lambda: False)
    assert dispatch.attention_impl(True, head_dim=256) == "xla"  # CPU
    monkeypatch.setattr(dispatch, "_on_gpu", lambda: True)
    monkeypatch.setattr(dispatch, "_compute_capability", lambda: (9, 0))
    assert dispatch.attention_impl(True, head_dim=256) == "cudnn"
    assert dispatch.attention_impl(False, head_dim=256) == "pallas"
    assert dispatch.attention_impl(True, head_dim=512) == "xla" and dispatch.attention_impl(False, head_dim=512) == "xla"
    assert dispatch.attention_impl(True, head_dim=96) == "xla"
    assert dispatch.attention_impl(True, head_dim=128) == "cudnn"
    monkeypatch.setattr(dispatch, "_compute_capability", lambda: (8, 0))
    assert dispatch.attention_impl(True, head_dim=256) == "pallas"
    monkeypatch.setattr(dispatch, "_compute_capability", lambda: (9, 0))
    jaxtune.set_kernels("pallas")
    assert dispatch.attention_impl(True, head_dim=256) == "pallas"


def kernel_model(model_type: str = "llama", dtype: str = "float32"):
    """2-layer QLoRA Llama (or Qwen3: q/k norms, head_dim 64 with 4 heads over hidden 128) whose shapes the
    kernels take: head_dim 64, GQA, dims multiples of 64."""
    heads = 4 if model_type == "qwen3" else 2
    cfg = ModelConfig(model_type=model_type, vocab_size=320, hidden_size=128, intermediate_size=192, num_layers=2,
                      num_heads=heads, num_kv_heads=heads // 2, head_dim=64, qk_norm=model_type == "qwen3")
    model = get_peft_model(quantize_layers(init_model(cfg, dtype=dtype, seed=0)), r=4, seed=1)
    lora = nnx.state(model, nnx.LoRAParam)
    nnx.update(model, jax.tree.map(lambda p: p + 0.02 * jax.random.normal(jax.random.key(2), p.shape, p.dtype), lora))
    return model


def packed_rows():
    """(token ids, segment ids) of two 64-token rows, the first packing two sequences: the inputs of the layer-scan,
    remat and offload checks, whose cached references were computed on these same rows."""
    ids = jax.random.randint(jax.random.key(0), (2, 64), 0, 320)
    seg = jnp.asarray(np.array([[1] * 40 + [2] * 24, [1] * 64]), jnp.int32)
    return ids, seg


def logits_and_grads(model, ids, seg):
    """(logits, LoRA gradients, the jaxpr computing both): one trace, compiled and read (tracing a model through the
    interpreted kernels costs seconds)."""
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)

    def loss(lora):
        logits = nnx.merge(graphdef, lora, rest)(ids, segment_ids=seg)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1)), logits

    traced = jax.jit(jax.value_and_grad(loss, has_aux=True)).trace(lora)
    (_, logits), grads = traced.lower().compile()(lora)
    return logits, grads, traced.jaxpr


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_model_with_pallas_kernels_matches_xla(model_type):
    model = kernel_model(model_type)
    if model_type == "qwen3":  # norms that are not all ones
        for norm in (model.layers.self_attn.q_norm, model.layers.self_attn.k_norm):
            norm.weight.set_value(1.0 + 0.1 * jax.random.normal(jax.random.key(3), norm.weight[...].shape))
    ids = jax.random.randint(jax.random.key(0), (2, 45), 0, 320)
    seg = jnp.asarray(np.array([[1] * 20 + [2] * 19 + [0] * 6, [1] * 7 + [2] * 30 + [3] * 8]), jnp.int32)
    jaxtune.set_kernels("xla")
    ref_logits, ref_grads, ref_jaxpr = logits_and_grads(model, ids, seg)
    jaxtune.set_kernels("pallas-interpret")
    logits, grads, jaxpr = logits_and_grads(model, ids, seg)
    assert "pallas_call" not in str(ref_jaxpr)
    assert str(jaxpr).count("pallas_call") >= 2  # flash attention and the fused NF4 matmul ran
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=2e-5, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-4)



def residuals_and_grad_jaxpr(model, ids, seg, residuals: bool = True):
    """(bytes of the residuals saved for the backward pass, or None without `residuals`, the gradient's jaxpr)."""
    from jax._src.ad_checkpoint import saved_residuals

    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)

    def loss(lora):
        return jnp.mean(nnx.merge(graphdef, lora, rest)(ids, segment_ids=seg))

    nbytes = sum(aval.size * aval.dtype.itemsize for aval, _ in saved_residuals(loss, lora)) if residuals else None
    return nbytes, jax.make_jaxpr(jax.grad(loss))(lora).jaxpr


def sub_jaxprs(eqn):
    """The jaxprs inside an equation's parameters (scan and checkpoint bodies, custom rules, ...)."""
    for p in eqn.params.values():
        for sub in p if isinstance(p, (tuple, list)) else (p,):
            inner = getattr(sub, "jaxpr", sub)
            if hasattr(inner, "eqns"):
                yield inner


def all_eqns(jaxpr):
    """Every equation of jaxpr and of its sub-jaxprs."""
    for e in jaxpr.eqns:
        yield e
        for inner in sub_jaxprs(e):
            yield from all_eqns(inner)


def live_eqns(jaxpr, matches) -> int:
    """How many equations `matches(eqn)` accepts have a used output (dead ones XLA removes), through sub-jaxprs."""
    used = {v for e in jaxpr.eqns for v in e.invars if not isinstance(v, jax.extend.core.Literal)}
    used |= {v for v in jaxpr.outvars if not isinstance(v, jax.extend.core.Literal)}
    count = 0
    for e in jaxpr.eqns:
        count += matches(e) and any(v in used for v in e.outvars)
        count += sum(live_eqns(inner, matches) for inner in sub_jaxprs(e))
    return count


def kernel_name(eqn) -> str | None:
    """The Pallas kernel an equation calls, None for other primitives."""
    if eqn.primitive.name != "pallas_call":
        return None
    return str(eqn.params.get("name_and_src_info", eqn.params.get("name", ""))).split(" ")[0]


def live_calls(jaxpr, name: str) -> int:
    """Live pallas_calls of kernel `name`."""
    return live_eqns(jaxpr, lambda e: kernel_name(e) == name)


def live_primitives(jaxpr, name: str) -> int:
    """Live equations of primitive `name`."""
    return live_eqns(jaxpr, lambda e: e.primitive.name == name)


def assert_matches_reference(got_outputs, want_outputs, compute: str) -> None:
    """Logits and LoRA gradients as the XLA reference's: to float32 rounding in bf16 mode; in FP8 mode the same
    e4m3 operands summed in another order, so later roundings to FP8 flip (measured 1.8e-2 at most)."""
    for got, want in zip(jax.tree.leaves(got_outputs), jax.tree.leaves(want_outputs)):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        if compute == "bf16":
            np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=1e-5)
        else:
            assert np.linalg.norm(got - want) <= 3e-2 * np.linalg.norm(want)


@pytest.mark.parametrize("compute, impl", [("bf16", "dequant+dot"), ("bf16", "fused"), ("fp8", "dequant+dot")])
def test_layer_scan_reads_nf4_codes_in_place(monkeypatch, compute, impl):
    """Inside the layer scan the NF4 kernels (dequant, fused forward and dx) read each layer's codes from the
    whole stack (a slice of it handed to a kernel is a copy on GPU), with the reference's logits and LoRA
    gradients (with the scales prepared for all layers, and with each layer dequantizing its own under "full"
    remat), and under every remat policy the stack is never saved per layer for the backward pass."""
    model = kernel_model()
    model.compute = compute
    ids, seg = packed_rows()
    ref_logits, ref_grads = _xla_reference(compute)
    jaxtune.set_kernels("pallas-interpret")
    monkeypatch.setattr(dispatch, "nf4_impl", lambda m: impl)  # GPU's choices for training / decoding shapes
    stack_shapes = {a.shape for a in jax.tree.leaves(nnx.state(model, nnx.PathContains("codes")))}
    # FP8's e4m3 kernel reads the same stack viewed as uint16 (two code bytes per element; a bitcast, no copy)
    view_shapes = {(*shape[:-1], shape[-1] // 2) for shape in stack_shapes}
    layers = model.config.num_layers
    for policy in ("none", "selective", "full"):
        model.remat_policy = policy
        # "selective" runs the kernels of "none" (it only saves fewer residuals: test_remat_policies_* checks its
        # gradients); "none" and "full" are the two ways the kernels get their scales, whose results the bf16 cases
        # check (FP8 takes the same scales: its numbers are checked once, its kernels' operands under every policy)
        # the fused kernels are the Pallas modes' own choice: "none" is the remat tests' reference (computed once per
        # worker), which they compare "full" with
        if (compute, impl) == ("bf16", "fused"):
            if policy == "none":
                assert_matches_reference(_no_remat_reference()[:2], (ref_logits, ref_grads), compute)
        elif policy == "none" or (policy == "full" and compute == "bf16"):
            assert_matches_reference(logits_and_grads(model, ids, seg)[:2], (ref_logits, ref_grads), compute)
        _, jaxpr = residuals_and_grad_jaxpr(model, ids, seg, residuals=False)
        nf4_kernels = [e for e in all_eqns(jaxpr)
                       if kernel_name(e) in ("nf4_dequantize", "nf4_dequantize_e4m3", "nf4_matmul", "nf4_matmul_dx")]
        assert nf4_kernels and all(any(v.aval.shape in stack_shapes | view_shapes for v in e.invars)
                                   for e in nf4_kernels), policy
        assert (compute == "fp8") == any(kernel_name(e) == "nf4_dequantize_e4m3" for e in nf4_kernels), policy
        # the stack (or its view) saved once per layer would be an array [layers, *stack]
        stacked_twice = [e for e in all_eqns(jaxpr) for v in e.outvars if v.aval.dtype in (jnp.uint8, jnp.uint16)
                         and v.aval.shape[:1] == (layers,) and v.aval.shape[1:] in stack_shapes | view_shapes]
        assert not stacked_twice, (policy, stacked_twice[:1])
        prepared = {(layers, k // 64, n) for layers, n, k in ((s[0], s[1], 2 * s[2]) for s in stack_shapes)}
        in_scan = [e.primitive.name for e in scan_body_eqns(jaxpr)]
        if policy == "full":  # a memory-saving mode: no float32 stack of every layer's scales lives through the
            # step; each layer dequantizes its own absmax codes inside the scan
            assert not any(v.aval.shape in prepared for e in nf4_kernels for v in e.invars), policy
            assert "gather" in in_scan, policy
            continue
        # the block scales (and FP8's row scales) are prepared for all layers before the scan: the kernels read
        # a float32 stack [layers, K/64, N], and no layer body dequantizes absmax codes (a gather from the 8-bit
        # map) or reduces a weight's scales to its rows
        assert all(any(v.aval.shape in prepared for v in e.invars) for e in nf4_kernels), policy
        assert "gather" not in in_scan and "reduce_max" not in in_scan, policy


def scan_body_eqns(jaxpr, inside: bool = False):
    """The equations inside scan bodies (through other sub-jaxprs, never into a Pallas kernel's own)."""
    for e in jaxpr.eqns:
        if inside:
            yield e
        if e.primitive.name != "pallas_call":
            for inner in sub_jaxprs(e):
                yield from scan_body_eqns(inner, inside or e.primitive.name == "scan")


@functools.cache
def _xla_reference(compute: str):
    """The logits and LoRA gradients of kernel_model() in `compute` mode through XLA alone, once per worker."""
    model = kernel_model()
    model.compute = compute
    ids, seg = packed_rows()
    jaxtune.set_kernels("xla")
    try:
        return logits_and_grads(model, ids, seg)[:2]
    finally:
        jaxtune.set_kernels(None)


@functools.cache
def _no_remat_reference():
    """The logits, gradients, residual bytes and gradient jaxpr of kernel_model() without remat (Pallas,
    interpreted): what every remat policy is compared with, computed once per worker."""
    model = kernel_model()
    ids, seg = packed_rows()
    jaxtune.set_kernels("pallas-interpret")
    return (*logits_and_grads(model, ids, seg)[:2], *residuals_and_grad_jaxpr(model, ids, seg))


@pytest.mark.parametrize("unrolled", [False, True], ids=["loop", "unrolled"])
@pytest.mark.parametrize("policy", ["selective", "full"])
def test_remat_policies_keep_gradients_and_selective_redoes_no_kernel(policy, unrolled):
    """Remat changes what the backward pass keeps, never the gradients; "selective" keeps projection outputs
    and the attention residuals, so its backward pass re-runs no attention forward and no matmul. The same
    with the layers unrolled (one traced layer each, no stacks)."""
    model = kernel_model()
    ids, seg = packed_rows()
    jaxtune.set_kernels("pallas-interpret")
    _, ref_grads, none_bytes, none_jaxpr = _no_remat_reference()
    model.remat_policy, model.unroll_layers = policy, unrolled
    _, grads, _ = logits_and_grads(model, ids, seg)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-5)
    nbytes, jaxpr = residuals_and_grad_jaxpr(model, ids, seg)
    assert nbytes < 0.7 * none_bytes
    assert live_calls(none_jaxpr, "flash_attention_fwd") == 1
    per_layer = model.config.num_layers if unrolled else 1  # a call per traced layer
    assert live_calls(jaxpr, "flash_attention_fwd") == per_layer * (1 if policy == "selective" else 2)


@pytest.mark.gpu
def test_single_sequence_rows_run_cudnn_attention_with_pallas_gradients():
    """Rows of one sequence (then padding) take cuDNN's causal attention; its loss and gradients match the
    Pallas kernel's on the same rows, and selective remat keeps cuDNN's forward outputs (no recompute)."""
    from jaxtune.models.remat import CUDNN_ATTENTION_FORWARD

    jaxtune.set_kernels("auto")
    model = kernel_model(dtype="bfloat16")
    model.remat_policy = "selective"
    ids = jax.random.randint(jax.random.key(0), (2, 256), 0, 320)
    seg = jnp.asarray(np.array([[1] * 256, [1] * 200 + [0] * 56]), jnp.int32)
    real = np.asarray(seg) > 0
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)

    def loss_of(graphdef):  # over real tokens only: padding attends differently, and carries no loss
        def loss(lora):
            logits = nnx.merge(graphdef, lora, rest)(ids, segment_ids=seg).astype(jnp.float32)
            return jnp.sum(jnp.where(seg > 0, jax.nn.logsumexp(logits, axis=-1), 0.0)) / jnp.sum(seg > 0), logits
        return loss

    (_, ref_logits), ref_grads = jax.value_and_grad(loss_of(graphdef), has_aux=True)(lora)  # segment ids: Pallas
    model.single_sequence_rows = True
    cudnn_graphdef = nnx.split(model, nnx.LoRAParam, ...)[0]
    (_, logits), grads = jax.value_and_grad(loss_of(cudnn_graphdef), has_aux=True)(lora)
    assert "pallas_call" in str(jax.make_jaxpr(loss_of(graphdef))(lora))
    assert CUDNN_ATTENTION_FORWARD in str(jax.make_jaxpr(loss_of(cudnn_graphdef))(lora))
    diff = np.abs(np.asarray(logits) - np.asarray(ref_logits))[real]
    assert diff.max() < 0.05 * np.abs(np.asarray(ref_logits)).max()
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.abs(got - want).max() <= 0.05 * np.abs(want).max() + 1e-6
    _, grad_jaxpr = residuals_and_grad_jaxpr(model, ids, seg, residuals=False)
    assert live_primitives(grad_jaxpr, CUDNN_ATTENTION_FORWARD) == 1


@pytest.mark.parametrize("group, on_device", [(1, 0), (2, 0), (1, 1)])
def test_offload_policy_moves_layer_inputs_to_host_and_tiles_the_mlp(monkeypatch, group, on_device):
    """Long-context mode: layer inputs saved in host memory (one per group of layers when host memory is short,
    the layers between recomputed; or the last layers' inputs kept on device), MLP run in token tiles; gradients
    unchanged."""
    from jax._src.ad_checkpoint import saved_residuals

    import jaxtune.models.causal_lm

    # at most 48 tokens of the 192-wide MLP: 2 x 64 tokens -> 3 tiles of 48, the last padded
    monkeypatch.setattr(jaxtune.models.causal_lm, "offload_mlp_token_tile", lambda cfg: 48)
    model = kernel_model()
    ids, seg = packed_rows()
    jaxtune.set_kernels("pallas-interpret")
    ref_logits, ref_grads, _, _ = _no_remat_reference()
    model.remat_policy, model.offload_group, model.offload_device_layers = "offload", group, on_device
    logits, grads, jaxpr = logits_and_grads(model, ids, seg)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=2e-5, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-5)
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    saved = saved_residuals(lambda l: jnp.mean(nnx.merge(graphdef, l, rest)(ids, segment_ids=seg)), lora)
    on_host = [aval for aval, _ in saved if "<host>" in aval.str_short()]
    assert [a.shape for a in on_host] == [((2 - on_device) // group, 2, 64, 128)]  # [layers / group, B, T, hidden]
    if on_device:  # and the kept layer's input stays on device, stacked like a scan output
        assert any(a.shape == (on_device, 2, 64, 128) and "<host>" not in a.str_short() for a, _ in saved)
    assert "length=3" in str(jaxpr)  # the MLP ran as a map over 3 token tiles
    model.offload_group, model.offload_device_layers = 3, 0
    with pytest.raises(ValueError, match="does not divide the 2 offloaded layers"):
        logits_and_grads(model, ids, seg)


@pytest.mark.gpu
def test_wide_head_attention_on_cudnn_equals_xla():
    """Heads of 256 on a Hopper GPU: cuDNN's flash attention, forward and gradients, equals XLA's attention."""
    from jaxtune.ops.attention import attention

    if (dispatch._compute_capability() or (0, 0))[0] < 9:
        pytest.skip("cuDNN's heads of 256 need Hopper or later")
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (2, 256, 8, 256), jnp.bfloat16)
    k, v = (jax.random.normal(key, (2, 256, 2, 256), jnp.bfloat16) for key in keys[1:3])
    w = jax.random.normal(keys[3], q.shape, jnp.float32)

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v).astype(jnp.float32) * w)

    jaxtune.set_kernels("auto")
    assert "__cudnn$fmha" in jax.jit(loss).lower(q, k, v).as_text()  # cuDNN's fused attention custom call
    got = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    jaxtune.set_kernels("xla")
    want = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= 0.03 * np.abs(b).max()
