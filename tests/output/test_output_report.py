"""The dataset card, plots and report page a run leaves in its output directory (and `batchgen report`)."""

from __future__ import annotations

import html

import pytest
import yaml
from typer.testing import CliRunner

from batchgen.cli import app
from jobutil import read_rows, seed_rows, write_job, write_jsonl

runner = CliRunner()
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _run(tmp_path, tiny_model_dir, **sections):
    rows = seed_rows(11) + [{"id": "row-bad", "topic": None, "level": 1}]  # a null in the template: a reject
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    sampling={"n": 2, "temperature": 0.8}, name="job.yaml", **sections)
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    return tmp_path / "out"


def test_a_run_leaves_a_dataset_card_that_datasets_loads_with_the_completions_only(tmp_path, tiny_model_dir):
    out = _run(tmp_path, tiny_model_dir)
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["configs"][0]["data_files"] == [{"split": "train", "path": "data/*.parquet"}]
    snippet = card.split("```python\n")[1].split("```")[0]
    assert f'load_dataset("{out.resolve()}", split="train")' in snippet  # the real directory, not a placeholder
    scope: dict = {}
    exec(snippet, scope)  # the card's own snippet loads the data (its configs: data/, not rejects/)
    ds = scope["ds"]
    assert ds.num_rows == len(read_rows(out)) == 22 and "completion" in ds.column_names
    assert "from 12 input rows (1 rejected" in card and "| null_value | 1 |" in card
    assert "| completion tokens |" in card and "## Job" in card and "temperature" in card


def test_a_run_leaves_throughput_and_length_plots_and_a_page_that_shows_them(tmp_path, tiny_model_dir):
    import matplotlib.image

    out = _run(tmp_path, tiny_model_dir)
    for name in ("throughput.png", "lengths.png"):
        path = out / "reports" / name
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        height, width, _ = matplotlib.image.imread(path).shape
        assert height > 200 and width > 600
    page = (out / "reports" / "index.html").read_text()
    assert 'src="throughput.png"' in page and 'src="lengths.png"' in page and "null_value" in page
    assert not list(out.rglob("*.tmp*"))  # every file written whole under a temporary name, then renamed


def test_the_report_page_shows_the_job_settings_and_sample_rows_escaped(tmp_path, tiny_model_dir):
    rows = seed_rows(4) + [{"id": "row-html", "topic": "<script>alert(1)</script> & co", "level": 2}]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    sampling={"temperature": 0.5, "max_new_tokens": 6}, output={"keep_prompt": True})
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    page = (tmp_path / "out" / "reports" / "index.html").read_text()
    assert "<h2>Job settings</h2>" in page and "<th>sampling.temperature</th><td>0.5</td>" in page
    assert f"<th>model.path</th><td>{tiny_model_dir}</td>" in page and "job.resolved.yaml" in page
    assert "Sample rows" in page and "<th>completion</th>" in page and "<th>finish_<wbr>reason</th>" in page
    shown = read_rows(tmp_path / "out")[0]
    assert html.escape(shown["completion"]) in page
    assert "<script>" not in page  # the row's markup, in its topic and its rendered prompt, is escaped
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; co" in page


def test_report_key_off_writes_no_card_and_the_report_command_writes_it_later(tmp_path, tiny_model_dir):
    out = _run(tmp_path, tiny_model_dir, output={"report": False})
    assert not (out / "README.md").exists() and not (out / "reports" / "index.html").exists()
    result = runner.invoke(app, ["report", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "README.md").exists() and (out / "reports" / "lengths.png").exists()


def test_a_users_own_readme_in_the_output_directory_is_left_alone_and_the_report_says_so(tmp_path, tiny_model_dir):
    out = _run(tmp_path, tiny_model_dir, output={"report": False})
    (out / "README.md").write_text("my notes\n")
    result = runner.invoke(app, ["report", str(out)])
    assert result.exit_code == 0
    assert "was not written by batchgen: left as is" in result.output
    assert (out / "README.md").read_text() == "my notes\n" and (out / "reports" / "index.html").exists()


@pytest.mark.parametrize("make", ["missing", "plain folder"])
def test_report_on_something_that_is_not_an_output_directory_is_a_clear_error(tmp_path, make):
    target = tmp_path / "nothing"
    if make == "plain folder":
        target.mkdir()
    result = runner.invoke(app, ["report", str(target)])
    assert result.exit_code == 2 and "is not a batchgen output directory" in result.output


def test_fresh_removes_batchgens_card_but_never_a_users_readme(tmp_path, tiny_model_dir):
    out = _run(tmp_path, tiny_model_dir, output={"report": False})
    assert runner.invoke(app, ["report", str(out)]).exit_code == 0
    job = tmp_path / "job.yaml"
    assert runner.invoke(app, ["run", str(job), "--no-progress", "--fresh", "--set", "output.report=false"]
                         ).exit_code == 0
    assert not (out / "README.md").exists()  # it described deleted data
    (out / "README.md").write_text("mine\n")
    assert runner.invoke(app, ["run", str(job), "--no-progress", "--fresh"]).exit_code == 0
    assert (out / "README.md").read_text() == "mine\n"


def _log(times, counts, finished=None):
    return [{"time": 1000.0 + t, "elapsed_s": t, "num_generated_tokens": c,
             "generated_tokens": (finished or counts)[i]} for i, (t, c) in enumerate(zip(times, counts))]


def test_throughput_rates_take_a_short_last_interval_into_the_window_before_it():
    """Records every 5 s at 100 tok/s, then the run's final record 0.4 s later: alone, its 400 tokens would read
    1,000 tok/s and flatten the curve; joined to the window before it, the last window reads 900 / 5.4 s."""
    from batchgen.output.plots import window_rates

    times = [5.0 * i for i in range(1, 11)] + [50.4]
    counts = [500 * i for i in range(1, 11)] + [5400]
    windows = window_rates(_log(times, counts))
    assert [round(v, 3) for *_, v in windows[:-1]] == [100.0] * 8
    assert windows[-1][:2] == (1045.0, 1050.4) and windows[-1][2] == pytest.approx(900 / 5.4)
    assert all(end - start >= 5.0 for start, end, _ in windows)


def test_throughput_rates_count_tokens_as_generated_not_as_rows_finish():
    """The finished rows' count jumps when rows end; the engine's count of generated tokens does not."""
    from batchgen.output.plots import window_rates

    times = [5.0 * i for i in range(1, 7)]
    finished = [0, 0, 0, 0, 0, 3000]  # every row finished in the last interval
    windows = window_rates(_log(times, [500 * i for i in range(1, 7)], finished))
    assert {round(v, 3) for *_, v in windows} == {100.0}
    older = [{k: v for k, v in r.items() if k != "num_generated_tokens"} for r in _log(times, finished)]
    assert window_rates(older)[-1][2] == 600.0  # a log without the engine's count still plots the rows' one


def test_a_long_runs_rate_is_drawn_over_at_most_about_sixty_windows_and_one_record_gets_one():
    from batchgen.output.plots import MAX_WINDOWS, window_rates

    times = [5.0 * i for i in range(1, 2001)]
    windows = window_rates(_log(times, [500 * i for i in range(1, 2001)]))
    assert len(windows) <= MAX_WINDOWS + 1 and {round(v, 3) for *_, v in windows} == {100.0}
    assert window_rates(_log([8.0], [400])) == [(1000.0, 1008.0, 50.0)]


def test_length_histograms_bin_whole_token_counts():
    import numpy as np

    from batchgen.output.plots import _token_bins

    assert list(_token_bins(np.array([48, 48, 49, 50]))) == [47.5, 48.5, 49.5, 50.5]  # one bar per count
    edges = _token_bins(np.arange(1000))
    widths = set(np.diff(edges))
    assert len(edges) - 1 <= 50 and len(widths) == 1 and widths.pop() == 20  # whole tokens, at most 50 bars
