"""Checks on local data files, run by the launcher before any worker starts.

datasets would fail on these deep inside a worker with a long traceback; here each
becomes one line naming the file (and line) and the override that fixes it.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
from pathlib import Path
from typing import IO, Iterator, Optional

from runner.config.spec import DataFormat, DataSpec

# file suffix (after an optional .gz) -> datasets builder name
BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv"}


def split_suffix(path: str) -> tuple[str, bool]:
    """('.jsonl', True) for 'x.jsonl.gz'."""
    p = Path(path)
    gz = p.suffix == ".gz"
    return (Path(p.stem).suffix if gz else p.suffix).lower(), gz


def builder_for(path: str) -> str:
    return BUILDERS[split_suffix(path)[0]]


def _open_text(path: Path, gz: bool) -> IO[str]:
    raw: IO[bytes] = gzip.open(path, "rb") if gz else open(path, "rb")  # noqa: SIM115
    return io.TextIOWrapper(raw, encoding="utf-8", errors="strict", newline="")


def _lines(handle: IO[str]) -> Iterator[tuple[int, str]]:
    for number, line in enumerate(handle, start=1):
        yield number, line


class MalformedLine(ValueError):
    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"line {line}: {reason}")
        self.line, self.reason = line, reason


def _json_records(path: Path, gz: bool) -> Iterator[tuple[int, object]]:
    """JSON Lines records; a .json file may also be one array of records."""
    with _open_text(path, gz) as handle:
        head = handle.read(1 << 16)
    if head.lstrip().startswith("["):
        with _open_text(path, gz) as handle:
            for i, record in enumerate(json.load(handle), start=1):
                yield i, record
        return
    with _open_text(path, gz) as handle:
        for number, line in _lines(handle):
            if line.strip():
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as err:
                    raise MalformedLine(number, err.msg) from err


def check_file(path_str: str, override: str, text_column: Optional[str],
               fields: Optional[dict[str, str]] = None) -> list[str]:
    """Problems with one local data file; empty when it is usable. `fields`: an
    instruction format's record fields (_instruction_fields), for .json/.jsonl records."""
    path = Path(path_str).expanduser()
    if not path.exists():
        return [f"{override}: no such file '{path}'. Fix the path ({override}=/path/to/file)."]
    if path.is_dir():
        return [f"{override}: '{path}' is a directory; give a file ({override}=/path/to/file.txt)."]
    suffix, gz = split_suffix(path.name)
    if suffix not in BUILDERS:
        kinds = ", ".join(BUILDERS)
        return [f"{override}: '{path.name}' has an unsupported type '{suffix or '(none)'}'; use {kinds} (optionally .gz)."]
    if path.stat().st_size == 0:
        return [f"{override}: '{path}' is empty. Give a file with text in it."]
    try:
        if suffix == ".txt":
            return _check_text(path, gz, override)
        if suffix in (".json", ".jsonl"):
            return _check_json(path, gz, override, text_column) if fields is None else \
                _check_records(path, gz, override, fields)
        return _check_csv(path, gz, override, text_column)
    except UnicodeDecodeError as err:
        return [f"{override}: '{path}' is not UTF-8 (byte {err.start} of a chunk: {err.reason}). Re-encode it as UTF-8."]
    except (OSError, EOFError) as err:  # e.g. a truncated or fake .gz
        return [f"{override}: cannot read '{path}': {err}."]


def _check_text(path: Path, gz: bool, override: str) -> list[str]:
    """Every line decodes as UTF-8 (named by number if not), and one holds text."""
    has_text = False
    with gzip.open(path, "rb") if gz else open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            try:
                has_text = bool(line.decode("utf-8").strip()) or has_text
            except UnicodeDecodeError as err:
                return [f"{override}: {path}:{number}: not UTF-8 (byte {err.start} of that line: {err.reason}). "
                        "Re-encode it as UTF-8, or fix that line."]
    return [] if has_text else [f"{override}: '{path}' holds no text (only blank lines)."]


def default_text_column(columns: list[str], text_column: Optional[str]) -> str:
    """The column the data pipeline reads (runner.components.data.prepare.text_column_of): the named one, else
    `text` if present, else the first."""
    return text_column or ("text" if "text" in columns else columns[0])


def _check_cell(value: object, where: str, column: str, override: str) -> list[str]:
    if value is None:
        return [f"{override}: {where}: column '{column}' is null (empty). Remove that record or give it text."]
    if not isinstance(value, str):
        return [f"{override}: {where}: column '{column}' holds a {type(value).__name__}, not text. "
                "Point data.text_column at a text column, or fix that record."]
    return []


def _check_json(path: Path, gz: bool, override: str, text_column: Optional[str]) -> list[str]:
    """Every record, not only the first: a record without the column, or with a null or
    non-text value there, stops tokenization deep inside datasets."""
    column: Optional[str] = None
    try:
        for number, record in _json_records(path, gz):
            if not isinstance(record, dict):
                return [f"{override}: {path}:{number}: expected a JSON object per line, got {type(record).__name__}."]
            if column is None:
                if not record:
                    return [f"{override}: {path}:{number}: an empty record has no text column."]
                problems = _check_column(list(record), path, override, text_column)
                if problems:
                    return problems
                column = default_text_column(list(record), text_column)
            if column not in record:
                return [f"{override}: {path}:{number}: this record has no column '{column}' (it has: "
                        f"{', '.join(record)}). Every record needs it; fix that record or set data.text_column."]
            problems = _check_cell(record[column], f"{path}:{number}", column, override)
            if problems:
                return problems
    except MalformedLine as err:
        return [f"{override}: {path}:{err.line}: malformed JSON ({err.reason}). Fix or remove that line."]
    except json.JSONDecodeError as err:  # a whole-file JSON array
        return [f"{override}: {path}:{err.lineno}: malformed JSON ({err.msg})."]
    if column is None:
        return [f"{override}: '{path}' holds no records."]
    return []


def _check_csv(path: Path, gz: bool, override: str, text_column: Optional[str]) -> list[str]:
    """The header names the column; every row must fill it (datasets reads an empty cell as null)."""
    with _open_text(path, gz) as handle:
        rows = csv.reader(handle)
        header = next(rows, None)
        if not header:
            return [f"{override}: '{path}' has no header row."]
        problems = _check_column(header, path, override, text_column)
        if problems:
            return problems
        index = header.index(default_text_column(header, text_column))
        for number, row in enumerate(rows, start=2):  # row 1 is the header
            if not row:
                continue  # a blank line: the csv reader and datasets both skip it
            value = row[index] if index < len(row) and row[index] != "" else None
            problems = _check_cell(value, f"{path}:{number}", header[index], override)
            if problems:
                return problems
    return []


def _check_column(columns: list[str], path: Path, override: str, text_column: Optional[str]) -> list[str]:
    if text_column is not None and text_column not in columns:
        return [
            f"{override}: '{path}' has no column '{text_column}' (it has: {', '.join(columns)}). "
            f"Set data.text_column to one of those."
        ]
    return []


def check_data_files(data: DataSpec) -> list[str]:
    problems: list[str] = []
    fields = _instruction_fields(data)
    for override, path in (("data.train_file", data.train_file), ("data.validation_file", data.validation_file)):
        if path:
            problems += check_file(path, override, data.text_column, fields)
    return problems


def _instruction_fields(data: DataSpec) -> Optional[dict[str, str]]:
    """Instruction formats: the fields every record needs, by the setting naming each."""
    if data.format is DataFormat.prompt_completion:
        return {"data.prompt_field": data.prompt_field, "data.completion_field": data.completion_field}
    if data.format is DataFormat.chat:
        return {"data.messages_field": data.messages_field}
    if data.format is DataFormat.prompts:
        return {"data.prompt_field": data.prompt_field}
    if data.format is DataFormat.preference:
        return {"data.prompt_field": data.prompt_field, "data.chosen_field": data.chosen_field,
                "data.rejected_field": data.rejected_field}
    return None


def _check_records(path: Path, gz: bool, override: str, fields: dict[str, str]) -> list[str]:
    """An instruction file: JSON records, each with the format's fields."""
    try:
        count = 0
        for number, record in _json_records(path, gz):
            count += 1
            if not isinstance(record, dict):
                return [f"{override}: {path}:{number}: expected a JSON object per line, got {type(record).__name__}."]
            missing = [(setting, name) for setting, name in fields.items() if record.get(name) is None]
            if missing:
                setting, name = missing[0]
                return [f"{override}: {path}:{number}: this record has no '{name}' (it has: {', '.join(record)}). "
                        f"Set {setting} to the field that holds it, or fix that record."]
        return [] if count else [f"{override}: '{path}' holds no records."]
    except MalformedLine as err:
        return [f"{override}: {path}:{err.line}: malformed JSON ({err.reason}). Fix or remove that line."]
    except json.JSONDecodeError as err:
        return [f"{override}: {path}:{err.lineno}: malformed JSON ({err.msg})."]
