"""docs/configuration.md is generated from the schema and kept up to date."""

from pathlib import Path

from runner.config.reference import field_docs, render, rows
from runner.config.spec import OptimSpec

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_configuration_page_is_what_the_schema_generates():
    assert PAGE.read_text() == render(), (
        "docs/configuration.md is out of date: python -m runner.config.reference > docs/configuration.md")


def test_every_field_is_documented_where_it_is_defined():
    undocumented = [key for _, fields in rows() for key, _, _, text in fields if not text]
    assert undocumented == []


def test_field_docs_reads_the_string_under_each_field():
    docs = field_docs(OptimSpec)
    assert docs["max_grad_norm"].startswith("Clip the global gradient norm")
    assert "eps" in docs and "lr" in docs
