"""GGUF import of llama.cpp's `llama` (Llama, Mistral, Mixtral), `qwen3` and `qwen3moe` architectures: tensors under
their HF names, config and tokenizer.

Quantized GGUF tensors are dequantized with the `gguf` package one tensor at a time (a layer's stack of experts once
for its experts). For `llama`, llama.cpp's converter permutes the rows of q/k projections for its interleaved RoPE;
they are permuted back to the rotate_half layout HF checkpoints (and jaxtune) use; Qwen3's are as HF has them.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

import numpy as np

from convert.moe_names import expert_layout
from jaxtune.errors import CheckpointError, UnsupportedModelError

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen3", "qwen3moe")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IGNORED = re.compile(r"^rope_freqs\.weight$|\.attn_rot_embd$")  # rope_freqs is read into the config
LLAMA3_ORIGINAL_CONTEXT = 8192  # Llama 3.1-3.3's original_max_position_embeddings, where a file does not say


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _hf_names(gguf_name: str, model_type: str, experts: int) -> list[tuple[str, int | None]] | None:
    """[(HF name, index into the GGUF tensor's leading expert axis or None)] of one GGUF tensor, None if unknown."""
    name = _hf_name(gguf_name)
    m = re.fullmatch(r"blk\.(\d+)\.ffn_(gate_inp|gate_exps|up_exps|down_exps)\.weight", gguf_name)
    if name is not None or m is None or not experts:
        return None if name is None else [(name, None)]
    module, hub_names = expert_layout(model_type)  # the router, and each layer's experts stacked per projection
    layer = f"model.layers.{m.group(1)}.{module}"
    if m.group(2) == "gate_inp":
        return [(f"{layer}.gate.weight", None)]
    hf = hub_names[m.group(2).replace("_exps", "_proj")]
    return [(f"{layer}.experts.{e}.{hf}.weight", e) for e in range(experts)]


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation (interleaved pairs -> rotate_half halves), per head."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_from_factors(factors: np.ndarray, theta: float, head_dim: int, original_context: int
                             ) -> dict[str, Any] | None:
    """HF's llama3 `rope_scaling` for llama.cpp's `rope_freqs` (per-pair divisors of the unscaled frequencies).

    llama3 scaling divides low frequencies by `factor`, keeps high ones, and in between interpolates 1/divisor
    linearly in 1/wavelength; that line fixes (low_freq_factor, high_freq_factor) / original_context, so with the
    file's original context (else Llama 3.1's) the parameters follow. They are checked by recomputing the divisors.
    None when every divisor is 1 (no scaling).
    """
    from jaxtune.models.rope import llama3_inverse_frequencies, unscaled_inverse_frequencies

    if factors.shape != (head_dim // 2,):
        raise CheckpointError(f"GGUF rope_freqs has {factors.size} values, the model's heads need {head_dim // 2}; "
                              "the file is inconsistent")
    if np.allclose(factors, 1.0):
        return None
    unsupported = UnsupportedModelError("the GGUF rope_freqs tensor does not follow llama3 RoPE scaling; "
                                        "unsupported (convert the model from its HF directory instead)")
    factor = float(factors.max())
    plain = unscaled_inverse_frequencies(theta, head_dim)
    smooth = (1.0 / factors - 1.0 / factor) / (1.0 - 1.0 / factor)  # 0 where fully scaled, 1 where unscaled
    medium = (smooth > 1e-4) & (smooth < 1 - 1e-4)
    if medium.sum() < 2:
        raise unsupported
    # smooth = original_context * x / (high - low) - low / (high - low), x = 1 / wavelength
    slope, intercept = np.polyfit(plain[medium] / (2 * np.pi), smooth[medium], 1)
    span = original_context / slope
    low = round(float(-intercept * span), 4)
    high = round(low + float(span), 4)
    if not np.allclose(plain / llama3_inverse_frequencies(plain, factor, low, high, original_context), factors,
                       rtol=1e-4):
        raise unsupported
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": original_context}


@functools.cache
def _plain_array_reader() -> type:
    """gguf's reader, reading its fields through a plain ndarray view of the file's memory map: numpy's memmap
    subclass costs ~25 us per slice, and a tokenizer's vocabulary and merges are ~250,000 slices (the bundled
    SmolLM2: 6.3 s to open, 1.6 s this way; same fields, same zero-copy tensors). The library's own reader where
    its internals differ from the version this was written against."""
    import gguf

    base = gguf.GGUFReader
    if not callable(getattr(base, "_get", None)):
        return base

    class PlainArrayReader(base):
        @property
        def data(self) -> np.memmap:
            return self._memmap

        @data.setter
        def data(self, memmap: np.memmap) -> None:  # the reader's first act: the view is taken once, here
            self._memmap, self._plain = memmap, memmap.view(np.ndarray)

        def _get(self, offset, dtype, count=1, override_order=None):
            dtype, count = np.dtype(dtype), int(count)
            arr = self._plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return PlainArrayReader


class GGUFSource:
    """A GGUF file seen as HF-named tensors plus an HF-style config dict."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise CheckpointError(f"GGUF file {self.path} does not exist; check the path")
        reader = _plain_array_reader()  # outside the try: a missing package is not a bad file
        try:
            self._reader = reader(self.path)
        except Exception as e:  # the reader raises ValueError/struct errors/IndexError on bad bytes
            raise CheckpointError(f"{self.path} is not a readable GGUF file ({type(e).__name__}: {e}); re-download it") from None
        arch = self._field("general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
            )
        self.arch = arch
        self.hf_config = self._build_config()
        model_type = self.hf_config["model_type"]
        experts = int(self.hf_config.get("num_experts") or self.hf_config.get("num_local_experts") or 0)
        self._tensors: dict[str, tuple[Any, int | None]] = {}  # HF name -> (GGUF tensor, expert index or None)
        self._stack: tuple[str, np.ndarray] | None = None  # the last expert stack dequantized, for its experts
        for t in self._reader.tensors:
            names = _hf_names(t.name, model_type, experts)
            if names is not None:
                self._tensors.update((name, (t, e)) for name, e in names)
            elif not _IGNORED.search(t.name):
                raise UnsupportedModelError(f"GGUF tensor {t.name!r} has no counterpart in a {model_type} model; "
                                            "unsupported variant")

    def _field(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def _build_config(self) -> dict[str, Any]:
        p = self.arch + "."
        experts = self._field(p + "expert_count")
        model_type = {"qwen3": "qwen3", "qwen3moe": "qwen3_moe"}.get(self.arch, "mixtral" if experts else "llama")
        try:
            hidden = int(self._field(p + "embedding_length"))
            heads = int(self._field(p + "attention.head_count"))
            cfg: dict[str, Any] = {
                "model_type": model_type,
                "hidden_size": hidden,
                "intermediate_size": int(self._field(p + "feed_forward_length")),
                "num_hidden_layers": int(self._field(p + "block_count")),
                "num_attention_heads": heads,
                "num_key_value_heads": int(self._field(p + "attention.head_count_kv", heads)),
                "head_dim": int(self._field(p + "attention.key_length", hidden // heads)),
                "rms_norm_eps": float(self._field(p + "attention.layer_norm_rms_epsilon", 1e-5)),
                "rope_theta": float(self._field(p + "rope.freq_base", 10000.0)),
                "max_position_embeddings": int(self._field(p + "context_length", 4096)),
                "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
                "eos_token_id": self._field("tokenizer.ggml.eos_token_id"),
            }
            if experts:  # llama.cpp's MoE renormalizes each token's top-k routing weights
                used, width = int(self._field(p + "expert_used_count")), self._field(p + "expert_feed_forward_length")
                if model_type == "mixtral":
                    cfg.update(num_local_experts=int(experts), num_experts_per_tok=used)
                else:
                    cfg.update(num_experts=int(experts), num_experts_per_tok=used, norm_topk_prob=True,
                               moe_intermediate_size=int(width if width is not None else cfg["intermediate_size"]))
        except TypeError:
            raise CheckpointError(f"{self.path} lacks {p}* hyper-parameters; the GGUF file is incomplete") from None
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        vocab = self._field(p + "vocab_size")
        cfg["vocab_size"] = int(vocab if vocab is not None else len(tokens.data))
        scaling = self._field(p + "rope.scaling.type")
        freqs = next((t for t in self._reader.tensors if t.name == "rope_freqs.weight"), None)
        if freqs is not None and scaling in (None, "none"):  # llama.cpp writes llama3 scaling as this tensor alone
            context = self._field(p + "rope.scaling.original_context_length")
            cfg["rope_scaling"] = llama3_rope_from_factors(
                np.asarray(freqs.data, np.float64).reshape(-1), cfg["rope_theta"], cfg["head_dim"],
                LLAMA3_ORIGINAL_CONTEXT if context is None else int(context))
        elif scaling == "linear" and freqs is None:
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(self._field(p + "rope.scaling.factor"))}
        elif scaling not in (None, "none"):
            raise UnsupportedModelError(f"unsupported GGUF rope scaling {scaling!r}"
                                        f"{' with a rope_freqs tensor' if freqs is not None else ''}; supported: none, "
                                        "linear, and llama3 (the rope_freqs tensor)")
        cfg["tie_word_embeddings"] = not any(t.name == "output.weight" for t in self._reader.tensors)
        return cfg

    def end_of_generation_ids(self) -> tuple[int, ...]:
        """llama.cpp's end-of-turn and end-of-message ids beside its eos (the ids its sampler also stops at)."""
        ids = [self._field(f"tokenizer.ggml.{kind}_token_id") for kind in ("eot", "eom")]
        return tuple(int(i) for i in ids if i is not None)

    def names(self) -> list[str]:
        return list(self._tensors)

    def tokenizer(self):
        """The file's tokenizer (vocabulary, special tokens, chat template), built without torch."""
        from convert.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(self._field, self.path)

    def shape(self, name: str) -> tuple[int, ...]:
        t, expert = self._tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        return shape if expert is None else shape[1:]

    def get(self, name: str) -> np.ndarray:
        import gguf

        t, expert = self._tensors[name]
        if expert is not None:
            if self._stack is None or self._stack[0] != t.name:
                shape = tuple(int(d) for d in reversed(t.shape.tolist()))
                self._stack = t.name, gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
            return self._stack[1][expert]
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(self.shape(name))
        if self.arch != "llama":  # Qwen3's q/k rows are HF's (llama.cpp's NEOX RoPE)
            return w
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, self.hf_config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, self.hf_config["num_key_value_heads"])
        return w

    def close(self) -> None:
        pass

    def __enter__(self) -> "GGUFSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
