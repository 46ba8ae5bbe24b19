"""examples/notebook.ipynb runs top to bottom on a kernel from this environment (the project's venv)."""

import json
import shutil
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")

    # The notebook's folder layout, in a temp dir: examples/notebook.ipynb, examples/data/, out/.
    examples = tmp_path / "examples"
    (examples / "data").mkdir(parents=True)
    shutil.copy(ROOT / "examples" / "data" / "quickstart.parquet", examples / "data")
    nb = nbformat.read(ROOT / "examples" / "notebook.ipynb", as_version=4)
    [params] = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    params.source += "\nROWS, WORKERS = 300, 1   # injected by the test: a small corpus, one worker"

    # A kernel spec pointing at this interpreter, so the kernel is the venv's whatever else is installed.
    kernels = tmp_path / "jupyter" / "kernels" / "embedpipe-test"
    kernels.mkdir(parents=True)
    (kernels / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "embedpipe test", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")

    client = nbclient.NotebookClient(nb, kernel_name="embedpipe-test", timeout=300,
                                     resources={"metadata": {"path": str(examples)}})
    client.execute()

    def output_of(marker: str) -> str:
        [cell] = [c for c in nb.cells if c.cell_type == "code" and marker in c.source]
        return "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in cell.outputs)

    assert output_of("q = embedpipe.embed(queries") .startswith("((3, 384)")
    assert "'rows': 300" in output_of("result = job.run(")
    assert output_of("matrix.shape") == "(300, 384)"
    assert float(output_of("one engine")) < 1e-4  # the job's vectors are embed()'s
    assert output_of("np.argsort").count("\n  0.") >= 9  # three hits for each of three queries
    assert "'factory'" in output_of("embedpipe.open_index(") and output_of("agrees with the brute-force") == "True"
    assert "units embedded again: 0 of" in output_of("embedpipe.open_index(")  # the index joins the first output
    assert not (tmp_path / "out" / "notebook-index").exists()
    [plot] = [c for c in nb.cells if c.cell_type == "code" and "report.png" in c.source]
    assert any("image/png" in o.get("data", {}) for o in plot.outputs)  # the report plot is shown
    assert (tmp_path / "out" / "notebook" / "report.json").is_file()
