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
def _origin(name, value, *, allow_path=False):
    """``value`` as the browser origin it names, or ImproperlyConfigured naming ``name``."""
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
SWITCHBOARD_INGEST_RATE_PER_MINUTE = _typed(
    "SWITCHBOARD_INGEST_RATE_PER_MINUTE", env.int, 600, minimum=1
)
SWITCHBOARD_MCP_RATE_PER_MINUTE = _typed("SWITCHBOARD_MCP_RATE_PER_MINUTE", env.int, 6000, minimum=1)
SWITCHBOARD_INGEST_FAILURES_PER_MINUTE = _typed(
    "SWITCHBOARD_INGEST_FAILURES_PER_MINUTE", env.int, 60, minimum=1
)
SWITCHBOARD_UNKNOWN_CLIENT_PER_MINUTE = _typed(
    "SWITCHBOARD_UNKNOWN_CLIENT_PER_MINUTE", env.int, 60, minimum=1
)
SWITCHBOARD_UNSIGNED_MAX_BODY_BYTES = _typed(
    "SWITCHBOARD_UNSIGNED_MAX_BODY_BYTES", env.int, 64 * 1024, minimum=1
)
SWITCHBOARD_REPLAY_WINDOW = timedelta(
    days=_typed("SWITCHBOARD_REPLAY_WINDOW_DAYS", env.int, 7, minimum=1)
)
SWITCHBOARD_DELIVERY_LOG_REFUSED_PER_MINUTE = _typed(
    "SWITCHBOARD_DELIVERY_LOG_REFUSED_PER_MINUTE", env.int, 60, minimum=0
)
SWITCHBOARD_MCP_MAX_RESULT_BYTES = _typed(
    "SWITCHBOARD_MCP_MAX_RESULT_BYTES", env.int, 8 * 1024 * 1024, minimum=64 * 1024
)
SWITCHBOARD_MCP_SESSION_IDLE = timedelta(
    seconds=_typed("SWITCHBOARD_MCP_SESSION_IDLE_SECONDS", env.int, 3600, minimum=60)
)
SWITCHBOARD_STREAM_KEEPALIVE_SECONDS = _typed(
    "SWITCHBOARD_STREAM_KEEPALIVE_SECONDS", env.float, 15.0, minimum=0.1)
SWITCHBOARD_STREAM_LEASE_SECONDS = _typed(
    "SWITCHBOARD_STREAM_LEASE_SECONDS", env.float, 300.0, minimum=1.0)
SWITCHBOARD_MAX_SESSIONS_PER_CREDENTIAL = _typed(
    "SWITCHBOARD_MAX_SESSIONS_PER_CREDENTIAL", env.int, 32, minimum=1)
SWITCHBOARD_MAX_OPEN_STREAMS = _typed("SWITCHBOARD_MAX_OPEN_STREAMS", env.int, 4, minimum=1)
SWITCHBOARD_MAX_LONG_POLLS_PER_SESSION = _typed(
    "SWITCHBOARD_MAX_LONG_POLLS_PER_SESSION", env.int, 4, minimum=1)
SWITCHBOARD_MAX_LONG_POLLS_PER_CREDENTIAL = _typed(
    "SWITCHBOARD_MAX_LONG_POLLS_PER_CREDENTIAL", env.int, 32, minimum=1)
SWITCHBOARD_ATTACH_WINDOW = timedelta(
    seconds=_typed("SWITCHBOARD_ATTACH_WINDOW_SECONDS", env.int, 120, minimum=1)
)
SWITCHBOARD_STREAM_BUFFER_BYTES = _typed(
    "SWITCHBOARD_STREAM_BUFFER_BYTES", env.int, 256 * 1024, minimum=1024
)
SWITCHBOARD_LONG_POLL_KEEPALIVE_SECONDS = _typed(
    "SWITCHBOARD_LONG_POLL_KEEPALIVE_SECONDS", env.float, 15.0, minimum=0.05)
# -- retention (docs/operating.md#retention): what the hourly prune deletes, and after how long --
SWITCHBOARD_RETAIN_DONE = timedelta(
    days=_typed("SWITCHBOARD_RETAIN_DONE_DAYS", env.int, 30, minimum=1)
)
_retain_dead_days = _typed("SWITCHBOARD_RETAIN_DEAD_DAYS", env.int, 0, minimum=0)
SWITCHBOARD_RETAIN_DEAD = timedelta(days=_retain_dead_days) if _retain_dead_days else None
SWITCHBOARD_RETAIN_ENDED_SESSIONS = timedelta(days=1)
SWITCHBOARD_RETAIN_DELIVERY_LOG = timedelta(
    days=_typed("SWITCHBOARD_RETAIN_DELIVERY_LOG_DAYS", env.int, 30, minimum=1)
)
SWITCHBOARD_SECRETS_KEY = env.str("SWITCHBOARD_SECRETS_KEY", default="")
SWITCHBOARD_METRICS_TOKEN = env.str("SWITCHBOARD_METRICS_TOKEN", default="")
# Write-back (docs/write-back.md) goes to https only; plain http to a loopback address is for a
# local stand-in of a source, which only the test settings allow.
SWITCHBOARD_WRITE_BACK_LOOPBACK_HTTP = False

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
    "switchboard.health.DatabaseUnavailableMiddleware",  # first: a 503, never a 500
    "django.middleware.security.SecurityMiddleware",
    "switchboard.http.query_text.UnstorableQueryMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "switchboard.http.csp.ContentSecurityPolicyMiddleware",
    "axes.middleware.AxesMiddleware",  # last, as django-axes requires
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

# -- database (why these options: docs/configuration.md#why-the-fixed-settings-are-what-they-are)
SQLITE_OPTIONS = {
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
    _sqlite_file = Path(DATABASES["default"]["NAME"])
    _sqlite_file.parent.mkdir(parents=True, exist_ok=True)  # a fresh clone has no var/ yet
    for _suffix in ("", "-wal", "-shm"):
        _path = Path(f"{_sqlite_file}{_suffix}")
        if (not _suffix or _path.exists()) and str(_sqlite_file) != ":memory:":
            _make_private_file(_path)
    DATABASES["default"].setdefault("TEST", {})["NAME"] = str(
        _sqlite_file.with_name("test_" + _sqlite_file.name))
else:
    DATABASES["default"].setdefault("OPTIONS", {})["prepare_threshold"] = (
        5 if _typed("DATABASE_PREPARED_STATEMENTS", env.bool, True) else None)
    _pool_max = _typed("DATABASE_POOL_MAX_SIZE", env.int, 10, minimum=0)
    if _pool_max:
        DATABASES["default"]["CONN_MAX_AGE"] = 0
        DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
            "min_size": min(2, _pool_max), "max_size": _pool_max, "timeout": 5,
            "max_idle": _typed("DATABASE_POOL_MAX_IDLE_SECONDS", env.int, 600, minimum=1),
        }
        DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
        pool_check.install_check()
    else:
        DATABASES["default"]["CONN_MAX_AGE"] = _typed("CONN_MAX_AGE", env.int, 60, minimum=0)
        DATABASES["default"]["CONN_HEALTH_CHECKS"] = True

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# -- production posture (metrics access, the reverse proxy, secrets at rest) --------------------
SWITCHBOARD_PRODUCTION = not EMBEDDED and not DEBUG
SWITCHBOARD_MAX_SHIFT_WINDOWS = _typed("SWITCHBOARD_MAX_SHIFT_WINDOWS", env.int, 50, minimum=1)
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
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",  # first: refuses a locked-out sign-in
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = _typed("SWITCHBOARD_SIGNIN_FAILURE_LIMIT", env.int, 10, minimum=1)
AXES_COOLOFF_TIME = timedelta(
    seconds=_typed("SWITCHBOARD_SIGNIN_LOCKOUT_SECONDS", env.int, 900, minimum=1))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
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
    AUTHENTICATION_BACKENDS.append(OIDC_BACKEND)
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
HTTPS = SWITCHBOARD_PUBLIC_URL.startswith("https://")
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = HTTPS
if HTTPS:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = _typed("SWITCHBOARD_SSL_REDIRECT", env.bool, True)
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
    SECURE_HSTS_SECONDS = _typed("SWITCHBOARD_HSTS_SECONDS", env.int, 31536000, minimum=0)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = _typed("SWITCHBOARD_HSTS_INCLUDE_SUBDOMAINS", env.bool, False)
    SECURE_HSTS_PRELOAD = _typed("SWITCHBOARD_HSTS_PRELOAD", env.bool, False)
    SILENCED_SYSTEM_CHECKS = ["security.W005", "security.W021"]
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
        "django.channels.server": {"level": "WARNING"},
        # httpx logs every request it sends; write-back logs its own line for each, with the
        # method, path and status only (ingest/outbound.py), so httpx's would say it twice.
        "httpx": {"level": "WARNING"},
    },
}
