#!/usr/bin/env bash
# Pack a training lease's results (train_pipeline.sh) into pieces a device call can bring back ($OUT takes
# at most 8 files of 16 MiB, 64 MiB per call):
#   /tmp/ret/t2.tar.NN          the drafter (hf/: config.json, model.safetensors, metrics.json,
#                               draft_vocab.json) and the logs
#   /tmp/ret/gen.jsonl.gz.NN    the responses gen.py regenerated
# each set with a .sha256 beside it. Rejoin here:  cat t2.tar.?? > t2.tar && sha256sum -c t2.tar.sha256
set -eu
W=/tmp/t2w
R=/tmp/ret
rm -rf $R && mkdir -p $R/tmp
cp -r $W/out/hf $R/tmp/hf
cp $W/train.log $W/gen.log $R/tmp/ 2>/dev/null || true
tar cf $R/t2.tar -C $R/tmp .
rm -rf $R/tmp
(cd $R && sha256sum t2.tar > t2.tar.sha256 && split -b 15M -d -a 2 t2.tar t2.tar. && rm t2.tar)
if [ -s $W/gen.jsonl ]; then
  gzip -c $W/gen.jsonl > $R/gen.jsonl.gz
  (cd $R && sha256sum gen.jsonl.gz > gen.jsonl.gz.sha256 && split -b 15M -d -a 2 gen.jsonl.gz gen.jsonl.gz. && rm gen.jsonl.gz)
fi
ls -la $R
