"""Pallas GPU kernels for jaxtune. Depends on jax only; each kernel file holds its custom VJP and reference."""
