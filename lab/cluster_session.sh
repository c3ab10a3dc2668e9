#!/usr/bin/env bash
# Device calls (sm_90) for the forward with the weight tile multicast to a cluster of two
# (lab.probes.fp8_gluon_cluster), which needs Triton > 3.6: first `bash lab/triton39.sh pack` here, then two calls on
# one warm machine, the first carrying [".triton39/part0"], the second [".triton39/part1"] (a part and the tree are
# ~58 MB of the call's 64 MiB: no .whl beside them; the probe needs neither transformers nor peft):
#   bash lab/cluster_session.sh
# Each moves its part out of the tree; once the set is whole (sha256 of lab/triton39.sha256) it unpacks Triton 3.9 and
# runs the probe: its build facts, then the output against gluon_wide's bit for bit and both timed (in a process of
# its own under a timeout: a new kernel's first run, whose barriers span two CTAs). In $OUT.
set -u
OUT=${OUT:-/tmp/cluster}; mkdir -p "$OUT"; START=$SECONDS
bash "$(dirname "$0")/triton39.sh" unpack || exit 1
[ -d /tmp/t39site/triton ] || exit 0
. "$(dirname "$0")/device_env.sh"
# in-tree backends: the parts carry no dist-info, and the image's Triton 3.6 has its own entry points
export PYTHONPATH=/tmp/t39site:${PYTHONPATH:-} TRITON_DEFAULT_FP_FUSION=1 TRITON_BACKENDS_IN_TREE=1
timeout 200 python3 -m lab.probes.fp8_gluon_cluster --build > "$OUT/cluster_build.txt" 2>&1
grep -v "leaked\|nanobind\|refleaks\|skipped remainder" "$OUT/cluster_build.txt" | tail -6
timeout "${PROBE_TIMEOUT:-240}" python3 -m lab.probes.fp8_gluon_cluster > "$OUT/cluster_probe.txt" 2>&1
echo "probe rc $?"; grep -v "leaked\|nanobind\|refleaks\|skipped remainder\|Warning" "$OUT/cluster_probe.txt" | tail -20
echo "[session] $((SECONDS - START)) s"
