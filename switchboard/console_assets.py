"""The console's shared stylesheet and favicon, served by Django (daphne serves no static
files); small, cacheable, and files rather than inline so the CSP needs no 'unsafe-inline'."""

from pathlib import Path

from django.http import HttpResponse
from django.views.decorators.http import require_GET

ASSETS = Path(__file__).resolve().parent / "static" / "switchboard"
CONSOLE_STYLE = ASSETS / "console.css"
FAVICON = ASSETS / "favicon.svg"


def _asset(path: Path, content_type: str) -> HttpResponse:
    response = HttpResponse(path.read_bytes(), content_type=content_type)
    response["Cache-Control"] = "private, max-age=300"
    return response


@require_GET
def console_style(request):
    return _asset(CONSOLE_STYLE, "text/css")


@require_GET
def favicon(request):
    return _asset(FAVICON, "image/svg+xml")
