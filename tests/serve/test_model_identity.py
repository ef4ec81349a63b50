"""Every front names the served model alike: the ZeroMQ ``stats`` reply, ``/v1/models``, an
OpenAI answer's ``model``, the metrics' ``model_name`` label, a replay report's model entry and
``ricllm info`` all read the one ``ServedModel`` the engine builds."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from ricllm.client import RicClient
from ricllm.model.identity import ServedModel
from tests.serve.test_server import http_get, metric_values

OWN_NAME = "tiny-random-llama"  # the tiny GGUF's general.name


def completion_model(base_url: str, model: str) -> str:
    body = json.dumps({"model": model, "prompt": "cell 17", "max_tokens": 2, "temperature": 0}).encode()
    request = urllib.request.Request(base_url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["model"]


@pytest.mark.parametrize("served_model_name", [None, "ran-decider"])
def test_every_front_reports_the_same_model_name(start_server, tiny_gguf, served_model_name):
    running = start_server(engine={"served_model_name": served_model_name})
    expected = served_model_name or OWN_NAME
    with RicClient(running.endpoint, timeout_s=30) as client:
        model = client.stats().model
    assert (model.name, model.served_name, Path(model.path).name) == (OWN_NAME, expected, Path(tiny_gguf).name)
    listed = json.loads(http_get(running.http_url + "/v1/models")[1])
    assert [card["id"] for card in listed["data"]] == [expected]
    assert completion_model(running.http_url, Path(tiny_gguf).name) == expected  # the file's name answers too
    labels = {dict(series)["model_name"] for _, series in metric_values(running.http_url) if "model_name" in dict(series)}
    assert labels == {expected}
    record = model.served_model().record(digest=False)  # what a replay over ZeroMQ writes
    assert (record["name"], record["served_name"], record["sha256"]) == (OWN_NAME, expected, None)


def test_the_served_model_names_fall_back_once():
    unnamed = ServedModel.of("/models/cell-decider.Q4_0.gguf")
    assert (unnamed.name, unnamed.served_name) == ("cell-decider.Q4_0", "cell-decider.Q4_0")
    named = ServedModel.of("/models/x.gguf", "SmolLM2-135M-Instruct", "ran-decider")
    assert (named.name, named.served_name) == ("SmolLM2-135M-Instruct", "ran-decider")
    assert named.answers_to("ran-decider") and named.answers_to("x.gguf") and named.answers_to("x")
    assert not named.answers_to("SmolLM2-135M-Instruct") and not named.answers_to("gpt-4o")


def test_info_and_the_in_process_engine_name_the_model_as_the_server_does(tiny_gguf, capsys):
    from ricllm import LLM
    from ricllm.cli import main

    assert main(["info", str(tiny_gguf)]) == 0
    rows = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines() if line.startswith("name "))
    assert rows["name"].strip() == OWN_NAME
    engine = LLM(model=str(tiny_gguf), served_model_name="ran-decider", kv_cache_budget="4MiB", dtype="float32",
                 threads=2).engine
    record = engine.served_model.record()  # what an in-process replay writes
    assert (record["name"], record["served_name"], Path(record["path"]).name) == \
        (OWN_NAME, "ran-decider", Path(tiny_gguf).name)
    assert len(record["sha256"]) == 64
