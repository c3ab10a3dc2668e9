#!/usr/bin/env bash
# Every JSON file of the results page, measured on the lent H200 at one commit in two device calls made back to
# back (the same machine: /tmp lasts between them). A call carries at most 64 MiB, the tracked tree included, so the
# CuTe-DSL runtime bundle of ../shared/peers/make_bundles.sh (.peerwhl/c1, one xz file) travels in two pieces.
#
#   here, once:  bash /work/shared/peers/make_bundles.sh     # .peerwhl/c1, .peerwhl/c2
#                pip download --no-deps -d .whl transformers==5.23.0
#                bash lab/results_session.sh split         # .peerwhl/c1 -> .peerwhl/c1a + .peerwhl/c1b
#                (/.peerwhl/ and /.whl/ in .git/info/exclude: ignored paths travel only when carried)
#   call 1, carry .peerwhl/c1a:                  CSATTN_COMMIT=<sha> bash lab/results_session.sh 1
#       the model step (16k-512k), csattn train on one GPU and on gloo meshes           about 8.5 min
#   call 2, carry .peerwhl/c1b .peerwhl/c2 .whl: CSATTN_COMMIT=<sha> bash lab/results_session.sh 2
#       the CUDA-graph step, the kernels against cuDNN, the model against HF eager, the
#       deterministic mode's cost                                                        about 5.5 min
#   call 3 (any machine):                        CSATTN_COMMIT=<sha> bash lab/results_session.sh 3
#       the CP = 4 and CP = 1 reports                                                   about 9.5 min
#   here:        copy the calls' $OUT/*.json into benchmarks/results/h200/, then
#                python -m benchmarks.results --out BENCHMARKS.md   # the page, its plot, docs/report
# To measure a commit while the working tree moves on, carry its `git archive` as .meas as well and run
# `cd .meas && ln -s ../.peerwhl ../.whl . && ... bash lab/results_session.sh N`.
# Each call stops starting commands after BUDGET_S seconds (default 570) and prints every command's time.
set -euo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-out}
BUDGET_S=${BUDGET_S:-570}
measure() {
  python3 -m benchmarks.results --measure --commit "${CSATTN_COMMIT:?set CSATTN_COMMIT: the tree has no git there}" \
    --json-dir "$OUT" --budget-s "$BUDGET_S" --stages "$@"
}
case ${1:?usage: results_session.sh split, 1, 2 or 3} in
  split)
    rm -rf .peerwhl/c1a .peerwhl/c1b && mkdir -p .peerwhl/c1a .peerwhl/c1b
    split -b 44M -d .peerwhl/c1/cutlass_dsl_libs_cu13.tar.xz .peerwhl/c1a/cu13.tar.xz.
    mv .peerwhl/c1a/cu13.tar.xz.0[1-9] .peerwhl/c1b/
    du -sh .peerwhl/c1a .peerwhl/c1b .peerwhl/c2 .whl ;;
  1)
    rm -rf /tmp/cu13parts && mkdir -p /tmp/cu13parts && cp .peerwhl/c1a/* /tmp/cu13parts/  # for call 2
    export PYTHONPATH="$PWD"
    measure model sharded ;;
  2)
    mkdir -p /tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .peerwhl/c2/*.whl
    if [ -d /tmp/cu13parts ]; then
      mkdir -p /tmp/cu13 && cat /tmp/cu13parts/* .peerwhl/c1b/* | xz -d | tar -x -C /tmp/cu13 && cp -a /tmp/cu13/. /tmp/site/
    else
      echo "no /tmp/cu13parts: a fresh machine (call 1 ran elsewhere); the cuDNN rows will be skipped"
    fi
    export PYTHONPATH="/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD"
    python3 -c "import cudnn.deepseek_sparse_attention as d; d.DSA" || echo "cuDNN's DSA module does not import"
    measure graphs kernels hf deterministic ;;
  3)
    export PYTHONPATH="$PWD"
    measure report-cp4 report-cp1 ;;
  *) echo "usage: results_session.sh split, 1, 2 or 3" >&2; exit 2 ;;
esac
