"""A checkpoint directory's weight files and its tensor names mapped to ours, torch-free.

One owner for both loaders: the torch one (embedpipe/models/loader.py) and the numpy query encoder's
(embedpipe/models/numpy_bert.py).
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Callable, Mapping, TypeVar

T = TypeVar("T")  # a tensor: torch's or numpy's

# old TF-era checkpoints name LayerNorm parameters gamma / beta
LEGACY_SUFFIXES: dict[str, str] = {".gamma": ".weight", ".beta": ".bias"}

Target = str | tuple[str, int] | None  # ours, (ours, shard index) of a fused tensor, or None: dropped


def weight_files(model_dir: Path) -> list[Path]:
    """The directory's safetensors files: the shards its index lists, else model.safetensors, else any."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    return sorted(model_dir.glob("*.safetensors"))


@cache
def _patterns(weight_map: tuple[tuple[str, Target], ...]) -> list[tuple[re.Pattern[str], Target]]:
    """WEIGHT_MAP keys as regexes: "{}" captures a layer index, "*" matches anything."""
    out = []
    for key, target in weight_map:
        rx = re.escape(key).replace(r"\{\}", r"(\d+)").replace(r"\*", ".*")
        out.append((re.compile(rx + "$"), target))
    return out


def our_name(name: str, *, weight_map: Mapping[str, Target], strip_prefixes: tuple[str, ...]) -> tuple[bool, Target]:
    """(known, target) for one checkpoint name; target None means drop it."""
    for prefix in strip_prefixes:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    for old, new in LEGACY_SUFFIXES.items():
        if name.endswith(old):
            name = name[: -len(old)] + new
    for rx, target in _patterns(tuple(weight_map.items())):
        m = rx.match(name)
        if m:
            if target is None:
                return True, None
            if isinstance(target, tuple):
                return True, (target[0].format(*m.groups()), target[1])
            return True, target.format(*m.groups())
    return False, None


def map_names(state: Mapping[str, T], *, weight_map: Mapping[str, Target], strip_prefixes: tuple[str, ...],
              fuse: Callable[[list[T]], T]) -> tuple[dict[str, T], list[str]]:
    """(our name -> tensor, the checkpoint names the map neither maps nor drops). Shards of one fused tensor
    (q, k, v -> qkv) are joined in shard order by ``fuse`` (torch.cat, np.concatenate: along dim 0)."""
    ours: dict[str, T] = {}
    shards: dict[str, dict[int, T]] = {}
    unknown = []
    for name, tensor in state.items():
        known, target = our_name(name, weight_map=weight_map, strip_prefixes=strip_prefixes)
        if not known:
            unknown.append(name)
        elif isinstance(target, tuple):
            shards.setdefault(target[0], {})[target[1]] = tensor
        elif target is not None:
            ours[target] = tensor
    for name, parts in shards.items():
        ours[name] = fuse([parts[i] for i in sorted(parts)])  # [sum of shard rows, ...]
    return ours, unknown
