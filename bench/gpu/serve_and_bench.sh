#!/usr/bin/env bash
# Start `hicache serve` with extra flags, wait for /health, run one client command, stop the server.
#   bench/gpu/serve_and_bench.sh NAME PORT "SERVE FLAGS" "CLIENT COMMAND (URL in $URL)"
# Server log -> $OUT/NAME.server.log, its flags -> NAME.flags.txt, its /metrics at the end -> NAME.metrics.txt; the
# client's own --json goes where its command says.
set -u
name=$1 port=$2 serve_flags=$3 client=$4
out=${OUT:-/tmp}
log=$out/$name.server.log
echo "$serve_flags" >"$out/$name.flags.txt"  # what bench/replay_vs_server.py gives the replay of this arm
# shellcheck disable=SC2086  # SERVE FLAGS is a list of flags
${PYTHON:-python3} -m hicache.cli serve --config "${CONFIG:-configs/h200-llama8b.yaml}" --port "$port" $serve_flags >"$log" 2>&1 &
pid=$!
URL=http://127.0.0.1:$port
for _ in $(seq 1 240); do
  if curl -sf "$URL/health" >/dev/null 2>&1; then break; fi
  if ! kill -0 $pid 2>/dev/null; then echo "$name: server died"; tail -30 "$log"; exit 1; fi
  sleep 0.5
done
echo "== $name: server up ($(grep -c . "$log") log lines)"
URL=$URL bash -c "$client"
rc=$?
curl -sf "$URL/metrics" >"$out/$name.metrics.txt" 2>/dev/null
kill -TERM $pid
wait $pid
echo "== $name: client rc=$rc, server rc=$?"
exit $rc
