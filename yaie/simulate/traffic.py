"""Requests to simulate: synthetic traffic (Poisson or bursty arrivals, closed-loop clients,
length ranges, a shared prompt prefix, multi-turn sessions) or a JSONL trace.

Prompts are made of token ids, not lengths, because the prefix cache keys on ids: requests that
share a prefix share its ids (drawn once from a common stream), everything else is drawn fresh.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

VOCAB_SIZE = 32000  # ids are only compared for equality; any vocabulary far above the lengths will do


@dataclass
class Turn:
    """A session's next user message: sent `think_s` after the previous answer ends, on top of the
    whole conversation so far (which is why sessions profit from prefix caching)."""

    user_token_ids: list[int]
    output_len: int
    think_s: float
    next_turn: Turn | None = None


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    output_len: int
    arrival_s: float = 0.0  # ignored with closed-loop clients
    next_turn: Turn | None = None


@dataclass
class Traffic:
    requests: list[Request]
    # Closed loop: this many clients each keep one request in flight, sending the next as soon as
    # theirs ends (how `yaie bench` loads a server). None: requests arrive at their arrival_s.
    clients: int | None = None
    # Prompts the engine served before this traffic (a warm-up, an earlier benchmark level): with
    # prefix caching their blocks are in the cache when it starts, as they are in a live server's.
    history: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class TrafficSpec:
    num_requests: int = 200
    arrival: str = "poisson"  # poisson | bursty | closed
    rate: float = 4.0  # requests per second (poisson, bursty)
    burst_size: int = 8  # bursty: requests arriving together; bursts are Poisson at rate / burst_size
    clients: int = 8  # closed
    prompt_len: tuple[int, int] = (512, 2048)  # uniform, inclusive
    output_len: tuple[int, int] = (128, 512)
    shared_prefix: float = 0.0  # fraction of every prompt taken from one common prefix
    turns: int = 1  # per session; later turns add a user message of prompt_len / 4
    think_s: float = 5.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arrival not in ("poisson", "bursty", "closed"):
            raise ValueError(f"arrival must be poisson, bursty or closed, got {self.arrival!r}")
        for name, (low, high) in (("prompt_len", self.prompt_len), ("output_len", self.output_len)):
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be a range LOW:HIGH with 1 <= LOW <= HIGH, got {low}:{high}")
        if not 0.0 <= self.shared_prefix <= 1.0:
            raise ValueError(f"shared_prefix must be a fraction in [0, 1], got {self.shared_prefix}")
        if self.rate <= 0 or self.num_requests < 1 or self.turns < 1 or self.clients < 1:
            raise ValueError("rate, num_requests, turns and clients must be positive")


def synthetic_traffic(spec: TrafficSpec) -> Traffic:
    rng = random.Random(spec.seed)
    shared = _tokens(rng, spec.prompt_len[1])

    def prompt(length: int) -> list[int]:
        num_shared = int(spec.shared_prefix * length)
        return shared[:num_shared] + _tokens(rng, length - num_shared)

    requests = []
    clock = 0.0
    for index in range(spec.num_requests):
        if spec.arrival == "poisson":
            clock += rng.expovariate(spec.rate)
        elif spec.arrival == "bursty" and index % spec.burst_size == 0:
            clock += rng.expovariate(spec.rate / spec.burst_size)
        next_turn = None
        for _ in range(spec.turns - 1):  # built last turn first, each pointing at the one after
            user = _tokens(rng, max(1, rng.randint(*spec.prompt_len) // 4))
            next_turn = Turn(user, rng.randint(*spec.output_len), spec.think_s, next_turn)
        prompt_ids = prompt(rng.randint(*spec.prompt_len))
        requests.append(Request(f"r{index}", prompt_ids, rng.randint(*spec.output_len), clock, next_turn))
    return Traffic(requests, spec.clients if spec.arrival == "closed" else None)


def load_trace(path: Path, clients: int | None = None, seed: int = 0) -> Traffic:
    """A JSONL trace, one request a line: {"arrival_s": 0.25, "prompt_len": 812, "output_len": 200},
    optionally "shared_prefix_len" (tokens shared with every request that has one; a system prompt)
    or "prompt_token_ids" (the real ids, which makes prefix sharing exact)."""
    rng = random.Random(seed)
    shared: list[int] = []
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            if "prompt_token_ids" in entry:
                ids = [int(t) for t in entry["prompt_token_ids"]]
            else:
                length, num_shared = int(entry["prompt_len"]), int(entry.get("shared_prefix_len", 0))
                shared += _tokens(rng, max(0, num_shared - len(shared)))
                ids = shared[:num_shared] + _tokens(rng, length - num_shared)
            request = Request(
                str(entry.get("request_id", f"t{number}")), ids, int(entry["output_len"]),
                float(entry.get("arrival_s", 0.0)),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{number}: not a trace entry ({exc!r}): {line[:80]}") from exc
        if not request.prompt_token_ids or request.output_len < 1:
            raise ValueError(f"{path}:{number}: a request needs a prompt and at least one output token")
        requests.append(request)
    if not requests:
        raise ValueError(f"{path} holds no requests")
    requests.sort(key=lambda r: r.arrival_s)
    return Traffic(requests, clients)


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(1, VOCAB_SIZE) for _ in range(count)]
