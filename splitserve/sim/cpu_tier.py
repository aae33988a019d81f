"""The seed's three CPU-tier programs, as closed forms: the work of streaming derender on a
stateless render tier (replaying the history, with and without a parser that rescans), the
CPU cores rendering takes at a rate, and what one image weighs at each hop of the EPD
pipeline. Each function returns rows next to the seed's printed figures."""

from __future__ import annotations

from typing import NamedTuple

from splitserve.sim.specs import ModelSpec

MIB = 2**20


class Row(NamedTuple):
    name: str
    seed: float
    ours: float
    unit: str
    tolerance: float = 0.0  # relative; 0: equal at the seed's printed precision

    @property
    def ok(self) -> bool:
        return abs(self.ours - self.seed) <= self.tolerance * abs(self.seed)


def replay_work(n: int, chars_per_token: int = 4) -> tuple[int, int, int]:
    """Characters parsed to stream `n` output tokens one per chunk: stateful (each new token
    once), stateless replay (the whole history every chunk), replay + a rescan of all the
    accumulated text on every call. Sums in closed form."""
    stateful = chars_per_token * n
    replay = chars_per_token * n * (n + 1) // 2
    rescan = chars_per_token * (n * (n + 1) * (2 * n + 1) // 6 + n * (n + 1) // 2) // 2
    return stateful, replay, rescan


# the seed's table: output tokens -> (stateful, replay, replay + rescan)
SEED_REPLAY = {
    250: (1_000, 125_500, 10_542_000),
    500: (2_000, 501_000, 83_834_000),
    1000: (4_000, 2_002_000, 668_668_000),
    2000: (8_000, 8_004_000, 5_341_336_000),
    4000: (16_000, 32_008_000, 42_698_672_000),
}


def replay_rows() -> list[Row]:
    rows = []
    for n, seed in SEED_REPLAY.items():
        for label, want, got in zip(
            ("stateful", "replay", "replay + rescan"), seed, replay_work(n), strict=True
        ):
            rows.append(Row(f"{n:,} output tokens, {label}", want, got, "chars"))
    growth = replay_work(4000)[2] / replay_work(2000)[2]
    rows.append(Row("replay + rescan growth when n doubles", 8.0, round(growth, 1), "x"))
    rows.append(
        Row("prompt share of each body (100k prompt, 1k output)", 99, round(100 * 100_000 / 101_000), "%")
    )
    return rows


# the guide: ~15 ms of CPU to template and tokenize a 9,000-token chat prompt
GUIDE_US_PER_TOKEN = 15e-3 / 9000 * 1e6
SEED_RENDER = {(9000, 0.4): 0.01, (9000, 73): 1.09, (2000, 500): 1.67, (100_000, 20): 3.33}
SEED_IMAGE_MS = 70.7  # the seed's measured 1080p JPEG -> 640x640 normalized, on its machine


def render_rows(us_per_token: float = GUIDE_US_PER_TOKEN, image_ms: float = SEED_IMAGE_MS) -> list[Row]:
    """CPU cores busy rendering `tokens`-token prompts at `rate` req/s, and the CPU a
    four-image request needs before its encoder can start."""
    rows = [
        Row("text rendering per prompt token", round(GUIDE_US_PER_TOKEN, 1), round(us_per_token, 1), "us")
    ]
    for (tokens, rate), seed in SEED_RENDER.items():
        cores = rate * tokens * us_per_token * 1e-6
        rows.append(Row(f"{tokens:,}-token prompts at {rate:g} req/s", seed, round(cores, 2), "cores"))
    rows.append(Row("4-image request preprocessing", round(4 * SEED_IMAGE_MS), round(4 * image_ms), "ms"))
    return rows


SEED_JPEG_MIB = 0.27  # the seed's photo-like 1080p test image at JPEG quality 85


def payload_rows(lm: ModelSpec, jpeg_bytes: float = SEED_JPEG_MIB * MIB) -> list[Row]:
    """One photo through the EPD pipeline (Qwen2-VL-style preprocessing, `lm` the language
    model): processed pixels, embeddings, the KV cache they become; the wire load."""
    plain = 640 * 640 * 3 * 4  # resize + normalize, float32
    side = 644  # rounded to a multiple of 28 px
    patches = (side // 14) ** 2
    qwen_style = patches * (3 * 2 * 14 * 14) * 4  # each patch doubled along a time axis, float32
    tokens = patches // 4  # 2x2 patches merge into one visual token
    embeddings = tokens * lm.hidden * lm.dtype_bytes
    kv = tokens * lm.kv_bytes_per_token
    rows = [Row("source JPEG", SEED_JPEG_MIB, round(jpeg_bytes / MIB, 2), "MiB")]
    for name, seed_mib, seed_x, size in (
        ("processed pixels, plain 640x640 float32", 4.69, 17, plain),
        ("processed pixels, Qwen2-VL-style patches", 9.49, 35, qwen_style),
        (f"embeddings for {tokens} visual tokens", 3.62, 13, embeddings),
        ("KV cache for those tokens", 28.93, 106, kv),
    ):
        rows.append(Row(name, seed_mib, round(size / MIB, 2), "MiB"))
        # the seed prints its JPEG's size to 0.01 MiB (2%): its ratios carry that uncertainty
        rows.append(Row(f"{name} / JPEG", seed_x, round(size / jpeg_bytes), "x", 0.02))
    for per_s, seed_jpeg, seed_proc in ((10, 0.02, 0.8), (100, 0.23, 8.0)):
        rows.append(
            Row(f"{per_s} images/s as JPEGs", seed_jpeg, round(per_s * jpeg_bytes * 8 / 1e9, 2), "Gb/s")
        )
        rows.append(
            Row(
                f"{per_s} images/s as processed tensors",
                seed_proc,
                round(per_s * qwen_style * 8 / 1e9, 1),
                "Gb/s",
            )
        )
    rows.append(Row("a 2-image request's processed tensors", 19, round(2 * qwen_style / MIB), "MiB"))
    return rows
