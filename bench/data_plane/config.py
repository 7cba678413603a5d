"""What one run of the data-plane benchmark measures (`BenchConfig`, `QUICK`), the three paths and
their labels, the stream names and the targets; its progress line."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Final

from bench import common

ROOT: Final = Path(__file__).resolve().parents[2]
RUN: Final = "bench"
GROUP: Final = "reward"  # the consumer group of one scoring stage
CONSUMER: Final = "bench-1"
MB: Final = 1e6  # MB/s are 10^6 bytes per second
PATHS: Final = ("rlfleet", "raw_sync", "raw_async")
TENSORS: Final = (
    "prompt_ids", "prompt_mask", "response_ids", "response_mask", "behaviour_logprobs", "group_ids",
)
PATH_LABELS: Final = {
    "rlfleet": "rlfleet (codec+Bus)",
    "raw_sync": "raw redis-py sync",
    "raw_async": "raw redis-py asyncio",
}
# The budget for everything that talks to Redis; the local loop has its own limit.
REDIS_PHASES_TIMEOUT_S: Final = 300.0
TRANSPORT_TARGET: Final = 0.10  # "transport adds < 10% to a step of the tiny run"
NOISY_HOST: Final = 0.10  # warn when other processes took more than this share of the CPUs' user time


@dataclass(frozen=True)
class BenchConfig:
    batches: int = 50  # measured batches per path, in each mode
    warmup: int = 3  # unmeasured batches before them (connections, allocator, caches)
    in_flight: int = 4  # K for the throughput mode
    rounds: int = 5  # throughput passes per path, taking turns with the other paths
    seqs: int = 256
    prompt_len: int = 64
    response_len: int = 1024
    group_size: int = 8
    tiny_config: str = "examples/tiny-cpu.yaml"
    tiny_prompt_len: int = 6  # tokens of an arithmetic prompt such as "12+7="
    tiny_hops: int = 100  # measured hops of each tiny message kind
    local_loop: bool = True
    local_steps: int = 10
    local_warmup_steps: int = 2  # left out of the step-time median
    local_timeout_s: float = 45.0
    seed: int = 0


QUICK: Final = BenchConfig(batches=10, warmup=2, rounds=2, tiny_hops=30, local_steps=5, local_timeout_s=20.0)


say = partial(common.say, tag="data_plane", err=True)
