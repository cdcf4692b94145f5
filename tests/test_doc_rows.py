"""benchmarks/doc_rows.py: docs/benchmarks.md's current results against a suite call's SCENARIO.json."""
import json

from benchmarks import doc_rows

PAGE = """# Benchmarks

## Current results

| run | commit | tokens/s | step s | GPU alloc / reserved GiB | host RSS GiB | command |
|---|---|---|---|---|---|---|
| batch 16, 24 GiB | abc1234 | **22,338** | 1.467 | 20.9 / 21.6 | 35.2 | `suite quick --only 3b_b16_cap24` |
| batch 8, 24 GiB | abc1234 | 17,758 | 0.923 | - | - | `suite quick --only 3b_b8_cap24` |
| by hand | abc1234 | 1,000 | 1.0 | - | - | `bench_train.py --model tiny` |

## Kernels

| run | tokens/s | command |
|---|---|---|
| not a result row | 5 | `suite quick --only 3b_b8_cap24` |
"""


def suite_file(tmp_path, tokens_per_s, provider="slide", tree="new"):
    row = {"provider": provider, "status": "ok", "tokens_per_s": tokens_per_s, "step_s": 16 * 2048 / tokens_per_s,
           "gpu_peak_allocated_gib": 20.0, "gpu_peak_reserved_gib": 21.0, "host_rss_peak_gib": 35.0}
    doc = {"scenario": "quick", "commit": "0123456789abcdef",
           "steps": [{"name": "3b_b16_cap24", "tree": tree, "rows": [row]},
                     {"name": "gpu_tests", "tree": "new", "status": "ok"}]}
    path = tmp_path / "quick.json"
    path.write_text(json.dumps(doc))
    return path


def test_the_rows_of_the_current_results_are_found_by_their_command():
    rows = doc_rows.doc_rows(PAGE)
    assert sorted(rows) == [("quick", "3b_b16_cap24"), ("quick", "3b_b8_cap24")]
    assert rows[("quick", "3b_b16_cap24")][1]["tokens/s"] == 2


def test_a_row_within_the_tolerance_passes_and_one_beyond_is_stale(tmp_path, capsys):
    page = tmp_path / "benchmarks.md"
    page.write_text(PAGE)
    assert doc_rows.main([str(suite_file(tmp_path, 22_500)), "--doc", str(page)]) == 0
    assert "ok     suite quick --only 3b_b16_cap24: documented 22,338, measured 22,500" in capsys.readouterr().out
    assert doc_rows.main([str(suite_file(tmp_path, 21_000)), "--doc", str(page)]) == 1
    assert "STALE" in capsys.readouterr().out
    assert page.read_text() == PAGE


def test_write_puts_the_measured_figures_in_the_row(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text(PAGE)
    assert doc_rows.main([str(suite_file(tmp_path, 21_000)), "--doc", str(page), "--write"]) == 0
    assert ("| batch 16, 24 GiB | 0123456 | **21,000** | 1.560 | 20.0 / 21.0 | 35.0 | "
            "`suite quick --only 3b_b16_cap24` |") in page.read_text()
    assert page.read_text().replace("| batch 16, 24 GiB | 0123456 | **21,000** | 1.560 | 20.0 / 21.0 | 35.0 |",
                                    "| batch 16, 24 GiB | abc1234 | **22,338** | 1.467 | 20.9 / 21.6 | 35.2 |") == PAGE


def test_an_older_tree_or_a_baseline_is_not_the_row(tmp_path, capsys):
    page = tmp_path / "benchmarks.md"
    page.write_text(PAGE)
    for kw in ({"tree": "old"}, {"provider": "ds3"}):
        assert doc_rows.main([str(suite_file(tmp_path, 1.0, **kw)), "--doc", str(page)]) == 0
        assert "no documented row" in capsys.readouterr().out


def test_the_documented_rows_exist():
    rows = doc_rows.doc_rows(doc_rows.DOC.read_text(encoding="utf-8"))
    assert {("quick", "3b_b16_cap24"), ("full", "8b_b16_cap24"), ("small-gpu", "8b_b16_cap12")} <= set(rows)
