"""A GPU check of the training loop's GPU-only branches after its split into phases (remat auto, micro-batch auto,
remat offload's host plan): benchmarks/results/2026-12-02-loop-phases-gpu-check-h200.md."""

import json
import sys
import tempfile

sys.path.insert(0, "tests")
import jaxtune  # noqa: E402
from jaxtune.models.causal_lm import init_model  # noqa: E402
from jaxtune.models.config import ModelConfig  # noqa: E402
from jaxtune.qlora import quantize_layers  # noqa: E402
from tiny_tokenizer import save_tiny_tokenizer  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

d = tempfile.mkdtemp()
save_tiny_tokenizer(d)
tok = AutoTokenizer.from_pretrained(d)
cfg = ModelConfig(model_type="llama", vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_layers=4,
                  num_heads=4, num_kv_heads=2, head_dim=64, eos_token_id=tok.eos_token_id)
rows = [{"prompt": f"hello {i}", "completion": f" world {i} " * 8} for i in range(64)]
for remat, mb in (("auto", "auto"), ("offload", 4)):
    model = quantize_layers(init_model(cfg, dtype="bfloat16", seed=0))
    c = jaxtune.TrainConfig(format="completion", seq_len=128, micro_batch_size=mb, max_steps=3, remat=remat,
                            learning_rate=1e-3)
    r = jaxtune.train(model, tok, rows, c, progress=False, out_dir=f"{d}/run-{remat}")
    print(json.dumps({"remat": r.remat, "micro": r.micro_batch_size, "losses": [round(x, 4) for x in r.losses]}),
          flush=True)
