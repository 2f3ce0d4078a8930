"""Images in (issue 60, its inputs): where an image may come from, what is checked before
anything is queued (zllm/media/images.py), and each route's 400 naming the part: OpenAI chat
`image_url` parts, Anthropic `image` blocks, Responses `input_image`, the offline
`multi_modal_data` and chat parts. The engine keeps serving after each refusal."""

from __future__ import annotations

import base64
import http.server
import io
import random
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image
from tiny_models import write_tiny_model

from zllm import LLM
from zllm.config.engine_args import EngineArgs
from zllm.config.media import MediaConfig, parse_limit_mm_per_prompt
from zllm.errors import ParamError
from zllm.media.images import ImageError, image_from_bytes, image_from_pil, read_image_url


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def picture(seed: int = 0, size: tuple[int, int] = (24, 16)) -> Image.Image:
    """Random pixels (so its PNG does not compress below its pixels' size)."""
    return Image.frombytes("RGB", size, random.Random(seed).randbytes(size[0] * size[1] * 3))


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def bomb_png(width: int, height: int) -> bytes:
    """A valid PNG header claiming width x height, with one tiny compressed row: a file of a
    hundred bytes that would decode to gigabytes."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )


MEDIA = MediaConfig()


# ---------------------------------------------------------------------------------------------
# The rules


def test_an_image_is_known_by_its_pixels_whatever_its_encoding() -> None:
    image = picture()
    as_png = image_from_bytes(encoded(image, "PNG"), MEDIA)
    as_bmp = image_from_bytes(encoded(image, "BMP"), MEDIA)
    from_pil = image_from_pil(image, MEDIA)
    assert (as_png.width, as_png.height) == (24, 16)
    assert as_png.digest == as_bmp.digest == from_pil.digest
    assert image_from_bytes(encoded(picture(seed=1)), MEDIA).digest != as_png.digest
    assert read_image_url(data_url(encoded(image)), MEDIA) == encoded(image)


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"plain text, not an image", "not an image"),
        (encoded(picture(), "PNG")[:80], "PNG image is truncated or corrupt"),
        (encoded(picture(size=(64, 64)), "JPEG")[:-500], "JPEG image is truncated or corrupt"),
        (bomb_png(5000, 5000), r"5000x5000 = 25,000,000 pixels; at most 16,777,216"),
        (bomb_png(100_000, 100_000), r"over 178,956,970 pixels; at most 16,777,216"),
    ],
    ids=["not-an-image", "truncated-png", "truncated-jpeg", "bomb", "bomb-beyond-pils-limit"],
)
def test_bad_images_are_refused_saying_why(data: bytes, says: str) -> None:
    with pytest.raises(ImageError, match=says):
        image_from_bytes(data, MEDIA)


def test_the_size_limits_hold() -> None:
    small = MediaConfig(max_image_pixels=100, max_image_bytes=200)
    with pytest.raises(ImageError, match=r"24x16 = 384 pixels; at most 100"):
        image_from_pil(picture(), small)
    with pytest.raises(ImageError, match=r"bytes; at most 200 are allowed"):
        read_image_url(data_url(encoded(picture(size=(64, 64)))), small)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("data:image/png,rawbytes", "must be base64"),
        ("data:text/plain;base64,aGVsbG8=", "'text/plain' is not an image"),
        ("data:image/png;base64,@@@@", "base64 does not decode"),
        ("ftp://example.com/a.png", "unsupported image URL"),
        ("https://example.com/a.png", "host 'example.com' are not allowed"),
        ("file:///etc/passwd", "no --allowed-local-media-path"),
    ],
)
def test_image_urls_follow_the_servers_rules(url: str, says: str) -> None:
    with pytest.raises(ImageError, match=says):
        read_image_url(url, MEDIA)


def test_local_files_are_read_under_the_allowed_directory_only(tmp_path: Path) -> None:
    allowed = tmp_path / "images"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(encoded(picture()))
    (tmp_path / "secret.png").write_bytes(encoded(picture()))
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    media = MediaConfig(allowed_local_path=str(allowed))
    assert read_image_url(f"file://{allowed}/a.png", media) == encoded(picture())
    for outside in (f"file://{tmp_path}/secret.png", f"file://{allowed}/../secret.png"):
        with pytest.raises(ImageError, match="outside --allowed-local-media-path"):
            read_image_url(outside, media)
    with pytest.raises(ImageError, match="outside"):  # a symlink out is resolved first
        read_image_url(f"file://{allowed}/link.png", media)


class _ImageHost(http.server.BaseHTTPRequestHandler):
    """/image.png, /slow.png (sleeps past the timeout), /big.png, /redirect (to another
    host), /missing (404)."""

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://localhost.invalid/image.png")
            self.end_headers()
            return
        if self.path == "/slow.png":
            time.sleep(1.5)
        body = encoded(picture(size=(64, 64)) if self.path == "/big.png" else picture())
        if self.path == "/missing":
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def image_host() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageHost)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_urls_are_fetched_from_allowed_hosts_only(image_host: str) -> None:
    media = MediaConfig(allowed_domains=["127.0.0.1"], fetch_timeout_s=0.5, max_image_bytes=2000)
    assert read_image_url(f"{image_host}/image.png", media) == encoded(picture())
    for path, says in [
        ("/redirect", "host 'localhost.invalid' are not allowed"),
        ("/slow.png", "fetching the image URL failed: timed out"),
        ("/big.png", "at most 2,000 are allowed"),
        ("/missing", "HTTP 404"),
    ]:
        with pytest.raises(ImageError, match=says):
            read_image_url(f"{image_host}{path}", media)
    with pytest.raises(ImageError, match="'127.0.0.1' are not allowed"):
        read_image_url(f"{image_host}/image.png", MEDIA)


def test_the_options_become_the_media_config(tiny_llama_dir: str, tmp_path: Path) -> None:
    config = EngineArgs(
        model=tiny_llama_dir,
        limit_mm_per_prompt={"image": 2},
        max_image_pixels=1000,
        allowed_media_domains=["Images.Example.com"],
        allowed_local_media_path=str(tmp_path),
    ).create_engine_config()
    assert config.media.images_per_prompt == 2 and config.media.max_image_pixels == 1000
    assert config.media.allowed_domains == ["images.example.com"]
    assert config.media.allowed_local_path == str(tmp_path.resolve())
    for bad, says in [('{"audio": 1}', "not 'audio'"), ('{"image": -1}', "count >= 0"), ("2", "")]:
        with pytest.raises(ValueError, match=says):
            parse_limit_mm_per_prompt(bad)
    with pytest.raises(ValueError, match="not a directory"):
        EngineArgs(
            model=tiny_llama_dir, allowed_local_media_path="/nonexistent"
        ).create_engine_config()


# ---------------------------------------------------------------------------------------------
# Offline


def test_offline_prompts_with_images_are_checked_then_refused_by_a_text_model(
    tiny_llama_dir: str,
) -> None:
    llm = LLM(tiny_llama_dir, limit_mm_per_prompt={"image": 2})
    good = picture()
    cases = [
        ({"prompt": "hi", "multi_modal_data": {"image": good}}, "does not take image input"),
        ({"prompt": "hi", "multi_modal_data": {"image": [good] * 3}}, "3 images in one prompt"),
        ({"prompt": "hi", "multi_modal_data": {"video": good}}, "not 'video'"),
        ({"prompt": "hi", "multi_modal_data": {"image": b"x"}}, r"\['image'\]\[0\]: an image must"),
    ]
    for prompt, says in cases:
        with pytest.raises(ParamError, match=says):
            llm.generate(prompt, use_tqdm=False)
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    with pytest.raises(ParamError, match=r"messages\[0\]\.content\[0\]: the data is not an image"):
        llm.chat([{"role": "user", "content": parts}], use_tqdm=False)
    pil = [{"type": "image_pil", "image_pil": good}, {"type": "text", "text": "what is it"}]
    with pytest.raises(ParamError, match="does not take image input"):
        llm.chat([{"role": "user", "content": pil}], use_tqdm=False)
    assert llm.generate("still serving", use_tqdm=False)[0].outputs[0].token_ids


# ---------------------------------------------------------------------------------------------
# Served: every route


@pytest.fixture(scope="module")
def server(tmp_path_factory, engine_pool):
    path = tmp_path_factory.mktemp("images")
    model = write_tiny_model(path / "model")
    with engine_pool.serve(
        str(model), path / "server.log", "--served-model-name", "tiny",
        "--limit-mm-per-prompt", '{"image": 2}', "--max-image-pixels", "1000000",
    ) as server:  # fmt: skip
        yield server


def _chat(parts: list[dict]) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": parts}], "max_tokens": 4}


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


GOOD = data_url(encoded(picture()))
BAD_INPUTS = [  # (the image URL, what the 400 says)
    (data_url(b"GIF89a not really"), "messages[0].content[1]: the data is not an image"),
    (data_url(encoded(picture())[:80]), "messages[0].content[1]: the PNG image is truncated"),
    (data_url(bomb_png(5000, 5000)), "25,000,000 pixels; at most 1,000,000"),
    ("https://example.com/cat.png", "host 'example.com' are not allowed"),
    ("file:///etc/hostname", "no --allowed-local-media-path"),
]


@pytest.mark.e2e
def test_openai_chat_image_parts_are_checked_and_named(server) -> None:
    for url, says in BAD_INPUTS:
        response = server.post(
            "/v1/chat/completions", _chat([{"type": "text", "text": "see"}, _image_part(url)])
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert says in error["message"] and error["param"] == "messages[0].content[1]", error
    three = _chat([_image_part(GOOD)] * 3)
    response = server.post("/v1/chat/completions", three)
    assert response.status_code == 400 and "3 images in one prompt" in response.text
    response = server.post("/v1/chat/completions", _chat([_image_part(GOOD)]))
    assert response.status_code == 400 and "does not take image input" in response.text
    response = server.post(
        "/tokenize", {"model": "tiny", "messages": _chat([_image_part(GOOD)])["messages"]}
    )
    assert response.status_code == 400 and "does not take image input" in response.text
    text = server.post("/v1/chat/completions", _chat([{"type": "text", "text": "hello"}]))
    assert text.status_code == 200 and text.json()["usage"]["completion_tokens"] == 4


@pytest.mark.e2e
def test_anthropic_image_blocks_are_checked_and_named(server) -> None:
    def message(source: dict) -> dict:
        content = [{"type": "text", "text": "see"}, {"type": "image", "source": source}]
        return {
            "model": "tiny",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": content}],
        }

    not_png = base64.b64encode(b"no image here").decode()
    for source, says in [
        (
            {"type": "base64", "media_type": "image/png", "data": not_png},
            "messages.0.content.1: the data is not an image",
        ),
        (
            {"type": "url", "url": "https://example.com/cat.png"},
            "host 'example.com' are not allowed",
        ),
        ({"type": "file", "file_id": "f"}, "an image block's source must be"),
    ]:
        response = server.post("/v1/messages", message(source))
        assert response.status_code == 400, response.text
        assert says in response.json()["error"]["message"], response.text
    good = {"type": "base64", "media_type": "image/png", "data": GOOD.split(",", 1)[1]}
    response = server.post("/v1/messages", message(good))
    assert response.status_code == 400 and "does not take image input" in response.text
    response = server.post("/v1/messages/count_tokens", message(good) | {"max_tokens": None})
    assert response.status_code == 400 and "does not take image input" in response.text


@pytest.mark.e2e
def test_responses_input_images_are_checked_and_named(server) -> None:
    def request(part: dict) -> dict:
        content = [{"type": "input_text", "text": "see"}, part]
        return {
            "model": "tiny",
            "max_output_tokens": 4,
            "input": [{"role": "user", "content": content}],
        }

    for part, says in [
        (
            {"type": "input_image", "image_url": data_url(b"nope")},
            "input[0].content[1]: the data is not an image",
        ),
        ({"type": "input_image", "file_id": "file-1"}, "zllm keeps no uploaded files"),
    ]:
        response = server.post("/v1/responses", request(part))
        assert response.status_code == 400, response.text
        assert says in response.json()["error"]["message"], response.text
    response = server.post("/v1/responses", request({"type": "input_image", "image_url": GOOD}))
    assert response.status_code == 400 and "does not take image input" in response.text
    assert server.healthy()
