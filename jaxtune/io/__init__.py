"""Where models and run files come from: the bundled model, hub ids through huggingface_hub's cache, JSON files
read with one-line errors."""
