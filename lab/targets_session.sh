#!/usr/bin/env bash
# One device call (H200) for issue 45's numbers: first the GPU tests of the routes the steps take that no GPU has run
# yet (the input gradient on the K-major copy, the op's default from 1024 rows an expert: the slice at 64k; the wide
# forward), then the frozen MoE (the finetune page's moe part), the V4-Flash slice
# written in the release format, (d) / (a) / (b) / (c) at 16k and (a) / (c) at 64k with the library's defaults; then
# (a) at 16k with the forward over 64 x 256 tiles and with the defaults again (alternating: the card's clocks drift),
# then lab.probes.fp8_gluon_wide (the wide kernel alone and in the frozen MoE, on and off), and only when named:
# lab.probes.fp8_gluon_xpose3 (the input gradient with a copier warp and two transposers), lab.probes.moe_profile
# (where the frozen MoE's kernels' time goes), lab.probes.fp8_dgrad_sweep (the input gradient's forms and settings),
# lab.probes.fp8_dgrad_copier (the input gradient's PAIRED / PERMUTED forms, bit for bit and timed),
# lab.probes.moe_launch_sweep (its elementwise kernels' launch settings), the frozen MoE alternating with the trees at
# BASE (earlier commits' csattn, benchmarks, lab/probes, tests/helpers: `git archive`; profile runs in them too).
# In $OUT. The device's copy of .git is stale: pass COMMIT by hand.
#   COMMIT=<sha> [PARTS="tests ptests moe steps variants wide xpose3 profile base dsweep forms sweep": which, in order] \
#     [BASE="<dir> ..."] [TESTS_S=<s>] [TESTS_K=<pytest -k>] [TESTS_F=<test files>] \
#     bash lab/targets_session.sh
set -u
has() { case " ${PARTS:-tests moe steps variants wide} " in *" $1 "*) return 0;; esac; return 1; }
OUT=${OUT:-/tmp/targets}; mkdir -p "$OUT"; START=$SECONDS; C=${COMMIT:-unknown}; CK=/tmp/csattn_v4_flash_slice
. "$(dirname "$0")/device_env.sh"
has tests && { timeout ${TESTS_S:-260} python3 -m pytest -q -p no:cacheprovider -k "${TESTS_K:-copy_equals or takes_the_copy or wide_forward or split or rows or swiglu or quantize or gluon or moe_fp8}" \
  tests/ops/test_fp8_gpu.py > "$OUT/gpu_tests.txt" 2>&1; grep -E "passed|failed|^FAILED|^E  " "$OUT/gpu_tests.txt" | tail -6; }
# the same tests, each in its own process, 8 at a time (in_own_process's child form, named by its node id)
has ptests && { python3 -m pytest -q -p no:cacheprovider --collect-only -k "${TESTS_K:-split or trans or moe_fp8 or low_rank or copy}" \
  ${TESTS_F:-tests/ops/test_fp8_gpu.py} 2>/dev/null | grep "::" > "$OUT/ptests_ids.txt"
  mkdir -p "$OUT/ptests"; export OUT
  timeout ${TESTS_S:-260} xargs -P 8 -I{} sh -c 'f="$OUT/ptests/$(echo "{}" | sed "s/.*:://" | tr -c "A-Za-z0-9_-" _).txt"
    CSATTN_TEST_CHILD="{}" python3 -m pytest -q -p no:cacheprovider "{}" > "$f" 2>&1 && echo "PASS {}" || echo "FAIL {}"' \
    < "$OUT/ptests_ids.txt" > "$OUT/ptests.txt"
  echo "$(grep -c ^PASS "$OUT/ptests.txt") passed, $(grep -c ^FAIL "$OUT/ptests.txt") failed of $(wc -l < "$OUT/ptests_ids.txt")"
  grep ^FAIL "$OUT/ptests.txt" | head; }
echo "[tests] $((SECONDS - START)) s"
has moe && timeout 90 python3 -m benchmarks.finetune --ckpt /tmp/none --json "$OUT/finetune_moe.json" --parts moe --commit "$C" \
  2>&1 | grep -E "^(fp8|bf16|w8a16) " | tail -6
echo "[moe] $((SECONDS - START)) s"
has steps && timeout 300 python3 -m benchmarks.finetune --ckpt $CK --json "$OUT/finetune_steps.json" --parts write,steps \
  --draw device --steps 5 --cases "d:16384;a:16384,65536;b:16384;c:16384,65536" --commit "$C" 2>&1 | grep -E "^\[" | tail -20
echo "[steps] $((SECONDS - START)) s"
has variants && timeout 60 python3 -m benchmarks.finetune --ckpt $CK --parts write --draw device --json "$OUT/write.json" \
  --commit "$C" 2>&1 | grep -E "^\[" | tail -1  # kept if the steps wrote it
has variants && for way in wide default wide; do
  flag=$([ $way = wide ] && echo --wide)
  timeout 70 python3 -m lab.finetune_variant $flag -- --ckpt $CK --json "$OUT/variant_${way}_$SECONDS.json" \
    --parts steps --steps 5 --cases "a:16384" --commit "$C" 2>&1 | grep -E "^\[(variant|steps)\] .*(ms|WIDE)" | tail -2
done
echo "[variants] $((SECONDS - START)) s"
has wide && { timeout 130 python3 -m lab.probes.fp8_gluon_wide > "$OUT/wide_probe.txt" 2>&1; grep -v Warning "$OUT/wide_probe.txt"; }
has xpose3 && { timeout 150 python3 -m lab.probes.fp8_gluon_xpose3 > "$OUT/xpose3_probe.txt" 2>&1; grep -v Warning "$OUT/xpose3_probe.txt" | tail -8; }
has profile && for dir in . ${BASE:-}; do
  (cd "$dir" && timeout 90 python3 -m lab.probes.moe_profile > "$OUT/moe_profile_$(basename "$dir").txt" 2>&1)
  echo "## $dir"; grep -v -i warn "$OUT/moe_profile_$(basename "$dir").txt" | head -9
done
# the frozen MoE here and in the trees at $BASE (earlier commits' csattn and benchmarks), alternating
has base && for i in 1 2; do for dir in . ${BASE:-}; do
  (cd "$dir" && timeout 90 python3 -m benchmarks.finetune --ckpt /tmp/none --json "$OUT/finetune_moe_$(basename "$dir")_$i.json" \
    --parts moe --commit "$C" 2>&1 | grep -E "^(fp8|bf16) " | sed "s|^|[$(basename "$dir")] |" | tail -3)
done; done
has dsweep && { timeout 200 python3 -m lab.probes.fp8_dgrad_sweep > "$OUT/dgrad_sweep.txt" 2>&1; grep -v Warn "$OUT/dgrad_sweep.txt"; }
has forms && { timeout 240 python3 -m lab.probes.fp8_dgrad_copier > "$OUT/dgrad_forms.txt" 2>&1; grep -v Warn "$OUT/dgrad_forms.txt"; }
has sweep && { timeout 150 python3 -m lab.probes.moe_launch_sweep > "$OUT/launch_sweep.txt" 2>&1; grep -v Warn "$OUT/launch_sweep.txt"; }
echo "[session] $((SECONDS - START)) s"
