"""Training steps under context parallelism (gloo CPU processes) equal the single-process steps: the loss
and every updated weight, at CP=2 and CP=4, and data parallel x CP."""

import pytest
import torch

from csattn.train.demo import run_spawned
from csattn.train.loop import TrainConfig, train

from .test_model_utils import one_thread  # noqa: F401

try:
    import csattn.cp  # noqa: F401

    HAVE_CP = True
except ImportError:  # pragma: no cover - depends on the checkout
    HAVE_CP = False

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.xfail(not HAVE_CP, reason="csattn.cp (context parallelism) is not available", run=False)]

BASE = dict(steps=2, seq_len=64, device="cpu", progress=False, warmup_steps=1, pad_multiple=4)


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _reference(**kw):
    result = train(TrainConfig(**BASE, **kw))
    return result.losses, result.model.state_dict()


@pytest.mark.parametrize("cp,partition,recompute", [(2, "contiguous", False), (4, "contiguous", False),
                                                    (2, "balanced", False), (2, "contiguous", True)],
                         ids=["cp2", "cp4", "cp2-balanced", "cp2-activation-checkpointing"])
def test_cp_step_equals_single_process_fp64(cp, partition, recompute):
    """fp64: every updated tensor agrees to 1e-9, so nothing but rounding differs. With activation
    checkpointing the CP ranks redo their collectives inside the backward; the single process does not."""
    # the balanced partition deals 4 chunks per rank: each must hold the 15-row window halo
    base = {**BASE, "seq_len": 128} if partition == "balanced" else BASE
    result = train(TrainConfig(**base, dtype="float64"))
    losses, state = result.losses, result.model.state_dict()
    got = run_spawned(cp, TrainConfig(cp=cp, dtype="float64", cp_partition=partition,
                                      activation_checkpointing=recompute, **base))
    for a, b in zip(got["losses"], losses):
        assert abs(a - b) <= 1e-12 * abs(b)
    for k, v in state.items():
        if v.is_floating_point():
            assert _rel(got["state"][k], v) <= 1e-9, k
        else:
            assert torch.equal(got["state"][k], v), k


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_step_equals_single_process_fp32(cp):
    """fp32, CP=2 and 4: the losses agree to 1e-5, and so do the updated weights outside the mHC taken as one
    vector (no single tensor worse than 1e-4).

    Adam's first steps turn any gradient into an update of about +-lr, so a tensor whose gradient is tiny
    (an expert that saw two tokens) or pure rounding noise (parts of the Sinkhorn-normalized mHC mixing,
    nearly insensitive to their logits) moves by amounts that depend on fp32 summation order. The mHC
    parameters (``attn_hc`` / ``ffn_hc`` / ``hc_head``) are therefore held to 1e-2 here; the fp64 test above
    holds every tensor, mHC included, to 1e-9.
    """
    losses, state = _reference()
    got = run_spawned(cp, TrainConfig(cp=cp, **BASE))
    for a, b in zip(got["losses"], losses):
        assert abs(a - b) <= 1e-5 * abs(b)
    main = []
    for k, v in state.items():
        if not v.is_floating_point():
            assert torch.equal(got["state"][k], v), k
            continue
        mhc = any(part in ("attn_hc", "ffn_hc", "hc_head") for part in k.split("."))
        assert _rel(got["state"][k], v) <= (1e-2 if mhc else 1e-4), k
        if not mhc:
            main.append(k)
    assert len(main) > 80
    ours = torch.cat([got["state"][k].reshape(-1) for k in main])
    ref = torch.cat([state[k].reshape(-1) for k in main])
    assert _rel(ours, ref) <= 1e-5


def test_data_parallel_times_cp():
    """4 ranks = 2 replicas x CP 2 equals 2 replicas x CP 1 (fp64, one step)."""
    one_step = {**BASE, "steps": 1}
    dp_only = run_spawned(2, TrainConfig(cp=1, dtype="float64", **one_step))
    dp_cp = run_spawned(4, TrainConfig(cp=2, dtype="float64", **one_step))
    assert abs(dp_cp["losses"][0] - dp_only["losses"][0]) <= 1e-12 * abs(dp_only["losses"][0])
    for k, v in dp_only["state"].items():
        if v.is_floating_point():
            assert _rel(dp_cp["state"][k], v) <= 1e-9, k


def test_model_demo_prints_side_by_side_curves(capsys):
    from csattn.cli import main

    assert main(["demo", "--model", "--model-steps", "2", "--model-seq-len", "32", "--model-cp", "1", "2"]) == 0
    text = capsys.readouterr().out
    assert "CP=1" in text and "CP=2" in text and "largest difference" in text
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 2 and all(abs(float(r[1]) - float(r[2])) < 1e-4 for r in rows)


def test_resume_single_process_checkpoint_under_cp(tmp_path):
    """A checkpoint written by one process resumes at CP=2 and continues exactly (fp64)."""
    out = str(tmp_path / "run")
    ref = train(TrainConfig(**{**BASE, "steps": 2}, dtype="float64", output=out, save_every=1))
    got = run_spawned(2, TrainConfig(**BASE, cp=2, dtype="float64", output=out,
                                     resume=f"{out}/checkpoint-000001"))
    assert len(got["losses"]) == 1 and abs(got["losses"][0] - ref.losses[1]) <= 1e-12 * abs(ref.losses[1])
    for k, v in ref.model.state_dict().items():
        if v.is_floating_point():
            assert _rel(got["state"][k], v) <= 1e-9, k
