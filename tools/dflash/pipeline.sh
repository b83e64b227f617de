#!/usr/bin/env bash
# The whole DFlash training run for one target on the lent GPU machine, started detached so that it
# survives between device calls:
#
#   setsid nohup bash /tmp/stage/pipeline.sh 1.5b > /tmp/p-1.5b.log 2>&1 < /dev/null &
#
# Needs in /tmp/stage (staged by tools/dflash/stage.sh): the target GGUF, llama-cpp-cuda-sm90.tgz, the gguf
# wheel, prompts_train.jsonl.gz, prompts_heldout.jsonl, regen.py, train.py, collect.sh.
# Steps: llama-server with many parallel slots serves the exact GGUF weights; regen.py regenerates
# responses (held-out benchmark prompts first, greedy); train.py loads the same GGUF through transformers
# meanwhile, trains on the growing response file, exports the drafter every few minutes and at the end,
# then collect.sh packs the results into 15 MiB pieces under /tmp/ret for the $OUT copy.
# Environment: REGEN_S (seconds of regeneration), TRAIN_S (seconds of training steps), NSERV servers of
# NP slots each (default 8 × 32).
set -u
TAG=$1
S=/tmp/stage
W=/tmp/dft/$TAG
mkdir -p "$W"
case $TAG in
  1.5b) GGUF=$S/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf; PORT=8081; INTER=4096 ;;
  0.5b) GGUF=$S/qwen2.5-coder-0.5b-instruct.gguf; PORT=8082; INTER=4864 ;;
  *) echo "unknown target $TAG" >&2; exit 2 ;;
esac
REGEN_S=${REGEN_S:-540}
TRAIN_S=${TRAIN_S:-600}
NP=${NP:-32}
NSERV=${NSERV:-8}
echo "[$(date +%T)] pipeline $TAG: regen ${REGEN_S}s, train ${TRAIN_S}s, $NP slots"

# one-time setup (the second pipeline starts a minute after the first and finds it done)
[ -x /tmp/bin/llama-server ] || tar xzf $S/llama-cpp-cuda-sm90.tgz -C /tmp
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site $S/gguf-*.whl
export LD_LIBRARY_PATH=/tmp/bin PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1

gunzip -c $S/prompts_train.jsonl.gz > "$W/prompts_train.jsonl"
# llama-server samples every slot on its main thread: past ~32 slots one server is CPU-bound (measured
# 8 tok/s per slot at 128 slots), so run several servers of 32 slots and spread the requests over them
URLS=""
SERVERS=""
for i in $(seq 0 $((NSERV - 1))); do
  p=$((PORT + 10 * i))
  /tmp/bin/llama-server -m "$GGUF" -ngl 99 -fa on -np "$NP" -c $((NP * 1400)) --threads-http $((NP + 16)) \
    --host 127.0.0.1 --port $p > "$W/server-$p.log" 2>&1 &
  SERVERS="$SERVERS $!"
  URLS="$URLS${URLS:+,}http://127.0.0.1:$p"
done
python3 - "$URLS" <<'PY'
import sys, time, urllib.request
for u in sys.argv[1].split(","):
    for _ in range(300):
        try:
            urllib.request.urlopen(u + "/health", timeout=2).read()
            break
        except Exception:
            time.sleep(1)
PY
echo "[$(date +%T)] server up"
python3 $S/regen.py --url "$URLS" --prompts "$W/prompts_train.jsonl" --out "$W/regen.jsonl" \
  --heldout $S/prompts_heldout.jsonl --heldout-out "$W/heldout.jsonl" --threads $((NP * NSERV)) \
  --seconds "$REGEN_S" --stop-file "$W/stop" > "$W/regen.log" 2>&1 &
REGEN=$!
python3 $S/train.py --gguf "$GGUF" --data "$W/regen.jsonl" --heldout "$W/heldout.jsonl" --out "$W/out" \
  --intermediate-size $INTER --train-seconds "$TRAIN_S" --stop-file "$W/stop" > "$W/train.log" 2>&1
rc=$?
echo "[$(date +%T)] train exit $rc"
# a failed training leaves regeneration running to its deadline, so that a fixed train.py can be
# started by hand on the same growing data
[ $rc -eq 0 ] && touch "$W/stop"
wait $REGEN
kill $SERVERS 2>/dev/null
bash $S/collect.sh "$TAG"
echo "[$(date +%T)] pipeline $TAG done"
