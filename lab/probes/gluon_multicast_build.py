"""Whether Gluon builds for sm_90 what the frozen MoE's forward would need to halve its activation tiles' L2 traffic:
two CTAs of a cluster on neighbouring 128-column tiles of one 128-row block, the ``[128, 128]`` FP8 activation tile
copied once by TMA multicast into both, each CTA's ``[128, 128]`` weight tile its own, an e4m3 wgmma per CTA.
Build only (no GPU): prints what the PTX holds. Needs Triton > 3.6 (3.6 has no ``multicast=``):

    TRITON_DEFAULT_FP_FUSION=1 python -m lab.probes.gluon_multicast_build

Gluon's multi-CTA model: a tensor's shape is the cluster's; ``cga_layout`` gives one basis per CTA-id bit, in units
of the CTA's share: ``[[0, 0]]`` the same tile in both CTAs (the multicast operand), ``[[1, 0]]`` split by rows,
``[[0, 1]]`` by columns. Element offsets as bases are refused at the descriptor's type ("layout is expected to be
surjective"). A step's transaction bytes are ``desc.nbytes_per_cta``.

What the PTX shows (Triton 3.9): CTA 0 alone issues the multicast copy (``cp.async.bulk.tensor ... multicast::cluster``,
CTA mask 3), each CTA's own barrier expects ``nbytes_per_cta`` (here 32 KB: its copy of the shared tile and its own
tile), ``.reqnctapercluster 2``, 32 KB of shared memory a CTA.

Not built here, and what a kernel needs beyond it (found while writing this):
- The ring's free-stage barrier across the cluster: CTA 0 refills a shared stage only once both CTAs' math warpgroups
  released it. ``hopper.mbarrier.arrive(bar, from_cta=0)`` routes an arrival to CTA 0's barrier (``from_cta`` keeps
  those CTA-id bits; the default arrives on the CTA's own). The code is the same in both CTAs and Gluon has no CTA
  rank to predicate on, so a barrier every producer waits on must get the same count in both CTAs: arrivals to self
  and to CTA 0 give CTA 0 six and CTA 1 two. Blackwell's ``arrive`` has ``multicast_cta``; Hopper's has not.
- Which operand to share. Pairs on neighbouring column tiles (this probe: the activation tile shared) need each
  CTA's own weight scale in the promotion, a per-CTA value that a cluster-level scalar cannot hold (a [256]-column
  vector would double the promotion's multiplies). Pairs on neighbouring row tiles (the weight tile shared, as
  ``gluon_wide``'s 64-row tiles two to a cluster) keep the weight scale uniform and the rows' scales each CTA's own,
  at the 128-row tiles' padding (1.150x the routed rows at 256 experts top-6 and 16k) instead of 1.075x; bytes from
  L2 a step and CTA: 8 KB + 16 KB against the wide kernel's 8 + 32.
- The persistent walk in pairs (both CTAs in one expert group), the promotion's scales, LoRA's term.
"""

from __future__ import annotations

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma

A_CGA = gl.constexpr([[0, 0]])  # the activation tile: the same in both CTAs
B_CGA = gl.constexpr([[1, 0]])  # the weight tile [256, 128]: each CTA its 128 rows
ACC_CGA = gl.constexpr([[0, 1]])  # the result [128, 256]: each CTA its 128 columns


@gluon.jit
def multicast_step_kernel(a_desc, b_desc, out, KC, stride_om):
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32],
                                                  cga_layout=ACC_CGA)
    a_s = gl.allocate_shared_memory(gl.float8e4nv, [128, 128], a_desc.layout)
    b_s = gl.allocate_shared_memory(gl.float8e4nv, [256, 128], b_desc.layout)
    bar = mbarrier.allocate_mbarrier()
    mbarrier.init(bar, count=1)
    acc = gl.zeros([128, 256], gl.float32, layout=ACC)
    phase = 0
    for k in range(0, KC, 128):
        mbarrier.expect(bar, a_desc.nbytes_per_cta + b_desc.nbytes_per_cta)
        tma.async_load(a_desc, [0, k], bar, a_s, multicast=True)
        tma.async_load(b_desc, [0, k], bar, b_s)
        mbarrier.wait(bar, phase)
        phase ^= 1
        acc = warpgroup_mma(a_s, b_s.permute((1, 0)), acc)
    OUT: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0], cga_layout=ACC_CGA)
    val = gl.convert_layout(acc.to(gl.bfloat16), OUT)
    rows = gl.arange(0, 128, layout=gl.SliceLayout(1, OUT))
    cols = gl.arange(0, 256, layout=gl.SliceLayout(0, OUT))
    gl.store(out + gl.expand_dims(rows * stride_om, 1) + gl.expand_dims(cols, 0), val)


def main() -> None:
    a_l = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2, cga_layout=A_CGA.value)
    b_l = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2, cga_layout=B_CGA.value)
    sig = {"a_desc": f"tensordesc<fp8e4nv[128, 128],{a_l!r}>", "b_desc": f"tensordesc<fp8e4nv[256, 128],{b_l!r}>",
           "out": "*bf16", "KC": "i32", "stride_om": "i32"}
    src = GluonASTSource(fn=multicast_step_kernel, signature=sig, attrs={}, constexprs={})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_ctas": 2})
    ptx = kernel.asm["ptx"]
    print(f"triton {triton.__version__}")
    print("TMA copies:", sorted(set(re.findall(r"cp\.async\.bulk\.tensor[^\s]*", ptx))))
    print("MMAs:", sorted(set(re.findall(r"wgmma\.mma_async[^\s]*", ptx))))
    print("cluster:", re.findall(r"\.reqnctapercluster[^\n]*|\.explicitcluster", ptx))
    print("shared bytes a CTA:", kernel.metadata.shared)


if __name__ == "__main__":
    main()
