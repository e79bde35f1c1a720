"""The bottom of the async edge: after-commit publishing (``publish``), the channel-layer
group names every sender and stream agree on (``groups``), and the one loop that keeps a
long-lived stream in its groups while Redis comes and goes (``group_reader``).

Imports nothing above it: Django, channels and ``switchboard``'s plumbing only.
"""
