"""Reading JSON / YAML option files with errors that name the file: a malformed, truncated or
binary file raises ``ValueError("<path>: malformed JSON: ...")`` instead of a parser traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_structured(path: str | Path) -> Any:
    """The content of ``path``: JSON for ``*.json``, YAML otherwise (a JSON file is valid YAML)."""
    path = Path(path)
    kind = "JSON" if path.suffix.lower() == ".json" else "YAML"
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not a {kind} text file (byte {error.start} is not UTF-8)") from None
    try:
        if kind == "JSON":
            return json.loads(text)
        import yaml

        return yaml.safe_load(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: malformed JSON (truncated?): {error}") from None
    except Exception as error:  # yaml.YAMLError; imported lazily, so caught by its base
        if not type(error).__module__.startswith("yaml"):
            raise
        raise ValueError(f"{path}: malformed YAML: {' '.join(str(error).split())}") from None
