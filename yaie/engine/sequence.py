"""One sequence: one of a request's n choices, as the scheduler runs it. Token ids and KV
bookkeeping only, no tensors, so the scheduler that moves sequences around stays pure Python.

A sequence generates (its params are `SamplingParams`) or pools (`PoolingParams`: an embedding,
its prompt computed once and never sampled from)."""

from __future__ import annotations

import enum
from typing import Any

from yaie.pooling_params import PoolingParams
from yaie.sampling_params import SamplingParams

# Whom the requests of a server without API keys (and of the offline `LLM`) come from: one tenant.
ANONYMOUS_TENANT = "anonymous"


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the model's context
    FINISHED_ABORTED = "abort"
    FINISHED_TIMEOUT = "timeout"  # its request's deadline passed (the request's `timeout`)

    @property
    def finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)


class Sequence:
    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        request_id: str | None = None,
        index: int = 0,
        priority: int = 0,
        tenant: str = ANONYMOUS_TENANT,
        cache_salt: str | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = seq_id if request_id is None else request_id  # the Request it belongs to
        self.index = index  # which of the request's n choices it is
        self.prompt_token_ids = list(prompt_token_ids)
        # Under the priority policy: lower runs first (vLLM's convention); ties go by arrival.
        self.priority = priority
        # Who sent its request (the API key's tenant): the scheduler shares the engine fairly
        # between tenants, and a tenant's prompts are matched only by its own in the prefix cache.
        self.tenant = tenant
        # vLLM's `cache_salt`: the request's prompt shares prefix-cache blocks only with requests of
        # the same tenant and the same salt (e.g. the users behind one API key, kept apart).
        self.cache_salt = cache_salt
        self.arrival = 0  # the scheduler's arrival order, stamped by Scheduler.add
        self.params = params
        self.status = SequenceStatus.WAITING
        # Prompt followed by every generated token: what the KV cache must eventually hold.
        self.all_token_ids = list(prompt_token_ids)
        # KV bookkeeping: the blocks this sequence holds (in order) and how many of its tokens
        # already have their K/V written there.
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        # Prompt tokens whose KV came from the prefix cache instead of being computed.
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        # A torch.Generator for a seeded choice (set by the engine; the sampler draws from it).
        # Typed loosely so that this module, and the scheduler, never import torch.
        self.generator: Any = None
        # A grammar matcher (yaie/structured/backend.py) for a choice with structured outputs:
        # the sampler masks by it, the output processor advances it.
        self.grammar: Any = None

    @property
    def sampling_params(self) -> SamplingParams:
        """A generating sequence's parameters. Only sequences that sample ask for them."""
        if not isinstance(self.params, SamplingParams):
            raise TypeError(f"{self.seq_id} is a pooling sequence: it has no sampling parameters")
        return self.params

    @property
    def pooling_params(self) -> PoolingParams | None:
        """A pooling sequence's parameters; None for one that generates."""
        return self.params if isinstance(self.params, PoolingParams) else None

    @property
    def needs_every_prompt_position(self) -> bool:
        """Whether the step's output at every prompt position is wanted (prompt logprobs, mean
        pooling), so that no prompt token may come from the prefix cache."""
        pooling = self.pooling_params
        if pooling is not None:
            return pooling.pooling_type == "mean"
        return self.sampling_params.prompt_logprobs is not None

    @property
    def cache_namespace(self) -> tuple[str, str | None]:
        """Where in the prefix cache its prompt is looked up and kept (yaie/cache/radix_cache.py)."""
        return (self.tenant, self.cache_salt)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
