"""Bad speculative configurations are refused at start, with errors that say what is wrong."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from yaie import LLM
from yaie.model.loader import bundled_model_path
from yaie.spec.config import (
    DISABLE_BY_BATCH_SIZE_DENSE,
    DISABLE_BY_BATCH_SIZE_QUANTIZED,
    MAX_SPECULATIVE_TOKENS,
    SpeculativeConfig,
)
from yaie.spec.proposers import NgramProposer, TargetInfo, TargetModel, check_same_vocabulary


def test_unknown_method_lists_the_methods() -> None:
    with pytest.raises(ValueError, match=r"unknown method 'eagle'.*draft_model, ngram, self"):
        SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 2})


@pytest.mark.parametrize("k", [0, -1, MAX_SPECULATIVE_TOKENS + 1, 2.5, True])
def test_k_out_of_range(k: object) -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer in"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": k})


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key.*lookahead"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
         "prompt_lookup_min <= prompt_lookup_max"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "draft_model needs 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
         "disable_by_batch_size"),
    ],
)  # fmt: skip
def test_other_bad_settings(raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(raw)


def test_the_batch_size_limit_is_the_users_or_the_measured_default_for_the_target() -> None:
    default = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    assert default.batch_size_limit(target_quantized=False) == DISABLE_BY_BATCH_SIZE_DENSE
    assert default.batch_size_limit(target_quantized=True) == DISABLE_BY_BATCH_SIZE_QUANTIZED
    assert DISABLE_BY_BATCH_SIZE_QUANTIZED < DISABLE_BY_BATCH_SIZE_DENSE
    chosen = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 6}
    )
    assert chosen.batch_size_limit(target_quantized=False) == 6
    assert chosen.batch_size_limit(target_quantized=True) == 6


def test_refused_before_the_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("yaie.engine.engine.load_model", no_loading)
    with pytest.raises(ValueError, match="unknown method"):
        LLM(speculative_config={"method": "medusa", "num_speculative_tokens": 2})


def _target(vocab: dict[str, int]) -> TargetInfo:
    tokenizer = SimpleNamespace(get_vocab=lambda: vocab)
    model = TargetModel(Path("target"), "none", torch.device("cpu"))
    return TargetInfo(len(vocab), tokenizer, None, None, 16, 8, 64, frozenset(), model, False)  # type: ignore[arg-type]


def test_a_draft_with_another_vocabulary_is_refused() -> None:
    target = _target({"a": 0, "b": 1})
    with pytest.raises(ValueError, match="vocabulary of 3 tokens, the target 2"):
        check_same_vocabulary(target, 3, SimpleNamespace(get_vocab=lambda: {}), "d")
    with pytest.raises(ValueError, match="another tokenizer"):
        check_same_vocabulary(target, 2, SimpleNamespace(get_vocab=lambda: {"a": 1, "b": 0}), "d")
    check_same_vocabulary(target, 2, SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 1}), "d")


@pytest.mark.slow
def test_a_draft_of_another_vocabulary_fails_the_engine_start(tiny_target: str) -> None:
    """The bundled model (49,152 tokens) cannot draft for the tiny model."""
    spec = {"method": "draft_model", "model": str(bundled_model_path()), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="a draft must use the target's tokenizer"):
        LLM(tiny_target, num_kv_blocks=64, speculative_config=spec)


def test_ngram_lookup() -> None:
    proposer = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3))
    # The suffix [7, 8] occurred twice; the latest occurrence's continuation is proposed.
    assert proposer.lookup([7, 8, 1, 2, 3, 7, 8, 4, 5, 6, 7, 8], 3) == [4, 5, 6]
    assert proposer.lookup([7, 8, 4], 2) == []  # nothing matches
    assert proposer.lookup([5, 5, 5], 4) == [5]  # what follows the match, however little
