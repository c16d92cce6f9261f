"""A model's sampling defaults: its generation_config.json, a speech layout's, the operator's `--sampling-default`;
ListModels shows the effective values, and a request's unset fields take them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.checkpoints import make_checkpoint
from support.paths import REPO_ROOT
from support.service_harness import ServerThread, user_request

from omnivox.engine import SamplingParams
from omnivox.services.cli._common import CliError
from omnivox.services.cli._serve_flags import model_specs, parse_sampling_default
from omnivox.services.parts.bundle import read_generation_config
from omnivox.services.parts.defaults import DEFAULT_GENERATION_CONFIG, DEFAULT_MODEL_NAME, DEFAULT_SPEECH_MODEL_NAME
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import generation_pb2_grpc, model_pb2, model_pb2_grpc, sampling_pb2


def test_generation_config_values(tmp_path: Path) -> None:
    file = tmp_path / "generation_config.json"
    file.write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_length": 9}))
    assert read_generation_config(file) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    file.write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert read_generation_config(file) == {"temperature": 0.0}  # transformers' greedy
    file.write_text("{not json")
    assert read_generation_config(file) == {}
    assert read_generation_config(tmp_path / "missing.json") == {}


def test_the_embedded_default_ships_valid_defaults() -> None:
    defaults = read_generation_config(DEFAULT_GENERATION_CONFIG)
    assert defaults, "the shipped generation_config.json sets no sampling value"
    assert SamplingParams(**defaults).violations(vocab_size=1) == []
    readme = (DEFAULT_GENERATION_CONFIG.parent.parent / "README.md").read_text()
    assert "What is the capital of France?" in readme  # the measurement is written next to the data


def test_sampling_default_flags_bind_to_models(tmp_path: Path) -> None:
    assert parse_sampling_default("temperature=0.7") == (None, "temperature", 0.7)
    assert parse_sampling_default("tiny:top_k=5") == ("tiny", "top_k", 5)
    a, b = tmp_path / "a", tmp_path / "B.gguf"
    specs = model_specs([a, b], ["first"], ["temperature=0.5", "b:top_p=0.8", "first:min_p=0.1"])
    assert [dict(s.sampling_overrides) for s in specs] == [{"temperature": 0.5, "min_p": 0.1}, {"top_p": 0.8}]
    embedded = model_specs([], [], ["temperature=0", f"{DEFAULT_SPEECH_MODEL_NAME}:temperature=0.9"])
    # text, hibari (the default speech model), orpheus-random, whisper-base, the image model
    assert [dict(s.sampling_overrides) for s in embedded] == [{"temperature": 0.0}, {}, {"temperature": 0.9}, {}, {}]
    assert embedded[-1].image and embedded[-1].path is None
    assert embedded[0].name is None and model_specs([], [], [f"{DEFAULT_MODEL_NAME}:top_k=3"])[0].sampling_overrides


@pytest.mark.parametrize(
    ("flag", "fragment"),
    [
        ("temperature=-1", "temperature must be a finite number >= 0"),
        ("top_p=1.5", "top_p must be in (0, 1]"),
        ("top_k=2.5", "is not a number"),
        ("seed=3", "KEY one of"),
        ("temperature", "KEY one of"),
        ("other:temperature=0.5", "no model is served as 'other'"),
    ],
)
def test_a_bad_sampling_default_is_one_clear_error(tmp_path: Path, flag: str, fragment: str) -> None:
    with pytest.raises(CliError) as error:
        model_specs([tmp_path / "tiny"], [], [flag])
    assert fragment in str(error.value) and "\n" not in str(error.value)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")
    (path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.0, "top_p": 0.7}))
    return path


def test_list_models_shows_effective_defaults_and_requests_take_them(checkpoint: Path) -> None:
    specs = [
        ModelSpec(path=checkpoint, name="own"),
        ModelSpec(path=checkpoint, name="hot", sampling_overrides={"temperature": 0.8, "top_k": 4}),
    ]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.01, device="cpu")) as server:
        models = model_pb2_grpc.ModelServiceStub(server.channel()).ListModels(model_pb2.ListModelsRequest()).models
        shown = {m.name: m.default_sampling for m in models}
        assert shown["own"] == sampling_pb2.SamplingConfig(temperature=0.0, top_p=0.7)
        assert shown["hot"] == sampling_pb2.SamplingConfig(temperature=0.8, top_p=0.7, top_k=4)

        stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
        prompt = "The capital of France is"

        def tokens(model: str, **fields) -> list[int]:
            responses = list(stub.Generate(user_request(prompt, model=model, max_output_tokens=12, **fields)))
            return [t for r in responses if r.HasField("delta") for t in r.delta.token_ids]

        # "own" has temperature 0 from its file: no sampling fields means greedy, whatever the seed.
        greedy = tokens("own", sampling=sampling_pb2.SamplingConfig(seed=1))
        assert greedy == tokens("own", sampling=sampling_pb2.SamplingConfig(seed=2))
        assert greedy == tokens("own", sampling=sampling_pb2.SamplingConfig(temperature=0.0))
        # "hot" samples at 0.8 by the operator's override (top_k 4 of 384 tokens): seeds differ somewhere.
        sampled = {tuple(tokens("hot", sampling=sampling_pb2.SamplingConfig(seed=s))) for s in range(6)}
        assert len(sampled) > 1
        # A field the request sets wins over every default.
        assert tokens("hot", sampling=sampling_pb2.SamplingConfig(temperature=0.0)) == greedy


@pytest.mark.slow
def test_the_embedded_default_answers_paris_without_sampling_fields(default_gguf: Path) -> None:
    """`omnivox chat "What is the capital of France?"` against the embedded default, tried as a new user would: no
    sampling fields (only a seed, so that the ten runs are ten draws). At temperature 1 it answered nonsense 2 times
    in 3; the shipped defaults must say Paris in at least 8 of 10."""
    from concurrent.futures import ThreadPoolExecutor

    with ServerThread([ModelSpec(path=None)], EngineOptions(kv_cache_gib=0.1, device="cpu")) as server:
        model = server.registry.lookup(DEFAULT_MODEL_NAME)
        assert model.source == default_gguf and model.sampling_defaults == read_generation_config(
            DEFAULT_GENERATION_CONFIG
        )
        stub = generation_pb2_grpc.GenerationServiceStub(server.channel())

        def answer(seed: int) -> str:
            request = user_request("What is the capital of France?", max_output_tokens=24)
            request.sampling.seed = seed
            return "".join(r.delta.text for r in stub.Generate(request, timeout=300) if r.HasField("delta"))

        with ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(answer, range(10)))
    assert sum("Paris" in a for a in answers) >= 8, answers


def test_the_shipped_defaults_are_package_data() -> None:
    """A wheel install (the Docker image) must carry the default's generation_config.json and its measurement."""
    import fnmatch
    import tomllib

    root = REPO_ROOT
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "omnivox.services.parts"
    ]
    parts = root / "services" / "parts"
    shipped = [p.relative_to(parts).as_posix() for p in (parts / "data").rglob("*.*")]
    assert DEFAULT_GENERATION_CONFIG.is_file() and len(shipped) >= 3
    for name in shipped:
        assert any(fnmatch.fnmatch(name, g) for g in globs), f"services/parts/{name} is not package data"


def test_a_bad_override_is_refused_before_loading(checkpoint: Path) -> None:
    from omnivox.services.grpc_api.server import build_registry
    from omnivox.services.parts.loading import ModelLoadError

    with pytest.raises(ModelLoadError, match="bad sampling default: top_p must be in"):
        build_registry([ModelSpec(path=checkpoint, sampling_overrides={"top_p": 0.0})], max_queue=4)
    with pytest.raises(ModelLoadError, match="unknown sampling default"):
        build_registry([ModelSpec(path=checkpoint, sampling_overrides={"warmth": 1.0})], max_queue=4)
