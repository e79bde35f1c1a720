# The system packages the browser, MCP-client and system tests need from outside PyPI (sourced
# by scripts/test).
#
# `install_missing_system_packages`: for each tool missing here, names the Debian package and
# what it is for on stderr, then (as root, with apt-get) installs it: one package at a time,
# each named before its install starts. Not root, no apt-get, or SB_TEST_SYSTEM_PACKAGES=no
# (scripts/test --no-system-packages): installs nothing and says what is missing; the tests
# that need it fail.

missing_system_packages() {  # one line per package missing here: PACKAGE<TAB>WHAT IT IS FOR
  command -v chromium >/dev/null 2>&1 || printf 'chromium\tthe browser tests\n'
  # Debian installs nginx in /usr/sbin, which a non-root PATH may lack.
  command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] \
    || printf 'nginx\tthe system suite (tests/system/, behind deploy/nginx.conf)\n'
  if ! command -v npx >/dev/null 2>&1; then
    printf 'nodejs\tthe MCP Inspector and conformance tests (npx)\n'
    printf 'npm\tthe MCP Inspector and conformance tests (npx) and the agent CLIs\n'
  fi
}

install_missing_system_packages() {
  local plan package purpose updated=""
  plan=$(missing_system_packages)
  [ -n "$plan" ] || return 0
  if [ "${SB_TEST_SYSTEM_PACKAGES:-yes}" = no ] || [ "$(id -u)" != 0 ] \
      || ! command -v apt-get >/dev/null 2>&1; then
    echo "scripts/test: not installing these system packages (that needs root and apt-get," \
      "and no --no-system-packages), so the tests that need them fail:" >&2
    while IFS=$'\t' read -r package purpose; do
      echo "  * $package, for $purpose" >&2
    done <<< "$plan"
    return 0
  fi
  while IFS=$'\t' read -r package purpose; do
    echo "scripts/test: installing the system package $package (apt-get, as root), for $purpose" >&2
    if [ -z "$updated" ]; then
      apt-get update -qq >/dev/null
      updated=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$package" >/dev/null
  done <<< "$plan"
}
