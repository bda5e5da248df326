"""Records of a data file: the one reader behind instruction, preference and prompt data.

JSON (a list) and JSONL files, and Hugging Face datasets (`read_dataset`): "hf:NAME" loads with
`datasets.load_dataset(NAME, split=...)` (a hub id, or a local folder of data files); a folder
written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk` or a .parquet / .arrow file is
read locally.
"""

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


DATASET_FILES = {".parquet": "parquet", ".arrow": "arrow"}


def is_dataset(spec: str | os.PathLike) -> bool:
    """Whether `spec` names a Hugging Face dataset rather than a JSON/JSONL file."""
    text = str(spec)
    path = Path(text).expanduser()
    return text.startswith("hf:") or path.is_dir() or path.suffix in DATASET_FILES


def read_dataset(spec: str | os.PathLike, split: str, items: str) -> list[tuple[dict, str]]:
    """(row, where) of each row of the `split` of a Hugging Face dataset (see the module
    docstring); `where` names the dataset, the split and the row."""
    import datasets

    text = str(spec)
    path = Path(text).expanduser()
    label = f"{text} ({split})"
    try:
        if text.startswith("hf:"):
            ds = datasets.load_dataset(text[3:], split=split)
        elif path.is_dir():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(
                        f"the dataset {text!r} has splits {sorted(ds)}, not {split!r}; set the "
                        "split to one of them"
                    )
                ds = ds[split]
        else:
            if not path.is_file():
                raise DataNotFound(f"dataset file {text!r} does not exist")
            ds = datasets.load_dataset(
                DATASET_FILES[path.suffix], data_files={split: str(path)}, split=split
            )
    except (FileNotFoundError, ValueError) as e:  # datasets' errors for a bad name or split
        raise DataError(f"cannot load the dataset {text!r}, split {split!r}: {e}") from None
    if len(ds) == 0:
        raise DataError(f"{label} holds no {items}")
    return [(row, f"{label} row {i}") for i, row in enumerate(ds)]
