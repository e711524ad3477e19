#!/usr/bin/env bash
# Weights as stored (--dtype stored: Q4_1/Q8_0 kept in their blocks) against f32 (--dtype
# f32), the server side by side, arms interleaved: resident memory before the first request and
# after, one stream of 200 tokens, 8 streams of 100 at once, and whether the text is the same.
# Usage: bench/stored_weights.sh [ROUNDS] (needs `make backend-build model`).
set -euo pipefail
cd "$(dirname "$0")/.."
B=target/release/kvgate-backend
PORT=${PORT:-8123}
MODEL_NAME=smollm2-135m-instruct
OUT=$(mktemp -d)
url=http://127.0.0.1:$PORT/v1/completions
ask() { curl -s "$url" -H 'content-type: application/json' -d "$1"; }
now() { date +%s.%N; }
for round in $(seq 1 "${1:-2}"); do
  for dt in stored f32; do
    $B --port "$PORT" --dtype $dt > "$OUT/log_$dt" 2>&1 &
    pid=$!
    for _ in $(seq 1 120); do curl -s "http://127.0.0.1:$PORT/v1/models" > /dev/null && break; sleep 0.5; done
    rss=$(ps -o rss= -p $pid)
    t0=$(now)
    ask "{\"model\":\"$MODEL_NAME\",\"prompt\":\"Count from one to one thousand: one, two, three,\",\"max_tokens\":200,\"temperature\":0}" > "$OUT/one_$dt.json"
    t1=$(now)
    pids=""
    for j in 1 2 3 4 5 6 7 8; do
      ask "{\"model\":\"$MODEL_NAME\",\"prompt\":\"Count from $j to one thousand: \",\"max_tokens\":100,\"temperature\":0}" > "$OUT/eight_${dt}_$j.json" &
      pids="$pids $!"
    done
    # shellcheck disable=SC2086
    wait $pids
    t2=$(now)
    rss2=$(ps -o rss= -p $pid)
    kill $pid; wait $pid 2> /dev/null || true
    python3 - "$OUT" "$dt" "$round" "$rss" "$rss2" "$t0" "$t1" "$t2" <<'PY'
import json, sys
out, dt, rnd, rss, rss2, t0, t1, t2 = sys.argv[1:]
tok = lambda f: json.load(open(f))["usage"]["completion_tokens"]
one = tok(f"{out}/one_{dt}.json")
eight = sum(tok(f"{out}/eight_{dt}_{j}.json") for j in range(1, 9))
t0, t1, t2 = float(t0), float(t1), float(t2)
print(f"round {rnd} {dt}: resident {int(rss)//1024} MB before, {int(rss2)//1024} MB after; "
      f"1 stream {one/(t1-t0):.1f} tok/s; 8 streams {eight/(t2-t1):.1f} tok/s")
PY
  done
  python3 -c "import json,sys; a,b=(json.load(open(f'$OUT/one_{d}.json'))['choices'][0]['text'] for d in ('stored','f32')); print('same text' if a==b else 'TEXT DIFFERS')"
done
rm -rf "$OUT"
