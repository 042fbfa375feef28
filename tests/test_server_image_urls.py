"""Where `mlx_dllm serve` takes images from (issue #27 §2), over real HTTP on loopback: image
URLs only as data URLs unless --allowed-image-dir / --allow-remote-images allow files under that
folder / public URLs (fetched from the address checked, no redirect followed), with one message
for every refused image."""

import base64
import http.server
import io
import json
import threading
import time

import pytest
from PIL import Image

from fixtures import diffusion_gemma as dgfx
from mlx_dllm_models.server import images as images_module
from mlx_dllm_models.server import shutdown
from mlx_dllm_models.server.images import REFUSED, ImagePolicy, public_address
from server_checks import call, gemma_checkpoint, start

gemma_path = gemma_checkpoint()


# -------------------------------------------------------------------------------------- images


def png_bytes(seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    pixels = (rng.random((dgfx.IMAGE_SIZE, dgfx.IMAGE_SIZE, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


class Recorder(http.server.BaseHTTPRequestHandler):
    """A local web server that serves one PNG (or a redirect) and records every request: what a
    refused URL must never reach."""

    hits: list = []
    body = b""

    def do_GET(self):
        type(self).hits.append((self.path, self.headers.get("Host")))
        if self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1:1/x.png")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(type(self).body)))
        self.end_headers()
        self.wfile.write(type(self).body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def web():
    Recorder.body = png_bytes(7)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def gemma_default(gemma_path):
    server, url = start(gemma_path)
    yield url
    shutdown(server)


def ask_image(url, image, timeout=120):
    content = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": image}}]
    body = {"messages": [{"role": "user", "content": content}], "seed": 0}
    body.update(max_tokens=dgfx.CANVAS_LENGTH, max_denoising_steps=2)
    status, _, text = call(url, "/v1/chat/completions", body, timeout=timeout)
    return status, json.loads(text)


def test_image_urls_are_data_urls_only_by_default(gemma_default, web, tmp_path):
    url = gemma_default
    Recorder.hits.clear()
    picture = tmp_path / "cat.png"
    picture.write_bytes(png_bytes(1))
    refused = [
        "/etc/passwd",  # exists
        "/etc/shadow",  # exists, unreadable
        "/no/such/file.png",  # does not: the same answer
        str(picture),  # a real image
        f"file://{picture}",
        f"http://127.0.0.1:{web}/cat.png",
        "https://example.com/cat.png",
    ]
    for image in refused:
        status, answer = ask_image(url, image)
        assert status == 400 and answer["error"]["message"] == REFUSED, image
    assert Recorder.hits == []  # nothing was fetched
    status, answer = ask_image(url, data_url(png_bytes(1)))
    assert status == 200 and answer["choices"][0]["message"]["content"]


def test_allowed_image_dir_reads_files_under_it_only(gemma_path, tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "cat.png").write_bytes(png_bytes(1))
    (outside / "dog.png").write_bytes(png_bytes(2))
    (allowed / "link.png").symlink_to(outside / "dog.png")  # a link out of the folder
    server, url = start(gemma_path, image_policy=ImagePolicy(allowed_dir=allowed))
    try:
        status, by_file = ask_image(url, str(allowed / "cat.png"))
        assert status == 200
        status, by_data = ask_image(url, data_url(png_bytes(1)))
        assert by_file["choices"][0]["message"] == by_data["choices"][0]["message"]
        for image in [
            str(outside / "dog.png"),
            str(allowed / ".." / "outside" / "dog.png"),
            str(allowed / "link.png"),
            str(allowed / "missing.png"),
            "/etc/passwd",
            "http://127.0.0.1:1/cat.png",  # remote images stay off
        ]:
            status, answer = ask_image(url, image)
            assert status == 400 and answer["error"]["message"] == REFUSED, image
    finally:
        shutdown(server)


@pytest.mark.parametrize(
    "address, public",
    [
        ("8.8.8.8", True),
        ("2606:4700:4700::1111", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),  # cloud metadata
        ("100.64.0.1", False),  # carrier-grade NAT
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("::1", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("::ffff:127.0.0.1", False),
        ("::ffff:192.168.0.1", False),
    ],
)
def test_public_addresses(address, public):
    assert public_address(address) == public


def test_remote_images_refuse_loopback_and_private_hosts(gemma_path, web, monkeypatch):
    server, url = start(gemma_path, image_policy=ImagePolicy(allow_remote=True))
    try:
        Recorder.hits.clear()
        for image in [
            f"http://127.0.0.1:{web}/cat.png",
            f"http://localhost:{web}/cat.png",  # refused after resolving the name
            f"http://[::ffff:127.0.0.1]:{web}/cat.png",
            f"http://2130706433:{web}/cat.png",  # 127.0.0.1 as one number
            "http://10.0.0.1/cat.png",
            "http://169.254.169.254/latest/meta-data",
            "http://0.0.0.0/cat.png",
            "ftp://example.com/cat.png",
        ]:
            started = time.perf_counter()
            status, answer = ask_image(url, image)
            assert status == 400 and answer["error"]["message"] == REFUSED, image
            assert time.perf_counter() - started < 10  # refused before any connection
        assert Recorder.hits == []
        # A host whose addresses pass the check is fetched from the address that was checked,
        # with the URL's host in the Host header; a redirect is not followed.
        monkeypatch.setattr(images_module, "public_address", lambda address: True)
        status, fetched = ask_image(url, f"http://localhost:{web}/cat.png")
        assert status == 200, fetched
        assert Recorder.hits == [("/cat.png", f"localhost:{web}")]
        status, by_data = ask_image(url, data_url(Recorder.body))
        assert fetched["choices"][0]["message"] == by_data["choices"][0]["message"]
        status, answer = ask_image(url, f"http://localhost:{web}/redirect")
        assert status == 400 and answer["error"]["message"] == REFUSED
    finally:
        shutdown(server)
