"""Command-line overrides: ``key=value`` tokens given after a bare ``--``."""

from __future__ import annotations

import copy
import difflib
import re
from typing import Any

import yaml

from pimm.config.loader import check_plain_data, flatten_keys
from pimm.errors import ConfigError

# PyYAML (YAML 1.1) reads "1e-3" as a string; people typing lr=1e-3 mean a float
_EXP_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
_EXAMPLE = "write overrides as key=value after the -- separator, e.g. -- optimizer.lr=0.01 data.train.max_len=32"


def _parse_value(raw: str) -> Any:
    """YAML-parse one override value; fall back to the raw string when it is not YAML data."""
    if raw.strip() == "":
        return raw  # "key=" means the empty string, not None
    if _EXP_FLOAT.fullmatch(raw.strip()):
        return float(raw)
    if raw.strip() == "None":  # configs are Python: people write None where YAML says null
        return None
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    try:
        # YAML dates, sets and binaries are not config data; keep what the user typed
        return check_plain_data(value, "value")
    except ConfigError:
        return raw


def _check_key(key: str, token: str) -> list[str]:
    parts = key.split(".")
    if not key or any(p == "" for p in parts):
        raise ConfigError(f"override {token!r} has an empty key or key part; {_EXAMPLE}")
    return parts


def parse_overrides(tokens: list[str]) -> list[tuple[str, object]]:
    """Parse ``key=value`` tokens into ``(dotted_key, value)`` pairs, values read as YAML."""
    out: list[tuple[str, object]] = []
    for token in tokens:
        if token.startswith("-"):
            raise ConfigError(
                f"override {token!r} looks like a flag; flags go before the -- separator and "
                f"only key=value overrides after it ({_EXAMPLE})"
            )
        if "=" not in token:
            raise ConfigError(f"override {token!r} is not key=value; {_EXAMPLE}")
        key, _, raw = token.partition("=")
        key = key.strip()
        _check_key(key, token)
        out.append((key, _parse_value(raw)))
    return out


def closest_keys(key: str, cfg: dict, n: int = 3) -> list[str]:
    """Up to `n` dotted keys of `cfg` that `key` most likely meant: keys ending in it (lr ->
    optimizer.lr), else close spellings of the whole key, else keys with the same or a close last part."""
    keys = [str(k) for k in flatten_keys(cfg)]
    leaf = key.rsplit(".", 1)[-1]
    leaves: dict[str, list[str]] = {}
    for k in keys:
        leaves.setdefault(k.rsplit(".", 1)[-1], []).append(k)
    for found in (
        [k for k in keys if k.endswith("." + key)],
        _nearly_best(key, [k for k in keys if k.count(".") == key.count(".")]),
        leaves.get(leaf, []),
        [k for close in difflib.get_close_matches(leaf, list(leaves), n=n, cutoff=0.75) for k in leaves[close]],
    ):
        if found:
            return found[:n]
    return []


def _nearly_best(word: str, choices: list[str], cutoff: float = 0.6) -> list[str]:
    """The choices spelled closest to `word` (similarity >= cutoff and within 0.1 of the best), best first."""
    scored = sorted(((difflib.SequenceMatcher(None, word, c).ratio(), c) for c in choices), reverse=True)
    return [c for score, c in scored if score >= max(cutoff, scored[0][0] - 0.1)] if scored else []


def _unknown(key: str, cfg: dict) -> ConfigError:
    close = closest_keys(key, cfg)
    if len(close) == 1:
        hint = f"; did you mean {close[0]!r}?"
    else:
        hint = f"; did you mean one of {', '.join(map(repr, close))}?" if close else "."
    return ConfigError(f"unknown config key {key!r}{hint} Overrides can only change keys that exist; "
                       "add new keys in the config file.")


def _child_key(node: dict, part: str) -> Any:
    """The key in ``node`` that ``part`` names (``"0"`` also finds an int key ``0``), or None."""
    if part in node:
        return part
    if re.fullmatch(r"-?\d+", part) and int(part) in node:
        return int(part)
    return None


def apply_overrides(cfg: dict, overrides: list[tuple[str, object]]) -> dict:
    """Return a copy of ``cfg`` with each ``(dotted_key, value)`` set; the input is not changed.

    Every part of a dotted key must already exist and lead through dicts.
    """
    out = copy.deepcopy(cfg)
    for key, value in overrides:
        parts = _check_key(key, f"{key}=...")
        value = check_plain_data(value, key)
        node = out
        for i, part in enumerate(parts):
            k = _child_key(node, part)
            if k is None:
                raise _unknown(key, cfg)
            if i == len(parts) - 1:
                node[k] = copy.deepcopy(value)
                break
            if not isinstance(node[k], dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(
                    f"cannot set {key!r}: {where!r} is not a dict (it is {type(node[k]).__name__} "
                    f"{node[k]!r:.60}). Override {where!r} itself instead, e.g. {where}=<value>."
                )
            node = node[k]
    return out
