"""The tiles of the Gluon FP8 grouped GEMM (:mod:`.gluon`): their size, shared-memory and accumulator layouts, how a
program's work item finds its group on the device, and the group table the host makes for it. Shared by the
kernel's forms (:mod:`.gluon`, :mod:`.gluon_wide`)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

from ..backend import interpreting, sm_count

# Renamed between releases (Triton 3.6: async_copy_global_to_shared and thread_barrier; later: async_load, barrier)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_cta_sync = getattr(gl, "thread_barrier", None) or gl.barrier

BM: gl.constexpr = gl.constexpr(128)  # rows of a tile: two math warpgroups of 64
BN: gl.constexpr = gl.constexpr(128)  # output columns of a tile: one block of the weight's scales
BK: gl.constexpr = gl.constexpr(128)  # contraction step: one block of both scales


@gluon.constexpr_function
def tile_smem():
    """Shared-memory layout of every ``[128, 128]`` FP8 tile (128-byte swizzle; what the TMA copies and the MMA
    read)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)


@gluon.constexpr_function
def permuted_tile_smem():
    """:func:`tile_smem` of a ``[128, 128]`` FP8 tile copied as ``[4, 32, 128]`` (the input gradient's weight tile with
    its rows permuted, ``gluon.permuted_w_desc``): the same 128-byte swizzle over its rows."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3)


@gluon.constexpr_function
def acc_layout():
    """Warpgroup-MMA register layout of one math warpgroup's ``[64, BN]`` accumulator."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])


@gluon.constexpr_function
def lanes_layout(n, warps=4, ctas=1):
    """A ``[n]`` layout (``n >= 32``) every warp of a ``warps``-warp partition holds whole: reductions over it stay
    within the warp (shuffles, no shared memory); in a cluster of ``ctas``, whole in each CTA too."""
    per = n // 32
    return gl.DistributedLinearLayout(reg_bases=[[1 << b] for b in range(per.bit_length() - 1)],
                                      lane_bases=[[per << b] for b in range(5)],
                                      warp_bases=[[0]] * (warps.bit_length() - 1),
                                      block_bases=[[0]] * (ctas.bit_length() - 1), shape=[n])


@gluon.jit
def _tile(t, table, tiles_m, tiles_n, E_P2: gl.constexpr, GROUP_M: gl.constexpr, WARPS: gl.constexpr = 4,
          TILE_M: gl.constexpr = BM, CTAS: gl.constexpr = 1):
    """Work item ``t`` -> (group, first row, end row, column tile); group ``E + 1`` or more: no tile. ``table``
    ``[3, E_P2]``: the groups' row starts, row ends and the running sum of their row-tile counts
    (:func:`group_table`, made on the device by torch: Triton 3.6's Gluon scans no layout the lookup can use).
    The group is the count of running sums at or below the row tile, read 128 at a time (held whole, 512 groups
    would take the producer's registers). ``GROUP_M`` row tiles side by side share the weight tiles in L2.
    ``WARPS``: the calling partition's; ``TILE_M``: the rows of a tile (the table's ``bm``); ``CTAS``: the cluster's
    (each CTA reads the table whole)."""
    per_group = GROUP_M * tiles_n
    first_m = (t // per_group) * GROUP_M
    size_m = gl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (t % per_group) % size_m
    pid_n = (t % per_group) // size_m
    idx = gl.arange(0, 128, layout=lanes_layout(128, WARPS, CTAS))
    g = pid_m * 0
    for c in gl.static_range(E_P2 // 128):
        g += gl.sum((gl.load(table + 2 * E_P2 + c * 128 + idx) <= pid_m).to(gl.int32), axis=0)
    start = gl.load(table + g)
    end = gl.load(table + E_P2 + g)
    first = gl.load(table + 2 * E_P2 + g) - (gl.maximum(end - start, 0) + TILE_M - 1) // TILE_M
    return g, start + (pid_m - first) * TILE_M, end, pid_n


@triton.jit
def _group_table_kernel(offs, table, E, M, BM: tl.constexpr, E_P2: tl.constexpr):
    idx = tl.arange(0, E_P2)
    group = idx <= E  # the groups and the rows past offs[-1] (group E)
    ends = tl.where(idx == E, M, tl.load(offs + idx, mask=idx < E, other=0).to(tl.int32))
    starts = tl.load(offs + idx - 1, mask=(idx >= 1) & group, other=0).to(tl.int32)
    ends = tl.where(group, ends, 0)
    run = tl.cumsum((tl.maximum(ends - starts, 0) + BM - 1) // BM, axis=0)
    tl.store(table + idx, starts)
    tl.store(table + E_P2 + idx, ends)
    tl.store(table + 2 * E_P2 + idx, tl.where(group, run, 2 ** 30))


def group_table(offs: Tensor, m: int, e_p2: int, bm: int = BM.value) -> Tensor:
    """:func:`group_table_ref` in one Triton launch (on the GPU, or under the interpreter) instead of its ~12 small
    torch ops before each of the MoE's four GEMMs (on an H100 at 7989847 the frozen MoE's kernels took 16.51-16.57 ms
    against 16.82: sixteen fill kernels a step, four a table, among what left the stream)."""
    e = offs.shape[0]
    if not (offs.is_cuda or interpreting()) or e + 2 > e_p2:
        return group_table_ref(offs, m, e_p2, bm)
    table = torch.empty(3, e_p2, dtype=torch.int32, device=offs.device)
    _group_table_kernel[(1,)](offs, table, e, m, BM=bm, E_P2=e_p2, num_warps=4)
    return table


def group_table_ref(offs: Tensor, m: int, e_p2: int, bm: int = BM.value) -> Tensor:
    """``[3, e_p2]`` int32 on ``offs``'s device, no host read: per group ``g <= E`` (``E``: the rows past
    ``offs[-1]``, up to ``m``) its first row, its end row and the running sum of the groups' ``bm``-row tile counts;
    the padding columns start and end at 0 and their running sum is past every tile."""
    e = offs.shape[0]
    ends = torch.cat([offs.to(torch.int32), offs.new_full((1,), m, dtype=torch.int32)])
    starts = torch.cat([offs.new_zeros(1, dtype=torch.int32), offs[:-1].to(torch.int32), offs[-1:].to(torch.int32)])
    table = torch.zeros(3, e_p2, dtype=torch.int32, device=offs.device)
    table[0, :e + 1], table[1, :e + 1] = starts, ends
    table[2] = 2 ** 30
    table[2, :e + 1] = torch.cumsum(((ends - starts).clamp_min(0) + bm - 1) // bm, 0)
    return table


class TileWalk(NamedTuple):
    """What a persistent program walks: the group table (:func:`group_table`), its padded group count ``e_p2``, the
    row and column tile counts, and the grid."""

    table: Tensor
    e_p2: int
    tiles_m: int
    tiles_n: int
    grid: tuple[int]


def tile_walk(offs: Tensor, m: int, n_out: int, tile_m: int, tile_n: int) -> TileWalk:
    """The work of a persistent kernel over ``m`` expert-sorted rows (groups ending at ``offs``) and ``n_out`` output
    columns in ``[tile_m, tile_n]`` tiles: ``ceil(m / tile_m) + E + 1`` row tiles (room for every group's partial
    last tile and the rows past ``offs[-1]``), the table padded to a power of two of at least 128 groups (:func:`_tile`
    reads it 128 at a time), one program an SM at most."""
    e = offs.shape[0]
    e_p2 = max(128, triton.next_power_of_2(e + 2))
    tiles_m, tiles_n = triton.cdiv(m, tile_m) + e + 1, n_out // tile_n
    return TileWalk(group_table(offs, m, e_p2, bm=tile_m), e_p2, tiles_m, tiles_n,
                    (min(tiles_m * tiles_n, sm_count(offs.device)),))
