"""JSON records of a data file: the one reader behind instruction, preference and prompt data."""

import json
import os
from pathlib import Path

from eqllm.data.errors import DataError, DataNotFound


def read_records(path: str | os.PathLike, kind: str, items: str) -> list[tuple[object, str]]:
    """(record, where) of each record in a JSON file (a list) or JSONL file (one per line).

    `where` names the file and the line (JSONL) or index (JSON), for errors about the record;
    `kind` names the data in "file does not exist" and `items` what the file holds.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataNotFound(f"{kind} file {str(file)!r} does not exist")
    text = file.read_text(encoding="utf-8")
    if file.suffix == ".json":
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{file}: not valid JSON ({e})") from None
        if not isinstance(records, list):
            raise DataError(f"{file}: a .json file must hold a list of {items}")
        out = [(r, f"{file} example {i}") for i, r in enumerate(records)]
    else:
        out = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                out.append((json.loads(line), f"{file} line {n}"))
            except json.JSONDecodeError as e:
                raise DataError(f"{file} line {n}: not valid JSON ({e})") from None
    if not out:
        raise DataError(f"{file} holds no {items}")
    return out
