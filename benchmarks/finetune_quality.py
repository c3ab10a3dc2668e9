"""Fine-tuning quality on real text: ``python -m benchmarks.finetune_quality --out DIR -- <csattn train options>``.

1. The corpus: English prose from the Python standard library's docstrings (modules, classes, functions), which
   ship with every Python: each ``*.py`` file under ``sysconfig``'s ``stdlib`` path (tests, ``idlelib``,
   ``site-packages`` left out), in sorted path order, one document per module (its docstrings in source order,
   ``inspect.cleandoc``-ed, those under ``--min-chars`` dropped). The same Python gives the same corpus: its
   file count, characters and sha256 go into the JSON.
2. A byte-level BPE tokenizer trained on it with the ``tokenizers`` package (``--vocab``, BOS / EOS / PAD
   specials), saved as a Hugging Face tokenizer directory (``PreTrainedTokenizerFast.save_pretrained``).
3. ``csattn train --data jsonl --data-path corpus.jsonl --tokenizer DIR`` with the options after ``--`` (LoRA,
   the checkpoint, steps...): csattn's packer and trainer, its per-step metrics.
4. The loss per step into ``quality.json`` and ``loss.png``; ``fell``: the mean of the last tenth of the steps
   below the mean of the first tenth.

    python -m benchmarks.finetune_quality --out /tmp/q -- --init-from /tmp/v4slice --device cuda \\
        --dtype bfloat16 --seq-len 4096 --steps 200 --lora-rank 16 --lora-targets attention,indexer,shared_experts
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

SKIP_DIRS = ("test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "turtledemo")
SPECIALS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>"}


def docstring_documents(root: str | None = None, min_chars: int = 200,
                        max_docs: int | None = None) -> tuple[list[str], dict[str, Any]]:
    """One document per standard-library module: its docstrings joined by blank lines, in sorted path order; and
    where they came from (root, files read, characters, sha256)."""
    root = root or sysconfig.get_paths()["stdlib"]
    docs: list[str] = []
    files = 0
    for path in sorted(Path(root).rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(part in SKIP_DIRS or part.startswith("test_") for part in rel):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a few files are templates or in other encodings: not prose
        files += 1
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef,
                                                                      ast.AsyncFunctionDef)))]
        parts = [inspect.cleandoc(d) for d in (ast.get_docstring(n, clean=False) for n in nodes) if d]
        text = "\n\n".join(p for p in parts if len(p) >= 40)
        if len(text) >= min_chars:
            docs.append(text)
        if max_docs is not None and len(docs) >= max_docs:
            break
    digest = hashlib.sha256("\x00".join(docs).encode()).hexdigest()
    return docs, {"source": "Python standard library docstrings", "root": root, "python": sys.version.split()[0],
                  "files_read": files, "documents": len(docs), "chars": sum(map(len, docs)), "sha256": digest}


def train_tokenizer(docs: list[str], vocab: int, out: str) -> int:
    """A byte-level BPE of ``vocab`` tokens (specials included) on ``docs``, saved as an HF tokenizer in ``out``;
    returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIALS.values()), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIALS)
    fast.save_pretrained(out)
    return len(fast)


def plot_loss(losses: list[float], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fell(losses: list[float]) -> dict[str, Any]:
    """Mean loss of the first and the last tenth of the steps (at least one each), and whether it fell."""
    n = max(1, len(losses) // 10)
    first, last = sum(losses[:n]) / n, sum(losses[-n:]) / n
    return {"first_mean": first, "last_mean": last, "fell": last < first}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder: corpus.jsonl, tokenizer/, metrics.jsonl, quality.json, "
                                                 "loss.png")
    ap.add_argument("--vocab", type=int, default=8192, help="the tokenizer's size (<= the model's vocabulary)")
    ap.add_argument("--min-chars", type=int, default=200, help="shortest module document kept")
    ap.add_argument("--max-docs", type=int, default=None, help="keep the first N documents (a quick run)")
    ap.add_argument("--timeout", type=int, default=540, help="seconds for the training run")
    ap.add_argument("--commit", default=os.environ.get("CSATTN_COMMIT"), help="recorded commit")
    args = ap.parse_args(argv[:cut])
    train_args = argv[cut + 1:]
    os.makedirs(args.out, exist_ok=True)
    docs, corpus = docstring_documents(min_chars=args.min_chars, max_docs=args.max_docs)
    data = os.path.join(args.out, "corpus.jsonl")
    with open(data, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    tok_dir = os.path.join(args.out, "tokenizer")
    vocab = train_tokenizer(docs, args.vocab, tok_dir)
    metrics = os.path.join(args.out, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)  # this run's steps only (a file of an earlier run is ours to replace)
    cmd = [sys.executable, "-m", "csattn", "train", "--data", "jsonl", "--data-path", data, "--text-field", "text",
           "--tokenizer", tok_dir, "--metrics", metrics, "--no-progress", *train_args]
    t0 = time.perf_counter()
    # written first as running: a run cut from outside still leaves the corpus, the command and metrics.jsonl's steps
    with open(os.path.join(args.out, "quality.json"), "w") as f:
        json.dump({"meta": {"commit": args.commit, "command": " ".join(cmd[1:])}, "corpus": corpus,
                   "tokenizer_vocab": vocab, "rc": None, "status": "running", "metrics": metrics}, f, indent=1)
    try:
        rc = subprocess.run(cmd, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    steps = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
    losses = [s["loss"] for s in steps]
    out = {"meta": {"commit": args.commit, "command": " ".join(cmd[1:]), "wall_s": round(time.perf_counter() - t0, 1)},
           "corpus": corpus, "tokenizer_vocab": vocab, "rc": rc, "steps": len(losses), "losses": losses,
           "lm_losses": [s.get("lm_loss") for s in steps],
           **(fell(losses) if losses else {"fell": False})}
    if steps and steps[-1].get("peak_gib") is not None:
        out["peak_gib"] = max(s.get("peak_gib") or 0 for s in steps)
    with open(os.path.join(args.out, "quality.json"), "w") as f:
        json.dump(out, f, indent=1)
    if losses:
        plot_loss(losses, os.path.join(args.out, "loss.png"), f"csattn train on stdlib docstrings, {len(losses)} "
                  f"steps: {out['first_mean']:.2f} -> {out['last_mean']:.2f}")
    print(json.dumps({k: out[k] for k in ("rc", "steps", "fell")} | {"corpus": corpus["documents"]}), flush=True)
    return 0 if rc == 0 and out["fell"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
