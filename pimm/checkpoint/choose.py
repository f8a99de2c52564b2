"""Which weights of a run `--checkpoint last|best|step_N` names (`pimm export`, `pimm test`)."""

from __future__ import annotations

import contextlib
import json
import math
import re
from pathlib import Path

from pimm.errors import PimmError

_STEP = re.compile(r"step_(\d+)")


def _best_step(run_dir: Path) -> int | None:
    """The step model_best.pth was saved at: model/model_best.json says so; runs from before that
    file: the first validation with the highest mIoU (the trainer replaces it only on a strictly
    better one); None without either."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        return int(json.loads((run_dir / "model" / "model_best.json").read_text())["step"])
    best, step = -math.inf, None
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut by a crash
            continue
        miou = rec.get("miou")
        if rec.get("kind") == "val" and isinstance(miou, int | float) and miou > best:
            best, step = miou, rec.get("step")
    return step


def choose_weights(run_dir: Path, which: str) -> tuple[Path, int | None]:
    """(weights file, its step) of `--checkpoint which` (last, best or step_N) of a run, verified;
    PimmError naming the available ones otherwise. Used by `pimm export` and `pimm test`."""
    from pimm.checkpoint.layout import LAST, WEIGHTS, candidates, verify

    model_dir = run_dir / "model"
    complete, incomplete = candidates(model_dir)
    snapshots = {int(p.stem.removeprefix("iter_")): p for p in model_dir.glob("iter_*.pth")
                 if p.stem.removeprefix("iter_").isdigit()}
    best = model_dir / "model_best.pth"
    available = [f"last (step {c.step})" if c.path.name == LAST else f"step_{c.step}" for c in complete]
    available += [f"step_{n} ({p.name})" for n, p in sorted(snapshots.items())
                  if n not in {c.step for c in complete}]
    available += ["best (model_best.pth)"] if best.is_file() else []
    listing = ", ".join(available) or "none"
    if incomplete:
        listing += f"; incomplete, not usable: {', '.join(p.name for p in incomplete)}"
    hint = f"available: {listing}"

    if which == "best":
        if not best.is_file():
            raise PimmError(f"--checkpoint best: {best} does not exist (no validation improved the mIoU yet); {hint}")
        return best, _best_step(run_dir)
    step = _STEP.fullmatch(which)
    if which == LAST:
        chosen = [c for c in complete if c.path.name == LAST]
        broken = [p for p in incomplete if p.name == LAST]
    elif step:
        n = int(step.group(1))
        chosen = [c for c in complete if c.step == n]
        broken = [p for p in incomplete if _STEP.fullmatch(p.name) and int(p.name.removeprefix("step_")) == n]
        if not chosen and n in snapshots:
            return snapshots[n], n
    else:
        raise PimmError(f"--checkpoint {which!r} is not last, best or step_N; {hint}")
    if not chosen:
        if broken:
            raise PimmError(f"checkpoint {broken[0]} is incomplete (its write never finished: no .complete marker or "
                            f"a file missing); choose a complete one ({hint})")
        raise PimmError(f"no checkpoint {which!r} in {model_dir}; {hint}")
    try:
        verify(chosen[0].path)  # sizes and sha256 of weights.pth against the manifest
    except PimmError as exc:
        raise PimmError(f"{exc}; choose another checkpoint ({hint})") from exc
    return chosen[0].path / WEIGHTS, chosen[0].step
