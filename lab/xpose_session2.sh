#!/usr/bin/env bash
# Second device call: the transposition variants (lab/probes/fp8_gluon_xpose.py) and where the frozen-expert MoE's
# time goes (lab/probes/moe_profile.py). In $OUT.
set -u
OUT=${OUT:-/tmp/xpose}; mkdir -p "$OUT"; START=$SECONDS
. "$(dirname "$0")/device_env.sh"
timeout 240 python3 -m lab.probes.fp8_gluon_xpose 2>&1 | grep -v Warning | tee "$OUT/xpose2.txt" | tail -24
echo "[xpose] $((SECONDS - START)) s"
timeout 120 python3 -m lab.probes.moe_profile 2>&1 | grep -v Warning | tee "$OUT/moe_profile.txt" | tail -34
echo "[session] $((SECONDS - START)) s"
