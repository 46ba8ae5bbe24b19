"""What embedpipe may touch: only output folders it created, and inside them only what it wrote.

An output folder carries a marker, ``<output.path>/.embedpipe-output`` (JSON: what made it, when,
and whether it is a versioned root or one run's output). A run writes into a folder only when it
is new, empty, or marked (an output of an earlier embedpipe without the marker is recognised by
its ``_manifest/job.json``, or by ``CURRENT`` beside a version folder of its own, and marked then). A
non-empty folder without it is refused before anything is written there, the lock file included.

Inside a marked folder, cleanup and ``--overwrite`` remove only the names embedpipe writes
(``OWNED``), never a symbolic link's target: an output whose own folders (``vectors/``,
``_manifest/``, ...) are links is refused, since cleaning it would reach outside the output.
``/``, the home folder and its parents are never an output.

An output at a URL (an object store) follows the same rules through its store: a prefix holding objects
without the marker or a manifest is refused as a foreign folder is; the checks of links, ``/`` and the
home folder are local ones.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

from embedpipe.errors import BadJob, OutputRefused
from embedpipe.io.layout import (CLEANED_DIRS, LOCK, MANIFEST, MARKER, OWNED, TEMPORARY, VERSIONED_OWNED, VERSIONS,
                                  OutputLayout, atomic_write_bytes)
from embedpipe.io.store import TreePath, tree_path

__all__ = ["CLEANED_DIRS", "MANIFEST", "MARKER", "OWNED", "TEMPORARY", "VERSIONED_OWNED"]  # the layout's names


class ManifestMismatch(BadJob, RuntimeError):
    """The output path holds another job's output."""


class OutputNotOwned(OutputRefused, ManifestMismatch):
    """output.path is a folder embedpipe did not create (or reaches outside itself): nothing is touched."""


def check_output(root: str | Path) -> None:
    """Refuse an output path embedpipe must not write into; reads only, writes nothing."""
    root = tree_path(root)
    store = OutputLayout(root).store
    if store.local:
        if not _check_local(Path(root)):
            return
    elif store.exists(root):
        raise OutputNotOwned(f"output.path {root} is an object, not a prefix: choose a new output.path")
    if _marked(root) or _legacy_output(root):
        return
    foreign = [name for name in store.names(root) if not name.startswith(LOCK)]  # the lock's own files
    if not foreign:
        return
    shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
    raise OutputNotOwned(
        f"{root} is not empty and was not created by embedpipe (found: {shown}; without a manifest or the {MARKER} "
        f"marker): embedpipe writes only into new or empty folders and its own outputs, and never deletes what it "
        f"did not write; choose a new or empty output.path")


def _check_local(root: Path) -> bool:
    """The local-only checks (``/``, home, not a folder, linked folders); False when the folder does not exist."""
    _refuse_special(root)
    if not root.exists():
        return False
    if not root.is_dir():
        raise OutputNotOwned(f"output.path {root} exists and is not a folder: choose a new output.path")
    for name in CLEANED_DIRS:
        path = OutputLayout(root).entry(name)
        if path.is_symlink():
            raise OutputNotOwned(
                f"{path} is a symbolic link (to {os.readlink(path)}): embedpipe writes and cleans only inside its "
                f"output folder; replace the link with a real folder, or point output.path elsewhere")
    return True


def claim_output(root: str | Path, *, kind: str) -> None:
    """Check the folder, create it if needed, and mark it as an embedpipe output (``kind``: run|versioned)."""
    root = tree_path(root)
    check_output(root)
    OutputLayout(root).store.mkdir(root)
    if _marked(root):
        return
    marker = {"embedpipe": _version(), "kind": kind, "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    atomic_write_bytes(OutputLayout(root).marker, json.dumps(marker, indent=1).encode())


def is_output(folder: TreePath) -> bool:
    """Whether ``folder`` is an embedpipe output (marked, or an earlier embedpipe's with a manifest or VALIDATED)."""
    layout = OutputLayout(folder)
    return _marked(folder) or layout.store.exists(layout.job) or layout.store.exists(layout.validated)


def remove_owned(root: TreePath, names: tuple[str, ...]) -> None:
    """Remove these top-level entries of a marked output: a link itself, never what it points to."""
    layout = OutputLayout(root)
    for name in names:
        layout.store.remove_tree(layout.entry(name))


def sweep_temporaries(root: TreePath) -> list:
    """Remove embedpipe's leftover temporary files (a killed write's ``.tmp``) from an output's folders."""
    layout = OutputLayout(root)
    store = layout.store
    doomed = []
    for folder in (layout.root, *(layout.entry(name) for name in CLEANED_DIRS if name != VERSIONS)):
        if store.local and Path(folder).is_symlink():
            continue
        doomed += [folder / name for name in store.list(folder) if TEMPORARY.match(name)]
    store.remove_many(doomed)
    return doomed


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("embedpipe")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def _marked(root: TreePath) -> bool:
    layout = OutputLayout(root)
    return layout.store.exists(layout.marker)  # a plain file: never a link


def _legacy_output(root: TreePath) -> bool:
    """An output written by embedpipe before the marker existed: its manifest, or a version folder of its own."""
    layout = OutputLayout(root)
    if layout.store.exists(layout.job):
        return True
    return layout.store.exists(layout.current) and any(
        is_output(layout.versions / name) for name in layout.store.names(layout.versions))


def _refuse_special(root: Path) -> None:
    resolved = root.expanduser().resolve()
    home = Path.home().resolve()
    if resolved == Path(resolved.anchor) or resolved == home or resolved in home.parents:
        raise OutputNotOwned(f"output.path {root} is {'the home folder' if resolved == home else 'a system folder'}: "
                             f"embedpipe never writes there; choose a folder of its own, e.g. {home / 'embedpipe-out'}")
