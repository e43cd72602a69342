"""`make lab` starts a JupyterLab that answers GET /api/status."""

from labserver import api_status, running_lab


def test_make_lab_answers_api_status(tmp_path):
    with running_lab(log_path=tmp_path / "lab.log") as (url, token):
        status = api_status(url, token)
        assert status is not None and "started" in status
