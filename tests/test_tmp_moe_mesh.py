import numpy as np
import pytest
import jaxtune
from conftest import build_hf_model
from test_moe import CONFIGS


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_mesh(tmp_path, tiny_tokenizer, family):
    config = CONFIGS[family](vocab_size=len(tiny_tokenizer))
    build_hf_model(config, tmp_path / "base")
    rows = [{"text": f"row {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3)} for i in range(16)]
    out = {}
    for mesh in (None, "data=2", "fsdp=2"):
        model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=True)
        cfg = jaxtune.TrainConfig(format="text", seq_len=48, micro_batch_size=4, max_steps=3, learning_rate=1e-2,
                                  warmup_steps=0, lora_r=4, save_steps=0, mesh=mesh)
        out[mesh] = jaxtune.train(model, tiny_tokenizer, rows, cfg, progress=False).losses
    print(out)
    for m in ("data=2", "fsdp=2"):
        np.testing.assert_allclose(out[m], out[None], rtol=1e-4)
