"""Peak host memory of the checkpoint input/output paths (convert, merged export, GGUF export) on a real-size model.

Each stage runs in a child process; this process samples the child's /proc status every 20 ms and reports the
peaks of VmRSS (what `top` shows), RssAnon (memory the process needs: heap, numpy and, on a CPU-only machine,
the JAX "device" arrays) and RssFile (pages of memory-mapped checkpoint files, which the kernel can drop).

    PYTHONPATH=. python3 benchmarks/steps/io_host_memory.py /tmp/io --model llama3-8b
writes /tmp/io/hf (random bf16 HF checkpoint), /tmp/io/jt (jaxtune convert), /tmp/io/merged, /tmp/io/model.gguf,
deleting each output once measured (`--keep` keeps them). One JSON line per stage.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

STAGES = {
    # what any stage costs before it touches a checkpoint: the interpreter, jax, transformers and their libraries
    "baseline": "import jax, jaxtune, transformers; jax.numpy.zeros(1).block_until_ready()",
    "make": "import sys, json; sys.path.insert(0, 'benchmarks/tools'); import make_bnb4_checkpoint as m; "
            "print(json.dumps(m.write_checkpoint('{model}', '{d}/hf', progress=False, bf16=True)))",
    "convert": "import jaxtune; jaxtune.convert('{d}/hf', '{d}/jt')",
    "merged": "{load}; jaxtune.save_merged(model, '{d}/merged', base='{d}/hf', tokenizer=tok)",
    # the random checkpoint's word-level tokenizer is not BPE: the GGUF gets the bundled SmolLM2's (ids padded)
    "gguf": "{load}; from convert.gguf_source import GGUFSource; from jaxtune.io.bundled import resolve_model_path; "
            "tok = GGUFSource(resolve_model_path('smollm2')).tokenizer(); "
            "jaxtune.save_gguf(model, '{d}/model.gguf', tokenizer=tok, base='{d}/hf', gguf_type='bf16')",
}
# the fine-tuned model an export starts from: the converted checkpoint with r=16 adapters on the 7 projections
LOAD = ("import jax, jaxtune, json; from flax import nnx; model, tok = jaxtune.from_pretrained('{d}/jt'); "
        "jaxtune.get_peft_model(model, r=16, lora_alpha=16); "
        "print(json.dumps({{'model_state_gib': round(sum(a.nbytes for a in jax.tree.leaves(nnx.state(model))) / 2**30, 2)}}))")
OUTPUTS = {"convert": "jt", "merged": "merged", "gguf": "model.gguf"}


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile"):
                    out[key] = int(value.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def run_stage(stage: str, directory: str, model: str) -> dict:
    code = STAGES[stage].format(d=directory, model=model, load=LOAD.format(d=directory))
    env = {**os.environ, "TQDM_DISABLE": "1"}
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    peaks: dict[str, int] = {}
    while child.poll() is None:
        for key, value in _status(child.pid).items():
            peaks[key] = max(peaks.get(key, 0), value)
        time.sleep(0.02)
    seconds = time.perf_counter() - t0
    if child.returncode:
        raise SystemExit(f"stage {stage} failed with exit code {child.returncode}")
    report = {"stage": stage, "model": model, "seconds": round(seconds, 1),
              **{f"peak_{k}_gib": round(v / 2**30, 2) for k, v in peaks.items()}}
    for line in child.stdout.read().splitlines():
        if line.startswith("{"):
            report.update({k: v for k, v in json.loads(line).items() if k not in ("path", "model")})
    if stage in OUTPUTS:
        path = os.path.join(directory, OUTPUTS[stage])
        size = os.path.getsize(path) if os.path.isfile(path) else sum(
            os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        report["output_gib"] = round(size / 2**30, 2)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--stages", default="baseline,make,convert,merged,gguf")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.directory, exist_ok=True)
    import jax

    device = jax.devices()[0].device_kind
    for stage in args.stages.split(","):
        report = run_stage(stage, args.directory, args.model)
        print(json.dumps({**report, "device": device, "date": time.strftime("%Y-%m-%d")}), flush=True)
        if not args.keep and stage in ("merged", "gguf"):
            path = os.path.join(args.directory, OUTPUTS[stage])
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


if __name__ == "__main__":
    main()
