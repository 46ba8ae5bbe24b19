"""Merge per-unit shards (inverted lists) into the trained index, in unit-id order.

In memory: one shard at a time is appended to the index's lists. On disk (an IVF larger than
``output.index_memory_gb``): the shards are memory-mapped and merged into ``index.ivfdata`` with
``OnDiskInvertedLists.merge_from_multiple``, as ``faiss.contrib.ondisk.merge_ondisk`` does.
"""

from __future__ import annotations

from pathlib import Path


def _read_lists(path: str, *, mmap: bool):
    import faiss

    reader = faiss.FileIOReader(str(path))
    return faiss.read_InvertedLists(reader, faiss.IO_FLAG_MMAP if mmap else 0)


def _set_ntotal(index, ntotal: int) -> None:
    import faiss

    node = index
    while node is not None:
        node.ntotal = ntotal
        inner = getattr(faiss.downcast_index(node), "index", None)  # IndexPreTransform -> its index
        node = faiss.downcast_index(inner) if inner is not None else None


def merge_in_memory(index, shards: list[str]) -> None:
    import faiss

    ivf = faiss.extract_index_ivf(index)
    for path in shards:  # unit-id order: every run lays the lists out the same way
        lists = _read_lists(path, mmap=False)
        ivf.invlists.merge_from(lists, 0)
        del lists
    _set_ntotal(index, sum(ivf.invlists.list_size(i) for i in range(ivf.nlist)))


def merge_on_disk(index, shards: list[str], ivfdata: Path) -> None:
    import faiss

    ivf = faiss.extract_index_ivf(index)
    assert index.ntotal == 0, "merge into the trained, empty index"
    lists = [_read_lists(path, mmap=True) for path in shards]
    ptrs = faiss.InvertedListsPtrVector()
    for one in lists:
        ptrs.push_back(one)
    ondisk = faiss.OnDiskInvertedLists(ivf.nlist, ivf.code_size, str(ivfdata))
    ntotal = ondisk.merge_from_multiple(ptrs.data(), ptrs.size(), False)
    ivf.replace_invlists(ondisk, True)
    ondisk.this.disown()
    _set_ntotal(index, int(ntotal))
