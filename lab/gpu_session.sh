#!/usr/bin/env bash
# Everything this project measures on a lent H200, in stages that each fit one 10-minute device call; results
# land in $OUT. .whl/ carries transformers >= 5.23 when the image's is older (HF eager baseline and parity tests).
#
#   CSATTN_COMMIT=<sha> STAGES="tests graphs" bash lab/gpu_session.sh            # ~8 min (2 GPUs)
#   CSATTN_COMMIT=<sha> STAGES="layer profile" bash lab/gpu_session.sh           # ~5 min
#   CSATTN_COMMIT=<sha> STAGES="attn-variants" bash lab/gpu_session.sh           # ~1 min
#   CSATTN_COMMIT=<sha> STAGES="topk-vs-fwd" bash lab/gpu_session.sh             # ~1 min
#   CSATTN_COMMIT=<sha> STAGES="model-tests moe mhc model model-hf model-kept" bash lab/gpu_session.sh
#   CSATTN_COMMIT=<sha> STAGES="report-a" bash lab/gpu_session.sh                # ~8 min
#   CSATTN_COMMIT=<sha> STAGES="report-b" bash lab/gpu_session.sh                # ~7 min
#   CSATTN_COMMIT=<sha> STAGES="hfprobe report-long" bash lab/gpu_session.sh     # ~7 min
#   python -m csattn report --merge report-a.json report-b.json report-c.json --out docs/report   # anywhere
#   STAGES=peers-unpack (carry .peerwhl/c1), then at once STAGES=peers (carry .peerwhl/c2): csattn against cuDNN
#   Frontend's DSA kernels (bundles from ../shared/peers/make_bundles.sh; /.peerwhl/ in .git/info/exclude);
#   providers PEER_BWD, PEER_TOPK, PEER_SELECT (default triton,cudnn), PEER_FWD (default triton: the forward target)
#   The unpack call carries a 64 MB bundle, and what a device call carries (tracked tree included) is capped at
#   64 MiB: for that call only, take the result files out of the working tree and put them back after:
#     rm -rf benchmarks/results docs/report   # then the peers-unpack call, then: git checkout -- benchmarks docs
#   BEFORE=<old tree> BEFORE_COMMIT=<sha> STAGES=layer-ab: the layer benchmarks of an older tree and this one
#
# report-a: CP = 1, every path (reference and unfused up to 32k, HF eager up to 8k); report-b: CP = 2 and 4,
# both partitions, and the isolated per-rank timing at 128k; report-long: 256k to 1M at CP = 1 and 4. On a
# machine with two GPUs CP = 2 runs on NCCL, CP = 4 as two gloo ranks per GPU. report-cp1 / report-cp4: only the
# lengths the report's targets name (32k, 128k); on two GPUs run them side by side, one GPU each:
#   (CUDA_VISIBLE_DEVICES=1 OUT=$OUT/g1 STAGES="report-cp1 report-long" bash lab/gpu_session.sh) &
#   (CUDA_VISIBLE_DEVICES=0 OUT=$OUT/g0 STAGES="report-cp4 hfprobe" bash lab/gpu_session.sh) & wait
# A device call brings back at most 8 files from $OUT: reports render into /tmp and only their report.json comes
# back (as $OUT/<stage>.json); re-render anywhere with `python -m csattn report --merge <json...> --out DIR`.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
C=${CSATTN_COMMIT:-unknown}
export PYTHONPATH="$PWD"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PWD"
fi
stage() { echo "=== $1 ($(date -u +%T)) commit $C" | tee -a "$LOG"; }
# report NAME TIMEOUT ARGS...: `csattn report ARGS` rendered into /tmp/NAME, its JSON brought back as $OUT/NAME.json
report() {
  local name=$1 limit=$2; shift 2
  CSATTN_COMMIT=$C timeout "$limit" python3 -m csattn report "$@" --out "/tmp/$name" >> "$LOG" 2>&1
  echo "$name rc=$?" >> "$LOG"
  cp "/tmp/$name/report.json" "$OUT/$name.json"
}
TOKENS="4096 8192 16384 32768 65536 131072"
for s in ${STAGES:-tests layer profile}; do
  case $s in
    tests)
      stage "gpu tests"
      if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
        # the two-GPU CP graph tests (about 75 s each: spawn, NCCL, compile) beside the one-GPU tests
        (CUDA_VISIBLE_DEVICES=0 timeout 420 python3 -m pytest -q -m gpu tests --ignore tests/graphs/test_graphs_cp_gpu.py \
          -p no:cacheprovider -rfEs > /tmp/tests_single.txt 2>&1; echo "pytest (one GPU) rc=$?" >> /tmp/tests_single.txt) &
        (timeout 560 python3 -m pytest -q tests/graphs/test_graphs_cp_gpu.py -p no:cacheprovider -rfEs > /tmp/tests_cp.txt 2>&1;
          echo "pytest (CP graphs, two GPUs) rc=$?" >> /tmp/tests_cp.txt) &
        wait
        cat /tmp/tests_single.txt /tmp/tests_cp.txt >> "$LOG"
      else
        timeout 420 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rfEs >> "$LOG" 2>&1
        echo "pytest rc=$?" >> "$LOG"
      fi ;;
    layer)
      stage "layer benchmark: Triton / reference / HF eager"
      timeout 180 python3 -m benchmarks.run --op layer --mode fwdbwd --providers triton,reference,hf \
        --shape tokens=8192,32768 --shape layer=csa,hca --warmup-ms 5 --rep-ms 40 --commit "$C" \
        --json "$OUT/layer.json" >> "$LOG" 2>&1
      echo "layer rc=$?" >> "$LOG" ;;
    attn-variants)
      stage "sparse attention: tile variants"
      timeout 150 python3 -m benchmarks.run --op sparse_attn --mode fwd,bwd \
        --providers "${ATTN_VARIANTS:-triton,triton[bk_fwd=32]}" \
        --shape tokens=8192,32768 --warmup-ms 10 --rep-ms 100 --commit "$C" --json "$OUT/attn_variants.json" \
        >> "$LOG" 2>&1
      echo "attn-variants rc=$?" >> "$LOG" ;;
    topk-vs-fwd)
      stage "indexer scores + top-k against the sparse attention forward, one call, 32k"
      timeout 120 python3 -m benchmarks.run --op indexer_topk --mode fwd --providers "${TOPK_VARIANTS:-triton}" \
        --shape tokens=32768 --warmup-ms 10 --rep-ms 100 --profile --commit "$C" --json "$OUT/indexer_topk.json" >> "$LOG" 2>&1
      timeout 60 python3 -m benchmarks.run --op sparse_attn --mode fwd --providers triton \
        --shape tokens=32768 --warmup-ms 10 --rep-ms 100 --commit "$C" --json "$OUT/sparse_attn_fwd.json" >> "$LOG" 2>&1
      echo "topk-vs-fwd rc=$?" >> "$LOG" ;;
    hfprobe)
      stage "largest length HF eager fits: Triton vs HF eager, one document"
      timeout 240 python3 -m benchmarks.run --op layer --mode fwdbwd --providers triton,hf \
        --shape tokens=10240,12288,14336,15360 --shape layer=csa,hca --warmup-ms 5 --rep-ms 40 --commit "$C" \
        --json "$OUT/hfprobe.json" >> "$LOG" 2>&1
      echo "hfprobe rc=$?" >> "$LOG" ;;
    profile)
      stage "per-kernel profile"
      for t in 8192 32768; do
        timeout 60 python3 -m benchmarks.profile_layer --tokens $t --layer csa > "$OUT/profile_csa_$t.txt" 2>&1
      done ;;
    graphs)
      stage "CUDA graph step: eager vs replay"
      timeout 150 python3 -m benchmarks.run --op layer_step --mode fwd --providers eager,capture_safe,graph \
        --shape tokens=4096,32768 --shape layer=csa --warmup-ms 5 --rep-ms 40 --commit "$C" \
        --json "$OUT/layer_step.json" >> "$LOG" 2>&1
      echo "layer_step rc=$?" >> "$LOG" ;;
    report-a)
      stage "scaling report, part a: CP = 1, every path"
      report report-a 570 --tokens $TOKENS --cp 1 --paths triton reference unfused hf --reference-max-tokens 32768 \
        --hf-max-tokens 8192 --balance-tokens --steps 2 --group-timeout 400 ;;
    report-b)
      stage "scaling report, part b: CP = 2 and 4, both partitions, per-rank balance at the longest length"
      report report-b 570 --tokens $TOKENS --cp 2 4 --paths triton reference --reference-max-tokens 4096 --steps 2 \
        --group-timeout 300 ;;
    report-long)
      stage "scaling report, part c: the longest streams at CP = 1 and 4"
      report report-c 400 --tokens 262144 524288 1048576 --cp 1 4 --partitions contiguous --paths triton \
        --balance-tokens --steps 1 --group-timeout 200 ;;
    report-cp1)
      stage "scaling targets, CP = 1: fused, reference and unfused at 32k, fused at 128k"
      report report-cp1 300 --tokens 32768 131072 --cp 1 --paths triton reference unfused \
        --reference-max-tokens 32768 --steps 2 --group-timeout 280 ;;
    report-cp4)
      stage "scaling targets, CP = 4: both partitions at 32k and 128k, per-rank balance at 128k"
      report report-cp4 400 --tokens 32768 131072 --cp 4 --paths triton --steps 2 --group-timeout 200 ;;
    model-tests)
      stage "model kernels on the GPU: mHC, MoE"
      timeout 300 python3 -m pytest -q -m gpu tests/ops/test_moe_gpu.py tests/ops/test_mhc*.py tests/models/test_model*.py \
        -p no:cacheprovider -rfEs >> "$LOG" 2>&1
      echo "model-tests rc=$?" >> "$LOG" ;;
    moe)
      stage "MoE experts: grouped GEMMs vs the per-expert loop"
      timeout 200 python3 -m benchmarks.run --op moe --providers grouped,loop --mode fwdbwd \
        --shape tokens=16384 --shape routing=8x2,64x6,256x6 --warmup-ms 5 --rep-ms 40 --commit "$C" \
        --json "$OUT/moe.json" >> "$LOG" 2>&1
      echo "moe rc=$?" >> "$LOG" ;;
    mhc)
      stage "mHC: fused kernels vs the reference"
      timeout 150 python3 -m benchmarks.run --op mhc --mode fwd,fwdbwd --shape tokens=16384,65536 \
        --warmup-ms 5 --rep-ms 40 --commit "$C" --json "$OUT/mhc.json" >> "$LOG" 2>&1
      echo "mhc rc=$?" >> "$LOG" ;;
    model)
      stage "model step: the 4-layer V4-Flash proxy, csattn vs HF eager"
      timeout 400 python3 -m benchmarks.run --op model --mode fwdbwd --providers csattn \
        --shape tokens=${MODEL_TOKENS:-16384,65536} --shape recompute=${MODEL_RECOMPUTE:-none} --warmup-ms 5 --rep-ms 30 \
        --commit "$C" --json "$OUT/model.json" >> "$LOG" 2>&1
      echo "model rc=$?" >> "$LOG" ;;
    model-hf)
      stage "model step against HF eager, one document"
      timeout 300 python3 -m benchmarks.run --op model --mode fwdbwd --providers csattn,hf --shape docs=one \
        --shape tokens=${HF_TOKENS:-4096} --warmup-ms 5 --rep-ms 30 --commit "$C" --json "$OUT/model_hf.json" \
        >> "$LOG" 2>&1
      echo "model-hf rc=$?" >> "$LOG" ;;
    model-kept)
      stage "what the model keeps for the backward, per component"
      timeout 200 python3 -m benchmarks.live_tensors --model --tokens 16384 --json "$OUT/model_kept.json" \
        > "$OUT/model_kept.txt" 2>&1
      echo "model-kept rc=$?" >> "$LOG" ;;
    model-targets)
      stage "model step targets: profile, recompute choices, 64 experts, longest streams, HF eager's longest"
      B="python3 -m benchmarks.run --op model --mode fwdbwd --commit $C"
      timeout 100 $B --providers csattn --shape tokens=16384 --profile --profile-top 40 --warmup-ms 5 --rep-ms 20 \
        --json "$OUT/model_profile.json" >> "$LOG" 2>&1
      timeout 120 $B --providers csattn --shape tokens=16384 --shape recompute=mhc,moe,block --warmup-ms 5 \
        --rep-ms 20 --json "$OUT/model_recompute.json" >> "$LOG" 2>&1
      timeout 200 $B --providers csattn --shape tokens=16384 --shape experts=64 --shape topk_experts=6 \
        --shape recompute=none,block --warmup-ms 5 --rep-ms 20 --json "$OUT/model_64x6.json" >> "$LOG" 2>&1
      timeout 100 $B --providers csattn --shape tokens=131072 --single --json "$OUT/model_128k.json" >> "$LOG" 2>&1
      timeout 100 $B --providers csattn,hf --shape docs=one --shape tokens=6144 --warmup-ms 1 --rep-ms 10 \
        --json "$OUT/model_hf6k.json" >> "$LOG" 2>&1
      timeout 150 $B --providers csattn --shape tokens=262144,524288 --shape recompute=block --single \
        --json "$OUT/model_long.json" >> "$LOG" 2>&1
      echo "model-targets rc=$?" >> "$LOG" ;;
    layer-ab)
      # BEFORE=<dir> holds an older tree (git archive <sha> csattn benchmarks | tar -x -C <dir>): the layer and the
      # layer-step benchmarks of both trees, interleaved in one run, for a before / after comparison
      stage "layer and layer-step benchmarks: ${BEFORE:?set BEFORE} (commit ${BEFORE_COMMIT:-?}) against this tree"
      for op in layer layer_step; do
        for side in before after; do
          dir=$PWD; c=$C
          if [ $side = before ]; then dir=$(cd "$BEFORE" && pwd); c=${BEFORE_COMMIT:-before}; fi
          if [ $op = layer ]; then args="--mode fwdbwd --providers triton --shape tokens=8192,32768 --shape layer=csa,hca"
          else args="--mode fwd --providers eager,capture_safe,graph --shape tokens=4096,32768 --shape layer=csa"; fi
          (cd "$dir" && PYTHONPATH="$dir" timeout 150 python3 -m benchmarks.run --op $op $args --warmup-ms 5 \
            --rep-ms 40 --commit "$c" --json "$OUT/${op}_$side.json") >> "$LOG" 2>&1
          echo "$op $side rc=$?" >> "$LOG"
        done
      done ;;
    peers-unpack)
      # run 1 of two made back to back: the CuTe-DSL runtime (.peerwhl/c1, ../shared/peers/make_bundles.sh)
      stage "unpack the CuTe-DSL runtime for cuDNN Frontend"
      mkdir -p /tmp/cu13 && tar -xJf .peerwhl/c1/cutlass_dsl_libs_cu13.tar.xz -C /tmp/cu13 && echo unpacked >> "$LOG" ;;
    peers)
      # run 2, right after peers-unpack (carry .peerwhl/c2): cuDNN's DSA kernels beside csattn's, one run
      stage "csattn vs cuDNN Frontend DSA: sparse-attention backward, indexer top-k, agreement tests; the forward"
      if [ ! -d /tmp/cu13/nvidia_cutlass_dsl ]; then echo "a fresh machine: run STAGES=peers-unpack first" >> "$LOG"
      else
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .peerwhl/c2/*.whl >> "$LOG" 2>&1
        cp -a /tmp/cu13/. /tmp/site/
        export PYTHONPATH="/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH"
        timeout 120 python3 -m pytest -q tests/ops/test_peer_cudnn.py -p no:cacheprovider -rfEs >> "$LOG" 2>&1
        timeout 300 python3 -m benchmarks.run --op sparse_attn --mode bwd --providers "${PEER_BWD:-triton,cudnn}" \
          --shape tokens=8192,32768 --warmup-ms 10 --rep-ms 100 --commit "$C" --json "$OUT/peers_bwd.json" >> "$LOG" 2>&1
        if [ -n "${BEFORE:-}" ]; then
          # the backward of an older tree (BEFORE, as for layer-ab) in the same call, right after
          (cd "$BEFORE" && PYTHONPATH="$(pwd):$PYTHONPATH" timeout 150 python3 -m benchmarks.run --op sparse_attn \
            --mode bwd --providers triton --shape tokens=8192,32768 --warmup-ms 10 --rep-ms 100 \
            --commit "${BEFORE_COMMIT:-before}" --json "$OUT/peers_bwd_before.json") >> "$LOG" 2>&1
        fi
        # PEER_INDEXER=0: leave out the indexer's two comparisons (a call that changed no indexer kernel)
        if [ "${PEER_INDEXER:-1}" = 1 ]; then
          timeout 150 python3 -m benchmarks.run --op indexer_topk --mode fwd --providers "${PEER_TOPK:-triton,cudnn}" \
            --shape tokens=8192,32768 --warmup-ms 10 --rep-ms 100 --commit "$C" --json "$OUT/peers_topk.json" >> "$LOG" 2>&1
          # the selection alone (scores computed beforehand), csattn's beside cuDNN's radix top-k
          timeout 120 python3 -m benchmarks.run --op indexer_select --mode fwd --providers "${PEER_SELECT:-triton,cudnn}" \
            --shape tokens=8192,32768 --warmup-ms 10 --rep-ms 100 --commit "$C" --json "$OUT/peers_select.json" >> "$LOG" 2>&1
        fi
        # the forward target (no SM90 peer kernel in cuDNN): csattn alone, 640 keys a row, and the per-tile /
        # per-item split over 256 / 640 / 1280 keys a row
        timeout 120 python3 -m benchmarks.run --op sparse_attn --mode fwd --providers "${PEER_FWD:-triton}" \
          --shape tokens=8192,32768 --shape topk=128,512,1152 --warmup-ms 10 --rep-ms 100 --commit "$C" \
          --json "$OUT/peers_fwd.json" >> "$LOG" 2>&1
        # what bounds the backward: the rate L2 takes its dkv reductions at, alone (lab/probes/l2_reduction_probe.py)
        if [ "${PEER_PROBE:-1}" = 1 ]; then
          timeout 90 python3 lab/probes/l2_reduction_probe.py --json "$OUT/l2_reduction_probe.json" >> "$LOG" 2>&1
          echo "l2 probe rc=$?" >> "$LOG"
        fi
        echo "peers done" >> "$LOG"
      fi ;;
    *) echo "unknown stage $s" >> "$LOG" ;;
  esac
done
stage done
