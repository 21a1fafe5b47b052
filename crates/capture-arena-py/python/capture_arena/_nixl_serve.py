"""A producer's NIXL server process: ``python -m capture_arena._nixl_serve NAME LEN AGENT``.

An arena served through NIXL (``SGLANG_SPEC_CAPTURE_TRANSPORT=nixl``) is registered with a NIXL
agent in a process of its own, started by the producer: UCX runs there, so whatever a trainer or
the network makes UCX do (over TCP the serving side emulates READs, and aborts on an error it
cannot hand to anyone) ends this process, not the inference server. It maps the producer's
shared memory, says where and with which agent on a stdout line of its own, and serves until its
stdin closes. ``SGLANG_SPEC_CAPTURE_NIXL_SERVER=inline`` serves in the producer's process instead.
"""

from __future__ import annotations

import sys

from . import _capture_arena


def main(argv: list[str]) -> int:
    if len(argv) != 3 or not argv[1].isdigit():
        print("usage: python -m capture_arena._nixl_serve NAME LEN AGENT", file=sys.stderr)
        return 2
    serve = getattr(_capture_arena, "_nixl_serve", None)
    if serve is None:
        print("this build of capture_arena has no nixl feature", file=sys.stderr)
        return 2
    serve(argv[0], int(argv[1]), argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
