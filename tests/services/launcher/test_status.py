"""`meshtrain status` of a run directory whose run has ended."""

import json

from meshtrain.services.cli import main


def _ended_run(tmp_path, last_step: int) -> str:
    (tmp_path / "config.toml").write_text("[train]\ntrain_iters = 20\n")
    (tmp_path / "metrics.jsonl").write_text(
        f'{{"step": 10, "loss": 5.5}}\n{{"step": {last_step}, "loss": 4.25}}\n'
    )
    return str(tmp_path)


def test_status_of_a_finished_run_reports_it_and_exits_0(tmp_path, capsys):
    run_dir = _ended_run(tmp_path, 20)
    assert main(["status", run_dir]) == 0
    assert (
        capsys.readouterr().out == f"{run_dir}: the run has finished: last step 20, loss 4.2500\n"
    )
    assert main(["status", run_dir, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "finished": True,
        "step": 20,
        "train_iters": 20,
        "loss": 4.25,
    }


def test_status_of_a_run_that_ended_early_without_an_endpoint_is_an_error(tmp_path, capsys):
    assert main(["status", _ended_run(tmp_path, 15)]) == 2
    assert "has ended (no control endpoint): last step 15" in capsys.readouterr().err
