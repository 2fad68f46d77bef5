"""The end-of-run summary table."""

from pathlib import Path

from runner.metrics import summary_table


def test_summary_shows_mfu_as_a_percentage_and_skips_what_is_missing():
    table = summary_table({"train_loss": 6.8, "train_mfu": 0.2358, "peak_memory_mb": 2282.0, "eval_loss": None}, Path("/run"))
    lines = table.splitlines()
    assert any(line.split() == ["MFU", "23.58%"] for line in lines)
    assert any(line.split() == ["peak", "memory", "(MB/rank)", "2,282"] for line in lines)
    assert "eval loss" not in table and "outputs in /run" in table
