"""The example notebook executes end to end (fine-tune, evaluate, save, reload), so it never rots."""
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "notebook.ipynb"


def test_notebook_executes(monkeypatch):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    root = str(NOTEBOOK.parents[1])
    monkeypatch.setenv("PYTHONPATH", root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": root}})
    client.execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "held-out loss:" in outputs and "max logit difference" in outputs
