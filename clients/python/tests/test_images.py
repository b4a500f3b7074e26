"""Images through the Python client (Session.image, Client.put_media,
Client.gc_media) on the derived vision test model: the default model with
idefics3's wrapper tokens and a random projector (its answers are noise; the
tests check the mechanics)."""

import hashlib
import struct
import zlib

from superfluid_client import SuperfluidError
from superfluid_client.daemon import derived_model

MODEL = "SmolLM2-135M-vision.gguf"
EXTRA_ARGS = ["--mmproj", derived_model("mmproj-SmolLM2-135M-vision.gguf")]


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
