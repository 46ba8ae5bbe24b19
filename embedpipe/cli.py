"""The `embedpipe` command: thin typed commands; heavy imports happen inside them."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Iterator, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Offline batch embedding: Parquet, JSONL, CSV or HF datasets in, vectors out, on local or remote Ray.")

JobFile = Annotated[Path, typer.Argument(help="The job YAML file.", show_default=False)]
SetOpt = Annotated[Optional[list[str]], typer.Option(
    "--set", help="Override a job field: --set output.path=/tmp/out (repeatable).", show_default=False)]


# Exit codes are a contract for schedulers (docs/operations.md): 0 success, then one per kind of failure;
# each embedpipe error carries its own (embedpipe/errors.py), these name the ones the CLI gives itself.
EXIT_BAD_JOB, EXIT_RUN_FAILED = 2, 4


def _fail(exc: BaseException, code: int) -> typer.Exit:
    """One line on stderr, then the exit code."""
    typer.echo("error: " + " ".join(str(exc).split()), err=True)
    return typer.Exit(code=code)


@contextmanager
def _exit_codes(*, cluster: bool = False) -> Iterator[None]:
    """The one mapping from a failure to its exit code and its one line on stderr: an embedpipe error by its
    kind, an interrupt (Ctrl-C, SIGTERM) as `interrupted:`; with ``cluster``, any other runtime or OS error
    (the cluster, the disk: the run could not finish) as exit 4. Anything else is a bug: its traceback stays."""
    from embedpipe.errors import EmbedpipeError, Interrupted

    try:
        yield
    except typer.Exit:  # click's Exit is a RuntimeError: never remapped
        raise
    except KeyboardInterrupt as exc:
        stop = exc if isinstance(exc, Interrupted) else Interrupted()
        typer.echo("interrupted: " + stop.line(), err=True)
        raise typer.Exit(code=stop.exit_code) from None
    except EmbedpipeError as exc:
        raise _fail(exc, exc.exit_code) from None
    except (RuntimeError, ConnectionError, OSError) as exc:
        if not cluster:
            raise
        raise _fail(exc, EXIT_RUN_FAILED) from None


def _load(job_file: Path, overrides: list[str] | None):
    from embedpipe.config import load_job

    with _exit_codes():
        return load_job(job_file, overrides=overrides)


@app.command()
def run(job_file: JobFile, set_: SetOpt = None,
        progress: Annotated[bool, typer.Option(help="Show the progress bar.")] = True,
        overwrite: Annotated[bool, typer.Option(help="Replace another job's output at output.path.")] = False) -> None:
    """Run a job: embed the input and write vectors and report.json under output.path.

    Rerunning a job on its own output resumes it: finished units are kept, the rest is redone.
    """
    job = _load(job_file, set_)
    from embedpipe.cluster.driver import run_job
    from embedpipe.io.layout import OutputLayout
    from embedpipe.report.render import render_table

    with _exit_codes(cluster=True):
        result = run_job(job, progress=progress, overwrite=overwrite)
    typer.echo(render_table(result.report))
    if "version" in result.report:
        typer.echo(f"CURRENT -> {result.report['version']['run_id']}")
    out = OutputLayout(result.output_path)
    typer.echo(f"vectors: {result.vectors_path}\nreport: {out.report_json}, {out.report_md}, {out.report_png}")


@app.command()
def validate(job_file: JobFile, set_: SetOpt = None) -> None:
    """Check a job file, its input files and its model without running it."""
    job = _load(job_file, set_)
    from embedpipe.preflight import preflight

    with _exit_codes():
        plan = preflight(job)
    typer.echo(f"ok: {job.name}: {len(plan.units)} units, {plan.rows:,} rows; model {plan.model.dir}")
    if plan.index is not None:
        from embedpipe.index.plan import describe_plan

        typer.echo(describe_plan(plan.index))


@app.command()
def search(output_dir: Annotated[str, typer.Argument(help="A job's output.path (holding index/): a folder or a URL "
                                                          "(s3://...).", show_default=False)],
           query: Annotated[str, typer.Argument(help="The query text.", show_default=False)],
           k: Annotated[int, typer.Option("-k", "--k", help="Results to show.")] = 10,
           prompt: Annotated[Optional[str], typer.Option(
               help="Put before the query (e.g. 'query: '); default: the model's own query prompt, if any.",
               show_default=False)] = None,
           json_: Annotated[bool, typer.Option(
               "--json", help="Print one JSON object (query, results with rank, id, score, text; warnings) for "
                              "scripts.")] = False,
           texts: Annotated[bool, typer.Option(
               help="Show each hit's text, read from the job's input.")] = True) -> None:
    """Search a built index with a text query: ids, scores and the source text when still readable.

    The query is encoded in this process (no Ray), with the settings the output's embedpipe.json records."""
    from embedpipe.index.search import open_index

    with _exit_codes():
        # one short query: one thread (more only wait on each other; on a shared CPU, seconds: docs/performance.md)
        index = open_index(output_dir, query_prompt=prompt, threads=1)
        [hits] = index.search([query], k=k)
    found = index.source_texts([i for i, _ in hits], warn=False) if texts else {}
    if index.text_problem and not json_:
        typer.echo(f"warning: {index.text_problem}", err=True)
    if json_:
        import json

        results = [{"rank": rank, "id": id_, "score": score, "text": found.get(id_)}
                   for rank, (id_, score) in enumerate(hits, 1)]
        warnings = [index.text_problem] if index.text_problem else []
        typer.echo(json.dumps({"query": query, "k": k, "results": results, "warnings": warnings}, default=str))
        return
    for rank, (id_, score) in enumerate(hits, 1):
        text = " ".join(str(found.get(id_, "")).split())
        typer.echo(f"{rank:>3}  {score:8.4f}  {id_}  {text[:120]}")


@app.command()
def report(
    runs: Annotated[list[str], typer.Argument(
        help="A finished output folder or URL (its report and its runs), or one run's folder OUTPUT/runs/<run id>; "
             "two folders: compare them.", show_default=False)],
    project_rows: Annotated[Optional[float], typer.Option(
        help="Also show what a corpus of this many rows would take and cost at the run's rates (e.g. 1e9).",
        show_default=False)] = None,
) -> None:
    """Re-render a finished output's report (table, report.md, report.png) with the runs that produced it, or one
    run's (OUTPUT/runs/<run id>), or compare two side by side."""
    from embedpipe.io.store import tree_path
    from embedpipe.report.render import load_report, render_comparison, render_table, vectors_line

    runs = [tree_path(run) for run in runs]  # a URL stays a URL (Path would collapse its "//")
    if len(runs) > 2:
        raise _fail(ValueError("report takes one output folder, or two to compare"), EXIT_BAD_JOB)
    from embedpipe.errors import EmbedpipeError

    try:
        reports = [load_report(run) for run in runs]
    except EmbedpipeError as exc:  # a store's error (exit 3)
        raise _fail(exc, exc.exit_code) from None
    except (OSError, ValueError) as exc:
        raise _fail(exc, EXIT_BAD_JOB) from None
    if len(reports) == 2:
        typer.echo(render_comparison(reports, [f"A: {runs[0]}", f"B: {runs[1]}"], project_rows=project_rows))
        return
    from embedpipe.report.outputs import write_renderings

    folder = runs[0].parent if runs[0].suffix == ".json" else runs[0]
    with _exit_codes():
        paths = write_renderings(folder, reports[0], project_rows=project_rows)
    typer.echo(render_table(reports[0], project_rows=project_rows))
    with _exit_codes():
        vectors = vectors_line(folder)  # the output's embedpipe.json: what its vectors are
    if vectors:
        typer.echo(vectors)
    typer.echo(f"report: {paths['markdown']}, {paths['plot']}")


def main() -> None:  # pragma: no cover - console entry
    app(prog_name="embedpipe")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
