"""YAML trees of sections and keys, to nested dataclasses and back: the typed reading
behind launch.config. An unknown key is an error that suggests the nearest valid one; a
value of the wrong type, or outside a Literal's choices, names its key and what it takes.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the key and the fix."""


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set '{key}': '{part}' is a value, not a section")
    node[leaf] = value


def field_key(f: dataclasses.Field) -> str:
    """A field's config key: its name, unless that is a Python keyword (`async`)."""
    return f.metadata.get("key", f.name)


def valid_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key the config accepts, e.g. 'train.lr'."""
    keys = []
    for f in dataclasses.fields(cls):
        kind = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(kind):
            keys += valid_keys(kind, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + field_key(f))
    return keys


def _unknown_key(key: str, root: type) -> ConfigError:
    keys = valid_keys(root)
    near = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    if not near:  # a right leaf in the wrong section: 'lr' -> 'train.lr'
        leaf = key.rsplit(".", 1)[-1]
        near = [k for k in keys if k.rsplit(".", 1)[-1] == leaf][:1]
    hint = f"; did you mean '{near[0]}'?" if near else f"; valid keys: {', '.join(keys)}"
    return ConfigError(f"unknown config key '{key}'{hint}")


def build(cls: type, tree: Any, prefix: str = "", root: type | None = None) -> Any:
    """The dataclass `cls` from a tree of sections; an unknown key is named with the
    nearest key of the whole config `root` (default `cls`)."""
    root = root or cls
    if not isinstance(tree, dict):
        raise ConfigError(f"'{prefix.rstrip('.')}' is a section; give it keys, not a value")
    hints = typing.get_type_hints(cls)
    names = {field_key(f): f.name for f in dataclasses.fields(cls)}
    for key, value in tree.items():
        if key not in names:
            full = prefix + str(key)
            while isinstance(value, dict) and value:  # name the whole key: 'trian.steps'
                key, value = next(iter(value.items()))
                full += f".{key}"
            raise _unknown_key(full, root)
    values = {}
    for key in names.keys() & tree.keys():
        name, kind = names[key], hints[names[key]]
        if dataclasses.is_dataclass(kind):
            values[name] = build(kind, tree[key], f"{prefix}{key}.", root)
        else:
            values[name] = _coerce(prefix + key, tree[key], kind, root)
    return cls(**values)


def _coerce(key: str, value: Any, kind: Any, root: type) -> Any:
    """Check `value` against the field type `kind`, converting what is unambiguous."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        is_null = value is None or (isinstance(value, str) and value.lower() in ("null", "~"))
        if is_null and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(key, value, inner[0], root)
    if origin is Literal:
        for choice in args:
            if value == choice or str(value) == str(choice):
                return choice
        allowed = "|".join(str(a) for a in args)
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of {allowed}")
    if origin is list:
        if isinstance(value, str) and dataclasses.is_dataclass(args[0]):
            value = yaml.safe_load(value)  # data.mixture='[{files: [a.txt], weight: 1}]'
        items = value if isinstance(value, list) else [value]
        return [_coerce(f"{key}[{i}]", item, args[0], root) for i, item in enumerate(items)]
    if dataclasses.is_dataclass(kind):
        return build(kind, value, f"{key}.", root)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "yes", "1", "on"):
            return True
        if str(value).lower() in ("false", "no", "0", "off"):
            return False
        raise ConfigError(f"{key}={value!r} must be true or false")
    if kind is int:
        try:
            number = float(value) if not isinstance(value, bool) else None
        except (TypeError, ValueError):
            number = None
        if number is None or not number.is_integer():
            raise ConfigError(f"{key}={value!r} must be an integer")
        return int(number)
    if kind is float:
        try:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} must be a number") from None
    if kind is str:
        if isinstance(value, (dict, list)) or value is None:
            raise ConfigError(f"{key}={value!r} must be a string")
        return str(value)
    raise TypeError(f"config field {key} has unsupported type {kind}")


def to_dict(config: Any) -> dict[str, Any]:
    """The config as its keys (`checkpoint.async`, not the field's name): what
    load_config reads back."""
    tree = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            tree[field_key(f)] = to_dict(value)
        elif isinstance(value, list):
            tree[field_key(f)] = [to_dict(v) if dataclasses.is_dataclass(v) else v for v in value]
        else:
            tree[field_key(f)] = copy.deepcopy(value)
    return tree
