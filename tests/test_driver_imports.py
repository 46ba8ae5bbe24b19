"""The driver never imports torch (~2 s of `embedpipe run`'s start-up, before Ray's): preflight reads a model's
facts through the torch-free family configs (embedpipe/models/families.py), the report its FLOPs, and a machine
without a GPU driver's device files is known to have no GPU without asking torch. Each check runs in a fresh
interpreter where importing torch raises."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedpipe.cluster.connect import GPU_DEVICE_FILES
from embedpipe.models.families import FAMILIES
from embedpipe.models.registry import MODEL_REGISTRY, load_families, register
from tests.conftest import ROOT

# a fresh interpreter where importing torch raises, and every attempt is counted (code that catches the
# ImportError still shows up): the script's last line must say no attempt was made
NO_TORCH = textwrap.dedent("""
    import atexit, sys
    ATTEMPTS = []
    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "torch":
                ATTEMPTS.append(name)
                raise ImportError(f"{name} imported on the driver")
    sys.meta_path.insert(0, NoTorch())
    atexit.register(lambda: print("torch imports:", len(ATTEMPTS), ATTEMPTS[:3]))
""")
# every import of pandas asked for in the interpreter, counted (allowed): pyarrow imports it for its own conversions
COUNT_PANDAS = textwrap.dedent("""
    import sys
    PANDAS = []
    class CountPandas:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "pandas":
                PANDAS.append(name)
    sys.meta_path.insert(0, CountPandas())
""")
TINY = {"vocab_size": 100, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 32}
CONFIGS = {  # model_type -> (config.json, the pooling a directory without a Pooling module gets)
    "qwen3": ({**TINY, "model_type": "qwen3", "num_key_value_heads": 1, "head_dim": 8}, "last"),
    "bidirectional_pplx_qwen3": ({**TINY, "model_type": "bidirectional_pplx_qwen3", "head_dim": 8}, "mean"),
    "modernbert": ({**TINY, "model_type": "modernbert", "classifier_pooling": "mean"}, "mean"),
    "bert": ({**TINY, "model_type": "bert", "max_position_embeddings": 64}, "mean"),
}
no_gpu_driver = pytest.mark.skipif(any(Path(p).exists() for p in GPU_DEVICE_FILES),
                                   reason="this machine has a GPU driver: the driver asks torch about it")


def _run(code: str, *, timeout: float = 300) -> str:
    done = subprocess.run([sys.executable, "-c", NO_TORCH + textwrap.dedent(code)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "torch imports: 0 []", done.stdout[-2000:]
    return done.stdout


def _model_dir(path: Path, config: dict, *, tokenizer: Path) -> Path:
    """A directory preflight accepts: config.json, tokenizer.json and a safetensors file (its weights unread)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    shutil.copy(tokenizer, path / "tokenizer.json")
    (path / "model.safetensors").write_bytes(b"")
    return path


def test_every_family_registers_its_config():
    load_families()
    assert sorted(MODEL_REGISTRY) == sorted(FAMILIES)
    for model_type, family in FAMILIES.items():
        assert MODEL_REGISTRY[model_type].config_class is family.config_class, model_type
        assert MODEL_REGISTRY[model_type].__module__ == f"embedpipe.models.{family.module}"


def test_register_refuses_a_model_type_families_does_not_list():
    cls = type("Other", (), {"config_class": FAMILIES["bert"].config_class})
    with pytest.raises(ValueError, match="add it to embedpipe/models/families.py"):
        register("not-a-family")(cls)
    with pytest.raises(ValueError, match="add it to embedpipe/models/families.py"):  # listed with another config
        register("modernbert")(type("Other", (), {"config_class": FAMILIES["qwen3"].config_class}))
    load_families()
    with pytest.raises(ValueError, match="already registered"):  # listed, same config, but taken
        register("bert")(type("Other", (), {"config_class": FAMILIES["bert"].config_class}))
    assert "not-a-family" not in MODEL_REGISTRY and MODEL_REGISTRY["bert"].__name__ == "BertModel"


@no_gpu_driver
def test_preflight_reads_every_family_without_torch(tmp_path, minilm_dir):
    pq.write_table(pa.table({"id": ["a", "b"], "text": ["one", "two"]}), tmp_path / "in.parquet")
    dirs = {name: str(_model_dir(tmp_path / name, config, tokenizer=minilm_dir / "tokenizer.json"))
            for name, (config, _) in CONFIGS.items()}
    dirs["minilm"] = str(minilm_dir)
    out = _run(f"""
        import json
        from embedpipe.cluster.driver import settle_dtype
        from embedpipe.cluster.connect import expected_workers
        from embedpipe.config import parse_job
        from embedpipe.preflight import preflight
        found = {{}}
        for name, path in {dirs!r}.items():
            job = settle_dtype(parse_job({{"input": {{"path": {str(tmp_path / "in.parquet")!r}}},
                                           "model": {{"path": path}}, "output": {{"path": {str(tmp_path / "out")!r}}}}}))
            plan = preflight(job, workers=expected_workers(job.cluster).workers)
            found[name] = [plan.model.pooling, plan.model.max_seq_len, job.model.dtype,
                           plan.model.flops_per_token(8) > 0]
        print(json.dumps(found))
    """)
    found = json.loads(out.strip().splitlines()[-2])
    for name, (config, pooling) in CONFIGS.items():
        assert found[name][0] == pooling, name
        assert found[name][2] == "float32" and found[name][3], name  # dtype auto on a CPU machine; FLOPs counted
    assert found["bert"][1] == 64 and found["minilm"][:3] == ["mean", 256, "float32"]


@no_gpu_driver
@pytest.mark.slow
def test_a_run_never_imports_torch_on_the_driver(tmp_path, quickstart_table):
    """The whole driver side of `embedpipe run` (preflight, an embedded Ray, the model shipped, the report) with
    torch unimportable there; the workers, their own processes, encode as always. Nor does the driver import
    pandas: pyarrow imports it for some of its conversions (its id scan's null mask did, 0.2 s before Ray's start),
    and nothing on the driver needs it."""
    pq.write_table(quickstart_table.slice(0, 16), tmp_path / "in.parquet")
    job = {"input": {"path": str(tmp_path / "in.parquet"), "text_column": "text", "id_column": "id"},
           "model": {"path": "sentence-transformers/all-MiniLM-L6-v2"},
           "output": {"path": str(tmp_path / "out")}, "cluster": {"workers": 1}}
    (tmp_path / "job.yaml").write_text(json.dumps(job))
    out = _run(COUNT_PANDAS + textwrap.dedent(f"""
        from embedpipe.cluster.driver import run_job
        from embedpipe.config import load_job
        result = run_job(load_job({str(tmp_path / "job.yaml")!r}), progress=False)
        print(result.report["rows"], result.report["workers"], "pandas imports:", len(PANDAS), PANDAS[:3])
    """))
    assert out.strip().splitlines()[-2].split() == ["16", "1", "pandas", "imports:", "0", "[]"]
    assert len(pq.read_table(tmp_path / "out" / "vectors").column("embedding")) == 16


def test_a_workers_units_never_import_pandas(tmp_path, quickstart_table):
    """An embedding worker's units (read, screen, tokenize, encode, write the part, record it), in a fresh
    interpreter: pyarrow imports pandas for its own conversions (``to_numpy``, ``pa.array``, ``pa.table``), about
    0.2 s of CPU per worker, at its first unit's read, inside the run's start-up; nothing in a unit needs it."""
    pq.write_table(quickstart_table.slice(0, 200), tmp_path / "in.parquet", row_group_size=100)
    job = {"input": {"path": str(tmp_path / "in.parquet"), "text_column": "text", "id_column": "id"},
           "model": {"path": "sentence-transformers/all-MiniLM-L6-v2", "dtype": "float32"},
           "output": {"path": str(tmp_path / "out")}}
    (tmp_path / "job.yaml").write_text(json.dumps(job))
    (tmp_path / "out").mkdir()
    code = COUNT_PANDAS + textwrap.dedent(f"""
        from embedpipe.cluster.worker import EmbedWorker, WorkerSetup
        from embedpipe.config import load_job
        from embedpipe.units import Unit
        worker = EmbedWorker(load_job({str(tmp_path / "job.yaml")!r}), model=None, index=0, threads=1)
        worker.configure(WorkerSetup(output_path={str(tmp_path / "out")!r}))
        units = [Unit(id=f"00000-{{g:05d}}", file={str(tmp_path / "in.parquet")!r}, row_groups=(g,), num_rows=100)
                 for g in (0, 1)]
        worker.process(units[0], ahead=units[1])
        worker.process(units[1])
        print("pandas imports:", len(PANDAS), PANDAS[:3])
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "pandas imports: 0 []", done.stdout[-2000:]
    assert pq.read_table(tmp_path / "out" / "vectors").num_rows == 200
