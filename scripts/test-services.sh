# PostgreSQL and Redis for a test run (sourced by scripts/test).
#
# `start_test_services`, for each of the two:
#   * DATABASE_URL / REDIS_URL set: used as they are.
#   * unset (the default): a private one started here on a free port — a PostgreSQL cluster
#     (initdb in a temporary directory, trust auth, fsync off; the way tests/system/topology.py
#     runs its own) and a redis-server that saves nothing — exported as DATABASE_URL /
#     REDIS_URL and removed when the calling script exits (trap). Whatever runs on this
#     machine's own ports is never used or touched: it may hold someone's data.
#   * unset with SB_TEST_SERVICES=machine (scripts/test --machine-services): this machine's
#     service on 127.0.0.1:5432 / :6379, which must answer.
#   * a private one needed but not installed: says what to install and returns 1, having
#     started nothing.
# SB_TEST_PG_PORT / SB_TEST_REDIS_PORT replace the machine's ports (5432 / 6379) and
# SB_TEST_PG_BINDIR / SB_TEST_REDIS_SERVER the binaries' locations (tests/test_scripts_test_services.py
# probes with them; nothing shared is ever stopped).

port_answers() {  # port_answers PORT: something accepts TCP connections on 127.0.0.1:PORT
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

find_pg_bindir() {  # the newest installed server binaries (Debian keeps them off PATH)
  local dir
  if [ -n "${SB_TEST_PG_BINDIR:-}" ]; then
    [ -x "$SB_TEST_PG_BINDIR/initdb" ] && [ -x "$SB_TEST_PG_BINDIR/pg_ctl" ] && echo "$SB_TEST_PG_BINDIR"
    return
  fi
  dir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
  if [ -n "$dir" ] && [ -x "$dir/initdb" ] && [ -x "$dir/pg_ctl" ]; then
    echo "$dir"
  elif command -v initdb >/dev/null && command -v pg_ctl >/dev/null; then
    dirname "$(command -v initdb)"
  fi
}

find_redis_server() {
  if [ -n "${SB_TEST_REDIS_SERVER:-}" ]; then
    [ -x "$SB_TEST_REDIS_SERVER" ] && echo "$SB_TEST_REDIS_SERVER"
    return
  fi
  command -v redis-server || true
}

as_postgres() {  # initdb refuses to run as root: the cluster runs as the postgres user then
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

stop_test_services() {
  [ -n "${SB_SERVICES_DIR:-}" ] || return 0
  if [ -f "$SB_SERVICES_DIR/redis.pid" ]; then
    local redis_pid
    redis_pid=$(cat "$SB_SERVICES_DIR/redis.pid")
    kill "$redis_pid" 2>/dev/null || true
    # Redis shuts down after the signal, not at it (a loaded machine: seconds), and is no
    # child of this shell to wait for: poll until it is gone, so that nothing outlives the run.
    for _ in $(seq 1 100); do kill -0 "$redis_pid" 2>/dev/null || break; sleep 0.1; done
  fi
  if [ -n "${SB_PG_BINDIR:-}" ] && [ -f "$SB_SERVICES_DIR/pg/data/postmaster.pid" ]; then
    as_postgres "$SB_PG_BINDIR/pg_ctl" -D "$SB_SERVICES_DIR/pg/data" -m immediate -w stop \
      >/dev/null 2>&1 || true
  fi
  rm -rf "$SB_SERVICES_DIR"
  SB_SERVICES_DIR=""
}

start_private_postgres() {
  local dir="$SB_SERVICES_DIR/pg" port
  port=$(free_port)
  mkdir -p "$dir/data" "$dir/sock"
  if [ "$(id -u)" = 0 ]; then
    chmod 755 "$SB_SERVICES_DIR"
    chown -R postgres:postgres "$dir"
  fi
  if ! as_postgres "$SB_PG_BINDIR/initdb" -D "$dir/data" -U postgres -A trust --no-sync -E UTF8 \
      >"$SB_SERVICES_DIR/initdb.log" 2>&1; then
    cat "$SB_SERVICES_DIR/initdb.log" >&2
    return 1
  fi
  if ! as_postgres "$SB_PG_BINDIR/pg_ctl" -D "$dir/data" -l "$dir/postgresql.log" -w -t 60 \
      -o "-p $port -k $dir/sock -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=300" \
      start >/dev/null; then
    cat "$dir/postgresql.log" >&2
    return 1
  fi
  export DATABASE_URL="postgres://postgres@127.0.0.1:$port/switchboard"
  echo "== private PostgreSQL ($SB_PG_BINDIR) on 127.0.0.1:$port, removed at exit" >&2
}

start_private_redis() {
  local port
  port=$(free_port)
  "$SB_REDIS_SERVER" --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
    --daemonize yes --pidfile "$SB_SERVICES_DIR/redis.pid" --dir "$SB_SERVICES_DIR" \
    --logfile "$SB_SERVICES_DIR/redis.log"
  for _ in $(seq 1 100); do
    port_answers "$port" && break
    sleep 0.1
  done
  if ! port_answers "$port"; then
    cat "$SB_SERVICES_DIR/redis.log" >&2
    return 1
  fi
  export REDIS_URL="redis://127.0.0.1:$port/0"
  echo "== private Redis ($SB_REDIS_SERVER) on 127.0.0.1:$port, removed at exit" >&2
}

start_test_services() {
  local pg_port="${SB_TEST_PG_PORT:-5432}" redis_port="${SB_TEST_REDIS_PORT:-6379}"
  local mode="${SB_TEST_SERVICES:-private}" need_pg="" need_redis="" missing=()
  SB_SERVICES_DIR=""
  case "$mode" in
    private|machine) ;;
    *) echo "scripts/test: SB_TEST_SERVICES must be private or machine, not '$mode'" >&2; return 1 ;;
  esac
  if [ "$mode" = machine ]; then
    [ -n "${DATABASE_URL:-}" ] || port_answers "$pg_port" \
      || missing+=("PostgreSQL: nothing answers on 127.0.0.1:$pg_port")
    [ -n "${REDIS_URL:-}" ] || port_answers "$redis_port" \
      || missing+=("Redis: nothing answers on 127.0.0.1:$redis_port")
    if [ "${#missing[@]}" -gt 0 ]; then
      {
        echo "scripts/test --machine-services (SB_TEST_SERVICES=machine) uses this machine's own services, but:"
        printf '  * %s\n' "${missing[@]}"
        echo "Start them, point DATABASE_URL / REDIS_URL at running ones, or leave the flag off for private ones."
      } >&2
      return 1
    fi
    [ -n "${DATABASE_URL:-}" ] || export DATABASE_URL="postgres://postgres@127.0.0.1:$pg_port/switchboard"
    [ -n "${REDIS_URL:-}" ] || export REDIS_URL="redis://127.0.0.1:$redis_port/0"
    return 0
  fi
  if [ -z "${DATABASE_URL:-}" ]; then
    need_pg=1
    SB_PG_BINDIR=$(find_pg_bindir || true)
    [ -n "$SB_PG_BINDIR" ] || missing+=(
      "PostgreSQL's server binaries (initdb, pg_ctl): Debian/Ubuntu: apt-get install postgresql (they land in /usr/lib/postgresql/<version>/bin); macOS: brew install postgresql")
  fi
  if [ -z "${REDIS_URL:-}" ]; then
    need_redis=1
    SB_REDIS_SERVER=$(find_redis_server || true)
    [ -n "$SB_REDIS_SERVER" ] || missing+=(
      "Redis's server (redis-server): Debian/Ubuntu: apt-get install redis-server; macOS: brew install redis")
  fi
  if [ "${#missing[@]}" -gt 0 ]; then
    {
      echo "scripts/test: DATABASE_URL / REDIS_URL are unset, so the tests start private PostgreSQL / Redis,"
      echo "but these are not installed:"
      printf '  * %s\n' "${missing[@]}"
      echo "Install them, point DATABASE_URL / REDIS_URL at running ones, or use this machine's own"
      echo "with scripts/test --machine-services."
    } >&2
    return 1
  fi
  [ -n "$need_pg$need_redis" ] || return 0
  SB_SERVICES_DIR=$(mktemp -d "${TMPDIR:-/tmp}/sb-test-services-XXXXXX")
  trap stop_test_services EXIT
  trap 'exit 130' INT TERM  # so that the EXIT trap runs on ^C too
  local started=$SECONDS
  if [ -n "$need_pg" ]; then start_private_postgres || return 1; fi
  if [ -n "$need_redis" ]; then start_private_redis || return 1; fi
  echo "== private services ready in $(( SECONDS - started )) s" >&2
}
