"""The notebooks execute end to end (on small settings), so they never rot.

Each notebook asserts its own claims on real numbers from SmolLM2-135M (the
acceptance law equals p; the empirical law is within sampling noise of p for
a good and a bad drafter; greedy speculative output equals AR; verify cost
grows relative to a step with the batch size).
"""

import glob
import os

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), os.pardir, "notebooks",
                                          "*.ipynb")))


def test_there_are_notebooks():
  assert len(NOTEBOOKS) >= 4, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[os.path.basename(p) for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch, tmp_path):
  monkeypatch.setenv("SPECJAX_NOTEBOOK_QUICK", "1")
  nb = nbformat.read(path, as_version=4)
  NotebookClient(nb, timeout=900, kernel_name="python3",
                 resources={"metadata": {"path": str(tmp_path)}}).execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors, errors
