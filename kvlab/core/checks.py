"""Checks over a whole composed config and over the overrides, whatever group a value sits in.

Each group's own checks (kvlab.config.schema) know what a field means; these know only its shape, so
that nothing slips between groups: a number that is not finite anywhere (``inf`` and ``nan``
reach ``int()``, ``timedelta`` and ``sleep`` otherwise), a key the schema does not have (an
override with ``+`` adds one that composes but that no rank can read back), a value left
missing, and deletions with ``~``.
"""
from __future__ import annotations

import math

from omegaconf import DictConfig, ListConfig, OmegaConf

from kvlab.core import paths
from kvlab.core.errors import ConfigError

FREE_FORM = ("extra",)  # keys of the schema whose contents are not checked against it


def check_overrides_shape(overrides: list[str]) -> None:
    """Overrides kvlab refuses whatever they name: deletions (``~key``)."""
    for ov in overrides:
        if ov.startswith("~"):
            key = ov.lstrip("~").split("=", 1)[0]
            raise ConfigError(key, f"<deleted by {ov}>", f"deleting a key is not supported, every rank reads "
                              f"it; set {key}=<value> instead")


def _walk(node, prefix: str = ""):
    """(dotted key, value) of every leaf, lists included; missing values are yielded as MISSING."""
    items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else enumerate(node)
    for k, _ in items:
        key = f"{prefix}.{k}" if isinstance(node, DictConfig) and prefix else (
            f"{prefix}[{k}]" if isinstance(node, ListConfig) else str(k))
        if OmegaConf.is_missing(node, k):
            yield key, "???"
            continue
        v = node[k]
        if isinstance(v, (DictConfig, ListConfig)):
            yield from _walk(v, key)
        else:
            yield key, v


def _unknown_keys(cfg: DictConfig, schema: DictConfig, prefix: str = "") -> list[str]:
    out = []
    for k in cfg.keys():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k == "hydra" and not prefix or key in FREE_FORM:
            continue
        if k not in schema.keys():  # `in` alone says False for a key whose value is missing
            out.append(key)
            continue
        sub, ref = cfg._get_node(k), schema._get_node(k)
        if isinstance(sub, DictConfig) and isinstance(ref, DictConfig) and not ref._is_none() \
                and not OmegaConf.is_missing(schema, k) and not sub._is_none():
            out += _unknown_keys(sub, ref, key)
    return out


def check_config(cfg: DictConfig, schema: type) -> None:
    """ConfigError for the first key ``schema`` (a structured config) lacks, value left missing, or number
    that is not finite."""
    ref = OmegaConf.structured(schema)
    unknown = _unknown_keys(cfg, ref)
    if unknown:
        key = unknown[0]
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        node = OmegaConf.select(ref, parent) if parent else ref
        keys = list(node.keys()) if isinstance(node, DictConfig) else []
        value = OmegaConf.select(cfg, key)
        if isinstance(value, DictConfig):  # name the key as it was typed: +new.key=1, not new={key: 1}
            key, value = next(_walk(value, key), (key, {}))
        raise ConfigError(key, value, f"no such key; {parent or 'the config'} has {', '.join(keys)}")
    for key, value in _walk(cfg):
        if key.startswith("hydra.") or key.split(".")[0] in FREE_FORM:
            continue
        if value == "???":
            group = paths.CONF_DIR / key.split(".")[0]
            options = sorted(p.stem for p in group.glob("*.yaml")) if "." not in key and group.is_dir() else []
            raise ConfigError(key, "???", f"has no value; choose one of {', '.join(options)}" if options
                              else "has no value; set one")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(key, value, "must be a finite number")
