import pytest
from django.db import connection

from tests.live_server import database_url_for, run_daphne


@pytest.fixture
def live_daphne(transactional_db, tmp_path):
    """daphne serving switchboard.asgi against the test database, on the test's Redis."""
    with run_daphne(database_url=database_url_for(connection),
                    log_path=tmp_path / "daphne.log") as server:
        yield server
