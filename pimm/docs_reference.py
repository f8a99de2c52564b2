"""Generate the reference pages of the documentation from the code.

    python -m pimm.docs_reference            # write docs/reference/config.md and docs/reference/cli.md
    python -m pimm.docs_reference --check    # exit 1 when a committed page differs from the code

`config.md`: every key of `configs/_base_/default_runtime.py` as a dotted name (nested dicts
flattened) with its default (from pimm's own config loader), the comment beside it in the file
(read with `tokenize`, so the file's text is the source) and the rule the launcher checks
(`pimm.config.validate.RULES`, plus `RULES_ELSEWHERE` for the keys checked in other modules).
`cli.md`: every command and flag of the `pimm` argument parsers (`pimm.cli.build_parser`).
"""

from __future__ import annotations

import argparse
import ast
import functools
import io
import sys
import tokenize
from pathlib import Path
from typing import Any

from pimm.cli import build_parser
from pimm.config import load_config
from pimm.config.validate import LOSS_OPTIONS, RULES, SEGMENTATION_METRICS, SPLITS

REPO = Path(__file__).resolve().parent.parent
BASE_CONFIG = REPO / "configs" / "_base_" / "default_runtime.py"
CONFIG_PAGE = REPO / "docs" / "reference" / "config.md"
CLI_PAGE = REPO / "docs" / "reference" / "cli.md"
USAGE_WIDTH = 100  # usage lines are wrapped at a fixed width, not the terminal's


def rules_elsewhere() -> dict[str, str]:
    """Rules of keys that `pimm.config.validate.RULES` leaves to other checks, in words."""
    per_rank = "an integer >= 1 that world size x grad_accum_steps divides, or None (one event per rank)"
    return {
        "batch_size": "an integer >= 1 that world size x grad_accum_steps divides (checked with the world size, "
                      "before any process starts)",
        "batch_size_val": per_rank.replace(" x grad_accum_steps", ""),
        "batch_size_test": per_rank.replace(" x grad_accum_steps", ""),
        "num_worker": "an integer >= 0 (global: each rank gets num_worker // world size)",
        "task.class_weights": "None, or one finite weight >= 0 per class (data.num_classes entries), not all 0",
        "task.ignore_index": "an integer label outside 0..data.num_classes-1",
        "task.best_metric": f"one of {', '.join(SEGMENTATION_METRICS)}",
        "task.loss": f"a non-empty list of dict(type=..., weight=...) with type one of {', '.join(LOSS_OPTIONS)} "
                     "(Focal also takes gamma >= 0)",
    }


# ----------------------------------------------------------------------------- config reference


def _comments(source: str) -> tuple[dict[int, str], dict[int, str]]:
    """(trailing comment per line, full-line comment per line) of a Python source."""
    trailing: dict[int, str] = {}
    full: dict[int, str] = {}
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        line = tok.start[0]
        text = tok.string.lstrip("#").strip()
        if lines[line - 1][: tok.start[1]].strip():
            trailing[line] = text
        else:
            full[line] = text
    return trailing, full


def _block_above(line: int, full: dict[int, str]) -> list[str]:
    """The contiguous full-line comments right above `line`; the file's header block (from line 1) is not one."""
    block = []
    at = line - 1
    while at in full:
        block.insert(0, full[at])
        at -= 1
    return [] if at == 0 else block


def config_comments(source: str) -> dict[str, str]:
    """Dotted key -> the comment written beside (or right above) its assignment in a config file."""
    trailing, full = _comments(source)
    out: dict[str, str] = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        key = node.targets[0].id
        text = _block_above(node.lineno, full)
        if node.lineno in trailing:
            text.append(trailing[node.lineno])
        if node.end_lineno != node.lineno and node.end_lineno in trailing:
            text.append(trailing[node.end_lineno])
        if text:
            out[key] = " ".join(text)
        value = node.value
        if isinstance(value, ast.Call) and node.end_lineno != node.lineno:
            for kw in value.keywords:
                if kw.arg is None or kw.value.lineno == node.lineno:
                    continue
                words = _block_above(kw.value.lineno, full)
                if kw.value.end_lineno in trailing and kw.value.end_lineno != node.end_lineno:
                    words.append(trailing[kw.value.end_lineno])
                if words:
                    out[f"{key}.{kw.arg}"] = " ".join(words)
    return out


def _flatten(cfg: dict, prefix: str = "") -> list[tuple[str, Any]]:
    rows = []
    for key, value in cfg.items():
        rows.append((prefix + key, value))
        if isinstance(value, dict):
            rows += _flatten(value, f"{prefix}{key}.")
    return rows


def config_rows(path: Path = BASE_CONFIG) -> list[dict[str, Any]]:
    """One row per dotted key of the base config: key, default, comment, rule, required."""
    cfg = load_config(path)
    comments = config_comments(path.read_text())
    rules = {key: (required, rule.allowed) for key, required, rule in RULES}
    other = rules_elsewhere()
    rows = []
    missing = []
    for key, value in _flatten(cfg):
        if key in other:
            required, rule = rules.get(key, (False, ""))[0], other[key]
        elif key in rules and rules[key][1] != "set":
            required, rule = rules[key]
        else:
            missing.append(key)
            continue
        rows.append({"key": key, "default": value, "comment": comments.get(key, ""), "rule": rule,
                     "required": required})
    if missing:
        raise LookupError(f"no validation rule for {', '.join(missing)}: add it to pimm.config.validate.RULES "
                          "or to pimm.docs_reference.rules_elsewhere")
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def _code(value: Any) -> str:
    text = repr(value) if not isinstance(value, dict) else "dict(...)"
    return "`" + text.replace("|", "\\|") + "`"


def render_config(path: Path = BASE_CONFIG) -> str:
    rows = config_rows(path)
    base_keys = {row["key"] for row in rows}
    out = [
        "# Config keys",
        "",
        "<!-- generated by `python -m pimm.docs_reference` from configs/_base_/default_runtime.py and "
        "pimm/config/validate.py; do not edit by hand -->",
        "",
        "Every key of `configs/_base_/default_runtime.py`, which every config inherits. Nested dicts are "
        "written as dotted names, the form `-- key=value` overrides take. *Default* is the base value, "
        "*comment* the one beside it in the file, *rule* what the launcher checks before any process "
        "starts (a value outside it stops the launch with exit status 2). How configs are written: "
        "[Configs](../configs.md).",
        "",
        "| key | default | comment | rule |",
        "|---|---|---|---|",
    ]
    for row in rows:
        rule = row["rule"] + (" (required)" if row["required"] else "")
        out.append(f"| `{row['key']}` | {_code(row['default'])} | {_cell(row['comment'])} | {_cell(rule)} |")
    out += [
        "",
        "## Keys the base leaves to each config",
        "",
        "The model, and the options of each data set (`data.train`, `data.val`, `data.test`; shown here as "
        "`data.<split>`), are set by each config. `PILArNetDataset`-only options are refused for "
        "`LArTPCDataset`.",
        "",
        "| key | rule |",
        "|---|---|",
    ]
    seen = set()
    for key, required, rule in RULES:
        parts = key.split(".")
        if len(parts) == 3 and parts[0] == "data" and parts[1] in SPLITS:
            key = f"data.<split>.{parts[2]}"
        if key in base_keys or key in seen:
            continue
        seen.add(key)
        text = rule.allowed + (" (required)" if required else "")
        out.append(f"| `{key}` | {_cell(text)} |")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- CLI reference


def _subcommands(parser: argparse.ArgumentParser, prefix: str) -> list[tuple[str, argparse.ArgumentParser]]:
    """(command line, parser) for the parser and every subcommand under it, depth first."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                line = f"{prefix} {name}"
                found.append((line, sub))
                found += _subcommands(sub, line)
    return found


def _flag_name(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(action.option_strings)
        if action.nargs == 0:
            return names
        if action.choices is not None:
            meta = "{" + ",".join(map(str, action.choices)) + "}"
        else:
            meta = action.metavar or action.dest.upper()
        if action.nargs == "?":
            meta = f"[{meta}]"
        return f"{names} {meta}"
    return action.metavar or action.dest


def cli_flags(parser: argparse.ArgumentParser | None = None) -> dict[str, list[str]]:
    """Command line ('pimm launch') -> its option strings, for every command that takes flags."""
    parser = parser or build_parser()
    out = {}
    for line, sub in _subcommands(parser, "pimm"):
        out[line] = [s for a in sub._actions for s in a.option_strings if s not in ("-h", "--help")]
    return out


def render_cli() -> str:
    parser = build_parser()
    out = [
        "# Command line",
        "",
        "<!-- generated by `python -m pimm.docs_reference` from the argument parsers in pimm/cli/; "
        "do not edit by hand -->",
        "",
        "Every `pimm` command and flag, as `pimm <command> --help` prints them. Everything after a bare "
        "`--` is a list of `key=value` config overrides ([Configs](../configs.md)); the commands that take "
        "them say so.",
        "",
    ]
    for line, sub in _subcommands(parser, "pimm"):
        if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
            verbs = [name for a in sub._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices]
            out += [f"## {line}", "", f"Subcommands: {', '.join(f'`{line} {v}`' for v in verbs)}.", ""]
            continue
        sub.formatter_class = functools.partial(sub.formatter_class, width=USAGE_WIDTH)
        formatter = sub._get_formatter()
        out += [f"## {line}", "", "```text", sub.format_usage().strip(), "```", ""]
        if sub.description:
            out += [_cell(" ".join(sub.description.split())), ""]
        out += ["| argument | meaning |", "|---|---|"]
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            text = formatter._expand_help(action) if action.help else ""
            out.append(f"| `{_flag_name(action).replace('|', chr(92) + '|')}` | {_cell(' '.join(text.split()))} |")
        out.append("")
    return "\n".join(out)


def pages() -> dict[Path, str]:
    return {CONFIG_PAGE: render_config(), CLI_PAGE: render_cli()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pimm.docs_reference", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a committed page is not current")
    args = parser.parse_args(argv)
    stale = []
    for path, text in pages().items():
        current = path.read_text() if path.is_file() else None
        if current == text:
            continue
        if args.check:
            stale.append(str(path.relative_to(REPO)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO)}")
    if stale:
        print(f"not current: {', '.join(stale)}; run `python -m pimm.docs_reference`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
