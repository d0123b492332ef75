set -x
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "import jax; print(jax.__version__, jax.devices())"
PYTHONPATH=$PWD:$PWD/.fla-site timeout 400 python benchmarks/kernels/gated_delta_vs_fla.py --shapes 2x4096,1x16384,8x2048 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -30
