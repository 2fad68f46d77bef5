"""Bad data files: one clear message each, naming the file and the fix."""

import gzip

import pytest

from runner.components.data.checks import check_file
from runner.config.spec import DataSpec
from runner.config.validate import check_data_source


def problems(path, text_column=None):
    return check_file(str(path), "data.train_file", text_column)


def test_good_files_pass(tmp_path):
    (tmp_path / "a.txt").write_text("hello\n")
    (tmp_path / "b.jsonl").write_text('{"text": "hi"}\n{"text": "there"}\n')
    (tmp_path / "c.csv").write_text("text\nhi\n")
    (tmp_path / "d.json").write_text('[{"text": "hi"}]')
    for name in ("a.txt", "b.jsonl", "c.csv", "d.json"):
        assert problems(tmp_path / name, "text") == [], name


def test_missing_file(tmp_path):
    [msg] = problems(tmp_path / "nope.txt")
    assert "no such file" in msg and "data.train_file=" in msg


def test_empty_file(tmp_path):
    (tmp_path / "e.txt").write_text("")
    [msg] = problems(tmp_path / "e.txt")
    assert "is empty" in msg


def test_directory_instead_of_file(tmp_path):
    [msg] = problems(tmp_path)
    assert "is a directory" in msg


def test_malformed_json_line_names_the_line(tmp_path):
    (tmp_path / "m.jsonl").write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": broken}\n')
    [msg] = problems(tmp_path / "m.jsonl")
    assert f"{tmp_path / 'm.jsonl'}:3:" in msg and "malformed JSON" in msg


def test_malformed_json_line_in_gzip(tmp_path):
    (tmp_path / "m.jsonl.gz").write_bytes(gzip.compress(b'{"text": "ok"}\n{oops\n'))
    [msg] = problems(tmp_path / "m.jsonl.gz")
    assert "m.jsonl.gz:2:" in msg


def test_missing_text_column(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"body": "hi"}\n')
    [msg] = problems(tmp_path / "c.jsonl", "text")
    assert "no column 'text'" in msg and "body" in msg and "data.text_column" in msg
    (tmp_path / "c.csv").write_text("body,id\nhi,1\n")
    [msg] = problems(tmp_path / "c.csv", "text")
    assert "no column 'text'" in msg


def test_non_utf8(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"caf\xe9\n")
    [msg] = problems(tmp_path / "b.txt")
    assert "not UTF-8" in msg


def test_unsupported_type(tmp_path):
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    [msg] = problems(tmp_path / "x.parquet")
    assert "unsupported type" in msg


def test_not_really_gzip(tmp_path):
    (tmp_path / "x.txt.gz").write_text("plain text\n")
    [msg] = problems(tmp_path / "x.txt.gz")
    assert "cannot read" in msg


def test_data_source_rules(tmp_path):
    assert "not both" in check_data_source(DataSpec(dataset_name="x", train_file="y") and _spec(dataset_name="x", train_file="y"))[0]
    assert "no training data" in check_data_source(_spec())[0]
    (tmp_path / "a.txt").write_text("hi\n")
    bad_split = check_data_source(_spec(train_file=str(tmp_path / "a.txt"), validation_split_percentage=0))
    assert "validation_split_percentage=0" in bad_split[0]


def _spec(**data):
    from runner.config.spec import RunSpec

    spec = RunSpec()
    spec.data = DataSpec(**data)
    return spec


@pytest.mark.parametrize(
    "lines, text_column, expected",
    [
        # the default column (text_column=null) is checked like a named one, in every record
        (['{"text": "a"}', '{"text": "b"}', '{"body": "c"}'], None, ":3: this record has no column 'text'"),
        (['{"text": "a"}', '{"text": null}'], None, ":2: column 'text' is null"),
        (['{"text": "a"}', '{"text": 7}'], None, ":2: column 'text' holds a int, not text"),
        (['{"body": "a"}', '{"body": ["x"]}'], None, ":2: column 'body' holds a list"),  # no `text`: the first column
        (['{"a": "x", "b": "y"}', '{"a": "x"}'], "b", ":2: this record has no column 'b'"),
    ],
)
def test_every_json_record_has_text_in_the_column(tmp_path, lines, text_column, expected):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    [msg] = check_file(str(path), "data.train_file", text_column)
    assert expected in msg and str(path) in msg


def test_every_csv_row_fills_the_column(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("id,text\n1,hello\n2,\n")
    [msg] = check_file(str(path), "data.train_file", None)
    assert f"{path}:3: column 'text' is null" in msg
    path.write_text("id,text\n1,hello\n2\n")  # a short row
    [msg] = check_file(str(path), "data.train_file", None)
    assert f"{path}:3:" in msg
    path.write_text("id,text\n1,hello\n\n2,world\n")
    assert check_file(str(path), "data.train_file", None) == []
