"""Per-family readers of a transformers config.json: what sets a family apart from the Llama block, as ModelConfig
fields."""
