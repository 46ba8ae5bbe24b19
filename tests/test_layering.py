"""The package's import layering (docs/architecture.md, "Layering"): no module imports a layer above it.

Every ``import`` in embedpipe/**/*.py is read with ast, at module level and inside functions alike
(a lazy import is still a dependency), and each module is mapped to its layer; an import of a higher
layer fails the test naming the file and line. Within one package imports are free.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "embedpipe"

# Bottom first. A module takes the layer of the longest prefix listed here.
LAYERS: list[tuple[str, ...]] = [
    ("embedpipe.config", "embedpipe.errors", "embedpipe.ranges", "embedpipe.report.counters",
     "embedpipe.report.memory", "embedpipe.sources"),  # leaves: the schema, errors, ranges laid end to end, counters, a
    # process's own peak memory, the digest of embedpipe's own sources
    ("embedpipe.io.fs", "embedpipe.io.store"),  # local and fsspec file access; the output tree's store
    ("embedpipe.units",),  # work units
    ("embedpipe.io",),  # readers, writers, manifest, quantization, ownership
    ("embedpipe.versions",),  # versioned outputs
    ("embedpipe.text",),  # tokenizer, packer
    ("embedpipe.kernels",),  # attention backends
    ("embedpipe.models",),  # model families, sentence-transformers layout, offline resolution
    ("embedpipe.runtime",),  # the encoder replica
    ("embedpipe.report",),  # FLOPs, device, cost, metrics, rendering
    ("embedpipe.index",),  # FAISS plan, build, search (hands shard tasks to a runner it is given)
    ("embedpipe.preflight",),  # checks across the job, the input and the model; the RunPlan
    ("embedpipe.cluster",),  # Ray: connect, scheduler, workers, calibration, the driver
    ("embedpipe.api",),  # embed(), Job
    ("embedpipe.cli",),  # the command line
    ("embedpipe",),  # the package's lazy names
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, the prefix that placed it) for an embedpipe module."""
    best = max(((i, prefix) for i, group in enumerate(LAYERS) for prefix in group
                if module == prefix or module.startswith(prefix + ".")), key=lambda x: len(x[1]), default=None)
    assert best is not None, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return best


def is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (PACKAGE.parent / rel).with_suffix(".py").is_file() or (PACKAGE.parent / rel / "__init__.py").is_file()


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every embedpipe module ``path`` imports, anywhere in the file."""
    me = module_name(path)
    package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            for alias in node.names:  # `from embedpipe import versions` imports embedpipe.versions
                found.append((node.lineno, f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base))
    return [(line, name) for line, name in dict.fromkeys(found) if name == "embedpipe" or name.startswith("embedpipe.")]


def upward_imports() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = module_name(path)
        mine, my_prefix = layer_of(me)
        for line, name in imported_modules(path):
            theirs, their_prefix = layer_of(name)
            if theirs > mine and name.split(".")[:2] != me.split(".")[:2]:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {me} ({my_prefix}) imports {name} "
                           f"({their_prefix}), a layer above it")
    return bad


def test_no_module_imports_a_layer_above_it():
    bad = upward_imports()
    assert not bad, "upward imports (docs/architecture.md, Layering):\n" + "\n".join(bad)


def test_config_is_a_leaf():
    """The schema imports no other embedpipe module but errors.py (its JobError is a BadJob), itself a leaf."""
    for name, allowed in (("config.py", {"embedpipe.errors"}), ("errors.py", set())):
        path = PACKAGE / name
        found = [(line, module) for line, module in imported_modules(path) if module not in allowed]
        assert found == [], f"{path}: a leaf imports no other embedpipe module"


def test_index_and_cluster_do_not_import_each_other_both_ways():
    def imports(package: str, other: str) -> list[str]:
        return [f"{p.relative_to(PACKAGE.parent)}:{line}" for p in sorted((PACKAGE / package).rglob("*.py"))
                for line, name in imported_modules(p) if name.startswith(f"embedpipe.{other}")]

    index_to_cluster, cluster_to_index = imports("index", "cluster"), imports("cluster", "index")
    assert not (index_to_cluster and cluster_to_index), (
        f"index imports cluster ({', '.join(index_to_cluster)}) and cluster imports index "
        f"({', '.join(cluster_to_index)}): a package cycle")
    assert not index_to_cluster, f"the index build is handed a shard runner; it imports cluster at {index_to_cluster}"


def test_the_walk_sees_function_level_imports():
    """The checker itself: cli.py imports the driver inside a command, and that import is found."""
    names = {name for _, name in imported_modules(PACKAGE / "cli.py")}
    assert "embedpipe.cluster.driver" in names and "embedpipe.preflight" in names
    assert layer_of("embedpipe.index.build")[0] < layer_of("embedpipe.cluster.connect")[0]
    assert layer_of("embedpipe.io.fs")[0] < layer_of("embedpipe.units")[0] < layer_of("embedpipe.io.formats")[0]
