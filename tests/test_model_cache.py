"""The node's model cache (embedpipe/models/cache.py): content-addressed, written atomically, checked.

Plain files, no Ray: ``fetch`` counts its calls, so a hit is seen to fetch nothing.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from embedpipe.models.cache import ModelCacheError, ModelFile, cached_model, materialize

FILES = {"config.json": b'{"model_type": "bert"}', "model.safetensors": random.Random(17).randbytes(300_000),
         "1_Pooling/config.json": b'{"pooling_mode_mean_tokens": true}'}
DIGEST = "5e" * 32  # the model's content hash: the cache takes it as the folder's name


def _files(contents: dict[str, bytes] = FILES) -> list[ModelFile]:
    return [ModelFile(name=n, size=len(b), sha256=hashlib.sha256(b).hexdigest()) for n, b in sorted(contents.items())]


class Fetcher:
    """Serves each file's bytes in two chunks; counts the files it was asked for."""

    def __init__(self, contents: dict[str, bytes] = FILES, delay: float = 0.0):
        self.names, self.contents, self.delay, self.calls = sorted(contents), contents, delay, 0

    def __call__(self, i: int):
        self.calls += 1
        data = self.contents[self.names[i]]
        time.sleep(self.delay)
        yield data[: len(data) // 2]
        yield data[len(data) // 2:]


def _assert_model(folder: Path) -> None:
    assert {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()} == FILES


def test_second_materialize_is_a_cache_hit(tmp_path):
    first, second = Fetcher(), Fetcher()
    folder, fetched = materialize(DIGEST, _files(), first, root=tmp_path)
    assert fetched and first.calls == 3 and folder == tmp_path / DIGEST
    _assert_model(folder)
    again, fetched = materialize(DIGEST, _files(), second, root=tmp_path)
    assert again == folder and not fetched and second.calls == 0  # a restarted worker fetches nothing
    assert [p.name for p in tmp_path.iterdir()] == [DIGEST]  # no temp folder left behind


def test_a_torn_temp_folder_is_ignored_and_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs: a writer that crashed mid-copy
    torn = tmp_path / f".{DIGEST}.{socket.gethostname()}.{dead.pid}.tmp"
    (torn / "1_Pooling").mkdir(parents=True)
    (torn / "model.safetensors").write_bytes(FILES["model.safetensors"][:1000])  # cut short
    assert cached_model(DIGEST, _files(), root=tmp_path) is None  # a temp folder is never the model
    folder, fetched = materialize(DIGEST, _files(), Fetcher(), root=tmp_path)
    assert fetched and not torn.exists()
    _assert_model(folder)


def test_a_damaged_model_folder_is_fetched_again(tmp_path):
    folder, _ = materialize(DIGEST, _files(), Fetcher(), root=tmp_path)
    (folder / "model.safetensors").write_bytes(b"cut")  # a file cut short by hand
    assert cached_model(DIGEST, _files(), root=tmp_path) is None
    again, fetched = materialize(DIGEST, _files(), Fetcher(), root=tmp_path)
    assert fetched and again == folder
    _assert_model(folder)


def test_bytes_that_do_not_match_the_hash_are_refused(tmp_path):
    last = FILES["model.safetensors"][-1]
    changed = {**FILES, "model.safetensors": FILES["model.safetensors"][:-1] + bytes([last ^ 0xFF])}  # same size, other bytes
    with pytest.raises(ModelCacheError, match=r"model file model.safetensors of model .*: the shipped bytes .* are "
                                              r"not the file the driver hashed .* leave it unchanged and rerun"):
        materialize(DIGEST, _files(), Fetcher(changed), root=tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing cached, no temp folder left
    folder, fetched = materialize(DIGEST, _files(), Fetcher(), root=tmp_path)  # the right bytes still go in
    assert fetched
    _assert_model(folder)


def test_an_unwritable_cache_names_the_folder_and_the_fix(tmp_path):
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")
    with pytest.raises(ModelCacheError, match=r"model cache .*file-not-folder.*: cannot write the model there .* "
                                              r"EMBEDPIPE_CACHE_DIR"):
        materialize(DIGEST, _files(), Fetcher(), root=blocked)


def _race(root: str, queue) -> None:
    folder, fetched = materialize(DIGEST, _files(), Fetcher(delay=0.2), root=Path(root))
    queue.put((str(folder), fetched))


def test_two_workers_of_a_node_racing_share_one_folder(tmp_path):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_race, args=(str(tmp_path), queue)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    answers = [queue.get(timeout=5) for _ in procs]
    assert all(p.exitcode == 0 for p in procs)
    assert {folder for folder, _ in answers} == {str(tmp_path / DIGEST)}
    assert [p.name for p in tmp_path.iterdir()] == [DIGEST]  # the loser's copy is gone
    _assert_model(tmp_path / DIGEST)
