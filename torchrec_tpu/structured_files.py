"""Reading JSON / YAML option files with errors that name the file: a malformed, truncated or
binary file raises ``ValueError("<path>: malformed JSON: ...")`` instead of a parser traceback.

Hostile files are refused in bounded time, before anything walks their content: more than
``MAX_FILE_BYTES``, nesting deeper than ``MAX_NESTING`` levels, or YAML aliases adding more than
``MAX_ALIAS_VALUES`` values when expanded (an alias bomb: 1 KB of anchors naming each other nine times over
is a billion strings to anything that iterates or prints it; a recursive alias is infinitely deep).
Callers echo the values they read in error messages through :func:`brief`.
"""

from __future__ import annotations

import json
import reprlib
from pathlib import Path
from typing import Any, Callable, Iterable

MAX_FILE_BYTES = 64 * 1024**2
MAX_NESTING = 100
MAX_ALIAS_VALUES = 100_000

_BRIEF = reprlib.Repr()  # keyword arguments only from Python 3.12
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxlong, _BRIEF.maxother = 2, 40, 40, 40
_BRIEF.maxdict = _BRIEF.maxlist = _BRIEF.maxtuple = _BRIEF.maxset = 4


def brief(value: Any, width: int = 80) -> str:
    """``repr(value)`` cut to about ``width`` characters without formatting all of a big value."""
    text = _BRIEF.repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def read_structured(path: str | Path) -> Any:
    """The content of ``path``: JSON for ``*.json``, YAML otherwise (a JSON file is valid YAML)."""
    path = Path(path)
    kind = "JSON" if path.suffix.lower() == ".json" else "YAML"
    with path.open("rb") as f:
        raw = f.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"{path}: larger than {MAX_FILE_BYTES} bytes, the limit of a {kind} option file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not a {kind} text file (byte {error.start} is not UTF-8)") from None
    try:
        if kind == "JSON":
            data = json.loads(text, object_pairs_hook=lambda pairs: _unique_keys(path, pairs))
            _check_shape(path, data, _json_children, yaml_nodes=False)
            return data
        return _load_yaml(path, text)
    except RecursionError:  # the JSON decoder recurses per level
        raise ValueError(f"{path}: nested deeper than {MAX_NESTING} levels") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: malformed JSON (truncated?): {error}") from None
    except ValueError as error:  # int() of a number with too many digits, inside either parser
        if str(error).startswith(f"{path}:"):
            raise
        raise ValueError(f"{path}: malformed {kind}: {error}") from None
    except Exception as error:  # yaml.YAMLError; imported lazily, so caught by its base
        if not type(error).__module__.startswith("yaml"):
            raise
        raise ValueError(_yaml_error(path, error)) from None


def _yaml_error(path: Path, error: Exception) -> str:
    """``cfg.yaml: malformed YAML at line 3, column 3: expected <block end>, but found '-' (while
    parsing a block mapping from line 1)``: PyYAML's message on one line, with the file's name."""
    mark, context, context_mark = (getattr(error, name, None) for name in ("problem_mark", "context", "context_mark"))
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(error, "problem", None) or " ".join(str(error).split())
    if context:
        problem += f" ({context}" + (f" from line {context_mark.line + 1})" if context_mark is not None else ")")
    return f"{path}: malformed YAML{where}: {problem}"


def _load_yaml(path: Path, text: str) -> Any:
    """``yaml.safe_load`` whose document is checked (nesting, alias expansion) before any Python
    value is built from it."""
    import yaml

    if yaml.__with_libyaml__:
        _check_yaml_nesting(path, text)

    class BoundedLoader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            self.depth += 1
            if self.depth > MAX_NESTING:
                mark = self.peek_event().start_mark
                raise ValueError(f"{path}: nested deeper than {MAX_NESTING} levels (line {mark.line + 1})")
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def compose_document(self) -> Any:
            node = super().compose_document()
            _check_shape(path, node, _yaml_children, yaml_nodes=True)
            return node

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            lines: dict[Any, int] = {}
            for key, _ in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value != "<<":
                    if key.value in lines:
                        raise ValueError(f"{path}: key {brief(key.value)} is given twice (lines {lines[key.value]} "
                                         f"and {key.start_mark.line + 1}); give it once")
                    lines[key.value] = key.start_mark.line + 1
            return super().construct_mapping(node, deep)

    loader = BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _unique_keys(path: Path, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; ValueError naming a key given twice (the last would win)."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ValueError(f"{path}: key {brief(key)} is given twice; give it once")
        data[key] = value
    return data


def _check_yaml_nesting(path: Path, text: str) -> None:
    """Refuse nesting deeper than MAX_NESTING from libyaml's events, before the pure-Python
    loader reads the text: its scanner takes seconds over a few thousand nested ``[`` (each is a
    possible simple key it re-checks at every token). Other syntax errors are the loader's to
    report."""
    import yaml

    depth = 0
    try:
        for event in yaml.parse(text, Loader=yaml.CSafeLoader):
            if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                depth += 1
                if depth > MAX_NESTING:
                    raise ValueError(f"{path}: nested deeper than {MAX_NESTING} levels "
                                     f"(line {event.start_mark.line + 1})")
            elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                depth -= 1
    except yaml.YAMLError as error:
        if "nesting depth" in str(error):  # libyaml's own limit, deeper than ours
            raise ValueError(f"{path}: nested deeper than {MAX_NESTING} levels") from None


def _json_children(value: Any) -> Iterable[Any]:
    if isinstance(value, dict):
        return [*value.keys(), *value.values()]
    return value if isinstance(value, list) else ()


def _yaml_children(node: Any) -> Iterable[Any]:
    if isinstance(node.value, list):  # sequence: nodes; mapping: (key, value) node pairs
        return [part for item in node.value for part in (item if isinstance(item, tuple) else (item,))]
    return ()


def _check_shape(path: Path, root: Any, children: Callable[[Any], Iterable[Any]], yaml_nodes: bool) -> None:
    """ValueError naming ``path`` when ``root`` nests deeper than MAX_NESTING levels or, for a YAML
    document (``yaml_nodes``), its aliases add more than MAX_ALIAS_VALUES values when expanded (a
    recursive alias is infinitely deep). Shared parts are measured once: a bomb costs its size in
    the file. (JSON has no aliases; its decoder shares the strings of repeated keys.)"""
    note = ", YAML aliases expanded (a recursive alias never ends)" if yaml_nodes else ""
    measured: dict[int, tuple[int, int]] = {}  # id -> (values, levels) of a part, shared parts counted at each use

    def measure(value: Any, depth: int) -> tuple[int, int]:
        known = measured.get(id(value))
        if known is None:
            if depth > MAX_NESTING:
                raise ValueError(f"{path}: nested deeper than {MAX_NESTING} levels{note}")
            values, levels = 1, 1
            for child in children(value):
                child_values, child_levels = measure(child, depth + 1)
                values, levels = values + child_values, max(levels, child_levels + 1)
            known = measured[id(value)] = (values, levels)
        if depth + known[1] - 1 > MAX_NESTING:
            raise ValueError(f"{path}: nested deeper than {MAX_NESTING} levels{note}")
        return known

    expanded = measure(root, 1)[0]
    if yaml_nodes and expanded - len(measured) > MAX_ALIAS_VALUES:
        raise ValueError(f"{path}: YAML aliases add {expanded - len(measured)} values when expanded, more than "
                         f"{MAX_ALIAS_VALUES} (an alias bomb?)")
