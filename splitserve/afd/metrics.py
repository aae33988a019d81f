"""The attention engine's AFD metrics on its /metrics, one observation per engine step
that called the FFN daemon: the bytes it sent and received, the time the step was held up
by the daemon (sending and waiting: what no micro-batch overlap hid) and the communication
in it (that time less the daemon's compute), and the tokens routed to each expert (summed
over the sparse layers); and counters of the layers sent again, of the answers that
missed their deadline (a stuck daemon), and of the layers whose tensors went through
shared memory (the bytes count the same either way)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from splitserve.afd.ffn_client import AfdTotals, FfnClient

PREFIX = "splitserve_afd"
BYTE_BUCKETS = tuple(float(1 << n) for n in range(10, 31, 2))  # 1 KiB .. 1 GiB
SECOND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)


class AfdStepMetrics:
    """A step listener (AsyncEngine.add_step_listener) over the engine's FfnClient."""

    def __init__(self, client: FfnClient, registry: CollectorRegistry) -> None:
        self.client = client
        self.last: AfdTotals = client.totals()
        r = registry
        self.bytes_sent = Histogram(
            f"{PREFIX}_step_bytes_sent",
            "Tensor bytes sent to the FFN daemon per step (hidden states and routing).",
            buckets=BYTE_BUCKETS,
            registry=r,
        )
        self.bytes_received = Histogram(
            f"{PREFIX}_step_bytes_received",
            "Tensor bytes received from the FFN daemon per step (the experts' output).",
            buckets=BYTE_BUCKETS,
            registry=r,
        )
        self.exposed = Histogram(
            f"{PREFIX}_step_exposed_communication_seconds",
            "Per step: the time held up by the FFN daemon less its compute of the step's layers.",
            buckets=SECOND_BUCKETS,
            registry=r,
        )
        self.blocked = Histogram(
            f"{PREFIX}_step_blocked_seconds",
            "Per step: the time spent sending MoE layers to the FFN daemon and waiting for them.",
            buckets=SECOND_BUCKETS,
            registry=r,
        )
        self.remote_compute = Histogram(
            f"{PREFIX}_step_remote_compute_seconds",
            "Per step: the FFN daemon's compute of this engine's layers.",
            buckets=SECOND_BUCKETS,
            registry=r,
        )
        self.expert_tokens = Histogram(
            f"{PREFIX}_step_expert_tokens",
            "Per step and expert: the tokens routed to it, summed over the sparse layers.",
            ["expert"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.resent = Counter(
            f"{PREFIX}_layers_resent", "Layers sent again to an FFN daemon that came back.", registry=r
        )
        self.deadlines_missed = Counter(
            f"{PREFIX}_deadlines_missed",
            "Layer answers the FFN daemon did not give by their deadline (stopped, wedged, slow).",
            registry=r,
        )

        self.shm_layers = Counter(
            f"{PREFIX}_shm_layers",
            "Layers whose tensors went to the FFN daemon and back through shared memory.",
            registry=r,
        )

    def on_step(self, _step_time_s: float, _num_tokens: int) -> None:
        now, last = self.client.totals(), self.last
        self.last = now
        if now.layers == last.layers:
            return  # a step that called no sparse layer
        self.bytes_sent.observe(now.bytes_sent - last.bytes_sent)
        self.bytes_received.observe(now.bytes_received - last.bytes_received)
        blocked = now.blocked_s - last.blocked_s
        compute = now.remote_compute_s - last.remote_compute_s
        # with two micro-batches the daemon's compute may hide behind attention too: then
        # this is the least the communication can have been
        self.exposed.observe(max(0.0, blocked - compute))
        self.blocked.observe(blocked)
        self.remote_compute.observe(compute)
        before = last.expert_tokens or (0,) * len(now.expert_tokens)
        for expert, (tokens, earlier) in enumerate(zip(now.expert_tokens, before, strict=True)):
            self.expert_tokens.labels(expert=str(expert)).observe(tokens - earlier)
        if now.reconnects > last.reconnects:
            self.resent.inc(now.reconnects - last.reconnects)
        if now.deadlines_missed > last.deadlines_missed:
            self.deadlines_missed.inc(now.deadlines_missed - last.deadlines_missed)
        if now.shm_layers > last.shm_layers:
            self.shm_layers.inc(now.shm_layers - last.shm_layers)
