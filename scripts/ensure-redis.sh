#!/usr/bin/env bash
# Makes sure a Redis answers at the given URL (default redis://127.0.0.1:6379/0); starts a local
# one, installing the Debian package if needed, when none does.
set -euo pipefail
url=${1:-redis://127.0.0.1:6379/0}
hostport=${url#redis://}
hostport=${hostport%%/*}
hostport=${hostport##*@}
host=${hostport%%:*}
port=${hostport##*:}
[ "$port" = "$hostport" ] && port=6379

ping() {
  if command -v redis-cli >/dev/null 2>&1; then
    redis-cli -h "$host" -p "$port" ping 2>/dev/null | grep -q PONG
  else
    (exec 3<>"/dev/tcp/$host/$port" && printf 'PING\r\n' >&3 && timeout 2 head -c 5 <&3 | grep -q PONG) 2>/dev/null
  fi
}

if ping; then
  echo "redis: answering at $host:$port"
  exit 0
fi
case "$host" in
  127.0.0.1|localhost|::1) ;;
  *) echo "redis: nothing answers at $host:$port and it is not local; start it there" >&2; exit 1 ;;
esac
if ! command -v redis-server >/dev/null 2>&1; then
  echo "redis: installing redis-server"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null
fi
echo "redis: starting a local server on port $port"
redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --save "" --appendonly no \
  --logfile /tmp/structserve-redis.log
for _ in $(seq 50); do ping && exit 0; sleep 0.1; done
echo "redis: did not come up, see /tmp/structserve-redis.log" >&2
exit 1
