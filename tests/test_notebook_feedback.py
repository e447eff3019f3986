"""What a notebook shows of the planner's and the tuner's work: plots a reader can tell the
configs apart in (a colour and marker each, the legend beside the lines), ``compare`` as a
table that says which configs are within noise of each other, progress while ``tune``,
``simulate``'s measurement and ``export`` run (text lines without a front end, a bar with
one), and the temporary model unloaded however the work ends."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from jupyter_triton.kernel import tune as tune_module
from jupyter_triton.kernel.discovery import Connection
from jupyter_triton.kernel.tune import TuneResult, tune
from jupyter_triton.planning import Load, ServiceModel, measure
from jupyter_triton.planning.capacity import CapacityPlan

CONFIG = {"name": "m", "backend": "python", "max_batch_size": 32, "dynamic_batching": {},
          "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [4]}],
          "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4]}]}
# notebook 09's grid: 12 configs, more than matplotlib's 10 colours
GRID = [(m, d, n) for m in (8, 32) for d in (0, 500, 2000) for n in (1, 2)]


def service() -> ServiceModel:
    return ServiceModel("m", "1", {b: [int((3 + 0.25 * b) * 1e6)] * 5 for b in (1, 4, 8, 32)})


@pytest.fixture(scope="module")
def plan() -> CapacityPlan:
    return CapacityPlan("m", CONFIG, service(), [Load("qps", 50.0), Load("qps", 400.0)], GRID,
                        requests=150, slo_p99_ms=25)


def laid_out(fig):
    fig.tight_layout()
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def series(ax) -> list:
    """The configs' lines (not the SLO's, not the Pareto front's, not the p50s')."""
    return [line for line in ax.get_lines() if not line.get_label().startswith(("_", "SLO", "Pareto"))]


def assert_readable(fig) -> None:
    """Each config's line a (colour, marker) of its own; the legend outside every axes."""
    renderer = laid_out(fig)
    ax = fig.axes[0]
    lines = series(ax)
    styles = [(line.get_color(), line.get_marker()) for line in lines]
    assert len(set(styles)) == len(styles), styles
    legend = ax.get_legend().get_window_extent(renderer)
    for each in fig.axes:
        assert not legend.overlaps(each.get_window_extent(renderer)), (legend, each)
    assert legend.x0 >= ax.get_window_extent(renderer).x1


def test_twelve_configs_are_twelve_styles_and_the_legend_is_beside_the_plot(plan):
    fig = plan.plot_figure()
    assert len(series(fig.axes[0])) == len(GRID) == 12
    assert_readable(fig)
    assert plan.plot_png().startswith(b"\x89PNG")


def test_the_tuners_plot_too():
    rows = [{"max_batch_size": m, "max_queue_delay_us": d, "concurrency": c, "throughput": 100.0 * m + c,
             "p50_ms": 1.0 + d / 1000, "p95_ms": 2.0 + d / 1000, "p99_ms": 3.0 + c + d / 1000,
             "mean_batch": 1.0, "failures": 0, "error": ""}
            for m in (1, 2, 4, 8, 16, 32) for d in (0, 500) for c in (1, 8)]
    result = TuneResult("m", rows, None, CONFIG, {}, None, "loadgen")
    fig = result.plot_figure()
    assert len(series(fig.axes[0])) == 12
    assert_readable(fig)


def measured_rows() -> list[dict]:
    """What tune() measured at c=1: at one client a queue delay of 0 or 1 us changes nothing."""
    return [{"max_batch_size": 8, "max_queue_delay_us": d, "concurrency": 1, "throughput": 250.0,
             "p50_ms": 4.0, "p95_ms": 4.5, "p99_ms": 5.0, "mean_batch": 1.0, "failures": 0}
            for d in (0, 1)]


def test_compare_is_a_table_that_notes_configs_within_noise(plan):
    from jupyter_triton.planning.render import Comparison
    side = plan.compare(measured_rows())
    assert isinstance(side, Comparison) and len(side) == 2
    assert [(r["max_queue_delay_us"], r["concurrency"]) for r in side] == [(0, 1), (1, 1)]  # dicts still
    page = side._repr_html_()
    assert page.startswith("<table>") and "<th>measured_throughput</th>" in page
    assert page.count("<tr>") == 3                        # the head and two rows
    text = repr(side)
    assert "{" not in text and text.splitlines()[0].split()[:3] == [
        "max_batch_size", "max_queue_delay_us", "concurrency"]
    # one client never batches: a delay of 0 or 1 us are the same config within noise, said so
    assert len(side.notes) == 1 and "b8 d0us" in side.notes[0] and "b8 d1us" in side.notes[0]
    assert "within noise" in page and "note: " in text


def test_best_says_when_another_config_is_within_noise():
    close = CapacityPlan("m", CONFIG, service(), [Load("concurrency", 1.0)], [(8, 0, 1), (8, 1, 1)],
                         requests=150)
    why = close.best().why
    assert "within noise of each other" in why and "another run may rank either first" in why, why


# ---- progress, and the temporary model gone however the work ends -----------------------

def test_progress_is_a_bar_with_a_front_end_and_lines_without():
    from jupyter_triton.progress import Progress, has_widget_frontend
    assert not has_widget_frontend()          # pytest: no kernel, no widgets
    out = io.StringIO()
    with Progress(40, "work", stream=out) as p:
        for i in range(40):
            p.update(i, f"step {i // 20}: item {i}")
    lines = out.getvalue().splitlines()
    assert 5 <= len(lines) <= 14, lines      # a line a tenth (and a phase), not one a step
    assert lines[0].startswith("[  0%] work: 0/40 step 0") and lines[-1].startswith("work: done (")
    bar = Progress(4, "work", widgets=True)
    bar.update(2, "half")
    progress, label = bar.widgets
    assert (progress.value, progress.max, label.value) == (2, 4, "work: 2/4 half")
    bar.close()
    assert progress.value == 4 and progress.bar_style == "success"


@pytest.fixture
def linear(standalone, model_repo: Path):
    conn = Connection(standalone.url + "/", mode="test")
    files = {"1/model.onnx": (model_repo / "linear" / "1" / "model.onnx").read_bytes()}
    return conn, files


def temporary_models(conn: Connection) -> list[dict]:
    from jupyter_triton.kernel.client import TritonHTTP
    return [r for r in TritonHTTP(conn).index() if r["name"].endswith(("__tune", "__sim"))]


def test_tune_shows_progress_without_a_front_end(linear, capsys):
    conn, files = linear
    t = tune("linear", max_batch_size=[2, 8], max_queue_delay_us=[0], concurrency=[1], seconds=0.3,
             files=files, load_generator="loadgen", connection=conn)
    assert len(t.results) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "[  0%] tune linear: 0/2 max_batch_size=2, max_queue_delay_us=0: concurrency 1 for 0.3 s"
    assert lines[1] == "[ 50%] tune linear: 1/2 max_batch_size=8, max_queue_delay_us=0: concurrency 1 for 0.3 s"
    assert lines[-1].startswith("tune linear: done (")
    assert temporary_models(conn) == []


def test_an_interrupted_tune_unloads_its_temporary_model_and_says_so(linear, capsys, monkeypatch):
    conn, files = linear
    measured = []
    real = tune_module._run_loadgen

    def interrupted(*args, **kwargs):
        if measured:
            raise KeyboardInterrupt
        measured.append(True)
        return real(*args, **kwargs)
    monkeypatch.setattr(tune_module, "_run_loadgen", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tune("linear", max_batch_size=[2, 8], max_queue_delay_us=[0], concurrency=[1], seconds=0.3,
             files=files, load_generator="loadgen", connection=conn)
    assert capsys.readouterr().err.splitlines()[-1].startswith("tune linear: interrupted (")
    assert temporary_models(conn) == []


def test_a_temporary_copy_is_removed_a_users_model_never(linear, model_repo: Path):
    """Removed: only a model whose config marks it temporary (what the tuner and the planner
    load); the numbers it used are never handed out again when the name comes back."""
    from jupyter_triton.kernel.client import TritonHTTP
    from jupyter_triton.kernel.tune import temporary
    from jupyter_triton.repository import Repository
    conn, files = linear
    client = TritonHTTP(conn)
    config = client.config("linear")
    # a user's config copied from a temporary copy carries that copy's mark, not its own
    copied = temporary(config, "linear__tune")
    for name, own in (("mine__tune", {**config, "name": "mine__tune"}),
                      ("from_copy", {**copied, "name": "from_copy"}),
                      ("copy__tune", temporary(config, "copy__tune"))):
        client.load(name, json.dumps(own), files)
        client.load(name, json.dumps(own), files)   # version 2
        client.unload(name)
    names = {r["name"] for r in client.index()}
    assert "mine__tune" in names and (model_repo / "mine__tune" / "1").is_dir()    # a user's: kept
    assert "from_copy" in names and (model_repo / "from_copy" / "2").is_dir()
    assert "copy__tune" not in names and not (model_repo / "copy__tune").exists()
    client.unload("linear")
    assert (model_repo / "linear" / "1" / "model.onnx").is_file()
    assert Repository(model_repo).next_version("copy__tune") == 3
    client.load("copy__tune", json.dumps(temporary(config, "copy__tune")), files)
    assert client.metadata("copy__tune")["versions"] == ["3"]


def test_the_measurement_shows_progress(linear, capsys):
    conn, _ = linear
    service = measure(conn, "linear", repeats=2, warmup=1, burst_s=0, refresh=True)
    assert max(service.samples) == 8
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("[  0%] measure linear v1: 0/") and "warm-up: batch of 1" in lines[0]
    assert any("sweep: batch of" in line for line in lines) and lines[-1].startswith("measure linear v1: done (")


def test_export_shows_progress(model_repo: Path, tmp_path: Path, capsys):
    from jupyter_triton.repository.export import export_repository
    report = export_repository(model_repo, tmp_path / "out", ["linear", "simple"])
    assert [m.name for m in report.models] == ["linear", "simple"]
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(": ", 1)[1] for line in lines[:2]] == ["0/2 linear:", "1/2 simple:"]
    assert lines[-1].startswith(f"export to {tmp_path / 'out'}: done (")
