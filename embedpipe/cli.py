"""The `embedpipe` command: thin typed commands; heavy imports happen inside them."""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Annotated, Iterator, NoReturn, Optional

import typer

# rich_markup_mode=None: click's plain help (no "<bool>" or "<path>" placeholders, no boxes)
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None, pretty_exceptions_enable=False,
                  help="Offline batch embedding: Parquet, JSONL, CSV or HF datasets in, vectors out, on local or remote Ray.")

JobFile = Annotated[Path, typer.Argument(help="The job YAML file.", show_default=False)]
SetOpt = Annotated[Optional[list[str]], typer.Option(
    "--set", help="Override a job field: --set output.path=/tmp/out (repeatable).", show_default=False,
    metavar="FIELD=VALUE")]
Verbose = Annotated[int, typer.Option("-v", "--verbose", count=True, show_default=False,
                                      help="More log lines: -v info (and Ray's and FAISS's own warnings), -vv debug.")]
Quiet = Annotated[bool, typer.Option("-q", "--quiet", show_default=False, help="Errors only: no warnings.")]


def _version(value: bool) -> None:
    if value:
        from embedpipe.io.describe import embedpipe_version  # one owner (embedpipe/__init__ sits above cli)

        typer.echo(f"embedpipe {embedpipe_version()}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    """Offline batch embedding: Parquet, JSONL, CSV or HF datasets in, vectors out, on local or remote Ray."""


class _Stderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a line is logged (a test runner swaps it per command). While the run's
    progress bar is shown, that stream writes each line above the bar (cluster/progress.py)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def _logging(*, verbose: int, quiet: bool) -> None:
    """The ``embedpipe`` loggers' level from -q/-v: errors only, warnings (the default), info, debug. Ray and
    FAISS follow it (embedpipe/cluster/connect.py, embedpipe/index/train.py): their own warnings show from -v."""
    level = logging.ERROR if quiet else {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
    logger = logging.getLogger("embedpipe")
    logger.setLevel(level)
    handler = next((h for h in logger.handlers if isinstance(h, _Stderr)), None)
    if handler is None:
        handler = _Stderr()
        logger.addHandler(handler)
        logger.propagate = False  # one line per message, whatever the root logger has
    handler.setFormatter(logging.Formatter("%(message)s" if level >= logging.WARNING
                                           else "%(levelname)s %(name)s: %(message)s"))


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
        progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show the progress bar.")] = True,
        overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace another job's output at output.path.")] = False,
        verbose: Verbose = 0, quiet: Quiet = False) -> None:
    """Run a job: embed the input and write vectors and report.json under output.path.

    Rerunning a job on its own output resumes it: finished units are kept, the rest is redone.
    """
    _logging(verbose=verbose, quiet=quiet)
    job = _load(job_file, set_)
    from embedpipe.cluster.driver import run_job
    from embedpipe.io.layout import OutputLayout
    from embedpipe.report.render import render_table

    # stdout carries the report alone (`embedpipe run job.yaml > report.txt`): while the job runs, what Ray prints there
    # (a worker's own stdout, the raylet's "A worker died" errors) goes to stderr with the run's other diagnostics
    with _exit_codes(cluster=True), redirect_stdout(sys.stderr):
        result = run_job(job, progress=progress, overwrite=overwrite)
    typer.echo(render_table(result.report))
    if "version" in result.report:
        typer.echo(f"CURRENT -> {result.report['version']['run_id']}")
    out = OutputLayout(result.output_path)
    typer.echo(f"vectors: {result.vectors_path}\nreport: {out.report_json}, {out.report_md}, {out.report_png}")


@app.command()
def validate(job_file: JobFile, set_: SetOpt = None, verbose: Verbose = 0, quiet: Quiet = False) -> None:
    """Check a job file, its input files, its model and its output path without running it; print the plan."""
    _logging(verbose=verbose, quiet=quiet)
    job = _load(job_file, set_)
    from embedpipe.cluster.connect import expected_workers
    from embedpipe.preflight import check_output_owner, describe_units, preflight

    with _exit_codes():
        workers = expected_workers(job.cluster)
        plan = preflight(job, workers=workers.workers)
        check_output_owner(job, plan)  # what run refuses about output.path, asked the same way
        lines = describe_units(plan, workers_source=workers.source)
        if plan.index is not None:
            from embedpipe.index.plan import describe_plan

            lines.append(describe_plan(plan.index))
    lines += [f"model: {plan.model.dir}", f"ok: {job.name}"]  # ok last: every check above passed
    typer.echo("\n".join(lines))


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
               help="Show each hit's text, read from the job's input.")] = True,
           per_document: Annotated[bool, typer.Option(
               "--per-document", help="Chunked outputs (input.chunking): the best chunk of each document only.")]
           = False,
           verbose: Verbose = 0, quiet: Quiet = False) -> None:
    """Search a built index with a text query: ids, scores and the source text when still readable.

    The query is encoded in this process (no Ray), with the settings the output's embedpipe.json records."""
    _logging(verbose=verbose, quiet=quiet)
    from embedpipe.index.search import open_index

    with _exit_codes():
        # one short query: one thread (more only wait on each other; on a shared CPU, seconds: docs/performance.md)
        index = open_index(output_dir, query_prompt=prompt, threads=1)
    if per_document and not index.chunked:
        typer.echo(f"error: --per-document: the index at {output_dir} is not over chunks (input.chunking is off): "
                   f"leave the flag out", err=True)
        raise typer.Exit(2)
    if index.chunked:
        with _exit_codes():
            [chunk_hits] = index.search([query], k=k, per_document=per_document)
        if json_:
            import json

            results = [{"rank": rank, "id": hit.id, "chunk": hit.chunk, "start": hit.start, "end": hit.end,
                        "score": hit.score, "text": hit.text if texts else None}
                       for rank, hit in enumerate(chunk_hits, 1)]
            typer.echo(json.dumps({"query": query, "k": k, "results": results, "warnings": []}, default=str))
            return
        for rank, hit in enumerate(chunk_hits, 1):
            text = " ".join((hit.text or "").split()) if texts else ""
            typer.echo(f"{rank:>3}  {hit.score:8.4f}  {hit.id}  #{hit.chunk} [{hit.start}:{hit.end}]  {text[:120]}")
        return
    with _exit_codes():
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
    verbose: Verbose = 0, quiet: Quiet = False,
) -> None:
    """Re-render a finished output's report (table, report.md, report.png) with the runs that produced it, or one
    run's (OUTPUT/runs/<run id>), or compare two side by side."""
    _logging(verbose=verbose, quiet=quiet)
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


def main() -> None:
    """The console entry (`embedpipe`): the app, then a quick exit (``_leave``)."""
    try:
        app(prog_name="embedpipe")
    except SystemExit as done:  # click ends every command so, errors and interrupts included (their exit codes)
        _leave(done)


def _leave(done: SystemExit) -> NoReturn:
    """Exit as Python would, less the interpreter's teardown: after a run it freed Ray's, pyarrow's and
    matplotlib's modules one by one, 0.2-0.45 s of every command's wall on two Zen 4 cores (docs/performance.md,
    session 36). The exit handlers run first (atexit: logging's flush, Ray's shutdown of a joined cluster,
    temporary folders), then stdout and stderr are flushed, Python's and C's. Where a thread that Python would wait
    for still runs, or this Python has no exit handlers to run, the exit is Python's own."""
    import atexit
    import os
    import threading

    run_handlers = getattr(atexit, "_run_exitfuncs", None)  # CPython's; the usual exit runs it the same way
    waited = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if run_handlers is None or waited:
        raise done
    code = done.code
    if code is not None and not isinstance(code, int):  # sys.exit("message"): printed, exit 1, as Python does
        print(code, file=sys.stderr)
        code = 1
    run_handlers()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed pipe (`embedpipe ... | head`): Python's own exit says 120
        code = code or 120
    _flush_c_stdio()
    os._exit(code or 0)


def _flush_c_stdio() -> None:
    """Flush C's own stdio buffers (what a C library printed to a pipe), as the C exit that os._exit skips would."""
    import ctypes

    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):  # no C library to load by that name here: nothing buffered to lose
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
