"""Many devices and hosts: the device mesh and shardings, and the multi-process agreement helpers."""
