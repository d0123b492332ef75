"""The model and its pieces: the config read from config.json, the decoder (Flax NNX), RoPE, the layer loop
with its own VJP, and the remat policies."""
