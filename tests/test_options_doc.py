"""docs/options.md is what the settings table renders."""
from hf_slideformer.config import SETTINGS
from hf_slideformer.options_doc import DOC_PATH, main, render


def test_docs_options_md_is_current():
    assert DOC_PATH.read_text(encoding="utf-8") == render(), \
        "docs/options.md is stale: run python -m hf_slideformer.options_doc"


def test_every_setting_has_a_row_and_check_reports_staleness(tmp_path):
    text = render()
    for name in SETTINGS:
        assert f"| `{name}` |" in text
    stale = tmp_path / "options.md"
    stale.write_text(text.replace("GPU layer slots", "slots"))
    assert main(["--check", "--path", str(stale)]) == 1
    assert main(["--path", str(stale)]) == 0 and main(["--check", "--path", str(stale)]) == 0
