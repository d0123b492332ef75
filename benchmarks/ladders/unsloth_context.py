"""The longest sequence Unsloth trains at batch 1, measured the way benchmarks/ladders/context_ladder.py measures jaxtune's:
one executed step (forward, backward, AdamW) per length, ascending, on one loaded model, until a length fails;
optionally with the GPU capped to a card size (torch's per-process memory fraction).

Runs where Unsloth is importable (`../shared/bench/make_site.sh`), with its recommended
`use_gradient_checkpointing="unsloth"`:
    PYTHONPATH=$PWD/.site HF_HUB_OFFLINE=1 python3 benchmarks/ladders/unsloth_context.py /tmp/bnb4_70b --seqs 89389,98304
Unsloth's checkpointing keeps every layer's input in host memory; a watcher stops the process with a JSON line when
host memory is nearly gone, before the machine runs out (exit status 3). Prints one JSON line per length.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
GIB = 2**30
HOST_FLOOR = 3 * GIB  # less host memory available than this stops the run


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def watch_host(record: dict, state: dict) -> None:
    """Records the least host memory available; ends the process with the record when it falls under the floor."""
    while True:
        now = mem_available()
        state["least"] = min(state.get("least", now), now)
        if now < HOST_FLOOR:
            print(json.dumps({**record, **state.get("current", {}), "error": "host memory exhausted",
                              "least_host_available_gib": round(now / GIB, 1)}), flush=True)
            os._exit(3)
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--seqs", required=True, help="comma-separated sequence lengths, tried in ascending order")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--cap-gib", type=float, help="use only this much GPU memory")
    args = ap.parse_args()
    seqs = sorted(int(s) for s in args.seqs.split(","))

    import unsloth  # noqa: F401  (before transformers)
    import torch
    from unsloth import FastLanguageModel

    if args.cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total))
    t0 = time.perf_counter()
    model, _ = FastLanguageModel.from_pretrained(model_name=args.model, max_seq_length=seqs[-1], load_in_4bit=True,
                                                 dtype=torch.bfloat16)
    model = FastLanguageModel.get_peft_model(
        model, r=args.lora_r, lora_alpha=args.lora_r, lora_dropout=0, bias="none",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        use_gradient_checkpointing="unsloth", random_state=0)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    base = {"system": "unsloth", "model": os.path.basename(args.model.rstrip("/")),
            "device": torch.cuda.get_device_name(0), "cap_gib": args.cap_gib, "batch": 1, "lora_r": args.lora_r,
            "grad_ckpt": "unsloth", "load_s": round(time.perf_counter() - t0, 1)}
    state: dict = {}
    threading.Thread(target=watch_host, args=(base, state), daemon=True).start()
    for seq in seqs:
        record = {**base, "seq": seq, "tokens": seq}
        state["current"], state["least"] = {"seq": seq, "tokens": seq}, mem_available()
        torch.cuda.empty_cache()
        x = torch.randint(0, model.config.vocab_size, (1, seq), device="cuda")
        t0 = time.perf_counter()
        try:
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            record.update(step_s=round(time.perf_counter() - t0, 1), loss=round(float(loss), 4),
                          tok_s=round(seq / (time.perf_counter() - t0)),
                          peak_gib=round(torch.cuda.max_memory_allocated() / GIB, 2))
        except torch.OutOfMemoryError as e:
            record.update(error=f"OutOfMemoryError: {str(e).splitlines()[0][:300]}",
                          after_s=round(time.perf_counter() - t0, 1))
        record["least_host_available_gib"] = round(state["least"] / GIB, 1)
        print(json.dumps(record), flush=True)
        del x
        if "error" in record:
            break


if __name__ == "__main__":
    main()
