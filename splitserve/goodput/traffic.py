"""Offered traffic: when requests arrive and how long their prompts and answers are.

Arrivals come from Python's `random.Random(seed)`: a Poisson process draws
`expovariate(rate)` gaps, exactly the stream the seed's simulator draws, so `sim` replays
the seed's own arrival times and `bench` sends the schedule `sim` predicted for the same
seed. `burstiness` is vLLM's: the gamma shape (1 is Poisson, < 1 burstier, > 1 more
regular; the coefficient of variation is 1 / sqrt(burstiness)).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

ARRIVALS = ("poisson", "gamma", "constant")
_KINDS = ("fixed", "uniform", "normal", "exp", "lognormal", "mix")
_FORMS = (
    "N, LO:HI, uniform:LO:HI, normal:MEAN:STD, exp:MEAN or lognormal:MEDIAN:SIGMA, "
    "or a mixture of them such as 64:256,10%2048:3072"
)


def interarrival_times(
    rate: float, rng: random.Random, arrival: str = "poisson", burstiness: float = 1.0
) -> Iterator[float]:
    """Seconds between consecutive arrivals (mean 1 / rate; 0 for an infinite rate)."""
    if arrival not in ARRIVALS:
        raise ValueError(f"unknown arrival process {arrival!r}: use one of {ARRIVALS}")
    if not rate > 0:
        raise ValueError(f"rate must be positive, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    while True:
        if math.isinf(rate):
            yield 0.0
        elif arrival == "poisson":
            yield rng.expovariate(rate)
        elif arrival == "gamma":
            # shape k, scale 1 / (rate k): mean 1 / rate, coefficient of variation 1 / sqrt(k)
            yield rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        else:
            yield 1.0 / rate


def arrival_times(
    rate: float, n: int, seed: int, arrival: str = "poisson", burstiness: float = 1.0
) -> list[float]:
    """The first `n` arrival times of the process seeded with `seed` (the first arrival
    after one gap, as the seed's simulator). A longer run extends the same stream."""
    gaps = interarrival_times(rate, random.Random(seed), arrival, burstiness)
    t, out = 0.0, []
    for _ in range(n):
        t += next(gaps)
        out.append(t)
    return out


@dataclass(frozen=True)
class Lengths:
    """A token-count distribution: fixed `N`, uniform `LO:HI` (both ends included; also
    `uniform:LO:HI`), `normal:MEAN:STD`, `exp:MEAN`, `lognormal:MEDIAN:SIGMA`. Every draw is
    rounded and at least 1.

    A mixture lists distributions separated by commas, each with its share of the draws:
    `64:256,10%2048:3072` is 90% short chats and 10% long prompts (a part without a share
    takes what the others leave, split evenly among such parts)."""

    kind: str
    a: float
    b: float = 0.0
    parts: tuple[tuple[float, Lengths], ...] = ()  # kind "mix": (share, distribution), shares sum to 1

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown length distribution {self.kind!r}: use {_FORMS}")
        if self.kind == "mix":
            shares = [share for share, _ in self.parts]
            if not shares or any(not share > 0 for share in shares) or abs(sum(shares) - 1) > 1e-9:
                raise ValueError(
                    f"bad mixture {self}: every share must be positive and they must sum to 100%"
                )
            if any(part.kind == "mix" for _, part in self.parts):
                raise ValueError("a mixture's parts cannot be mixtures")
            return
        if self.kind in ("fixed", "uniform") and (self.a < 1 or (self.kind == "uniform" and self.b < self.a)):
            raise ValueError(f"bad lengths {self}: need 1 <= LO <= HI")
        if self.kind != "uniform" and (self.a <= 0 or self.b < 0):
            raise ValueError(f"bad lengths {self}: parameters must be positive")

    @classmethod
    def fixed(cls, n: int) -> Lengths:
        return cls("fixed", n)

    @classmethod
    def mixture(cls, parts: list[tuple[float, Lengths]]) -> Lengths:
        return cls("mix", 0, parts=tuple(parts))

    @classmethod
    def parse(cls, text: str | int) -> Lengths:
        spec = str(text).strip()
        if "," in spec:
            return cls._parse_mixture(spec)
        head, _, rest = spec.partition(":")
        try:
            if not rest:
                return cls("fixed", int(head))
            if head.isdigit():  # LO:HI
                low, high = (int(x) for x in spec.split(":"))
                return cls("uniform", low, high)
            args = [float(x) for x in rest.split(":")]
            if head == "uniform" and len(args) == 2:
                return cls("uniform", int(args[0]), int(args[1]))
            if head in ("normal", "lognormal") and len(args) == 2:
                return cls(head, args[0], args[1])
            if head == "exp" and len(args) == 1:
                return cls("exp", args[0])
        except ValueError as exc:
            raise ValueError(f"bad lengths {spec!r}: use {_FORMS} ({exc})") from None
        raise ValueError(f"bad lengths {spec!r}: use {_FORMS}")

    @classmethod
    def _parse_mixture(cls, spec: str) -> Lengths:
        given: list[tuple[float | None, Lengths]] = []
        for item in spec.split(","):
            share_text, percent, form = item.strip().rpartition("%")
            if not percent:
                given.append((None, cls.parse(form)))
                continue
            try:
                share = float(share_text) / 100
            except ValueError:
                raise ValueError(
                    f"bad share {item.strip()!r} in {spec!r}: give a percentage, e.g. 10%2048"
                ) from None
            given.append((share, cls.parse(form)))
        taken = sum(share for share, _ in given if share is not None)
        open_parts = sum(share is None for share, _ in given)
        if taken > 1 + 1e-9 or (open_parts == 0 and abs(taken - 1) > 1e-9) or (open_parts and taken >= 1):
            raise ValueError(
                f"bad mixture {spec!r}: the shares must sum to 100% (or leave some to a part without one)"
            )
        rest = (1 - taken) / open_parts if open_parts else 0.0
        return cls.mixture([(rest if share is None else share, dist) for share, dist in given])

    @property
    def is_fixed(self) -> bool:
        return self.kind == "fixed"

    def mean(self) -> float:
        """The distribution's mean (before rounding and the floor of 1)."""
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        if self.kind == "lognormal":
            return self.a * math.exp(self.b**2 / 2)
        if self.kind == "mix":
            return sum(share * part.mean() for share, part in self.parts)
        return self.a

    def sample(self, rng: random.Random) -> int:
        if self.kind == "mix":
            draw = rng.random()
            for share, part in self.parts:
                draw -= share
                if draw < 0:
                    return part.sample(rng)
            return self.parts[-1][1].sample(rng)  # rounding left the draw a hair past the last share
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        if self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        elif self.kind == "exp":
            value = rng.expovariate(1.0 / self.a)
        else:
            value = self.a * math.exp(rng.gauss(0.0, self.b))
        return max(1, round(value))

    def __str__(self) -> str:
        if self.kind == "mix":
            return ",".join(f"{share * 100:g}%{part}" for share, part in self.parts)
        if self.kind == "fixed":
            return f"{int(self.a)}"
        if self.kind == "uniform":
            return f"{int(self.a)}:{int(self.b)}"
        return f"{self.kind}:{self.a:g}" + (f":{self.b:g}" if self.kind != "exp" else "")
