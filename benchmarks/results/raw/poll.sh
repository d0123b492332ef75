# usage: bash /tmp/poll.sh DRIVER TAG SECONDS  (run on the device from the repo root)
mkdir -p /tmp/jt
[ -f /tmp/jt/started-$2 ] || { touch /tmp/jt/started-$2; setsid bash $1 > /tmp/jt/log 2>&1 < /dev/null & }
end=$(( $(date +%s) + $3 ))
while [ "$(date +%s)" -lt $end ] && ! grep -q all-done /tmp/jt/stages 2>/dev/null; do sleep 10; done
for f in results.jsonl stages fusions32.jsonl trace32.jsonl unsloth_profile32.jsonl log; do [ -f /tmp/jt/$f ] && cp /tmp/jt/$f $OUT/; done
tail -c 300000 /tmp/jt/runs.log > $OUT/runs_tail.log 2>/dev/null
cat /tmp/jt/stages; nvidia-smi --query-gpu=memory.used --format=csv
