"""What switchboard switches off in daphne's HTTP layer, applied when ``switchboard.asgi`` loads.

twisted parses the form arguments of every POST (a Content-Type parse through the standard library's
``email`` package, then the body for url-encoded and multipart forms) into ``request.args``. daphne
never reads them: it hands the raw body to the ASGI application. The parse showed in profiles of
/mcp on every request, and a malformed multipart body made twisted answer 400 itself before the
application could say what was wrong. Switching it off changes nothing an application sees.
"""


def skip_form_parsing() -> None:
    try:
        from daphne.http_protocol import WebRequest
    except ImportError:  # served by another ASGI server: nothing to switch off
        return
    if getattr(WebRequest, "switchboard_skips_form_parsing", False):
        return
    parse_init = WebRequest.__init__

    def init_without_form_parsing(self, *args, **kwargs):
        parse_init(self, *args, **kwargs)
        self._parsePOSTFormSubmission = False  # twisted.web.http.Request's own switch

    WebRequest.__init__ = init_without_form_parsing
    WebRequest.switchboard_skips_form_parsing = True
