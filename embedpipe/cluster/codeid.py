"""Which embedpipe code a process runs, so that a worker running other code than its driver's fails the run.

A worker may import another embedpipe than the driver's: another install on its node, or a folder named
``embedpipe/`` in the driver's working directory, which Ray puts ahead of the installed package on every worker's
import path (``JobConfig._py_driver_sys_path``; a console script's driver does not see it). Its vectors would come
from other code than the run's record says. So the driver hands every worker its ``CodeId``; a worker whose own
differs fails its first unit with ``CodeMismatch``, which the scheduler never retries (another worker would meet the
same install), before it reads or writes anything.

The identity is the installed distribution's version and a digest of the package's source files. The version alone
cannot tell two trees of one version apart: it is read from the installed metadata, not from the code imported.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from embedpipe.errors import RunError

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
    sha = hashlib.sha256()
    for file in sorted(package.rglob("*.py")):
        sha.update(file.relative_to(package).as_posix().encode() + b"\0")
        sha.update(file.read_bytes())
    return CodeId(version=version, digest=sha.hexdigest()[:DIGEST_CHARS], where=str(package))


@lru_cache(maxsize=1)
def this_code() -> CodeId:
    """This process's embedpipe (~3 ms over the package's ~110 files; once per process)."""
    from embedpipe.io.describe import embedpipe_version

    return code_id(Path(__file__).resolve().parents[1], version=embedpipe_version())


def check_same_code(driver: CodeId, *, worker: int, node: str) -> None:
    """Raise CodeMismatch when this process runs other embedpipe code than ``driver``'s."""
    mine = this_code()
    if (mine.version, mine.digest) == (driver.version, driver.digest):
        return
    raise CodeMismatch(
        f"worker {worker} on node {node} runs {mine.describe()}, the driver {driver.describe()}: install the same "
        f"embedpipe on every node, and start the run from a folder with no other embedpipe/ package in it (Ray puts "
        f"the driver's working directory first on its workers' import path)")
