"""Where config names are looked up: ./configs first, then the configs/ shipped beside the package
(REPO_ROOT: the checkout pimm runs from)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def config_roots() -> list[Path]:
    roots = [Path.cwd() / "configs", REPO_ROOT / "configs"]
    unique: list[Path] = []
    for root in roots:
        if root.is_dir() and root.resolve() not in [r.resolve() for r in unique]:
            unique.append(root)
    return unique
