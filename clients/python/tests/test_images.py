"""Images through the Python client (Session.image, Client.put_media,
Client.gc_media) on the derived vision test model: the default model with
idefics3's wrapper tokens and a random projector (its answers are noise; the
tests check the mechanics)."""

import base64
import hashlib
import os
import struct
import zlib

import anthropic
import ollama
import openai
import pytest
from compat import KEY, ant, oai

from superfluid_client import SuperfluidError
from superfluid_client.daemon import derived_model

MODEL = "SmolLM2-135M-vision.gguf"
EXTRA_ARGS = ["--mmproj", derived_model("mmproj-SmolLM2-135M-vision.gguf"), "--api-key", KEY]


def png(w, h, rgb):
    """A w x h PNG of one colour."""

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = b"".join(b"\x00" + bytes(rgb) * w for _ in range(h))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def test_an_image_from_bytes_a_file_or_a_hash_then_a_reply(sf, tmp_path):
    data = png(40, 30, (10, 200, 30))
    blob = sf.put_media(data)
    assert blob == hashlib.sha256(data).hexdigest()
    s = sf.session()
    e = s.image(data, pre_text="Look:", post_text="What is it?")
    assert e.kind == "Image"
    assert e.data["blob"] == blob and e.data["image_len"] == 14
    path = tmp_path / "pic.png"
    path.write_bytes(png(20, 20, (255, 0, 0)))
    s.image(str(path), post_text="And this one?")
    s.image(blob, post_text="The first again.")
    reply = s.generate(max_tokens=8)
    assert reply.finish in (1, 2) and reply.tokens > 0
    assert reply.warm_prefix == 0, "a session with images never uses the cache"
    assert [m.role for m in s.messages()][:3] == ["user", "user", "user"]
    kept, removed = sf.gc_media()
    assert removed == 0 and kept >= 2


def test_not_an_image_is_refused_before_it_is_sent(sf):
    try:
        sf.session().image(b"plain text, not an image")
    except SuperfluidError as e:
        assert "not a PNG" in str(e)
    else:
        raise AssertionError("bytes that are not an image were taken")


def data_uri(data):
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_chat(client, data, seed=3):
    return client.chat.completions.create(
        model="SmolLM2-135M-vision",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": data_uri(data)}},
                ],
            }
        ],
        max_tokens=8,
        temperature=0,
        seed=seed,
    )


def test_openai_chat_takes_a_data_uri_image_and_never_caches_it(daemon):
    client = oai(daemon)
    black, white = png(40, 40, (0, 0, 0)), png(40, 40, (255, 255, 255))
    a = image_chat(client, black)
    assert a.choices[0].message.content is not None
    assert a.usage.prompt_tokens > 14, "the image's 14 positions are on the prompt"
    # Requests with images never use the cache: the same request again
    # prefills it all.
    b = image_chat(client, black)
    details = b.usage.prompt_tokens_details
    assert details is None or not details.cached_tokens
    assert b.choices[0].message.content == a.choices[0].message.content
    # The image is on the input: a white one draws another reply.
    c = image_chat(client, white)
    assert c.choices[0].message.content != a.choices[0].message.content
    # The image went through the media store like PutMedia.
    media = os.path.join(daemon.sessions, "media", hashlib.sha256(black).hexdigest())
    assert os.path.exists(media)


def test_openai_chat_refuses_image_urls_and_bad_images_with_400(daemon):
    client = oai(daemon)
    for url, needle in [
        ("https://example.com/cat.png", "no outbound requests"),
        ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "not an image"),
        ("data:text/plain;base64,aGk=", "mime"),
        ("ftp://x/y.png", "data: URI"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="SmolLM2-135M-vision",
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
                max_tokens=4,
            )
        assert needle in str(e.value), (url, str(e.value))


def test_anthropic_image_blocks_and_url_sources(daemon):
    client = ant(daemon)

    def ask(data):
        return client.messages.create(
            model="SmolLM2-135M-vision",
            max_tokens=8,
            extra_body={"temperature": 0},
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
                        {"type": "text", "text": "What is in this picture?"},
                    ],
                }
            ],
        )

    black = base64.b64encode(png(30, 30, (0, 0, 0))).decode()
    white = base64.b64encode(png(30, 30, (255, 255, 255))).decode()
    a, b, c = ask(black), ask(black), ask(white)
    assert a.usage.input_tokens > 14
    assert not b.usage.cache_read_input_tokens
    assert a.content[0].text == b.content[0].text != c.content[0].text
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model="SmolLM2-135M-vision",
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}],
                }
            ],
        )
    assert "no outbound requests" in str(e.value)


def test_ollama_chat_images(daemon):
    client = ollama.Client(host=daemon.url, headers={"Authorization": "Bearer " + KEY})

    def ask(data):
        return client.chat(
            model="SmolLM2-135M-vision",
            messages=[{"role": "user", "content": "What is in this picture?", "images": [data]}],
            options={"num_predict": 8, "temperature": 0, "seed": 1},
        )

    a = ask(png(30, 30, (0, 0, 0)))
    b = ask(png(30, 30, (255, 255, 255)))
    assert a.message.content != b.message.content
    assert a.prompt_eval_count > 14
    with pytest.raises(ollama.ResponseError) as e:
        ask(b"this is not an image")
    assert "not a PNG" in str(e.value)


def test_a_request_over_the_message_cap_stores_none_of_its_images(daemon):
    """The message cap is checked before any image is stored or laid out."""
    media = os.path.join(daemon.sessions, "media")
    before = set(os.listdir(media)) if os.path.isdir(media) else set()
    pixels = [png(12, 12, (i, 255 - i, 7)) for i in range(3)]
    uri = "data:image/png;base64,"
    filler = [{"role": r, "content": "x"} for _ in range(256) for r in ("user", "assistant")]
    with pytest.raises(openai.BadRequestError) as e:
        oai(daemon).chat.completions.create(model="default", max_tokens=4, messages=filler + [
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}] + [
                {"type": "image_url", "image_url": {"url": uri + base64.b64encode(p).decode()}}
                for p in pixels]}])
    assert "512" in str(e.value) and e.value.param == "messages"
    with pytest.raises(anthropic.BadRequestError) as e:
        ant(daemon).messages.create(model="default", max_tokens=4, messages=filler + [
            {"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(p).decode()}} for p in pixels]}])
    assert "512" in str(e.value)
    client = ollama.Client(host=daemon.url, headers={"Authorization": "Bearer " + KEY})
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="SmolLM2-135M-vision", messages=filler + [
            {"role": "user", "content": "what is this?", "images": pixels}])
    assert "512" in str(e.value)
    after = set(os.listdir(media)) if os.path.isdir(media) else set()
    assert after == before, "a refused request stored images"
