"""The Gluon input gradient with the transposers reading the weight's words from global memory (``LOADS``) instead of
a TMA copy in shared memory that they read back: a stage's shared-memory traffic falls from ~112 KB (copies of both
tiles, the transposition's read and write, both math warpgroups' MMA reads) to ~80 KB, the forward's. Both GEMMs at
the slice's 16k tokens (256 experts top-6) against the default (the split transposition from TMA copies), bit for
bit and timed, over ``STAGES`` (a stage is 32 KB without the copied weight tile), then the frozen MoE with each.

    PYTHONPATH=. python -m lab.probes.fp8_dgrad_loads
"""

from __future__ import annotations

import torch

from csattn.ops.fp8.gluon import launch_settings
from lab.probes.gluon_forms import compare_moe, time_gemms

FORMS = {f"loads, {n} stages": {"LOADS": True, "STAGES": n} for n in (4, 5, 6)}


def main() -> None:
    print(f"== {torch.cuda.get_device_name()}; default {launch_settings(True)}", flush=True)
    time_gemms(FORMS)
    for _ in range(2):  # alternating: the card's clocks drift over a run
        compare_moe({"loads, 4 stages": FORMS["loads, 4 stages"], "loads, 6 stages": FORMS["loads, 6 stages"]})


if __name__ == "__main__":
    main()
