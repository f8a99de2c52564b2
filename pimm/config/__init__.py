"""Config files: find, load (with ``_base_`` inheritance), override, dump and hash; a run's resolved
config read back as data (``read_run_config``)."""

from pimm.config.loader import (
    config_hash,
    dump_config,
    flatten_keys,
    list_configs,
    load_config,
    merge_configs,
    read_run_config,
    resolve_config_path,
)
from pimm.config.overrides import apply_overrides, parse_overrides

__all__ = [
    "apply_overrides",
    "config_hash",
    "dump_config",
    "flatten_keys",
    "list_configs",
    "load_config",
    "merge_configs",
    "parse_overrides",
    "read_run_config",
    "resolve_config_path",
]
