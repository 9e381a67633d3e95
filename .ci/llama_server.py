#!/usr/bin/env python3
"""Build llama.cpp's llama-server and write a random-weight llama GGUF, both cached.

CI and test plumbing for tests/real_server/ (a real llama.cpp server under the coordinator and
the client), not product code.

* llama-server: built on CPU from the source the PyPI sdist of llama-cpp-python vendors under
  vendor/llama.cpp (pip download; cmake, Release, the llama-server target only, -j2), with
  nothing that downloads at build time (no curl, no OpenSSL, no web UI). Cached under
  ~/.cache/fleetgate/llama-server-<version>-<hash of the cmake flags>/bin/llama-server; a second
  run finds it and does nothing.
* The model: a llama architecture with random 16-bit weights (~190 MB, so that a decode step
  is weight-bound and more slots mean more throughput), written with the `gguf` package and
  cached under ~/.cache/fleetgate/models/random-llama-<hash of its parameters>.gguf.

`make test-long` runs it first (the long tier holds tests/real_server/).
Where the server cannot be built (no cmake or C++ compiler, no route to PyPI) it says why and
exits 0, and those tests skip saying so -- unless FLEETGATE_REQUIRE_REAL_SERVER is set (CI,
.ci/run): then it fails, as do the tests, so CI cannot pass without them.

  python .ci/llama_server.py            # build what is missing (progress lines on stdout)
  python .ci/llama_server.py --paths    # print {"binary", "model", "ready"} as JSON, build nothing
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

VERSION = "0.3.36"
CACHE = Path(os.environ.get("FLEETGATE_CACHE", Path.home() / ".cache" / "fleetgate"))

# LLAMA_CURL is deprecated and ignored by this llama.cpp (it says so only when ON); OpenSSL and
# the web UI are the two options that would reach out (HTTPS; npm or the HF bucket for the UI
# assets). Static libraries, so the binary in the cache needs nothing next to it.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
)
JOBS = 2

# The model's shape: 8 layers of width 1024 and FFN 2560 = 96.5 M weights, 193 MB at f16.
MODEL = {
    "n_vocab": 512,
    "n_embd": 1024,
    "n_layer": 8,
    "n_head": 16,
    "n_ff": 2560,
    "n_ctx_train": 4096,
    "seed": 23,
    "std": 0.02,
}


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def build_dir() -> Path:
    return CACHE / f"llama-server-{VERSION}-{_digest([VERSION, *CMAKE_FLAGS])}"


def binary_path() -> Path:
    return build_dir() / "bin" / "llama-server"


def model_path() -> Path:
    return CACHE / "models" / f"random-llama-{_digest(MODEL)}.gguf"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One builder at a time per cache entry: a second run waits, then finds it cached."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another build holding {path}")
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def log(msg: str) -> None:
    print(f"llama-server: {msg}", flush=True)


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, cwd=cwd, check=True)


def build_server() -> Path:
    target = binary_path()
    if target.is_file() and os.access(target, os.X_OK):
        log(f"cached: {target}")
        return target
    root = build_dir()
    work = root / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.monotonic()
    log(f"downloading the sdist of llama-cpp-python=={VERSION} from PyPI")
    pip = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
    _run([*pip, "--no-cache-dir", "-q", "-d", str(work), f"llama-cpp-python=={VERSION}"])
    (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
    log(f"extracting {sdist.name}")
    with tarfile.open(sdist) as tar:
        tar.extractall(work, filter="data")
    source = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
    build = work / "build"
    log(f"configuring {source} ({' '.join(CMAKE_FLAGS)})")
    _run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS])
    log(f"compiling llama-server with -j{JOBS} (about 11 minutes on 2 cores)")
    # nice: other work on the machine (a test suite, an editor) keeps its share meanwhile
    compile_cmd = ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(JOBS)]
    _run(["nice", "-n", "10", *compile_cmd])
    built = build / "bin" / "llama-server"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, target.with_suffix(".tmp"))
    target.with_suffix(".tmp").rename(target)
    (root / "flags.json").write_text(json.dumps({"version": VERSION, "flags": CMAKE_FLAGS}))
    shutil.rmtree(work, ignore_errors=True)
    log(f"built {target} in {time.monotonic() - started:.0f} s")
    return target


def _vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary: <unk> <s> </s>, the 256 byte tokens (so any text
    tokenizes), then letters and letter pairs (with and without the word mark) to n_vocab."""
    from gguf import TokenType

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces = ["\u2581"] + [f"\u2581{c}" for c in letters] + letters
    pieces += [f"{a}{b}" for a in letters for b in letters]
    for piece in pieces[: n_vocab - len(tokens)]:
        tokens.append(piece)
        types.append(TokenType.NORMAL)
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    return tokens, scores, [int(t) for t in types]


def write_model() -> Path:
    """The random-weight llama GGUF (f16 matrices, f32 norms), written once per MODEL."""
    target = model_path()
    if target.is_file():
        log(f"model cached: {target}")
        return target
    import gguf
    import numpy as np

    m = MODEL
    started = time.monotonic()
    rng = np.random.default_rng(m["seed"])
    n_embd, n_ff = m["n_embd"], m["n_ff"]

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * m["std"]).astype(np.float16)

    def ones() -> np.ndarray:
        return np.ones(n_embd, dtype=np.float32)

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name("fleetgate random llama")
    writer.add_context_length(m["n_ctx_train"])
    writer.add_embedding_length(n_embd)
    writer.add_block_count(m["n_layer"])
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(m["n_head"])
    writer.add_head_count_kv(m["n_head"])
    writer.add_rope_dimension_count(n_embd // m["n_head"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tokens, scores, types = _vocab(m["n_vocab"])
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", matrix(m["n_vocab"], n_embd))
    for i in range(m["n_layer"]):
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", ones())
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{blk}.{name}.weight", matrix(n_embd, n_embd))
        writer.add_tensor(f"{blk}.ffn_norm.weight", ones())
        writer.add_tensor(f"{blk}.ffn_gate.weight", matrix(n_ff, n_embd))
        writer.add_tensor(f"{blk}.ffn_up.weight", matrix(n_ff, n_embd))
        writer.add_tensor(f"{blk}.ffn_down.weight", matrix(n_embd, n_ff))
    writer.add_tensor("output_norm.weight", ones())
    writer.add_tensor("output.weight", matrix(m["n_vocab"], n_embd))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(target)
    size = target.stat().st_size / 1e6
    log(f"wrote {target} ({size:.0f} MB) in {time.monotonic() - started:.1f} s")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--paths", action="store_true", help="print the paths as JSON, build nothing"
    )
    parser.add_argument(
        "--only", choices=("server", "model"), help="build only the server, or only the model"
    )
    args = parser.parse_args(argv)
    if args.paths:
        binary, model = binary_path(), model_path()
        ready = binary.is_file() and model.is_file()
        print(json.dumps({"binary": str(binary), "model": str(model), "ready": ready}))
        return 0
    if args.only != "server":
        with _locked(model_path().parent / ".lock"):
            write_model()
    if args.only != "model":
        missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
        if missing and not binary_path().is_file():
            return _cannot_build(f"{' and '.join(missing)} not found on PATH")
        try:
            with _locked(build_dir() / ".lock"):
                build_server()
        except (subprocess.CalledProcessError, OSError) as exc:
            return _cannot_build(str(exc))
    return 0


def _cannot_build(why: str) -> int:
    """Not built: fatal where the real-server tests are required, else a note (they skip)."""
    if os.environ.get("FLEETGATE_REQUIRE_REAL_SERVER"):
        log(f"cannot build llama-server: {why} (FLEETGATE_REQUIRE_REAL_SERVER is set)")
        return 1
    log(f"cannot build llama-server: {why}; tests/real_server/ will skip, saying so")
    return 0


if __name__ == "__main__":
    sys.exit(main())
