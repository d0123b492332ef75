#!/usr/bin/env bash
# Hold of 2026-11-28, the machine of leases 37-38 (one H200, /tmp/moe30): jaxtune's larger batch (64, selective)
# and its memory-lean layout (remat full, batch 32).
# bash benchmarks/drivers/poll.sh THIS 39 400
set -u
. benchmarks/tools/lease_queue.sh
jt jt-moe-b64 /tmp/moe30 --batch 64 --remat selective --steps 3 --warmup 1
jt jt-moe-b32-full /tmp/moe30 --batch 32 --remat full --steps 3 --warmup 1
stage all-done
