# Launches a hold's driver once, detached, and returns within SECONDS with what it wrote so far under $OUT
# (the device runner's output folder): bash benchmarks/drivers/poll.sh DRIVER TAG SECONDS
mkdir -p /tmp/jt
[ -f /tmp/jt/started-$2 ] || { touch /tmp/jt/started-$2; setsid bash $1 > /tmp/jt/log 2>&1 < /dev/null & }
end=$(( $(date +%s) + $3 ))
while [ "$(date +%s)" -lt $end ] && ! grep -q all-done /tmp/jt/stages 2>/dev/null; do sleep 10; done
for f in /tmp/jt/*.jsonl /tmp/jt/*.json /tmp/jt/gpu_tests*.log /tmp/jt/gpu?.log /tmp/jt/stages /tmp/jt/log; do [ -f "$f" ] && cp "$f" $OUT/; done
tail -c 300000 /tmp/jt/runs.log > $OUT/runs_tail.log 2>/dev/null
cat /tmp/jt/stages; nvidia-smi --query-gpu=memory.used --format=csv
