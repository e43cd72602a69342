"""`make lab` starts a JupyterLab that answers GET /api/status."""

import pytest
from labserver import api_status, running_lab


# JupyterLab's start takes 5-20 s on a 2-core machine (and `make lab` installs the venv first
# where there is none): `make test` runs it, the edit loop does not.
@pytest.mark.slow
def test_make_lab_answers_api_status(tmp_path):
    with running_lab(log_path=tmp_path / "lab.log") as (url, token):
        status = api_status(url, token)
        assert status is not None and "started" in status
