"""What authenticating the KV data plane costs: the keyed MAC (`kv/transport/frame_mac.py`) every
tcp KV frame carries, against copying the same frame once (what the tcp transport does
anyway), including the replay stamp (session and sequence number) the receiver
checks. shm frames carry no data (only a small notification), so their MAC is noise.

Figures: seal (sender) and open (receiver) GiB/s for one layer's frame, a copy's GiB/s,
and the ratio MAC time / copy time last.

Run: .venv/bin/python benchmarks/bench_kv_frame_mac.py [--frame-mib 4 --repeats 30]
"""

from __future__ import annotations

import argparse
import secrets
import time

from splitserve.kv.transport.frame_mac import FrameMac, ReplayGuard, SenderSession


def _best_seconds(action, repeats: int) -> float:
    action()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frame-mib", type=float, default=4.0, help="one layer's KV frame")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    size = int(args.frame_mib * 2**20)
    payload = memoryview(bytearray(secrets.token_bytes(size)))
    frames = [b"PUSH", b'{"transfer_id": "t", "layer": 0, "dst": [1, 2, 3]}', payload]
    mac = FrameMac(secrets.token_urlsafe(32))
    guard, session = ReplayGuard(), SenderSession()
    session.start(guard.issue())

    def seal() -> list:
        return mac.seal([*frames, session.next_stamp()])

    sealed = [seal() for _ in range(args.repeats + 1)]

    def open_next() -> None:  # each message once, in order, as the receiver sees them
        body = mac.open(sealed.pop(0))
        assert body is not None and guard.admit(bytes(body[-1]))

    seal_s = _best_seconds(seal, args.repeats)
    open_s = _best_seconds(open_next, args.repeats)
    copy_s = _best_seconds(lambda: bytearray(payload), args.repeats)
    gib = size / 2**30
    print(f"frame {args.frame_mib:g} MiB, best of {args.repeats}")
    print(f"  seal (sender)   {gib / seal_s:6.2f} GiB/s  {seal_s * 1e3:7.2f} ms")
    print(f"  open (receiver) {gib / open_s:6.2f} GiB/s  {open_s * 1e3:7.2f} ms")
    print(f"  one copy        {gib / copy_s:6.2f} GiB/s  {copy_s * 1e3:7.2f} ms")
    print(f"ratio MAC (seal) / copy time: {seal_s / copy_s:.1f}x")


if __name__ == "__main__":
    main()
