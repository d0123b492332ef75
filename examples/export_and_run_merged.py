"""Export a training run as a PEFT adapter and a merged HF checkpoint, then run the merged model in transformers.

    python examples/export_and_run_merged.py runs/demo/run --out runs/export
(runs/demo/run is what `make demo` leaves behind.)
"""

from __future__ import annotations

import argparse
import os
import warnings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a jaxtune train --out directory")
    ap.add_argument("--out", default="runs/export")
    ap.add_argument("--prompt", default="Extract the person as JSON with keys name, age, job, city.\n"
                                        "Ines, 28, works as a dentist in Quito.")
    args = ap.parse_args()
    import torch  # after the arguments: --help answers at once, without loading torch and transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import jaxtune
    from convert.export import load_run, original_weights

    model, tokenizer, base_model = load_run(args.run)
    jaxtune.save_peft(model, os.path.join(args.out, "adapter"), base_model_name_or_path=base_model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a GGUF/NF4 base has no original weights: merged onto the dequantized ones
        jaxtune.save_merged(model, os.path.join(args.out, "merged"), base=original_weights(base_model),
                            tokenizer=tokenizer, dtype="float32")
    merged_dir = os.path.join(args.out, "merged")
    hf_tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    text = hf_tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                            add_generation_prompt=True)
    ids = hf_tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = hf_model.generate(**ids, max_new_tokens=48, do_sample=False)
    print("transformers, merged checkpoint:", hf_tokenizer.decode(out[0, ids["input_ids"].shape[1]:],
                                                                  skip_special_tokens=True))
    print("jaxtune, base + adapter:        ", jaxtune.generate(model, tokenizer, [[{"role": "user",
                                                                                  "content": args.prompt}]],
                                                               max_new_tokens=48)[0])


if __name__ == "__main__":
    main()
