"""Which embedpipe code a process runs, so that a worker running other code than its driver's fails the run.

A worker may import another embedpipe than the driver's: another install on its node, or a folder named
``embedpipe/`` in the driver's working directory, which Ray puts ahead of the installed package on every worker's
import path (``JobConfig._py_driver_sys_path``; a console script's driver does not see it). Its vectors would come
from other code than the run's record says. So the driver hands every process that does the run's work its
``CodeId``, and each checks its own before it reads or writes anything: the embedding workers at every unit, the
index's shard workers at every shard, and the int8 calibration and incremental diff tasks when they start. A
mismatch raises ``CodeMismatch`` (exit 4), which is never retried: another worker on that node would meet the same
install.

The identity is the installed distribution's version and a digest of the package's source files. The version alone
cannot tell two trees of one version apart: it is read from the installed metadata, not from the code imported.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator

from embedpipe.errors import RunError, remote_message
from embedpipe.sources import PACKAGE, own_sources_sha256, sources_sha256

DIGEST_CHARS = 12  # hex digits of the sources' sha256 kept: enough to tell trees apart, short enough for a line


class CodeMismatch(RunError, RuntimeError):
    """A worker runs other embedpipe code than the driver: names both, and the fix."""


@dataclass(frozen=True)
class CodeId:
    version: str  # the installed distribution's version (embedpipe.io.describe.embedpipe_version)
    digest: str  # sha256 of the package's .py files (each one's path in the package and its bytes), DIGEST_CHARS
    where: str  # the package's folder in this process

    def describe(self) -> str:
        return f"embedpipe {self.version} from {self.where} (code {self.digest})"


def code_id(package: Path, *, version: str) -> CodeId:
    """The identity of the package in folder ``package``: its .py files in path order, each path with its bytes."""
    return CodeId(version=version, digest=sources_sha256(package)[:DIGEST_CHARS], where=str(package))


@lru_cache(maxsize=1)
def this_code() -> CodeId:
    """This process's embedpipe (its sources hashed once per process: embedpipe/sources.py)."""
    from embedpipe.io.describe import embedpipe_version

    return CodeId(version=embedpipe_version(), digest=own_sources_sha256()[:DIGEST_CHARS], where=str(PACKAGE))


def check_same_code(driver: CodeId | None, *, who: str, node: str | None = None) -> None:
    """Raise CodeMismatch when this process runs other embedpipe code than ``driver``'s (None: not checked).
    ``who``: the process as the message names it ("worker 1", "an incremental diff task"); ``node``: its Ray
    node (default: this process's)."""
    if driver is None:
        return
    mine = this_code()
    if (mine.version, mine.digest) == (driver.version, driver.digest):
        return
    if node is None:
        from embedpipe.cluster.nodes import node_name

        node = node_name()
    raise CodeMismatch(
        f"{who} on node {node} runs {mine.describe()}, the driver {driver.describe()}: install the same "
        f"embedpipe on every node, and start the run from a folder with no other embedpipe/ package in it (Ray puts "
        f"the driver's working directory first on its workers' import path)")


@contextmanager
def own_words() -> Iterator[None]:
    """Around a driver's ``ray.get`` of checked work: a task's CodeMismatch is raised in its own one line, not as
    Ray's wrapper (a RayTaskError is an instance of the task's error type, its message Ray's traceback)."""
    try:
        yield
    except CodeMismatch as exc:
        raise CodeMismatch(remote_message(exc)) from None
