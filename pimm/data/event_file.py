"""The launcher's check of the data a dataset config names, by its layout and without torch: pimm's
event files are checked by `pimm.data.event_format`, PILArNet-M shards by `pimm.data.pilarnet_file`."""

from __future__ import annotations

import logging
from typing import Any

from pimm.data.event_format import validate_event_file
from pimm.data.pilarnet_file import open_pilarnet

log = logging.getLogger("pimm")

# the PILArNetDataset arguments that choose its events (the rest only change how they are read)
_PILARNET_SELECTION = ("split", "revision", "label", "min_points", "energy_threshold", "remove_low_energy_scatters",
                       "min_points_after_cut", "pid_unlabelled_as_none")


def validate_data(dataset: dict, num_classes: int | None = None, ignore_index: int = -1) -> dict[str, Any]:
    """Check the data a dataset config (`dict(type=..., path=..., ...)`) names, by its layout;
    return its identity ({path, size_bytes, num_events, content_hash, ...}; num_events after any
    event selection). Labels must be classes or `ignore_index` (task.ignore_index). Raises
    DataError or ConfigError saying what is wrong. Leaves no file open."""
    skip_nonfinite = bool(dataset.get("skip_nonfinite", False))
    if dataset.get("type") == "PILArNetDataset":
        info, _, _ = open_pilarnet(dataset["path"], num_classes=num_classes, ignore_index=ignore_index,
                                   skip_nonfinite=skip_nonfinite,
                                   **{k: dataset[k] for k in _PILARNET_SELECTION if k in dataset})
    else:
        info = validate_event_file(dataset["path"], num_classes=num_classes, ignore_index=ignore_index,
                                   skip_nonfinite=skip_nonfinite)
    note = dropped_note(info)
    if note:
        log.warning("pimm: %s", note)
    return info


def dropped_note(info: dict[str, Any]) -> str | None:
    """The line that says how many events `skip_nonfinite` left out of a data set of either layout
    (None: none)."""
    if not info.get("nonfinite_dropped"):
        return None
    return (f"data {info['path']}: dropped {info['nonfinite_dropped']} of {info['events_in_files']} events with "
            f"non-finite values (skip_nonfinite=true); {info['num_events']} events are used")
