"""Reading nested text (YAML configs, JSON rows, manifests, metrics lines) with bounds.

Python's parsers recurse: a document nested a few thousand levels deep ends in a
`RecursionError`, and a YAML alias bomb (anchors of anchors, `a: &a [x, x]`,
`b: &b [*a, *a]`, ...) is a few hundred bytes that expand to billions of values as
soon as anything walks them (pydantic, an error message). And PyYAML keeps the
last of two equal keys without a word, so a duplicated `run:` section silently
drops the first. Everything a user or a crashed run can hand us goes through here:

    load_yaml(text, where)   refuses nesting over MAX_DEPTH, aliases expanding past
                             MAX_EXPANDED values and duplicated keys, before
                             anything is built (the scan walks PyYAML's events,
                             which its parser produces without recursion)
    loads_json(text)         json.loads whose depth past MAX_DEPTH (or past what the
                             C scanner can recurse) is a `NestingError` (a ValueError,
                             so every caller that handles malformed JSON handles it)

This module imports only yaml and json, so the config loader can use it.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

MAX_DEPTH = 100
"""Deepest nesting accepted in any document we read (configs, data rows, manifests, metrics: <10 in practice)."""
MAX_EXPANDED = 100_000
"""Most values a YAML document may hold once its aliases are expanded (tiny_cpu.yaml: ~60)."""


class NestingError(ValueError):
    """A document nested deeper than MAX_DEPTH, or whose aliases expand past MAX_EXPANDED values."""


class DuplicateKeyError(ValueError):
    """A YAML mapping that names one key twice."""


def _line(mark) -> str:
    return f"line {mark.line + 1}" if mark is not None else "somewhere"


def scan_yaml(text: str) -> None:
    """NestingError when `text` nests deeper than MAX_DEPTH or its aliases expand past MAX_EXPANDED values.

    Walks the parser's event stream once: each collection's expanded size is its leaves plus its
    children's sizes, an alias counts the size of the node it names (so `[*b, *b]` doubles `b`)."""
    depth = 0
    sizes: list[int] = [0]  # expanded size of each open collection; [0] is the document level
    anchors: dict[str, int] = {}
    open_anchor: list[str | None] = []
    for ev in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(ev, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise NestingError(f"{_line(ev.start_mark)}: nested more than {MAX_DEPTH} levels deep")
            sizes.append(1)
            open_anchor.append(ev.anchor)
        elif isinstance(ev, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1
            size = sizes.pop()
            if (anchor := open_anchor.pop()) is not None:
                anchors[anchor] = size
            sizes[-1] += size
        elif isinstance(ev, yaml.ScalarEvent):
            sizes[-1] += 1
            if ev.anchor is not None:
                anchors[ev.anchor] = 1
        elif isinstance(ev, yaml.AliasEvent):
            sizes[-1] += anchors.get(ev.anchor, 1)
        else:
            continue
        if sizes[-1] > MAX_EXPANDED:
            raise NestingError(f"{_line(ev.start_mark)}: its aliases expand to more than {MAX_EXPANDED} values "
                               "(an alias bomb?); write the values out, or use fewer aliases")


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping naming one key twice (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                continue  # SafeLoader itself reports an unhashable key
            if key in seen:
                raise DuplicateKeyError(f"line {key_node.start_mark.line + 1}: key {str(key)[:80]!r} appears twice "
                                        f"(first on line {seen[key].start_mark.line + 1}); keep one of them")
            seen[key] = key_node
        return super().construct_mapping(node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _StrictLoader.construct_mapping)


def load_yaml(text: str) -> Any:
    """`yaml.safe_load(text)`, bounded (NestingError) and strict about duplicated keys (DuplicateKeyError).
    yaml.YAMLError for syntax errors, as PyYAML raises them."""
    scan_yaml(text)
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


def loads_json(text: str | bytes) -> Any:
    """`json.loads(text)`; nesting past MAX_DEPTH is a NestingError (a ValueError, like malformed JSON)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise NestingError(f"nested more than {MAX_DEPTH} levels deep") from None
    check_depth(value)
    return value


def check_depth(value: Any, limit: int = MAX_DEPTH) -> None:
    """NestingError when lists/dicts in `value` nest deeper than `limit` (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, tuple, dict)):
            if d > limit:
                raise NestingError(f"nested more than {limit} levels deep")
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
