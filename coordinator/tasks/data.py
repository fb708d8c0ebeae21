"""Reading a dataset task's rows from local files: JSONL, Parquet, or a Hugging Face ``datasets`` folder.

Nothing is ever downloaded: a path must exist on this machine, and the ``datasets`` library is used with
``HF_DATASETS_OFFLINE=1``. Parquet needs ``pyarrow`` and datasets folders need ``datasets``; both are optional, and
a run that names such a file without them stops at start-up with :class:`MissingDependency` saying what to install.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any, Literal

from coordinator.errors import MissingDependency, TaskError

Row = dict[str, Any]
Format = Literal["auto", "jsonl", "parquet", "hf"]


def resolve_format(path: Path, fmt: Format) -> Literal["jsonl", "parquet", "hf"]:
    if fmt != "auto":
        return fmt
    if path.is_dir():
        return "hf"
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise TaskError(f"cannot tell the format of {path} from its name; set task.format to 'jsonl', 'parquet' or "
                    f"'hf' (a datasets folder)")


def read_rows(path: Path, fmt: Format = "auto", split: str = "train") -> list[Row]:
    """Every row of a local dataset as a dict of column → value. ``split`` picks one of a DatasetDict's splits."""
    path = Path(path)
    if not path.exists():
        raise TaskError(f"dataset {path} does not exist (datasets are read from local files only)")
    kind = resolve_format(path, fmt)
    if kind == "jsonl":
        return _read_jsonl(path)
    if kind == "parquet":
        return _read_parquet(path)
    return _read_hf(path, split)


def _read_jsonl(path: Path) -> list[Row]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise TaskError(f"cannot read task file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise TaskError(f"{path} is not UTF-8 text") from None
    rows = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise TaskError(f"{path}:{lineno}: not a JSON value (one JSON object per line)") from None
        if not isinstance(row, dict):
            raise TaskError(f"{path}:{lineno}: expected a JSON object (one per line)")
        rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise MissingDependency(f"reading {path} needs pyarrow: pip install pyarrow") from None
    try:
        return list(pq.read_table(path).to_pylist())
    except Exception as exc:  # pyarrow raises its own ArrowInvalid / OSError family
        raise TaskError(f"cannot read Parquet file {path}: {exc}") from None


def _read_hf(path: Path, split: str) -> list[Row]:
    if not path.is_dir():
        raise TaskError(f"{path} is not a folder; format 'hf' reads a datasets folder (save_to_disk output, or a "
                        f"folder of data files)")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # never reach the hub, whatever the folder says
    try:
        import datasets
    except ImportError:
        raise MissingDependency(f"reading the datasets folder {path} needs Hugging Face datasets: "
                                f"pip install datasets") from None
    saved = any((path / name).exists() for name in ("dataset_dict.json", "state.json", "dataset_info.json"))
    try:
        if saved:
            ds: Any = datasets.load_from_disk(str(path))
        else:
            ds = datasets.load_dataset(str(path))
    except Exception as exc:
        raise TaskError(f"cannot load the datasets folder {path}: {type(exc).__name__}: {exc}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise TaskError(f"{path} has the splits {sorted(ds)}, not {split!r}; set task.train_split / "
                            f"task.heldout_split")
        ds = ds[split]
    return [dict(r) for r in ds]


def split_items(items: list[Any], *, heldout_size: int | None, heldout_fraction: float | None, seed: int,
                source: Path) -> tuple[list[Any], list[Any]]:
    """(train, held-out): a seeded shuffle, then the first ``heldout_size`` (or fraction) held out."""
    items = list(items)
    random.Random(seed).shuffle(items)
    if heldout_fraction is not None:
        n_held = max(1, round(heldout_fraction * len(items)))
    else:
        n_held = 256 if heldout_size is None else heldout_size
    if n_held >= len(items):
        raise TaskError(f"{source} has {len(items)} items; the held-out split ({n_held}) must leave some to train "
                        f"on: lower heldout_size / heldout_fraction, or give a heldout_path")
    return items[n_held:], items[:n_held]
