"""Standard JSON for every file pimm writes (summary.json, metrics.jsonl, model_best.json,
provenance.json, validate-scaling's report.json, ...).

Python's json writes NaN and Infinity, which are not JSON: strict parsers (jq, JavaScript,
most other languages) reject the whole file. `dumps` writes a non-finite float as null instead
and refuses (ValueError) anything else that is not JSON; `nonfinite_keys` names the values it
turned into null, so a record can say which of its numbers were not finite."""

from __future__ import annotations

import json
import math
import numbers
from typing import Any


def metric_text(value: float | None, error: float | None = None) -> str:
    """A metric as pimm prints it on a console line: four decimals, "n/a" where it is None (how `dumps` wrote a
    non-finite value) or not finite; with `error` (its standard error) finite, "value ± error"."""
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{value:.4f} ± {error:.4f}" if error is not None and math.isfinite(error) else f"{value:.4f}"


def finite_or_none(value: Any) -> Any:
    """`value` with every non-finite float (also numpy scalars) in it replaced by None, recursively
    through dicts, lists and tuples; other values unchanged."""
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        value = float(value)  # numpy float32 is not a float: json would not write it at all
        return value if math.isfinite(value) else None
    return value


def nonfinite_keys(record: dict) -> list[str]:
    """The keys of `record` whose value is a non-finite number (NaN, inf), in order."""
    return [k for k, v in record.items() if isinstance(v, numbers.Real) and not isinstance(v, numbers.Integral)
            and not math.isfinite(float(v))]


def dumps(value: Any, **kwargs: Any) -> str:
    """json.dumps of `value` as standard JSON: non-finite floats become null (allow_nan=False
    guarantees that no NaN or Infinity is ever written)."""
    return json.dumps(finite_or_none(value), allow_nan=False, **kwargs)
