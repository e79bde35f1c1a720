import pytest

from tests.live_server import run_daphne
from tests.processes import children_database_url


@pytest.fixture
def live_daphne(transactional_db, tmp_path):
    """daphne serving switchboard.asgi against the test database, on the test's Redis."""
    with run_daphne(database_url=children_database_url(),
                    log_path=tmp_path / "daphne.log") as server:
        yield server
