"""Inside a Linux sandbox: the loopback listeners that carry traffic to the session's proxies.

The sandbox's network namespace has only `lo`. Two socat listeners on 127.0.0.1 inside it forward
each connection to the Unix sockets of the session's proxies, bound read-only into the sandbox at
`BRIDGE_DIR`. Connecting to those sockets directly reaches the same proxies: there is no way out
that skips the allowlist. Pure: this module only builds argv and environment.

The listeners are started by a small /bin/sh prologue, detached from the command (they are
reparented to the sandbox's PID 1, so the command never sees them as children), and the command is
exec'd only once both are listening, read from /proc/net/tcp, so its first connection cannot race
them. If they do not come up in time the command is not run (exit 125).
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "BRIDGE_DIR",
    "BRIDGE_READY_EXIT",
    "HTTP_PROXY_PORT",
    "SOCKS_PROXY_PORT",
    "bridge_env",
    "bridged_argv",
]

BRIDGE_DIR: Final = "/run/cc-egress"  # where the host's socket directory appears inside
HTTP_PROXY_PORT: Final = 3128  # inside the sandbox, on 127.0.0.1
SOCKS_PROXY_PORT: Final = 1080  # inside the sandbox, on 127.0.0.1
BRIDGE_READY_EXIT: Final = 125  # the command never ran
READY_SPINS: Final = 2000  # builtin-only checks of /proc/net/tcp before sleeping between checks
READY_SLEEPS: Final = 300  # then up to this many 10 ms sleeps (3 s) before giving up

_PROLOGUE = r"""
socat="$1"; shift
( "$socat" TCP-LISTEN:{http},bind=127.0.0.1,reuseaddr,fork UNIX-CONNECT:{dir}/http.sock \
    </dev/null >/dev/null 2>&1 & )
( "$socat" TCP-LISTEN:{socks},bind=127.0.0.1,reuseaddr,fork UNIX-CONNECT:{dir}/socks.sock \
    </dev/null >/dev/null 2>&1 & )
ready() {{
  h=; s=
  while read -r _ local _ st _; do
    [ "$st" = 0A ] || continue
    [ "$local" = 0100007F:{http_hex} ] && h=1
    [ "$local" = 0100007F:{socks_hex} ] && s=1
  done < /proc/net/tcp
  [ -n "$h" ] && [ -n "$s" ]
}}
i=0
until ready; do
  i=$((i + 1))
  if [ "$i" -gt {spins} ]; then
    [ "$i" -gt $(({spins} + {sleeps})) ] && {{
      echo "cc-server: the egress bridge did not start; the command was not run" >&2
      exit {fail}
    }}
    sleep 0.01
  fi
done
exec "$@"
"""


def _script() -> str:
    return _PROLOGUE.format(
        http=HTTP_PROXY_PORT,
        socks=SOCKS_PROXY_PORT,
        http_hex=f"{HTTP_PROXY_PORT:04X}",
        socks_hex=f"{SOCKS_PROXY_PORT:04X}",
        dir=BRIDGE_DIR,
        spins=READY_SPINS,
        sleeps=READY_SLEEPS,
        fail=BRIDGE_READY_EXIT,
    ).strip()


def bridged_argv(socat: str, argv: tuple[str, ...]) -> tuple[str, ...]:
    """`argv` wrapped so that the bridge listens before it runs. `socat` is the probe's path."""
    return ("/bin/sh", "-c", _script(), "cc-egress-bridge", socat, *argv)


def bridge_env(
    http_port: int = HTTP_PROXY_PORT, socks_port: int = SOCKS_PROXY_PORT
) -> dict[str, str]:
    """Proxy variables for the sandboxed command: every common spelling, names resolved by the
    proxy (socks5h), loopback exempt, and git-over-SSH through the SOCKS proxy (netcat-openbsd).
    The ports default to the bridge's; Seatbelt passes the session proxies' own."""
    http = f"http://127.0.0.1:{http_port}"
    socks = f"socks5h://127.0.0.1:{socks_port}"
    no_proxy = "localhost,127.0.0.1,::1"
    return {
        "HTTP_PROXY": http,
        "HTTPS_PROXY": http,
        "http_proxy": http,
        "https_proxy": http,
        "ALL_PROXY": socks,
        "all_proxy": socks,
        "NO_PROXY": no_proxy,
        "no_proxy": no_proxy,
        "GIT_SSH_COMMAND": f"ssh -o ProxyCommand='nc -X 5 -x 127.0.0.1:{socks_port} %h %p'",
    }
