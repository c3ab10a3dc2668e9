"""``fp8_grouped_mm``: the MoE expert GEMMs over expert-sorted rows with frozen FP8 weights (see ``README.md``)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from ..backend import interpreting, triton_version
from .naive import BLOCK, FP8_DTYPE, _cdiv, _check_grouped, check_weight, fp8_grouped_mm_ref, low_rank_ref

__all__ = ["COMPUTES", "COPY_ROWS_PER_EXPERT", "Fp8Rows", "LowRank", "add_low_rank", "check_compute",
           "fp8_grouped_mm", "gluon_fits", "input_grad_copies", "kernel_compute", "takes_fp8_rows", "transposed_weight"]

COMPUTES = ("fp8", "w8a16")
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
# From this many rows per expert the Gluon input gradient multiplies a K-major copy of the weights made for the call
# (:func:`transposed_weight`) with the forward's kernel, instead of transposing each weight tile in the kernel.
# On an H100 at c228b90 the in-kernel transposition ran the MoE's input gradients at 539 TFLOP/s and the forward
# kernel 810 at the same shapes (lab/results/finetune_h100/fwd_probe_c228b90.txt): 1.24e-15 s saved per weight byte
# and row, against ~1e-12 s per weight byte for a copy read and written at ~2 TB/s: even at ~800 rows an expert. The
# 256-expert slice on one GPU (~384 rows an expert at 16k tokens) keeps the in-kernel transposition; ranks of the
# one-node plan (ep 8: ~1536 at 8k tokens a rank) take the copy. 1024 leaves room for the copy's bandwidth, which
# lab.probes.fp8_dgrad_copy measures.
COPY_ROWS_PER_EXPERT = 1024


class Fp8Rows(NamedTuple):
    """Rows already quantized per 1x128 tile (as :func:`~csattn.ops.fp8.quantize_1x128` gives them), for
    :func:`fp8_grouped_mm` where :func:`takes_fp8_rows` holds: so that a kernel that produces the rows can write
    them quantized, or rows can be quantized before a gather (per-row quantization commutes with it).

    Attributes:
        q: ``[M, C]`` ``float8_e4m3fn``. s: ``[M, ceil(C/128)]`` fp32, ``rows ~ q * s`` per tile.
    """

    q: Tensor
    s: Tensor

    @classmethod
    def empty(cls, rows: int, cols: int, device: torch.device) -> Fp8Rows:
        """Unwritten rows ``[rows, cols]`` (a kernel's destination)."""
        return cls(torch.empty((rows, cols), dtype=FP8_DTYPE, device=device),
                   torch.empty((rows, _cdiv(cols, BLOCK)), dtype=torch.float32, device=device))

    def check(self, name: str, rows: int | None = None, cols: int | None = None) -> None:
        """A ``ValueError`` naming ``name`` unless ``q`` is ``[rows, cols]`` e4m3 (by default its own shape) and ``s``
        ``[rows, ceil(cols/128)]`` fp32."""
        m, c = self.q.shape if rows is None else (rows, cols)
        want = (m, _cdiv(c, BLOCK))
        if self.q.dtype != FP8_DTYPE or tuple(self.q.shape) != (m, c) or self.s.dtype != torch.float32 \
                or tuple(self.s.shape) != want:
            raise ValueError(f"{name} must be (q [{m}, {c}] float8_e4m3fn, s {list(want)} fp32), got q "
                             f"{self.q.dtype} {tuple(self.q.shape)}, s {self.s.dtype} {tuple(self.s.shape)}")

    def index_select(self, index: Tensor) -> Fp8Rows:
        """Rows ``index`` of both (bitwise ``quantize_1x128(rows[index])``); the bytes go through ``uint8``, as
        ``index_select`` takes no float8."""
        return Fp8Rows(self.q.view(torch.uint8).index_select(0, index).view(self.q.dtype),
                       self.s.index_select(0, index))


class LowRank(NamedTuple):
    """A low-rank term added to a grouped GEMM's output: rows of group ``e`` get ``scale * v[rows] @ w[e]^T`` (LoRA's
    ``(x a_e^T) b_e^T``, or in the input gradient ``(dy b_e) a_e``, with ``w = a^T``).

    Attributes:
        v: ``[M, R]`` in the output's dtype. w: ``[E, n_out, R]``, same dtype. scale: the factor.
    """

    v: Tensor
    w: Tensor
    scale: float


def check_compute(compute: str) -> str:
    """``compute`` itself if it is one of :data:`COMPUTES`, else a ``ValueError`` naming them."""
    if compute not in COMPUTES:
        raise ValueError(f"compute must be 'fp8' (FP8 tensor cores) or 'w8a16' (bf16 numerics on FP8 storage), "
                         f"got {compute!r}")
    return compute


def kernel_compute(x: Tensor, compute: str) -> str | None:
    """The kernel mode the FP8 ops run for activations ``x`` and ``compute``: ``"fp8"`` (FP8 tensor cores, sm_89+),
    ``"w8a16"`` (bf16 / fp16 tensor cores), or None for the reference (CPU, fp32 / fp64, older GPUs)."""
    return _kernel_mode(x.dtype, x.device, compute)


def _kernel_mode(dtype: torch.dtype, device: torch.device, compute: str) -> str | None:
    check_compute(compute)
    if device.type != "cuda" or dtype not in KERNEL_DTYPES:
        return None
    cap = torch.cuda.get_device_capability(device)
    if compute == "fp8":
        return "fp8" if cap >= (8, 9) else None
    return "w8a16" if cap >= (8, 0) else None


def takes_fp8_rows(dtype: torch.dtype, device: torch.device, weight: Tensor, compute: str, trans: bool) -> bool:
    """Whether :func:`fp8_grouped_mm` quantizes rows of ``dtype`` on ``device`` per 1x128 tile for ``weight`` in mode
    ``compute`` (and so takes them as :class:`Fp8Rows` instead): the FP8 kernels run (``compute="fp8"`` on sm_89+,
    bf16 / fp16 rows) and the direction is one they take quantized rows in (``trans=False``, or the Gluon kernel)."""
    if _kernel_mode(dtype, device, compute) != "fp8":
        return False
    return not trans or _gluon_on(device, weight)


def fp8_grouped_mm(a: Tensor | Fp8Rows, weight: Tensor, scale: Tensor, offs: Tensor, trans: bool = False,
                   compute: str = "fp8", out_dtype: torch.dtype | None = None,
                   low_rank: LowRank | None = None) -> Tensor:
    """Expert GEMMs over contiguous expert-sorted rows, frozen FP8 weights.

    Args:
        a: ``[M, K]`` (``trans=False``) or ``[M, N]`` (``trans=True``), rows sorted by expert; or those rows already
            quantized (:class:`Fp8Rows`), where :func:`takes_fp8_rows` holds for ``out_dtype`` (else a ``ValueError``).
        weight: ``[E, N, K]`` ``float8_e4m3fn`` (not requiring grad). scale: ``[E, ceil(N/128), ceil(K/128)]`` fp32.
        offs: ``[E]`` int32, cumulative row end of each expert (as ``torch.nn.functional.grouped_mm`` takes);
            ``offs[-1] <= M``.
        trans: False: rows of expert ``e`` times ``W_e^T`` -> ``[M, N]`` (gate/up and down forward); True: times
            ``W_e`` -> ``[M, K]`` (their input gradients).
        compute: ``"fp8"``: ``a`` quantized per 1x128 tile (fused kernel), FP8 MMA, fp32 accumulation with the
            scales applied per 128-deep block (on sm_90 with ``N``, ``K`` multiples of 128 the Gluon kernel, both
            directions; elsewhere ``trans=True`` runs W8A16, as measured faster there); ``"w8a16"``: the
            weight tile cast to ``a``'s dtype in the kernel, bf16 / fp16 MMA.
            On CPU, for fp32 / fp64 ``a`` or GPUs without the MMA, the reference runs (``W_e`` dequantized to
            ``a``'s dtype one expert at a time, plain matmuls).
        out_dtype: the output dtype: required for :class:`Fp8Rows` (the dtype the rows were quantized from), else
            ``a``'s dtype (None or that).
        low_rank: a :class:`LowRank` term added to the output (``w [E, n_out, R]``, ``n_out`` the output's
            columns). The Gluon kernel can add it to its fp32 result before the one rounding (rank 16 or less,
            padded; one bf16 MMA a tile, its operands copied ahead by the producer; ``gluon.FUSE_LOW_RANK``);
            elsewhere, and at higher ranks, :func:`add_low_rank` adds it after (one Triton pass on CUDA).

    Returns:
        ``[M, N]`` or ``[M, K]`` in ``a``'s dtype (``out_dtype``); rows past ``offs[-1]`` are zero. Not
        differentiable (callers use it inside their own backward): ``a`` that requires grad under grad mode is
        refused.
    """
    if isinstance(a, Fp8Rows):
        _check_rows(a, weight, scale, offs, trans, compute, out_dtype)
        _check_low_rank(low_rank, a.q.shape[0], weight, trans, out_dtype)
        return _fp8_mm(a, weight, scale, offs, trans, out_dtype, low_rank)
    _check_grouped(a, weight, scale, offs, trans)
    if out_dtype not in (None, a.dtype):
        raise ValueError(f"out_dtype {out_dtype} is for pre-quantized rows (Fp8Rows); the output of a {a.dtype} "
                         "tensor a is in its dtype: leave out_dtype out")
    if a.requires_grad and torch.is_grad_enabled():
        raise ValueError("fp8_grouped_mm is not differentiable: call it under torch.no_grad() or inside an "
                         "autograd.Function (the MoE op does), or use fp8_linear for a differentiable dense layer")
    _check_low_rank(low_rank, a.shape[0], weight, trans, a.dtype)
    mode = kernel_compute(a, compute)
    if mode is None:
        return add_low_rank(fp8_grouped_mm_ref(a, weight, scale, offs, trans), low_rank, offs)
    from .triton import grouped_mm_triton, quantize_1x128_triton  # lazy: Triton optional

    if takes_fp8_rows(a.dtype, a.device, weight, compute, trans):
        return _fp8_mm(Fp8Rows(*quantize_1x128_triton(a)), weight, scale, offs, trans, a.dtype, low_rank)
    # trans=True elsewhere runs W8A16 in both modes: FP8 MMA wants W K-major, and neither Triton's transposition of
    # the FP8 tile (91-125 TFLOP/s on the H200) nor a transposed copy per call (107-110) beat the bf16 MMA on the
    # cast tile (~235); the Gluon kernel transposes the tile in shared memory (see README.md)
    return add_low_rank(grouped_mm_triton(a, None, weight, scale, offs, trans, out_dtype=a.dtype), low_rank, offs)


def _fp8_mm(a: Fp8Rows, weight: Tensor, scale: Tensor, offs: Tensor, trans: bool, out_dtype: torch.dtype,
            low_rank: LowRank | None) -> Tensor:
    """The FP8 kernels on quantized rows: Gluon where it fits (the low-rank term in its epilogue at rank 16 or
    less; the input gradient on a K-major copy of the weights where :func:`input_grad_copies` holds; the forward over
    ``[64, 256]`` tiles where ``gluon_wide.takes_wide`` holds), else Triton (``trans=False``)."""
    if gluon_fits(a.q, weight):
        from .gluon import FUSE_LOW_RANK, RANK, grouped_mm_gluon  # lazy: Gluon is experimental API

        fused = FUSE_LOW_RANK and low_rank is not None and low_rank.v.shape[1] <= RANK
        lr = _padded(low_rank, RANK) if fused else None
        if trans and input_grad_copies(a.q.shape[0], weight.shape[0]):
            # dY W_e = dY (W_e^T)^T: the same products as the transposing kernel's, bit for bit
            weight, scale = transposed_weight(weight, scale)
            trans = False
        from .gluon_wide import grouped_mm_gluon_wide, takes_wide

        if not trans and takes_wide(a.q.shape[0], weight):  # [64, 256] tiles: the same bits
            out = grouped_mm_gluon_wide(a.q, a.s, weight, scale, offs, out_dtype=out_dtype, low_rank=lr)
        else:
            out = grouped_mm_gluon(a.q, a.s, weight, scale, offs, trans, out_dtype=out_dtype, low_rank=lr)
        return out if fused else add_low_rank(out, low_rank, offs)
    from .triton import grouped_mm_triton  # lazy: Triton optional

    return add_low_rank(grouped_mm_triton(a.q, a.s, weight, scale, offs, trans, out_dtype=out_dtype), low_rank, offs)


def transposed_weight(weight: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """The K-major copy of a frozen FP8 weight, for ``dY @ W`` by a kernel that multiplies ``a @ B^T`` (Hopper's FP8
    MMA, cuBLAS's and the Gluon kernel's, takes K-major operands only).

    Args:
        weight: ``[N, K]`` or ``[E, N, K]`` ``float8_e4m3fn``. scale: its block scales ``[..., ceil(N/128),
            ceil(K/128)]`` fp32.

    Returns:
        ``(W^T [..., K, N], scale^T [..., ceil(K/128), ceil(N/128)])``, new and contiguous: the pair dequantizes to
        the transpose of ``dequantize(weight, scale)`` bit for bit. On CUDA one Triton pass over the codes
        (:func:`.triton.transpose_codes_triton`), elsewhere torch's copy.
    """
    check_weight(weight, scale)
    codes = weight if weight.dim() == 3 else weight.reshape(-1, *weight.shape[-2:])
    if codes.is_cuda:
        from .triton import transpose_codes_triton  # lazy: Triton optional

        wt = transpose_codes_triton(codes)
    else:
        wt = codes.view(torch.uint8).transpose(1, 2).contiguous().view(FP8_DTYPE)
    return wt.view(*weight.shape[:-2], weight.shape[-1], weight.shape[-2]), scale.transpose(-1, -2).contiguous()


def input_grad_copies(rows: int, experts: int) -> bool:
    """Whether the Gluon input gradient of ``rows`` expert-sorted rows over ``experts`` experts multiplies a K-major
    copy of the weights made for the call (at least :data:`COPY_ROWS_PER_EXPERT` rows an expert on average: the
    copy's read and write then cost less than the in-kernel transposition) rather than transposing each tile."""
    return rows >= COPY_ROWS_PER_EXPERT * max(experts, 1)


def _padded(lr: LowRank, rank: int) -> LowRank:
    """``lr`` with ``v`` and ``w`` padded by zero columns to ``rank`` (the same term)."""
    pad = rank - lr.v.shape[1]
    if pad == 0:
        return lr
    return LowRank(torch.nn.functional.pad(lr.v, (0, pad)), torch.nn.functional.pad(lr.w, (0, pad)), lr.scale)


def add_low_rank(out: Tensor, lr: LowRank | None, offs: Tensor) -> Tensor:
    """``out [M, n_out]`` plus the low-rank term ``lr``, in place (``out`` is a GEMM's own fresh output), rows past
    ``offs[-1]`` left as they are: on CUDA one Triton pass over ``out`` (:func:`.triton.low_rank_add_triton`: read,
    fp32 sum, one rounding), elsewhere a loop of matmuls (:func:`.naive.low_rank_ref`)."""
    if lr is None:
        return out
    if out.is_cuda and out.dtype in (torch.float32, *KERNEL_DTYPES) and out.stride(-1) == 1:
        from .triton import low_rank_add_triton  # lazy: Triton optional

        return low_rank_add_triton(out, lr.v, lr.w, lr.scale, offs)
    return out.add_(low_rank_ref(lr.v, lr.w, offs), alpha=lr.scale)


def _check_low_rank(lr: LowRank | None, m: int, weight: Tensor, trans: bool, dtype: torch.dtype | None) -> None:
    """A ``ValueError`` naming ``low_rank`` unless ``v [m, R]`` and ``w [E, n_out, R]`` fit the output, in its
    dtype."""
    if lr is None:
        return
    e, n, k = weight.shape
    n_out = k if trans else n
    v, w = lr.v, lr.w
    if v.dim() != 2 or w.dim() != 3 or v.shape[0] != m or tuple(w.shape[:2]) != (e, n_out) \
            or v.shape[1] != w.shape[2] or v.dtype != w.dtype or (dtype is not None and v.dtype != dtype):
        raise ValueError(f"low_rank must be (v [{m}, R], w [{e}, {n_out}, R], scale) in the output's dtype {dtype}, "
                         f"got v {v.dtype} {tuple(v.shape)}, w {w.dtype} {tuple(w.shape)}")


def _check_rows(a: Fp8Rows, weight: Tensor, scale: Tensor, offs: Tensor, trans: bool, compute: str,
                out_dtype: torch.dtype | None) -> None:
    """A ``ValueError`` unless the pre-quantized rows ``a`` fit the GEMM and reach a kernel that takes them."""
    _check_grouped(a.q, weight, scale, offs, trans)
    a.check("Fp8Rows")
    if out_dtype is None:
        raise ValueError("fp8_grouped_mm on Fp8Rows needs out_dtype (the dtype the rows were quantized from)")
    if not takes_fp8_rows(out_dtype, a.q.device, weight, compute, trans):
        raise ValueError(f"pre-quantized rows (Fp8Rows) reach no FP8 kernel here (device {a.q.device}, out_dtype "
                         f"{out_dtype}, compute {compute!r}, trans={trans}, weight {tuple(weight.shape)}): where "
                         "takes_fp8_rows(...) is False pass the unquantized rows")


@functools.cache
def _gluon_available() -> bool:
    """Whether this Triton builds the Gluon kernel: measured on 3.6, compiled on 3.9 (a CPU test builds it for
    sm_90); Gluon is experimental API that changes between releases."""
    if triton_version() < (3, 6):
        return False
    try:
        from .gluon import fp8_grouped_gluon_kernel  # noqa: F401
    except (ImportError, AttributeError):
        return False
    return True


def gluon_fits(a: Tensor, weight: Tensor) -> bool:
    """Whether the FP8 grouped GEMM runs the Gluon kernel (``gluon.py``) for activations ``a`` and the weight
    ``[E, N, K]``: sm_90 (Hopper's warpgroup MMA and TMA), not under the interpreter, ``N`` and ``K`` multiples
    of 128 (each 128-wide output tile and contraction step one block of scales). Elsewhere the Triton kernel runs."""
    return _gluon_on(a.device, weight)


def _gluon_on(device: torch.device, weight: Tensor) -> bool:
    if device.type != "cuda" or interpreting() or weight.shape[-1] % 128 or weight.shape[-2] % 128:
        return False
    return torch.cuda.get_device_capability(device) == (9, 0) and _gluon_available()
