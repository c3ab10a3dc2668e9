"""Triton indexer top-k against ``indexer_topk_ref``: the same ids in the same order (ties to the lower id,
-1 padding, per-document causal limits), on the CPU interpreter and, at the real geometry, on a GPU."""

import pytest
import torch

from csattn.ops.indexer import indexer_scores_ref, indexer_topk, indexer_topk_ref
from csattn.packing import PackedSeqs
from tests.helpers import poison_kernel_outputs


@pytest.fixture(autouse=True)
def _poisoned_kernel_outputs(monkeypatch):
    """Every kernel output starts as NaN, so an element the kernel does not write fails."""
    import csattn.ops.indexer.triton

    poison_kernel_outputs(monkeypatch, csattn.ops.indexer.triton)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

try:
    import triton
    import triton.language as tl

    from csattn.ops.indexer.triton import _bisect_regs
except ImportError:  # pragma: no cover - the kernel tests need Triton
    triton = None

if triton is not None:
    @triton.jit
    def _bisection(keys, n, out, scratch, RB: tl.constexpr, CAND: tl.constexpr, GATHER: tl.constexpr):
        """Program ``p`` runs the threshold search for ``kk = p + 1`` on one int32 row (it gathers its ids to the
        first ``RB`` slots of the program's scratch row, its bracket's keys after them)."""
        kk = tl.program_id(0) + 1
        rel = tl.arange(0, RB)
        key = tl.load(keys + rel, mask=rel < n, other=-(2**31))
        ids = scratch + tl.program_id(0) * (RB + CAND)
        t1, a1, gathered = _bisect_regs(key, kk, n, keys, ids, ids + RB, CAND, 16, GATHER)
        base = out + tl.program_id(0) * 5
        tl.store(base, t1)
        tl.store(base + 1, a1)
        tl.store(base + 4, gathered)


def _pack(lengths, padded):
    packed = PackedSeqs.from_lengths(lengths, padded_lengths=padded)
    return packed, packed.compress(4, device=torch.device(DEVICE))


def _int_inputs(T, Nc, HI, CI, gen):
    # Small integers: every score is exact in fp32 whatever the summation order, and many scores tie
    # (zero ReLU terms, repeated keys), which exercises the lower-id rule.
    q = torch.randint(-2, 3, (T, HI, CI), generator=gen).float()
    w = torch.randint(-2, 3, (T, HI), generator=gen).float()
    k = torch.randint(-1, 2, (Nc, CI), generator=gen).float()
    return q.to(DEVICE), w.to(DEVICE), k.to(DEVICE)


@pytest.mark.parametrize(
    "lengths,padded,topk,workspace",
    [
        pytest.param([37, 58, 5, 23], [40, 60, 8, 24], 6, 1 << 30, id="ragged_padded_ties"),
        pytest.param([64, 3], [64, 3], 32, 1 << 30, id="topk_gt_visible"),
        pytest.param([50, 29], [52, 29], 5, 1, id="tiny_workspace_chunks"),
    ],
)
@pytest.mark.parametrize("search", ["row_in_registers", pytest.param("row_streamed", marks=pytest.mark.slow), "cand_2"])
@pytest.mark.parametrize("seg", [1024, 16], ids=["one_tile", "16_key_tiles"])
def test_topk_equals_reference_exact(lengths, padded, topk, workspace, search, seg):
    from csattn.ops.indexer import IndexerConfig

    # Rows longer than register_row keys take the tiled selection path (streamed: forced on these small rows);
    # the in-register search parks its last 2 * topk (or 2) keys; rows compacted in one tile, or in several (the
    # ranks carried from tile to tile).
    extra = {"row_streamed": {"register_row": 8}, "cand_2": {"cand": 2}}.get(search, {})
    config = IndexerConfig(seg=seg, **extra)
    gen = torch.Generator().manual_seed(sum(lengths) + topk)
    packed, meta = _pack(lengths, padded)
    q, w, k = _int_inputs(packed.num_rows, meta.num_entries, 3, 16, gen)
    expected = indexer_topk_ref(q, w, k, meta.vis_start, meta.vis_end, topk)
    got = indexer_topk(q, w, k, meta.vis_start, meta.vis_end, topk, workspace_bytes=workspace, backend="triton",
                       config=config)
    assert got.dtype == torch.int64 and got.shape == expected.shape
    assert torch.equal(got, expected)


@pytest.mark.parametrize("gather", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["gather", "no_gather"])
@pytest.mark.parametrize("cand", [2, 8, 64], ids=["cand2", "cand8", "cand64"])
@pytest.mark.parametrize("case", ["random", "extremes", "ties", "clustered"])
def test_bisection_threshold_exact(case, cand, gather):
    """The bisection returns the exact ``(threshold, count above)`` on int32 rows across the whole range (negative
    keys, INT32_MIN / INT32_MAX, long runs of equal keys, keys one apart, padding), for every kk; it hands over to
    its parked-candidate phase at brackets of 2, 8 or 64 keys (64: the whole row from the start). Without
    ``GATHER`` (lists of more than 2^14 ids) it gathers no ids, the same threshold."""
    search = _bisection
    gen = torch.Generator().manual_seed(3)
    n = 45
    if case == "random":
        keys = torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen, dtype=torch.int64)
    elif case == "extremes":
        keys = torch.tensor([-(2**31), 2**31 - 1, 0, -1, 1, -(2**31) + 1, 2**31 - 2] * 6 + [5, 5, 5],
                            dtype=torch.int64)
    elif case == "ties":
        keys = torch.randint(-3, 3, (n,), generator=gen, dtype=torch.int64) * (2**21 + 7)
    else:
        keys = torch.randint(-6, 6, (n,), generator=gen, dtype=torch.int64) + 1000
    keys = keys.to(torch.int32).to(DEVICE)
    out = torch.full((n, 5), 7, dtype=torch.int32, device=DEVICE)
    scratch = torch.full((n, 64 + cand), 7, dtype=torch.int32, device=DEVICE)
    search[(n,)](keys, n, out, scratch, RB=64, CAND=cand, GATHER=gather)
    out, scratch, keys = out.cpu(), scratch.cpu(), keys.cpu()
    ordered = torch.sort(keys, descending=True).values
    assert torch.equal(out[:, 0], ordered[:n])  # the kk-th largest
    assert torch.equal(out[:, 1], (keys[None, :] > out[:, :1]).sum(1).to(torch.int32)), out  # the count above
    # Gathered ids: those of every key at or above some bound no greater than the threshold, ascending, fewer
    # than kk + cand (0: the whole-row counts found the threshold themselves).
    if not gather:
        assert (out[:, 4] == 0).all() and (scratch[:, :64] == 7).all()
    for p in range(n):
        thr, gathered = int(out[p, 0]), int(out[p, 4])
        if gathered == 0:
            continue
        got = scratch[p, :gathered]
        bound = keys[got].min()
        assert bound <= thr and gathered < p + 1 + cand
        assert torch.equal(got, torch.nonzero(keys >= bound).flatten().to(torch.int32)), (p, got)


@pytest.mark.parametrize("topk,cand", [pytest.param(16, 8, marks=pytest.mark.slow),
                                       pytest.param(16, 2, marks=pytest.mark.slow), (33, 16)],
                         ids=["k16_cand8", "k16_cand2", "k33_cand16"])
def test_topk_gathered_list_equals_reference(topk, cand):
    """Rows of up to 60 keys with few ties (integer scores over a wide range): most rows stop their whole-row
    counts with a bracket of several keys, gather the ids at or above it and write the list from those; the bound
    on the gathered ids (fewer than k + cand, in 2 k int32 slots) is tight at cand = (k + 1) / 2."""
    from csattn.ops.indexer import IndexerConfig

    gen = torch.Generator().manual_seed(topk + cand)
    packed, meta = _pack([240], [240])
    q = torch.randint(-8, 9, (packed.num_rows, 2, 16), generator=gen).float().to(DEVICE)
    w = torch.randint(1, 9, (packed.num_rows, 2), generator=gen).float().to(DEVICE)
    k = torch.randint(-8, 9, (meta.num_entries, 16), generator=gen).float().to(DEVICE)
    expected = indexer_topk_ref(q, w, k, meta.vis_start, meta.vis_end, topk)
    got = indexer_topk(q, w, k, meta.vis_start, meta.vis_end, topk, backend="triton",
                       config=IndexerConfig(cand=cand, seg=64))
    assert torch.equal(got, expected)


def test_topk_ids_ascending_for_any_k():
    """Every row is the reference's list: its ids ascending, then -1 (every slot written: the output buffer
    starts poisoned), for k from 1 to wider than any row."""
    gen = torch.Generator().manual_seed(5)
    packed, meta = _pack([37, 58, 5, 23], [40, 60, 8, 24])
    q, w, k = _int_inputs(packed.num_rows, meta.num_entries, 3, 16, gen)
    for topk in (1, 6, 32):
        expected = indexer_topk_ref(q, w, k, meta.vis_start, meta.vis_end, topk)
        got = indexer_topk(q, w, k, meta.vis_start, meta.vis_end, topk, backend="triton")
        assert torch.equal(got, expected), topk
        ids = torch.where(got < 0, torch.iinfo(torch.int64).max, got)
        assert (ids[:, 1:] > ids[:, :-1]).logical_or(ids[:, 1:] == torch.iinfo(torch.int64).max).all()
        assert torch.equal((got >= 0).sum(1), (meta.vis_end - meta.vis_start).clamp(0, topk))


def test_topk_chunk_plan_kept_per_pack_and_redone_on_change():
    """The row-chunk plan (host reads) is made once for a pair of range tensors and reused by later calls; an
    in-place edit of the ranges or another ``vis_start`` makes a new one, and the ids follow the new ranges."""
    from csattn.ops.indexer import triton as kernels

    gen = torch.Generator().manual_seed(3)
    packed, meta = _pack([37, 58, 23], [40, 60, 24])
    q, w, k = _int_inputs(packed.num_rows, meta.num_entries, 3, 16, gen)
    vis_start, vis_end = meta.vis_start.clone(), meta.vis_end.clone()
    plan = kernels._chunks(vis_start, vis_end, 1 << 20)
    assert kernels._chunks(vis_start, vis_end, 1 << 20) is plan
    assert kernels._chunks(vis_start.clone(), vis_end, 1 << 20) is not plan
    assert kernels._chunks(vis_start, vis_end, 1 << 10) is not plan
    first = indexer_topk(q, w, k, vis_start, vis_end, 6, backend="triton")
    assert torch.equal(first, indexer_topk_ref(q, w, k, vis_start, vis_end, 6))
    vis_end.copy_(torch.minimum(vis_end, vis_start + 3))  # every row now sees at most 3 entries
    got = indexer_topk(q, w, k, vis_start, vis_end, 6, backend="triton")
    assert torch.equal(got, indexer_topk_ref(q, w, k, vis_start, vis_end, 6))
    assert not torch.equal(got, first)


def _assert_same_sets(got, expected, scores, vis_start, tol):
    """Row by row, the two id sets may differ only in entries whose scores are within ``tol`` of the row's
    k-th best (rounding of a different accumulation order); the -1 padding must agree exactly."""
    assert torch.equal(got < 0, expected < 0)
    mismatched = 0
    for t in range(got.shape[0]):
        a = set(got[t][got[t] >= 0].tolist())
        b = set(expected[t][expected[t] >= 0].tolist())
        assert len(a) == len(b) == len(got[t][got[t] >= 0])  # no duplicates
        if a == b:
            continue
        mismatched += 1
        row = scores[t]
        kth = min(float(row[i - int(vis_start[t])]) for i in b)
        for i in a ^ b:
            assert abs(float(row[i - int(vis_start[t])]) - kth) <= tol * max(1.0, abs(kth)), (t, i)
    return mismatched


def test_topk_random_floats_same_sets():
    gen = torch.Generator().manual_seed(1)
    packed, meta = _pack([60, 21], [60, 24])
    T, Nc = packed.num_rows, meta.num_entries
    q = torch.randn(T, 2, 16, generator=gen).to(DEVICE)
    w = torch.randn(T, 2, generator=gen).to(DEVICE)
    k = torch.randn(Nc, 16, generator=gen).to(DEVICE)
    expected = indexer_topk_ref(q, w, k, meta.vis_start, meta.vis_end, 7)
    got = indexer_topk(q, w, k, meta.vis_start, meta.vis_end, 7, backend="triton")
    vis_start = meta.vis_start.cpu()
    scores = [indexer_scores_ref(q[t:t + 1].double(), w[t:t + 1].double(),
                                 k[int(meta.vis_start[t]):int(meta.vis_end[t])].double())[0] for t in range(T)]
    _assert_same_sets(got.cpu(), expected.cpu(), scores, vis_start, 1e-5)
    # Distinct random scores: the lists match exactly as well.
    assert torch.equal(got, expected)


def test_topk_bad_input():
    q = torch.zeros(4, 2, 16)
    with pytest.raises(ValueError, match="topk"):
        indexer_topk(q, torch.zeros(4, 2), torch.zeros(1, 16), torch.zeros(4, dtype=torch.long),
                     torch.ones(4, dtype=torch.long), 0, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        indexer_topk(q, torch.zeros(4, 2), torch.zeros(1, 16), torch.zeros(4, dtype=torch.long),
                     torch.ones(4, dtype=torch.long), 2, backend="cuda")


@pytest.mark.gpu
def test_topk_gpu_bf16_real_geometry():
    """bf16 inputs, HI=64, cI=128, k=512, 32k ragged tokens: both sides accumulate in fp32, so the sets agree
    except between entries whose fp32 scores are within rounding of each other."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = [9000, 127, 5, 12000, 1000, 10636]
    packed = PackedSeqs.from_lengths(lengths, padded_lengths=[9000, 128, 8, 12000, 1000, 10640])
    meta = packed.compress(4, device=torch.device("cuda"))
    T, Nc = packed.num_rows, meta.num_entries
    q = torch.randn(T, 64, 128, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(T, 64, device="cuda", generator=gen) * 128**-0.5 * 64**-0.5).float()
    k = torch.randn(Nc, 128, device="cuda", generator=gen).bfloat16()
    expected = indexer_topk_ref(q, w, k, meta.vis_start, meta.vis_end, 512)
    got = indexer_topk(q, w, k, meta.vis_start, meta.vis_end, 512, backend="triton")
    assert torch.equal(got < 0, expected < 0)
    same = (torch.sort(got, dim=1).values == torch.sort(expected, dim=1).values).all(dim=1)
    rows = torch.nonzero(~same).flatten()
    assert rows.numel() <= T // 100, f"{rows.numel()} rows differ"
    # Check the differing rows: every swapped id scores within fp32 rounding of the row's k-th score.
    scores = []
    for t in rows[:64].tolist():
        lo, hi = int(meta.vis_start[t]), int(meta.vis_end[t])
        scores.append(indexer_scores_ref(q[t:t + 1].double(), w[t:t + 1].double(), k[lo:hi].double())[0].cpu())
    sub = rows[:64].cpu()
    _assert_same_sets(got.cpu()[sub], expected.cpu()[sub], scores, meta.vis_start.cpu()[sub], 1e-4)
    # The streamed selection (rows longer than register_row) picks exactly what the in-register one picks.
    from csattn.ops.indexer import IndexerConfig

    streamed = IndexerConfig(register_row=1024)
    assert torch.equal(indexer_topk(q, w, k, meta.vis_start, meta.vis_end, 512, backend="triton", config=streamed),
                       got)
    # So do the other search and sort settings the benchmark compares, in the same order.
    for spec in ("seg=1024", "seg=2048", "seg=2048,select_warps=8", "cand=2", "tma=1",
                 "bt=128,warps=8,stages=3"):
        config = IndexerConfig.parse(spec)
        assert torch.equal(indexer_topk(q, w, k, meta.vis_start, meta.vis_end, 512, backend="triton", config=config),
                           got), spec


@pytest.mark.gpu
def test_topk_gpu_rows_of_32k_keys_exact():
    """A 128k-token document: its last rows see 32768 entries, searched in registers on 8 warps (the widest row
    the in-register search takes); integer inputs make every score exact, so ids and order equal the
    reference's, and the streamed search picks the same."""
    from csattn.ops.indexer import IndexerConfig

    gen = torch.Generator().manual_seed(7)
    packed, meta = _pack([131072], [131072])
    q, w, k = _int_inputs(packed.num_rows, meta.num_entries, 2, 16, gen)
    expected = indexer_topk_ref(q, w, k, meta.vis_start, meta.vis_end, 512)
    got = indexer_topk(q, w, k, meta.vis_start, meta.vis_end, 512, backend="triton")
    assert torch.equal(got, expected)
    streamed = IndexerConfig(register_row=16384)
    assert torch.equal(indexer_topk(q, w, k, meta.vis_start, meta.vis_end, 512, backend="triton", config=streamed),
                       expected)
