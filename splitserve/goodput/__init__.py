"""What a deployment is asked to serve and what counts as serving it well: one definition of
SLOs, goodput, arrival processes and length distributions, shared by `sim` (which predicts)
and `bench` (which measures). Standard library only, so both can import it."""

from splitserve.goodput.slo import (
    SLO,
    SLO_AVERAGE,
    SLO_KEYS,
    SLO_WORST_GAP,
    distserve_goodput,
    format_duration,
    interpolated_goodput,
    parse_duration,
)
from splitserve.goodput.traffic import ARRIVALS, Lengths, arrival_times, interarrival_times

__all__ = [
    "ARRIVALS",
    "SLO",
    "SLO_AVERAGE",
    "SLO_KEYS",
    "SLO_WORST_GAP",
    "Lengths",
    "arrival_times",
    "distserve_goodput",
    "format_duration",
    "interarrival_times",
    "interpolated_goodput",
    "parse_duration",
]
