"""Reading a JSON input file with errors that name it (model configs, YaRN payloads)."""

from __future__ import annotations

import json
import os
from typing import Any


def read_json(path: str | os.PathLike, what: str) -> Any:
    """The parsed file; `ValueError("<what> file '<path>' does not exist / is not valid JSON: ...")`."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{what} file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} file {str(path)!r} is not valid JSON: {e}") from None
