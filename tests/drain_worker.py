"""An agent process for crash and concurrency tests: drains an endpoint through the same
transitions the MCP verbs call, printing each claimed todo id (flushed) as it goes.

    python -m tests.drain_worker SLUG --mode drain|hold [--lease-seconds N] [--session NAME]

``drain``: claim_next + complete until the queue is empty (with --until-settled: until the
endpoint has no pending or claimed todo left, polling while other workers' leases may still
lapse back through the reaper). ``hold``: claim up to --hold todos and then hang
with the leases held, waiting to be SIGKILLed. The database comes from DATABASE_URL.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "switchboard.settings")


def main():
    import django

    django.setup()
    from endpoints.models import Endpoint
    from todos import transitions

    parser = argparse.ArgumentParser()
    parser.add_argument("slug")
    parser.add_argument("--mode", choices=["drain", "hold"], default="drain")
    parser.add_argument("--lease-seconds", type=int, default=300)
    parser.add_argument("--hold", type=int, default=5)
    parser.add_argument("--session", default=f"worker-{os.getpid()}")
    parser.add_argument("--until-settled", action="store_true")
    args = parser.parse_args()

    endpoint = Endpoint.objects.get(slug=args.slug)
    caller = transitions.Caller.agent(endpoint, args.session)
    print("ready", flush=True)
    held = 0
    while True:
        todo = transitions.claim_next_todo(caller, lease_ttl_seconds=args.lease_seconds)
        if todo is None:
            unsettled = endpoint.todos.filter(state__in=["pending", "claimed"]).exists()
            if args.mode == "hold" or not (args.until_settled and unsettled):
                break
            time.sleep(0.2)
            continue
        print(todo.pk, flush=True)
        if args.mode == "hold":
            held += 1
            if held >= args.hold:
                break
            continue
        transitions.complete_todo(caller, todo.pk, lease_id=todo.lease_id)
    if args.mode == "hold":
        print("holding", flush=True)
        while True:  # hang with the leases held until killed
            time.sleep(60)
    print("done", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
