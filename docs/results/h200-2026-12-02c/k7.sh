#!/bin/bash
# Twentieth run, call 1 (one H200): installs the vllm-c part, then on the kernels alone (commit in
# .snap/GIT_SHA) the kernel bench for values-only windows twice: the default launch (with the
# staged-splits rule of 6980ff7: one staged split once sequences x KV heads fill 2 programs per SM)
# and KVARN_KERNELS_BATCH_INVARIANT=1 (splits at fixed positions, Triton kernel only), the price
# of the mode that makes speculative verify rows agree with plain decode.
bash .gpu/vllm-c/install.sh | tail -1
cd .snap/packages/kvarn-kernels && export PYTHONPATH=$PWD/../kvarn-math/src:$PWD/src
export KVARN_GIT_SHA=$(cat ../../GIT_SHA)
mkdir -p $OUT/k
for MODE in default invariant; do
  [ $MODE = invariant ] && export KVARN_KERNELS_BATCH_INVARIANT=1
  timeout 100 python3 -m kvarn_kernels.bench --quick --no-vllm --key-frame auto --windows values \
    --out $OUT/k/$MODE.json > $OUT/k/$MODE.log 2>&1
  echo "$MODE rc=$?"; grep "^| kvarn" $OUT/k/$MODE.log | sort -u | cut -d'|' -f4-6,13-14
done
