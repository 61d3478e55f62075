"""Every command the docs print still runs: its flags parse, its config validates.

The fenced `bash` blocks of README.md, docs/*.md and benchmarks/results/*/README.md are read
line by line (`\\` continuations joined, comments dropped). Each tfpar-train, tfpar-launch,
tfpar-check and `python benchmarks/NAME.py` command is parsed without running
(tests/scripts/parse_only.py); a config file a doc defines in a ```python block
(whose docstring starts with `configs/NAME.py:`) is written out first, so that example is checked too.
`pip install` lines must name extras setup.py has, and every ```python block must compile.
Commands for other tools (git, gcloud, srun's own flags, tensorboard) are not checked.
"""

from __future__ import annotations

import concurrent.futures
import re
import shlex
from pathlib import Path

import pytest

from procs import REPO, SCRIPTS, run_python

DOCS = sorted({REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "benchmarks" / "results").glob("*/README.md")})
CHECKED = ("tfpar-train", "tfpar-launch", "tfpar-check")
WRAPPERS = ("srun",)  # run the command after them


def fences(path: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(encoding="utf-8"), re.S)


def shell_lines(path: Path) -> list[list[str]]:
    """The words of every command line in the doc's bash/sh blocks."""
    lines = []
    for block in fences(path, "bash") + fences(path, "sh"):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = shlex.split(line, comments=True)
            while words and words[0] in WRAPPERS:
                words = words[1:]
            if words:
                lines.append(words)
    return lines


def is_checked(words: list[str]) -> bool:
    python_script = words[0] in ("python", "python3") and len(words) > 1 and (
        words[1].startswith("benchmarks/") or words[1:3] in (["-m", "tfpar.train"], ["-m", "tfpar.check"]))
    return words[0] in CHECKED or python_script


def documented_configs(tmp_path: Path) -> dict[str, str]:
    """configs/NAME.py -> a file holding the doc's ```python block that defines it."""
    found = {}
    for path in DOCS:
        for block in fences(path, "python"):
            named = re.match(r'"""(configs/\w+\.py):', block)
            if named and not (REPO / named.group(1)).exists():
                target = tmp_path / Path(named.group(1)).name
                target.write_text(block, encoding="utf-8")
                found[named.group(1)] = str(target)
    return found


def commands(tmp_path: Path) -> list[tuple[str, list[str]]]:
    configs = documented_configs(tmp_path)
    found = []
    for path in DOCS:
        for words in shell_lines(path):
            if is_checked(words):
                words = [re.sub(r"^--config=(\S+)$", lambda m: f"--config={configs.get(m[1], m[1])}", w)
                         for w in words]
                found.append((str(path.relative_to(REPO)), words))
    return found


def test_every_python_block_compiles():
    blocks = [(path, block) for path in DOCS for block in fences(path, "python") if ">>>" not in block]
    assert len(blocks) > 10
    for path, block in blocks:
        compile(block, str(path), "exec")  # a SyntaxError names the doc


def test_pip_install_lines_name_extras_setup_py_has():
    setup = (REPO / "setup.py").read_text()
    for path in DOCS:
        for words in shell_lines(path):
            if words[:2] != ["pip", "install"]:
                continue
            for word in words[2:]:
                extras = re.match(r"^\.?\[([\w,]+)\]$", word.lstrip("-e").strip()) or re.match(r'^"?\.\[([\w,]+)\]"?$', word)
                for extra in (extras.group(1).split(",") if extras else ()):
                    assert f'"{extra}":' in setup, f"{path.name}: pip install extra [{extra}] is not in setup.py"
            assert "tfpar[" not in " ".join(words), f"{path.name}: tfpar is not on PyPI: {' '.join(words)}"


@pytest.mark.slow
def test_every_documented_command_parses(tmp_path):
    """Each command in a subprocess (each loads its config and TensorFlow): about 4 s each,
    two at a time."""
    found = commands(tmp_path)
    assert len(found) >= 15, found
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(lambda item: run_python([str(SCRIPTS / "parse_only.py"), *item[1]], timeout=180), found))
    failed = [f"{doc}: {' '.join(words)}\n  -> {(d.stdout + d.stderr).strip().splitlines()[-1:]}"
              for (doc, words), d in zip(found, done) if d.returncode != 0]
    assert not failed, "\n".join(failed)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a markdown file's headings (lowercase, punctuation dropped,
    spaces to hyphens, repeated ones numbered)."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#+\s+(.*)$", path.read_text(encoding="utf-8"), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for path in DOCS:
        text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s):, mailto:
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{path.relative_to(REPO)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{path.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
