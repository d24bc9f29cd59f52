#!/bin/bash
# Thirtieth run, call 5 (one H200): 4K bursts that fill the cache, 1024 tokens out, Llama-3.1-8B
# shape (dummy weights), 256 slots: kvarn_k4v4_g128 with the Gluon decode kernel on 4-bit values,
# then kvarn_k4v2_g128 with the kernel warm-up's default thread count (no
# KVARN_KERNELS_WARMUP_THREADS set: 4 since 71f6aeb). Arguments CACHE:LIMIT_SECONDS.
unset KVARN_KERNELS_WARMUP_THREADS
[ -f /tmp/kvarn-k4v4-ok ] && echo "call 1: the k4v4 Gluon tests passed" || echo "call 1: k4v4 Gluon tests NOT passed"
exec bash "$(dirname "$0")/z4b.sh" "$@"
