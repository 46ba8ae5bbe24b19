"""``embedpipe.Job``: a job from YAML or built in code, run on an embedded local Ray or a cluster.

    job = embedpipe.Job.from_yaml("examples/quickstart.yaml", overrides=["output.path=/tmp/q"])
    job = embedpipe.Job(input={"path": "data/*.parquet"}, model="sentence-transformers/all-MiniLM-L6-v2",
                        output={"path": "out/corpus"})
    result = job.run()                      # embedded local Ray, progress bar (a widget in notebooks)
    result = job.submit("ray://head:10001") # the same job on a running cluster
    result.report, result.output_path, result.vectors_path
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from pathlib import Path
from typing import Any

from embedpipe.config import SECTIONS, JobSpec, job_from_dict, load_job

Section = dict[str, Any] | Any  # a mapping of fields, or the section's config dataclass


class Job:
    """A validated job (``spec``, a ``JobSpec``) and the two ways to run it."""

    def __init__(self, *, model: Section | str, name: str = "job", base: str | os.PathLike = ".",
                 **sections: Section | None):
        """Sections as in a job file, one keyword per section of the schema (``input``, ``output``,
        ``batching``, ``cluster``, ``runtime``, ``cost``...: ``config.SECTIONS``), each a mapping or
        the section's config dataclass; ``model`` may be just its path.

        Relative paths resolve against ``base`` (the current directory by default); errors name the field.
        """
        sections = {**sections, "model": {"path": model} if isinstance(model, str) else model}
        raw = {key: _as_mapping(value) for key, value in sections.items() if value is not None}
        self.spec: JobSpec = job_from_dict({**raw, "name": name}, base=Path(base).resolve(), source="Job(...)")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, *, overrides: list[str] | None = None) -> "Job":
        """Read a job file; ``overrides`` are ``--set`` items (``"output.path=/tmp/out"``)."""
        return cls.from_spec(load_job(path, overrides=overrides))

    @classmethod
    def from_spec(cls, spec: JobSpec) -> "Job":
        job = cls.__new__(cls)
        job.spec = spec
        return job

    def replace(self, **sections: dict[str, Any]) -> "Job":
        """A copy with some fields changed: ``job.replace(output={"path": "/tmp/x"})``."""
        return Job.from_spec(self.spec.replace(**sections))

    def run(self, *, progress: bool = True, overwrite: bool = False):
        """Run on ``cluster.address`` (empty: an embedded local Ray, started and stopped here), as
        ``embedpipe run`` does: rerunning resumes the job's own unfinished output; ``overwrite``
        replaces another job's output at ``output.path``.

        Returns a ``RunResult``: ``report`` (the report.json dict), ``output_path`` and ``vectors_path``.
        Reuses the Ray this process is already connected to, if any.
        """
        from embedpipe.cluster.driver import run_job

        return run_job(self.spec, progress=progress, overwrite=overwrite)

    def submit(self, address: str, *, progress: bool = True, overwrite: bool = False):
        """Run on the Ray cluster at ``address`` (``auto``, ``host:port`` or ``ray://host:port``); blocks
        until done and returns the same result as ``run``. Input, model and output must be reachable
        from the cluster's nodes (shared paths, or input URLs such as ``s3://``)."""
        return self.replace(cluster={"address": address}).run(progress=progress, overwrite=overwrite)

    def __repr__(self) -> str:
        s = self.spec
        return (f"Job({s.name!r}: {s.input.path} ({s.input.format}) -> {s.model.path} -> {s.output.path}, "
                f"cluster {s.cluster.address or 'embedded local Ray'})")


def _signature() -> inspect.Signature:
    """Job's keywords as the schema lists its sections, so help(Job) and editors show every one."""
    kw = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(s, kw, annotation="Section | str") if s == "model" else
               inspect.Parameter(s, kw, default=None, annotation="Section | None") for s in SECTIONS]
    params += [inspect.Parameter("name", kw, default="job", annotation="str"),
               inspect.Parameter("base", kw, default=".", annotation="str | os.PathLike")]
    return inspect.Signature(params)


Job.__init__.__signature__ = _signature()


def _as_mapping(section: Section) -> dict[str, Any]:
    if dataclasses.is_dataclass(section) and not isinstance(section, type):
        return dataclasses.asdict(section)
    return dict(section) if isinstance(section, dict) else section  # anything else: the schema names the section
