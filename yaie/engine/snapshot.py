"""The engine's state as the engine view draws it: one JSON-ready dict, read between two steps.

`EngineSnapshots(engine).take(viewer)` only reads the engine; call it on the thread that runs
the engine (`AsyncEngine.snapshot` does). `viewer` is the tenant asking (the API key's): it sees
the whole engine's load, but no other tenant's text, and no other tenant's request ids (an id
could be used to fetch what a request made, such as a stored response). The schema (version 2):

    version      2
    time         Unix time of the snapshot
    cost_ms      what taking this snapshot cost the engine thread
    model        {name, architecture, max_model_len}
    config       {block_size, max_num_seqs, max_num_batched_tokens, prefix_caching,
                  scheduling_policy ("fcfs" or "priority")}
    sequences    one per sequence the scheduler holds, running ones first (in admission order),
                 then the waiting ones (in queue order):
                 {request_id (another tenant's: an alias, "other-" and 12 hex digits, the same for
                  the same request from one snapshot to the next), index (which of the request's n
                  choices), phase, num_computed_tokens,
                  num_tokens (prompt + generated), num_prompt_tokens, num_cached_tokens,
                  num_preemptions, priority (its request's), blocks (its block table)}
                 phase: "prefill" (running, more than the last token left to compute: a prompt
                 chunk, or recomputation after a preemption), "decode" (running, one token a
                 step), "waiting" (not admitted yet), "preempted" (waiting again after a
                 preemption). Choices of an n > 1 request that wait for the first choice's
                 prompt are not listed until they are queued.
    kv           {num_blocks, num_free, num_used (held by sequences), num_cached (held only by the
                  prefix cache), states}
                 states: one character per block id: "f" free, "u" held by sequences, "s" held
                 by sequences and by the prefix cache, "c" held only by the prefix cache. Which
                 sequences hold a block: those whose `blocks` list it.
    tree         the viewer's part of the prefix cache (its prompts sent without a cache_salt):
                 its first TREE_DEPTH levels, breadth first, at most TREE_NODES nodes, or null
                 without prefix caching:
                 {parent (index in this list, -1 under the root), depth, start (tokens before
                  the edge), num_tokens, blocks, hits (prefix matches that reused it),
                  num_children, text (the edge's first LABEL_TOKENS tokens, decoded)}
    counters     {preemptions, evicted_blocks, computed_prompt_tokens}: totals since start
    history      what the engine did while watched (yaie/engine/step_log.py), the first two as
                 columns (one list per field, oldest first, equally long):
                 {seconds: {second, steps, busy_s, max_step_s, prefill_tokens, sampled_tokens,
                            ttft_sum_s, num_ttft, preemptions, evicted_blocks},
                  recent_steps: {time, duration_s, prefill_tokens, decode_tokens, num_running,
                                 num_waiting},
                  events: [{time, kind: "preemption", request_id (aliased as above), index,
                            num_tokens}
                           or {time, kind: "eviction", num_blocks}]}

What a snapshot costs the engine thread is mostly proportional to what it shows: the step log
keeps its history ready to copy, and the tree's labels are decoded once per node, not once per
snapshot.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from typing import TYPE_CHECKING, Any

from yaie.engine.sequence import Sequence

if TYPE_CHECKING:
    from yaie.engine.engine import Engine

SCHEMA_VERSION = 2
TREE_DEPTH = 4
TREE_NODES = 64
LABEL_TOKENS = 12


class EngineSnapshots:
    """Snapshots of one engine. Between two it keeps the labels of the tree nodes it showed:
    decoding them was most of what the tree cost, and the top levels change rarely."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._labels: dict[tuple[int, ...], str] = {}  # a label's tokens -> its text
        self._alias_key = secrets.token_bytes(16)  # other tenants' request ids are hashed with it

    def take(self, viewer: str) -> dict[str, Any]:
        started = time.perf_counter()
        engine = self.engine
        scheduler, config = engine.scheduler, engine.config
        cache = scheduler.prefix_cache
        sequences = [self._sequence(seq, viewer, running=True) for seq in scheduler.running]
        sequences += [self._sequence(seq, viewer, running=False) for seq in scheduler.waiting]
        history = engine.step_log.to_json()
        history["events"] = [self._event(event, viewer) for event in history["events"]]
        snapshot = {
            "version": SCHEMA_VERSION,
            "time": time.time(),
            "model": {
                "name": engine.model_info.path.name,
                "architecture": engine.model_info.architecture,
                "max_model_len": engine.max_model_len,
            },
            "config": {
                "block_size": config.block_size,
                "max_num_seqs": config.max_num_seqs,
                "max_num_batched_tokens": config.max_num_batched_tokens,
                "prefix_caching": cache is not None,
                "scheduling_policy": config.scheduling_policy,
            },
            "sequences": sequences,
            "kv": _kv(engine),
            "tree": None if cache is None else self._tree(viewer),
            "counters": {
                "preemptions": scheduler.num_preemptions,
                "evicted_blocks": 0 if cache is None else cache.num_evicted_blocks,
                "computed_prompt_tokens": scheduler.num_computed_prompt_tokens,
            },
            "history": history,
        }
        snapshot["cost_ms"] = (time.perf_counter() - started) * 1000
        return snapshot

    def _request_id(self, request_id: str, tenant: str, viewer: str) -> str:
        if tenant == viewer:
            return request_id
        digest = hashlib.blake2b(request_id.encode(), key=self._alias_key, digest_size=6).hexdigest()
        return f"other-{digest}"

    def _sequence(self, seq: Sequence, viewer: str, running: bool) -> dict[str, Any]:
        if running:
            phase = "prefill" if seq.num_tokens - seq.num_computed_tokens > 1 else "decode"
        else:
            phase = "preempted" if seq.num_preemptions else "waiting"
        return {
            "request_id": self._request_id(seq.request_id, seq.tenant, viewer),
            "index": seq.index,
            "phase": phase,
            "num_computed_tokens": seq.num_computed_tokens,
            "num_tokens": seq.num_tokens,
            "num_prompt_tokens": seq.num_prompt_tokens,
            "num_cached_tokens": seq.num_cached_tokens,
            "num_preemptions": seq.num_preemptions,
            "priority": seq.priority,
            "blocks": list(seq.block_table),
        }

    def _event(self, event: dict[str, Any], viewer: str) -> dict[str, Any]:
        """A step log event as `viewer` may see it (the log keeps whose it was)."""
        event = dict(event)
        tenant = event.pop("tenant", None)
        if tenant is not None:
            event["request_id"] = self._request_id(event["request_id"], tenant, viewer)
        return event

    def _tree(self, viewer: str) -> list[dict[str, Any]]:
        cache = self.engine.scheduler.prefix_cache
        assert cache is not None
        nodes = cache.top_levels(TREE_DEPTH, TREE_NODES, (viewer, None))
        # Only the labels of the nodes shown now are kept: TREE_NODES at most.
        labels = {node.tokens[:LABEL_TOKENS]: "" for node in nodes}
        for tokens in labels:
            known = self._labels.get(tokens)
            labels[tokens] = self.engine.tokenizer.decode(list(tokens)) if known is None else known
        self._labels = labels
        return [
            {
                "parent": node.parent,
                "depth": node.depth,
                "start": node.start,
                "num_tokens": len(node.tokens),
                "blocks": node.blocks,
                "hits": node.hits,
                "num_children": node.num_children,
                "text": labels[node.tokens[:LABEL_TOKENS]],
            }
            for node in nodes
        ]


def _kv(engine: Engine) -> dict[str, Any]:
    stats = engine.stats()
    return {
        "num_blocks": stats.num_kv_blocks,
        "num_free": engine.block_pool.num_free,
        "num_used": stats.num_used_kv_blocks,
        "num_cached": stats.num_cached_kv_blocks,
        "states": engine.block_pool.states(),
    }
