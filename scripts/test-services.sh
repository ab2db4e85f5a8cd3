#!/usr/bin/env bash
# Start the local services the test suite talks to (idempotent): Redis on 127.0.0.1:6379 and PostgreSQL on
# 127.0.0.1:5432 (trust auth, database `test`). Installs them from Debian's packages if the machine lacks them.
# The embedded default (`corral up`) needs neither.
set -euo pipefail

install() {
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  else
    echo "missing $*: install it (Debian: apt-get install $*)" >&2
    exit 1
  fi
}

# Servers and checkers the deploy tests run for real: NGINX (the TLS edge), docker-compose (validates the
# rendered Compose file; no Docker engine needed), systemd-analyze (verifies the rendered unit).
missing=()
command -v nginx >/dev/null || missing+=(nginx-light)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v systemd-analyze >/dev/null || missing+=(systemd)
# Prometheus and promtool: the alert rules' unit tests and a real scrape of a cluster (tests/observe/).
command -v promtool >/dev/null || missing+=(prometheus)
# Chromium and its WebDriver: the web console's browser test (tests/gateway/test_console.py).
command -v chromium >/dev/null || missing+=(chromium)
command -v chromedriver >/dev/null || missing+=(chromium-driver)
if [ ${#missing[@]} -gt 0 ]; then install "${missing[@]}"; fi
# The tests run their own NGINX and Prometheus instances on free ports; packaged ones are left alone.

# The agent CLIs the dialect tests drive against a simulated cluster (tests/dialects/test_agent_clis.py):
# Codex and Claude Code from npm, pinned, into corral's cache (installed once; node comes from Debian).
AGENTS="${CORRAL_AGENT_CLIS:-$HOME/.cache/corral/agent-clis}"
command -v npm >/dev/null || install nodejs npm
if [ ! -x "$AGENTS/node_modules/.bin/codex" ] || [ ! -x "$AGENTS/node_modules/.bin/claude" ]; then
  echo "installing the agent CLIs (Codex, Claude Code) into $AGENTS"
  mkdir -p "$AGENTS"
  (cd "$AGENTS" && npm install --silent --no-audit --no-fund \
    @openai/codex@0.171.0 @anthropic-ai/claude-code@2.1.197 >/dev/null)
fi

command -v redis-server >/dev/null || install redis-server
if ! redis-cli -h 127.0.0.1 ping >/dev/null 2>&1; then
  echo "starting redis"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
fi

command -v pg_ctlcluster >/dev/null || install postgresql
if ! pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then
  echo "starting postgresql"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start
fi
for _ in $(seq 30); do pg_isready -h 127.0.0.1 -p 5432 -q && break; sleep 1; done
if ! psql -h 127.0.0.1 -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname='test'" 2>/dev/null | grep -q 1; then
  psql -h 127.0.0.1 -U postgres -c "CREATE DATABASE test" >/dev/null 2>&1 || true
fi
exit 0
