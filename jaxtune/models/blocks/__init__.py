"""Token mixers other than the Llama block's attention, one module each."""
