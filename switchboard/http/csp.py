"""The Content-Security-Policy header (docs/security.md). Django 5.2 has no built-in CSP; this is
the smallest middleware that sends settings.CONTENT_SECURITY_POLICY on every Django response
that does not carry a policy of its own."""

from django.conf import settings
from django.utils.deprecation import MiddlewareMixin


class ContentSecurityPolicyMiddleware(MiddlewareMixin):
    # MiddlewareMixin: sync and async capable, so it adds no thread hop under ASGI.
    def process_response(self, request, response):
        response.headers.setdefault("Content-Security-Policy", settings.CONTENT_SECURITY_POLICY)
        return response
