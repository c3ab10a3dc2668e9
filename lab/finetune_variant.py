"""``benchmarks.finetune`` with kernel forms that are off by default switched on for the run, to measure what they
would give a step before they become the default (or what the default gives over them): ``--no-fuse-low-rank``
(LoRA's term added after the Gluon FP8 kernel, not in its epilogue: ``gluon.FUSE_LOW_RANK`` off), ``--inplace`` (the
input gradient transposing each weight tile in place, ``gluon.inplace_settings()``), ``--swap`` (the input
gradient's SWAP form, ``gluon.SWAP_SETTINGS``). Write to another ``--json`` than the page's records: a variant is not
the library's default path. Run on an H200:
python -m lab.finetune_variant --swap -- --ckpt /tmp/csattn_v4_flash_slice --json v.json --parts steps --cases a:16384
"""

from __future__ import annotations

import argparse
import sys
from unittest import mock

import csattn.ops.fp8.gluon as fp8_gluon
from benchmarks.finetune import main as finetune_main
from lab.probes.gluon_forms import input_grad_form


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-fuse-low-rank", action="store_true", help="LoRA's term added after the FP8 kernel")
    form = ap.add_mutually_exclusive_group()
    form.add_argument("--inplace", action="store_true", help="the input gradient transposing in place")
    form.add_argument("--swap", action="store_true", help="the input gradient's SWAP form")
    args = ap.parse_args(argv[:cut])
    fuse = not args.no_fuse_low_rank
    settings = fp8_gluon.inplace_settings() if args.inplace else fp8_gluon.SWAP_SETTINGS if args.swap else None
    print(f"[variant] FUSE_LOW_RANK={fuse} INPLACE={args.inplace} SWAP={args.swap}", flush=True)
    with mock.patch.object(fp8_gluon, "FUSE_LOW_RANK", fuse), input_grad_form(settings):
        return finetune_main(argv[cut + 1:])


if __name__ == "__main__":
    sys.exit(main())
