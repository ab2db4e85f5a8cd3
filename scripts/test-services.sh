#!/usr/bin/env bash
# Start the local services the test suite talks to, if they are not running (idempotent).
# The embedded default needs none; Redis and PostgreSQL back the shared-state tests.
set -euo pipefail
if command -v redis-cli >/dev/null && ! redis-cli -h 127.0.0.1 ping >/dev/null 2>&1; then
  echo "starting redis"
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
fi
if command -v pg_ctlcluster >/dev/null && ! pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then
  echo "starting postgresql"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start
fi
exit 0
