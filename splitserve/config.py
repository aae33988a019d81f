"""Typed, frozen configuration for every tier. Construct once, pass down, never mutate."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

EngineRole = Literal["both", "prefill", "decode", "encoder"]  # encoder: the vision tower only
KVCacheDtype = Literal["auto", "float32", "bfloat16", "float16"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDtype)


@dataclass(frozen=True)
class ModelConfig:
    model: str  # a Hugging Face model directory
    dtype: str | None = None  # None: the dtype config.json names
    # gguf: a GGUF file's Q8_0/Q4_x/K-quant projections stay in their blocks (quant_linear.py);
    # none: dequantized to the dtype; auto: gguf for a GGUF file unless a dtype is named
    quantization: Literal["auto", "gguf", "none"] = "auto"
    device: str | None = None  # None: cuda when present, else cpu
    seed: int = 0
    # CPU: a step of at most this many tokens runs on one thread, larger ones on all of
    # torch's (0, the default: every step on all). One thread paid while each of a step's
    # few hundred parallel regions woke its workers from sleep; with one OpenMP team that
    # spins briefly between regions (splitserve/__init__.py, engine/async_engine.py) a
    # batch-1 decode step reads the weights faster on every core (2 cores, through
    # `serve`: SmolLM2-135M bf16 32.7 -> 20.0 ms, the bench model 8.8 -> 5.1 ms).
    serial_step_tokens: int = 0


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # KV budget in bytes; the number of blocks is derived from it and the model shape.
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    num_blocks: int | None = None  # overrides the budget when set (tests)
    # the KV cache's element type (vLLM's --kv-cache-dtype). auto: the compute dtype; under
    # float32 activations (a quantized GGUF model's) bfloat16 or float16 may be asked for:
    # half the bytes decode attention reads, as llama.cpp's f16 cache (engine/device.py)
    kv_cache_dtype: KVCacheDtype = "auto"
    enable_prefix_caching: bool = True
    # how long a finished request's cached blocks stay prefix hits (None: until reused)
    retention_ttl_s: float | None = None
    # visual-token embeddings kept by image hash (vision-language models)
    encoder_cache_bytes: int = 512 * 1024 * 1024
    # hybrid (Mamba) models: the running requests' state slots (at most max_num_seqs of
    # them), and the state snapshots at block boundaries prefix hits resume from (0: none,
    # and no prefix caching for them)
    state_cache_bytes: int = 512 * 1024 * 1024
    state_snapshot_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # vLLM's name: a prompt computes at most this many tokens in a step that also carries
    # decodes (0: no cap), so a long prefill stalls the running streams for one chunk at a
    # time, never for the whole prompt
    long_prefill_token_threshold: int = 0


# `up`'s engines' default `--long-prefill-token-threshold` (docs/pd.md): a prompt
# prefilled beside streams stalls them 32 tokens at a time.
UP_LONG_PREFILL_TOKEN_THRESHOLD = 32


@dataclass(frozen=True)
class TransferConfig:
    # auto: shm with peers on the same node, tcp with the others (kv/transport/auto.py);
    # nixl: one-sided NIXL WRITEs/READs (kv/transport/nixl.py, `splitserve[nixl]`)
    transport: Literal["shm", "tcp", "nixl", "auto"] = "shm"
    mode: Literal["push", "pull"] = "push"
    timeout_s: float = 30.0
    failure_policy: Literal["recompute", "fail"] = "recompute"
    reservation_ttl_s: float = 60.0
    # decode: requests waiting for remote KV at once, and the share of the pool they may
    # reserve; past either, a new one is refused (429) rather than pinning the cache.
    max_reservations: int = 512
    max_reserved_fraction: float = 0.9
    # the KV peers (host, port) this engine may dial, registered with the deployment
    # (`up` passes every P/D engine's); empty: any peer the (authenticated) proxy names
    allowed_peers: tuple[tuple[str, int], ...] = ()
    node_id: str | None = None  # auto: the node this engine runs on (None: this host's boot ID)
    # how long a send lane's job, and its connection set-up, may make no progress before the
    # peer is declared stalled (None: kv/transport/send_lane.py's STALLED_PEER_S and
    # HANDSHAKE_TIMEOUT_S); never more than timeout_s
    stalled_peer_s: float | None = None
    handshake_timeout_s: float | None = None


@dataclass(frozen=True)
class KVEventsConfig:
    """Where an engine publishes its KV cache events (vLLM's KVEventsConfig names)."""

    endpoint: str  # ZMQ PUB bind address, e.g. tcp://*:5557
    replay_endpoint: str  # ZMQ ROUTER bind address answering replay requests
    topic: str = ""
    buffer_steps: int = 10_000  # batches kept for replay


@dataclass(frozen=True)
class AfdConfig:
    """Attention-FFN disaggregation: this engine's sparse MoE layers run their experts on
    the FFN daemon at ffn_host:ffn_port (`splitserve engine --role ffn`); the engine loads
    no expert weights."""

    ffn_host: str
    ffn_port: int
    timeout_s: float = 30.0  # for an answer to one layer (and to HELLO at start-up)
    # a decode step of >= 2 sequences as two micro-batches, one's MoE traffic hidden
    # behind the other's attention (afd/microbatch.py); 1: the whole step at once
    microbatches: int = 1
    # how a layer's tensors travel: shm (a shared-memory segment, the daemon on this host),
    # tcp (ZeroMQ frames), auto (shm when the daemon can map the segment, else tcp)
    transport: Literal["shm", "tcp", "auto"] = "auto"

    def __post_init__(self) -> None:
        if self.microbatches not in (1, 2):
            raise ValueError(f"AFD micro-batches must be 1 or 2, not {self.microbatches}")
        if self.transport not in ("shm", "tcp", "auto"):
            raise ValueError(f"the AFD transport must be shm, tcp or auto, not {self.transport!r}")


@dataclass(frozen=True)
class CpuLendingConfig:
    """Idle CPUs lent between engines pinned on one host (engine/cpu_lending.py; `up`
    sets it): a lender's CPUs serve its borrowers' large steps while it has no work."""

    lend_file: str | None = None  # this engine lends its CPUs while idle, through this file
    borrow_files: tuple[str, ...] = ()  # the lenders this engine may borrow from


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    role: EngineRole = "both"
    transfer: TransferConfig = field(default_factory=TransferConfig)
    kv_events: KVEventsConfig | None = None  # None: publish no KV events
    afd: AfdConfig | None = None  # None: the experts run here (collocated)
    cpu_lending: CpuLendingConfig = field(default_factory=CpuLendingConfig)

    def __post_init__(self) -> None:
        # shm maps decode's KV pool as a shared-memory file: it needs the pool in CPU memory
        device = self.model.device or "cpu"
        if self.role != "both" and self.transfer.transport == "shm" and not device.startswith("cpu"):
            raise ValueError(
                f"the shm KV transport needs the KV cache in CPU memory, but the device is {device}: "
                "use --kv-transport tcp"
            )
