"""Stands in for xprof where tokamax is imported only for its kernels: tokamax's benchmarking module imports
`xprof.cli.tools` at import time, and xprof (with its many dependencies) is not on the device image."""
