"""The `yaie` command line: `generate` in a subprocess, `chat` driven through a terminal."""

from __future__ import annotations

import json
import re
import subprocess

import openai
import pexpect
import pytest

from tests.e2e.e2e_helpers import MODEL, Server, clean_env, yaie_command
from yaie import LLM, SamplingParams
from yaie.cli import build_parser
from yaie.cli.engine_args import engine_config
from yaie.cli.local_engine import stream_text
from yaie.cli.options import parse_bytes
from yaie.config import EngineConfig
from yaie.errors import RequestFailedError, YaieError
from yaie.outputs import CompletionOutput, RequestOutput

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
QUESTION = "What is the capital of France?"


def spawn_chat(*args: str) -> pexpect.spawn:
    command = yaie_command("chat", *args)
    return pexpect.spawn(command[0], command[1:], env=clean_env(), encoding="utf-8", timeout=120)


def answer_to(child: pexpect.spawn, question: str) -> str:
    """Ask at the `you>` prompt; return the streamed answer once the next prompt shows."""
    child.sendline(question)
    child.expect("assistant>")
    child.expect("you>")
    return ANSI_ESCAPE.sub("", child.before).replace("\r\n", "\n").strip()


@pytest.mark.parametrize(
    ("text", "size"),
    [("1000", 1000), ("2GiB", 2 << 30), ("512MiB", 512 << 20), ("2g", 2 << 30), ("1.5GB", 1_500_000_000)],
)
def test_sizes_in_bytes(text: str, size: int) -> None:
    assert parse_bytes(text) == size


def test_serve_flags_come_from_the_environment_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YAIE_PORT", "1234")
    monkeypatch.setenv("YAIE_API_KEY", "from-env")
    monkeypatch.setenv("YAIE_NO_PREFIX_CACHING", "1")
    monkeypatch.setenv("YAIE_KV_CACHE_MEMORY", "1GiB")
    monkeypatch.setenv("YAIE_MODEL", "/models/m.gguf")
    args = build_parser().parse_args(["serve", "--port", "4321"])  # the command line wins
    assert (args.port, args.api_key, args.no_prefix_caching) == (4321, ["from-env"], True)
    assert (args.kv_cache_memory, args.model, args.host) == (1 << 30, "/models/m.gguf", "127.0.0.1")


def test_quantization_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    assert build_parser().parse_args(["serve"]).quantization == "auto"
    assert build_parser().parse_args(["generate", "hi", "--quantization", "int4"]).quantization == "int4"
    monkeypatch.setenv("YAIE_QUANTIZATION", "none")
    assert build_parser().parse_args(["serve"]).quantization == "none"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "fp8"])


def test_kv_cache_dtype_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    assert build_parser().parse_args(["serve"]).kv_cache_dtype == "auto"
    args = build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "bfloat16"])
    assert args.kv_cache_dtype == "bfloat16"
    monkeypatch.setenv("YAIE_KV_CACHE_DTYPE", "float16")
    assert build_parser().parse_args(["serve"]).kv_cache_dtype == "float16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "--kv-cache-dtype", "fp8"])


def test_generation_config_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine_config(build_parser().parse_args(["serve"])).generation_config == "auto"
    args = build_parser().parse_args(["generate", "hi", "--generation-config", "vllm"])
    assert engine_config(args).generation_config == "vllm"
    monkeypatch.setenv("YAIE_GENERATION_CONFIG", "vllm")
    assert engine_config(build_parser().parse_args(["serve"])).generation_config == "vllm"
    assert engine_config(build_parser().parse_args(["chat"])).generation_config == "vllm"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--generation-config", "model"])


def test_every_engine_option_reaches_the_engine_config() -> None:
    argv = ["serve", "m.gguf", "--dtype", "bfloat16", "--quantization", "int8", "--kv-cache-dtype", "float16",
            "--max-model-len", "512", "--num-kv-blocks", "9", "--kv-cache-memory", "1GiB", "--threads", "2",
            "--speculative-config", '{"method": "ngram"}', "--max-num-seqs", "4",
            "--max-num-batched-tokens", "256", "--block-size", "32", "--no-prefix-caching",
            "--long-prefill-token-threshold", "64"]  # fmt: skip
    config = engine_config(build_parser().parse_args(argv))
    model = (config.model, config.dtype, config.quantization, config.kv_cache_dtype)
    assert model == ("m.gguf", "bfloat16", "int8", "float16")
    assert (config.max_model_len, config.num_kv_blocks, config.kv_cache_memory) == (512, 9, 1 << 30)
    assert (config.num_threads, config.speculative_config) == (2, {"method": "ngram"})
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.block_size) == (4, 256, 32)
    assert config.long_prefill_token_threshold == 64
    assert config.enable_prefix_caching is False
    # The same options, the same defaults, wherever an engine runs in this process.
    for command in (["serve"], ["generate", "hi"], ["chat"]):
        assert engine_config(build_parser().parse_args(command)) == EngineConfig()


class ScriptedEngine:
    """Answers each step with the next of `steps` (lists of outputs) and records aborts."""

    def __init__(self, steps: list[list[RequestOutput]]) -> None:
        self.steps = iter(steps)
        self.aborted: list[str] = []

    def add_request(self, request_id: None, prompt: str, params: SamplingParams) -> str:
        return "r0"

    def step(self) -> list[RequestOutput]:
        return next(self.steps)

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return False


def _output(text: str, finished: bool = False, error: YaieError | None = None) -> RequestOutput:
    outputs = [] if error else [CompletionOutput(0, text, [], "stop" if finished else None, delta_text=text)]
    return RequestOutput("r0", "hi", [1], outputs, finished, error=error)


def test_the_engine_loop_streams_one_request_to_its_end() -> None:
    engine = ScriptedEngine([[], [_output("Par")], [_output("is", finished=True)], [_output("never")]])
    assert list(stream_text(engine, "hi", SamplingParams())) == ["Par", "is"]  # type: ignore[arg-type]
    assert engine.aborted == ["r0"]


def test_a_request_the_engine_fails_ends_in_its_error() -> None:
    failed = _output("", finished=True, error=RequestFailedError("the engine failed"))
    engine = ScriptedEngine([[_output("Par")], [failed]])
    stream = stream_text(engine, "hi", SamplingParams())  # type: ignore[arg-type]
    assert next(stream) == "Par"
    with pytest.raises(YaieError, match="the engine failed"):
        next(stream)
    assert engine.aborted == ["r0"]


# That the engine then runs on that many threads: test_generate_streams_a_completion.
def test_threads_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    assert build_parser().parse_args(["serve"]).threads is None  # torch's default: one per core
    assert build_parser().parse_args(["generate", "hi", "--threads", "1"]).threads == 1
    monkeypatch.setenv("YAIE_THREADS", "3")
    assert build_parser().parse_args(["serve"]).threads == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--threads", "0"])


@pytest.mark.slow
def test_generate_streams_a_completion(llm: LLM) -> None:
    prompt = "The capital of France is"
    flags = ["--max-tokens=12", "--temperature=0", "--num-kv-blocks=64", "--quantization=none", "--threads=1"]
    result = subprocess.run(
        yaie_command("generate", prompt, *flags),
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=180,
        check=True,
    )
    [expected] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))
    assert result.stdout == expected.outputs[0].text + "\n"
    assert "CPU threads: 1" in result.stderr


@pytest.mark.slow
def test_bench_starts_a_server_and_reports_every_level(tmp_path) -> None:
    out = tmp_path / "bench.json"
    command = yaie_command("bench", "--concurrency", "1,2", "--num-requests", "2", "--max-tokens", "4")
    # --num-kv-blocks and --max-num-seqs are not bench options: they go to `yaie serve`.
    command += ["--out", str(out), "--num-kv-blocks", "128", "--max-num-seqs", "4"]
    result = subprocess.run(command, capture_output=True, text=True, env=clean_env(), timeout=300)
    assert result.returncode == 0, result.stderr
    assert "--max-num-seqs 4" in result.stderr  # forwarded to `yaie serve`
    report = json.loads(out.read_text())
    assert [level["concurrency"] for level in report["levels"]] == [1, 2]
    for level in report["levels"]:
        assert level["errors"] == 0 and all(r["output_tokens"] == 4 for r in level["requests"])


@pytest.mark.slow
def test_bench_reports_speculative_acceptance(tmp_path) -> None:
    out = tmp_path / "bench.json"
    # n-gram lookup from a single token: a chat answer repeats some token of its prompt.
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "min_acceptance_rate": 0}
    command = yaie_command("bench", "--concurrency", "1", "--num-requests", "2", "--max-tokens", "32")
    command += ["--out", str(out), "--num-kv-blocks", "128", "--speculative-config", json.dumps(spec)]
    result = subprocess.run(command, capture_output=True, text=True, env=clean_env(), timeout=300)
    assert result.returncode == 0, result.stderr
    [level] = json.loads(out.read_text())["levels"]
    assert 0 <= level["spec_acceptance_rate"] <= 1
    assert level["spec_mean_accepted_length"] >= 1
    assert "mean len" in result.stdout


@pytest.mark.slow
def test_chat_with_a_server(server: Server, client: openai.OpenAI) -> None:
    max_tokens = 200
    expected = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=max_tokens
    )
    child = spawn_chat(
        MODEL, "--url", f"{server.base_url}/v1", "--temperature=0", f"--max-tokens={max_tokens}"
    )
    child.expect("you>")
    assert answer_to(child, QUESTION) == (expected.choices[0].message.content or "").strip()
    child.sendline("/reset")
    child.expect("conversation cleared")
    child.expect("you>")
    # Ctrl-C while an answer streams stops that answer only.
    child.sendline("Tell me a very long story about a dragon and a knight.")
    child.expect("assistant>")
    child.sendintr()
    child.expect(r"\(stopped\)")
    child.expect("you>")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


@pytest.mark.slow
def test_chat_in_process(llm: LLM) -> None:
    system = "You are a helpful assistant."
    child = spawn_chat(
        "--system", system, "--temperature=0", "--max-tokens=24", "--num-kv-blocks=64", "--quantization=none"
    )
    child.expect("you>")
    answer = answer_to(child, QUESTION)
    conversation = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    [expected] = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=24))
    assert answer == expected.outputs[0].text.strip()
    child.sendintr()  # at the prompt, Ctrl-C quits
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
