"""The machine jaxtune runs on: host memory and the device memory fraction JAX may take, set before a backend
starts."""
