"""``benchmarks.finetune`` with kernel forms that are off by default switched on for the run, to measure what they
would give a step before they become the default (or what the default gives over them): ``--no-fuse-low-rank``
(LoRA's term added after the Gluon FP8 kernel, not in its epilogue: ``gluon.FUSE_LOW_RANK`` off), ``--wide`` (the
forward over 64 x 256 tiles, ``gluon_wide.WIDE_FORWARD`` on). Write to another ``--json`` than the page's records: a
variant is not the library's default path. Run on an H200:
python -m lab.finetune_variant --wide -- --ckpt /tmp/csattn_v4_flash_slice --json v.json --parts steps --cases a:16384
"""

from __future__ import annotations

import argparse
import sys
from unittest import mock

import csattn.ops.fp8.gluon as fp8_gluon
import csattn.ops.fp8.gluon_wide as fp8_wide
from benchmarks.finetune import main as finetune_main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-fuse-low-rank", action="store_true", help="LoRA's term added after the FP8 kernel")
    ap.add_argument("--wide", action="store_true", help="the forward over 64 x 256 tiles")
    args = ap.parse_args(argv[:cut])
    fuse = not args.no_fuse_low_rank
    print(f"[variant] FUSE_LOW_RANK={fuse} WIDE_FORWARD={args.wide}", flush=True)
    with mock.patch.object(fp8_gluon, "FUSE_LOW_RANK", fuse), mock.patch.object(fp8_wide, "WIDE_FORWARD", args.wide):
        return finetune_main(argv[cut + 1:])


if __name__ == "__main__":
    sys.exit(main())
