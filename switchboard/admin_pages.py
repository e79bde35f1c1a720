"""Admin pages shared by the apps: freshly minted secrets shown once.

A credential, API token or signing secret is displayed exactly once, on a page of its own sent
with ``Cache-Control: no-store`` — never in a Django message: messages may travel in a cookie
(signed, not encrypted) and are shown again on whatever page comes next.
"""

from django.contrib import admin
from django.template.response import TemplateResponse


def show_secrets_once(request, *, title: str, headers: list[str], rows: list[tuple],
                      back_url: str, note: str = "switchboard stores only a hash."):
    """The page; each row's last column is the secret, the others describe it."""
    response = TemplateResponse(request, "admin/shown_once.html", {
        **admin.site.each_context(request), "title": title, "headers": headers,
        "rows": [(row[:-1], row[-1]) for row in rows], "back_url": back_url, "note": note,
    })
    response["Cache-Control"] = "no-store"
    return response
