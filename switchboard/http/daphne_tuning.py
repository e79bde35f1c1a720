"""Every workaround for daphne's (and Twisted's) HTTP layer, in one file.

What switchboard switches off (``skip_form_parsing``, applied when ``switchboard.asgi`` loads):
twisted parses the form arguments of every POST (a Content-Type parse through the standard library's
``email`` package, then the body for url-encoded and multipart forms) into ``request.args``. daphne
never reads them: it hands the raw body to the ASGI application. The parse showed in profiles of
/mcp on every request, and a malformed multipart body made twisted answer 400 itself before the
application could say what was wrong. Switching it off changes nothing an application sees.

What daphne does not tell a stream: how many bytes its client has not read yet
(``transport_backlog_bytes``).
"""

import functools


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


def transport_backlog_bytes(send) -> int | None:
    """Bytes this response has handed to the server that the socket has not yet taken: what a
    client that stopped reading leaves piling up in the server's memory. daphne's ``send``
    never pushes back (it is ``functools.partial(Server.handle_reply, protocol)``, and the
    protocol writes straight into its Twisted transport), so the stream asks the transport:
    a Twisted ``FileDescriptor`` keeps unsent bytes in ``dataBuffer`` (from ``offset``) plus
    ``_tempDataLen`` (see twisted.internet.abstract). None when ``send`` is not daphne's
    (test communicators, another server): then only the frame bound applies."""
    protocol = send.args[0] if isinstance(send, functools.partial) and send.args else None
    transport = getattr(getattr(protocol, "channel", None), "transport", None)
    try:
        return len(transport.dataBuffer) - transport.offset + transport._tempDataLen
    except (AttributeError, TypeError):
        return None
