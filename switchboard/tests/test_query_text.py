"""A query parameter the database cannot hold is a 400 naming it on every Django page, before
the view runs (switchboard/http/query_text.py): admin's list filters put it straight into SQL,
where PostgreSQL refused the NUL with a 500 and a traceback."""

import pytest
from django.test import Client

from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

ADMIN_FILTERS = [
    "/admin/todos/todo/?state__exact=%00",
    "/admin/todos/todo/?trust__exact=%00",
    "/admin/ingest/webhook/?source__exact=%00",
    "/admin/ingest/deliveryevent/?source__exact=%00",
    "/admin/ingest/deliveryrecord/?outcome__exact=%00",
    "/admin/todos/todo/?q=ok&state__exact=in%00box",
]


@pytest.fixture
def admin_client():
    client = Client()
    client.force_login(UserFactory(username="root", is_staff=True, is_superuser=True))
    return client


@pytest.mark.parametrize("url", ADMIN_FILTERS)
def test_a_nul_in_an_admin_list_filter_is_a_400_naming_the_parameter(admin_client, url):
    answer = admin_client.get(url)
    assert answer.status_code == 400, (url, answer.status_code)
    error = answer.json()["error"]
    assert error["code"] == "invalid_argument"
    assert url.split("?")[1].split("&")[-1].split("=")[0] in error["message"]


def test_a_nul_in_a_parameters_name_is_refused_too(admin_client):
    answer = admin_client.get("/admin/todos/todo/?sta%00te=pending")
    assert answer.status_code == 400 and "NUL" in answer.json()["error"]["message"]


def test_ordinary_filters_pass_through(admin_client):
    assert admin_client.get("/admin/todos/todo/?state__exact=pending").status_code == 200
    assert admin_client.get("/admin/todos/todo/?q=caf%C3%A9").status_code == 200
