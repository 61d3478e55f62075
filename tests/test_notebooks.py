"""The Colab notebooks run end to end (small parameters, on this CPU): a notebook that no
longer runs fails the suite."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

from procs import REPO

NOTEBOOKS = {
    "tpu_keras_fit.ipynb": "STEPS = 20\nSTEPS_PER_CALL = 10\nBATCH = 32\nSAMPLE = 20",
    "loop_compression_pipeline.ipynb": "STEPS = 10\nMICRO_BATCHES = 4",
}


def run(name: str, parameters: str, workdir) -> nbformat.NotebookNode:
    """Executes the notebook with `parameters` injected after its "parameters" cell."""
    book = nbformat.read(REPO / "colab" / name, as_version=4)
    at = next(i for i, c in enumerate(book.cells) if "parameters" in c.metadata.get("tags", []))
    book.cells.insert(at + 1, nbformat.v4.new_code_cell(parameters))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    NotebookClient(book, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(workdir)}}).execute()
    return book


def text(book) -> str:
    return "\n".join(out.get("text", "") for cell in book.cells if cell.cell_type == "code"
                     for out in cell.get("outputs", []))


@pytest.mark.parametrize("name", list(NOTEBOOKS))
def test_notebook_runs_end_to_end(name, tmp_path):
    book = run(name, NOTEBOOKS[name], tmp_path)
    out = text(book)
    if name == "tpu_keras_fit.ipynb":
        assert "strategy 'auto' chose" in out and "No TPU here: this run uses" in out
        assert "validation loss" in out and "training loss:" in out
    else:
        for compressor in ("none", "fp16", "int8", "topk", "powersgd", "sign"):
            assert f"{compressor:>9}:" in out
        assert "measured bubble" in out
        assert (tmp_path / "pipeline.gif").stat().st_size > 1000
