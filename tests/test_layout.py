"""OutputLayout owns every path of an output tree: no other module spells one, and its paths are
the tree a real run writes."""

from __future__ import annotations

import ast
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import embedpipe
from embedpipe.cli import app
from embedpipe.io.layout import OutputLayout, atomic_path, atomic_write_bytes, atomic_write_table
from tests.conftest import write_job
from tests.model_helpers import save_tiny_text_model

PACKAGE = Path(embedpipe.__file__).parent
LAYOUT = PACKAGE / "io" / "layout.py"
# The path names of an output tree: only embedpipe/io/layout.py may join them into a path.
TREE_NAMES = {"vectors", "_manifest", "index", "versions", "CURRENT", "VALIDATED", "runs", "report.json",
              "report.md", "report.png", "skipped.parquet", "quantization.json", "job.json", "ids.parquet",
              "index.json", ".embedpipe-output", ".embedpipe.lock", "units", "skipped", "index.faiss",
              "holdout.parquet", "index.ivfdata", "_build", "embedpipe.json"}
PATH_CALLS = {"Path", "join", "with_name", "joinpath", "glob"}


def _tree_string(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value in TREE_NAMES or node.value.startswith("part-")
    if isinstance(node, ast.JoinedStr) and node.values:  # f"part-{unit}.parquet"
        first = node.values[0]
        return isinstance(first, ast.Constant) and str(first.value).startswith("part-")
    return False


def _spelled_paths(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        operands: list[ast.AST] = []
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            operands = [node.left, node.right]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in PATH_CALLS:
                operands = list(node.args)
        found += [f"{path.relative_to(PACKAGE.parent)}:{op.lineno}: {ast.unparse(op)}"
                  for op in operands if _tree_string(op)]
    return found


def test_only_the_layout_spells_output_paths():
    spelled = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != LAYOUT for hit in _spelled_paths(path)]
    assert not spelled, "output paths spelled outside embedpipe/io/layout.py (use OutputLayout):\n" + "\n".join(spelled)


def test_atomic_path_renames_on_success_and_removes_the_temporary_on_failure(tmp_path):
    target = tmp_path / "a" / "x.bin"
    atomic_write_bytes(target, b"one")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("killed")
    assert target.read_bytes() == b"one" and sorted(p.name for p in target.parent.iterdir()) == ["x.bin"]
    import pyarrow as pa

    atomic_write_table(pa.table({"id": [1, 2]}), tmp_path / "t.parquet")
    assert pq.read_table(tmp_path / "t.parquet")["id"].to_pylist() == [1, 2]


def _expected(root: OutputLayout, *, units: list[str], version_id: str, run_id: str) -> set[Path]:
    """Every file a finished versioned run with a Flat index writes, as the layout names them."""
    version = root.version(version_id)
    index = version.index
    run = version.run(run_id)
    return {root.marker, root.current, root.description, version.description, version.marker, version.validated,
            version.job, version.report_json,
            version.report_md, version.report_png, run.report_json, run.report_md, run.report_png,
            index.faiss, index.ids, index.holdout, index.meta,
            *(version.unit_record(u) for u in units), *(version.part(u) for u in units)}


@pytest.mark.slow
def test_the_layout_is_the_tree_a_run_writes(tmp_path, quickstart_table, ray_session):
    corpus = tmp_path / "corpus.parquet"
    pq.write_table(quickstart_table.slice(0, 80).select(["id", "text"]), corpus, row_group_size=40)
    model = save_tiny_text_model(tmp_path / "model", seed=0)
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.yaml", input={"path": str(corpus), "unit_rows": 40}, model={"path": str(model)},
                    batching={"max_tokens": 2048}, cluster={"workers": 1, "cpus_per_worker": 1},
                    output={"path": str(out), "versioned": True, "format": "both", "index": "Flat"})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    root = OutputLayout(out)
    version_id = root.current.read_text().strip()
    units = sorted(p.stem for p in root.version(version_id).units.glob("*.json"))
    assert len(units) == 2
    (run_id,) = [p.name for p in root.version(version_id).runs.iterdir()]
    assert run_id == version_id  # a new version is named by its run's start second, as the run is
    written = {p for p in out.rglob("*") if p.is_file()}
    assert written == _expected(root, units=units, version_id=version_id, run_id=run_id)
