#!/bin/bash
# Twenty-second run, call 1 (one H200): installs the vllm-c part, then on the kernels alone (commit
# in .snap/GIT_SHA): (1) GPU tests: nothing compiles after warm-up (row slices too), the L2
# prefetch changes no bit; (2) the kernel bench with KVARN_KERNELS_FAST_PREFETCH=0, 1, 2 at batch
# 64 and 256 x 4K and 16K (256 x 4K is the 4K burst's decode); (3) one Nsight Compute profile of
# the Gluon decode kernel at 256 x 4K, without prefetch.
bash .gpu/vllm-c/install.sh | tail -1
cd .snap/packages/kvarn-kernels && export PYTHONPATH=$PWD/../kvarn-math/src:$PWD/src
export KVARN_GIT_SHA=$(cat ../../GIT_SHA)
mkdir -p $OUT/k
START=$SECONDS
timeout 150 python3 -m pytest -q -m gpu tests/test_kernels_warmup.py tests/test_kernels_gpu.py \
  -k "warmup or prefetch" -p no:cacheprovider > $OUT/k/tests.log 2>&1
echo "tests rc=$? at $((SECONDS-START)) s"; tail -4 $OUT/k/tests.log
for PF in 0 1 2; do
  KVARN_KERNELS_FAST_PREFETCH=$PF timeout 100 python3 -m kvarn_kernels.bench --quick --no-vllm \
    --key-frame auto --windows values --batches 64 256 --contexts 4096 16384 \
    --out $OUT/k/pf$PF.json > $OUT/k/pf$PF.log 2>&1
  echo "prefetch $PF rc=$? at $((SECONDS-START)) s"; grep "^| kvarn" $OUT/k/pf$PF.log | sort -u | cut -d'|' -f4-8,13-14
done
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
timeout 120 $NCU --clock-control none --set full -k regex:fast_decode -s 2 -c 1 -o $OUT/k/ncu_256x4k \
  python3 -m kvarn_kernels.bench --quick --no-vllm --key-frame auto --windows values --batches 256 \
  --contexts 4096 --out $OUT/k/ncu_bench.json > $OUT/k/ncu_run.log 2>&1
echo "ncu rc=$? at $((SECONDS-START)) s"; tail -3 $OUT/k/ncu_run.log
[ -f $OUT/k/ncu_256x4k.ncu-rep ] && $NCU --import $OUT/k/ncu_256x4k.ncu-rep --page details > $OUT/k/ncu_256x4k.txt 2>&1 \
  && grep -E "Duration|Memory Throughput|DRAM Throughput|Registers|Achieved Occupancy|Local|Warp Cycles Per Issued|Stall|Issue Slots" $OUT/k/ncu_256x4k.txt | head -30
[ -f $OUT/k/ncu_256x4k.ncu-rep ] && $NCU --import $OUT/k/ncu_256x4k.ncu-rep --page raw --csv > $OUT/k/ncu_256x4k_raw.csv 2>/dev/null
rm -f $OUT/k/ncu_256x4k.ncu-rep.tmp
ls -la $OUT/k | head -20
