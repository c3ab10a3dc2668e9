"""What the results page cites: each JSON file, the command that writes it and the measurement stage it belongs to.

The page prints these commands beside its tables and ``--measure`` runs them, so the two cannot disagree. Each
timeout is the most that command may take on one H200 (a command cut short keeps the records it wrote: the runner
and the report rewrite their JSON after every case); the stage times in the comments were measured there.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

__all__ = ["Source", "STAGES", "SHARDED", "REPORT_PARTS", "LISTED_ONCE_MEASURED", "source", "listed_stages"]


@dataclass(frozen=True)
class Source:
    """One JSON file of the page and the command that measures it.

    Args:
        file: its name in the JSON folder.
        module: ``python -m <module>`` writes it (``benchmarks.run``, ``benchmarks.model_long_step`` or
            ``csattn`` for the scaling report).
        args: the command's arguments, without the output, commit and timeout ones (added by :meth:`argv`).
        timeout_s: the most the command may take.
        env: environment variables the command needs.
    """

    file: str
    module: str
    args: tuple[str, ...]
    timeout_s: int
    env: tuple[tuple[str, str], ...] = ()

    @property
    def is_report(self) -> bool:
        return self.module == "csattn"

    def argv(self, out: str, commit: str) -> list[str]:
        """The arguments after ``python -m module``, writing to ``out`` (the report: a folder)."""
        if self.is_report:
            return [*self.args, "--group-timeout", str(self.timeout_s), "--out", out]
        return self._before_rest(["--commit", commit, "--json", out])

    def _before_rest(self, extra: list[str]) -> list[str]:
        """``args`` with ``extra`` put before a ``--`` (after which a command takes another's options), if any."""
        cut = self.args.index("--") if "--" in self.args else len(self.args)
        return [*self.args[:cut], *extra, *self.args[cut:]]

    def command(self) -> str:
        """The command as a reader would type it (the report writes ``DIR/report.json``, saved as ``file``)."""
        env = " ".join(f"{k}={v}" for k, v in self.env)
        args = [*self.args, "--out", "DIR"] if self.is_report else self._before_rest(["--json", self.file])
        return " ".join(filter(None, [env, "python -m", self.module, shlex.join(args)]))


_RUN = "benchmarks.run"
_TIMED = ("--warmup-ms", "5", "--rep-ms", "30")

STAGES: dict[str, tuple[Source, ...]] = {
    # the 4-layer V4-Flash proxy: 16k and 64k by do_bench medians, 128k one timed step after one warm-up, 512k
    # (block recompute, block inputs in host memory) the second of two steps; about 3.5 min with the model builds,
    # then the planner's two inputs
    "model": (
        Source("model.json", _RUN, ("--op", "model", "--mode", "fwdbwd", "--providers", "csattn",
                                    "--shape", "tokens=16384,65536", *_TIMED), 150),
        Source("model_128k.json", _RUN, ("--op", "model", "--mode", "fwdbwd", "--providers", "csattn",
                                         "--shape", "tokens=131072", "--single"), 100),
        Source("model_512k.json", "benchmarks.model_long_step",
               ("--tokens", "524288", "--recompute", "full+offload", "--steps", "2"), 200,
               (("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),)),
        # the planner's inputs (benchmarks/results/planner.py): each recompute's step at 16k, and what the
        # forward keeps for the backward per component; estimated 1.5 min with the model builds
        Source("model_recompute.json", _RUN, ("--op", "model", "--mode", "fwdbwd", "--providers", "csattn",
                                              "--shape", "tokens=16384", "--shape", "recompute=none,mhc,moe,block,full",
                                              *_TIMED), 120),
        Source("model_kept.json", "benchmarks.live_tensors", ("--model", "--tokens", "16384"), 90),
    ),
    # one CSA layer step, eager against CUDA-graph replay; about 30 s
    "graphs": (
        Source("layer_step.json", _RUN, ("--op", "layer_step", "--mode", "fwd", "--providers",
                                         "eager,capture_safe,graph", "--shape", "tokens=4096,32768",
                                         "--shape", "layer=csa", "--warmup-ms", "5", "--rep-ms", "40"), 90),
    ),
    # CP = 4 as four gloo ranks sharing the GPU, both partitions, and each rank timed alone at 128k; about 2.5 min
    "report-cp4": (
        Source("report_cp4.json", "csattn", ("report", "--tokens", "8192", "32768", "131072", "--cp", "4",
                                             "--paths", "triton", "--balance-tokens", "131072", "--steps", "2",
                                             "--model-tokens"), 285),
    ),
    # csattn's kernels beside cuDNN Frontend's (the `cudnn` provider needs nvidia-cudnn-frontend); about 1 min
    "kernels": (
        Source("sparse_attn_bwd.json", _RUN, ("--op", "sparse_attn", "--mode", "bwd", "--providers", "triton,cudnn",
                                              "--shape", "tokens=8192,32768", "--warmup-ms", "10", "--rep-ms", "100"),
               90),
        Source("indexer_topk.json", _RUN, ("--op", "indexer_topk", "--mode", "fwd", "--providers", "triton,cudnn",
                                           "--shape", "tokens=8192,32768", "--warmup-ms", "10", "--rep-ms", "100"),
               60),
        Source("sparse_attn_fwd.json", _RUN, ("--op", "sparse_attn", "--mode", "fwd", "--providers", "triton",
                                              "--shape", "tokens=8192,32768", "--warmup-ms", "10", "--rep-ms", "100"),
               60),
    ),
    # the model against HF eager (transformers >= 5.23), HF patched onto csattn beside both; about 1.5 min
    "hf": (
        Source("model_hf.json", _RUN, ("--op", "model", "--mode", "fwdbwd", "--providers", "csattn,hf_patched,hf",
                                       "--shape", "docs=one", "--shape", "tokens=6144", "--warmup-ms", "1",
                                       "--rep-ms", "10"), 150),
    ),
    # CP = 1: the fused layer against the unfused PyTorch path (up to 32k) and HF eager (up to 8k); about 2 min
    "report-cp1": (
        Source("report_cp1.json", "csattn", ("report", "--tokens", "8192", "32768", "131072", "--cp", "1",
                                             "--paths", "triton", "unfused", "hf", "--reference-max-tokens", "32768",
                                             "--hf-max-tokens", "8192", "--steps", "2", "--model-tokens"), 285),
    ),
    # deterministic mode's cost: the key-gradient kernels with fixed-point sums beside the default ones (one process
    # each), and the proxy step under csattn.deterministic_mode with every layer deterministic beside its default
    # step; about 3 min
    "deterministic": (
        Source("deterministic_kernels.json", _RUN, ("--op", "sparse_attn", "--mode", "bwd", "--providers",
                                                    "triton,triton[deterministic=1],"
                                                    "triton[deterministic=1,bwd_gluon=0]", "--shape",
                                                    "tokens=8192,32768", "--warmup-ms", "10", "--rep-ms", "100"), 90),
        Source("deterministic_indexer_loss.json", _RUN, ("--op", "indexer_loss", "--mode", "bwd", "--providers",
                                                         "triton,triton[deterministic=1]", "--warmup-ms", "10",
                                                         "--rep-ms", "50"), 60),
        Source("model_deterministic.json", _RUN, ("--op", "model", "--mode", "fwdbwd", "--providers",
                                                  "csattn[deterministic]", "--shape", "tokens=16384", "--deterministic",
                                                  *_TIMED), 120),
        # the default step again in this stage's run, so that the two sit side by side
        Source("model_deterministic_base.json", _RUN, ("--op", "model", "--mode", "fwdbwd", "--providers", "csattn",
                                                       "--shape", "tokens=16384", *_TIMED), 90),
    ),
    # deterministic mode end to end: csattn train --deterministic on the proxy at 8k, one run killed twice and
    # resumed beside two uninterrupted runs, all three on the one GPU; about 5.5 min
    "soak": (
        Source("soak_deterministic.json", "benchmarks.soak", (
            "--seconds", "555", "--kills", "2", "--save-every", "40", "--", "--deterministic", "--config-json",
            "benchmarks/configs/v4_flash_proxy.json", "--device", "cuda", "--dtype", "bfloat16", "--seq-len", "8192",
            "--steps", "240", "--lr", "3e-4", "--min-lr", "3e-5", "--warmup-steps", "20", "--doc-min-len", "256",
            "--doc-max-len", "4096", "--log-every", "20"), 590),
    ),
    # csattn train on the proxy at world size 1 (16k, 128k) and on 2 and 4 gloo ranks sharing the GPU, beside
    # the planner's per-rank peak; about 5 min
    "sharded": (
        Source("sharded.json", "benchmarks.sharded", (), 360),
    ),

    # fine-tuning a real-geometry V4-Flash slice from a release-format checkpoint (written first into --ckpt,
    # reused when there): modes (a)-(d) at 16k and 64k beside the planner, the frozen-expert MoE, the FP8 /
    # weight-only logits, two gloo ranks with ep 2; estimated 7-9 min (lab/finetune_session.sh runs its parts)
    "finetune": (
        Source("finetune.json", "benchmarks.finetune", ("--ckpt", "/tmp/csattn_v4_flash_slice"), 590),
    ),
}
# stages the page's commands name only once their JSON is in the folder (added after the page was last measured)
LISTED_ONCE_MEASURED = {"finetune": "finetune.json"}

SHARDED = "sharded.json"
# the report's parts, merged in this order into one report (a later part's cases replace an earlier one's)
REPORT_PARTS = ("report_cp4.json", "report_cp1.json")


def source(file: str) -> Source:
    """The :class:`Source` that writes ``file``."""
    for runs in STAGES.values():
        for s in runs:
            if s.file == file:
                return s
    raise KeyError(f"no stage writes {file!r}")


def listed_stages(files: dict) -> list[str]:
    """The stages the page's commands name: those with a command, less the ones whose JSON is not yet in
    ``files`` (:data:`LISTED_ONCE_MEASURED`)."""
    return [s for s in STAGES if STAGES[s] and (s not in LISTED_ONCE_MEASURED or LISTED_ONCE_MEASURED[s] in files)]
