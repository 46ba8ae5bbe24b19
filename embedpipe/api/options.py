"""``embed()``'s keyword options: job-file fields under their own names, validated by the job schema.

Every field of ``model`` (but ``path``, which is ``model=``), ``output.dim``/``output.dtype`` and the
int8 calibration sample's ``calibration_rows``/``calibration_seed``, ``input.on_bad_row`` (error or embed_empty: embed returns one row per input,
so skip is refused), and the ``batching`` and ``runtime`` fields, so a new schema field is an
option the day it lands. A name two sections share keeps its plain form for the first section
in ``OPTION_SECTIONS`` and takes ``<section>_`` for the next: ``dtype`` is ``model.dtype``,
``output_dtype`` is ``output.dtype``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

from embedpipe.config import SECTIONS, JobError, JobSpec, parse_section

# section -> the fields that are options (None: all of them but `path`), in naming priority order
OPTION_SECTIONS: dict[str, tuple[str, ...] | None] = {
    "model": None,
    "output": ("dim", "dtype", "calibration_rows", "calibration_seed"),
    "input": ("on_bad_row",),
    "batching": None,
    "runtime": None,
}
SOURCE = "embed()"
IN_PROCESS = "<in process>"  # input.path and output.path of the placeholder job: never read or written


def option_names() -> dict[str, tuple[str, str]]:
    """Keyword option -> (section, field), for the fields the schema has today."""
    names: dict[str, tuple[str, str]] = {}
    for section, allowed in OPTION_SECTIONS.items():
        for f in dataclasses.fields(SECTIONS[section]):
            if f.name == "path" or (allowed is not None and f.name not in allowed):
                continue
            names[f.name if f.name not in names else f"{section}_{f.name}"] = (section, f.name)
    return names


def job_for_options(model: str, options: dict[str, Any], *, source: str = SOURCE) -> JobSpec:
    """A JobSpec for in-process use: ``model.path=model`` plus the options, each checked by the schema.

    Its input and output sections are placeholders: nothing is read or written through them.
    """
    names = option_names()
    raw: dict[str, dict[str, Any]] = {section: {} for section in OPTION_SECTIONS}
    raw["model"]["path"] = model
    raw["output"]["path"] = raw["input"]["path"] = IN_PROCESS
    for key, value in options.items():
        if key not in names:
            import difflib

            close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}=?" if close else f"known options: {', '.join(sorted(names))}"
            raise JobError(key, "unknown option", hint, source=source)
        section, field = names[key]
        raw[section][field] = value
    where = {f"{section}.{field}": key for key, (section, field) in names.items()}
    sections = {}
    with _as_options(where, source=source):
        for section, values in raw.items():
            sections[section] = parse_section(section, values, source=source)
    if sections["input"].on_bad_row == "skip":
        raise JobError("on_bad_row", "'skip' would leave rows without a vector (embed returns one row per input)",
                       "pass on_bad_row='error' or 'embed_empty'", source=source)
    job = JobSpec(**sections)
    with _as_options(where, source=source):
        _check_against_model(job)
    return job


def _check_against_model(job: JobSpec) -> None:
    """prompt_name and dim against the model: the check a job run makes in preflight (read only when set)."""
    if job.model.prompt_name is None and job.output.dim is None:
        return
    from embedpipe.models.resolve import resolve_model_path
    from embedpipe.models.st import model_dim, read_st_spec
    from embedpipe.preflight import check_model_options

    root = resolve_model_path(job.model.path)  # ModelNotFound names the model and the fix
    spec = read_st_spec(root, allow_pickle=job.model.allow_pickle)
    check_model_options(job, spec=spec, dim=model_dim(root, spec))


@contextlib.contextmanager
def _as_options(where: dict[str, str], *, source: str) -> Iterator[None]:
    """A JobError names the keyword option, not the job-file field."""
    try:
        yield
    except JobError as exc:
        option = where.get(exc.field_path, exc.field_path)
        raise JobError(option, exc.problem, exc.fix.replace(exc.field_path, option), source=source) from None
