"""README.md's Layout block against the tree: every folder and file it names is where it says, and it names every
top-level folder, every package under csattn/ and every module directly in csattn/.

The block's lines: ``name  description`` at indent 0 (a top-level folder or file) or 2 (inside the last top-level
folder); a longer name stands alone and its description follows on lines indented further. ``ops/<op>/`` stands
for the ops its description lists before the colon. A path in a description (``plan.py``, ``providers/``) is
relative to its entry's folder, or else to the repository's root (``BENCHMARKS.md``). The check is a function of
a README path and a root, so an edited copy can be checked by hand:

    python -c "from pathlib import Path; from tests.test_readme_layout import layout_errors as f; \\
               print(*f(Path('/tmp/README.md'), Path('.')), sep='\\n')"
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PLACEHOLDER = "<op>"
# a path in a description: a file with one of these endings, or a folder (a trailing slash)
DESCRIBED_PATH = re.compile(r"(?<![\w/.<-])([\w.-]+(?:/[\w.-]+)*(?:\.(?:py|md|json|png)|/))(?![\w/])")


@dataclass
class Entry:
    """One name of the Layout block: its path from the root (``csattn/ops/<op>/``) and its description."""

    path: str
    line: int
    description: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return " ".join(self.description)


def layout_entries(text: str) -> list[Entry]:
    """The Layout block's entries, in order (a ``ValueError`` if the README has no such block)."""
    m = re.search(r"^## Layout\n\n```\n(.*?)^```$", text, flags=re.S | re.M)
    if m is None:
        raise ValueError("README.md has no '## Layout' section opening with a ``` block")
    first = text.count("\n", 0, m.start(1)) + 1
    entries: list[Entry] = []
    top = ""
    for i, line in enumerate(m[1].splitlines()):
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip():
            continue
        if indent > 2:  # a description continued
            entries[-1].description.append(line.strip())
            continue
        names, _, desc = line.strip().partition("  ")
        for name in (n.strip() for n in names.split(",")):
            path = name if indent == 0 else top + name
            entries.append(Entry(path, first + i, [desc.strip()] if desc.strip() else []))
        if indent == 0:
            top = names.strip() if names.strip().endswith("/") else ""
    return entries


def _folders(entry: Entry, root: Path) -> list[Path]:
    """The folder(s) an entry stands for (its parent's for a file): the listed ops for ``ops/<op>/``."""
    if PLACEHOLDER not in entry.path:
        path = root / entry.path
        return [path if entry.path.endswith("/") or path.is_dir() else path.parent]
    ops = entry.text.partition(":")[0]
    return [root / entry.path.replace(PLACEHOLDER, op.strip()) for op in ops.split(",") if op.strip()]


def _named_errors(entries: list[Entry], root: Path, readme: Path) -> list[str]:
    """Every entry and every path in its description exists where it says."""
    errors = []
    for e in entries:
        where = f"{readme}:{e.line}"
        folders = _folders(e, root)
        if PLACEHOLDER not in e.path and not (root / e.path).exists():
            errors.append(f"{where}: {e.path} does not exist")
        for folder in folders if PLACEHOLDER in e.path else []:
            if not (folder / "__init__.py").is_file():
                errors.append(f"{where}: {e.path} lists {folder.name}, but {folder.relative_to(root)} is no package")
        for ref in DESCRIBED_PATH.findall(e.text):
            for folder in folders:
                if not ((folder / ref).exists() or (root / ref).exists()):
                    errors.append(f"{where}: {ref} (in {e.path}'s description) is neither in "
                                  f"{folder.relative_to(root)}/ nor at the root")
    return errors


def _tracked_top_folders(root: Path) -> set[str]:
    """The top-level folders holding files that git tracks (not the hidden ones)."""
    out = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout
    return {p.split("/")[0] + "/" for p in out.splitlines() if "/" in p and not p.startswith(".")}


def _complete_errors(entries: list[Entry], root: Path, readme: Path) -> list[str]:
    """Every top-level folder, package under csattn/ and module directly in csattn/ is named."""
    named: set[str] = set()
    for e in entries:
        paths = [str(f.relative_to(root)) + "/" for f in _folders(e, root)] if PLACEHOLDER in e.path else [e.path]
        for p in paths:
            parts = p.rstrip("/").split("/")
            named |= {"/".join(parts[:i]) + "/" for i in range(1, len(parts))}  # its folders
            named.add(p if p.endswith("/") or not (root / p).is_dir() else p + "/")
    missing = sorted(_tracked_top_folders(root) - named)
    pkg = root / "csattn"
    missing += sorted(f"{p.parent.relative_to(root).as_posix()}/" for p in pkg.rglob("__init__.py")
                      if f"{p.parent.relative_to(root).as_posix()}/" not in named)
    missing += sorted(f"csattn/{p.name}" for p in pkg.glob("*.py")
                      if p.name not in ("__init__.py", "__main__.py") and f"csattn/{p.name}" not in named)
    return [f"{readme}: the Layout block does not name {m}" for m in missing]


def layout_errors(readme: Path, root: Path = ROOT) -> list[str]:
    """One line per way ``readme``'s Layout block and the tree at ``root`` disagree."""
    entries = layout_entries(Path(readme).read_text())
    return _named_errors(entries, Path(root), readme) + _complete_errors(entries, Path(root), readme)


def test_readme_layout_matches_the_tree():
    try:
        errors = layout_errors(README, ROOT)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e})")
    assert not errors, "\n".join(errors)


def test_layout_check_fails_on_a_misplaced_or_missing_name(tmp_path):
    """Not vacuous: a file named in the wrong folder, a folder that is not there and an unnamed package are each
    reported."""
    text = README.read_text()
    block = re.search(r"^## Layout\n\n```\n.*?^```$", text, flags=re.S | re.M)[0]
    edited = block.replace("  nosync.py          NoHostSync: fails on any op that would read device data on the host\n",
                           "")
    edited = edited.replace("(CUDA graphs, capture.py)", "(CUDA graphs, capture.py, nosync.py)")
    edited = edited.replace("  cp/     ", "  cpp/    ")
    assert edited.count("\n") == block.count("\n") - 1
    copy = tmp_path / "README.md"
    copy.write_text(text.replace(block, edited))
    errors = layout_errors(copy, ROOT)
    assert any("nosync.py (in csattn/capture_safe/'s description)" in e for e in errors), errors
    assert any("csattn/cpp/ does not exist" in e for e in errors), errors
    assert any("does not name csattn/cp/" in e for e in errors), errors
    assert any("does not name csattn/nosync.py" in e for e in errors), errors
