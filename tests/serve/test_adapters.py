"""LoRA adapters through ``ricllm serve``: ``--lora-modules NAME=PATH`` (checked as a setting,
loaded as the engine is built), a ZeroMQ request under an adapter (named, or inherited from its
template) gives the tokens ``LLM.generate(..., lora_request=...)`` gives offline, the refusals
(``UNKNOWN_ADAPTER``, ``ADAPTER_MISMATCH``), ``/v1/models`` and ``model: NAME`` over HTTP, the
metrics, and ``lora_modules`` changed live in ``$CONFIG_FILE`` (a replace while a request runs:
it finishes on the old adapter, new ones use the new).

Random adapters (``tests/lora_adapters.py``) on the tiny random GGUF; the servers in-process."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ricllm import LoRARequest, SamplingParams
from ricllm import protocol as p
from ricllm.client import RicClient, ServerError
from ricllm.config import SettingsError
from tests.lora_adapters import write_lora_adapter
from tests.serve.test_lifecycle import WAIT_S, serve_from_config_file
from tests.serve.test_server import http_get, metric_values, run_cli, wait_for

PROMPT = "Cell 7 reports PRB usage high and throughput low."
SYSTEM = "You are a RAN configuration assistant."
MAX_TOKENS = 8
MODEL = "tiny-random-llama"  # the tiny GGUF's general.name: the base model's served name


@pytest.fixture(scope="module")
def spec(tiny_gguf):
    from ricllm.model.loader import open_checkpoint

    return open_checkpoint(tiny_gguf).spec


@pytest.fixture(scope="module")
def adapters(spec, tmp_path_factory) -> dict[str, Path]:
    """Three random adapters for the tiny model: A, B (another rank) and A2 (A's shape, other numbers)."""
    folder = tmp_path_factory.mktemp("adapters")
    return {"A": write_lora_adapter(folder / "A", spec, seed=1),
            "B": write_lora_adapter(folder / "B", spec, seed=2, rank=8, alpha=16),
            "A2": write_lora_adapter(folder / "A2", spec, seed=3)}


@pytest.fixture(scope="module")
def offline(engine_kwargs, adapters):
    """``LLM.generate`` on the same settings, under each adapter by ``LoRARequest(name, path)``; skips
    where the runtime holds no adapters (no ``runtime.lora``: the engine's capacity is 0)."""
    from ricllm import LLM

    llm = LLM(**{k: v for k, v in engine_kwargs.items() if k not in ("admission", "latency_fit")})
    if llm.engine.loras.capacity == 0:
        pytest.skip("this runtime has no LoRA adapter slots")

    def generate(prompt: str | list[int], adapter: str | None, max_tokens: int = MAX_TOKENS) -> list[int]:
        request = None if adapter is None else LoRARequest(adapter, str(adapters[adapter]))
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return llm.generate([prompt], params, lora_request=request)[0].token_ids

    generate.llm = llm
    return generate


@pytest.fixture(scope="module")
def lora_server(engine_kwargs, adapters, offline):
    """A server with A and B loaded from ``lora_modules``."""
    from ricllm.config import EngineConfig, ServerOptions
    from ricllm.serve.server import Server

    options = ServerOptions(zmq_endpoint="tcp://127.0.0.1:*", http_port=0, http_host="127.0.0.1",
                            lora_modules={"A": str(adapters["A"]), "B": str(adapters["B"])})
    server = Server(EngineConfig(**engine_kwargs), options).start()
    try:
        assert server.wait_ready(60), "the tiny model did not load within 60 s"
        yield server
    finally:
        server.stop()


# ------------------------------------------------------------------------------ the setting


def parse(*argv: str):
    from ricllm.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_lora_modules_take_name_path_pairs_after_one_flag(adapters):
    from ricllm.cli.serve import settings_from_args

    settings = settings_from_args(parse("--lora-modules", f"A={adapters['A']}", f"B={adapters['B']}"), environ={})
    assert settings.controls.lora_modules == [f"A={adapters['A']}", f"B={adapters['B']}"]
    assert settings.server.lora_modules == {"A": str(adapters["A"]), "B": str(adapters["B"])}
    assert settings.sources["lora_modules"] == "command-line flags"
    assert settings_from_args(parse(), environ={}).server.lora_modules == {}


def test_lora_modules_come_from_a_config_file_too(adapters, tmp_path):
    from ricllm.cli.serve import settings_from_args

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"controls": {"lora_modules": [f"A={adapters['A']}"]}}))
    settings = settings_from_args(parse("--config", str(path)), environ={})
    assert settings.server.lora_modules == {"A": str(adapters["A"])}


@pytest.mark.parametrize("entries, problem", [
    (["A"], "'A' is not NAME=PATH (no '=')"),
    (["={A}"], "has an empty adapter name"),
    (["A="], "'A=' has an empty path"),
    (["A={missing}"], "does not exist"),
    (["A={A}", "A={B}"], "adapter name 'A' is given twice"),
    (["A={A}", "B={B}", "C={A}"], "lora_modules names 3 adapters but max_loras is 2"),
])
def test_a_bad_lora_module_is_an_error_naming_it(adapters, tmp_path, entries, problem):
    from ricllm.cli.serve import settings_from_args

    paths = {"A": adapters["A"], "B": adapters["B"], "missing": tmp_path / "nowhere"}
    argv = ["--lora-modules", *(e.format(**paths) for e in entries), "--max-loras", "2"]
    with pytest.raises(SettingsError, match="lora_modules") as error:
        settings_from_args(parse(*argv), environ={})
    assert problem in str(error.value)


def test_ricllm_serve_ends_on_a_bad_lora_module_with_the_message_and_no_traceback(tmp_path):
    missing = tmp_path / "nowhere"
    done = run_cli("serve", "--lora-modules", f"tuned={missing}")
    assert done.returncode == 2
    assert f"lora_modules: adapter 'tuned': '{missing}' does not exist" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_file_is_not_an_adapter_folder(adapters, tmp_path):
    from ricllm.cli.serve import settings_from_args

    with pytest.raises(SettingsError, match="is not a folder"):
        settings_from_args(parse("--lora-modules", f"A={adapters['A'] / 'adapter_config.json'}"), environ={})


# ------------------------------------------------------------------------------ loading at start


def _start(engine_kwargs: dict, **options):
    from ricllm.config import EngineConfig, ServerOptions
    from ricllm.serve.server import Server

    return Server(EngineConfig(**engine_kwargs), ServerOptions(zmq_endpoint="tcp://127.0.0.1:*", http_port=0,
                                                               http_host="127.0.0.1", **options)).start()


def test_an_adapter_that_does_not_load_fails_the_start_naming_it(engine_kwargs, spec, tmp_path):
    from ricllm.errors import ConfigError

    bad = write_lora_adapter(tmp_path / "dora", spec, config={"use_dora": True})
    server = _start(engine_kwargs, lora_modules={"tuned": str(bad)})
    try:
        with pytest.raises(ConfigError, match="lora_modules: cannot serve adapter 'tuned'") as error:
            server.wait_ready(60)
        assert "use_dora" in str(error.value)  # the loader's own message
    finally:
        server.stop()


def test_no_adapter_slots_fail_the_start(engine_kwargs, adapters):
    from ricllm.errors import ConfigError

    server = _start({**engine_kwargs, "max_loras": 0}, lora_modules={"A": str(adapters["A"])})
    try:
        with pytest.raises(ConfigError, match="max_loras is 0"):
            server.wait_ready(60)
    finally:
        server.stop()


# ------------------------------------------------------------------------------ refusals without adapters


@pytest.fixture(scope="module")
def plain_server(engine_kwargs):
    server = _start(engine_kwargs)
    try:
        assert server.wait_ready(60)
        yield server
    finally:
        server.stop()


def test_an_unknown_adapter_is_refused_with_its_code(plain_server):
    with RicClient(plain_server.endpoint, timeout_s=30) as client:
        with pytest.raises(ServerError) as generate:
            client.generate(PROMPT, adapter="nope", max_tokens=4)
        with pytest.raises(ServerError) as register:
            client.register_template(SYSTEM, adapter="nope")
        assert client.stats().adapters == ()
        client.generate(PROMPT, max_tokens=2)  # the server carries on
    for error in (generate.value, register.value):
        assert error.code == "UNKNOWN_ADAPTER"
        assert "'nope'" in error.message and "holds none" in error.message


def test_the_client_command_names_an_adapter(plain_server):
    generate = run_cli("client", "generate", "--endpoint", plain_server.endpoint, PROMPT, "--adapter", "nope")
    register = run_cli("client", "register-template", "--endpoint", plain_server.endpoint, SYSTEM,
                       "--adapter", "nope")
    for done in (generate, register):
        assert done.returncode == 2 and "UNKNOWN_ADAPTER" in done.stderr and "'nope'" in done.stderr


def test_the_models_list_has_only_the_base_and_an_unknown_model_names_what_is_served(plain_server):
    base = f"http://127.0.0.1:{plain_server.http_port}"
    status, text = http_get(base + "/v1/models")
    assert status == 200 and [card["id"] for card in json.loads(text)["data"]] == [MODEL]
    status, body = post(base + "/v1/completions", {"model": "nope", "prompt": PROMPT, "max_tokens": 2})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert "'nope'" in body["error"]["message"] and f"'{MODEL}'" in body["error"]["message"]


def test_the_adapter_gauges_are_there_with_none_held(plain_server):
    values = metric_values(f"http://127.0.0.1:{plain_server.http_port}")
    assert values[("ricxapp_ricllm_lora_adapters_resident", (("model_name", MODEL),))] == 0


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# ------------------------------------------------------------------------------ served under an adapter


def test_a_request_under_an_adapter_gives_the_offline_tokens(lora_server, offline):
    with RicClient(lora_server.endpoint, timeout_s=30) as client:
        results = {name: client.generate(PROMPT, adapter=name, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids
                   for name in ("A", "B", None)}
    assert results == {name: offline(PROMPT, name) for name in ("A", "B", None)}
    assert results["A"] != results[None] and results["B"] != results[None]  # the adapters change the answer


def test_the_stats_list_the_adapters(lora_server, adapters):
    with RicClient(lora_server.endpoint, timeout_s=30) as client:
        stats = client.stats()
    assert [a.name for a in stats.adapters] == ["A", "B"]
    a, b = stats.adapters
    assert (a.rank, b.rank) == (4, 8) and a.slot != b.slot and stats.max_loras >= 2
    assert a.path == str(adapters["A"]) and a.content_hash != b.content_hash
    assert a.nbytes > 0 and b.nbytes > a.nbytes and a.requests == b.requests == 0


def test_a_request_inherits_its_templates_adapter(lora_server, offline):
    with RicClient(lora_server.endpoint, timeout_s=30) as client:
        registered = client.register_template(SYSTEM, template_id="under-a", adapter="A")
        inherited = client.generate(PROMPT, template_id="under-a", max_tokens=MAX_TOKENS, ignore_eos=True)
        named = client.generate(PROMPT, template_id="under-a", adapter="A", max_tokens=MAX_TOKENS, ignore_eos=True)
        template = client.stats().templates["under-a"]
    llm = offline.llm
    prompt = llm.render_chat([{"role": "system", "content": SYSTEM}], add_generation_prompt=False) + \
        llm.engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert inherited.token_ids == named.token_ids == offline(prompt, "A")
    assert inherited.token_ids != offline(prompt, None)
    assert registered.adapter == "A" and template.adapter == "A"
    assert inherited.num_cached_tokens >= registered.num_pinned_tokens > 0  # its pin was computed under A


def test_another_adapter_than_the_templates_is_refused_naming_both(lora_server):
    with RicClient(lora_server.endpoint, timeout_s=30) as client:
        client.register_template(SYSTEM, template_id="pinned-a", adapter="A")
        with pytest.raises(ServerError) as error:
            client.generate(PROMPT, template_id="pinned-a", adapter="B", max_tokens=2)
    assert error.value.code == "ADAPTER_MISMATCH"
    assert "'A'" in error.value.message and "'B'" in error.value.message and "'pinned-a'" in error.value.message


def test_the_models_list_has_each_adapter_under_the_base(lora_server, adapters):
    status, text = http_get(f"http://127.0.0.1:{lora_server.http_port}/v1/models")
    cards = json.loads(text)["data"]
    assert status == 200 and [c["id"] for c in cards] == [MODEL, "A", "B"]
    assert cards[0]["parent"] is None
    assert [(c["parent"], c["root"]) for c in cards[1:]] == [(MODEL, str(adapters["A"])), (MODEL, str(adapters["B"]))]
    status, text = http_get(f"http://127.0.0.1:{lora_server.http_port}/v1/models/B")
    assert status == 200 and json.loads(text)["parent"] == MODEL


def test_model_names_the_adapter_a_request_is_served_under(lora_server, offline):
    base = f"http://127.0.0.1:{lora_server.http_port}"
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    under_a = post(base + "/v1/completions", {**body, "model": "A"})
    under_base = post(base + "/v1/completions", {**body, "model": MODEL})
    unknown = post(base + "/v1/completions", {**body, "model": "C"})
    tokenizer = offline.llm.engine.tokenizer
    assert under_a[0] == 200 and under_a[1]["model"] == "A"
    assert under_a[1]["choices"][0]["text"] == tokenizer.decode(offline(PROMPT, "A"))
    assert under_base[1]["model"] == MODEL
    assert under_base[1]["choices"][0]["text"] == tokenizer.decode(offline(PROMPT, None))
    assert unknown[0] == 404 and unknown[1]["error"]["code"] == "model_not_found"
    assert all(f"'{name}'" in unknown[1]["error"]["message"] for name in (MODEL, "A", "B"))


def test_the_metrics_count_adapters_and_their_requests(lora_server):
    base = f"http://127.0.0.1:{lora_server.http_port}"
    before = metric_values(base).get(("ricxapp_ricllm_lora_requests_total",
                                      (("lora_name", "B"), ("model_name", MODEL))), 0)
    with RicClient(lora_server.endpoint, timeout_s=30) as client:
        client.generate(PROMPT, adapter="B", max_tokens=2)
        client.generate(PROMPT, max_tokens=2)

    def counted() -> bool:
        values = metric_values(base)
        return values.get(("ricxapp_ricllm_lora_requests_total", (("lora_name", "B"), ("model_name", MODEL)))) \
            == before + 1 and values[("ricxapp_ricllm_lora_adapters_resident", (("model_name", MODEL),))] == 2

    assert wait_for(counted, 5)


# ------------------------------------------------------------------------------ changed live


@pytest.fixture
def lora_config_server(engine_kwargs, adapters, offline, tmp_path):
    """A server whose ``lora_modules`` (A and B) come from ``$CONFIG_FILE``."""
    yield from serve_from_config_file(tmp_path, engine_kwargs, lora_modules=[f"A={adapters['A']}", f"B={adapters['B']}"])


def adapter_hashes(client: RicClient) -> dict[str, str]:
    return {a.name: a.content_hash for a in client.stats().adapters}


def test_a_replaced_adapter_serves_new_requests_while_one_in_flight_finishes_on_the_old(
        lora_config_server, adapters, offline):
    server = lora_config_server
    long_tokens = 400  # runs well past the watcher's reaction (a 50 ms quiet period, then a step)
    with RicClient(server.endpoint, timeout_s=60) as client, RicClient(server.endpoint, timeout_s=60) as other:
        old_hash = adapter_hashes(client)["A"]
        stream = client.stream(PROMPT, adapter="A", max_tokens=long_tokens, ignore_eos=True)
        first = next(stream)
        assert isinstance(first, p.Token)
        server.write(lora_modules=[f"A={adapters['A2']}", f"B={adapters['B']}"])
        assert wait_for(lambda: adapter_hashes(other)["A"] != old_hash, WAIT_S), "A was not replaced"
        replaced_while_running = other.stats().queues.in_flight == 1
        fresh = other.generate(PROMPT, adapter="A", max_tokens=MAX_TOKENS, ignore_eos=True)
        replies = [first, *stream]
        assert server.config()["controls"]["lora_modules"] == [f"A={adapters['A2']}", f"B={adapters['B']}"]
    result = replies[-1]
    assert replaced_while_running, "the long request ended before the replacement: nothing was shown"
    assert isinstance(result, p.Result) and result.finish_reason == "length"
    assert result.token_ids == offline(PROMPT, "A", long_tokens)  # every token under the adapter it started under
    assert fresh.token_ids == offline(PROMPT, "A2") != offline(PROMPT, "A")


def test_a_replaced_adapter_repins_its_templates(lora_config_server, adapters, offline):
    server = lora_config_server
    with RicClient(server.endpoint, timeout_s=30) as client:
        client.register_template(SYSTEM, template_id="t", adapter="A")
        old_hash = adapter_hashes(client)["A"]
        server.write(lora_modules=[f"A={adapters['A2']}", f"B={adapters['B']}"])
        assert wait_for(lambda: adapter_hashes(client)["A"] != old_hash, WAIT_S)
        assert wait_for(lambda: client.stats().templates["t"].pinned, WAIT_S)
        result = client.generate(PROMPT, template_id="t", max_tokens=MAX_TOKENS, ignore_eos=True)
        pinned = client.stats().templates["t"].num_pinned_tokens
    llm = offline.llm
    prompt = llm.render_chat([{"role": "system", "content": SYSTEM}], add_generation_prompt=False) + \
        llm.engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert result.token_ids == offline(prompt, "A2")
    assert result.num_cached_tokens >= pinned > 0  # the pin under the new content is found


def test_adapters_are_added_and_removed_but_not_one_a_template_names(lora_config_server, adapters):
    server = lora_config_server
    with RicClient(server.endpoint, timeout_s=30) as client:
        client.register_template(SYSTEM, template_id="keeps-a", adapter="A")
        server.write(lora_modules=[f"C={adapters['A2']}"])  # add C; remove A (refused) and B
        assert wait_for(lambda: sorted(adapter_hashes(client)) == ["A", "C"], WAIT_S)
        assert server.config()["controls"]["lora_modules"] == [f"A={adapters['A']}", f"C={adapters['A2']}"]
        assert client.generate(PROMPT, adapter="C", max_tokens=2).finish_reason == "length"
        with pytest.raises(ServerError) as gone:
            client.generate(PROMPT, adapter="B", max_tokens=2)
        assert gone.value.code == "UNKNOWN_ADAPTER"
        client.unregister_template("keeps-a")
        server.write(lora_modules=[f"C={adapters['A2']}"])  # the file is written again: A is asked again
        assert wait_for(lambda: sorted(adapter_hashes(client)) == ["C"], WAIT_S)


def test_an_adapter_that_does_not_load_keeps_the_running_one(lora_config_server, adapters, spec, tmp_path):
    server = lora_config_server
    bad = write_lora_adapter(tmp_path / "bad", spec, config={"modules_to_save": ["lm_head"]})
    with RicClient(server.endpoint, timeout_s=30) as client:
        before = adapter_hashes(client)
        server.write(lora_modules=[f"A={bad}", f"B={adapters['B']}"])
        assert wait_for(lambda: server.config()["reloads"] == 1, WAIT_S)
        assert adapter_hashes(client) == before
        assert server.config()["controls"]["lora_modules"] == [f"A={adapters['A']}", f"B={adapters['B']}"]
