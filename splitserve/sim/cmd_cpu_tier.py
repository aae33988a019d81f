"""`splitserve sim cpu-tier` and `splitserve sim payload`: the seed's stateless-replay work
table, its CPU render-cost table and its image payload table, the seed's figures next to
ours. Exit 1 if one differs."""

from __future__ import annotations

import argparse

from splitserve.sim import cpu_tier
from splitserve.sim.cmd_common import emit, require_positive
from splitserve.sim.specs import load_model


def _num(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,g}"


def _table(args: argparse.Namespace, sections: dict[str, list[cpu_tier.Row]]) -> int:
    lines, data, failed = [], {}, []
    for title, rows in sections.items():
        lines += [title, f"  {'':58s} {'seed':>16s} {'splitserve':>16s}"]
        for r in rows:
            if not r.ok:
                failed.append(r.name)
            mark = "" if r.ok else "DIFFERS"
            lines.append(f"  {r.name:58s} {_num(r.seed):>16s} {_num(r.ours):>16s} {r.unit:5s} {mark}")
        data[title] = [r._asdict() for r in rows]
    emit(args, {"sections": data, "differ": failed}, lines)
    return 1 if failed else 0


def cmd_cpu_tier(args: argparse.Namespace) -> int:
    require_positive(us_per_token=args.us_per_token, image_ms=args.image_ms)
    return _table(
        args,
        {
            "Streaming derender work on a stateless render tier (characters parsed)": cpu_tier.replay_rows(),
            "CPU cores busy rendering (text), and image preprocessing": cpu_tier.render_rows(
                args.us_per_token, args.image_ms
            ),
        },
    )


def cmd_payload(args: argparse.Namespace) -> int:
    require_positive(jpeg_bytes=args.jpeg_bytes)
    rows = cpu_tier.payload_rows(load_model(args.model), args.jpeg_bytes)
    return _table(args, {"One photo through the EPD pipeline": rows})
