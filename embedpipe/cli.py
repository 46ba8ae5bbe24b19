"""The `embedpipe` command: thin typed commands; heavy imports happen inside them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Offline batch embedding: Parquet in, vectors out, on a local or remote Ray cluster.")

JobFile = Annotated[Path, typer.Argument(help="The job YAML file.", show_default=False)]
SetOpt = Annotated[Optional[list[str]], typer.Option(
    "--set", help="Override a job field: --set output.path=/tmp/out (repeatable).", show_default=False)]


def _load(job_file: Path, overrides: list[str] | None):
    from embedpipe.config import JobError, load_job

    try:
        return load_job(job_file, overrides=overrides)
    except JobError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None


@app.command()
def run(job_file: JobFile, set_: SetOpt = None,
        progress: Annotated[bool, typer.Option(help="Show the progress bar.")] = True) -> None:
    """Run a job: embed the input and write vectors and report.json under output.path."""
    job = _load(job_file, set_)
    from embedpipe.cluster.driver import run_job
    from embedpipe.report.report import render_summary
    from embedpipe.units import InputError

    try:
        result = run_job(job, progress=progress)
    except InputError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=3) from None
    typer.echo(render_summary(result.report))
    typer.echo(f"vectors: {result.vectors_path}\nreport: {result.output_path / 'report.json'}")


@app.command()
def validate(job_file: JobFile, set_: SetOpt = None) -> None:
    """Check a job file without running it."""
    job = _load(job_file, set_)
    from embedpipe.units import InputError, list_files, plan_units

    try:
        units = plan_units(list_files(job.input.path), unit_rows=job.input.unit_rows)
    except InputError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=3) from None
    from embedpipe.models.resolve import ModelNotFound, resolve_model_path

    try:
        model_dir = resolve_model_path(job.model.path)
    except ModelNotFound as exc:
        typer.echo(f"error: model.path: {exc}", err=True)
        raise typer.Exit(code=2) from None
    typer.echo(f"ok: {job.name}: {len(units)} units, {sum(u.num_rows for u in units):,} rows; model {model_dir}")


def main() -> None:  # pragma: no cover - console entry
    app(prog_name="embedpipe")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
