"""Small registries: build components from `dict(type="Name", ...)` config entries."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from pimm.errors import ConfigError


class Registry:
    """Maps a type name to a class or factory; `build` turns a config dict into an object."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Callable[..., Any]] = {}

    def register(self, obj: Callable[..., Any] | None = None, *, name: str | None = None):
        """Register `obj` under its own name (or `name`); usable as a decorator."""

        def add(target: Callable[..., Any]) -> Callable[..., Any]:
            self._entries[name or target.__name__] = target
            return target

        return add(obj) if obj is not None else add

    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, type_name: str) -> Callable[..., Any]:
        if type_name not in self._entries:
            close = difflib.get_close_matches(type_name, self.names(), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else "."
            raise ConfigError(
                f"unknown {self.kind} type '{type_name}'{hint} Valid types: {', '.join(self.names())}."
            )
        return self._entries[type_name]

    def build(self, cfg: dict, *args: Any, **extra: Any) -> Any:
        """Build from `cfg` (a dict with `type`); `args`/`extra` are passed before/besides its keys."""
        if not isinstance(cfg, dict) or "type" not in cfg:
            raise ConfigError(f"a {self.kind} config must be a dict with a 'type' key, got {cfg!r}")
        kwargs = {k: v for k, v in cfg.items() if k != "type"}
        factory = self.get(cfg["type"])
        try:
            return factory(*args, **kwargs, **extra)
        except (TypeError, ValueError) as exc:  # an argument the component refuses: the config's fault
            raise ConfigError(f"cannot build {self.kind} '{cfg['type']}' from {kwargs}: {exc}") from exc
