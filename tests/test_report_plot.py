"""report.png: a valid PNG with one tokens/s line per worker and the stage breakdown."""

from embedpipe.report.plot import build_figure, worker_line, write_plot
from tests.report_helpers import sample_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_worker_line_steps_up_for_each_unit_and_back_to_zero():
    xs, ys = worker_line([[2.0, 6.0, 100, 4000], [7.0, 9.0, 50, 1000]])
    assert xs == [0.0, 2.0, 2.0, 6.0, 6.0, 7.0, 7.0, 9.0, 9.0]
    assert ys == [0.0, 0.0, 1000.0, 1000.0, 0.0, 0.0, 500.0, 500.0, 0.0]


def test_one_line_per_worker_and_a_bar_per_stage():
    report = sample_report(workers=3)
    fig = build_figure(report)
    timeline, stages = fig.axes[:2]
    assert len(timeline.get_lines()) == 3
    assert [line.get_label() for line in timeline.get_lines()] == ["worker 0", "worker 1", "worker 2"]
    assert max(max(line.get_ydata()) for line in timeline.get_lines()) == 64_000 / 9
    assert [t.get_text() for t in stages.get_yticklabels()] == ["read", "tokenize", "pack", "encode", "write"]


def test_png_is_valid(tmp_path):
    from matplotlib.image import imread

    path = write_plot(sample_report(workers=2), tmp_path / "report.png")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    height, width, channels = imread(path).shape
    assert width > height > 100 and channels in (3, 4)
    assert not list(tmp_path.glob("*.tmp"))


def test_the_image_is_drawn_from_the_figures_inputs_alone(tmp_path):
    import io

    from embedpipe.report.plot import figure_inputs

    report = {**sample_report(workers=2), "runs": [{"id": "r1"}], "output": {"rows": 5000}}
    drawn = io.BytesIO()
    build_figure(report).savefig(drawn, format="png", dpi=100)
    assert write_plot(report, tmp_path / "report.png").read_bytes() == drawn.getvalue()
    assert set(figure_inputs(report)) < set(report)  # the runs and their sums are not drawn


def test_a_report_that_differs_only_where_the_figure_does_not_draw_is_not_drawn_again(tmp_path):
    from embedpipe.report.plot import _png

    run = sample_report(workers=2)
    first = write_plot(run, tmp_path / "run.png").read_bytes()
    drawn = _png.cache_info().misses
    output = {**run, "runs": [{"id": "r1"}], "output": {"rows": 5000}, "version": {"run_id": "v"}}
    assert write_plot(output, tmp_path / "output.png").read_bytes() == first
    assert _png.cache_info().misses == drawn
    slower = write_plot({**run, "wall_seconds": run["wall_seconds"] * 2}, tmp_path / "slower.png").read_bytes()
    assert _png.cache_info().misses == drawn + 1 and slower != first
