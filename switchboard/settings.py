"""switchboard settings: read only from the environment (docs/configuration.md).

Two runtime modes fall out of two variables:

* ``DATABASE_URL`` unset -> SQLite under ``var/`` (WAL, IMMEDIATE transactions, busy timeout);
  set -> that database (PostgreSQL in production).
* ``REDIS_URL`` unset -> in-memory channel layer and sweeps inside the web process;
  set -> Redis channel layer and Celery broker (worker + beat run the sweeps).

A malformed value fails at import time with a message naming the variable.
"""

import os
import secrets
from datetime import timedelta
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from switchboard.db import pool_check
from switchboard.http import origins

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(environ.Env().str("SWITCHBOARD_VAR_DIR", default=str(BASE_DIR / "var")))

env = environ.Env()


def _typed(name, cast, default, *, minimum=None):
    """Read one variable through django-environ; any bad value names the variable."""
    try:
        value = cast(name, default=default)
    except (ValueError, TypeError) as exc:
        raise ImproperlyConfigured(f"{name}: {exc}") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name} must be >= {minimum}, got {value!r}")
    return value


def _make_private_file(path: Path) -> bool:
    """Create ``path`` readable by its owner only (0600) if it is missing, and tighten it if an
    older version left it wider. True when this call created it."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return True
    except FileExistsError:
        try:
            path.chmod(0o600)
        except PermissionError:  # someone else's file: theirs to fix, not a reason to stop
            pass
        return False


def _dev_secret_key():
    """Generated once into var/ so sessions survive restarts of the embedded default."""
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    key_file = VAR_DIR / "secret_key"
    if _make_private_file(key_file):  # 0600 from the first byte, not chmod-ed after writing
        key_file.write_text(secrets.token_urlsafe(50))
    return key_file.read_text().strip()


DEBUG = _typed("DEBUG", env.bool, False)
SECRET_KEY = env.str("SECRET_KEY", default="") or _dev_secret_key()
ALLOWED_HOSTS = _typed("ALLOWED_HOSTS", env.list, ["localhost", "127.0.0.1", "[::1]"])
SWITCHBOARD_PUBLIC_URL = env.str("SWITCHBOARD_PUBLIC_URL", default="http://127.0.0.1:8000").rstrip(
    "/"
)
# Browser origins allowed to call /mcp (exact scheme, host and port; docs/security.md): the public
# URL's own origin plus SWITCHBOARD_ALLOWED_ORIGINS (comma-separated, e.g. a browser-based
# inspector's http://localhost:6274). A request without Origin (any non-browser client) is
# never refused for it.
def _origin(name, value, *, allow_path=False):
    parsed = origins.parse_origin(value, allow_path=allow_path)
    if parsed is None:
        raise ImproperlyConfigured(f"{name}: {value!r} is not an http(s) origin (scheme://host[:port])")
    return parsed


_EXTRA_ORIGINS = _typed("SWITCHBOARD_ALLOWED_ORIGINS", env.list, [])
SWITCHBOARD_ALLOWED_ORIGINS = [
    _origin("SWITCHBOARD_PUBLIC_URL", SWITCHBOARD_PUBLIC_URL, allow_path=True),
    *(_origin("SWITCHBOARD_ALLOWED_ORIGINS", value) for value in _EXTRA_ORIGINS),
]
CSRF_TRUSTED_ORIGINS = [SWITCHBOARD_PUBLIC_URL, *_EXTRA_ORIGINS]

# -- the queue -------------------------------------------------------------------------------
SWITCHBOARD_DEFAULT_LEASE = timedelta(
    seconds=_typed("SWITCHBOARD_DEFAULT_LEASE_SECONDS", env.int, 300, minimum=1)
)
SWITCHBOARD_MAX_BODY_BYTES = _typed("SWITCHBOARD_MAX_BODY_BYTES", env.int, 1024 * 1024, minimum=1)
# Token-bucket rate limits, requests per minute per webhook (ingest) / per credential (MCP).
SWITCHBOARD_INGEST_RATE_PER_MINUTE = _typed(
    "SWITCHBOARD_INGEST_RATE_PER_MINUTE", env.int, 600, minimum=1
)
SWITCHBOARD_MCP_RATE_PER_MINUTE = _typed("SWITCHBOARD_MCP_RATE_PER_MINUTE", env.int, 6000, minimum=1)
# Failed verifications per webhook and client address, and unknown hook slugs / bad MCP bearers per
# client address (docs/security.md#anonymous-senders): counted apart from the verified budget above,
# so anonymous traffic can never spend a signed sender's tokens.
SWITCHBOARD_INGEST_FAILURES_PER_MINUTE = _typed(
    "SWITCHBOARD_INGEST_FAILURES_PER_MINUTE", env.int, 60, minimum=1
)
SWITCHBOARD_UNKNOWN_CLIENT_PER_MINUTE = _typed(
    "SWITCHBOARD_UNKNOWN_CLIENT_PER_MINUTE", env.int, 60, minimum=1
)
# Body cap for `unsigned` webhooks (anyone who knows the URL may post).
SWITCHBOARD_UNSIGNED_MAX_BODY_BYTES = _typed(
    "SWITCHBOARD_UNSIGNED_MAX_BODY_BYTES", env.int, 64 * 1024, minimum=1
)
# A signed body accepted under one delivery id is refused under another for this long (a replay).
SWITCHBOARD_REPLAY_WINDOW = timedelta(
    days=_typed("SWITCHBOARD_REPLAY_WINDOW_DAYS", env.int, 7, minimum=1)
)
# Delivery log (docs/senders.md#the-delivery-log): refused deliveries recorded per webhook per
# minute; the rest are counted.
SWITCHBOARD_DELIVERY_LOG_REFUSED_PER_MINUTE = _typed(
    "SWITCHBOARD_DELIVERY_LOG_REFUSED_PER_MINUTE", env.int, 60, minimum=0
)
# The largest tools/call result (its JSON) an agent is sent; a larger one (list_todos at a high
# limit over big payloads) is refused as invalid_argument telling the agent to lower `limit`.
SWITCHBOARD_MCP_MAX_RESULT_BYTES = _typed(
    "SWITCHBOARD_MCP_MAX_RESULT_BYTES", env.int, 8 * 1024 * 1024, minimum=64 * 1024
)
# MCP sessions (docs/reference.md#sessions-and-streams) with no request and no open stream for this
# long are ended by the idle-session sweep; an open notification stream keeps its session alive.
SWITCHBOARD_MCP_SESSION_IDLE = timedelta(
    seconds=_typed("SWITCHBOARD_MCP_SESSION_IDLE_SECONDS", env.int, 3600, minimum=60)
)
# Streams. Keep-alive comments on the MCP and board streams; every keep-alive
# interval each process also re-checks the right of every stream it holds (credential / Django
# session) in one query, so this is also how soon a revoked stream closes. Below the 30-60 s idle cut of common proxies.
SWITCHBOARD_STREAM_KEEPALIVE_SECONDS = _typed(
    "SWITCHBOARD_STREAM_KEEPALIVE_SECONDS", env.float, 15.0, minimum=0.1)
# A web process holding MCP notification streams renews ONE lease row of its own (a
# ``StreamHost``) instead of a write per stream; its streams count as open while that lease
# runs, so a process killed without a goodbye stops counting within this long. Renewed every
# 2/5 of it (2 min of the default 5). Tests of a killed process shorten it.
SWITCHBOARD_STREAM_LEASE_SECONDS = _typed(
    "SWITCHBOARD_STREAM_LEASE_SECONDS", env.float, 300.0, minimum=1.0)
# Caps: live MCP sessions per credential (initialize evicts the oldest idle beyond it),
# and open streams per MCP session and per operator's board.
SWITCHBOARD_MAX_SESSIONS_PER_CREDENTIAL = _typed(
    "SWITCHBOARD_MAX_SESSIONS_PER_CREDENTIAL", env.int, 32, minimum=1)
SWITCHBOARD_MAX_OPEN_STREAMS = _typed("SWITCHBOARD_MAX_OPEN_STREAMS", env.int, 4, minimum=1)
# Waiting claim_next calls (long polls) per MCP session and per credential, per web process:
# each is a parked coroutine and a wake-up slot, and a client that loops without reading its
# answers must not pile up hundreds. The next one is refused (at_capacity), nothing claimed.
SWITCHBOARD_MAX_LONG_POLLS_PER_SESSION = _typed(
    "SWITCHBOARD_MAX_LONG_POLLS_PER_SESSION", env.int, 4, minimum=1)
SWITCHBOARD_MAX_LONG_POLLS_PER_CREDENTIAL = _typed(
    "SWITCHBOARD_MAX_LONG_POLLS_PER_CREDENTIAL", env.int, 32, minimum=1)
# A session counts as attached (a receiver for doorbells, sweeps and digests;
# docs/reference.md#doorbells) while it has an open notification stream, or made a request within
# this window: a client that vanished without DELETE stops costing ring budget after it, not after
# the idle limit above.
SWITCHBOARD_ATTACH_WINDOW = timedelta(
    seconds=_typed("SWITCHBOARD_ATTACH_WINDOW_SECONDS", env.int, 120, minimum=1)
)
# A notification stream whose client has not drained this many bytes (frames the transport
# has not yet written to the socket) drops new doorbells instead of buffering them.
SWITCHBOARD_STREAM_BUFFER_BYTES = _typed(
    "SWITCHBOARD_STREAM_BUFFER_BYTES", env.int, 256 * 1024, minimum=1024
)
# A long-polling claim_next (docs/reference.md#long-poll) answering over SSE sends a keep-alive
# comment this often, below the 30-60 s idle cut of common proxies (tests shorten it).
SWITCHBOARD_LONG_POLL_KEEPALIVE_SECONDS = _typed(
    "SWITCHBOARD_LONG_POLL_KEEPALIVE_SECONDS", env.float, 15.0, minimum=0.05)
# -- retention (docs/operating.md#retention): what the hourly prune deletes, and after how long --
# Done todos, with their audit events, secrets and the delivery events no other todo needs.
SWITCHBOARD_RETAIN_DONE = timedelta(
    days=_typed("SWITCHBOARD_RETAIN_DONE_DAYS", env.int, 30, minimum=1)
)
# Dead letters are kept until a human acts on them, unless this is set.
_retain_dead_days = _typed("SWITCHBOARD_RETAIN_DEAD_DAYS", env.int, 0, minimum=0)
SWITCHBOARD_RETAIN_DEAD = timedelta(days=_retain_dead_days) if _retain_dead_days else None
# Ended (terminated or expired) MCP sessions: kept a day for the admin's sake, then deleted.
SWITCHBOARD_RETAIN_ENDED_SESSIONS = timedelta(days=1)
# The delivery log (what each request to a webhook became) and its dropped counts.
SWITCHBOARD_RETAIN_DELIVERY_LOG = timedelta(
    days=_typed("SWITCHBOARD_RETAIN_DELIVERY_LOG_DAYS", env.int, 30, minimum=1)
)
# Fernet key for operator-supplied secrets (docs/security.md#stored-secrets); derived from
# SECRET_KEY when unset.
SWITCHBOARD_SECRETS_KEY = env.str("SWITCHBOARD_SECRETS_KEY", default="")
# When set, GET /metrics requires "Authorization: Bearer <this token>" (docs/operating.md#metrics).
SWITCHBOARD_METRICS_TOKEN = env.str("SWITCHBOARD_METRICS_TOKEN", default="")

# -- apps ------------------------------------------------------------------------------------
INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "axes",
    "endpoints",
    "todos",
    "ingest",
    "channels_push",
    "accounts",
    "console",
]

MIDDLEWARE = [
    # Database unreachable -> 503 + Retry-After (JSON), not a 500
    # (docs/operating.md#when-postgresql-is-down).
    "switchboard.health.DatabaseUnavailableMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # A query parameter the database cannot hold (a NUL) -> 400 naming it, never a 500.
    "switchboard.http.query_text.UnstorableQueryMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "switchboard.http.csp.ContentSecurityPolicyMiddleware",
    # Last, as django-axes requires: turns a locked-out sign-in into its 429 answer.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "switchboard.urls"
ASGI_APPLICATION = "switchboard.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# -- database --------------------------------------------------------------------------------
# SQLite (the embedded default, or any sqlite:// URL) always runs with these options.
SQLITE_OPTIONS = {
    # IMMEDIATE: a writing transaction takes the write lock at BEGIN, so two writers queue on
    # the busy timeout instead of deadlocking on a lock upgrade.
    "transaction_mode": "IMMEDIATE",
    "timeout": 20,
    "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
}
EMBEDDED = not env.str("DATABASE_URL", default="")
if EMBEDDED:
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    DATABASES = {
        "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": VAR_DIR / "switchboard.sqlite3"}
    }
else:
    try:
        DATABASES = {"default": env.db("DATABASE_URL")}
    except (ImproperlyConfigured, ValueError, KeyError) as exc:
        raise ImproperlyConfigured(f"DATABASE_URL: {exc}") from None
    if DATABASES["default"]["ENGINE"] not in (
        "django.db.backends.postgresql", "django.db.backends.sqlite3"
    ):
        raise ImproperlyConfigured("DATABASE_URL must be postgres://… (or sqlite:///path)")
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"]["OPTIONS"] = dict(SQLITE_OPTIONS)
    # Tests need a file (threads and child processes share it), next to the database it mirrors.
    _sqlite_file = Path(DATABASES["default"]["NAME"])
    _sqlite_file.parent.mkdir(parents=True, exist_ok=True)  # a fresh clone has no var/ yet
    # The ledger holds payloads and secrets' ciphertexts: 0600. SQLite gives the -wal and -shm
    # files it creates the database file's mode, so creating the database first covers them.
    for _suffix in ("", "-wal", "-shm"):
        _path = Path(f"{_sqlite_file}{_suffix}")
        if (not _suffix or _path.exists()) and str(_sqlite_file) != ":memory:":
            _make_private_file(_path)
    DATABASES["default"].setdefault("TEST", {})["NAME"] = str(
        _sqlite_file.with_name("test_" + _sqlite_file.name))
else:
    # Django turns psycopg's prepared statements off (prepare_threshold None), and then even an
    # explicit prepare=True is ignored. The hot statements (the todo transitions, the bearer
    # check, the webhook lookup: switchboard/db/statements.py, fetch_rows) prepare on first use,
    # and the hook's other server-binding statements
    # (switchboard/db/statements.py) are prepared after 5 runs; the ORM's own queries use
    # client-side binding, which never prepares, so this changes nothing else.
    # DATABASE_PREPARED_STATEMENTS=false turns both off, for a connection pooler in front that
    # does not carry prepared statements (PgBouncer in transaction mode without
    # max_prepared_statements): psycopg then ignores prepare=True as well.
    DATABASES["default"].setdefault("OPTIONS", {})["prepare_threshold"] = (
        5 if _typed("DATABASE_PREPARED_STATEMENTS", env.bool, True) else None)
    # Under ASGI every request runs its sync code in a thread of its own, so persistent per-thread
    # connections (CONN_MAX_AGE > 0) pile up until PostgreSQL refuses clients ("too many clients";
    # docs/decisions/pool-without-reset-callback.md). Django's documented answer is psycopg's
    # connection pool with CONN_MAX_AGE = 0; DATABASE_POOL_MAX_SIZE=0 turns it off.
    _pool_max = _typed("DATABASE_POOL_MAX_SIZE", env.int, 10, minimum=0)
    if _pool_max:
        DATABASES["default"]["CONN_MAX_AGE"] = 0
        DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
            # A request waits at most this long for a connection (PostgreSQL down: a 503/500
            # after 5 s instead of at once — the price of pooling; Celery's prefork fixup
            # closes the inherited pool in each child).
            "min_size": min(2, _pool_max), "max_size": _pool_max, "timeout": 5,
            # Every max_idle seconds in which some pooled connections sat unused throughout,
            # one of them is closed (down to min_size): how fast a burst's connections go
            # back to PostgreSQL (psycopg-pool's default: 10 minutes).
            "max_idle": _typed("DATABASE_POOL_MAX_IDLE_SECONDS", env.int, 600, minimum=1),
            # No ``reset`` callback: with one, every return goes through the pool's worker
            # thread (switchboard/db/pool_check.py says why that matters).
        }
        # With a pool, Django passes ConnectionPool.check_connection on as the pool's check: a
        # connection is tested when it is handed out. Without it, a restarted PostgreSQL
        # leaves every pooled connection dead and each one fails one request before the pool
        # drops it (system suite). pool_check's version spares the round trip for a connection
        # handed out moments ago whose socket is quiet.
        DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
        pool_check.install_check()
    else:
        DATABASES["default"]["CONN_MAX_AGE"] = _typed("CONN_MAX_AGE", env.int, 60, minimum=0)
        # A restarted PostgreSQL leaves dead persistent connections behind; check before reuse.
        DATABASES["default"]["CONN_HEALTH_CHECKS"] = True

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# -- production posture (metrics access, the reverse proxy, secrets at rest) --------------------
# Production = a configured database and DEBUG off; the embedded default (no DATABASE_URL) and
# DEBUG runs are not. /metrics is off in production unless SWITCHBOARD_METRICS_TOKEN is set
# (superusers always read it); operator secrets need a key of their own there.
SWITCHBOARD_PRODUCTION = not EMBEDDED and not DEBUG
# Windows per endpoint shift schedule (a bound on operator input): a clock in/out derives them all
# under a row lock.
SWITCHBOARD_MAX_SHIFT_WINDOWS = _typed("SWITCHBOARD_MAX_SHIFT_WINDOWS", env.int, 50, minimum=1)
# Reverse proxies whose X-Forwarded-For is believed (switchboard/http/client_address.py): addresses,
# networks, or "unix" for daphne on a unix socket. Empty: the peer is the client.
SWITCHBOARD_TRUSTED_PROXIES = _typed("SWITCHBOARD_TRUSTED_PROXIES", env.list, [])
from switchboard.http.client_address import parse_trusted_proxies  # noqa: E402 - checked at start

parse_trusted_proxies(tuple(SWITCHBOARD_TRUSTED_PROXIES))
if SWITCHBOARD_PRODUCTION:
    if not SWITCHBOARD_SECRETS_KEY.strip(" ,"):
        raise ImproperlyConfigured(
            "SWITCHBOARD_SECRETS_KEY is required in production (DATABASE_URL set, DEBUG off): "
            "a Fernet key of its own for secrets at rest, not derived from SECRET_KEY. Generate "
            "one with: python -c 'from cryptography.fernet import Fernet; "
            "print(Fernet.generate_key().decode())'")
    from cryptography.fernet import Fernet

    for _key in [k.strip() for k in SWITCHBOARD_SECRETS_KEY.split(",") if k.strip()]:
        try:
            Fernet(_key)
        except ValueError:
            raise ImproperlyConfigured(
                "SWITCHBOARD_SECRETS_KEY: not a Fernet key (32 url-safe base64-encoded bytes; "
                "several keys are separated by commas, newest first)") from None

# -- redis: channel layer and Celery ---------------------------------------------------------
REDIS_URL = env.str("REDIS_URL", default="")
# The key prefix of everything this installation keeps in Redis (the channel layer, the rate
# limits, the doorbell counts).
CHANNEL_PREFIX = env.str("CHANNEL_PREFIX", default="sb")
if REDIS_URL:
    if not REDIS_URL.startswith(("redis://", "rediss://", "unix://")):
        raise ImproperlyConfigured("REDIS_URL must start with redis://, rediss:// or unix://")
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer",
            "CONFIG": {"hosts": [REDIS_URL], "prefix": CHANNEL_PREFIX},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

CELERY_BROKER_URL = REDIS_URL or "memory://"
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_TIMEZONE = "UTC"

# -- sign-in throttling (docs/security.md#sign-in-throttling): django-axes -----------------------
# Why django-axes rather than switchboard/ratelimit.py's token bucket: a lockout must count
# failed sign-ins only (a bucket charges every request, so an operator's successful sign-ins
# would spend it), per (username, address) pair, forget them after a success, and be shared by
# every web process in the embedded default too (the bucket falls back to per-process memory
# without Redis). Axes keeps its counters in the database (both backends), sits in front of
# every authenticate() call — the board's /accounts/login/, /admin/login/ and OIDC alike — and
# lists attempts and lockouts in the admin (reset: manage.py axes_reset).
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",  # first: refuses a locked-out sign-in
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = _typed("SWITCHBOARD_SIGNIN_FAILURE_LIMIT", env.int, 10, minimum=1)
AXES_COOLOFF_TIME = timedelta(
    seconds=_typed("SWITCHBOARD_SIGNIN_LOCKOUT_SECONDS", env.int, 900, minimum=1))
# The (username, address) pair locks, never the username alone: otherwise anyone could lock an
# operator out from anywhere by failing their username. The trade-off (guesses spread over many
# addresses are not locked) is why Django's password validators are on; docs/security.md.
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
# The client address is REMOTE_ADDR — the ASGI client, never a header a client could forge
# (named, so that axes never turns to django-ipware's reading of headers should that package
# arrive). Behind the reverse proxy or a tunnel it must be the client's, not the proxy's, or
# one attacker locks every operator out: the ASGI entry point is where a trusted proxy's
# X-Forwarded-For becomes the client (never daphne --proxy-headers, which believes the entry a
# client writes).
AXES_CLIENT_IP_CALLABLE = "switchboard.http.client_address.request_client_address"
AXES_DISABLE_ACCESS_LOG = True  # failures are what lock; no row per successful sign-in
AXES_VERBOSE = False  # no "AXES: BEGIN …" banner on every manage.py call

# -- operator sign-in through OIDC (mozilla-django-oidc), only when OIDC_* is set -------------
OIDC_BACKEND = "accounts.oidc.SubjectOIDCBackend"
OIDC_ENABLED = bool(env.str("OIDC_RP_CLIENT_ID", default=""))
if OIDC_ENABLED:
    _OIDC_REQUIRED = ("OIDC_RP_CLIENT_ID", "OIDC_RP_CLIENT_SECRET", "OIDC_OP_AUTHORIZATION_ENDPOINT",
                      "OIDC_OP_TOKEN_ENDPOINT", "OIDC_OP_USER_ENDPOINT")
    _missing = [name for name in _OIDC_REQUIRED if not env.str(name, default="")]
    if _missing:
        raise ImproperlyConfigured(f"OIDC_RP_CLIENT_ID is set, so these are needed too: {_missing}")
    for _name in _OIDC_REQUIRED:
        globals()[_name] = env.str(_name)
    OIDC_RP_SIGN_ALGO = env.str("OIDC_RP_SIGN_ALGO", default="RS256")
    OIDC_OP_JWKS_ENDPOINT = env.str("OIDC_OP_JWKS_ENDPOINT", default="")
    if OIDC_RP_SIGN_ALGO.startswith("RS") and not OIDC_OP_JWKS_ENDPOINT:
        raise ImproperlyConfigured("OIDC_OP_JWKS_ENDPOINT is needed with OIDC_RP_SIGN_ALGO=RS*")
    OIDC_RP_SCOPES = env.str("OIDC_RP_SCOPES", default="openid email profile")
    INSTALLED_APPS.append("mozilla_django_oidc")
    # Links accounts by the `sub` claim, requires email_verified (accounts/oidc.py).
    AUTHENTICATION_BACKENDS.append(OIDC_BACKEND)
    # No account is created for an unknown subject unless asked for (the library's own
    # setting is OIDC_CREATE_USER, default on).
    OIDC_CREATE_USER = _typed("OIDC_CREATE_USERS", env.bool, False)

# -- auth, i18n, static ----------------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": f"django.contrib.auth.password_validation.{name}"}
    for name in ("UserAttributeSimilarityValidator", "MinimumLengthValidator",
                 "CommonPasswordValidator", "NumericPasswordValidator")
]
LOGIN_URL = "/admin/login/"
LOGIN_REDIRECT_URL = "/todos/"
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
SESSION_COOKIE_HTTPONLY = True
CSRF_COOKIE_HTTPONLY = False

# -- https posture (docs/security.md#https-posture): on whenever the public URL is https ---------
# The supported production shape terminates TLS in the reverse proxy, which sets
# X-Forwarded-Proto (deploy/nginx.conf); only then is that header trusted.
HTTPS = SWITCHBOARD_PUBLIC_URL.startswith("https://")
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = HTTPS
if HTTPS:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    # Off only when the proxy in front cannot say https (TLS ends further out and the proxy
    # forwards X-Forwarded-Proto: http): the redirect would then loop.
    SECURE_SSL_REDIRECT = _typed("SWITCHBOARD_SSL_REDIRECT", env.bool, True)
    # Probes and scrapers ask over plain http on the inside; /mcp and /hooks never redirect
    # (they are served before Django, asgi.py).
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
    SECURE_HSTS_SECONDS = _typed("SWITCHBOARD_HSTS_SECONDS", env.int, 31536000, minimum=0)
    # Domain-wide promises (every subdomain, the browsers' preload list) are the operator's to
    # make, not a default: opt in with these. check --deploy's reminders of them are silenced.
    SECURE_HSTS_INCLUDE_SUBDOMAINS = _typed("SWITCHBOARD_HSTS_INCLUDE_SUBDOMAINS", env.bool, False)
    SECURE_HSTS_PRELOAD = _typed("SWITCHBOARD_HSTS_PRELOAD", env.bool, False)
    SILENCED_SYSTEM_CHECKS = ["security.W005", "security.W021"]
# No inline script or style anywhere (the board's script and style are files), so the policy
# needs no 'unsafe-inline'. Sent on every Django page (switchboard.http.csp).
CONTENT_SECURITY_POLICY = ("default-src 'self'; frame-ancestors 'none'; base-uri 'self'; "
                           "object-src 'none'")

# -- logging: key=value lines; never a bearer, secret or body (docs/operating.md#what-to-watch)
LOG_LEVEL = env.str("LOG_LEVEL", default="INFO").upper()
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"kv": {"()": "switchboard.logfmt.KeyValueFormatter"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "kv"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        "django.db.backends": {"level": "WARNING"},
        # daphne's access log prints full URLs; ours carry no secrets, but keep it quiet.
        "django.channels.server": {"level": "WARNING"},
    },
}
