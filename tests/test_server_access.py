"""Who can reach `mlx_dllm serve` (issue #27 §2), over real HTTP on loopback: no cross-origin
access unless --cors-origin names the origin (preflight too); no request naming a host the server
does not serve (DNS rebinding) unless --allowed-host names it; flags out of range are one-line
errors, a non-loopback host a warning."""

import json

import pytest

from mlx_dllm_models.cli import main as cli_main
from mlx_dllm_models.server import shutdown
from mlx_dllm_models.server.guards import HostCheck
from mlx_dllm_models.server.process import check_args, loopback
from mlx_dllm_models.server.process import parser as serve_parser
from server_checks import CHAT, call, error_of, llada_served, start

llada_path, served = llada_served()


# ------------------------------------------------------------------------------ cross-origin


PAGE = "http://evil.example"


def test_cross_origin_requests_are_refused_by_default(served):
    _, url = served
    # curl and OpenAI's clients send no Origin: answered, with no CORS header.
    status, headers, _ = call(url, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
    assert status == 200 and headers.get("Access-Control-Allow-Origin") is None
    # A web page's request carries its Origin: refused before anything runs, and the answer
    # carries no header that would let the page read it.
    for method, path, body in [
        ("POST", "/v1/chat/completions", CHAT),
        ("GET", "/v1/models", None),
        ("OPTIONS", "/v1/chat/completions", None),  # the browser's preflight
    ]:
        status, headers, text = call(url, path, body, headers={"Origin": PAGE}, method=method)
        assert status == 403, (method, path)
        assert "--cors-origin" in error_of(text)
        assert headers.get("Access-Control-Allow-Origin") is None


def test_cors_origin_allows_the_origins_it_names(llada_path):
    app = "http://localhost:3000"
    server, url = start(llada_path, cors_origins=[app])
    try:
        preflight = {
            "Origin": app,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        }
        status, headers, _ = call(url, "/v1/chat/completions", headers=preflight, method="OPTIONS")
        assert status == 204 and headers["Access-Control-Allow-Origin"] == app
        assert headers["Vary"] == "Origin" and "POST" in headers["Access-Control-Allow-Methods"]
        status, headers, text = call(url, "/v1/chat/completions", CHAT, headers={"Origin": app})
        assert status == 200 and headers["Access-Control-Allow-Origin"] == app
        status, headers, _ = call(url, "/v1/chat/completions", CHAT, headers={"Origin": PAGE})
        assert status == 403 and headers.get("Access-Control-Allow-Origin") is None
    finally:
        shutdown(server)


# ------------------------------------------------------------------------- DNS rebinding


def test_a_request_naming_another_host_is_refused(served, capsys):
    """A page on evil.example that points its own name at 127.0.0.1 (DNS rebinding) makes the
    browser's requests same-origin, with no Origin header to refuse, but they name evil.example
    in their Host header: a 403 in OpenAI's error shape before anything runs."""
    server, url = served
    port = server.server_address[1]
    before = server.service.scheduler.blocks
    for method, path, body in [
        ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4}),
        ("GET", "/v1/models", None),
        ("GET", "/health", None),
        ("OPTIONS", "/v1/chat/completions", None),
    ]:
        for host in (f"evil.example:{port}", "evil.example", "localhost.evil.example", ""):
            status, _, text = call(url, path, body, headers={"Host": host}, method=method)
            assert status == 403, (method, path, host)
            error = json.loads(text)["error"]
            assert error["type"] == "invalid_request_error" and "--allowed-host" in error["message"]
    assert server.service.scheduler.blocks == before  # nothing decoded for them
    # This machine's loopback names, any port, in any case: answered.
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LocalHost", "[::1]"):
        status, _, _ = call(url, "/v1/models", headers={"Host": host})
        assert status == 200, host
    status, _, _ = call(url, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
    assert status == 200  # urllib's own Host (127.0.0.1:PORT)


def test_host_check_names():
    default = HostCheck("127.0.0.1")
    assert default.allows(None)  # no Host header: no browser sent it (HTTP/1.0)
    assert not default.allows("evil.example") and not default.allows("192.168.1.5:8080")
    named = HostCheck("127.0.0.1", ["my-box.lan", "10.0.0.7"])
    assert named.allows("MY-BOX.LAN.:8080") and named.allows("10.0.0.7:80")
    assert not named.allows("evil.example")
    assert HostCheck("127.0.0.1", ["*"]).allows("anything.example")
    # A non-loopback bind serves its own name or address; a wildcard bind any IP address (a page
    # served from an address is that address's: there is no name to point elsewhere).
    assert HostCheck("my-box.lan").allows("my-box.lan:8080")
    assert HostCheck("192.168.1.5").allows("192.168.1.5:8080")
    assert not HostCheck("192.168.1.5").allows("evil.example")
    wild = HostCheck("0.0.0.0")
    assert wild.allows("192.168.1.5:8080") and wild.allows("[fe80::1]:8080")
    assert not wild.allows("evil.example:8080")


def test_allowed_host_adds_names(llada_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--help"])
    assert e.value.code == 0
    assert "--allowed-host NAME" in capsys.readouterr().out
    args = serve_parser().parse_args(
        ["--allowed-host", "proxy.lan,10.0.0.7", "--allowed-host", "x"]
    )
    check_args(args)
    assert args.allowed_hosts == ["proxy.lan", "10.0.0.7", "x"]
    server, url = start(llada_path, allowed_hosts=args.allowed_hosts)
    try:
        port = server.server_address[1]
        for host in (f"proxy.lan:{port}", "10.0.0.7", "localhost"):
            status, _, _ = call(url, "/v1/chat/completions", CHAT, headers={"Host": host})
            assert status == 200, host
        status, _, text = call(url, "/v1/chat/completions", CHAT, headers={"Host": "evil.example"})
        assert status == 403 and "--allowed-host" in error_of(text)
    finally:
        shutdown(server)


# --------------------------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--decode-concurrency", "0"], "--decode-concurrency must be at least 1"),
        (["--decode-concurrency", "-3"], "--decode-concurrency must be at least 1"),
        (["--port", "99999"], "--port must be from 0 to 65535"),
        (["--port", "-1"], "--port must be from 0 to 65535"),
        (["--prompt-cache-size", "-1"], "--prompt-cache-size must be 0"),
        (["--prompt-cache-bytes", "0"], "--prompt-cache-bytes must be more than 0"),
        (["--max-body-bytes", "10"], "--max-body-bytes must be at least 1024"),
        (["--allowed-image-dir", "/no/such/folder"], "is not a folder"),
        (["--allowed-host", "http://proxy.lan/"], "--allowed-host takes a host name or address"),
    ],
)
def test_flags_out_of_range_are_one_line_errors(flags, message, monkeypatch):
    monkeypatch.setattr("mlx_dllm_models.server.process.make_server", None)  # never reached
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", *flags])
    text = str(e.value.code)
    assert text.startswith("error: ") and message in text and "\n" not in text


def test_loopback_hosts():
    assert loopback("127.0.0.1") and loopback("localhost") and loopback("::1")
    assert not loopback("0.0.0.0") and not loopback("::")
