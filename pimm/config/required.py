"""Keys every training config must define (checked by the launcher before any process starts)."""

from __future__ import annotations

from pimm.errors import ConfigError


def check_config(cfg: dict) -> None:
    """Keys the trainer needs, checked before any process group work."""
    for key in ("seed", "epochs", "batch_size", "model", "optimizer", "data", "log_every", "eval_every_epochs"):
        if key not in cfg:
            raise ConfigError(f"config is missing '{key}' (normally set in configs/_base_/default_runtime.py)")
    if "train" not in cfg["data"] or not cfg["data"]["train"]:
        raise ConfigError("config has no data.train entry")
