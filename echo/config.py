"""Config plumbing shared by every process: TOML files + dotted command-line overrides,
validated by one pydantic model per process.

    cfg = load_config(LearnerConfig, "configs/demo.toml", ["--trainer.lr", "3e-4"])

Unknown keys and bad values raise `ConfigError`, whose message names the key, the file and
what is allowed, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import argparse
import difflib
import json
import tomllib
import typing
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

M = TypeVar("M", bound=BaseModel)
#: What the docs call a key, where that word is not the key (`--buffer.policy queue-max`: its `type`)
SYNONYMS = {"policy": "type", "kind": "type", "mode": "type"}


class Section(BaseModel):
    """Base of every config table: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ConfigError(ValueError):
    """A config file or override is wrong; the message says where and what is allowed."""


def parse_overrides(args: list[str], flags: list[list[str]] | None = None) -> dict[str, Any]:
    """`["--trainer.lr", "3e-4", "--run.name=x"]` -> `{"trainer": {"lr": 3e-4}, "run": {"name": "x"}}`.

    Values are read as TOML literals when they parse (numbers, booleans, arrays, quoted
    strings) and as plain strings otherwise, so `--task.name arith` needs no quotes. `flags`,
    if given, gets each override's key path as typed (`--trainer.lora '{rank = 4}'` is
    `["trainer", "lora"]`, not the keys inside its table).
    """
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.key VALUE")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):  # no value given: a value never starts so
                if "." not in key:  # `--bogus`: an unknown flag, not a value-less override
                    raise ConfigError(f"unknown option --{key}; overrides look like --section.key VALUE (see --help)")
                raise ConfigError(f"override --{key} needs a value")
            value = args[i + 1]
            i += 1
        i += 1
        node = out
        parts = key.replace("-", "_").split(".")
        if flags is not None:
            flags.append(parts)
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override --{key} conflicts with another override")
        node[parts[-1]] = _literal(value)
    return out


def _literal(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None


def load_config(model: type[M], path: str | Path | None, overrides: list[str] | None = None) -> M:
    """Load `path` (optional), apply dotted overrides, validate with `model`."""
    data = read_toml(path) if path else {}
    flags: list[list[str]] = []
    data = deep_merge(data, parse_overrides(overrides or [], flags))
    source = str(path) if path else "the defaults"
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_explain(model, e, source, flags)) from None


def _explain(model: type[BaseModel], error: ValidationError, source: str, flags: list[list[str]] = ()) -> str:
    """`flags`: the overrides' key paths as typed on the command line."""
    lines = [f"invalid config ({source}, with command-line overrides applied):"]
    for err in error.errors():
        path, allowed = _walk(model, [str(p) for p in err["loc"]])
        # A table's kind (`[broadcast] mode`, `[eval] where`) that names no variant: said as the
        # key it is, not as pydantic's "Input tag 'stripes' found using 'mode'" (a new user)
        kind = (next((k for k, v in err["input"].items() if v == err["ctx"]["tag"]), None)
                if err["type"] == "union_tag_invalid" and isinstance(err.get("input"), dict) else None)
        if kind:
            path = [*path, kind]
        key = ".".join(path)
        # Where the user wrote it: a key typed on the command line is not "in configs/demo.toml",
        # and one inside a table given whole is named by the flag that gave it.
        # (`--foo.bar 1` made the unknown table `foo`: the flag lies under the key, not over it)
        flag = next((f for f in reversed(flags) if path[:len(f)] == f or f[:len(path)] == path), None) if path else None
        where = f"given as --{'.'.join(flag)} on the command line" if flag else f"in {source}"
        msg = err["msg"].removeprefix("Value error, ")
        if kind:
            lines.append(f"  {key} = {err['ctx']['tag']!r}: must be one of {err['ctx']['expected_tags']} ({where})")
        elif err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(path[-1], allowed, n=1) if path else []
            if path and not close and path[-1] in SYNONYMS and SYNONYMS[path[-1]] in allowed:
                close = [SYNONYMS[path[-1]]]  # the docs' words: "the buffer policy" is its `type`
            hint = (f"; did you mean {close[0]!r}?" if close else "") + (
                f"; allowed keys here: {', '.join(allowed)}" if allowed else "")
            lines.append(f"  {key}: unknown key ({where}){hint}")
        elif isinstance(err.get("input"), dict):
            # A check of a whole table, or of keys together: its message names them; the input
            # (the table, or the whole config) would bury it.
            lines.append(f"  {'' if not key or msg.startswith('[') else '[' + key + '] '}{msg}")
        else:
            lines.append(f"  {key} = {err.get('input')!r}: {msg} ({where})")
    return "\n".join(lines)


def _walk(model: type[BaseModel], loc: list[str]) -> tuple[list[str], list[str]]:
    """The user's key path in a pydantic error location, and the keys allowed beside its last
    part. pydantic inserts union tags (a tagged union's `mode = "chain"` shows as `chain`) and
    validator names into locations: they are not keys, they pick the variant."""
    options: list[type[BaseModel]] = [model]
    path: list[str] = []
    for i, part in enumerate(loc):
        chosen = [m for m in options if part == m.__name__ or part in _tags(m)]
        if len(options) > 1 and chosen:
            options = chosen[:1]
            continue
        if part.startswith("function-"):
            continue
        path.append(part)
        if i == len(loc) - 1:
            break
        owner = next((m for m in options if part in m.model_fields), None)
        options = _models_of(owner.model_fields[part].annotation) if owner else []
    allowed = sorted({k for m in options for k in m.model_fields}) if len(options) == 1 else []
    return path, allowed


def _tags(model: type[BaseModel]) -> set[str]:
    """The literal values a variant's fields take: its tag among them."""
    return {str(v) for f in model.model_fields.values() if typing.get_origin(f.annotation) is typing.Literal
            for v in typing.get_args(f.annotation)}


def _models_of(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_of(arg)]


def add_config_args(parser: argparse.ArgumentParser, default: str | None) -> None:
    """The flags every process shares; everything else on the line is a dotted override."""
    parser.add_argument("--config", default=default, help=f"TOML config file (default: {default})")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the resolved config (as TOML) and exit"
    )


def dump_toml(cfg: BaseModel) -> str:
    """The resolved config as TOML (what --dry-run prints and each run directory keeps)."""
    return _to_toml(json.loads(cfg.model_dump_json()))


def _to_toml(data: dict[str, Any], prefix: str = "") -> str:
    scalars = [(k, v) for k, v in data.items() if not isinstance(v, dict)]
    tables = [(k, v) for k, v in data.items() if isinstance(v, dict)]
    out = [f"{k} = {_toml_value(v)}" for k, v in scalars if v is not None]
    for key, table in tables:
        name = f"{prefix}{key}"
        body = _to_toml(table, name + ".")
        out.append(f"\n[{name}]\n{body}" if body.strip() else f"\n[{name}]")
    return "\n".join(out).strip() + "\n" if not prefix else "\n".join(out)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))
