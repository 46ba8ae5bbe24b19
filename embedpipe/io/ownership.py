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
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path

from embedpipe.errors import BadJob, OutputRefused
from embedpipe.io.layout import (CLEANED_DIRS, LOCK, MANIFEST, MARKER, OWNED, TEMPORARY, VERSIONED_OWNED, VERSIONS,
                                  OutputLayout, atomic_write_bytes)

__all__ = ["CLEANED_DIRS", "MANIFEST", "MARKER", "OWNED", "TEMPORARY", "VERSIONED_OWNED"]  # the layout's names


class ManifestMismatch(BadJob, RuntimeError):
    """The output path holds another job's output."""


class OutputNotOwned(OutputRefused, ManifestMismatch):
    """output.path is a folder embedpipe did not create (or reaches outside itself): nothing is touched."""


def check_output(root: str | Path) -> None:
    """Refuse an output path embedpipe must not write into; reads only, writes nothing."""
    root = Path(root)
    _refuse_special(root)
    if not root.exists():
        return
    if not root.is_dir():
        raise OutputNotOwned(f"output.path {root} exists and is not a folder: choose a new output.path")
    for name in CLEANED_DIRS:
        path = OutputLayout(root).entry(name)
        if path.is_symlink():
            raise OutputNotOwned(
                f"{path} is a symbolic link (to {os.readlink(path)}): embedpipe writes and cleans only inside its "
                f"output folder; replace the link with a real folder, or point output.path elsewhere")
    if _marked(root) or _legacy_output(root):
        return
    foreign = sorted(p.name for p in root.iterdir() if not p.name.startswith(LOCK))  # the lock's own files
    if not foreign:
        return
    shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
    raise OutputNotOwned(
        f"{root} is not empty and was not created by embedpipe (found: {shown}; without a manifest or the {MARKER} "
        f"marker): embedpipe writes only into new or empty folders and its own outputs, and never deletes what it "
        f"did not write; choose a new or empty output.path")


def claim_output(root: str | Path, *, kind: str) -> None:
    """Check the folder, create it if needed, and mark it as an embedpipe output (``kind``: run|versioned)."""
    root = Path(root)
    check_output(root)
    root.mkdir(parents=True, exist_ok=True)
    if _marked(root):
        return
    marker = {"embedpipe": _version(), "kind": kind, "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    atomic_write_bytes(OutputLayout(root).marker, json.dumps(marker, indent=1).encode())


def is_output(folder: Path) -> bool:
    """Whether ``folder`` is an embedpipe output (marked, or an earlier embedpipe's with a manifest or VALIDATED)."""
    layout = OutputLayout(folder)
    return _marked(folder) or layout.job.is_file() or layout.validated.is_file()


def remove_owned(root: Path, names: tuple[str, ...]) -> None:
    """Remove these top-level entries of a marked output: a link itself, never what it points to."""
    for name in names:
        path = OutputLayout(root).entry(name)
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)  # does not follow links inside the tree


def sweep_temporaries(root: Path) -> list[Path]:
    """Remove embedpipe's leftover temporary files (a killed write's ``.tmp``) from an output's folders."""
    removed = []
    for folder in (root, *(OutputLayout(root).entry(name) for name in CLEANED_DIRS if name != VERSIONS)):
        if not folder.is_dir() or folder.is_symlink():
            continue
        for path in folder.iterdir():
            if TEMPORARY.match(path.name) and path.is_file() and not path.is_symlink():
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("embedpipe")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def _marked(root: Path) -> bool:
    marker = OutputLayout(root).marker
    return marker.is_file() and not marker.is_symlink()


def _legacy_output(root: Path) -> bool:
    """An output written by embedpipe before the marker existed: its manifest, or a version folder of its own."""
    layout = OutputLayout(root)
    if layout.job.is_file():
        return True
    versions = layout.versions
    return layout.current.is_file() and versions.is_dir() and any(
        p.is_dir() and is_output(p) for p in versions.iterdir())


def _refuse_special(root: Path) -> None:
    resolved = root.expanduser().resolve()
    home = Path.home().resolve()
    if resolved == Path(resolved.anchor) or resolved == home or resolved in home.parents:
        raise OutputNotOwned(f"output.path {root} is {'the home folder' if resolved == home else 'a system folder'}: "
                             f"embedpipe never writes there; choose a folder of its own, e.g. {home / 'embedpipe-out'}")
