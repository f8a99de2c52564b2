"""What the published recipes give each parameter (lr by keyword, the WeightDecayExclusion hook) against what
pimm's param_groups give it: shared by the recipe tests."""

from __future__ import annotations

import math

from pimm.engine.optim import parameter_groups


def published_lr_and_decay(model, keywords: list[tuple[str, float]], base_lr: float, base_wd: float,
                           exclusion: bool = True) -> dict[str, tuple[float, float]]:
    """name -> (lr, weight decay) of every trainable parameter as the published trainer sets them: the lr of
    the first keyword in its name (base_lr otherwise); no decay on biases, norms, gammas, tokens and 1-D
    parameters when the recipe has the WeightDecayExclusion hook."""
    out = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:  # no gradient: AdamW leaves it alone
            continue
        lr = next((lr for keyword, lr in keywords if keyword in n), base_lr)
        lower = n.lower()
        excluded = exclusion and (n.endswith(".bias") or "norm" in lower or "gamma" in lower or "token" in lower
                                  or p.ndim == 1)
        out[n] = (lr, 0.0 if excluded else base_wd)
    return out


def pimm_lr_and_decay(model, cfg: dict) -> tuple[dict[str, tuple[float, float]], list[dict]]:
    """(name -> (lr, weight decay) that pimm's parameter_groups give each trainable parameter, the groups)."""
    groups = parameter_groups(model.named_parameters(), cfg["optimizer"], cfg["param_groups"])
    ids = {id(p): n for n, p in model.named_parameters()}
    seen = {}
    for group in groups:
        decay = group.get("weight_decay", cfg["optimizer"]["weight_decay"])
        for p in group["params"]:
            seen[ids[id(p)]] = (cfg["optimizer"]["lr"] * group["lr_scale"], decay)
    return seen, groups


def mismatches(seen: dict, expected: dict) -> list:
    """The parameters whose lr or weight decay differ (lr to 1e-12 relative)."""
    assert seen.keys() == expected.keys()
    return [(n, seen[n], expected[n]) for n in expected
            if seen[n][1] != expected[n][1] or not math.isclose(seen[n][0], expected[n][0], rel_tol=1e-12)]
