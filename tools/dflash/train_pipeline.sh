#!/usr/bin/env bash
# A training lease on the GPU machine (staged by train_stage.sh into /tmp/stage), started detached so that it
# survives between device calls:
#
#   GEN_S=240 TRAIN_S=780 setsid nohup bash /tmp/stage/train_pipeline.sh > /tmp/t2.log 2>&1 < /dev/null &
#
# gen.py regenerates responses for the training prompts not answered before (then new samples of all of
# them) for GEN_S seconds (its model load included) into $W/gen.jsonl; train.py meanwhile continues the
# starting drafter on the committed responses ($S/data/*.jsonl.gz) plus that growing file for TRAIN_S
# seconds (wall clock, evaluations included), with the draft-vocabulary readout, exporting every EXPORT_S
# seconds; then collect_train.sh packs the results into 15 MiB pieces under /tmp/ret. `touch $W/halt` ends
# training early (it still exports). Session 6 ran this with the first run's responses alone in data/.
# DRAFT_LAYERS=2: the starting drafter (1 layer) gains a layer that starts as a no-op (train.py --init-from);
# NEW_LR_MULT scales that layer's lr; PREFER_SRC=sharegpt: gen.py samples those prompts first.
set -u
S=/tmp/stage
W=/tmp/t2w
mkdir -p "$W"
GEN_S=${GEN_S:-240}
TRAIN_S=${TRAIN_S:-780}
EXPORT_S=${EXPORT_S:-240}
LR=${LR:-6e-4}  # session 6 ran 6e-4 from v1; TRAINING.md suggests 1e-4-2e-4 (and WARMUP 200) to continue
WARMUP=${WARMUP:-30}
GGUF=$S/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
echo "[$(date +%T)] pipeline: gen ${GEN_S}s, train ${TRAIN_S}s, lr $LR"
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site $S/gguf-*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $W/init && cp $S/init-model.safetensors $W/init/model.safetensors && cp $S/init-config.json $W/init/config.json
gunzip -c $S/prompts_train.jsonl.gz > $W/prompts_train.jsonl
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
DATA=$(ls $S/data/*.jsonl.gz | paste -sd, -)
GEN=
if [ "$GEN_S" -gt 0 ]; then  # GEN_S=0: train on the committed responses alone
  python3 $S/gen.py --gguf $GGUF --prompts $W/prompts_train.jsonl --skip-ids $S/used_ids.txt --out $W/gen.jsonl \
    --seconds "$GEN_S" --prefer-src "${PREFER_SRC:-}" --stop-file $W/genstop > $W/gen.log 2>&1 &
  GEN=$!
  DATA="$DATA,$W/gen.jsonl"
fi
python3 $S/${TRAIN_PY:-train.py} --gguf $GGUF --data "$DATA" --heldout $S/heldout.jsonl \
  --out $W/out --intermediate-size 4096 --init-from $W/init --draft-vocab $S/draft_vocab.json --eval-first \
  --train-seconds "$TRAIN_S" --export-every "$EXPORT_S" --schedule wsd --decay-frac "${DECAY:-0.35}" --min-lr 0.05 \
  --lr "$LR" --warmup "$WARMUP" --anchors 512 --token-budget 16384 --block-budget 6144 --max-batch 48 \
  --chunk-rows 16384 --draft-layers "${DRAFT_LAYERS:-1}" --new-lr-mult "${NEW_LR_MULT:-1}" \
  --chunk-anchors "${CHUNK_ANCHORS:-32}" --halt-file $W/halt > $W/train.log 2>&1
echo "[$(date +%T)] train exit $?"
touch $W/genstop
[ -z "$GEN" ] || wait $GEN
bash $S/collect_train.sh
echo "[$(date +%T)] pipeline done"
