"""``embed()``'s keyword options: job-file fields under their own names, validated by the job schema.

Every field of ``model`` (but ``path``, which is ``model=``), ``output.dim``/``output.dtype`` and the
int8 calibration sample's ``calibration_rows``/``calibration_seed``, ``input.on_bad_row`` (error or embed_empty: embed returns one row per input,
so skip is refused), ``input.chunking`` (a mapping of its fields, or its mode alone: ``chunking="split"``) and
``output.document_vectors``, and the ``batching`` and ``runtime`` fields, so a new schema field is an
option the day it lands. A name two sections share keeps its plain form for the first section
in ``OPTION_SECTIONS`` and takes ``<section>_`` for the next: ``dtype`` is ``model.dtype``,
``output_dtype`` is ``output.dtype``.
"""

from __future__ import annotations

from typing import Any

from embedpipe.config import (IN_PROCESS, OPTION_SECTIONS, JobError, JobSpec, job_from_options,  # noqa: F401
                              option_errors, option_names)

SOURCE = "embed()"


def job_for_options(model: str, options: dict[str, Any], *, source: str = SOURCE) -> JobSpec:
    """A JobSpec for in-process use: ``model.path=model`` plus the options, each checked by the schema,
    and ``prompt_name``/``dim`` checked against the model as a job run's preflight checks them.

    Its input and output sections are placeholders: nothing is read or written through them.
    """
    if isinstance(options.get("chunking"), str):  # chunking="split": the mode alone, the other fields' defaults
        options = {**options, "chunking": {"mode": options["chunking"]}}
    job = job_from_options(model, options, source=source)
    if job.input.on_bad_row == "skip":
        raise JobError("on_bad_row", "'skip' would leave rows without a vector (embed returns one row per input)",
                       "pass on_bad_row='error' or 'embed_empty'", source=source)
    with option_errors(source=source):
        _check_against_model(job)
    return job


def _check_against_model(job: JobSpec) -> None:
    """prompt_name and dim against the model: the check a job run makes in preflight (read only when set)."""
    if job.model.prompt_name is None and job.output.dim is None:
        return
    from embedpipe.models.resolve import resolve_model_path
    from embedpipe.models.st import model_dim, read_st_spec
    from embedpipe.preflight import check_model_options

    root = resolve_model_path(job.model.path, storage_options=job.model.storage_options)  # ModelNotFound: one line
    spec = read_st_spec(root, allow_pickle=job.model.allow_pickle)
    check_model_options(job, spec=spec, dim=model_dim(root, spec))
