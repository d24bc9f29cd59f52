#!/bin/bash
# Thirty-fourth run: Gemma-3-270M converted (gemma_prep.py: the machine's transformers, then the
# tokenizer files of a transformers 5.25 conversion), from the repository root after setup.sh.
GEMMA=$KVARN_GPU_FILES/gemma-3-270m-q4_k_m.gguf
R=$(cd ../.gpurun && pwd)
mkdir -p $OUT/p
START=$SECONDS
timeout ${LIMIT:-300} python3 $R/gemma_prep.py $GEMMA $R/gemma_tok.tar.xz > $OUT/p/prep.log 2>&1
echo "prep rc=$? at $((SECONDS-START)) s"; tail -3 $OUT/p/prep.log
