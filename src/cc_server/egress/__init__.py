"""Network egress: domain patterns, the allowlist resolver, the address guard, sans-IO HTTP and
SOCKS5 proxy machines, and the asyncio driver that is their only I/O."""
