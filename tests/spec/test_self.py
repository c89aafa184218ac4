"""The `self` method: the target's own model file, loaded again with quantized weights, drafts
for the target run unquantized. Greedy outputs are the unquantized model's token for token;
sampling verifies by rejection sampling; a target that already runs quantized is refused
before anything loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import yaie.spec.decoder as decoder_module
from tests.engine.engine_helpers import assert_no_leak
from yaie import LLM, SamplingParams
from yaie.cli import main
from yaie.model.quantization import weight_types
from yaie.server.metrics import ServerMetrics
from yaie.spec.config import SpeculativeConfig
from yaie.spec.proposers import SelfProposer, TargetModel, self_draft_quantization
from yaie.spec.verify import Draft, verify

PROMPTS = [
    "hello world hello world hello world hello",
    "the cat sat on the mat and the cat sat on",
    "one two three four five six seven eight nine ten one two three",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Every sequence speculates, however many decode together.
ALWAYS = {"disable_by_batch_size": 1024, "min_acceptance_rate": 0.0}


def _self(k: int = 3, **extra: Any) -> dict[str, Any]:
    return {"method": "self", "num_speculative_tokens": k, **ALWAYS, **extra}


def _draft_types(llm: LLM) -> set[str]:
    """The types the draft's linear layers run in."""
    proposer = llm.engine.speculator.proposer  # type: ignore[union-attr]
    assert isinstance(proposer, SelfProposer)
    return set(weight_types(proposer.runner.model))


@pytest.fixture
def targets(tiny_target: str, tiny_gguf_q8: str) -> dict[str, tuple[str, dict[str, Any], str]]:
    """name -> (model, the self config's extra keys, the draft's weight type)."""
    return {
        "hf-int4": (tiny_target, {}, "int4"),  # a dense checkpoint's default draft
        "hf-int8": (tiny_target, {"quantization": "int8"}, "int8"),
        "gguf-Q8_0": (tiny_gguf_q8, {}, "Q8_0"),  # a GGUF file's default: its weights as stored
    }


@pytest.mark.parametrize("situation", [{"num_kv_blocks": 256}, {"num_kv_blocks": 16, "block_size": 4}],
                         ids=["plain", "preemption"])  # fmt: skip
@pytest.mark.parametrize("name", ["hf-int4", "hf-int8", "gguf-Q8_0"])
def test_greedy_is_the_unquantized_models(targets: dict, name: str, situation: dict[str, Any]) -> None:
    model, extra, draft_type = targets[name]
    situation = {**situation, "quantization": "none"}  # the target unquantized, a GGUF's too
    plain = LLM(model, **situation)
    expected = [out.outputs[0].token_ids for out in plain.generate(PROMPTS, GREEDY)]
    llm = LLM(model, speculative_config=_self(**extra), **situation)
    got = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]
    assert got == expected
    assert llm.engine.model_info.quantization == "none"  # the target runs in float32
    assert _draft_types(llm) == {draft_type}  # every linear layer of the draft, the LM head too
    stats = llm.engine.stats().spec_decode
    assert stats is not None and stats.num_drafts > 0
    # Where the twin agrees with the model its drafts are kept (random tiny models, whose
    # logits are flat, agree less often than a trained model and its twin).
    assert stats.num_accepted_tokens > 0
    if "block_size" in situation:
        assert llm.engine.stats().num_preemptions > 0
    assert_no_leak(llm)
    assert llm.engine.speculator.proposer.pool.num_used == 0  # type: ignore[union-attr]


def test_sampling_verifies_by_rejection_and_keeps_drafts(
    tiny_target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    verified: list[Draft] = []

    def spy(sampler: Any, logits: torch.Tensor, seqs: Any, drafts: list[Draft]) -> Any:
        verified.extend(drafts)
        return verify(sampler, logits, seqs, drafts)

    monkeypatch.setattr(decoder_module, "verify", spy)
    llm = LLM(tiny_target, num_kv_blocks=256, speculative_config=_self(k=4))
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=32, ignore_eos=True)
              for seed in range(len(PROMPTS))]  # fmt: skip
    first = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]
    # Seeded requests draw the same tokens again, drafts and verification included.
    assert [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)] == first
    registry = ServerMetrics(llm.engine.stats).registry
    accepted = registry.get_sample_value("spec_decode_num_accepted_tokens_total")
    drafted = registry.get_sample_value("spec_decode_num_draft_tokens_total")
    assert accepted is not None and drafted is not None
    assert 0 < accepted <= drafted
    # The drafts came with the twin's distributions, spread over several tokens: verification
    # accepted with min(1, p/q) and drew rejections from max(p - q, 0), not a greedy match.
    assert verified and all(draft.probs is not None for draft in verified)
    assert any(float(draft.probs.max()) < 1 for draft in verified)  # type: ignore[union-attr]
    assert registry.get_sample_value("spec_decode_num_accepted_tokens_per_pos_total", {"position": "0"})
    assert_no_leak(llm)


def _refused_before_loading(monkeypatch: pytest.MonkeyPatch, model: str, quantization: str,
                            spec: dict[str, Any], message: str) -> None:  # fmt: skip
    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("yaie.engine.engine.load_model", no_loading)
    with pytest.raises(ValueError, match=message):
        LLM(model, quantization=quantization, speculative_config=spec)


def test_a_quantized_gguf_target_is_refused(monkeypatch: pytest.MonkeyPatch, tiny_gguf_q8: str) -> None:
    message = r"the target already runs quantized \(Q8_0\).*no gain.*quantization 'none'"
    _refused_before_loading(monkeypatch, tiny_gguf_q8, "auto", _self(), message)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_target_quantized_at_load_is_refused(
    monkeypatch: pytest.MonkeyPatch, tiny_target: str, quantization: str
) -> None:
    message = rf"the target already runs quantized \({quantization}\).*no gain"
    _refused_before_loading(monkeypatch, tiny_target, quantization, _self(), message)


def test_drafts_that_would_not_be_quantized_or_twice_quantized_are_refused(
    monkeypatch: pytest.MonkeyPatch, tiny_target: str, tiny_gguf_q8: str
) -> None:
    _refused_before_loading(monkeypatch, tiny_target, "none", _self(quantization="auto"),
                            "stores no quantized weights.*'auto' would run the target's own dense weights")
    _refused_before_loading(monkeypatch, tiny_gguf_q8, "none", _self(quantization="int4"),
                            r"already stores quantized weights \(Q8_0\).*second rounding error")  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"quantization": "none"}, "the draft would be the target itself"),
        ({"quantization": "fp8"}, "quantization must be one of none, auto, int8, int4"),
        ({"model": "other.gguf"}, "self drafts with the target's own model file"),
    ],
)
def test_bad_self_settings(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(_self(**extra))


def test_the_draft_needs_the_cpus_kernels(tiny_target: str) -> None:
    config = SpeculativeConfig.from_dict(_self())
    with pytest.raises(ValueError, match="CPU only"):
        self_draft_quantization(config, TargetModel(Path(tiny_target), "none", torch.device("cuda")))


def test_the_cli_takes_the_dict(tiny_target: str, capsys: pytest.CaptureFixture[str]) -> None:
    prompt = PROMPTS[0]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    [expected] = LLM(tiny_target, num_kv_blocks=64).generate(prompt, greedy)
    args = ["generate", prompt, "--model", tiny_target, "--temperature", "0", "--max-tokens", "12",
            "--num-kv-blocks", "64"]  # fmt: skip
    spec = json.dumps({"method": "self", "num_speculative_tokens": 4})
    assert main([*args, "--speculative-config", spec]) == 0
    assert capsys.readouterr().out == expected.outputs[0].text + "\n"
    assert main([*args, "--quantization", "int4", "--speculative-config", spec]) == 1
    assert "the target already runs quantized (int4)" in capsys.readouterr().err
