#!/usr/bin/env bash
# Pack one target's results on the GPU machine into pieces a device call can bring back ($OUT takes at
# most 8 files of 16 MiB, 64 MiB per call):
#   /tmp/ret/TAG.tar.NN   the drafter (hf/: config.json, model.safetensors, metrics.json, draft_vocab.json),
#                         heldout.jsonl and the logs
#   /tmp/ret/TAG-regen.jsonl.gz.NN   the regenerated training sequences, for later sessions
# Each set has a .sha256 beside it. Rejoin here with:  cat TAG.tar.?? > TAG.tar && sha256sum -c TAG.tar.sha256
set -eu
TAG=$1
W=/tmp/dft/$TAG
R=/tmp/ret
mkdir -p $R/tmp-$TAG
rm -f $R/$TAG.tar* $R/$TAG-regen.jsonl.gz*
cp -r "$W/out/hf" $R/tmp-$TAG/$TAG-hf 2>/dev/null || true
cp "$W/heldout.jsonl" "$W/train.log" "$W/regen.log" $R/tmp-$TAG/ 2>/dev/null || true
tar cf $R/$TAG.tar -C $R/tmp-$TAG .
rm -rf $R/tmp-$TAG
(cd $R && sha256sum $TAG.tar > $TAG.tar.sha256 && split -b 15M -d -a 2 $TAG.tar $TAG.tar. && rm $TAG.tar)
if [ -s "$W/regen.jsonl" ]; then
  G=$TAG-regen.jsonl.gz
  gzip -c "$W/regen.jsonl" > $R/$G
  (cd $R && sha256sum $G > $G.sha256 && split -b 15M -d -a 2 $G $G. && rm $G)
fi
ls -la $R
