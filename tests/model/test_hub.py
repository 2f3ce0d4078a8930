"""Hugging Face Hub ids as models and tokenizers (zllm/model/hub.py), served from a Hub cache
laid out as huggingface_hub lays it out (tests/hub_cache.py): the Hub is not reachable here,
so every test runs with HF_HUB_OFFLINE, except those that point huggingface_hub at a
stand-in Hub to see its refusals. huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE when
it is imported, so the in-process tests set its constants as the variables would have; the
served test sets the variables."""

from __future__ import annotations

import filecmp
import os
import shutil
from pathlib import Path

import huggingface_hub
import pytest
from gguf import GGMLQuantizationType as T
from gguf_files import write_llama_gguf
from hub_cache import StubHub, add_snapshot, files_of, write_split_gguf
from servers import start_server, stop_server
from tiny_models import CHAT_TEMPLATE, write_tiny_model

from zllm import LLM, SamplingParams
from zllm.cli import main as zllm_main
from zllm.config.engine_args import EngineArgs
from zllm.model.files import resolve_model, resolve_tokenizer
from zllm.text.tokenizer import load_tokenizer

OTHER_TEMPLATE = (
    "{% for message in messages %}### {{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}### assistant:{% endif %}"
)
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 77, 300, 12], [400, 3, 3, 9, 250, 31, 100]]
CHAT = [{"role": "user", "content": "The quick brown fox"}]


class Hub:
    """The module's cache and the local files its snapshots were made from."""

    def __init__(self, root: Path) -> None:
        self.cache = root / "hub"
        self.tiny = write_tiny_model(root / "tiny", seed=0)
        self.tiny2 = write_tiny_model(root / "tiny2", seed=1)
        self.other = write_tiny_model(root / "other", chat_template=OTHER_TEMPLATE, weights=False)
        self.gguf = root / "gguf" / "tiny-Q8_0.gguf"
        self.gguf.parent.mkdir()
        write_llama_gguf(self.gguf, lambda name: T.Q8_0)
        self.parts = write_split_gguf(self.gguf, root / "split" / "tiny-Q8_0.gguf", 7)
        self.main = add_snapshot(self.cache, "org/tiny", files_of(self.tiny))
        self.v2 = add_snapshot(self.cache, "org/tiny", files_of(self.tiny2), refs=["v2"])
        add_snapshot(self.cache, "org/other", files_of(self.other, TOKENIZER_FILES))
        # Two quantizations (the F16 one's bytes are the Q8_0 file's: only names matter).
        add_snapshot(
            self.cache,
            "org/tiny-GGUF",
            {
                "tiny-Q8_0.gguf": self.gguf,
                "tiny-F16.gguf": self.gguf,
                "mmproj-Q8_0.gguf": self.gguf,
            },
        )
        add_snapshot(self.cache, "org/split-GGUF", {f"Q8_0/{p.name}": p for p in self.parts})
        add_snapshot(self.cache, "org/torn-GGUF", {p.name: p for p in self.parts[:2]})
        add_snapshot(
            self.cache, "org/twins-GGUF", {"a-Q8_0.gguf": self.gguf, "b-Q8_0.gguf": self.gguf}
        )
        add_snapshot(self.cache, "org/empty", {"README.md": self.tiny / "config.json"})


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Hub:
    return Hub(tmp_path_factory.mktemp("hub"))


@pytest.fixture
def offline(hub: Hub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Hub:
    """HF_HUB_CACHE=hub.cache HF_HUB_OFFLINE=1, and joined GGUF files in a fresh $ZLLM_CACHE."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub.cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("ZLLM_CACHE", str(tmp_path / "zllm"))
    return hub


def snapshot_of(hub: Hub, repo_id: str) -> Path:
    """The snapshot of `repo_id` that main points at."""
    repo = hub.cache / ("models--" + repo_id.replace("/", "--"))
    return repo / "snapshots" / (repo / "refs" / "main").read_text()


def tiny_llm(model: str, **kwargs) -> LLM:
    return LLM(model, kv_cache_memory_bytes=16 << 20, max_num_seqs=4, **kwargs)


def greedy(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def tiny_tokens(hub: Hub) -> list[list[int]]:
    return greedy(tiny_llm(str(hub.tiny)))


# ---------------------------------------------------------------------------------------------
# The cache is huggingface_hub's


def test_the_cache_reads_as_huggingface_hubs_own(hub: Hub) -> None:
    repos = {r.repo_id: r for r in huggingface_hub.scan_cache_dir(hub.cache).repos}
    revisions = {rev.commit_hash: rev for rev in repos["org/tiny"].revisions}
    assert revisions[hub.main.name].refs == {"main"}
    assert revisions[hub.v2.name].refs == {"v2"}
    names = {f.file_name for f in revisions[hub.main.name].files}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names


# ---------------------------------------------------------------------------------------------
# Models


def test_hub_id_serves_the_snapshot_with_the_directorys_greedy_tokens(offline, tiny_tokens) -> None:
    llm = tiny_llm("org/tiny")
    assert llm.config.model_path == str(offline.main)
    assert llm.config.tokenizer_path == str(offline.main)
    assert llm.config.model == "org/tiny"  # the served name, as vLLM's
    assert greedy(llm) == tiny_tokens


def test_revision_picks_a_snapshot_through_its_ref(offline, tiny_tokens) -> None:
    assert resolve_model("org/tiny", revision=offline.v2.name) == str(offline.v2)  # a commit
    llm = tiny_llm("org/tiny", revision="v2")
    assert llm.config.model_path == str(offline.v2)
    tokens = greedy(llm)
    assert tokens == greedy(tiny_llm(str(offline.tiny2)))
    assert tokens != tiny_tokens


def test_download_dir_names_the_cache(offline, monkeypatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", "/nonexistent")
    assert resolve_model("org/tiny", download_dir=str(offline.cache)) == str(offline.main)
    args = EngineArgs("org/tiny", download_dir=str(offline.cache), tokenizer="org/other")
    config = args.create_engine_config()  # the tokenizer's id is looked up there too
    assert config.model_path == str(offline.main)
    assert config.tokenizer_path == str(snapshot_of(offline, "org/other"))
    with pytest.raises(ValueError, match="nor in the Hugging Face cache [(]/nonexistent[)]"):
        resolve_model("org/tiny")


def test_gguf_tag_picks_the_file_and_a_hub_tokenizer_replaces_its_own(offline) -> None:
    path = resolve_model("org/tiny-GGUF:q8_0")  # any case; mmproj-Q8_0.gguf is no model
    assert path == str(snapshot_of(offline, "org/tiny-GGUF") / "tiny-Q8_0.gguf")
    assert resolve_model("org/tiny-GGUF/tiny-F16.gguf").endswith("/tiny-F16.gguf")
    reference = greedy(tiny_llm(str(offline.gguf)))
    llm = tiny_llm("org/tiny-GGUF:Q8_0", tokenizer="org/other")
    assert greedy(llm) == reference
    # The GGUF file has no chat template; the tokenizer repo's is used.
    assert llm.config.tokenizer_path == str(snapshot_of(offline, "org/other"))
    out = llm.chat(CHAT, GREEDY, use_tqdm=False)[0]
    rendered = "### user: The quick brown fox\n### assistant:"
    assert out.prompt_token_ids == llm.get_tokenizer().encode(rendered, add_special_tokens=False)


def test_split_gguf_parts_are_joined_once_into_the_file_they_came_from(offline) -> None:
    joined = resolve_model("org/split-GGUF:Q8_0")  # parts in a folder named by the tag
    assert Path(joined).name == "tiny-Q8_0.gguf"
    assert Path(joined).is_relative_to(Path(os.environ["ZLLM_CACHE"]) / "joined")
    assert filecmp.cmp(joined, offline.gguf, shallow=False)  # gguf-split --merge's bytes
    mtime = Path(joined).stat().st_mtime_ns
    assert resolve_model("org/split-GGUF/Q8_0/tiny-Q8_0-00002-of-00003.gguf") == joined
    assert Path(joined).stat().st_mtime_ns == mtime  # not joined again
    local = resolve_model(str(offline.parts[1]))  # a local split file too
    assert filecmp.cmp(local, offline.gguf, shallow=False)


# ---------------------------------------------------------------------------------------------
# Tokenizers


def test_tokenizer_directory_replaces_the_models_tokenizer_and_template(offline) -> None:
    llm = tiny_llm(str(offline.tiny), tokenizer=str(offline.other))
    assert llm.config.tokenizer_path == str(offline.other)
    assert llm.get_tokenizer().chat_template == OTHER_TEMPLATE
    out = llm.chat(CHAT, GREEDY, use_tqdm=False)[0]
    ours = llm.get_tokenizer().encode(
        "### user: The quick brown fox\n### assistant:", add_special_tokens=False
    )
    assert out.prompt_token_ids == ours
    assert load_tokenizer(str(offline.tiny)).chat_template == CHAT_TEMPLATE


def test_tokenizer_revision_and_a_tokenizer_only_repo(offline) -> None:
    config = EngineArgs(str(offline.tiny), tokenizer="org/tiny", tokenizer_revision="v2")
    assert config.create_engine_config().tokenizer_path == str(offline.v2)
    assert resolve_tokenizer("org/other") == str(snapshot_of(offline, "org/other"))
    # org/other has no config.json: a model it is not, a tokenizer it is.
    with pytest.raises(ValueError, match="org/other: org/other has neither config.json nor"):
        resolve_model("org/other")


REPO_FILES = [
    ".gitattributes", "README.md", "config.json", "generation_config.json", "tokenizer.json",
    "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
    "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
    "model.safetensors.index.json", "consolidated.safetensors", "pytorch_model.bin",
    "onnx/model.onnx", "original/params.safetensors", "model-Q8_0.gguf",
]  # fmt: skip
ENGINE_FILES = [
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "chat_template.jinja", "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors", "model.safetensors.index.json",
]  # fmt: skip


def test_online_fetches_only_the_files_the_engine_reads(online, hub, monkeypatch) -> None:
    """The file choice from the Hub's listing (a stand-in Hub answers the model info): what
    snapshot_download is asked for, the one call that needs the real Hub."""
    parts = [f"Q4_K_M/x-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    fetched = online.parent / "fetched"  # what a snapshot_download would leave
    shutil.copytree(hub.tiny, fetched)
    (fetched / "Q4_K_M").mkdir()
    for name, part in zip(parts, hub.parts, strict=True):
        shutil.copy(part, fetched / name)
    asked: list[list[str]] = []

    def snapshot_download(repo_id, *, revision, cache_dir, allow_patterns):
        asked.append(allow_patterns)
        for name in allow_patterns:  # (plain names: no glob characters to escape here)
            (fetched / name).touch()
        return str(fetched)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with StubHub(404, "EntryNotFound", REPO_FILES + parts) as stub:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", stub.url)
        assert resolve_model("org/x") == str(fetched)
        assert resolve_tokenizer("org/x") == str(fetched)
        assert filecmp.cmp(resolve_model("org/x:q4_k_m"), hub.gguf, shallow=False)
    assert sorted(asked[0]) == sorted(ENGINE_FILES)
    assert sorted(asked[1]) == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    assert asked[2] == parts


# ---------------------------------------------------------------------------------------------
# Refusals: one line naming the id and what to do


def refusal(call, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as caught:
        call(*args, **kwargs)
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_refusals_from_the_cache(offline) -> None:
    cache = offline.cache
    assert refusal(resolve_model, "org/missing") == (
        f"org/missing is neither a local path nor in the Hugging Face cache ({cache}), and "
        "HF_HUB_OFFLINE is set: "
        "fetch it once where the Hub is reachable (HF_HUB_OFFLINE unset), or name the cache "
        "that holds it (HF_HUB_CACHE, --download-dir)"
    )
    assert refusal(resolve_model, "org/tiny", revision="v9").startswith(
        f"org/tiny: revision 'v9' of org/tiny is not in the Hugging Face cache ({cache}) and "
        "HF_HUB_OFFLINE is set"
    )
    assert refusal(resolve_model, "org/tiny-GGUF:Q5_K_M") == (
        "org/tiny-GGUF:Q5_K_M: no GGUF file of org/tiny-GGUF in the Hugging Face cache matches "
        "the tag 'Q5_K_M' (GGUF files: tiny-F16.gguf, tiny-Q8_0.gguf); name one as "
        "org/tiny-GGUF:TAG or org/tiny-GGUF/FILE.gguf"
    )
    assert refusal(resolve_model, "org/twins-GGUF:Q8_0") == (
        "org/twins-GGUF:Q8_0: the tag 'Q8_0' matches several GGUF files of org/twins-GGUF "
        "(a-Q8_0.gguf, b-Q8_0.gguf); name one as org/twins-GGUF/FILE.gguf"
    )
    assert refusal(resolve_model, "org/tiny-GGUF") == (
        "org/tiny-GGUF: org/tiny-GGUF has no config.json and several GGUF files in the "
        "Hugging Face cache (GGUF files: tiny-F16.gguf, tiny-Q8_0.gguf): name one as "
        "org/tiny-GGUF:TAG or org/tiny-GGUF/FILE.gguf"
    )
    assert refusal(resolve_model, "org/tiny-GGUF/tiny-Q2_K.gguf") == (
        "org/tiny-GGUF/tiny-Q2_K.gguf: org/tiny-GGUF has no file tiny-Q2_K.gguf in the "
        "Hugging Face cache (GGUF files: tiny-F16.gguf, tiny-Q8_0.gguf)"
    )
    assert refusal(resolve_model, "org/torn-GGUF:Q8_0") == (
        "org/torn-GGUF:Q8_0: tiny-Q8_0-00001-of-00003.gguf is split in 3 parts but 2 are in "
        "the Hugging Face cache (tiny-Q8_0-00001-of-00003.gguf, tiny-Q8_0-00002-of-00003.gguf); "
        "each part is needed"
    )
    assert refusal(resolve_model, "org/empty") == (
        "org/empty: org/empty has neither config.json nor a .gguf file in the Hugging Face "
        "cache: not a model zllm reads (Hugging Face layout or GGUF)"
    )
    assert refusal(resolve_model, str(offline.tiny), revision="v2") == (
        f"a revision ('v2') names a version of a Hugging Face Hub repo; {str(offline.tiny)!r} "
        "is not a Hub id"
    )
    assert refusal(resolve_tokenizer, str(offline.gguf.parent)).startswith(
        f"unknown tokenizer {str(offline.gguf.parent)!r} (directory without tokenizer.json)"
    )


@pytest.fixture
def online(hub: Hub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """HF_HUB_OFFLINE unset, an empty cache; the endpoint is each test's to set."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return tmp_path / "hub"


def test_refusals_from_the_hub(online, monkeypatch) -> None:
    cases = [
        (404, "RepoNotFound", None, "org/missing: no model repo org/missing on the Hugging Face "
         "Hub (nor a local path of that name), or it is private: check the id, or set HF_TOKEN "
         "to a token that can read it"),
        # The gate shows at the download: the model info answers.
        (401, "GatedRepo", ["config.json", "model.safetensors"], "org/missing: org/missing is "
         "a gated model: accept its conditions at https://huggingface.co/org/missing and set "
         "HF_TOKEN to a token of that account"),
    ]  # fmt: skip
    for status, code, siblings, expected in cases:
        with StubHub(status, code, siblings) as stub:
            monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", stub.url)
            assert refusal(resolve_model, "org/missing") == expected
    with StubHub(404, "RevisionNotFound") as stub:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", stub.url)
        assert refusal(resolve_model, "org/tiny", revision="v9") == (
            "org/tiny: org/tiny has no revision 'v9' on the Hugging Face Hub; give a branch, "
            "tag or commit hash it has"
        )


def test_no_network_serves_the_cache_else_says_so(online, hub, monkeypatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # refused
    message = refusal(resolve_model, "org/tiny")
    assert message.startswith(
        f"org/tiny is neither a local path nor in the Hugging Face cache ({online}), and the "
        "Hugging Face Hub could not be reached (Connect"
    )
    assert resolve_model("org/tiny", download_dir=str(hub.cache)) == str(hub.main)


def test_offline_asks_the_hub_nothing(offline, monkeypatch) -> None:
    with StubHub(404, "RepoNotFound") as stub:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", stub.url)
        assert resolve_model("org/tiny") == str(offline.main)
        refusal(resolve_model, "org/missing")
    assert stub.requests == []


def test_the_command_line_refuses_in_one_line(offline, capsys) -> None:
    assert zllm_main(["download", "org/missing"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("zllm: error: org/missing is neither a local path nor in the")
    assert "\n" not in err
    assert zllm_main(["download", "org/tiny", "--revision", "v2"]) == 0
    assert capsys.readouterr().out.strip() == str(offline.v2)


# ---------------------------------------------------------------------------------------------
# Served: every process reads the local paths the supervisor resolved


@pytest.mark.e2e
def test_serve_hub_id_offline_with_a_hub_tokenizer(hub: Hub, tiny_tokens, tmp_path: Path) -> None:
    env = {"HF_HUB_CACHE": str(hub.cache), "HF_HUB_OFFLINE": "1"}
    server = start_server("org/tiny", tmp_path / "serve.log", "--tokenizer", "org/other", env=env)
    try:
        r = server.post(
            "/v1/completions",
            {"model": "org/tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
             "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        tokens = r.json()["choices"][0]["logprobs"]["tokens"]
        assert tokens == [f"token_id:{t}" for t in tiny_tokens[0]]
        # The tokenizer worker renders the chat with org/other's template.
        r = server.post(
            "/v1/chat/completions", {"model": "org/tiny", "messages": CHAT, "max_tokens": 1}
        )
        assert r.status_code == 200, r.text
        other = load_tokenizer(str(hub.other))
        rendered = "### user: The quick brown fox\n### assistant:"
        assert r.json()["usage"]["prompt_tokens"] == len(other.encode(rendered, False))
    finally:
        stop_server(server)
