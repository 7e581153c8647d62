"""The documentation stands alone: its layout block is the package's tree, and every repository path it (or any
file of the repository) names exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = {".md", ".py", ".ipynb", ".toml"}
SKIPPED_DIRS = {".git", ".venv", "__pycache__", "build", "dist", ".ipynb_checkpoints", ".pytest_cache"}
# a backticked path into the repository's top-level folders, up to a line number or an anchor
BACKTICKED = re.compile(r"`((?:onnxtrain|docs|tests|benchmarks|notebooks)/[^`\s:#()]*)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# what a documented command creates, git-ignored (benchmarks/.ort-training/)
CREATED = tuple(line.strip().rstrip("/") for line in (ROOT / ".gitignore").read_text().splitlines()
                if "/" in line.strip().rstrip("/"))


def repository_files() -> list[Path]:
    """The project's own files: not what a documented command created (a virtualenv's packages are not ours)."""
    return [p for p in ROOT.rglob("*") if p.is_file() and p.suffix in SCANNED
            and not SKIPPED_DIRS & set(p.relative_to(ROOT).parts)
            and not p.relative_to(ROOT).as_posix().startswith(CREATED)]


def layout_block() -> list[str]:
    """The module paths docs/architecture.md's layout block lists, from its indentation (two spaces a level)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    folders: list[str] = []
    listed = []
    for line in block.splitlines():
        match = re.match(r"( *)(\S+\.py|\S+/)(?:\s|$)", line)
        if not match:
            continue
        depth = len(match.group(1)) // 2
        folders = folders[:depth]
        name = match.group(2)
        if name.endswith("/"):
            folders.append(name)
        else:
            listed.append("".join(folders) + name)
    return listed


def test_architecture_layout_lists_every_module():
    listed = layout_block()
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "onnxtrain").rglob("*.py")
                     if "__pycache__" not in p.parts)
    assert len(listed) == len(set(listed)), "a module is listed twice"
    assert sorted(listed) == modules, (
        f"missing from docs/architecture.md: {sorted(set(modules) - set(listed))}; "
        f"listed but absent: {sorted(set(listed) - set(modules))}"
    )


def test_every_named_repository_path_exists():
    dangling = []
    for file in repository_files():
        text = file.read_text(errors="replace")
        named = [(m, ROOT / m) for m in BACKTICKED.findall(text)]
        if file.suffix in (".md", ".ipynb"):
            links = [m.split("#")[0] for m in LINK.findall(text) if not re.match(r"[a-z]+:|#", m)]
            named += [(m, file.parent / m) for m in links if m]
        dangling += [f"{file.relative_to(ROOT)}: {name}" for name, path in named
                     if not re.search(r"[<*{]", name) and not name.startswith(CREATED) and not path.exists()]
    assert not dangling, "\n".join(dangling)
