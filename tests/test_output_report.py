"""The dataset card, plots and report page a run leaves in its output directory (and `batchgen report`)."""

from __future__ import annotations

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
